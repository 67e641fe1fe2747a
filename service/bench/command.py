"""What the measurement commands' bodies share: the model their flags name, loaded, and the
error that stops a command with its message rather than a traceback."""

from __future__ import annotations

from service.engine.config import EngineConfig
from service.model.loader import LoadedModel, load_model


class UsageError(Exception):
    """The measurement cannot run as asked (a strategy the engine lacks, a reference whose
    package is missing): the command stops with this message."""


def load(model: str | None, config: EngineConfig) -> LoadedModel:
    """`model` (a directory or .gguf; None: the embedded one) on the device, in the dtype and the
    quantization `config` names, through its cache."""
    return load_model(model, config.device, config.dtype, config.cache_dir, config.quantization)
