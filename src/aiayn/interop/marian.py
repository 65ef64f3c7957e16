"""Import a HuggingFace MarianMT directory (the OPUS-MT models) as an aiayn checkpoint.

MarianMT is the paper's Transformer (post-norm, sinusoidal positions, tied embeddings) with a few
variations, each an option of `ModelConfig`:
- FFN activation `swish` (= SiLU), `relu` or `gelu`         -> `activation`
- a bias on the logits, `final_logits_bias`                  -> `final_logits_bias=True`
- sinusoids with every sine before every cosine              -> `positions="sin_cos"`
- the decoder starts from the pad token                      -> `decoder_start_id` (the pad id)
- embeddings scaled by sqrt(d_model) only if `scale_embedding` -> `scale_embedding`
- one vocabulary (`vocab.json`) or two (`separate_vocabs`, `target_vocab.json`)
                                                             -> `share_embeddings`, `tgt_vocab_size`
A configuration that asks for anything else that changes what the network computes (pre-norm, a
LayerNorm on the embeddings, learned positions...) raises `UserError` naming the field.

The directory is read as files, without `transformers`; weights never go through pickle's code
execution: `model.safetensors` (possibly sharded), or `pytorch_model.bin` with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from aiayn.checkpoint import load_into, save_checkpoint
from aiayn.config import ConfigError, ModelConfig, from_dict
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.model import Transformer, sinusoidal_positions

log = logging.getLogger(__name__)

ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}  # HF "gelu" is the erf one

# Fields (of current and older MarianConfig files) that aiayn has no option for, with the only value
# it supports. The old converter wrote all of them; new files may omit them.
FIXED_FIELDS = {
    "normalize_before": False,  # True: pre-norm (mBART); Marian is post-norm
    "normalize_embedding": False,  # True: a LayerNorm on the embeddings (BART's layernorm_embedding)
    "add_final_layer_norm": False,  # True: a LayerNorm at the end of each stack
    "add_bias_logits": False,  # True: a second, learned logits bias
    "static_position_embeddings": True,  # False: learned positions
    "is_decoder": False,  # True: a decoder-only MarianForCausalLM
}
# Regularizers that only act in training; aiayn has none of them, so fine-tuning runs without them.
TRAINING_ONLY = ("attention_dropout", "activation_dropout", "encoder_layerdrop", "decoder_layerdrop")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: not found (is this a MarianMT directory?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _int_field(hf: dict[str, Any], name: str, where: str) -> int:
    value = hf.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{where}: {name}={value!r} is not supported (aiayn needs one integer id)")
    return value


def _same_field(hf: dict[str, Any], encoder: str, decoder: str, where: str) -> Any:
    if hf.get(encoder) != hf.get(decoder):
        raise UserError(f"{where}: {encoder}={hf.get(encoder)} differs from {decoder}={hf.get(decoder)}; "
                        f"aiayn's encoder and decoder layers have the same shape")
    return hf[encoder]


def model_config_from_marian(hf: dict[str, Any], where: str) -> ModelConfig:
    """A MarianConfig (config.json as a dict) -> `ModelConfig`, or `UserError` naming what differs."""
    if hf.get("model_type") != "marian":
        raise UserError(f"{where}: model_type={hf.get('model_type')!r}, expected 'marian'")
    if "architectures" in hf and "MarianMTModel" not in (hf["architectures"] or []):
        raise UserError(f"{where}: architectures={hf['architectures']} is not supported "
                        f"(expected MarianMTModel)")
    for name, supported in FIXED_FIELDS.items():
        if name in hf and hf[name] != supported:
            raise UserError(f"{where}: {name}={json.dumps(hf[name])} is not supported "
                            f"(aiayn reads Marian models with {name}={json.dumps(supported)})")
    activation = hf.get("activation_function", "gelu")  # MarianConfig's default
    if activation not in ACTIVATIONS:
        raise UserError(f"{where}: activation_function={activation!r} is not supported; "
                        f"supported: {', '.join(ACTIVATIONS)}")
    for name in TRAINING_ONLY:
        if hf.get(name, 0.0):
            log.warning("%s: %s=%s is ignored: aiayn has no such regularizer (inference is unaffected)",
                        where, name, hf[name])
    shared = hf.get("share_encoder_decoder_embeddings", True)
    vocab_size = _int_field(hf, "vocab_size", where)
    pad_id = _int_field(hf, "pad_token_id", where)
    values = dict(
        vocab_size=vocab_size,
        tgt_vocab_size=None if shared else (hf.get("decoder_vocab_size") or vocab_size),
        d_model=hf["d_model"],
        n_heads=_same_field(hf, "encoder_attention_heads", "decoder_attention_heads", where),
        d_ff=_same_field(hf, "encoder_ffn_dim", "decoder_ffn_dim", where),
        n_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"],
        dropout=float(hf.get("dropout", 0.1)),
        activation=ACTIVATIONS[activation],
        norm_first=False,
        positions="sin_cos",
        max_len=hf.get("max_position_embeddings", 1024),
        share_embeddings=shared,
        tie_output=hf.get("tie_word_embeddings", True),
        scale_embedding=hf.get("scale_embedding", False),
        final_logits_bias=True,
        layer_norm_eps=1e-5,  # Marian's nn.LayerNorm default
        pad_id=pad_id,
        decoder_start_id=pad_id if hf.get("decoder_start_token_id") is None
        else _int_field(hf, "decoder_start_token_id", where),
        eos_id=_int_field(hf, "eos_token_id", where),
    )
    try:
        return from_dict(ModelConfig, values, where=where)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None


def load_marian_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of `model.safetensors` (or its shards) or of `pytorch_model.bin`, as float32."""
    single, index, legacy = (directory / n for n in
                             ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
    elif legacy.is_file():
        try:  # weights_only: tensors and plain containers only, never code from the pickle
            weights = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad or hostile file
            raise UserError(f"{legacy}: cannot read as plain tensors ({type(e).__name__}: {e})") from None
        return {k: v.float() for k, v in weights.items()}
    else:
        raise UserError(f"{directory}: no model.safetensors or pytorch_model.bin")
    weights = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f}: corrupt weights ({e})") from None
    return {k: v.float() for k, v in weights.items()}


def _check_positions(hf: dict[str, Tensor], config: ModelConfig, where: str) -> None:
    """Older files store the sinusoid tables; they must be the formula aiayn computes (`sin_cos`)."""
    for side in ("encoder", "decoder"):
        table = hf.pop(f"model.{side}.embed_positions.weight", None)
        if table is None:
            continue
        expected = sinusoidal_positions(table.shape[0], config.d_model, config.positions)
        if table.shape != expected.shape or not torch.allclose(table, expected, atol=1e-4):
            raise UserError(f"{where}: model.{side}.embed_positions.weight is not the sin-then-cos sinusoid "
                            f"table; learned positions are not supported")


def _embeddings(hf: dict[str, Tensor], config: ModelConfig, where: str) -> dict[str, Tensor]:
    """Token embeddings, output projection and logits bias, in aiayn's names; tying checked."""
    shared = hf.pop("model.shared.weight", None)
    src = hf.pop("model.encoder.embed_tokens.weight", shared)
    tgt = hf.pop("model.decoder.embed_tokens.weight", shared)
    lm_head = hf.pop("lm_head.weight", None)
    if src is None or tgt is None:
        raise UserError(f"{where}: missing token embeddings "
                        f"(model.shared.weight or model.*.embed_tokens.weight)")
    out = {"src_embed.embed.weight": src}
    if config.share_embeddings:
        if not torch.equal(src, tgt):
            raise UserError(f"{where}: share_encoder_decoder_embeddings=true but the encoder and decoder "
                            f"embeddings differ")
    else:
        out["tgt_embed.embed.weight"] = tgt
    if config.tie_output:
        if lm_head is not None and not torch.equal(lm_head, tgt):
            raise UserError(f"{where}: tie_word_embeddings=true but lm_head.weight differs from the decoder "
                            f"embeddings")
    elif lm_head is None:
        raise UserError(f"{where}: tie_word_embeddings=false but lm_head.weight is missing")
    else:
        out["generator.weight"] = lm_head
    bias = hf.pop("final_logits_bias", None)  # transformers treats a missing one as zeros
    out["final_logits_bias"] = torch.zeros(config.target_vocab_size) if bias is None else bias.reshape(-1)
    return out


def _attention(hf: dict[str, Tensor], theirs: str, ours: str, self_attention: bool) -> dict[str, Tensor]:
    """Separate q/k/v projections -> our packed `qkv_proj` ([W^Q; W^K; W^V]) or `q_proj` + `kv_proj`."""
    out = {}
    for p in ("weight", "bias"):
        q, k, v = (hf.pop(f"{theirs}.{n}_proj.{p}") for n in "qkv")
        if self_attention:
            out[f"{ours}.qkv_proj.{p}"] = torch.cat([q, k, v])  # (3 d, ...)
        else:
            out[f"{ours}.q_proj.{p}"] = q
            out[f"{ours}.kv_proj.{p}"] = torch.cat([k, v])  # (2 d, ...)
        out[f"{ours}.out_proj.{p}"] = hf.pop(f"{theirs}.out_proj.{p}")
    return out


def _layer(hf: dict[str, Tensor], theirs: str, ours: str, decoder: bool) -> dict[str, Tensor]:
    """One Marian layer -> ours. Marian's LayerNorm after each sub-layer is our `sublayer[i].norm`."""
    out = _attention(hf, f"{theirs}.self_attn", f"{ours}.self_attn", self_attention=True)
    norms = ["self_attn_layer_norm", "final_layer_norm"]
    if decoder:
        out.update(_attention(hf, f"{theirs}.encoder_attn", f"{ours}.src_attn", self_attention=False))
        norms.insert(1, "encoder_attn_layer_norm")
    for p in ("weight", "bias"):
        out[f"{ours}.feed_forward.w_1.{p}"] = hf.pop(f"{theirs}.fc1.{p}")
        out[f"{ours}.feed_forward.w_2.{p}"] = hf.pop(f"{theirs}.fc2.{p}")
        for i, norm in enumerate(norms):
            out[f"{ours}.sublayer.{i}.norm.{p}"] = hf.pop(f"{theirs}.{norm}.{p}")
    return out


def convert_weights(hf: dict[str, Tensor], config: ModelConfig, where: str) -> dict[str, Tensor]:
    """MarianMTModel's state dict -> aiayn's (`state_dict_for_saving` names); unknown tensors are errors."""
    hf = dict(hf)  # consumed as it is read: what is left at the end is something aiayn would ignore
    _check_positions(hf, config, where)
    out = _embeddings(hf, config, where)
    try:
        for i in range(config.n_layers):
            out.update(_layer(hf, f"model.encoder.layers.{i}", f"encoder.{i}", decoder=False))
        for i in range(config.decoder_layers):
            out.update(_layer(hf, f"model.decoder.layers.{i}", f"decoder.{i}", decoder=True))
    except KeyError as e:
        raise UserError(f"{where}: missing weight {e.args[0]}") from None
    if hf:
        raise UserError(f"{where}: weights aiayn has no place for: {', '.join(sorted(hf)[:5])} "
                        f"(a Marian variant it does not support)")
    return out


def _read_vocab(path: Path) -> dict[str, int]:
    vocab = read_json(path)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise UserError(f"{path}: expected a mapping from piece to integer id")
    return vocab


def _token_name(value: Any) -> str:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    return value["content"] if isinstance(value, dict) else str(value)


def marian_tokenizer(directory: Path, config: ModelConfig) -> Tokenizer:
    """source.spm/target.spm with vocab.json (and target_vocab.json), as `MarianTokenizer` reads them.

    Pieces come from the SentencePiece models and are mapped to ids through the JSON vocabularies
    (unknown pieces -> <unk>); `</s>` ends the source. Marian has no BOS: its slot is the decoder's
    start token (pad), which `decode_tgt` drops like a pad.
    """
    settings_path = directory / "tokenizer_config.json"
    settings = read_json(settings_path) if settings_path.is_file() else {}
    vocab_path = directory / "vocab.json"
    vocab = _read_vocab(vocab_path)
    tgt_path = directory / "target_vocab.json"
    tgt_vocab = _read_vocab(tgt_path) if settings.get("separate_vocabs", False) else None
    specials = {}
    for key, default in (("pad", "<pad>"), ("eos", "</s>"), ("unk", "<unk>")):
        name = _token_name(settings.get(f"{key}_token", default))
        if name not in vocab:
            raise UserError(f"{vocab_path}: has no {key} token {name!r}")
        if tgt_vocab is not None and tgt_vocab.get(name) != vocab[name]:
            raise UserError(f"{tgt_path}: {name!r} has id {tgt_vocab.get(name)} but {vocab[name]} in "
                            f"vocab.json; aiayn's tokenizer needs one id per special token")
        specials[key] = vocab[name]
    for key, field in (("pad", "pad_token_id"), ("eos", "eos_token_id")):
        if specials[key] != getattr(config, f"{key}_id"):
            raise UserError(f"{directory / 'config.json'}: {field}={getattr(config, f'{key}_id')} but the "
                            f"vocabulary gives the {key} token id {specials[key]}")
    specials["bos"] = config.decoder_start_id
    sides = ((vocab_path, vocab, config.vocab_size), (tgt_path, tgt_vocab, config.target_vocab_size))
    for path, v, size in sides:
        if v is not None and set(v.values()) != set(range(size)):
            raise UserError(f"{path}: its {len(v)} ids are not exactly 0..{size - 1}, the model's vocabulary")
    return Tokenizer(directory / "source.spm", directory / "target.spm", vocab, specials, tgt_vocab)


def generation_defaults(directory: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """The model's own decoding settings (beam size, length limit, banned tokens), kept for reference."""
    path = directory / "generation_config.json"
    source = read_json(path) if path.is_file() else hf
    keys = ("num_beams", "max_length", "length_penalty", "bad_words_ids", "forced_eos_token_id")
    return {k: source[k] for k in keys if source.get(k) is not None}


def convert_marian(directory: str | Path, out: str | Path) -> Path:
    """Read a local MarianMT directory and write an aiayn checkpoint to `out`; return its path."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: not a directory")
    hf = read_json(directory / "config.json")
    config = model_config_from_marian(hf, str(directory / "config.json"))
    tokenizer = marian_tokenizer(directory, config)
    weights = convert_weights(load_marian_weights(directory), config, str(directory))
    model = Transformer(config)
    load_into(model, weights, directory)
    meta = {"converted_from": {"format": "marian", "path": str(directory.resolve())},
            "marian_generation": generation_defaults(directory, hf)}
    log.info("converted %s: %s parameters", directory, f"{model.num_parameters():,}")
    return save_checkpoint(out, model.eval(), tokenizer, meta)
