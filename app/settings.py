"""One settings object for the server, read from `NGRAMMYS_*` variables and CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from drafting import STRATEGY_NAMES
from drafting.suffix import DEFAULT_CAPACITY
from service.engine.config import EngineConfig
from service.engine.params import SpeculationMode
from service.engine.scheduler import SchedulerConfig
from service.grammar import GrammarLimits
from service.model.loader import DEFAULT_CACHE_DIR

DEVICE_ROUND_SWITCH = {"auto": None, "on": True, "off": False}
Strategy = Literal[STRATEGY_NAMES]  # type: ignore[valid-type]
# a directory or a database URL, kept as written (a Path would fold a URL's "//"); a Path given
# in code is taken as its string
StoreLocation = Annotated[str, BeforeValidator(lambda value: str(value))]


class Settings(BaseSettings):
    """Server settings; each field is also a `ngrammys serve --flag` and a `NGRAMMYS_FLAG`."""

    model_config = SettingsConfigDict(env_prefix="NGRAMMYS_")

    model: str | None = Field(
        None,
        description="A local Hugging Face model directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    served_model_name: str | None = Field(
        None, description="Model name reported by the API (default: derived from the model)"
    )
    host: str = Field("0.0.0.0", description="Address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on")
    device: str | None = Field(
        None, description="torch device, e.g. cpu or cuda:0 (default: cuda if present)"
    )
    dtype: str | None = Field(
        None,
        description="float32, bfloat16 or float16 (default: bfloat16 on GPU; on a CPU float32 for "
        "the packed GGUF path, else bfloat16 with native bf16, float32 without)",
    )
    quantization: Literal["auto", "none", "gguf", "gguf-int8"] = Field(
        "auto",
        description="gguf: keep a GGUF's Q2_K/Q3_K/Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 "
        "linears and LM head packed (other types float32), the CPU fast path; gguf-int8: the "
        "same with the packed linears' "
        "activations rounded to 8 bits per block of 32 and a float16 KV cache, as llama.cpp "
        "computes (CPUs with AVX2 or AVX-512 VNNI); none: "
        "unpacked weights in the dtype; auto: gguf for a GGUF model of a packed family on a CPU "
        "(numba installed, dtype unset or float32), else none",
    )
    cache_dir: Path = Field(
        DEFAULT_CACHE_DIR,
        description="Where a GGUF's config, packed tiles, tables and profiles are cached",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks the model is split over (its heads and MLP columns), one GPU each (on a "
        "CPU, its cores shared), started by this command; Llama-family models, --quantization "
        "none, no model drafts or device round",
    )
    tensor_parallel_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds an exchange between the ranks (a pass, an idle ping) may wait; past "
        "it a rank is taken as lost and the server exits",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every pass eagerly: no CUDA graphs of the small passes (GPU; a CPU never "
        "records them)",
    )
    device_round: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Take the steps it can (every row decoding, no logprobs, grammar or logit "
        "controls; fixed mode with one shape, or auto) through the device round: drafts, tree "
        "check and KV commit on the model's device, one copy back a step; auto: on a GPU",
    )
    spec_mode: SpeculationMode = Field(
        "auto",
        description="off, fixed (k x w every round) or auto (the controller picks up to k x w)",
    )
    spec_k: int = Field(
        8, ge=0, le=64, description="Speculations per round (the maximum in auto mode)"
    )
    spec_w: int = Field(
        6, ge=0, le=64, description="Tokens per speculation (the maximum in auto mode)"
    )
    spec_strategy: Strategy = Field(
        "mixed",
        description="Draft strategy: context, extended_bigram, recycled, logit, suffix, unigram, "
        "bigram, token_recycling (the last three never in mixed), self_draft, draft_model, "
        "self_draft_staged, draft_model_staged (the model drafts when enabled) or mixed (all "
        "enabled but those three)",
    )
    suffix_cache_tokens: int = Field(
        DEFAULT_CAPACITY,
        ge=0,
        description="Recent output tokens of all requests the suffix strategy indexes (about 40 "
        "bytes each; 0 = off)",
    )
    self_draft: bool = Field(
        False,
        description="Enable the self_draft strategy: the model's first self_draft_layers "
        "layers (plus its final norm and LM head) draft for it; no extra weights",
    )
    self_draft_layers: int | None = Field(
        None,
        ge=1,
        description="Layers of the self-draft (default: 4/5 of the model's, measured in "
        "docs/benchmarks.md)",
    )
    draft_staged: bool = Field(
        False,
        description="Also serve self_draft_staged / draft_model_staged: the same drafts "
        "with their own chain guessed ahead by the context n-gram and verified in one pass",
    )
    draft_model: str | None = Field(
        None,
        description="Enable the draft_model strategy: a local Hugging Face directory or .gguf with "
        "the model's tokenizer, drafting for it (checked at start)",
    )
    model_tables: bool = Field(
        True,
        description="Derive the unigram/bigram draft tables from the model at start (background)",
    )
    cost_profile: bool = Field(
        True, description="Measure forward-pass costs at start (background; auto mode needs them)"
    )
    max_waiting: int = Field(
        64, ge=1, description="Requests that may wait for the engine; more get 429"
    )
    max_running_requests: int | None = Field(
        None,
        ge=1,
        description="Requests decoded together in one batch, one pass per step (default: 16 on "
        "CPU, 64 on GPU)",
    )
    max_tokens_per_pass: int = Field(
        512,
        ge=16,
        description="Tokens one pass may carry: prompt chunks, decode tokens and tree nodes of the "
        "whole batch",
    )
    max_prefill_tokens_while_decoding: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens a pass may carry while other requests decode (default: as many "
        "as prefill_pass_ms allows; 64 on CPU, max_tokens_per_pass on GPU until a cost profile is "
        "in use)",
    )
    prefill_pass_ms: float = Field(
        100.0,
        gt=0,
        description="While other requests decode, prompt chunks are sized by the cost profile so "
        "that a pass costs about this many ms (the inter-token time a loading prompt may cause)",
    )
    kv_cache_memory_mb: int | None = Field(
        4096,
        ge=1,
        description="KV cache budget in MiB; a request waits until it fits (none = unbounded)",
    )
    prefix_cache: bool = Field(
        True,
        description="Keep the KV of computed prompt and output blocks for later requests "
        "that start the same way, in the KV budget the running requests leave",
    )
    request_timeout: float | None = Field(
        600.0, gt=0, description="Seconds a request may take, queueing included"
    )
    drain_timeout: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: seconds running requests may take to finish before they are ended "
        "with an error",
    )
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After sent with 429")
    default_temperature: float = Field(
        1.0,
        ge=0,
        le=2,
        description="Temperature when a request gives none (OpenAI's default is 1; 0 = greedy)",
    )
    max_tokens: int = Field(256, ge=1, description="Default max_tokens when a request gives none")
    reasoning_parser: Literal["none", "think"] = Field(
        "none",
        description="think: a chat answer's <think>...</think> section (opened by the answer or "
        "by the chat template) is returned apart, as reasoning_content (reasoning items, thinking "
        "blocks); none: the answer is all text",
    )
    stored_responses: int = Field(
        1000,
        ge=0,
        description="Responses API: responses kept in memory for retrieval and "
        "previous_response_id, least recently used dropped first (0: none kept)",
    )
    stored_responses_mb: int = Field(
        64, ge=1, description="Responses API: memory the kept responses may take, in MiB"
    )
    batch_store: StoreLocation | None = Field(
        None,
        description="Batch jobs (/v1/files, /v1/batches): their store, kept across restarts: a "
        "directory (SQLite and the files; one server a store) or a postgresql:// URL (several "
        "replicas share it, each batch worked under a lease). Unset: batch jobs are off",
    )
    batch_lease_seconds: float = Field(
        30,
        gt=0,
        description="Batch jobs on a PostgreSQL store: how long a replica's claim on a batch "
        "lasts unless renewed (every third of it); a batch whose replica died is taken over "
        "once it has expired",
    )
    batch_concurrency: int = Field(
        16, ge=1, description="Batch jobs: lines of a batch in flight at once (at idle priority)"
    )
    batch_file_mb: int = Field(
        100, ge=1, description="Batch jobs: the largest file an upload may carry, in MiB"
    )
    batch_max_files: int = Field(
        1000, ge=1, description="Batch jobs: files the store keeps at most (outputs included)"
    )
    log_level: str = Field("info", description="Logging level")

    # Limits: a request beyond one gets a 4xx in OpenAI's error shape (README: Limits).
    max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body in bytes; more gets 413"
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens a request may send (default: the model's context); more "
        "gets 400",
    )
    max_tokens_cap: int = Field(
        4096,
        ge=1,
        description="Largest max_tokens / max_completion_tokens a request may ask for; more gets "
        "400 (not clamped)",
    )
    max_stop_sequences: int = Field(
        4, ge=0, description="Most stop strings per request; more gets 400"
    )
    max_stop_length: int = Field(
        256, ge=1, description="Longest stop string in characters; longer gets 400"
    )
    grammar_compile_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a request's grammar (response_format, tools) may take to compile; "
        "longer gets 400 naming the field and the compile is killed. Also the most a compile waits "
        "for a free slot; longer gets 429",
    )
    grammar_max_concurrent: int = Field(
        1,
        ge=1,
        description="Grammars compiled at once, each in a worker process at the lowest CPU "
        "priority; more wait in line",
    )
    grammar_max_bytes: int = Field(
        131_072,
        ge=1,
        description="Largest JSON schema (tools' schemas together, regex) in bytes; larger gets "
        "400 before any compile",
    )
    grammar_max_depth: int = Field(
        48,
        ge=1,
        description="Deepest nesting of a schema's JSON objects and arrays; deeper gets 400 before "
        "any compile (objects nested 10 deep, OpenAI's limit, are about 21)",
    )
    grammar_cache_mb: int = Field(
        512,
        ge=0,
        description="Compiled grammars kept for their next request, in MiB (least recently used "
        "dropped first)",
    )
    max_concurrent_per_key: int = Field(
        0,
        ge=0,
        description="Requests one API key may have in flight (0 = no limit; without keys all "
        "clients are one); more get 429",
    )

    # Authentication (README: Authentication).
    api_keys: str | None = Field(
        None,
        description="Comma-separated API keys accepted as `Authorization: Bearer KEY` (none and no "
        "file: no auth)",
    )
    api_key_file: Path | None = Field(
        None, description="A file of API keys, one per line (# comments and blank lines skipped)"
    )
    metrics_auth: bool = Field(False, description="Require an API key on /metrics too")
    web_ui: bool = Field(
        True,
        description="Serve the chat page with its speculation view at / (its data routes ask "
        "for an API key as the others do)",
    )

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> Settings:
        if self.max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must not exceed max_tokens_cap "
                f"({self.max_tokens_cap})"
            )
        return self

    def engine_config(self) -> EngineConfig:
        """What the engine and its runtime take from these settings."""
        memory = None if self.kv_cache_memory_mb is None else self.kv_cache_memory_mb * 2**20
        scheduler = SchedulerConfig(
            self.max_running_requests,
            self.max_tokens_per_pass,
            memory,
            self.max_prefill_tokens_while_decoding,
            self.prefill_pass_ms,
            self.prefix_cache,
        )
        return EngineConfig(
            scheduler=scheduler,
            max_waiting=self.max_waiting,
            request_timeout=self.request_timeout,
            model_tables=self.model_tables,
            cost_profile=self.cost_profile,
            cache_dir=self.cache_dir,
            enforce_eager=self.enforce_eager,
            device_round=DEVICE_ROUND_SWITCH[self.device_round],
            suffix_cache_tokens=self.suffix_cache_tokens,
            self_draft_layers=(self.self_draft_layers,)
            if self.self_draft
            else (),  # one depth (None: the default)
            draft_model=self.draft_model,
            draft_staged=self.draft_staged,
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            grammar_limits=GrammarLimits(
                self.grammar_compile_timeout,
                self.grammar_max_concurrent,
                self.grammar_max_bytes,
                self.grammar_max_depth,
                self.grammar_cache_mb * 2**20,
            ),
        )
