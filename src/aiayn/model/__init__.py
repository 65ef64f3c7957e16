"""The model: attention and masks, the decoding cache, the Transformer itself."""

from aiayn.model.attention import MultiHeadAttention, causal_mask, padding_mask
from aiayn.model.kv_cache import KVCache
from aiayn.model.modes import evaluating
from aiayn.model.transformer import Transformer, sinusoidal_positions, target_positions

__all__ = ["KVCache", "MultiHeadAttention", "Transformer", "causal_mask", "evaluating", "padding_mask",
           "sinusoidal_positions", "target_positions"]
