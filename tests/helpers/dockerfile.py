"""A reader for this project's Dockerfile, so the tests can run its build and serve steps
without a Docker engine: stages, ARG/ENV with Docker's variable expansion, WORKDIR, COPY, RUN,
USER, HEALTHCHECK and CMD. Not a general Dockerfile interpreter: it understands what the
project's Dockerfile uses and fails loudly on anything else."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

KNOWN = {
    "ARG",
    "FROM",
    "ENV",
    "WORKDIR",
    "RUN",
    "COPY",
    "LABEL",
    "USER",
    "EXPOSE",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "CMD",
}


@dataclass
class Instruction:
    keyword: str
    flags: dict[str, str]
    args: str


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _lines(text: str) -> list[str]:
    """Logical lines: comments dropped, backslash continuations joined."""
    logical, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append((current + stripped).strip())
        current = ""
    assert not current, "dangling line continuation"
    return logical


def parse(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        assert keyword in KNOWN, f"the test does not know {keyword}"
        flags = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.lstrip()
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip()))
        elif not stages:
            assert keyword == "ARG"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, flags, rest))
    return Dockerfile(global_args, stages)


def expand(word: str, env: dict[str, str]) -> str:
    """Docker's $VAR, ${VAR}, ${VAR:-default} and ${VAR:+alternative}."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(4)
        value = env.get(name, "")
        if match.group(2) == ":-":
            return value or match.group(3)
        if match.group(2) == ":+":
            return match.group(3) if value else ""
        return value

    return re.sub(r"\$\{(\w+)(?:(:[-+])([^}]*))?\}|\$(?=\w)(?:(\w+))", one, word)


def assignments(args: str, env: dict[str, str]) -> dict[str, str]:
    """KEY=VALUE pairs of ENV or LABEL (values expanded with `env` as it stood before)."""
    pairs = {}
    for word in shlex.split(args):
        key, equals, value = word.partition("=")
        assert equals, f"only KEY=VALUE forms are understood: {word}"
        pairs[key] = expand(value, env)
    return pairs


def exec_form(args: str) -> list[str]:
    command = json.loads(args)
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), args
    return command


def healthcheck(stage: Stage) -> tuple[dict[str, str], list[str]]:
    (check,) = stage.all("HEALTHCHECK")
    keyword, _, command = check.args.partition(" ")
    assert keyword == "CMD", check.args
    return check.flags, exec_form(command)
