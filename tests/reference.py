"""Oracles we did not write ourselves, or that are the paper's formula spelt out naively.

- `naive_attention`: softmax(Q K^T / sqrt(d_k)) V in float64, masks as bool (True = attend).
- `TorchReference`: the same model built on `torch.nn.Transformer`, with weights copied from ours.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.model import Transformer


def naive_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Equation 1 of the paper in float64: (..., T, D), (..., L, D), (..., L, D) -> (..., T, D)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def copy_self_attention(theirs: nn.MultiheadAttention, ours) -> None:
    theirs.in_proj_weight.copy_(ours.qkv_proj.weight)
    theirs.in_proj_bias.copy_(ours.qkv_proj.bias)
    theirs.out_proj.load_state_dict(ours.out_proj.state_dict())


class TorchReference(nn.Module):
    """Our embeddings, positions and output projection around `torch.nn.Transformer`'s stacks."""

    def __init__(self, ours: Transformer):
        super().__init__()
        c = ours.config
        self.ours = ours
        self.pad_id = c.pad_id
        encoder_layer = nn.TransformerEncoderLayer(
            c.d_model, c.n_heads, c.d_ff, dropout=0.0, activation=c.activation if c.activation != "silu" else nn.functional.silu,
            layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.norm_first,
        )
        encoder = nn.TransformerEncoder(
            encoder_layer, c.n_layers, norm=nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.norm_first else None,
            enable_nested_tensor=False,
        )
        self.ref = nn.Transformer(
            custom_encoder=encoder,
            d_model=c.d_model, nhead=c.n_heads, num_encoder_layers=c.n_layers,
            num_decoder_layers=c.decoder_layers, dim_feedforward=c.d_ff, dropout=0.0,
            activation=c.activation if c.activation != "silu" else nn.functional.silu,
            layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.norm_first,
        )
        if not c.norm_first:  # nn.Transformer always adds a final LayerNorm; post-norm has none
            self.ref.decoder.norm = None
        self.copy_weights()

    @torch.no_grad()
    def copy_weights(self) -> None:
        ours, ref = self.ours, self.ref
        for a, b in zip(ours.encoder, ref.encoder.layers):
            copy_self_attention(b.self_attn, a.self_attn)
            b.linear1.load_state_dict(a.feed_forward.w_1.state_dict())
            b.linear2.load_state_dict(a.feed_forward.w_2.state_dict())
            b.norm1.load_state_dict(a.sublayer[0].norm.state_dict())
            b.norm2.load_state_dict(a.sublayer[1].norm.state_dict())
        for a, b in zip(ours.decoder, ref.decoder.layers):
            copy_self_attention(b.self_attn, a.self_attn)
            b.multihead_attn.in_proj_weight.copy_(torch.cat([a.src_attn.q_proj.weight, a.src_attn.kv_proj.weight]))
            b.multihead_attn.in_proj_bias.copy_(torch.cat([a.src_attn.q_proj.bias, a.src_attn.kv_proj.bias]))
            b.multihead_attn.out_proj.load_state_dict(a.src_attn.out_proj.state_dict())
            b.linear1.load_state_dict(a.feed_forward.w_1.state_dict())
            b.linear2.load_state_dict(a.feed_forward.w_2.state_dict())
            for j, norm in enumerate((b.norm1, b.norm2, b.norm3)):
                norm.load_state_dict(a.sublayer[j].norm.state_dict())
        if self.ours.config.norm_first:
            ref.encoder.norm.load_state_dict(ours.encoder_norm.state_dict())
            ref.decoder.norm.load_state_dict(ours.decoder_norm.state_dict())

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        t = tgt_in.shape[1]
        causal = ~torch.ones(t, t, dtype=torch.bool).tril()  # True = may not attend
        src_pad = src == self.pad_id  # nn.Transformer's convention: True = ignore
        h = self.ref(
            self.ours.src_embed(src), self.ours.tgt_embed(tgt_in), tgt_mask=causal,
            src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_in == self.pad_id, tgt_is_causal=True,
        )
        return self.ours.project(h)
