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
    `aiayn` command imports this package, and torch took 1.6 of `aiayn --help`'s 1.7 seconds."""
    if name in ("KVCache", "Transformer"):
        return getattr(importlib.import_module("aiayn.model"), name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
