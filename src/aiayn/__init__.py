"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), for real use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aiayn.config import ConfigError, ModelConfig, model_config

if TYPE_CHECKING:
    from aiayn.model import KVCache, Transformer

__version__ = "0.1.0"
__all__ = ["ConfigError", "KVCache", "ModelConfig", "Transformer", "model_config"]


def __getattr__(name: str) -> Any:
    """`aiayn.Transformer` and `aiayn.KVCache` import torch on first use, not on `import aiayn`: every
    `aiayn` command imports this package, and torch took 1.6 of `aiayn --help`'s 1.7 seconds. A
    subpackage (`aiayn.model`, `aiayn.translate`...) is imported on first use too, as it was once
    `import aiayn` had imported the model."""
    if name in ("KVCache", "Transformer"):
        return getattr(importlib.import_module("aiayn.model"), name)
    if name.startswith("__"):  # hasattr(aiayn, "__main__") ran the command line, and exited
        raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
    try:
        return importlib.import_module(f"aiayn.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"aiayn.{name}":  # the module exists but lacks one of its own imports
            raise
        raise AttributeError(f"module 'aiayn' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    """With the names `__getattr__` imports on first use: `dir(aiayn)` left out Transformer and KVCache."""
    return sorted({*globals(), *__all__})
