"""The decoder's state during incremental decoding, as an explicit object (paper section 3.2.3).

Auto-regressive decoding feeds one new target token per step. Recomputing the whole prefix each step
costs O(T^2) projections; instead each decoder layer's self-attention keys and values are written into
a buffer preallocated for the longest output (no concatenation per step), and the encoder-decoder
attention's keys and values, which depend only on the source, are computed once per sentence.

Dimension key: B batch (rows being decoded), L decoder layers, H heads, D head dim, S source length.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


class KVCache:
    """Self-attention K/V buffers (L, B, H, max_len, D) plus per-layer cross-attention K/V."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (n_layers, batch_size, n_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, max_len, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, max_len, D)
        self.length = 0  # target positions already stored (the same in every layer)
        self.cross: list[tuple[Tensor, Tensor] | None] = [None] * n_layers  # (B, H, S, D) pairs

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, D) new keys/values of `layer`; return all so far, (B, H, length + T, D).

        `length` moves on in `advance`, once every layer has appended, so all layers write the same slots.
        """
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; step {end} is past its end")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def cross_kv(self, layer: int, project: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The encoder-decoder K/V of `layer`, computed by `project()` on first use only."""
        if self.cross[layer] is None:
            self.cross[layer] = project()
        return self.cross[layer]  # type: ignore[return-value]

    def select(self, index: Tensor) -> None:
        """Keep (and reorder) batch rows `index` (beam search reordering, dropping finished rows)."""
        self.k = self.k.index_select(1, index)  # (L, B', H, max_len, D)
        self.v = self.v.index_select(1, index)
        self.cross = [None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                      for kv in self.cross]
