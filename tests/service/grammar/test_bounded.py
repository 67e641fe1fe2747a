"""`BoundedCompiler` on the tiny vocabulary: a grammar compiled once and then taken from the
cache, a compile past its time limit refused and its worker replaced, a line that stays busy
refused as busy, and the cache bounded in bytes."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest

from service.grammar import BoundedCompiler, CompileTimeout, GrammarBusy, GrammarLimits
from service.grammar.bounded import GrammarCache
from service.grammar.compiler import GrammarError, GrammarSpec
from tests.helpers.grammar import schema_spec, slow_schema, tiny_compiler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
# compiles for seconds on any CPU
SLOW = GrammarSpec("json_schema", json.dumps(slow_schema(10)), field="response_format")


@pytest.fixture
def bounded():
    compiler = BoundedCompiler(tiny_compiler(), GrammarLimits(compile_timeout=0.5, max_bytes=2**20))
    assert compiler.wait_ready(120)
    yield compiler
    compiler.close()


def test_a_repeated_grammar_is_compiled_once(bounded) -> None:
    first = bounded.submit(schema_spec(SCHEMA)).result(timeout=60)
    spaced = GrammarSpec("json_schema", json.dumps(SCHEMA, indent=2))
    assert bounded.submit(spaced).result(timeout=1) is first
    assert bounded.compiles == 1


def test_a_compile_past_its_time_limit_is_refused_and_the_worker_replaced(bounded) -> None:
    began = time.monotonic()
    with pytest.raises(CompileTimeout) as refused:
        bounded.submit(SLOW).result(timeout=60)
    assert time.monotonic() - began < 5  # killed at its limit, not compiled to the end
    assert refused.value.field == "response_format" and "0.5 s" in str(refused.value)
    assert bounded.compiles == 0
    assert bounded.wait_ready(120)  # a new worker
    other = {"type": "array", "items": {"type": "integer"}}
    assert bounded.submit(schema_spec(other)).result(timeout=60) is not None
    assert bounded.compiles == 1


def test_a_compile_error_names_the_field_the_compile_named(bounded) -> None:
    spec = GrammarSpec("json_schema", '{"type": "nope"}', field="tools")
    with pytest.raises(GrammarError) as refused:
        bounded.submit(spec).result(timeout=120)
    assert refused.value.field == "tools" and not isinstance(refused.value, CompileTimeout)


def test_a_compile_over_before_its_callback_is_added_does_not_deadlock(bounded) -> None:
    """A compile that fails at once can be over before `submit` adds its done-callback, which
    then runs in `submit`'s own thread: it must not wait for a lock `submit` holds."""

    class AtOnce:  # runs each compile in the caller's thread: over before `submit` goes on
        def submit(self, fn, *args):
            done = Future()
            try:
                done.set_result(fn(*args))
            except Exception as error:
                done.set_exception(error)
            return done

        def shutdown(self, **_: object) -> None:
            pass

    bounded._threads = AtOnce()
    caller = threading.Thread(
        target=lambda: bounded.submit(GrammarSpec("json_schema", '{"type": "nope"}'))
    )
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive()
    assert not bounded._pending  # forgotten once over


def test_a_line_that_stays_busy_past_the_limit_is_refused_as_busy(bounded) -> None:
    slow = bounded.submit(SLOW)
    queued = bounded.submit(schema_spec({"type": "boolean"}))  # waits for the one slot
    with pytest.raises(GrammarBusy):
        queued.result(timeout=60)
    with pytest.raises(CompileTimeout):
        slow.result(timeout=60)


def test_the_cache_drops_the_least_recently_used_past_its_bytes() -> None:
    compiler = tiny_compiler()
    grammars = [
        compiler.compile(schema_spec({"type": "array", "maxItems": n})) for n in range(1, 4)
    ]
    cache = GrammarCache(sum(g.memory_size_bytes for g in grammars[:2]))
    cache.put(("json_schema", "1"), grammars[0])
    cache.put(("json_schema", "2"), grammars[1])
    assert cache.get(("json_schema", "1")) is grammars[0]  # now the most recently used
    cache.put(("json_schema", "3"), grammars[2])
    assert cache.get(("json_schema", "2")) is None
    assert cache.get(("json_schema", "1")) is grammars[0]
    assert cache.get(("json_schema", "3")) is grammars[2]
