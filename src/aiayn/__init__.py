"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), for real use."""

from aiayn.config import ConfigError, ModelConfig, model_config
from aiayn.model import KVCache, Transformer

__version__ = "0.1.0"
__all__ = ["ConfigError", "KVCache", "ModelConfig", "Transformer", "model_config"]
