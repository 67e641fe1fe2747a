"""/metrics through a REAL Prometheus: scraped, queried, and the dashboard kept honest."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from app.background import free_port, serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import LONG, MESSAGES, QUIET, wait_ready, wait_until

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "ngrammys.json"
EXPECTED = {  # name -> type, as issue-level contract
    "ngrammys_spec_decode_num_drafts": "counter",
    "ngrammys_spec_decode_num_draft_tokens": "counter",
    "ngrammys_spec_decode_num_accepted_tokens": "counter",
    "ngrammys_spec_decode_num_accepted_tokens_per_pos": "counter",
    "ngrammys_spec_decode_tokens_per_pass": "histogram",
    "ngrammys_spec_decode_k": "gauge",
    "ngrammys_spec_decode_w": "gauge",
    "ngrammys_spec_decode_predicted_tokens_per_second": "gauge",
    "ngrammys_spec_decode_realized_tokens_per_second": "gauge",
    "ngrammys_time_to_first_token_seconds": "histogram",
    "ngrammys_inter_token_latency_seconds": "histogram",
    "ngrammys_e2e_request_latency_seconds": "histogram",
    "ngrammys_request_queue_time_seconds": "histogram",
    "ngrammys_forward_pass_seconds": "histogram",
    "ngrammys_batch_size": "histogram",
    "ngrammys_pass_tokens": "histogram",
    "ngrammys_pass_committed_tokens": "histogram",
    "ngrammys_cuda_graph_capture_seconds": "counter",
    "ngrammys_num_requests_waiting": "gauge",
    "ngrammys_num_requests_running": "gauge",
    "ngrammys_prompt_tokens": "counter",
    "ngrammys_generation_tokens": "counter",
    "ngrammys_requests": "counter",
    "ngrammys_client_disconnects": "counter",
    "ngrammys_http_requests": "counter",
    "ngrammys_cost_profile_valid": "gauge",
    "ngrammys_cost_profile_remeasures": "counter",
    "ngrammys_kv_cache_usage_perc": "gauge",
    "ngrammys_prefix_cache_queries": "counter",
    "ngrammys_prefix_cache_hits": "counter",
    "ngrammys_prefix_cache_bytes": "gauge",
    "ngrammys_kv_cache_bytes": "gauge",
    "ngrammys_num_preemptions": "counter",
    "ngrammys_suffix_index_bytes": "gauge",
    "ngrammys_batches": "gauge",
    "ngrammys_batch_lines": "counter",
    "ngrammys_batch_generation_tokens": "counter",
}
PROCESS = {  # prometheus_client's standard process series (Linux)
    "process_virtual_memory_bytes": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_cpu_seconds": "counter",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
}


def exported_types(text: str) -> dict[str, str]:
    """Metric family -> type (a counter's family is named without `_total`)."""
    types = re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    return {
        name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in types
    }


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    store = tmp_path_factory.mktemp("batches")  # batch jobs on: their series too
    settings = Settings(spec_mode="fixed", spec_k=4, spec_w=4, batch_store=store, **QUIET)
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        yield base


def traffic(base: str) -> None:
    """A streamed and a plain request, one refused, and one the client abandons."""
    repetitive = [{"role": "user", "content": "Repeat five times: the cat sat on the mat."}]
    httpx.post(
        f"{base}/v1/chat/completions", json={"messages": repetitive, "max_tokens": 32}, timeout=60
    )
    body = {"messages": MESSAGES, "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        response.read()
    httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=60)
    abandoned = {"messages": LONG, "max_tokens": 300, "stream": True}  # far from done when dropped
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=abandoned, timeout=60) as r:
        next(line for line in r.iter_lines() if '"content"' in line)
    wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=10)


def test_every_metric_is_exported_with_its_type_and_promtool_agrees(server: str) -> None:
    traffic(server)
    text = httpx.get(f"{server}/metrics").text
    # all of them, and nothing else (no `_created` noise)
    assert exported_types(text) == EXPECTED | PROCESS
    assert (
        'ngrammys_requests_total{status="ok"}' in text
        and 'ngrammys_requests_total{status="invalid"}' in text
    )
    assert "ngrammys_client_disconnects_total 1.0" in text
    chat = 'ngrammys_http_requests_total{method="POST",route="/v1/chat/completions",status='
    assert f'{chat}"200"}}' in text and f'{chat}"400"}}' in text
    httpx.get(f"{server}/nowhere")
    httpx.post(f"{server}/tokenize", json={"prompt": "counted"})
    text = httpx.get(f"{server}/metrics").text
    assert 'ngrammys_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'ngrammys_http_requests_total{method="POST",route="/tokenize",status="200"} 1.0' in text
    assert shutil.which("promtool"), "promtool missing: `make test` installs Debian's prometheus"
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_real_prometheus_scrapes_and_sees_the_counters_move(server: str, tmp_path: Path) -> None:
    assert shutil.which("prometheus"), (
        "prometheus missing: `make test` installs Debian's prometheus"
    )
    target = server.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: ngrammys, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def value(query: str) -> float:
        result = httpx.get(api, params={"query": query}, timeout=5).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else -1.0

    try:
        wait_until(lambda: _up(api), timeout=60)
        before = {q: value(q) for q in QUERIES}
        traffic(server)
        time.sleep(0.1)
        wait_until(lambda: value(QUERIES[0]) > before[QUERIES[0]], timeout=30)
        time.sleep(2.5)  # one more scrape after the last request ended
        after = {q: value(q) for q in QUERIES}
        print(json.dumps({"before": before, "after": after}, indent=1))  # the proof, in -s output
        for query in QUERIES:
            assert after[query] > before[query], query
    finally:
        process.terminate()
        process.wait(timeout=30)


QUERIES = [
    "sum(ngrammys_generation_tokens_total)",
    'sum(ngrammys_requests_total{status="ok"})',
    'sum(ngrammys_requests_total{status="invalid"})',
    "sum(ngrammys_spec_decode_num_draft_tokens_total)",
    "sum(ngrammys_spec_decode_num_accepted_tokens_total)",
    "sum(ngrammys_time_to_first_token_seconds_count)",
    "sum(ngrammys_forward_pass_seconds_count)",
    "sum(ngrammys_batch_size_count)",
    "sum(ngrammys_client_disconnects_total)",
    "sum(ngrammys_prefix_cache_queries_total)",
]


def _up(api: str) -> bool:
    """Prometheus has scraped the server once (it answers 503 while its storage starts)."""
    try:
        response = httpx.get(api, params={"query": "up"}, timeout=2)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    result = response.json()["data"]["result"]
    return bool(result) and result[0]["value"][1] == "1"


def test_every_metric_in_the_dashboard_is_exported(server: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {
        re.sub(r"_(bucket|sum|count|total)$", "", name)
        for e in exprs
        for name in re.findall(r"ngrammys_\w+", e)
    }
    exported = set(exported_types(httpx.get(f"{server}/metrics").text))
    assert used and used <= exported, used - exported
    assert set(EXPECTED) <= used  # and the dashboard shows every metric
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
