"""Tensor parallelism over HTTP: `ngrammys serve --tensor-parallel-size 2` (two processes on gloo)
answers as one rank does, greedy and seeded, with speculation, batched, prompts in chunks; a lost
rank ends the server within the bound; SIGTERM drains and stops every rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch

from app.background import free_port
from service.model.loader import load_model
from service.model.prompts import assistant_prefix_ids
from service.model.tables import compute_tables, saved_tables, tables_path
from tests.helpers.http import wait_until
from tests.helpers.models import make_tiny_model

# Different lengths, several past a 16-token pass (prompts in chunks), some repeating themselves
# (context drafts accepted), two sharing a long start (the prefix cache's blocks).
SHARED = "The committee reviewed the proposal line by line and agreed on every point raised. " * 3
PROMPTS = [
    "Count: one two three four five six seven eight nine ten eleven twelve",
    SHARED + "First question: what was agreed?",
    SHARED + "Second question: who raised the points?",
    "a b c a b c a b c a b c a b c a b c a b c",
    "Hello",
    "Write a list of fruits: apple, banana, cherry, apple, banana, cherry, apple,",
]
LOGIT_SCALE = 16.0
SPECULATION = {
    "off": {"mode": "off"},
    "fixed": {"mode": "fixed", "k": 4, "w": 4},
    "auto": {"mode": "auto"},
}


@pytest.fixture(scope="module")
def tiny_dir(embedded, tmp_path_factory) -> Path:
    """The tiny random Llama (4 heads, 2 KV heads: both split over 2 ranks) saved as a model
    directory with the embedded model's tokenizer. Its LM head is scaled up so that its next-token
    distributions are peaked as a trained model's are: two ranks sum each layer's partial
    products in another order than one rank, so their logits differ in the last bits, and over a
    random model's near-uniform 49,152 tokens that moves an inverse-CDF sample to a neighbour
    within a few tokens."""
    directory = tmp_path_factory.mktemp("tiny-tp")
    model = make_tiny_model(vocab_size=embedded.model.config.vocab_size)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(directory)
    embedded.tokenizer.save_pretrained(directory)
    return directory


def _start(
    model: Path, cache: Path, ranks: int, *flags: str
) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = cache / f"server-{ranks}-{port}.log"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--tensor-parallel-size",
            str(ranks),
            "--cache-dir",
            str(cache),
            "--max-tokens-per-pass",
            "16",
            "--no-model-tables",
            "--no-cost-profile",
            *flags,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return server, f"http://127.0.0.1:{port}", log


def _ready(base: str, server: subprocess.Popen[bytes]) -> bool:
    assert server.poll() is None, "the server exited while starting"
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, tmp_path_factory) -> Iterator[dict[int, str]]:
    """One server on one rank, one on two ranks, each with a cache directory of its own."""
    started = {
        ranks: _start(tiny_dir, tmp_path_factory.mktemp(f"cache{ranks}"), ranks) for ranks in (1, 2)
    }
    try:
        for server, base, _ in started.values():
            wait_until(lambda: _ready(base, server), timeout=180)
        yield {ranks: base for ranks, (_, base, _) in started.items()}
    finally:
        for server, _, _ in started.values():
            server.terminate()
            server.wait(timeout=60)


def _complete(base: str, prompt: str, **body) -> dict:
    response = httpx.post(
        f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 24, **body}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _batch(base: str, **body) -> list[dict]:
    """All prompts at once: they are decoded together, as one batch."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: _complete(base, prompt, **body), PROMPTS))


@pytest.mark.slow
@pytest.mark.parametrize("mode", SPECULATION)
def test_two_ranks_decode_greedy_as_one_does(servers: dict[int, str], mode: str) -> None:
    body = {"temperature": 0, "logprobs": 1, "speculation": SPECULATION[mode]}
    alone, split = _batch(servers[1], **body), _batch(servers[2], **body)
    for one, two in zip(alone, split):
        assert two["text"] == one["text"]
        assert two["logprobs"]["token_logprobs"] == pytest.approx(
            one["logprobs"]["token_logprobs"], abs=1e-4
        )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "fixed"])
def test_two_ranks_draw_the_seeded_samples_one_does(servers: dict[int, str], mode: str) -> None:
    """One request at a time: a row's float32 logits move in their last bits with the rows
    beside it in a pass (the matmuls' blocking), and which requests share a pass depends on
    timing; a sample at a CDF boundary would then part between runs of the same server too.
    The drafts (and so the trees a fixed-mode sample is drawn in) follow what each server learnt
    before; temperature 0.5 keeps the distributions peaked enough that such last bits rarely
    reach a boundary (at 0.8 one run in a dozen parted)."""
    body = {"temperature": 0.5, "top_p": 0.95, "seed": 7, "speculation": SPECULATION[mode]}
    for prompt in PROMPTS:
        assert (
            _complete(servers[2], prompt, **body)["text"]
            == _complete(servers[1], prompt, **body)["text"]
        )


@pytest.mark.slow
def test_a_killed_rank_ends_the_server_within_the_bound(tiny_dir: Path, tmp_path: Path) -> None:
    server, base, log = _start(tiny_dir, tmp_path, 2)
    try:
        wait_until(lambda: _ready(base, server), timeout=180)
        worker = psutil.Process(server.pid).children()[0]
        body = {"prompt": "a b c a b c", "max_tokens": 480, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data: ")  # the request is being decoded
            killed = time.monotonic()
            worker.send_signal(signal.SIGKILL)
            with pytest.raises(
                httpx.HTTPError
            ):  # the stream ends with the server: it does not hang
                list(events)
        assert server.wait(timeout=30) == 70
        assert time.monotonic() - killed < 30  # the watch notices within a second or so
        text = log.read_text()
        # whichever notices first: the watch over the pod's processes, or the next pass's collective
        lost = re.search(
            r"tensor parallelism: (rank process \d+ exited with code -9|a collective with the "
            r"other ranks failed).*the model copy is lost, exiting",
            text,
        )
        assert lost, text[-2000:]
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_a_rank_that_hangs_while_the_server_is_idle_ends_it_within_the_timeout(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The process is alive, so only the idle pings (an all-reduce each) can find it."""
    server, base, log = _start(tiny_dir, tmp_path, 2, "--tensor-parallel-timeout", "4")
    try:
        wait_until(lambda: _ready(base, server), timeout=180)
        worker = psutil.Process(server.pid).children()[0]
        stopped = time.monotonic()
        worker.suspend()  # SIGSTOP
        assert server.wait(timeout=60) == 70
        assert time.monotonic() - stopped < 4 + 1 + 10  # the timeout, a ping interval, and slack
        assert "a collective with the other ranks failed" in log.read_text()
        wait_until(
            lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, timeout=10
        )
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_sigterm_drains_and_stops_every_rank(tiny_dir: Path, tmp_path: Path) -> None:
    server, base, log = _start(tiny_dir, tmp_path, 2, "--drain-timeout", "30")
    try:
        wait_until(lambda: _ready(base, server), timeout=180)
        worker = psutil.Process(server.pid).children()[0]
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_complete, base, "a b c a b c", max_tokens=400)
            wait_until(
                lambda: httpx.get(f"{base}/health").json()["requests_running"] == 1, timeout=30
            )
            server.send_signal(signal.SIGTERM)
            # as an orchestrator signals every pod: the rank waits for rank 0
            worker.send_signal(signal.SIGTERM)
            assert answer.result()["text"]  # accepted before: answered in full
        assert server.wait(timeout=60) == 0
        worker.wait(timeout=10)  # gone (rank 0 waited for it: the code is rank 0's to read)
        assert "rank 1: stopped by rank 0" in log.read_text()  # told to stop, not lost
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, says",
    [
        (("--quantization", "gguf"), "cannot be split over ranks"),
        (("--device-round", "on"), "the device round does not run under tensor parallelism"),
        (("--self-draft",), "model-running draft strategies"),
    ],
)
def test_what_cannot_be_split_is_refused_by_name(
    tiny_dir: Path, tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    server, _, log = _start(tiny_dir, tmp_path, 2, *flags)
    try:
        assert server.wait(timeout=180) != 0
        assert says in log.read_text()
        wait_until(lambda: not _ranks_of(tmp_path), timeout=10)  # the rank it started is gone too
    finally:
        if server.poll() is None:
            server.kill()


def _ranks_of(cache: Path) -> list[psutil.Process]:
    """The worker processes started with `cache` as their cache directory."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "worker" in command and str(cache) in command:
            found.append(process)
    return found


@pytest.mark.slow
def test_the_ranks_compute_the_model_tables_one_rank_would(tiny_dir: Path, tmp_path: Path) -> None:
    """Computed over the ranks in the background and kept where one rank's server looks."""
    server, base, _ = _start(tiny_dir, tmp_path, 2, "--model-tables")
    try:
        wait_until(lambda: _ready(base, server), timeout=180)
        wait_until(lambda: httpx.get(f"{base}/health").json()["model_tables"], timeout=300)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    loaded = load_model(str(tiny_dir), "cpu", "float32", tmp_path, "none")
    prefix = assistant_prefix_ids(loaded.tokenizer)
    split = saved_tables(tables_path(loaded.model, tmp_path, prefix))
    assert split is not None  # where a one-rank server with the same model and dtype finds them
    alone = compute_tables(loaded.model, prefix, show_progress=False)
    assert np.array_equal(split.unigram, alone.unigram)
    assert (
        split.bigram == alone.bigram
    ).mean() > 0.999  # logits differ in the last bits: near ties may swap
