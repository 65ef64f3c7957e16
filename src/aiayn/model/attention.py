"""Multi-head attention (paper section 3.2) and every mask the model uses.

Dimension key: B batch, S source length, T target (query) length, H heads, D head dim (d_k = d_v),
L key length.

One mask convention: a bool tensor, True = may attend. The source padding mask has shape (B, 1, 1, S)
and broadcasts over heads and queries. The decoder's self-attention uses `is_causal`; while decoding
with a cache, one new query has no mask (the cache holds only the past) and several (a forced prefix)
get `causal_mask(T, device, past)`: the past and their own causal triangle. With right-padded targets a
real position never sees a pad, since every pad comes after it, and pad positions carry no loss.

One attention path: `torch.nn.functional.scaled_dot_product_attention`. Without attention dropout
(the paper has none) it takes PyTorch's fused kernels on CPU and GPU; a row with no key to attend to
(an all-padding sentence) comes out as zeros there, not NaN. The naive formula is the tests' oracle
(tests/reference.py), and `attention_weights` computes its weights again, beside SDPA, only for the
inspection recorder (`aiayn.attention`): never for the model's output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.model.kv_cache import KVCache

if TYPE_CHECKING:  # annotations only: aiayn.attention imports the model
    from aiayn.attention import _Recorders


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, S) token ids -> (B, 1, 1, S) bool, True at real tokens."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(t: int, device: torch.device | None = None, past: int = 0) -> Tensor:
    """(T, past + T) bool, True where query i may attend key j, i.e. j <= past + i (section 3.2.3).

    `past` keys come before the T queries: those a decoding cache already holds.
    """
    return torch.ones(t, past + t, dtype=torch.bool, device=device).tril(diagonal=past)


# Up to this length SDPA's math backend trains faster than the CPU flash kernel in bfloat16, whose
# backward is 2-3x slower on short sequences (benchmarks/RESULTS.md); longer ones keep flash's O(L) memory.
# The math backend runs in bfloat16 (`_bf16_math`): by default it upcasts q, k, v to float32, and those
# casts and float32 products made a bf16 `small` step 8% slower (200 against 184 ms, RESULTS.md). The price
# is accuracy: the scores are rounded to bfloat16 before the softmax, so the output lies 1.8-8x further from
# a float64 reference than the fused kernel's (mean error 7e-4 against 4e-4 for unit-variance q and k,
# 5.5e-3 against 7e-4 at standard deviation 4); the bf16 loss curve still tracks float32's (0.74%,
# RESULTS.md).
MATH_BACKEND_MAX_LEN = 256


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` of (B, H, T, D) queries over (B, H, L, D) keys -> (B, H, T, D).

    The one attention call of the model. PyTorch picks the kernel, except for CPU training in
    bfloat16 on short sequences (translation's usual case), where the math backend is faster.
    """
    # The lengths are looked at last: a compiled decoder step (no gradient) would otherwise be compiled
    # for lengths up to MATH_BACKEND_MAX_LEN only, and compiled again past it.
    cpu_bf16_training = q.requires_grad and q.device.type == "cpu" and q.dtype == torch.bfloat16
    if cpu_bf16_training and max(q.shape[-2], k.shape[-2]) <= MATH_BACKEND_MAX_LEN:
        # Heads split from a projection are strided views; the math backend's batched products would copy
        # the scaled q and k and v into (B*H, L, D) anyway, forward and backward. Copied here once, the
        # attention of a base-sized layer trains about 10% faster (64 x 32 tokens, 8 heads: 7.8 against
        # 8.7 ms, forward and backward, two threads of an AMD EPYC); the flash kernel (float32) is slower
        # with the copies, so only this branch makes them.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, H, T, D), (B, H, L, D) x 2
        with sdpa_kernel(SDPBackend.MATH), _bf16_math():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


@contextmanager
def _bf16_math():
    """Let SDPA's math backend multiply bfloat16 as bfloat16 (float32 accumulation inside the matmuls)
    instead of upcasting q, k, v to float32 first, as autocast does for every other matmul; restores
    the global flag afterwards. The backward replays the bfloat16 ops recorded here. (The flag lives in
    `torch.backends.cuda`, but the math backend reads it on every device; PyTorch has it from 2.5, the
    oldest pyproject admits.)"""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, H*D) -> (B, H, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)  # (B, H, T, D)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H*D): Concat(head_1, ..., head_h)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, T, H*D)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) for inspection: (B, H, T, D), (B, H, L, D) -> (B, H, T, L).

    Not on the model's compute path (that is SDPA); `MultiHeadAttention` calls it only when a
    recorder asks for weights, with the very q and k that SDPA received.
    """
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, T, L)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # A row with no key to attend to is all -inf; SDPA returns zeros there, so do we.
    return torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections are stored as one matrix each, as every implementation does. For
    self-attention W^Q, W^K, W^V are one packed Linear `qkv_proj` (one matmul instead of three); for
    encoder-decoder attention `q_proj` reads the decoder and the packed `kv_proj` reads the encoder
    output, so that a decoding cache can compute K and V of the source once.
    """

    def __init__(self, d_model: int, n_heads: int, self_attention: bool):
        super().__init__()
        if n_heads < 1 or d_model % n_heads:  # ModelConfig checks this; a direct caller met a reshape error
            raise ValueError(f"d_model={d_model} is not divisible into n_heads={n_heads} heads")
        self.n_heads = n_heads
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # [W^Q; W^K; W^V]
        else:
            self.q_proj = nn.Linear(d_model, d_model)  # W^Q
            self.kv_proj = nn.Linear(d_model, 2 * d_model)  # [W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        self.recorder: _Recorders | None = None  # set by `record_attention` to inspect weights

    def reset_parameters(self) -> None:
        """W^Q, W^K and W^V each Xavier-uniform as its own d x d matrix with gain 1/sqrt(2), W^O with gain 1,
        zero biases: fairseq's initialization. Xavier over a packed matrix would take its scale from the
        packing (3d x d, 2d x d or d x d gave the three attentions' W^Q three scales)."""
        d = self.out_proj.in_features
        packed = [self.qkv_proj] if self.self_attention else [self.q_proj, self.kv_proj]
        for linear in packed:
            for w in linear.weight.split(d):  # d x d views of W^Q, W^K, W^V
                nn.init.xavier_uniform_(w, gain=2**-0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for linear in [*packed, self.out_proj]:
            nn.init.zeros_(linear.bias)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder output (B, S, d_model) -> K, V each (B, H, S, D)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # 2 x (B, S, H*D)
        return split_heads(k, self.n_heads), split_heads(v, self.n_heads)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        Self-attention reads only `x`; encoder-decoder attention reads `memory` (B, S, d_model).
        `mask` is bool, True = attend. With a `cache`, self-attention appends this step's keys and
        values to those of the past steps in slot `layer`, and encoder-decoder attention projects the
        memory once per sentence and reuses it on every later step.
        """
        if mask is not None and mask.dtype != torch.bool:  # SDPA adds a float mask to the scores: a 0/1
            # mask attended to padding, silently (Transformer.decode refuses one; a caller of this did not)
            raise ValueError(f"mask is {mask.dtype}: it is bool, True = attend")
        if self.self_attention:
            b, t, _ = x.shape
            qkv = self.qkv_proj(x).view(b, t, 3, self.n_heads, -1)  # (B, T, 3, H, D)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
            if cache is not None:
                past = cache.length
                k, v = cache.append(layer, k, v)  # (B, H, past + T, D) each
                # One new query sees every cached key: no mask. Several (a forced prefix) see
                # the past and their own causal triangle.
                mask = None if q.shape[2] == 1 else causal_mask(q.shape[2], q.device, past)
                is_causal = False
        else:
            q = split_heads(self.q_proj(x), self.n_heads)  # (B, H, T, D)
            if cache is None:
                if memory is None:  # a TypeError inside linear(); a None test is all it costs per call
                    raise TypeError("encoder-decoder attention (self_attention=False) reads memory: pass the "
                                    "encoder output (B, S, d_model)")
                k, v = self.project_kv(memory)  # (B, H, S, D) each
            else:
                k, v = cache.cross_kv(layer, lambda: self.project_kv(memory))
                if q.shape[0] != k.shape[0]:  # K beams per sentence share its K/V (KVCache.beam_size)
                    return self.attend_shared(q, k, v, mask)
        return self.attend(q, k, v, mask, is_causal)

    def attend_shared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of (B*K, H, T, D) queries over (B, H, S, D) keys shared by the K rows of a sentence.

        The K*T queries of a sentence are one longer query block against its keys: no copy of K/V per
        beam, and beam reordering never touches them. A (B, 1, 1, S) mask broadcasts as before.
        """
        bk, h, t, d = q.shape
        b = k.shape[0]
        q = q.view(b, bk // b, h, t, d).transpose(1, 2).reshape(b, h, -1, d)  # (B, H, K*T, D)
        out = sdpa(q, k, v, mask)  # (B, H, K*T, D)
        if self.recorder is not None:
            self.recorder.append(attention_weights(q, k, mask, False).detach())
        out = out.view(b, h, bk // b, t, d).transpose(1, 2).reshape(bk, h, t, d)  # (B*K, H, T, D)
        return self.out_proj(merge_heads(out))  # (B*K, T, d_model)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        """Scaled dot-product attention of (B, H, T, D) queries over (B, H, L, D) keys, then W^O."""
        out = sdpa(q, k, v, mask, is_causal)  # (B, H, T, D)
        if self.recorder is not None:
            self.recorder.append(attention_weights(q, k, mask, is_causal).detach())
        return self.out_proj(merge_heads(out))  # (B, T, d_model)
