"""The Transformer (paper section 3, Figure 1): embeddings, positions, encoder and decoder stacks.

Dimension key: B batch, S source length, T target length, V vocabulary, d = d_model.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from aiayn.config import POSITIONS, ModelConfig
from aiayn.model.attention import MultiHeadAttention, padding_mask
from aiayn.model.dropout import Dropout
from aiayn.model.kv_cache import KVCache


def sinusoidal_positions(max_len: int, d_model: int, layout: str = "interleaved",
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """(max_len, d_model) table of section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos,
    computed in float64 and rounded once to `dtype`.

    `interleaved` is the paper's layout (sin in even columns, cos in odd ones). `sin_cos` puts every sine
    first and every cosine after it, as Marian (and HuggingFace's MarianMT) does: the same frequencies
    in a fixed permutation of the columns, but weights trained with one layout only work with it.
    (fairseq and tensor2tensor also use sin-then-cos, with frequencies 10000^(-i/(d/2 - 1)).)
    """
    if layout not in POSITIONS:  # any other string fell into the sin_cos branch: wrong positions, silently
        raise ValueError(f"positions layout {layout!r} is not one of {', '.join(POSITIONS)}")
    if d_model < 2 or d_model % 2 or max_len < 0:  # an odd d_model gave a table of d_model + 1 columns
        raise ValueError(f"sinusoidal_positions({max_len}, {d_model}): d_model is an even number >= 2 (a "
                         "sine and a cosine per frequency) and max_len >= 0")
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angles = pos * inv_freq  # (max_len, d/2)
    if layout == "interleaved":
        pe = torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)  # (max_len, d)
    else:  # sin_cos
        pe = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # (max_len, d)
    return pe.to(dtype)


def target_positions(tgt_out: Tensor, pad_id: int) -> Tensor:
    """(B, T) target ids -> (N,) long: the flat (row-major) indices of the N non-pad positions, those that
    carry a loss; `Transformer.decode` projects only them. Built on the host (`collate`): on a GPU,
    finding them waits for the device."""
    return (tgt_out != pad_id).flatten().nonzero()[:, 0]  # (N,)


def _building_on_meta() -> bool:
    """Whether modules are being built on the meta device (`with torch.device("meta")`), where
    `model_from_weights` builds a model to load weights into: nothing is drawn or computed there, as
    normal_ and arange on meta import torch._dynamo, 1.3 s of every checkpoint load."""
    return torch.empty(0).is_meta


class Embeddings(nn.Module):
    """Token embedding times sqrt(d_model) plus sinusoidal positions, then dropout (sections 3.4, 3.5, 5.4)."""

    def __init__(self, embed: nn.Embedding, config: ModelConfig, side: str = "src"):
        super().__init__()
        self.side = side  # "src" or "tgt_in", named when a sequence is too long
        self.embed = embed  # may be shared with the other stack and the output projection
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        # Nothing to compute on the meta device; the buffer's device is the default one, not the
        # embedding's: accelerate's init_empty_weights puts parameters alone on meta. Its dtype is the
        # embedding's: under torch.set_default_dtype(torch.float64) a float32 table was added to float64 ones
        dtype = embed.weight.dtype
        pe = torch.empty(config.max_len, config.d_model, dtype=dtype) if _building_on_meta() else \
            sinusoidal_positions(config.max_len, config.d_model, config.positions, dtype)
        self.register_buffer("pe", pe, persistent=False)  # (max_len, d): a function, not a weight
        self.dropout = Dropout(config.dropout)
        self.config = config

    def reset_parameters(self) -> None:
        """Compute the position table again (after `to_empty` it is uninitialized memory). The token
        embedding is `embed`'s, initialized by `Transformer.reset_parameters`."""
        c = self.config
        pe = sinusoidal_positions(c.max_len, c.d_model, c.positions, self.pe.dtype)
        self.pe = pe.to(self.pe.device)  # (max_len, d)

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply` (behind `.to`, `.double()`, `.half()`), then, where the table's dtype
        changed, the table computed again in the new one: cast, a float64 model kept float32-accurate
        positions (3e-8 off), and `.to(torch.bfloat16).float()` kept them rounded to bfloat16 for good,
        while the same model saved and loaded had exact ones (the table is not saved). Once per cast,
        never per forward pass; not on the meta device, where nothing is computed."""
        dtype = self.pe.dtype
        super()._apply(fn, recurse)
        if self.pe.dtype != dtype and not self.pe.is_meta:
            self.reset_parameters()
        return self

    def forward(self, tokens: Tensor, start: int = 0) -> Tensor:
        """(B, T) ids at positions start..start+T-1 -> (B, T, d)."""
        t = tokens.shape[1]
        if start + t > self.pe.shape[0]:
            raise ValueError(f"{self.side} reaches position {start + t}, past max_len={self.pe.shape[0]}")
        return self.dropout(self.embed(tokens) * self.scale + self.pe[start : start + t])


ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}  # config.ACTIVATIONS' functions


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (equation 2); GELU or SiLU instead of ReLU as options."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_1 = nn.Linear(config.d_model, config.d_ff)
        self.w_2 = nn.Linear(config.d_ff, config.d_model)
        self.activation = ACTIVATION_FUNCTIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation(self.w_1(x)))


def check_ids(name: str, ids: Tensor, vocab: int | None = None) -> None:
    """(B, T) token ids, B and T at least 1, of an integer dtype: a 1-D, empty or float input failed deep in
    the embedding or a reshape. With `vocab`, each id in 0..vocab-1 too (the embedding's "index out of range
    in self" named neither the id nor the input), but on a CPU only: there it is one pass over the ids, on
    a GPU reading them back waits for the device at every batch (an id past the vocabulary stays the
    embedding's error there). Not while torch.compile or torch.jit traces either (a branch on values breaks
    the graph), nor of a tensor subclass (FakeTensorMode's, which numpy cannot read)."""
    if not isinstance(ids, Tensor):  # a list, a numpy array: "'list' object has no attribute 'dim'"
        raise TypeError(f"{name} is {type(ids).__name__}: token ids are a (batch, length) torch tensor of ids "
                        "(aiayn.data.batching.right_pad(lists, pad_id) pads lists of ids into one)")
    if ids.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}: token ids are (batch, length)")
    if ids.dtype not in (torch.long, torch.int32):  # the two the embedding takes
        raise TypeError(f"{name} is {ids.dtype}: token ids are integers (torch.long or torch.int32)")
    if ids.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}: no token to read")
    if vocab is not None and _readable_here(ids):
        host = ids.numpy()  # the ids where they are, read by numpy: no tensor operation, none to wait for
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"{name} holds id {low if low < 0 else high}, outside the vocabulary of {vocab} "
                             f"(ids 0 to {vocab - 1})")


def _readable_here(t: Tensor) -> bool:
    """Whether `t`'s values can be read without waiting: on the CPU (on a GPU, reading waits for the
    device), a plain tensor (not FakeTensorMode's, which numpy cannot read), and not while torch.compile or
    torch.jit traces (a branch on values breaks the graph)."""
    return (t.device.type == "cpu" and type(t) is torch.Tensor and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing())


def check_positions(positions: Tensor, rows: int) -> None:
    """`positions` (N,) integer indices into `rows` = B*T flat positions, as `target_positions` makes: a bool
    mask (B, T) failed in index_select ("Index is supposed to be a vector"), a float one with "Expected dtype
    int32 or int64", an index past B*T or below 0 with "index out of range in self". The range on a CPU
    only (`_readable_here`: reading a GPU's indices back waits for the device every batch)."""
    if not isinstance(positions, Tensor) or positions.dtype not in (torch.long, torch.int32):
        kind = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        mask = ", not a mask" if kind == torch.bool else ""
        raise TypeError(f"positions is {kind}: it is (N,) long indices of the flat (B*T) positions, "
                        f"target_positions(tgt_out, pad_id){mask}")
    if positions.dim() != 1:
        raise ValueError(f"positions has shape {tuple(positions.shape)}: it is (N,) indices of the flat "
                         "(B*T) positions, target_positions(tgt_out, pad_id)")
    if positions.numel() and _readable_here(positions):
        host = positions.numpy()
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= rows:
            raise ValueError(f"positions holds {low if low < 0 else high}, outside the B*T = {rows} "
                             f"positions of tgt_in (0 to {rows - 1})")


def check_src_mask_rows(src_mask: Tensor) -> None:
    """Each row of a (B, 1, 1, S) bool `src_mask` (as `_decode` checked it) lets its queries attend to some
    source position: every real source holds at least its EOS. torch's key_padding_mask (True = pad) or an
    all-False mask gave wrong logits, silently. Where `_readable_here` only: a GPU's mask stays unchecked."""
    if not _readable_here(src_mask):  # its dtype and shape: checked by `_decode`, which alone calls this
        return
    attends = src_mask.numpy().any(axis=-1).reshape(-1)  # (B,)
    if not attends.all():
        raise ValueError(f"src_mask row {int((~attends).nonzero()[0][0])} is False everywhere: it is True "
                         "where the source is a token (Transformer.src_mask), unlike torch's "
                         "key_padding_mask (True = padding)")


@contextmanager
def _clearing_autocast_cache():
    try:
        yield
    finally:
        torch.clear_autocast_cache()


def _recompute_contexts():
    """`checkpoint`'s context_fn: nothing around a layer's forward; around its recompute in the backward
    pass, autocast's cache of bf16 weight copies cleared after it. An enclosing autocast, even a disabled
    one (`aiayn.train.loop.train` holds one for the whole run), keeps the copies a recompute casts: after
    the optimizer's step, the next forward computed with the old weights' copies (a bf16 run with
    checkpointing trained another model, every tensor apart after 6 updates)."""
    return nullcontext(), _clearing_autocast_cache()


class SublayerConnection(nn.Module):
    """Residual, dropout and LayerNorm around one sub-layer (section 3.1, 5.4).

    Post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-norm: x + Dropout(Sublayer(LayerNorm(x))); the stack then ends with its own LayerNorm.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.dropout)
        self.norm_first = config.norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention, then the FFN, each wrapped by `SublayerConnection` (section 3.1)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config.d_model, config.n_heads, self_attention=True)
        self.feed_forward = PositionwiseFeedForward(config)
        self.sublayer = nn.ModuleList([SublayerConnection(config) for _ in range(2)])

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, mask=src_mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then the FFN (section 3.1)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config.d_model, config.n_heads, self_attention=True)
        self.src_attn = MultiHeadAttention(config.d_model, config.n_heads, self_attention=False)
        self.feed_forward = PositionwiseFeedForward(config)
        self.sublayer = nn.ModuleList([SublayerConnection(config) for _ in range(3)])

    def forward(
        self, x: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache | None = None, layer: int = 0
    ) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, is_causal=True, cache=cache, layer=layer))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, mask=src_mask, cache=cache, layer=layer))
        return self.sublayer[2](x, self.feed_forward)


class Transformer(nn.Module):
    """Encoder-decoder Transformer. `forward(src, tgt_in)` -> logits (B, T, V_tgt).

    `tgt_in` is the target shifted right (starting with `config.decoder_start_id`); the model does
    not shift. `encode` and `decode` are the two halves, `decode` taking an optional `KVCache`.
    """

    def __init__(self, config: ModelConfig):
        if not isinstance(config, ModelConfig):  # a dict: "'dict' object has no attribute 'd_model'"
            raise TypeError(f"Transformer takes a ModelConfig, not {type(config).__name__}: build one with "
                            "model_config('base', vocab_size=...) (a preset and changes), or ModelConfig(...)")
        super().__init__()
        self.config = config
        d = config.d_model
        # Off the meta device, nn.Embedding's own draw, redrawn by `reset_parameters`, is kept: a seed
        # gives the same model.
        on_meta = _building_on_meta()
        table = lambda n: nn.Embedding(n, d, _weight=torch.empty(n, d) if on_meta else None)
        src_embed = table(config.vocab_size)
        tgt_embed = src_embed if config.share_embeddings else table(config.target_vocab_size)
        self.src_embed = Embeddings(src_embed, config, "src")
        self.tgt_embed = Embeddings(tgt_embed, config, "tgt_in")
        self.encoder = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(config) for _ in range(config.decoder_layers)])
        # Pre-norm leaves each stack's output un-normalized: each stack ends with a LayerNorm.
        norm = (lambda: nn.LayerNorm(d, eps=config.layer_norm_eps)) if config.norm_first else nn.Identity
        self.encoder_norm, self.decoder_norm = norm(), norm()
        self.generator = nn.Linear(d, config.target_vocab_size, bias=False)  # pre-softmax projection
        if config.final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(config.target_vocab_size))
        else:
            self.final_logits_bias = None
        # A compiled cached decoder step for one row (`aiayn.decoding.compiled.OneRowStep`), set by
        # `compile_one_row_step` (translate --compile) and used by `decoding.search.step_log_probs` where
        # it applies; None: every step eager. A plain object, not a module: no part of the state dict.
        self.one_row_step = None
        # Activation checkpointing (`train.checkpoint_activations`): while gradients are recorded, each
        # layer keeps only its input for the backward pass and runs its forward again there. A plain
        # attribute, not a setting of the network: the same weights and gradients (bit for bit on a CPU).
        self.checkpoint_activations = False
        if not on_meta:
            self.reset_parameters()
        self._tie_output()

    def _tie_output(self) -> None:
        if self.config.tie_output:  # section 3.4: the pre-softmax projection is the target embedding
            self.generator.weight = self.tgt_embed.embed.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        """`nn.Module.to_empty` of the whole model (built on the meta device, then loaded or initialized),
        which leaves every tensor uninitialized and gives each module its own copy of a shared parameter:
        the position tables are computed again and the output projection tied again to the embedding.
        (Tools that materialize module by module call `Embeddings.reset_parameters` for the tables and
        must tie the projection themselves.)"""
        super().to_empty(device=device, recurse=recurse)
        for emb in (self.src_embed, self.tgt_embed):
            emb.reset_parameters()
        self._tie_output()
        return self

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply` (behind `.to`, `.bfloat16()`, `.cuda()`), once every submodule that refuses
        some (a Linear packed for CPU decoding: `aiayn.decoding.cpu.PackedLinear.check_apply`) has agreed:
        a refusal halfway left the embeddings cast and the packed Linears not."""
        for m in self.modules():
            check = getattr(type(m), "check_apply", None)
            if check is not None:
                check(m, fn)
        return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, zero biases (tensor2tensor, fairseq), attention's as fairseq's
        (`MultiHeadAttention.reset_parameters`); embeddings N(0, d^-1/2) so that after the sqrt(d) scale
        they have unit variance, the size of the positional signal; LayerNorm gains one; Marian's logits
        bias, a buffer, zero."""
        attentions = [m for m in self.modules() if isinstance(m, MultiHeadAttention)]
        theirs = {id(p) for m in attentions for p in m.parameters()}
        for name, p in self.named_parameters():
            if id(p) in theirs:
                continue
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for attention in attentions:
            attention.reset_parameters()
        for emb in {id(m): m for m in self.modules() if isinstance(m, nn.Embedding)}.values():
            nn.init.normal_(emb.weight, mean=0.0, std=self.config.d_model**-0.5)
        for norm in self.modules():
            if isinstance(norm, nn.LayerNorm):
                norm.reset_parameters()  # gain 1, bias 0
        if self.final_logits_bias is not None:
            nn.init.zeros_(self.final_logits_bias)

    def src_mask(self, src: Tensor) -> Tensor:
        return padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)

    def encode(self, src: Tensor) -> Tensor:
        """(B, S) source ids -> memory (B, S, d)."""
        check_ids("src", src, self.config.vocab_size)
        mask = self.src_mask(src)
        x = self.src_embed(src)
        for layer in self.encoder:
            x = self._run(layer, x, mask)
        return self.encoder_norm(x)

    def _run(self, layer: nn.Module, *inputs) -> Tensor:
        """`layer(*inputs)`; with `checkpoint_activations` while autograd records (training), through
        `torch.utils.checkpoint`: the layer's inner activations (attention's q, k, v and output, the FFN's
        d_ff-wide hidden layer, the dropout masks, the LayerNorms' inputs) are freed after its forward and
        computed again in the backward pass, about a third more arithmetic for a step. Dropout draws
        the same masks again: checkpoint restores the CPU and GPU generators' states for the recompute,
        and the recompute leaves no bf16 weight copies in autocast's cache (`_recompute_contexts`).
        Non-reentrant (`use_reentrant=False`), PyTorch's recommended kind: it works under DDP, autocast and
        torch.compile and with inputs that need no gradient (the first layer's under a frozen embedding)."""
        if not (self.checkpoint_activations and torch.is_grad_enabled()):
            return layer(*inputs)
        # Dynamo takes dispatch modes alone as contexts (its graph casts; `batch_loss` clears the cache for
        # the eager parts of a compiled model), and checkpoint's debug mode (`set_checkpoint_debug_enabled`)
        # refuses any context_fn: both without the clearing
        debugging = getattr(torch.utils.checkpoint, "_checkpoint_debug_enabled", None)  # None, True, False
        if torch.compiler.is_compiling() or debugging:
            return checkpoint(layer, *inputs, use_reentrant=False)
        return checkpoint(layer, *inputs, use_reentrant=False, context_fn=_recompute_contexts)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_mask: Tensor | None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """(B, T) target ids, memory (B, S, d), src_mask (B, 1, 1, S) -> logits (B, T, V_tgt).

        `src_mask` may be None when no source has padding.

        With a cache, `tgt_in` holds only the new positions (usually one) and the cache the past.
        With `positions` (N,) long, flat indices into the B*T positions (row-major), only those are
        projected: logits (N, V_tgt). Indices rather than a bool mask, since selecting by a mask must
        read the mask's count back from a GPU (a host-device sync every training batch).

        On the CPU, a `src_mask` row that attends to nothing is refused (`check_src_mask_rows`); with a
        cache only on its first step, after which the cache holds every step to the same mask.
        """
        return self._decode(tgt_in, memory, src_mask, cache, positions, check_rows=True)

    def _decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache | None,
                positions: Tensor | None, *, check_rows: bool) -> Tensor:
        """`decode`, which checks `src_mask`'s rows, and `forward`, which does not: its own mask may have an
        all-padding source, which trains (its outputs come out as zeros, no NaN)."""
        check_ids("tgt_in", tgt_in, self.config.target_vocab_size)
        beam = 1 if cache is None else cache.beam_size
        if memory.dim() != 3 or tgt_in.shape[0] != memory.shape[0] * beam:  # 1 row broadcast silently
            per = f" / beam_size {beam}" if beam > 1 else ""
            raise ValueError(f"tgt_in has {tgt_in.shape[0]} rows, memory {tuple(memory.shape)}: (B, S, d) "
                             f"with B = rows{per}")
        width, dtype = self.config.d_model, self._cache_like().dtype
        if memory.shape[2] != width or (memory.dtype != dtype  # autocast casts memory as it casts the weights
                                        and not torch.is_autocast_enabled(memory.device.type)):
            # failed in the cross-attention's projection: "mat1 and mat2 shapes cannot be multiplied"
            error = ValueError if memory.shape[2] != width else TypeError
            raise error(f"memory is {memory.dtype} {tuple(memory.shape)}: it is (B, S, d_model={width}) in "
                        f"the model's {dtype}, Transformer.encode's output")
        if src_mask is not None and (src_mask.dtype != torch.bool or src_mask.dim() != 4
                                     or src_mask.shape[0] != memory.shape[0] or src_mask.shape[1:3] != (1, 1)
                                     or src_mask.shape[-1] != memory.shape[1]):
            # SDPA adds a float mask to the scores: a 0/1 mask attended to padding, silently; and broadcasts
            # it: one sentence's mask (1, 1, 1, S) masked every sentence as that one, silently, and a mask
            # per beam row (B*K) or of other rows failed inside attention ("The size of tensor a ...")
            raise ValueError(f"src_mask is {src_mask.dtype} {tuple(src_mask.shape)}: it is bool "
                             f"(B, 1, 1, S) with memory's B, S = {memory.shape[0]}, {memory.shape[1]}, True "
                             "where the source is a token (Transformer.src_mask)")
        # after the shape's check: a mask of another shape was said to have a row (of it flattened) False
        if check_rows and src_mask is not None and (cache is None or cache.length == 0):  # once per search
            check_src_mask_rows(src_mask)
        if positions is not None:  # before the stack's work, not at the index_select after it
            check_positions(positions, tgt_in.numel())
        if cache is not None:
            shape = (len(self.decoder), self.config.n_heads, self.config.d_k)
            cache.check_step(tgt_in.shape[0], memory, src_mask, shape, self._cache_like().dtype)
        start = 0 if cache is None else cache.length
        x = self.tgt_embed(tgt_in, start)
        for i, layer in enumerate(self.decoder):
            if cache is None:
                x = self._run(layer, x, memory, src_mask)
            else:  # decoding, a step at a time: no backward pass to keep anything for
                x = layer(x, memory, src_mask, cache, i)
        if cache is not None:
            cache.advance(tgt_in.shape[1])
        h = self.decoder_norm(x)  # (B, T, d)
        if positions is not None:
            h = h.flatten(0, 1).index_select(0, positions)  # (B*T, d) -> (N, d)
        return self.project(h)  # (B, T, V) or (N, V)

    def project(self, h: Tensor) -> Tensor:
        """Decoder states (..., d) -> logits (..., V_tgt)."""
        logits = self.generator(h)
        return logits if self.final_logits_bias is None else logits + self.final_logits_bias

    def forward(self, src: Tensor, tgt_in: Tensor, positions: Tensor | None = None) -> Tensor:
        """(B, S) source ids, (B, T) shifted target ids -> logits (B, T, V_tgt).

        Training passes `positions` = `target_positions(tgt_out)`, those whose target is not padding,
        and gets their logits only, (N, V_tgt): the V-wide projection and softmax then skip the padding
        (a third of the positions in length-bucketed batches of short sentences).
        """
        check_ids("src", src)  # first: a list failed at its .dim() ("'list' object has no attribute 'dim'")
        check_ids("tgt_in", tgt_in)
        if src.shape[0] != tgt_in.shape[0]:  # (1, T) broadcast silently
            raise ValueError(f"src has {src.shape[0]} rows and tgt_in {tgt_in.shape[0]}: one target per "
                             "source")
        memory = self.encode(src)
        return self._decode(tgt_in, memory, self.src_mask(src), None, positions, check_rows=False)

    def new_cache(self, batch_size: int, max_len: int, *, beam_size: int = 1) -> KVCache:
        """An empty `KVCache` for `batch_size` rows (sentences x `beam_size`), up to `max_len` positions,
        in the model's dtype and on its device.

        With beams, `decode` takes `memory` and `src_mask` once per sentence, not once per row. (No
        `dtype` argument: attention takes queries, keys and values of one dtype, so a cache in another
        failed inside SDPA; nothing passed one.)
        """
        c = self.config
        p = self._cache_like()
        return KVCache(c.decoder_layers, batch_size, c.n_heads, c.d_k, max_len, p.dtype, p.device, beam_size)

    def _cache_like(self) -> Tensor:
        """A weight in the dtype and on the device a `KVCache` must have: an embedding, still a float
        tensor in an int8-quantized model."""
        return self.tgt_embed.embed.weight

    def num_parameters(self) -> int:
        """Distinct parameters, trainable or frozen (a shared embedding counted once): the model's size,
        which `aiayn info`, the paper's Table 3 and a memory estimate all mean. Buffers (the position
        tables, a logits bias) are not counted. A model packed or quantized for decoding
        (`Translator.load`), whose Linear weights are no parameters, counts those it stands for
        (`packed_parameters`, `aiayn.decoding.cpu.count_packed`): a packed one counted its embeddings and
        norms alone (13,120 of a micro model's 34,176)."""
        packed = sum(getattr(m, "packed_parameters", 0) for m in self.modules())
        return sum(p.numel() for p in self.parameters()) + packed
