"""A compile worker: a child process that compiles a grammar to learn, within a time limit,
whether it compiles, and is killed when it does not.

Why a process and then a compile in the server: a thread cannot be stopped, so a schema that
compiles for minutes would keep a core for minutes; a process can be killed at its deadline.
But the compiled grammar cannot come back from it at an acceptable price: xgrammar's
`CompiledGrammar.serialize_json` writes every state's token masks as JSON, many times the
compile's own time and hundreds of MB for a schema of tens of KB, and its `deserialize_json`
holds the server for most of that again. So the worker only proves that the spec compiles
within the limit (or returns the compile's error), and the server then compiles it itself,
on a thread that releases the interpreter lock (`service/grammar/bounded.py`).

The worker runs at the lowest CPU priority (`lowest_priority`), so the engine wins the CPU from
it.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

from service.grammar.compiler import GrammarError, GrammarSpec


class CompileTimeout(GrammarError):
    """A grammar that did not compile within its time limit."""


@dataclass(frozen=True)
class _Outcome:
    error: str | None = None  # the compile's `GrammarError` message (None: it compiled)
    field: str = ""  # the field it names


def lowest_priority() -> None:
    """Give the calling thread (on Linux a thread's priority is its own, and the threads it
    starts inherit it) the CPU only when nothing else wants it: nice 19, and where the OS has it
    the idle class, which stays below a server that itself runs at nice 19."""
    os.nice(19)
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _serve(connection: Connection, info_json: str) -> None:
    """The worker's loop: compile each spec received, answer with its outcome."""
    lowest_priority()
    import xgrammar

    from service.grammar.compiler import compile_spec, new_xgrammar_compiler

    compiler = new_xgrammar_compiler(xgrammar.TokenizerInfo.deserialize_json(info_json))
    connection.send(_Outcome())  # ready
    while True:
        try:
            spec = connection.recv()
        except EOFError:  # the server closed its end: it is gone or stopping
            return
        try:
            compile_spec(compiler, spec)
            connection.send(_Outcome())
        except GrammarError as error:
            message = str(error).removeprefix(f"{error.field}: ")
            connection.send(_Outcome(message, error.field))


class CompileWorker:
    """One worker process for one caller at a time; replaced after a timeout (not thread-safe:
    `BoundedCompiler` hands each to one thread)."""

    def __init__(self, info_json: str) -> None:
        self._info_json = info_json
        self.replaced = False  # started again after a kill (a first start is the server's)
        self._start()

    def _start(self) -> None:
        # spawn: the server's threads (torch's, the engine's) are not copied into the child
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, self._info_json), name="ngrammys-grammar", daemon=True
        )
        self._process.start()
        child.close()
        self._ready = False

    def wait_ready(self, timeout: float) -> bool:
        """Whether the process has started (imported xgrammar, read the vocabulary) within
        `timeout` seconds; one that failed to start is replaced."""
        if not self._ready and self._connection.poll(timeout):
            try:
                self._connection.recv()
                self._ready = True
            except EOFError:
                self.close()
                self._start()
        return self._ready

    def check(self, spec: GrammarSpec, timeout: float) -> None:
        """Return once `spec` compiled within `timeout` seconds (the worker ready:
        `wait_ready`); `GrammarError` with the compile's message, or `CompileTimeout` (the
        worker is then killed and replaced)."""
        self._connection.send(spec)
        outcome = self._await(
            timeout,
            spec,
            f"did not compile within {timeout:g} s (--grammar-compile-timeout)",
        )
        if outcome.error is not None:
            raise GrammarError(outcome.error, outcome.field)

    def _await(self, timeout: float, spec: GrammarSpec, late: str) -> _Outcome:
        if self._connection.poll(timeout):
            try:
                return self._connection.recv()
            except EOFError:  # it died (out of memory, killed): a new one for the next
                pass
        self.close()
        self._start()
        self.replaced = True
        raise CompileTimeout(late, spec.field)

    def close(self) -> None:
        """Kill the process (it holds nothing to save) and reap it."""
        self._process.kill()
        self._process.join()
        self._connection.close()
