"""The decoder's state during incremental decoding, as an explicit object (paper section 3.2.3).

Auto-regressive decoding feeds one new target token per step. Recomputing the whole prefix each step
costs O(T^2) projections; instead each decoder layer's self-attention keys and values are written into
a buffer preallocated for the longest output (no concatenation per step), and the encoder-decoder
attention's keys and values, which depend only on the source, are computed once per sentence.

Beam search decodes K hypotheses of each sentence as K rows. The cross-attention K/V of a sentence are
the same for all its beams, so they are stored once per sentence, (B, H, S, D), never copied K times
and never reordered when beams are: `MultiHeadAttention` lets the K queries of a sentence share them.

Dimension key: B sentences, K beams per sentence, L decoder layers, H heads, D head dim, S source length.
The self-attention buffers hold B*K rows (B when K = 1), time before heads: (L, B*K, max_len, H, D), so
that the filled past of a row is one contiguous block, which attention reads and beam reordering copies
(an H-major buffer leaves a gap after each head's filled positions). `append` and what it returns keep
attention's (B, H, T, D) shape, as views.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# what a step after `select` or `keep_sentences` must pass, said where it passed something else
_SELECTED = ", after a select its rows selected alike"


class KVCache:
    """Self-attention K/V buffers (L, B*K, max_len, H, D) plus per-layer cross-attention K/V (B, H, S, D)."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        beam_size: int = 1,
    ):
        sizes = {"n_layers": n_layers, "batch_size": batch_size, "n_heads": n_heads, "head_dim": head_dim,
                 "max_len": max_len, "beam_size": beam_size}
        for name, size in sizes.items():  # zero layers made a cache that decoded nothing; a float, a string
            # or a negative size failed in torch.zeros or a comparison, naming none
            if isinstance(size, bool) or not hasattr(type(size), "__index__"):
                raise TypeError(f"KVCache {name} is {type(size).__name__} ({size!r}): a whole number, at "
                                "least 1")
            if size < 1:
                raise ValueError(f"KVCache {name}={size}: at least 1")
        if batch_size % beam_size:
            raise ValueError(f"batch_size={batch_size} rows is not a multiple of beam_size={beam_size}")
        self.beam_size = beam_size  # K decoding rows per sentence share one cross-attention K/V row
        shape = (n_layers, batch_size, max_len, n_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B*K, max_len, H, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B*K, max_len, H, D)
        self._layers()
        self.length = 0  # target positions already stored (the same in every layer)
        self.cross: list[tuple[Tensor, Tensor] | None] = [None] * n_layers  # (B, H, S, D) pairs
        self.spare: tuple[Tensor, Tensor] | None = None  # second K/V buffers for beam reordering
        self.memory: Tensor | None = None  # what the cross K/V were projected from (B, S, d); after a
        # select of sentences, only its first position (B', 1, d): `memory_head`
        self.memory_head = False
        self.src_mask: Tensor | None = None  # and the mask of that memory (None: no padding)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def __repr__(self) -> str:
        return (f"KVCache(rows={self.k.shape[1]}, beam_size={self.beam_size}, length={self.length}, "
                f"max_len={self.max_len}, layers={self.k.shape[0]}, {self.k.dtype}, {self.k.device})")

    def check_step(self, rows: int, memory: Tensor, src_mask: Tensor | None, shape: tuple[int, int, int],
                   dtype: torch.dtype) -> None:
        """Before a decoding step of `rows` target rows over `memory` (B, S, d): the cache's rows, and the
        memory its cross-attention K/V were projected from on the first step (a later one was ignored: the
        step attended over the first memory's keys with the second's mask): the same values, not only the
        same shape, and the same `src_mask`; after sentences are selected, the selected memory and mask
        (a search selects its own alike). Pass the same tensors at every step: others, even equal ones made
        again, are compared by value, which on a GPU waits for the device at every step. `shape`: the
        model's (decoder layers, heads, head size), which a hand-made cache must have (fewer layers were an
        IndexError, other heads a size mismatch); `dtype` the model's, which it must hold (another failed
        inside SDPA: "Expected query, key, and value to have the same dtype")."""
        compiling = torch.compiler.is_compiling()  # the shape checks are traced into the graph's guards
        mine = (self.k.shape[0], self.k.shape[3], self.k.shape[4])
        if not compiling and mine != shape:  # dynamo's fake tensors fail on it
            raise ValueError(f"KVCache has (layers, heads, head size) {mine}, the model {shape}: make it "
                             "with the model's new_cache")
        if self.k.dtype != dtype:
            raise TypeError(f"KVCache holds {self.k.dtype}, the model computes in {dtype}: make it with the "
                            "model's new_cache")
        if rows != self.k.shape[1]:
            raise ValueError(f"KVCache holds {self.k.shape[1]} rows; this step has {rows}")
        cross = self.cross[0][0] if self.cross[0] is not None else None  # layer 0's keys, (B, H, S, D)
        sentences, src_len = memory.shape[0], memory.shape[1]
        if cross is not None and (cross.shape[0], cross.shape[2]) != (sentences, src_len):
            raise ValueError(f"KVCache was filled for a memory of {cross.shape[0]} x {cross.shape[2]} source "
                             f"positions, not {sentences} x {src_len}: a new source needs a new cache")
        if compiling:
            return
        self._check_writable()
        if cross is not None and self.memory is not None:
            self._check_same_source(memory, src_mask)
        self.memory, self.memory_head, self.src_mask = memory, False, src_mask

    def _check_same_source(self, memory: Tensor, src_mask: Tensor | None) -> None:
        """The memory and mask of this step are the first step's. Compared by identity first: a search
        passes the same tensors at every step, and comparing values reads them back from a GPU."""
        if memory is not self.memory:
            # another tensor: a view, a copy or encode() again are the same source (on a GPU, encode()
            # again may differ in the last bits; NaN is NaN); other values are not
            theirs = memory[:, :1] if self.memory_head else memory  # (B, 1, d) after a select
            if theirs.shape != self.memory.shape or not torch.allclose(theirs, self.memory, rtol=1e-4,
                                                                        atol=1e-5, equal_nan=True):
                raise ValueError("KVCache was filled from another memory: pass the same memory at every "
                                 f"step{_SELECTED * self.memory_head} (a new source needs a new cache)")
        if src_mask is not self.src_mask and not _same_mask(src_mask, self.src_mask):
            # a mask on the first step and None on the next attended to the padding, silently
            raise ValueError("KVCache was filled with another src_mask: pass the same mask at every step"
                             f"{_SELECTED * self.memory_head} (None only where no source has padding)")

    def _check_writable(self) -> None:
        """The buffers can be written here: PyTorch refuses in-place updates of tensors made under
        torch.inference_mode() outside it ("Inplace update to inference tensor outside InferenceMode")."""
        if self.k.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError("KVCache was made under torch.inference_mode(), whose tensors PyTorch updates "
                               "only inside it: decode and select with it under torch.inference_mode() too")

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, D) new keys/values of `layer`; return all so far, (B, H, length + T, D).

        `length` moves on in `advance`, once every layer has appended, so all layers write the same slots.
        """
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # the buffers keep no graph: the
            # copy failed with a message about views made in no_grad mode
            raise RuntimeError("decoding with a KVCache needs torch.no_grad() or torch.inference_mode(): the "
                               "cache keeps no gradients")
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; step {end} is past its end")
        k_layer, v_layer = self.k_layers[layer], self.v_layers[layer]  # (B*K, max_len, H, D) views
        k_layer.narrow(1, self.length, k.shape[2]).copy_(k.transpose(1, 2))  # (B*K, T, H, D)
        v_layer.narrow(1, self.length, k.shape[2]).copy_(v.transpose(1, 2))  # (B*K, T, H, D)
        # (B*K, H, length + T, D) each: every position so far
        return k_layer.narrow(1, 0, end).transpose(1, 2), v_layer.narrow(1, 0, end).transpose(1, 2)

    def _layers(self) -> None:
        """Per-layer views of the buffers, made once per buffer rather than indexed on every append."""
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    def advance(self, steps: int) -> None:
        self.length += steps

    def cross_kv(self, layer: int, project: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The encoder-decoder K/V of `layer`, computed by `project()` on first use only.

        Stored contiguous: `project()` returns head views into one packed projection, which every later
        step would read with a stride (SDPA over them, beam 4 x 16 rows, 24 source positions, caches
        flushed as a step's weights flush them: 471 us against 424 us contiguous; benchmarks/RESULTS.md)."""
        if self.cross[layer] is None:
            k, v = project()  # (B, H, S, D) views
            self.cross[layer] = (k.contiguous(), v.contiguous())
        return self.cross[layer]  # type: ignore[return-value]

    def select(self, index: Tensor) -> None:
        """Keep (and reorder) self-attention rows `index` (B'*K,): beam search reordering, or dropping
        finished rows. Cross-attention rows follow only without beams (K = 1, one row per sentence);
        with beams they belong to sentences, so `index` reorders all B*K rows (dropping sentences is
        `keep_sentences`) and each row must take the past of a row of its own sentence (index[r] // K
        == r // K): a row given another sentence's past would attend over its own sentence's source with
        the other's target prefix. That is the caller's contract, not checked: checking it reads `index`
        back from a GPU (a wait for the device at every beam step)."""
        self._check_writable()
        if index.dim() != 1:
            raise ValueError(f"KVCache.select takes a (rows,) index, not one of shape {tuple(index.shape)}")
        if self.beam_size > 1 and index.shape[0] != self.k.shape[1]:  # the next step failed on the rows
            raise ValueError(f"KVCache.select with beams reorders all {self.k.shape[1]} rows, not "
                             f"{index.shape[0]}: drop whole sentences with keep_sentences")
        if self.beam_size == 1:  # rows are sentences: the caller selects its memory alike and passes that
            self._select_source(index)
        if index.shape[0] == self.k.shape[1]:  # a reordering (each beam step)
            # Most beams continue their own hypothesis (94% of rows per step in benchmarks/decode.py):
            # on a CPU, copy only the rows that take another row's past, when they are few. Not on a
            # GPU: finding them reads the index back (a wait for the device at every beam step), and
            # a copy per row is a kernel launch each, where the gather below is one.
            moved = None
            if index.device.type == "cpu":
                moved = (index != torch.arange(index.shape[0], device=index.device)).nonzero()[:, 0]  # (M,)
            if moved is not None and 2 * moved.shape[0] <= index.shape[0]:
                self._copy_rows(index[moved], moved)
                if self.beam_size == 1:
                    self._select_cross(index)
                return
            # Gather the filled part into a second buffer and swap: one pass, no allocation, no copy
            # back (3.6x faster than an in-place gather at batch 16 x beam 4, base shape).
            if self.spare is None:
                self.spare = (torch.empty_like(self.k), torch.empty_like(self.v))
            k, v = self.spare
            self._gather_past(index, k, v)
            self.spare, self.k, self.v = (self.k, self.v), k, v
        else:  # rows that finished leave
            self._take_rows(index)
        self._layers()
        if self.beam_size == 1:
            self._select_cross(index)

    def _copy_rows(self, source: Tensor, target: Tensor) -> None:
        """Row target[i] takes the filled past of row source[i]; all sources are read before any write.

        One strided copy per moved row: a handful per step, where `index_select` + `index_copy_` over
        the non-contiguous filled part took 25x longer (1.1 ms against 0.05 ms per buffer, 4 of 64 rows,
        `base` shape; 4 of a beam 4 x batch 16 step's 60 ms went to it).
        """
        n = self.length
        pairs = list(zip(source.tolist(), target.tolist()))
        read_later = {s for s, _ in pairs} & {t for _, t in pairs}  # sources overwritten before read
        for buf in (self.k, self.v):
            past = buf[:, :, :n]  # (L, B*K, n, H, D), a view
            saved = {s: past[:, s].clone() for s in read_later}  # (L, n, H, D) each
            for s, t in pairs:
                past[:, t].copy_(saved[s] if s in saved else past[:, s])

    def expand_beams(self, index: Tensor, beam_size: int) -> None:
        """Grow the one self-attention row of each sentence into `beam_size` rows, row i taking the past
        of row index[i] (B*K,): beam search after its first step, which decodes one row per sentence
        (its K beams all start from the same empty hypothesis). The cross K/V stay one per sentence."""
        self._take_rows(index)
        self.beam_size = beam_size
        self._layers()

    def _take_rows(self, index: Tensor) -> None:
        """New buffers of len(index) rows, row i holding the filled past of row index[i].

        Only the `length` filled positions are copied; the rest is left uninitialized, as `append`
        writes every position before attention reads it. (`index_select` of whole max_len buffers
        copied mostly unfilled slots: dropping finished sentences took 1.6 s of a 13.3 s beam 4
        translation of Multi30k's 1,014 validation lines, one thread, and 0.6 s this way.)
        """
        shape = (self.k.shape[0], index.shape[0], *self.k.shape[2:])  # (L, len(index), max_len, H, D)
        k, v = self.k.new_empty(shape), self.v.new_empty(shape)
        self._gather_past(index, k, v)
        self.k, self.v, self.spare = k, v, None

    def _gather_past(self, index: Tensor, k: Tensor, v: Tensor) -> None:
        """Row i of the buffers `k`, `v` (L, len(index), max_len, H, D) takes the filled past of row
        index[i]: only the `length` positions written so far are read and written."""
        n = self.length
        torch.index_select(self.k[:, :, :n], 1, index, out=k[:, :, :n])  # (L, len(index), n, H, D)
        torch.index_select(self.v[:, :, :n], 1, index, out=v[:, :, :n])

    def keep_sentences(self, index: Tensor) -> None:
        """Keep (and reorder) whole sentences `index` (B',): their K rows each and their cross K/V."""
        self._select_source(index)  # the caller selects its memory alike and passes that
        k = self.beam_size
        rows = (index[:, None] * k + torch.arange(k, device=index.device)).flatten()  # (B'*K,)
        self._take_rows(rows)
        self._layers()
        self._select_cross(index)

    def _select_source(self, index: Tensor) -> None:
        """The memory and mask rows of sentences `index` (B',), which the next step's must be. Of the memory
        only the first position of each row is kept and compared, (B', 1, d): it tells sentences apart
        (the encoder mixes every position into it): selected and compared whole, a 64 x 30 x 512 memory
        took 38 ms a select on one thread, a third of a `base` greedy step, against 0.3 ms so. (Forgotten,
        as before, the next step ran with the memory and mask of the rows before the select, off by 0.2
        in the logits, or with another memory ignored.) The mask, (B', 1, 1, S) bools, is kept whole.
        On a GPU forgotten, as before: the next step's comparison (the search's selected tensors are new
        ones) would wait for the device at every select, a beam-1 beam_search's every step."""
        if self.memory is not None and self.memory.device.type != "cpu":
            self.memory = self.src_mask = None  # the next step's are taken as they come
            return
        if self.memory is not None:
            head = self.memory if self.memory_head else self.memory[:, :1]  # (B, 1, d)
            self.memory, self.memory_head = head.index_select(0, index), True  # (B', 1, d)
        if self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, index)  # (B', 1, 1, S)

    def _select_cross(self, index: Tensor) -> None:
        self.cross = [None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                      for kv in self.cross]


def _same_mask(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two (B, 1, 1, S) source masks let attention see the same positions; None masks none."""
    if a is b:
        return True
    if a is None or b is None:
        return bool((b if a is None else a).all())  # type: ignore[union-attr]
    return a.shape == b.shape and torch.equal(a, b)
