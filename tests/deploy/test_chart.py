"""The Helm chart: rendered by Helm's own Go SDK, checked by `helm lint`, validated against the
Kubernetes JSON schemas (kubernetes-validate) and, for the KEDA, Prometheus Operator and Gateway
API resources, against their CRDs' schemas; values.schema.json must reject bad values. The
LeaderWorkerSet and the InferencePool, whose CRD schemas no package carries, get their pod
templates checked against the Kubernetes schemas and the rest by hand. deploy/inference-gateway.yaml
(the Endpoint Picker and the HTTPRoute) is validated the same way and must fit the chart's pool."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from app.settings import Settings
from tests.helpers.deploy import (
    BAKED_CACHE,
    CHART,
    CRD_VALIDATOR,
    DEPLOY,
    GPU_EXAMPLE,
    OLDEST_KUBERNETES,
    ROOT,
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
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "tls": [{"secretName": "tls", "hosts": ["ngrammys.example.com"]}],
        "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
    },
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}
    },
    "apiKey": {"existingSecret": "ngrammys-api-keys"},
    "model": {"source": "pvc", "path": "qwen", "pvc": {"claimName": "models", "subPath": "hf"}},
    "cache": {"persistence": {"enabled": True, "accessModes": ["ReadWriteMany"]}},
    "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "2"}],
    **KEDA_ON,
}
EXAMPLES = CHART / "examples"
GATEWAY_MANIFESTS = DEPLOY / "inference-gateway.yaml"


def over(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of two values files (`-f base -f override`): maps merge, the rest is
    replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = over(merged[key], value) if both_maps else copy.deepcopy(value)
    return merged


def on_gpu(example: str) -> dict[str, Any]:
    return over(load_yaml(GPU_EXAMPLE), load_yaml(EXAMPLES / example))


CASES = {
    "default": {},
    "gpu-example": load_yaml(GPU_EXAMPLE),
    "keda-on": KEDA_ON,
    "keda-off-cpu-hpa": KEDA_OFF,
    "everything": EVERYTHING,
    "init-container-model": {
        "model": {
            "source": "initContainer",
            "path": "model.gguf",
            "initContainer": {"image": "registry.example.com/models/smol:1"},
        }
    },
    "tensor-parallel-example": on_gpu("tensor-parallel.yaml"),  # 4 GPUs, KEDA
    "multi-node-example": on_gpu("multi-node.yaml"),  # LeaderWorkerSet of 2 x 8 GPUs, KEDA
    "lws-cpu-hpa": {
        "gpu": {"enabled": True},
        "tensorParallelSize": 2,
        "leaderWorkerSet": {"enabled": True, "size": 3},
        "apiKey": {"existingSecret": "ngrammys-api-keys"},
        "inferencePool": {"enabled": True},
        **KEDA_OFF,
    },
    "inference-gateway-example": on_gpu("inference-gateway.yaml"),
    # beside the cache's claim: two claims from one template
    "batch-store": {
        "batchStore": {"enabled": True, "storageClassName": "fast-ssd"},
        "cache": {"persistence": {"enabled": True}},
    },
    # PostgreSQL: the replicas share it, so autoscaling is allowed
    "batch-store-postgres": {
        "batchStore": {"enabled": True, "url": {"secretName": "ngrammys-batch-store"}},
        **KEDA_OFF,
    },
}
# validated against their CRDs' schemas
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor", "HTTPRoute"}
# No npm or PyPI package carries these CRDs' schemas: their pod templates are validated against the
# Kubernetes schemas, the rest checked by hand (_check_unpublished).
UNPUBLISHED_KINDS = {"LeaderWorkerSet", "InferencePool"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {case: render(values) for case, values in CASES.items()}


@pytest.fixture(scope="module")
def gateway() -> list[dict[str, Any]]:
    """deploy/inference-gateway.yaml: the Endpoint Picker and the HTTPRoute."""
    return [doc for doc in yaml.safe_load_all(GATEWAY_MANIFESTS.read_text()) if doc]


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs)["Deployment"]
    return deployment


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


def _config(docs: list[dict[str, Any]]) -> dict[str, str]:
    (config,) = by_kind(docs)["ConfigMap"]
    return config["data"]


def _group(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (group,) = by_kind(docs)["LeaderWorkerSet"]
    return group


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's leader and worker pod templates as core PodTemplates, which the
    Kubernetes schemas validate (the LWS CRD embeds the same PodTemplateSpec)."""
    templates = doc["spec"]["leaderWorkerTemplate"]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{doc['metadata']['name']}-{role}"},
            "template": templates[f"{role}Template"],
        }
        for role in ("leader", "worker")
    ]


def _core(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    core = [doc for doc in docs if doc["kind"] not in CUSTOM_KINDS | UNPUBLISHED_KINDS]
    return core + [
        t for doc in docs if doc["kind"] == "LeaderWorkerSet" for t in _pod_templates(doc)
    ]


@pytest.mark.parametrize("case", CASES)
def test_manifests_validate_against_the_kubernetes_schemas(rendered: dict, case: str) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`"
    )
    docs = _core(rendered[case])
    kinds = {doc["kind"] for doc in docs}
    assert {"Service", "ConfigMap", "ServiceAccount"} <= kinds and ("Deployment" in kinds) != (
        "PodTemplate" in kinds
    )
    for version in (OLDEST_KUBERNETES, kv.latest_version()):
        for doc in docs:
            kv.validate(doc, version, strict=True)  # raises on any unknown field or wrong type


def test_the_gateway_manifests_validate_against_the_kubernetes_schemas(gateway: list) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`"
    )
    docs = _core(gateway)
    assert {doc["kind"] for doc in docs} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "Service",
    }
    for version in (OLDEST_KUBERNETES, kv.latest_version()):
        for doc in docs:
            kv.validate(doc, version, strict=True)


def test_the_pod_template_check_can_fail(rendered: dict) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`"
    )
    group = copy.deepcopy(_group(rendered["multi-node-example"]))
    group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = [
        "ngrammys"
    ]  # a typo
    leader, worker = _pod_templates(group)
    kv.validate(leader, OLDEST_KUBERNETES, strict=True)
    with pytest.raises(kv.ValidationError):
        kv.validate(worker, OLDEST_KUBERNETES, strict=True)


def test_the_kubernetes_schema_check_can_fail(rendered: dict) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed: `make deploy-tools`"
    )
    deployment = copy.deepcopy(_deployment(rendered["default"]))
    # a typo
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 10
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, OLDEST_KUBERNETES, strict=True)


def test_custom_resources_validate_against_their_crd_schemas(rendered: dict, gateway: list) -> None:
    node = tool("node", "Node.js: apt-get install nodejs")
    if not (CRD_VALIDATOR / "node_modules").is_dir():
        pytest.skip(
            "the CRD schemas are not installed (`make deploy-tools` runs npm ci in "
            "tests/deploy/crd); ScaledObject, ServiceMonitor and HTTPRoute were not validated"
        )
    resources = [
        doc for docs in [*rendered.values(), gateway] for doc in docs if doc["kind"] in CUSTOM_KINDS
    ]
    assert {doc["kind"] for doc in resources} == CUSTOM_KINDS
    broken = copy.deepcopy(next(doc for doc in resources if doc["kind"] == "ScaledObject"))
    broken["spec"]["minReplicaCount"] = "one"
    run = subprocess.run(
        [node, "validate.mjs"],
        cwd=CRD_VALIDATOR,
        input=json.dumps(resources + [broken]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(resources) + 1, run.stderr
    assert [r for r in results[:-1] if r["error"]] == []
    assert "minReplicaCount" in results[-1]["error"]  # the validator does reject


@pytest.mark.parametrize(
    "case",
    [
        "default",
        "gpu-example",
        "everything",
        "tensor-parallel-example",
        "multi-node-example",
        "lws-cpu-hpa",
        "inference-gateway-example",
        "batch-store",
        "batch-store-postgres",
    ],
)
def test_helm_lint_strict_finds_nothing(case: str) -> None:
    helm = helm_sdk()
    report = helm.lint(CHART, CASES[case], strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings and errors


def test_default_pod_is_locked_down_and_probed(rendered: dict) -> None:
    docs = rendered["default"]
    pod = _deployment(docs)["spec"]["template"]["spec"]
    container = _container(docs)
    assert (
        pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    )
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"] >= 600
    )  # a slow CPU model load fits
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    values = helm_sdk().Chart.load(CHART).values
    server = values["server"]
    assert (
        pod["terminationGracePeriodSeconds"]
        == server["preStopSleepSeconds"] + server["drainTimeoutSeconds"] + 10
    )
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "sleep",
        str(server["preStopSleepSeconds"]),
    ]
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
    assert (
        _deployment(base)["spec"]["template"]["metadata"]["annotations"][annotation]
        != _deployment(changed)["spec"]["template"]["metadata"]["annotations"][annotation]
    )


def test_scrape_annotations_and_service_monitor(rendered: dict) -> None:
    annotations = _deployment(rendered["default"])["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and annotations["prometheus.io/path"] == "/metrics"
    )
    assert annotations["prometheus.io/port"] == str(
        _container(rendered["default"])["ports"][0]["containerPort"]
    )
    assert "ServiceMonitor" not in by_kind(rendered["default"])
    (monitor,) = by_kind(rendered["everything"])["ServiceMonitor"]
    (service,) = by_kind(rendered["everything"])["Service"]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_keda_scales_on_queue_depth_and_the_cpu_hpa_is_the_fallback(rendered: dict) -> None:
    keda = by_kind(rendered["keda-on"])
    (scaled,) = keda["ScaledObject"]
    assert "HorizontalPodAutoscaler" not in keda  # KEDA makes its own
    assert "replicas" not in _deployment(rendered["keda-on"])["spec"]
    prometheus, cpu = scaled["spec"]["triggers"]
    assert prometheus["type"] == "prometheus" and prometheus["metricType"] == "AverageValue"
    query = prometheus["metadata"]["query"]
    assert (
        "ngrammys_num_requests_waiting" in query
        and 'namespace="llm"' in query
        and "demo-ngrammys-" in query
    )
    assert cpu["type"] == "cpu"
    assert (
        scaled["spec"]["scaleTargetRef"]["name"]
        == _deployment(rendered["keda-on"])["metadata"]["name"]
    )
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
    queries = [
        t["metadata"]["query"]
        for case in ("keda-on", "multi-node-example")
        for doc in by_kind(rendered[case])["ScaledObject"]
        for t in doc["spec"]["triggers"]
        if t["type"] == "prometheus"
    ]
    assert len(queries) == 2
    rules = {
        "groups": [
            {
                "name": "keda",
                "rules": [{"record": f"keda:query{i}", "expr": q} for i, q in enumerate(queries)],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(json.dumps(rules))
    (tmp_path / "bad.yml").write_text(
        json.dumps({"groups": [{"name": "b", "rules": [{"record": "b", "expr": "sum("}]}]})
    )
    check = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        subprocess.run(
            [promtool, "check", "rules", str(tmp_path / "bad.yml")], capture_output=True
        ).returncode
        != 0
    )


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


def test_tensor_parallel_pods_get_one_gpu_per_rank_and_shared_memory(rendered: dict) -> None:
    docs = rendered["tensor-parallel-example"]
    container = _container(docs)
    pod = _deployment(docs)["spec"]["template"]["spec"]
    assert _config(docs)["NGRAMMYS_TENSOR_PARALLEL_SIZE"] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    told = notes(CASES["tensor-parallel-example"])
    assert "Tensor parallelism: one model copy over 4 ranks (4 per pod)" in told

    default = rendered["default"]
    assert _config(default)["NGRAMMYS_TENSOR_PARALLEL_SIZE"] == "1"
    assert all(
        v["name"] != "shm" for v in _deployment(default)["spec"]["template"]["spec"]["volumes"]
    )
    assert "Tensor parallelism" not in notes()
    assert (
        _container(rendered["gpu-example"])["resources"]["limits"]["nvidia.com/gpu"] == "1"
    )  # gpu.count

    # passed through; no GPU is requested without gpu.enabled
    cpu_only = render({"tensorParallelSize": 2})
    assert _config(cpu_only)["NGRAMMYS_TENSOR_PARALLEL_SIZE"] == "2"
    assert "nvidia.com/gpu" not in json.dumps(_container(cpu_only)["resources"])
    assert any(m["mountPath"] == "/dev/shm" for m in _container(cpu_only)["volumeMounts"])


# PromQL matches a label regex against the whole value: re.fullmatch.
DEPLOYMENT_POD = "demo-ngrammys-7d9f8c6b5-x2x9z"
LEADER_POD, WORKER_POD = "demo-ngrammys-lws-0", "demo-ngrammys-lws-0-1"


def _pod_regex(query: str) -> str:
    return re.search(r'pod=~"([^"]+)"', query).group(1)


def test_a_leader_worker_set_replaces_the_deployment(rendered: dict) -> None:
    docs = rendered["multi-node-example"]
    kinds = by_kind(docs)
    assert "Deployment" not in kinds
    group = _group(docs)
    (service,) = kinds["Service"]
    # LWS names the group's headless Service (the pods' DNS) after itself: not the chart's Service.
    assert group["metadata"]["name"] != service["metadata"]["name"]
    spec = group["spec"]
    assert "replicas" not in spec  # KEDA owns the count of groups
    assert spec["startupPolicy"] == "LeaderCreated"
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    (lead,), (work,) = leader["spec"]["containers"], worker["spec"]["containers"]

    # The leader is the server: probes, its port, the scrape annotations.
    assert (
        lead["readinessProbe"]["httpGet"]["path"] == "/ready" and "command" not in lead
    )  # the image's CMD
    assert {p["name"] for p in lead["ports"]} == {"http", "rendezvous"}
    assert leader["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # The workers run the other ranks: their command, no HTTP.
    assert work["command"] == ["ngrammys", "worker"]
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(work)
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    for container in (lead, work):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)" and env["MASTER_PORT"] == "29500"
        assert (
            container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        )  # tensorParallelSize per pod
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert container["envFrom"] == [{"configMapRef": {"name": "demo-ngrammys"}}]
    assert _config(docs)["NGRAMMYS_TENSOR_PARALLEL_SIZE"] == "8"

    # The Service (and so the ServiceMonitor) reaches the leaders only.
    selector = service["spec"]["selector"].items()
    assert selector <= leader["metadata"]["labels"].items()
    assert not selector <= worker["metadata"]["labels"].items()
    assert "leaderworkerset" in notes(CASES["multi-node-example"])
    assert "one model copy over 16 ranks (8 per pod, 2 pods a group)" in notes(
        CASES["multi-node-example"]
    )


def test_autoscaling_scales_whole_groups(rendered: dict) -> None:
    multi = rendered["multi-node-example"]
    group = _group(multi)
    target = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": group["metadata"]["name"],
    }
    (scaled,) = by_kind(multi)["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"] == target
    query = next(t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus")["metadata"][
        "query"
    ]
    assert re.fullmatch(_pod_regex(query), LEADER_POD) and not re.fullmatch(
        _pod_regex(query), WORKER_POD
    )

    (hpa,) = by_kind(rendered["lws-cpu-hpa"])["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert "replicas" not in _group(rendered["lws-cpu-hpa"])["spec"]
    fixed = render(
        {"gpu": {"enabled": True}, "leaderWorkerSet": {"enabled": True}, "replicaCount": 3}
    )
    assert _group(fixed)["spec"]["replicas"] == 3  # groups, without autoscaling

    (keda,) = by_kind(rendered["keda-on"])["ScaledObject"]
    deployment_query = next(t for t in keda["spec"]["triggers"] if t["type"] == "prometheus")[
        "metadata"
    ]["query"]
    assert re.fullmatch(_pod_regex(deployment_query), DEPLOYMENT_POD)


def _check_unpublished(doc: dict[str, Any]) -> list[str]:
    """The fields of the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) and InferencePool
    (inference.networking.k8s.io/v1) APIs that the chart sets, checked against their Go types
    and CRD markers by hand: apiVersion and kind, the required fields, their types and enums.
    Not the CRDs' whole schemas (no package carries them); their pod templates are validated
    against the Kubernetes schemas elsewhere."""
    errors = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            errors.append(what)

    def integer(value: Any, low: int, high: int = 2**31 - 1) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    meta, spec = doc.get("metadata", {}), doc.get("spec")
    need(
        isinstance(meta.get("name"), str)
        and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) is not None,
        "metadata.name",
    )
    need(isinstance(spec, dict), "spec")
    spec = spec if isinstance(spec, dict) else {}
    if doc.get("kind") == "LeaderWorkerSet":
        need(doc.get("apiVersion") == "leaderworkerset.x-k8s.io/v1", "apiVersion")
        known = {
            "replicas",
            "leaderWorkerTemplate",
            "rolloutStrategy",
            "startupPolicy",
            "networkConfig",
        }
        need(set(spec) <= known, f"unknown spec fields {set(spec) - known}")
        need("replicas" not in spec or integer(spec["replicas"], 0, 1_000_000), "spec.replicas")
        need(
            spec.get("startupPolicy", "LeaderCreated") in {"LeaderCreated", "LeaderReady"},
            "spec.startupPolicy",
        )
        rollout = spec.get("rolloutStrategy", {"type": "RollingUpdate"})
        need(rollout.get("type") == "RollingUpdate", "spec.rolloutStrategy.type")
        rolling = rollout.get("rollingUpdateConfiguration", {})
        need(
            set(rolling) <= {"partition", "maxUnavailable", "maxSurge"},
            "spec.rolloutStrategy.rollingUpdateConfiguration",
        )
        need(
            all(
                isinstance(rolling[k], (int, str))
                for k in set(rolling) & {"maxUnavailable", "maxSurge"}
            ),
            "rollingUpdateConfiguration int-or-string",
        )
        template = spec.get("leaderWorkerTemplate")
        need(isinstance(template, dict), "spec.leaderWorkerTemplate")
        template = template if isinstance(template, dict) else {}
        known = {
            "leaderTemplate",
            "workerTemplate",
            "size",
            "restartPolicy",
            "subGroupPolicy",
            "volumeClaimTemplates",
            "persistentVolumeClaimRetentionPolicy",
        }
        need(set(template) <= known, f"unknown leaderWorkerTemplate fields {set(template) - known}")
        need(
            isinstance(template.get("workerTemplate"), dict),
            "leaderWorkerTemplate.workerTemplate (required)",
        )
        need(
            "leaderTemplate" not in template or isinstance(template["leaderTemplate"], dict),
            "leaderTemplate",
        )
        need(integer(template.get("size", 1), 1), "leaderWorkerTemplate.size")
        need(
            template.get("restartPolicy", "RecreateGroupOnPodRestart")
            in {"RecreateGroupOnPodRestart", "None", "Default", "RecreateGroupAfterStart"},
            "restartPolicy",
        )
    elif doc.get("kind") == "InferencePool":
        need(doc.get("apiVersion") == "inference.networking.k8s.io/v1", "apiVersion")
        known = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
        need(
            set(spec) <= known and {"selector", "targetPorts", "endpointPickerRef"} <= set(spec),
            f"spec fields {sorted(spec)}",
        )
        labels = spec.get("selector", {}).get("matchLabels")
        need(
            isinstance(labels, dict)
            and 1 <= len(labels) <= 64
            and set(spec["selector"]) == {"matchLabels"}
            and all(
                isinstance(v, str)
                and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", v)
                and len(v) <= 63
                for v in labels.values()
            ),
            "spec.selector.matchLabels",
        )
        ports = spec.get("targetPorts")
        need(
            isinstance(ports, list)
            and 1 <= len(ports) <= 8
            and all(
                isinstance(p, dict) and set(p) == {"number"} and integer(p["number"], 1, 65535)
                for p in ports
            )
            and len({p["number"] for p in ports}) == len(ports),
            "spec.targetPorts",
        )
        need(spec.get("appProtocol", "http") in {"http", "kubernetes.io/h2c"}, "spec.appProtocol")
        epp = spec.get("endpointPickerRef", {})
        need(
            set(epp) <= {"group", "kind", "name", "port", "failureMode"}, "endpointPickerRef fields"
        )
        need(
            isinstance(epp.get("name"), str) and 1 <= len(epp["name"]) <= 253,
            "endpointPickerRef.name",
        )
        port = epp.get("port")
        need(
            epp.get("kind", "Service") != "Service"
            or (
                isinstance(port, dict)
                and set(port) == {"number"}
                and integer(port["number"], 1, 65535)
            ),
            "endpointPickerRef.port (required for a Service)",
        )
        need(
            epp.get("failureMode", "FailClose") in {"FailOpen", "FailClose"},
            "endpointPickerRef.failureMode",
        )
    else:
        errors.append(f"not a LeaderWorkerSet or InferencePool: {doc.get('kind')}")
    return errors


def test_the_leader_worker_set_and_the_inference_pool_have_their_apis_fields(
    rendered: dict,
) -> None:
    resources = [
        doc for docs in rendered.values() for doc in docs if doc["kind"] in UNPUBLISHED_KINDS
    ]
    assert {doc["kind"] for doc in resources} == UNPUBLISHED_KINDS
    assert {doc["metadata"]["name"]: _check_unpublished(doc) for doc in resources} == {
        doc["metadata"]["name"]: [] for doc in resources
    }
    group = copy.deepcopy(_group(rendered["multi-node-example"]))
    group["spec"]["leaderWorkerTemplate"]["size"] = "2"
    group["spec"]["startupPolicy"] = "WhenReady"
    (pool,) = by_kind(rendered["inference-gateway-example"])["InferencePool"]
    pool = copy.deepcopy(pool)
    del pool["spec"]["endpointPickerRef"]["port"]
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert _check_unpublished(group) == ["spec.startupPolicy", "leaderWorkerTemplate.size"]
    assert _check_unpublished(pool) == [
        "spec.targetPorts",
        "endpointPickerRef.port (required for a Service)",
    ]


def _metric_names() -> set[str]:
    """The series app/metrics.py exports (each name appears there as a string literal)."""
    return set(re.findall(r'"(ngrammys_[a-z0-9_]+)"', (ROOT / "app" / "metrics.py").read_text()))


def test_the_inference_pool_its_endpoint_picker_and_route_fit_together(gateway: list) -> None:
    # the release name the example assumes
    docs = render(CASES["inference-gateway-example"], name="ngrammys")
    (pool,) = by_kind(docs)["InferencePool"]
    (deployment,) = by_kind(docs)["Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    # The pool selects the serving pods, on the server's port.
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]

    manifests = by_kind(gateway)
    (epp_service,) = manifests["Service"]
    (epp,) = manifests["Deployment"]
    (route,) = manifests["HTTPRoute"]
    (config_map,) = manifests["ConfigMap"]
    # The pool's Endpoint Picker is the example's EPP Service, its ext-proc port the EPP's gRPC
    # port.
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == epp_service["metadata"]["name"] and ref["failureMode"] == "FailOpen"
    port = next(p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    (epp_container,) = epp["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {
        p["name"] for p in epp_container["ports"] if p["containerPort"] == 9002
    }
    assert (
        epp_service["spec"]["selector"].items()
        <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    # The EPP watches that pool; the route sends to it.
    args = epp_container["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]
    # Metric names come from the EPP's configuration: its old flags make v1.4+ refuse to start.
    assert not [a for a in args if "metric" in a and a != "--metrics-endpoint-auth=false"]
    config = yaml.safe_load(next(iter(config_map["data"].values())))
    assert config["kind"] == "EndpointPickerConfig"
    mounted = epp_container["volumeMounts"][0]["mountPath"]
    assert f"--config-file={mounted}/{next(iter(config_map['data']))}" in args
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")[
        "parameters"
    ]
    (engine,) = extractor["engineConfigs"]
    # ... for the engine the pods are labelled as, which is also the default.
    assert (
        engine["name"]
        == extractor["defaultEngine"]
        == pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"]
    )
    assert engine["queuedRequestsSpec"] == "ngrammys_num_requests_waiting"
    assert engine["runningRequestsSpec"] == "ngrammys_num_requests_running"
    assert engine["kvUsageSpec"] == "ngrammys_kv_cache_usage_perc"
    assert {
        engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")
    } <= _metric_names()
    scorers = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert (
        {"queue-scorer", "kv-cache-utilization-scorer"}
        <= scorers
        <= {p["type"] for p in config["plugins"]}
    )
    # The RBAC lets it read the pool and the pods.
    (role,) = manifests["Role"]
    (binding,) = manifests["RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert {"inferencepools", "pods"} <= {r for rule in role["rules"] for r in rule["resources"]}
    assert "ngrammys-epp" in notes(CASES["inference-gateway-example"])


def test_with_a_group_the_pool_selects_the_leaders(rendered: dict) -> None:
    docs = rendered["lws-cpu-hpa"]
    (pool,) = by_kind(docs)["InferencePool"]
    template = _group(docs)["spec"]["leaderWorkerTemplate"]
    selector = pool["spec"]["selector"]["matchLabels"].items()
    assert selector <= template["leaderTemplate"]["metadata"]["labels"].items()
    assert not selector <= template["workerTemplate"]["metadata"]["labels"].items()
    assert pool["spec"]["endpointPickerRef"]["name"] == "demo-ngrammys-epp"  # the default name
    # API keys: the leader serves, the workers have no HTTP and no key.
    leader, worker = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    assert any("secret" in v for v in leader["volumes"]) and not any(
        "secret" in v for v in worker["volumes"]
    )


def _claims(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in by_kind(docs).get("PersistentVolumeClaim", [])}


def test_the_batch_store_is_a_kept_claim_mounted_where_the_server_looks(rendered: dict) -> None:
    docs = rendered["batch-store"]
    values = helm_sdk().Chart.load(CHART).values["batchStore"]
    claims = _claims(docs)
    assert set(claims) == {"demo-ngrammys-cache", "demo-ngrammys-batches"}
    claim = claims["demo-ngrammys-batches"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == values["size"] == "10Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    # The server's store is where the claim is mounted.
    store = _config(docs)["NGRAMMYS_BATCH_STORE"]
    assert store == values["mountPath"] == "/var/lib/ngrammys/batches"
    pod = _deployment(docs)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "batch-store"]
    assert volume["persistentVolumeClaim"] == {"claimName": "demo-ngrammys-batches"}
    (mount,) = [m for m in _container(docs)["volumeMounts"] if m["name"] == "batch-store"]
    assert mount["mountPath"] == store and not mount.get("readOnly")
    # One server owns the store: the old pod goes before the new one starts.
    assert _deployment(docs)["spec"]["strategy"] == {"type": "Recreate"}
    assert _deployment(docs)["spec"]["replicas"] == 1
    told = notes(CASES["batch-store"])
    assert (
        "/var/lib/ngrammys/batches on the claim demo-ngrammys-batches (kept on uninstall)" in told
    )

    default = rendered["default"]
    assert "NGRAMMYS_BATCH_STORE" not in _config(default)
    assert "PersistentVolumeClaim" not in by_kind(default)
    assert all(
        v["name"] != "batch-store"
        for v in _deployment(default)["spec"]["template"]["spec"]["volumes"]
    )
    assert _deployment(default)["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "Batch jobs" not in notes()


def test_the_batch_store_can_be_an_existing_claim() -> None:
    docs = render({"batchStore": {"enabled": True, "existingClaim": "my-batches"}})
    assert _claims(docs) == {}  # the chart makes none
    pod = _deployment(docs)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "batch-store"]
    assert volume["persistentVolumeClaim"] == {"claimName": "my-batches"}
    assert _config(docs)["NGRAMMYS_BATCH_STORE"] == "/var/lib/ngrammys/batches"
    assert "on the claim my-batches." in notes(
        {"batchStore": {"enabled": True, "existingClaim": "my-batches"}}
    )


def test_the_batch_store_can_be_a_postgres_url_the_replicas_share(rendered: dict) -> None:
    docs = rendered["batch-store-postgres"]
    assert "NGRAMMYS_BATCH_STORE" not in _config(docs)  # it carries a password: from the Secret
    (store,) = [e for e in _container(docs)["env"] if e["name"] == "NGRAMMYS_BATCH_STORE"]
    assert store["valueFrom"] == {"secretKeyRef": {"name": "ngrammys-batch-store", "key": "url"}}
    assert "demo-ngrammys-batches" not in _claims(docs)  # no claim, no volume, no mount
    pod = _deployment(docs)["spec"]["template"]["spec"]
    assert all(v["name"] != "batch-store" for v in pod["volumes"])
    assert all(m["name"] != "batch-store" for m in _container(docs)["volumeMounts"])
    # Replicas share it: autoscaling and rolling updates are allowed.
    assert "HorizontalPodAutoscaler" in by_kind(docs)
    assert _deployment(docs)["spec"]["strategy"]["type"] == "RollingUpdate"
    told = notes(CASES["batch-store-postgres"])
    assert "the key url of the Secret ngrammys-batch-store" in told and "lease" in told

    url = {"batchStore": {"enabled": True, "url": {"secretName": "s", "key": "dsn"}}}
    assert _deployment(render({**url, "replicaCount": 3}))["spec"]["replicas"] == 3
    # In a group, the leader serves and reads the store; the workers do not.
    grouped = {**url, "gpu": {"enabled": True}, "leaderWorkerSet": {"enabled": True}}
    template = _group(render(grouped))["spec"]["leaderWorkerTemplate"]
    leader, worker = (
        template[role]["spec"]["containers"][0] for role in ("leaderTemplate", "workerTemplate")
    )
    assert "NGRAMMYS_BATCH_STORE" in [e["name"] for e in leader["env"]]
    assert "NGRAMMYS_BATCH_STORE" not in [e["name"] for e in worker["env"]]


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
    "model path escaping /models": {
        "model": {"source": "pvc", "path": "../etc", "pvc": {"claimName": "m"}}
    },
    "zero GPUs": {"gpu": {"enabled": True, "count": 0}},
    "cache not absolute": {"cache": {"mountPath": "cache"}},
    "service port": {"service": {"port": 70000}},
    "ingress path": {
        "ingress": {
            "enabled": True,
            "hosts": [{"host": "a", "paths": [{"path": "x", "pathType": "Prefix"}]}],
        }
    },
    "keda threshold zero": {"autoscaling": {"keda": {"threshold": "0"}}},
    "keda server address": {"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}},
    "cpu target over 100": {"autoscaling": {"cpu": {"targetUtilizationPercentage": 150}}},
    "probe without threshold": {"probes": {"startup": {"failureThreshold": None}}},
    "scrape interval": {"metrics": {"serviceMonitor": {"interval": "often"}}},
    "zero tensor-parallel ranks": {"tensorParallelSize": 0},
    "tensor parallelism as a setting": {"settings": {"tensor_parallel_size": 2}},
    "a group of one pod": {"leaderWorkerSet": {"enabled": True, "size": 1}},
    "group startup policy": {"leaderWorkerSet": {"startupPolicy": "Eventually"}},
    "shared memory size": {"sharedMemory": {"sizeLimit": "lots"}},
    "endpoint picker failure mode": {
        "inferencePool": {"enabled": True, "endpointPicker": {"failureMode": "Retry"}}
    },
    "batch store not absolute": {"batchStore": {"enabled": True, "mountPath": "batches"}},
    "batch store read-only": {"batchStore": {"accessModes": ["ReadOnlyMany"]}},
    "batch store size": {"batchStore": {"size": "ten gigs"}},
    "typo in the batch store": {"batchStore": {"enable": True}},
    "batch store as a setting": {"settings": {"batch_store": "/tmp/batches"}},
    "batch store url in the values": {"batchStore": {"url": "postgresql://u:p@db/batches"}},
    "batch store url's secret name": {"batchStore": {"url": {"secretName": "Not A Name"}}},
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
    settings = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"][
        "properties"
    ]
    listed = {name: spec["enum"] for name, spec in settings.items() if "enum" in spec}
    literal = {
        name: list(get_args(field.annotation))
        for name, field in Settings.model_fields.items()
        if get_origin(field.annotation) is Literal
    }
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


@pytest.mark.parametrize(
    "values, message",
    [
        ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "maxReplicas"),
        (
            {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}},
            "requests.cpu",
        ),
        ({"cache": {"mountPath": "/opt/ngrammys/cache/"}}, "hide the baked cache"),
        ({"gpu": {"enabled": True, "count": 2}, "tensorParallelSize": 4}, "disagree"),
        ({"leaderWorkerSet": {"enabled": True}}, "needs gpu.enabled"),
        (
            {"batchStore": {"enabled": True}, "replicaCount": 2},
            "needs replicaCount 1, not 2: one server owns a batch store",
        ),
        (
            {"batchStore": {"enabled": True}, **KEDA_OFF},
            r"autoscaling.enabled \(HPA or KEDA\): one server",
        ),
        (
            {"batchStore": {"enabled": True}, **KEDA_ON},
            r"autoscaling.enabled \(HPA or KEDA\): one server",
        ),
        (
            {
                "batchStore": {"enabled": True},
                "gpu": {"enabled": True},
                "leaderWorkerSet": {"enabled": True},
            },
            "not leaderWorkerSet.enabled: one server owns a batch store",
        ),
        (
            {"batchStore": {"enabled": True, "mountPath": "/var/cache/ngrammys/"}},
            "batchStore.mountPath must differ",
        ),
    ],
)
def test_checks_the_schema_cannot_express(values: dict[str, Any], message: str) -> None:
    helm = helm_sdk()
    with pytest.raises(helm.HelmError, match=message):
        render(values)
