"""Grammar compiles the HTTP edge asks for, bounded in time, in number and in size, off the
engine's way, and kept by content.

A request's grammar goes through, in order: its size and nesting limits (`limits.py`, 400 at
once); the cache (a grammar compiled before costs a lookup); a place in line, at most
`max_concurrent` compiles at once (one waiting longer than the time limit is refused as
`GrammarBusy`, a 429: the server's load, not the schema, kept it); a compile worker process
that must finish within the time limit and is killed past it (`worker.py`: `CompileTimeout`,
a 400 naming the field); then the compile the engine will use, on a thread of this module.

Those threads run at the lowest CPU priority (`worker.lowest_priority`), and xgrammar
releases the interpreter lock while it compiles (and uses one core: `new_xgrammar_compiler`),
so neither the engine's passes nor its Python between them wait for a compile. The compiled
grammar travels to the engine inside the request (`GenerationParams.compiled_grammar`), so the
engine never compiles what this module compiled.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar

from service.grammar.compiler import GrammarCompiler, GrammarSpec
from service.grammar.limits import GrammarLimits, cache_key, check_limits
from service.grammar.worker import CompileWorker, lowest_priority

Key = tuple[str, str, str]
# seconds a server's new worker may take to import and read the vocabulary
FIRST_START_TIMEOUT = 120.0


class GrammarBusy(Exception):
    """Every compile slot stayed taken for longer than the time limit: retry later."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class GrammarCache:
    """Compiled grammars by `cache_key`, least recently used dropped first once their sizes
    (xgrammar's `memory_size_bytes`) pass `max_bytes` (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, xgrammar.CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Key) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
            return compiled

    def put(self, key: Key, compiled: xgrammar.CompiledGrammar) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = compiled
            self._bytes += compiled.memory_size_bytes
            while self._bytes > self.max_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.memory_size_bytes


class BoundedCompiler:
    """`GrammarCompiler` behind the limits, the line, the workers and the cache (thread-safe)."""

    def __init__(self, compiler: GrammarCompiler, limits: GrammarLimits = GrammarLimits()) -> None:
        self.compiler = compiler
        self.limits = limits
        self.cache = GrammarCache(limits.cache_bytes)
        self.compiles = 0  # grammars compiled for the engine (cache misses that compiled)
        # started now, so their start (importing xgrammar) is behind them by the first request
        info_json = compiler.info.serialize_json()
        self._workers = [CompileWorker(info_json) for _ in range(limits.max_concurrent)]
        self._idle: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._pending: dict[Key, Future[xgrammar.CompiledGrammar]] = {}
        self._pending_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(
            limits.max_concurrent,
            thread_name_prefix="ngrammys-grammar",
            initializer=lowest_priority,
        )

    def submit(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar, when ready: at once from the cache; one compile for requests
        that ask for the same grammar meanwhile. Fails with `GrammarError` (its field named;
        `CompileTimeout` past the time limit) or `GrammarBusy`."""
        done: Future[xgrammar.CompiledGrammar] = Future()
        try:
            check_limits(spec, self.limits)
        except Exception as error:
            done.set_exception(error)
            return done
        key = cache_key(spec)
        compiled = self.cache.get(key)
        if compiled is not None:
            done.set_result(compiled)
            return done
        with self._pending_lock:
            pending = self._pending.get(key)
            started = pending is None
            if started:
                pending = self._threads.submit(self._compile, spec, key, time.monotonic())
                self._pending[key] = pending
        if started:
            # outside the lock: a compile already over (one that failed at once) runs this
            # callback here, now, and it takes the lock
            pending.add_done_callback(lambda done: self._forget(key, done))
        return pending

    def _forget(self, key: Key, done: Future[xgrammar.CompiledGrammar]) -> None:
        with self._pending_lock:
            if self._pending.get(key) is done:
                del self._pending[key]

    def _compile(self, spec: GrammarSpec, key: Key, queued: float) -> xgrammar.CompiledGrammar:
        timeout = self.limits.compile_timeout
        worker = self._idle.get()  # one per compile thread: never waits
        try:
            # in line (or while a worker killed before restarts) at most the time limit; the
            # server's start (its workers' first) is not the line's
            in_line = queued + timeout - time.monotonic()
            start = in_line if worker.replaced else max(in_line, FIRST_START_TIMEOUT)
            if in_line <= 0 or not worker.wait_ready(start):
                raise GrammarBusy(
                    f"{spec.field}: no grammar compile slot was free for {timeout:g} s "
                    f"(--grammar-max-concurrent {self.limits.max_concurrent}); retry shortly",
                    spec.field,
                )
            worker.check(spec, timeout)
        finally:
            self._idle.put(worker)
        compiled = self.compiler.compile(spec)
        self.compiles += 1
        self.cache.put(key, compiled)
        return compiled

    def wait_ready(self, timeout: float) -> bool:
        """Whether every worker process has started within `timeout` seconds (for a caller
        that must not meet a starting worker: tests, benches; call it while nothing compiles)."""
        workers = [self._idle.get() for _ in self._workers]
        try:
            deadline = time.monotonic() + timeout
            return all(w.wait_ready(max(deadline - time.monotonic(), 0.0)) for w in workers)
        finally:
            for worker in workers:
                self._idle.put(worker)

    def close(self) -> None:
        """Stop the compile threads (the compile under way, if any, is left to finish) and
        kill the worker processes."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.close()
