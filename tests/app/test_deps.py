"""What the edge takes from the settings and the runtime: boolean switches, the engine's
config, and the runtime's accessors the routes read."""

from __future__ import annotations

import pytest

from app.cli import build_parser, serve_settings
from app.openapi import enabled_strategies
from app.settings import Settings
from service.controller.default_profile import default_profile
from service.controller.profiler import profile_path
from service.engine.config import EngineConfig
from service.model.runner import ModelRunner
from service.runtime import Runtime, WarmUpState
from tests.helpers.costs import CPU_LIKE


def served(*flags: str) -> Settings:
    return serve_settings(build_parser().parse_args(["serve", *flags]))


def test_boolean_settings_are_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NGRAMMYS_SELF_DRAFT", raising=False)
    assert served("--self-draft").self_draft is True
    assert served("--no-self-draft").self_draft is False
    assert served().self_draft is False
    assert served("--no-model-tables", "--enforce-eager").model_tables is False
    assert served("--enforce-eager").enforce_eager is True
    with pytest.raises(SystemExit):  # a switch takes no value
        build_parser().parse_args(["serve", "--self-draft", "true"])


def test_environment_still_sets_a_switch_and_a_flag_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NGRAMMYS_SELF_DRAFT", "true")
    assert served().self_draft is True
    assert served("--no-self-draft").self_draft is False


def test_engine_config_maps_the_settings() -> None:
    config = Settings(
        kv_cache_memory_mb=2,
        max_running_requests=3,
        max_waiting=5,
        request_timeout=7.0,
        model_tables=False,
        self_draft=True,
        self_draft_layers=2,
        draft_staged=True,
        suffix_cache_tokens=0,
        enforce_eager=True,
        quantization="none",
    ).engine_config()
    assert (
        config.scheduler.kv_cache_bytes == 2 * 2**20 and config.scheduler.max_running_requests == 3
    )
    assert (config.max_waiting, config.request_timeout) == (5, 7.0)
    assert (config.model_tables, config.cost_profile) == (False, True)
    assert (config.self_draft_layers, config.draft_staged, config.draft_model) == ((2,), True, None)
    assert (config.suffix_cache_tokens, config.enforce_eager, config.static_passes) == (
        0,
        True,
        False,
    )
    assert config.quantization == "none"
    assert Settings(self_draft=False, self_draft_layers=2).engine_config().self_draft_layers == ()
    assert Settings(self_draft=True).engine_config().self_draft_layers == (
        None,
    )  # the measured default depth
    assert Settings(kv_cache_memory_mb=None).engine_config().scheduler.kv_cache_bytes is None


def test_runtime_accessors_are_what_the_routes_read(tiny_served) -> None:
    runtime = Runtime.start(
        tiny_served, EngineConfig(model_tables=False, cost_profile=False, self_draft_layers=(1,))
    )
    try:
        assert (
            "self_draft" in runtime.enabled_strategies and "context" in runtime.enabled_strategies
        )
        assert runtime.vocab_size == tiny_served.model.config.vocab_size
        assert runtime.tokenizer is tiny_served.tokenizer
        assert runtime.warm_up_state == WarmUpState(
            cost_profile=False, cost_profile_source=None, model_tables=False, model_table_rows=0
        )
    finally:
        runtime.close()


def test_a_server_starts_from_its_saved_valid_profile_and_reports_its_state(
    tiny_served, tmp_path
) -> None:
    """The saved profile is in use at once, before any warm-up increment runs."""
    path = profile_path(tmp_path, ModelRunner(tiny_served.model))
    CPU_LIKE.save(path)
    runtime = Runtime.start(
        tiny_served, EngineConfig(model_tables=False, cost_profile=True, cache_dir=tmp_path)
    )
    try:
        state = runtime.warm_up_state
        assert state.cost_profile and runtime.engine.profile == CPU_LIKE
        assert state.cost_profile_source == "measured"
        assert runtime.engine.scheduler.profile == CPU_LIKE
        assert (
            state.profile is not None
            and state.profile.valid
            and state.profile.valid_since == path.stat().st_mtime
        )
        assert not state.profile.stale and state.profile.remeasures == {
            "adopted": 0,
            "failed": 0,
            "abandoned": 0,
        }
    finally:
        runtime.close()


def test_without_a_saved_profile_auto_prices_with_the_default_until_one_is_measured(
    tiny_served, tmp_path
) -> None:
    """Auto mode speculates from the start on the device class's conservative profile; the
    scheduler, whose prefill chunks would follow its guessed level, goes unpriced; a measured
    profile replaces it for both."""
    runtime = Runtime.start(
        tiny_served, EngineConfig(model_tables=False, cost_profile=True, cache_dir=tmp_path)
    )
    try:
        state, engine = runtime.warm_up_state, runtime.engine
        assert not state.cost_profile and state.cost_profile_source == "default"
        assert engine.profile == default_profile(engine.runner) and engine.scheduler.profile is None
        assert state.profile is not None and not state.profile.valid
        engine.profile = CPU_LIKE
        assert runtime.warm_up_state.cost_profile_source == "measured"
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "flags", [(), ("--self-draft", "--draft-staged")], ids=["plain", "self-draft staged"]
)
def test_the_published_strategies_are_the_ones_the_runtime_enables(tiny_served, flags) -> None:
    settings = served("--no-model-tables", "--no-cost-profile", *flags)
    runtime = Runtime.start(tiny_served, settings.engine_config())
    try:
        assert enabled_strategies(settings) == set(runtime.enabled_strategies)
    finally:
        runtime.close()
