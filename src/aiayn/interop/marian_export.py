"""Export an aiayn checkpoint as a HuggingFace MarianMT directory, the reverse of `aiayn.interop.marian`.

`MarianMTModel.from_pretrained(out)` and `MarianTokenizer.from_pretrained(out)` load it offline and
compute what aiayn computes (transformers 5 has no translation pipeline: tokenize, `generate`, decode).
The directory is what transformers 5 saves and OPUS-MT ships: config.json, generation_config.json,
model.safetensors, source.spm, target.spm, vocab.json (and target_vocab.json), tokenizer_config.json.
It is written with `safetensors` and `json` alone: neither `transformers` nor pickle is needed.

MarianMT is the paper's post-norm Transformer with Marian's options, each of which aiayn has
(`interop.marian`'s table): activation, logits bias, decoder start, embedding scale, one or two
vocabularies. Its sinusoids are sin-then-cos; aiayn's default, the paper's, interleaves them. That model
is still exactly a MarianMT: only the order of the d_model features of the residual stream differs, so
the export permutes that dimension in every weight that reads or writes it (`residual_order`), and the
network computes the same logits. What MarianMT cannot compute (pre-norm, another LayerNorm epsilon) is
refused, naming the config key, before anything is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from aiayn.checkpoint import META, check_utf8_path, load_checkpoint
from aiayn.config import ModelConfig
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.files import OutputKind, check_not_inside, check_output, write_atomically
from aiayn.model import Transformer, sinusoidal_positions
from aiayn.train.state import check_outside_checkpoints

log = logging.getLogger(__name__)

# aiayn's activation -> MarianConfig's activation_function (transformers' ACT2FN): "gelu" is the erf
# form there as in F.gelu, "swish" is SiLU
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "swish"}
# Every MarianMT LayerNorm is nn.LayerNorm(d_model), PyTorch's default epsilon; MarianConfig has no field
MARIAN_LAYER_NORM_EPS = 1e-5


def check_exportable(config: ModelConfig, where: str) -> None:
    """Refuse, in one line naming the aiayn config key, a model that MarianMT cannot compute.

    The rest is expressible: one shape for encoder and decoder layers (aiayn has one n_heads and one d_ff),
    biases on every projection (aiayn has them too), either position layout (`residual_order`)."""
    if config.norm_first:
        raise UserError(f"{where}: norm_first=True (pre-norm) cannot be exported to MarianMT, which is "
                        "post-norm only (LayerNorm after each residual sum)")
    if config.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        raise UserError(f"{where}: layer_norm_eps={config.layer_norm_eps} cannot be exported to MarianMT, "
                        f"whose LayerNorms all use {MARIAN_LAYER_NORM_EPS} (no config field sets it)")


def residual_order(config: ModelConfig) -> Tensor:
    """(d,) long: MarianMT's feature c of the residual stream is aiayn's feature `order[c]`.

    Marian's position table is every sine, then every cosine; the paper's interleaves them (sin in even
    columns, cos in odd ones), so sin_cos = interleaved[:, order] with order = [0, 2, ..., 1, 3, ...].
    Each weight is permuted along its d_model side (`marian_weights`); LayerNorm's mean and variance do
    not depend on the order of the features, and the attention and FFN inner sizes keep theirs."""
    d = config.d_model
    if config.positions == "sin_cos":
        return torch.arange(d)
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


class _Permuted:
    """Weights of the aiayn model with the residual dimension in MarianMT's order."""

    def __init__(self, order: Tensor):
        self.order = order

    def reads(self, weight: Tensor) -> Tensor:
        """A Linear or embedding whose input (columns) is the residual stream: (out, d)."""
        return weight[:, self.order].contiguous()

    def writes(self, t: Tensor) -> Tensor:
        """A Linear's output rows and bias, or a LayerNorm's gain and bias, on the residual stream."""
        return t[self.order].contiguous()


def _attention(p: _Permuted, attn, theirs: str) -> dict[str, Tensor]:
    """Our packed projections ([W^Q; W^K; W^V] or q_proj + [W^K; W^V]) -> Marian's q/k/v/out_proj.
    Queries, keys and values read the residual stream (the encoder's, for keys and values of the
    encoder-decoder attention); out_proj writes it. Heads and their order are untouched."""
    if attn.self_attention:
        weights, biases = attn.qkv_proj.weight.chunk(3), attn.qkv_proj.bias.chunk(3)  # 3 x (d, d), (d,)
    else:
        weights = (attn.q_proj.weight, *attn.kv_proj.weight.chunk(2))  # 3 x (d, d)
        biases = (attn.q_proj.bias, *attn.kv_proj.bias.chunk(2))  # 3 x (d,)
    out = {}
    for name, weight, bias in zip("qkv", weights, biases):
        out[f"{theirs}.{name}_proj.weight"] = p.reads(weight)
        out[f"{theirs}.{name}_proj.bias"] = bias.contiguous()
    out[f"{theirs}.out_proj.weight"] = p.writes(attn.out_proj.weight)
    out[f"{theirs}.out_proj.bias"] = p.writes(attn.out_proj.bias)
    return out


def _layer(p: _Permuted, layer, theirs: str, decoder: bool) -> dict[str, Tensor]:
    """One of our layers -> Marian's. Our `sublayer[i].norm` is the LayerNorm after sub-layer i."""
    out = _attention(p, layer.self_attn, f"{theirs}.self_attn")
    norms = ["self_attn_layer_norm", "final_layer_norm"]
    if decoder:
        out.update(_attention(p, layer.src_attn, f"{theirs}.encoder_attn"))
        norms.insert(1, "encoder_attn_layer_norm")
    ffn = layer.feed_forward
    out[f"{theirs}.fc1.weight"] = p.reads(ffn.w_1.weight)  # (d_ff, d)
    out[f"{theirs}.fc1.bias"] = ffn.w_1.bias.contiguous()  # (d_ff,): the inner size keeps its order
    out[f"{theirs}.fc2.weight"] = p.writes(ffn.w_2.weight)  # (d, d_ff)
    out[f"{theirs}.fc2.bias"] = p.writes(ffn.w_2.bias)
    for i, norm in enumerate(norms):
        out[f"{theirs}.{norm}.weight"] = p.writes(layer.sublayer[i].norm.weight)
        out[f"{theirs}.{norm}.bias"] = p.writes(layer.sublayer[i].norm.bias)
    return out


def _embeddings(p: _Permuted, model: Transformer) -> dict[str, Tensor]:
    """Token embeddings and output projection as transformers 5 saves each tying (what config.json's
    share_encoder_decoder_embeddings and tie_word_embeddings say, `marian_config`):
    - one matrix, tied output: model.shared.weight alone (the rest are tied to it on loading);
    - one matrix, own output: model.shared.weight and its two copies (transformers 5 embeds with the
      copies, 4 with model.shared), and lm_head.weight;
    - two matrices: model.encoder/decoder.embed_tokens.weight, and lm_head.weight where not tied to the
      decoder's. Each stored tensor is its own copy: safetensors stores no shared memory."""
    c = model.config
    src = p.reads(model.src_embed.embed.weight)  # (V, d)
    out = {}
    if c.share_embeddings:
        out["model.shared.weight"] = src
        if not c.tie_output:
            out["model.encoder.embed_tokens.weight"] = src.clone()
            out["model.decoder.embed_tokens.weight"] = src.clone()
    else:
        out["model.encoder.embed_tokens.weight"] = src
        out["model.decoder.embed_tokens.weight"] = p.reads(model.tgt_embed.embed.weight)  # (V_tgt, d)
    if not c.tie_output:
        out["lm_head.weight"] = p.reads(model.generator.weight)  # (V_tgt, d)
    bias = model.final_logits_bias
    bias = torch.zeros(c.target_vocab_size) if bias is None else bias.clone()
    out["final_logits_bias"] = bias[None]  # (1, V): MarianMTModel's buffer
    return out


@torch.no_grad()
def marian_weights(model: Transformer) -> dict[str, Tensor]:
    """MarianMTModel's state dict (float32) for `model`, in MarianMT's order of the residual features."""
    c = model.config
    p = _Permuted(residual_order(c))
    out = _embeddings(p, model)
    for i, layer in enumerate(model.encoder):
        out.update(_layer(p, layer, f"model.encoder.layers.{i}", decoder=False))
    for i, layer in enumerate(model.decoder):
        out.update(_layer(p, layer, f"model.decoder.layers.{i}", decoder=True))
    # transformers computes the tables itself and saves none; stored anyway (older readers, aiayn's own
    # import, which checks them), they are the sin_cos layout that the permutation gave every weight
    for side in ("encoder", "decoder"):
        out[f"model.{side}.embed_positions.weight"] = sinusoidal_positions(c.max_len, c.d_model, "sin_cos")
    return {name: t.detach().float().contiguous() for name, t in out.items()}


def marian_config(config: ModelConfig) -> dict[str, Any]:
    """config.json: a MarianConfig for `config`, every field written out rather than left to MarianConfig's
    defaults. forced_eos_token_id is null: MarianConfig's default 0, where a reader applies it, would end
    every translation cut at the length limit with id 0 (aiayn's pad), where aiayn returns the hypothesis
    as it is (transformers 5 reads generate's settings from generation_config.json, and from an explicit
    value here only where that file is missing)."""
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian",
        "vocab_size": config.vocab_size, "decoder_vocab_size": config.target_vocab_size,
        "d_model": config.d_model, "encoder_layers": config.n_layers, "decoder_layers": config.decoder_layers,
        "encoder_attention_heads": config.n_heads, "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
        "activation_function": ACTIVATIONS[config.activation],
        "dropout": config.dropout, "attention_dropout": 0.0, "activation_dropout": 0.0,  # aiayn has neither
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "max_position_embeddings": config.max_len, "scale_embedding": config.scale_embedding,
        "share_encoder_decoder_embeddings": config.share_embeddings, "tie_word_embeddings": config.tie_output,
        "pad_token_id": config.pad_id, "eos_token_id": config.eos_id, "bos_token_id": None,
        "decoder_start_token_id": config.decoder_start_id, "forced_eos_token_id": None,
        "is_encoder_decoder": True, "use_cache": True,
        # the fields the import checks, as MarianMT always has them
        "normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
        "add_bias_logits": False, "static_position_embeddings": True,
    }


def generation_config(config: ModelConfig) -> dict[str, Any]:
    """generation_config.json: `generate`'s defaults, as aiayn searches. Padding is banned, as aiayn's
    searches do and OPUS-MT's configs say (`bad_words_ids`), before the log-softmax as aiayn bans it
    (`renormalize_logits`: a beam's score is otherwise off by log(1 - P(pad)) a step, and beams are ranked
    otherwise). Greedy: aiayn's default beam search has the paper's length penalty, which `generate` lacks
    (its beams equal aiayn's `lenpen_kind="power"` ones). The length limit is the position table's:
    `max_length` counts the decoder's start token too, so max_len + 1 lets `generate` write max_len
    tokens, as many as aiayn's searches may (the last one read at position max_len - 1)."""
    return {
        "decoder_start_token_id": config.decoder_start_id, "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id, "bad_words_ids": [[config.pad_id]], "forced_eos_token_id": None,
        "renormalize_logits": True, "num_beams": 1, "max_length": config.max_len + 1,
    }


def _pieces(tokenizer: Tokenizer, target: bool) -> dict[str, int]:
    """piece -> id of one side: the vocabulary a converted model carries, else the SentencePiece model's
    own ids (aiayn's tokenizers read ids from it)."""
    vocab = tokenizer.tgt_vocab if target else tokenizer.vocab
    if vocab is not None:
        return dict(vocab)
    sp = tokenizer.tgt if target else tokenizer.src
    return {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}


def tokenizer_files(tokenizer: Tokenizer, config: ModelConfig, where: str) -> dict[str, bytes]:
    """source.spm, target.spm, vocab.json (target_vocab.json) and tokenizer_config.json for
    `MarianTokenizer`: the SentencePiece models as they are (one file twice for a shared model), each
    piece mapped to aiayn's id, and the special tokens named by their pieces. MarianTokenizer appends
    `</s>` (its eos_token) to the source, as `encode_src` appends EOS."""
    src_model, tgt_model = tokenizer.models()
    source, target = _pieces(tokenizer, False), _pieces(tokenizer, True)
    # two vocabularies where the target's differs; one shared (MarianTokenizer decodes with source.spm)
    separate = target != source
    names = {i: p for p, i in source.items()}
    settings: dict[str, Any] = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": separate,
                                "model_max_length": config.max_len, "source_lang": None, "target_lang": None}
    for key, i in (("eos", tokenizer.eos_id), ("unk", tokenizer.unk_id), ("pad", tokenizer.pad_id)):
        if target.get(names[i]) != i:  # MarianTokenizer names each special token once, for both sides
            raise UserError(f"{where}: the {key} id {i} is {names[i]!r} in the source vocabulary but not in "
                            "the target's; MarianTokenizer names each special token once")
        settings[f"{key}_token"] = names[i]
    files = {"source.spm": src_model, "target.spm": tgt_model or src_model,
             "vocab.json": _json(source), "tokenizer_config.json": _json(settings)}
    if separate:
        files["target_vocab.json"] = _json(target)
    return files


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _is_marian_dir(directory: Path) -> bool:
    """Whether `directory` holds a MarianMT model (what an earlier export wrote)."""
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


# What `export --force` may replace: the files this export writes, so that anything kept beside an export
# (a README, another model's weights) is refused rather than deleted
MARIAN_KIND = OutputKind("a MarianMT model", _is_marian_dir, frozenset({
    "config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
    "target_vocab.json", "tokenizer_config.json"}))


def export_marian(checkpoint: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the HuggingFace MarianMT directory `out` for `checkpoint`; return its path.

    Written into a temporary sibling that replaces `out` only once complete (`write_atomically`).
    `force` replaces an existing `out` that holds an earlier export (or nothing), never the checkpoint or
    a directory holding it."""
    out = Path(out)
    check_utf8_path(out, "transformers' from_pretrained")
    check_outside_checkpoints(out)  # first (--force cannot mend it): keep_last deletes what lies there
    check_not_inside(out, MARIAN_KIND)
    check_output(out, [Path(checkpoint)], force, earlier=MARIAN_KIND)
    ck = load_checkpoint(checkpoint)
    where = str(Path(checkpoint) / META)  # where the model's configuration is written
    check_exportable(ck.model.config, where)
    files = tokenizer_files(ck.tokenizer, ck.model.config, where)  # its refusals too, before any writing
    files["config.json"] = _json(marian_config(ck.model.config))
    files["generation_config.json"] = _json(generation_config(ck.model.config))
    log.info("exporting %s to %s (HuggingFace MarianMT)", checkpoint, out)
    weights = marian_weights(ck.model)

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # transformers' tag
        for name, data in files.items():
            (tmp / name).write_bytes(data)

    write_atomically(out, write, what="MarianMT model", exist_ok=force)  # one that came meanwhile too
    return out
