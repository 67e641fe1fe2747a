"""Paths, tools and the chart renderer shared by the deployment tests.

Every validator is a real tool installed by `make test` (deploy-tools): Helm's Go SDK through
helm-python-sdk, kubernetes-validate's schemas, hadolint, check-jsonschema's compose-spec
schema, promtool, and the CRD schemas of KEDA, the Prometheus Operator and the Gateway API
(npm). A test whose tool is missing skips and says which one and how to get it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ngrammys"
GPU_EXAMPLE = CHART / "examples" / "gpu.yaml"
DEPLOY = ROOT / "deploy"
CRD_VALIDATOR = ROOT / "tests" / "deploy" / "crd"

# Kubernetes versions the rendered manifests are checked against: the oldest the chart
# supports (Chart.yaml kubeVersion) and the newest kubernetes-validate ships.
OLDEST_KUBERNETES = "1.25.0"

# What the chart's seed-cache init container runs, with the image's baked cache and the
# writable cache (the defaults of image.cacheDir and cache.mountPath); the image test runs it.
BAKED_CACHE = "/opt/ngrammys/cache"
WRITABLE_CACHE = "/var/cache/ngrammys"


def seed_command(baked: str | Path, writable: str | Path) -> list[str]:
    return ["cp", "-rsf", f"{baked}/.", f"{writable}/"]


def tool(name: str, install: str) -> str:
    """The executable `name` beside this Python (the venv) or on PATH, or skip saying how to get
    it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} not found ({install}); this check did not run")
    return found


def helm_sdk() -> Any:
    return pytest.importorskip(
        "helm_python",
        reason="helm-python-sdk (Helm's Go SDK) not installed: `make deploy-tools`; "
        "the chart was not rendered",
    )


def render(
    values: dict[str, Any] | None = None, name: str = "demo", namespace: str = "llm"
) -> list[dict[str, Any]]:
    """The chart rendered by Helm itself (its Go SDK), as a list of manifests."""
    helm = helm_sdk()
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    helm = helm_sdk()
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name="demo", namespace="llm", is_install=True)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
