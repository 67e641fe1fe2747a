"""What a server runs: the loaded model, its engine behind the async worker, and the warm-up
(cost profile, model tables) that the worker runs in increments while idle."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Literal

from transformers import PreTrainedTokenizerBase
from xgrammar import CompiledGrammar

from drafting import ModelTables, Strategy, TableSlot, compile_table_kernels, default_mixer
from service.controller.cost_profile import CostProfile
from service.controller.default_profile import default_profile
from service.controller.profile_keeper import ProfileKeeper, ProfileState
from service.controller.profiler import load_or_measure
from service.engine.async_engine import AsyncEngine
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.outputs import StepStats
from service.engine.params import GenerationParams
from service.grammar import BoundedCompiler, GrammarCompiler, GrammarError, GrammarSpec
from service.kernels.packed_linear import kernels_error
from service.model.loader import LoadedModel
from service.model.prompts import assistant_prefix_ids, stop_token_ids
from service.model.runner import ModelRunner
from service.model.tables import load_or_compute_tables, load_or_compute_tables_steps
from service.model_drafts.draft_model import ModelDrafter, load_drafters
from service.parallel.group import Control
from service.parallel.launch import RankShard
from service.parallel.ranks import PodRanks
from service.parallel.runner import ParallelRunner
from service.parallel.shard import NotShardable

log = logging.getLogger(__name__)
TABLE_BATCH = 128  # vocabulary tokens per warm-up increment (short, so requests wait little)


def drafters_for(loaded: LoadedModel, config: EngineConfig) -> list[ModelDrafter]:
    """The model-running draft strategies `config` enables (`service/model_drafts/draft_model.py`),
    a draft model loaded as `config` says the target was."""
    return load_drafters(
        loaded,
        config.self_draft_layers,
        config.draft_model,
        config.cache_dir,
        config.device,
        config.dtype,
        config.quantization,
        config.draft_staged,
    )


def build_engine(
    loaded: LoadedModel,
    tables: TableSlot,
    config: EngineConfig = EngineConfig(),
    drafters: Sequence[Strategy] = (),
    runner: ModelRunner | None = None,
) -> Engine:
    """The engine for `loaded`, drafting with every strategy over `tables` and `drafters`
    (`drafters_for`: loaded once, they may serve several engines), its passes run by `runner`
    (default: one over `loaded.model` on its device)."""
    model_config = loaded.model.config
    runner = runner or ModelRunner(loaded.model, static_passes=config.static_passes)
    eos_token_ids = stop_token_ids(loaded.tokenizer, model_config.eos_token_id)
    return Engine(
        runner,
        default_mixer(tables, drafters, config.suffix_cache_tokens),
        eos_token_ids=eos_token_ids,
        max_context=model_config.max_position_embeddings,
        scheduler_config=config.scheduler,
        grammars=grammar_compiler(
            loaded.tokenizer, runner.vocab_size, tuple(sorted(eos_token_ids))
        ),
        device_round=config.device_round,
    )


@functools.lru_cache(maxsize=4)
def grammar_compiler(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompiler:
    """One grammar compiler per tokenizer, shared by its engines (reading a large vocabulary
    takes a while)."""
    return GrammarCompiler.for_tokenizer(tokenizer, vocab_size, eos_token_ids)


def build_engine_with_tables(
    loaded: LoadedModel, config: EngineConfig = EngineConfig(), drafters: Sequence[Strategy] = ()
) -> Engine:
    """An engine whose model tables (and cost profile, if `config.cost_profile`) are ready
    before it returns."""
    prefix = assistant_prefix_ids(loaded.tokenizer)
    tables = TableSlot(load_or_compute_tables(loaded.model, config.cache_dir, prefix))
    engine = build_engine(loaded, tables, config, drafters)
    if config.cost_profile:
        engine.profile = load_or_measure(engine.runner, config.cache_dir)
    return engine


def model_tables_steps(
    loaded: LoadedModel, config: EngineConfig
) -> Generator[ModelTables | None, None, ModelTables]:
    """The model tables from the cache, or computed (and saved) in increments."""
    prefix = assistant_prefix_ids(loaded.tokenizer)
    return load_or_compute_tables_steps(
        loaded.model, config.cache_dir, prefix, TABLE_BATCH, show_progress=False
    )


def warm_up(
    engine: Engine,
    keeper: ProfileKeeper | None,
    tables: Generator[ModelTables | None, None, ModelTables] | None,
) -> Generator[bool | None, None, None]:
    """The warm-up as increments, for as long as the server runs (yields False while there is
    nothing to do). First the successor tables' compiled refresh and walk, which every round of
    a request drafting from them runs. Then the cost profile's `keeper` (a first valid profile,
    later probes and re-measures: `service/controller/profile_keeper.py`) before anything else;
    the model `tables` (None: none to make) are computed in the increments the keeper leaves free
    (while it waits for a steady load or its back-off); the strategies draft from the rows
    done so far as they come."""
    compile_table_kernels()
    yield None
    profiling = keeper.steps() if keeper is not None else itertools.repeat(False)
    while True:
        if next(profiling) is not False:
            yield True
        elif tables is not None:
            try:
                partial = next(tables)
            except StopIteration as done:
                engine.mixer.tables.tables = done.value
                tables = None
                log.info("model tables ready: unigram/bigram strategies enabled")
            else:
                if partial is not None:
                    if engine.mixer.tables.tables is None:
                        log.info(
                            "model tables: drafting from the first %d tokens' rows while the "
                            "rest are computed",
                            len(partial.bigram),
                        )
                    engine.mixer.tables.tables = partial
            yield True
        else:
            yield False


def profile_keeper(engine: Engine, config: EngineConfig) -> ProfileKeeper | None:
    """The keeper of `engine`'s cost profile, started from the saved one if valid, else from
    the device class's default until one is measured (None if `config` measures none: auto mode
    then decodes plainly)."""
    if not config.cost_profile:
        return None

    def adopt(profile: CostProfile) -> None:
        engine.profile = profile

    keeper = ProfileKeeper.for_runner(engine.runner, config.cache_dir, engine.calibration, adopt)
    if keeper.profile is None:
        engine.use_default_profile(default_profile(engine.runner))
    return keeper


@dataclass(frozen=True)
class WarmUpState:
    """How far the background warm-up got."""

    cost_profile: bool  # a valid one measured or loaded
    # what auto mode prices passes with: this machine's measured profile, the device class's
    # conservative default, or nothing (auto decodes plainly)
    cost_profile_source: Literal["measured", "default"] | None
    model_tables: bool  # computed (all of them) or loaded
    # the tokens whose rows the table strategies draft from: the vocabulary once computed, the
    # first ids' while they are (0: none yet)
    model_table_rows: int
    # the keeper's account (None: the server measures no profile)
    profile: ProfileState | None = None


@dataclass
class Runtime:
    """What a server needs to answer requests: tokenizer, engine, and the engine's worker.

    The accessors below are what the HTTP edge reads, so it need not know how the engine
    holds them."""

    loaded: LoadedModel
    engine: Engine
    async_engine: AsyncEngine
    keeper: ProfileKeeper | None = None
    pod: PodRanks | None = None  # the tensor-parallel ranks this process started
    # the requests' grammar compiles, bounded (None: the engine has no tokenizer)
    grammars: BoundedCompiler | None = None

    @classmethod
    def start(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> Runtime:
        """Serve at once; the worker measures (or loads) the cost profile and the model
        tables while idle. Until then auto mode decodes plainly and the table strategies
        propose nothing. The model drafts `config` enables load first (a draft model that
        cannot draft for `loaded` raises here)."""
        engine = build_engine(loaded, TableSlot(), config, drafters_for(loaded, config))
        return cls._serving(
            loaded,
            engine,
            config,
            model_tables_steps(loaded, config) if config.model_tables else None,
            on_step,
        )

    @classmethod
    def start_parallel(
        cls,
        shard: RankShard,
        config: EngineConfig,
        on_lost: Callable[[BaseException], None],
        on_step: Callable[[StepStats], None] | None = None,
        pod: PodRanks | None = None,
    ) -> Runtime:
        """`start` as rank 0 of tensor-parallel ranks (`service/parallel/`): the engine's passes
        run on every rank; `on_lost` is told if a rank is lost; `pod`: the ranks this process
        started, waited for at `close`. No model drafts, no device round; the model tables are
        those the cache holds for the whole model, or computed over the ranks and saved there."""
        if config.self_draft_layers or config.draft_model:
            raise NotShardable(
                "the model-running draft strategies do not run under tensor parallelism"
            )
        if config.device_round:
            raise NotShardable("the device round does not run under tensor parallelism")
        config = replace(config, device_round=False)
        runner = ParallelRunner(
            shard.loaded.model,
            Control(shard.control_group, on_lost, shard.timeout),
            shard.place.world,
        )
        engine = build_engine(shard.loaded, TableSlot(shard.tables), config, runner=runner)
        tables = None
        if config.model_tables and shard.tables is None:
            prefix = assistant_prefix_ids(shard.loaded.tokenizer)
            tables = runner.table_steps(prefix, shard.tables_path, TABLE_BATCH)
        return cls._serving(shard.loaded, engine, config, tables, on_step, pod)

    @classmethod
    def _serving(
        cls,
        loaded: LoadedModel,
        engine: Engine,
        config: EngineConfig,
        tables: Generator[ModelTables | None, None, ModelTables] | None,
        on_step: Callable[[StepStats], None] | None,
        pod: PodRanks | None = None,
    ) -> Runtime:
        """`engine` behind its worker, which warms up (the cost profile's keeper, `tables`) while
        idle."""
        # the grammar workers start first: their start (spawned processes) is not raced by the
        # engine's warm-up
        grammars = (
            None
            if engine.grammars is None
            else BoundedCompiler(engine.grammars, config.grammar_limits)
        )
        keeper = profile_keeper(engine, config)
        async_engine = AsyncEngine(
            engine,
            config.max_waiting,
            config.request_timeout,
            warm_up(engine, keeper, tables),
            on_step,
        )
        return cls(loaded, engine, async_engine, keeper, pod, grammars)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    @property
    def max_context(self) -> int:
        """Tokens a request's prompt and answer may take together (the model's context)."""
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        """Token ids the model's embedding has (its config's vocabulary, which may be larger or
        smaller than the tokenizer's)."""
        return self.loaded.model.config.vocab_size

    @property
    def enabled_strategies(self) -> list[str]:
        """The strategy names a request may ask for: the built-in ones and the model drafts
        this server was started with."""
        return self.engine.mixer.names

    @property
    def kernels_fallback(self) -> str | None:
        """Why the packed CPU path runs on its torch fallback (the numba kernels failed to
        load), or None."""
        return kernels_error()

    @property
    def warm_up_state(self) -> WarmUpState:
        tables = self.engine.mixer.tables.tables
        return WarmUpState(
            cost_profile=self.engine.scheduler.profile is not None,
            cost_profile_source=(
                None
                if self.engine.profile is None
                else "measured"
                if self.engine.scheduler.profile is not None
                else "default"
            ),
            model_tables=tables is not None and len(tables.bigram) == self.vocab_size,
            model_table_rows=0 if tables is None else len(tables.bigram),
            profile=None if self.keeper is None else self.keeper.state,
        )

    def check_fits(self, num_prompt_tokens: int, params: GenerationParams) -> None:
        """`Engine.check_fits`: raises `ContextTooLong` or `DoesNotFit` (thread-safe)."""
        self.engine.check_fits(num_prompt_tokens, params)

    def compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A request's grammar, compiled within the limits (`BoundedCompiler.submit`): it fails
        with `GrammarError` naming the field, or `GrammarBusy` (thread-safe; returns at once)."""
        if self.grammars is None:
            refused: Future[CompiledGrammar] = Future()
            refused.set_exception(
                GrammarError("structured output needs the model's tokenizer", spec.field)
            )
            return refused
        return self.grammars.submit(spec)

    def close(self) -> None:
        """Stop the engine's worker, the grammar workers, then the other ranks' (if any)."""
        self.async_engine.shutdown()
        if self.grammars is not None:
            self.grammars.close()
        if self.pod is not None:
            self.pod.stopping()
        if isinstance(self.engine.runner, ParallelRunner):
            self.engine.runner.close()
        if self.pod is not None:
            self.pod.wait()
