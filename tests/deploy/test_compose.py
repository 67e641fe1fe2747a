"""deploy/compose.yaml against the compose specification's schema; the Prometheus configs by
promtool; Grafana's provisioning files pointing at the dashboard and data source that exist."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path, PurePosixPath

from tests.helpers.deploy import DEPLOY, load_yaml, tool

COMPOSE = DEPLOY / "compose.yaml"


def _check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    checker = tool("check-jsonschema", "pip install check-jsonschema: `make deploy-tools`")
    return subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_validates_against_the_compose_spec(tmp_path: Path) -> None:
    run = _check_compose(COMPOSE)
    assert run.returncode == 0, run.stdout + run.stderr
    broken = load_yaml(COMPOSE)
    broken["services"]["ngrammys"]["ports"] = {"http": 8000}  # not a list: the schema must say so
    (tmp_path / "compose.yaml").write_text(json.dumps(broken))
    assert _check_compose(tmp_path / "compose.yaml").returncode != 0


def _mounts(service: dict) -> dict[PurePosixPath, Path]:
    """Container path -> host path of a service's bind mounts (host paths relative to deploy/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[PurePosixPath(target)] = (DEPLOY / source).resolve()
    return mounts


def _host_path(mounts: dict[PurePosixPath, Path], container_path: str) -> Path | None:
    """Where `container_path` is on the host, through the bind mount that covers it."""
    path = PurePosixPath(container_path)
    for target, source in sorted(mounts.items(), key=lambda item: -len(item[0].parts)):
        if path == target or target in path.parents:
            return source.joinpath(*path.relative_to(target).parts)
    return None


def test_grafana_provisions_the_dashboard_that_exists_and_the_compose_prometheus() -> None:
    compose = load_yaml(COMPOSE)
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    for host in mounts.values():
        assert host.exists(), host

    datasource_dir = _host_path(mounts, "/etc/grafana/provisioning/datasources")
    dashboards_dir = _host_path(mounts, "/etc/grafana/provisioning/dashboards")
    assert datasource_dir and dashboards_dir
    (source,) = [
        s for f in sorted(datasource_dir.glob("*.y*ml")) for s in load_yaml(f)["datasources"]
    ]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    host, port = re.fullmatch(r"http://([^:/]+):(\d+)/?", source["url"]).groups()
    assert host in compose["services"]  # the compose Prometheus, by service name
    command = compose["services"][host].get("command", [])
    assert port == "9090" and not [
        a for a in command if "--web.listen-address" in a
    ]  # its default port

    providers = [
        p for f in sorted(dashboards_dir.glob("*.y*ml")) for p in load_yaml(f)["providers"]
    ]
    dashboards = []
    for provider in providers:
        folder = provider["options"]["path"]
        files = [
            (target, host)
            for target, host in mounts.items()
            if PurePosixPath(folder) in target.parents and target.suffix == ".json"
        ]
        dashboards += [host for _, host in files]
        whole = _host_path(mounts, folder)
        if whole and whole.is_dir():
            dashboards += sorted(whole.glob("*.json"))
    assert (DEPLOY / "grafana" / "ngrammys.json").resolve() in dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path(mounts, home) == (DEPLOY / "grafana" / "ngrammys.json").resolve()
    dashboard = json.loads((DEPLOY / "grafana" / "ngrammys.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == source["type"]  # the dashboard's data source variable finds it


def test_compose_prometheus_scrapes_the_compose_server() -> None:
    compose = load_yaml(COMPOSE)
    prometheus = compose["services"]["prometheus"]
    config_path = _host_path(_mounts(prometheus), "/etc/prometheus/prometheus.yml")
    assert config_path and config_path == (DEPLOY / "prometheus" / "prometheus.yml").resolve()
    targets = [
        t
        for job in load_yaml(config_path)["scrape_configs"]
        for s in job["static_configs"]
        for t in s["targets"]
    ]
    server = compose["services"]["ngrammys"]
    published = {p.split(":")[-1] for p in server["ports"]}
    assert [t for t in targets if t.split(":")[0] == "ngrammys" and t.split(":")[1] in published]


def test_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    promtool = tool("promtool", "Debian's prometheus package: `make test-tools`")
    compose_config = DEPLOY / "prometheus" / "prometheus.yml"
    run = subprocess.run(
        [promtool, "check", "config", str(compose_config)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # Debian's Prometheus is built without Kubernetes service discovery: check the pod job's
    # relabelling with a static target in place of kubernetes_sd_configs.
    kubernetes = load_yaml(DEPLOY / "prometheus" / "kubernetes.yml")
    for job in kubernetes["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["ngrammys:8000"]}]
    (tmp_path / "kubernetes.yml").write_text(json.dumps(kubernetes))
    run = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "kubernetes.yml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    labels = {
        rule.get("target_label")
        for job in kubernetes["scrape_configs"]
        for rule in job["relabel_configs"]
    }
    assert {"namespace", "pod"} <= labels  # what the chart's KEDA query selects on
