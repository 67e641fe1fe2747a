"""The Helm chart: rendered by Helm's own Go SDK, checked by `helm lint`, validated against the
Kubernetes JSON schemas (kubernetes-validate) and, for the KEDA and Prometheus Operator
resources, against their CRDs' schemas; values.schema.json must reject bad values."""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any, Literal, get_args, get_origin

import pytest

from app.settings import Settings
from tests.helpers.deploy import (
    BAKED_CACHE,
    CHART,
    CRD_VALIDATOR,
    GPU_EXAMPLE,
    OLDEST_KUBERNETES,
    WRITABLE_CACHE,
    by_kind,
    helm_sdk,
    load_yaml,
    notes,
    render,
    seed_command,
    tool,
)

KEDA_ON = {"autoscaling": {"enabled": True, "maxReplicas": 6, "keda": {"enabled": True}}}
KEDA_OFF = {"autoscaling": {"enabled": True, "maxReplicas": 6, "keda": {"enabled": False}}}
EVERYTHING = {  # every optional part on at once
    "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "tls", "hosts": ["ngrammys.example.com"]}],
                "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "apiKey": {"existingSecret": "ngrammys-api-keys"},
    "model": {"source": "pvc", "path": "qwen", "pvc": {"claimName": "models", "subPath": "hf"}},
    "cache": {"persistence": {"enabled": True, "accessModes": ["ReadWriteMany"]}},
    "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "2"}],
    **KEDA_ON,
}
CASES = {
    "default": {},
    "gpu-example": load_yaml(GPU_EXAMPLE),
    "keda-on": KEDA_ON,
    "keda-off-cpu-hpa": KEDA_OFF,
    "everything": EVERYTHING,
    "init-container-model": {"model": {"source": "initContainer", "path": "model.gguf",
                                       "initContainer": {"image": "registry.example.com/models/smol:1"}}},
}
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {case: render(values) for case, values in CASES.items()}


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs)["Deployment"]
    return deployment


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


def _config(docs: list[dict[str, Any]]) -> dict[str, str]:
    (config,) = by_kind(docs)["ConfigMap"]
    return config["data"]


@pytest.mark.parametrize("case", CASES)
def test_manifests_validate_against_the_kubernetes_schemas(rendered: dict, case: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`")
    docs = [doc for doc in rendered[case] if doc["kind"] not in CUSTOM_KINDS]
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= {doc["kind"] for doc in docs}
    for version in (OLDEST_KUBERNETES, kv.latest_version()):
        for doc in docs:
            kv.validate(doc, version, strict=True)  # raises on any unknown field or wrong type


def test_the_kubernetes_schema_check_can_fail(rendered: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`")
    deployment = copy.deepcopy(_deployment(rendered["default"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 10  # a typo
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, OLDEST_KUBERNETES, strict=True)


def test_custom_resources_validate_against_their_crd_schemas(rendered: dict) -> None:
    node = tool("node", "Node.js: apt-get install nodejs")
    if not (CRD_VALIDATOR / "node_modules").is_dir():
        pytest.skip("the CRD schemas are not installed (`make deploy-tools` runs npm ci in tests/deploy/crd); "
                    "ScaledObject and ServiceMonitor were not validated")
    resources = [doc for docs in rendered.values() for doc in docs if doc["kind"] in CUSTOM_KINDS]
    assert {doc["kind"] for doc in resources} == CUSTOM_KINDS
    broken = copy.deepcopy(next(doc for doc in resources if doc["kind"] == "ScaledObject"))
    broken["spec"]["minReplicaCount"] = "one"
    run = subprocess.run([node, "validate.mjs"], cwd=CRD_VALIDATOR, input=json.dumps(resources + [broken]),
                         capture_output=True, text=True, timeout=60)
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(resources) + 1, run.stderr
    assert [r for r in results[:-1] if r["error"]] == []
    assert "minReplicaCount" in results[-1]["error"]  # the validator does reject


@pytest.mark.parametrize("case", ["default", "gpu-example", "everything"])
def test_helm_lint_strict_finds_nothing(case: str) -> None:
    helm = helm_sdk()
    report = helm.lint(CHART, CASES[case], strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings and errors


def test_default_pod_is_locked_down_and_probed(rendered: dict) -> None:
    docs = rendered["default"]
    pod = _deployment(docs)["spec"]["template"]["spec"]
    container = _container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a slow CPU model load fits
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    values = helm_sdk().Chart.load(CHART).values
    server = values["server"]
    assert pod["terminationGracePeriodSeconds"] == server["preStopSleepSeconds"] + server["drainTimeoutSeconds"] + 10
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(server["preStopSleepSeconds"])]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "cpu" not in container["resources"]["limits"]  # requested, never throttled


def test_the_cache_is_writable_and_seeded_from_the_image(rendered: dict) -> None:
    docs = rendered["default"]
    pod = _deployment(docs)["spec"]["template"]["spec"]
    config = _config(docs)
    assert config["NGRAMMYS_CACHE_DIR"] == WRITABLE_CACHE
    (seed,) = pod["initContainers"]
    assert seed["command"] == seed_command(BAKED_CACHE, WRITABLE_CACHE)  # what the image test runs
    assert seed["image"] == _container(docs)["image"]
    mounts = {m["mountPath"]: m["name"] for m in _container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[WRITABLE_CACHE]] and "emptyDir" in volumes[mounts["/tmp"]]
    assert "NGRAMMYS_MODEL" not in config  # the embedded model baked into the image


def test_settings_become_ngrammys_variables_and_a_change_rolls_the_pods() -> None:
    base = render()
    changed = render({"settings": {"spec_k": 4, "cost_profile": False}})
    config = _config(changed)
    assert config["NGRAMMYS_SPEC_K"] == "4" and config["NGRAMMYS_COST_PROFILE"] == "false"
    assert config["NGRAMMYS_SPEC_MODE"] == "auto"  # defaults kept beside the override
    annotation = "checksum/config"
    assert (_deployment(base)["spec"]["template"]["metadata"]["annotations"][annotation]
            != _deployment(changed)["spec"]["template"]["metadata"]["annotations"][annotation])


def test_scrape_annotations_and_service_monitor(rendered: dict) -> None:
    annotations = _deployment(rendered["default"])["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(_container(rendered["default"])["ports"][0]["containerPort"])
    assert "ServiceMonitor" not in by_kind(rendered["default"])
    (monitor,) = by_kind(rendered["everything"])["ServiceMonitor"]
    (service,) = by_kind(rendered["everything"])["Service"]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_keda_scales_on_queue_depth_and_the_cpu_hpa_is_the_fallback(rendered: dict) -> None:
    keda = by_kind(rendered["keda-on"])
    (scaled,) = keda["ScaledObject"]
    assert "HorizontalPodAutoscaler" not in keda  # KEDA makes its own
    assert "replicas" not in _deployment(rendered["keda-on"])["spec"]
    prometheus, cpu = scaled["spec"]["triggers"]
    assert prometheus["type"] == "prometheus" and prometheus["metricType"] == "AverageValue"
    query = prometheus["metadata"]["query"]
    assert "ngrammys_num_requests_waiting" in query and 'namespace="llm"' in query and "demo-ngrammys-" in query
    assert cpu["type"] == "cpu"
    assert scaled["spec"]["scaleTargetRef"]["name"] == _deployment(rendered["keda-on"])["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 6)

    cpu_only = by_kind(rendered["keda-off-cpu-hpa"])
    assert "ScaledObject" not in cpu_only
    (hpa,) = cpu_only["HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in _deployment(rendered["keda-off-cpu-hpa"])["spec"]

    plain = by_kind(rendered["default"])
    assert "ScaledObject" not in plain and "HorizontalPodAutoscaler" not in plain
    assert _deployment(rendered["default"])["spec"]["replicas"] == 1


def test_the_keda_query_is_valid_promql(rendered: dict, tmp_path) -> None:
    promtool = tool("promtool", "Debian's prometheus package: `make test-tools`")
    queries = [t["metadata"]["query"] for doc in by_kind(rendered["keda-on"])["ScaledObject"]
               for t in doc["spec"]["triggers"] if t["type"] == "prometheus"]
    rules = {"groups": [{"name": "keda", "rules": [{"record": f"keda:query{i}", "expr": q} for i, q in enumerate(queries)]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))
    (tmp_path / "bad.yml").write_text(json.dumps({"groups": [{"name": "b", "rules": [{"record": "b", "expr": "sum("}]}]}))
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert subprocess.run([promtool, "check", "rules", str(tmp_path / "bad.yml")], capture_output=True).returncode != 0


def test_gpu_example_requests_a_gpu_on_gpu_nodes(rendered: dict) -> None:
    docs = rendered["gpu-example"]
    pod = _deployment(docs)["spec"]["template"]["spec"]
    container = _container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] and pod["runtimeClassName"] == "nvidia"
    assert _config(docs)["NGRAMMYS_DEVICE"] == "cuda"
    assert "ScaledObject" in by_kind(docs) and "PersistentVolumeClaim" in by_kind(docs)


def test_api_key_secret_is_mounted_and_named_by_env(rendered: dict) -> None:
    docs = rendered["everything"]
    pod = _deployment(docs)["spec"]["template"]["spec"]
    (secret,) = [v for v in pod["volumes"] if "secret" in v]
    assert secret["secret"]["secretName"] == "ngrammys-api-keys"
    (mount,) = [m for m in _container(docs)["volumeMounts"] if m["name"] == secret["name"]]
    assert mount["readOnly"] is True
    key = secret["secret"]["items"][0]["path"]
    assert _config(docs)["NGRAMMYS_API_KEY_FILE"] == f"{mount['mountPath']}/{key}"
    assert "NGRAMMYS_API_KEY_FILE" not in _config(rendered["default"])
    assert "ngrammys-api-keys" in notes(EVERYTHING)


def test_model_from_a_claim_or_an_init_container(rendered: dict) -> None:
    claim = rendered["everything"]
    assert _config(claim)["NGRAMMYS_MODEL"] == "/models/qwen"
    pod = _deployment(claim)["spec"]["template"]["spec"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mount = next(m for m in _container(claim)["volumeMounts"] if m["name"] == "models")
    assert mount["subPath"] == "hf" and mount["readOnly"] is True

    fetched = rendered["init-container-model"]
    assert _config(fetched)["NGRAMMYS_MODEL"] == "/models/model.gguf"
    init = _deployment(fetched)["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["seed-cache", "fetch-model"]
    assert init[1]["image"] == "registry.example.com/models/smol:1"


BAD_VALUES = {
    "negative replicas": {"replicaCount": -1},
    "unknown top-level key": {"replicas": 2},
    "typo in a nested key": {"server": {"drainTimeout": 30}},
    "pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "setting the chart owns": {"settings": {"port": 9000}},
    "setting name not snake_case": {"settings": {"Spec-Mode": "auto"}},
    "speculation mode": {"settings": {"spec_mode": "fast"}},
    "speculation width": {"settings": {"spec_w": 100}},
    "quantization": {"settings": {"quantization": "int4"}},
    "setting given a list": {"settings": {"log_level": ["info"]}},
    "pvc model without a claim": {"model": {"source": "pvc"}},
    "init-container model without an image": {"model": {"source": "initContainer"}},
    "unknown model source": {"model": {"source": "s3"}},
    "model path escaping /models": {"model": {"source": "pvc", "path": "../etc", "pvc": {"claimName": "m"}}},
    "zero GPUs": {"gpu": {"enabled": True, "count": 0}},
    "cache not absolute": {"cache": {"mountPath": "cache"}},
    "service port": {"service": {"port": 70000}},
    "ingress path": {"ingress": {"enabled": True, "hosts": [{"host": "a", "paths": [{"path": "x", "pathType": "Prefix"}]}]}},
    "keda threshold zero": {"autoscaling": {"keda": {"threshold": "0"}}},
    "keda server address": {"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}},
    "cpu target over 100": {"autoscaling": {"cpu": {"targetUtilizationPercentage": 150}}},
    "probe without threshold": {"probes": {"startup": {"failureThreshold": None}}},
    "scrape interval": {"metrics": {"serviceMonitor": {"interval": "often"}}},
}


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    helm = helm_sdk()
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError, match="schema|at '"):
            chart.render(bad, name="demo", namespace="llm")  # what `helm install` does with them
        merged = chart.merge_values(bad)
    jsonschema = pytest.importorskip("jsonschema")  # a second, independent implementation agrees
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(merged)), "jsonschema accepted it"


def test_the_schemas_choices_are_the_servers() -> None:
    """A setting the server takes from a fixed list is checked against that same list: the
    chart's list of draft strategies had fallen behind the server's by eight."""
    settings = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"]["properties"]
    listed = {name: spec["enum"] for name, spec in settings.items() if "enum" in spec}
    literal = {name: list(get_args(field.annotation)) for name, field in Settings.model_fields.items()
               if get_origin(field.annotation) is Literal}
    assert literal and set(literal) <= set(listed)
    assert {name: listed[name] for name in literal} == literal


@pytest.mark.parametrize("case", CASES)
def test_values_schema_accepts_the_shipped_values(case: str) -> None:
    helm = helm_sdk()
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(CASES[case])
        jsonschema.Draft7Validator(schema).validate(chart.merge_values(CASES[case]))


@pytest.mark.parametrize("values, message", [
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "maxReplicas"),
    ({"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}, "requests.cpu"),
    ({"cache": {"mountPath": "/opt/ngrammys/cache/"}}, "hide the baked cache"),
])
def test_checks_the_schema_cannot_express(values: dict[str, Any], message: str) -> None:
    helm = helm_sdk()
    with pytest.raises(helm.HelmError, match=message):
        render(values)
