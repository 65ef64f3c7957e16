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
- one vocabulary embedded by two matrices, the output untied -> `share_embeddings=False`,
  (transformers 5's reading of `tie_word_embeddings=false`)     `tgt_vocab_size=None`
A configuration that asks for anything else that changes what the network computes (pre-norm, a
LayerNorm on the embeddings, learned positions...) raises `UserError` naming the field.

The directory is read as files, without `transformers`; weights never go through pickle's code
execution: `model.safetensors` (possibly sharded), or `pytorch_model.bin` with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from aiayn.checkpoint import (
    CHECKPOINT_KIND,
    check_utf8_path,
    cut_short,
    file_head,
    is_checkpoint,
    is_safetensors,
    model_from_weights,
    save_checkpoint,
)
from aiayn.config import ConfigError, ModelConfig, from_dict
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.files import broken_link, check_output
from aiayn.model import sinusoidal_positions
from aiayn.train.state import check_outside_checkpoints

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


# How a Git LFS pointer file starts: what a clone without git-lfs holds in place of each large file
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"


def _check_stand_in(path: Path) -> None:
    """Refuse what stands in for one of the model's files: a symbolic link to nothing (a partial download
    in the HuggingFace cache, whose files are links into blobs/; it was said to be missing) or a Git LFS
    pointer (it was 'not valid JSON', or pytorch_model.bin's 'refused: not plain tensors')."""
    if (link := broken_link(path)) is not None:
        raise UserError(f"{path}: {link}")
    if not path.is_file():  # missing, a directory, a FIFO (which reading may block on): the reader says
        return
    try:
        with open(path, "rb") as f:
            pointer = f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:  # the reader says why
        return
    if pointer:
        raise UserError(f"{path}: a Git LFS pointer, not the file itself (run `git lfs pull`)")


def _there(path: Path) -> bool:
    """Whether an optional file of the model is there: a link to nothing counts, for `read_json` to say so
    (taken for absent, a partial download's tokenizer_config.json silently changed the special tokens)."""
    return path.is_file() or path.is_symlink()


def read_json(path: Path) -> dict[str, Any]:
    _check_stand_in(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a file")
    if not path.is_file():
        raise UserError(f"{path}: not found (is this a MarianMT directory?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON's and UTF-8's errors, a 4,300-digit number, nesting
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _field(hf: dict[str, Any], name: str, kind: type, where: str, default: Any = _REQUIRED) -> Any:
    """`hf[name]` checked to be a `kind`, else `UserError` naming the file, the field and the problem.

    Absent or null gives `default` where there is one (MarianConfig writes null for "unset").
    """
    value = hf.get(name)
    if value is None and default is not _REQUIRED:
        return default
    if name not in hf:
        raise UserError(f"{where}: {name} is missing")
    if kind is float:  # JSON may write 1.0 as 1
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:  # True is an int to Python, not to a config
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise UserError(f"{where}: {name}={json.dumps(value)} is not {_KINDS[kind]}")
    return float(value) if kind is float else value


def _same_field(hf: dict[str, Any], encoder: str, decoder: str, where: str) -> int:
    """An integer Marian sets per stack and aiayn once for both (heads, FFN width)."""
    value, other = _field(hf, encoder, int, where), _field(hf, decoder, int, where)
    if value != other:
        raise UserError(f"{where}: {encoder}={value} differs from {decoder}={other}; "
                        f"aiayn's encoder and decoder layers have the same shape")
    return value


def _check_supported(hf: dict[str, Any], where: str) -> None:
    """Refuse the fields that would change what the network computes; warn about the training-only ones."""
    if "model_type" not in hf:  # said as other fields are: "model_type=None" was Python's word for it
        raise UserError(f'{where}: model_type is missing (expected "marian")')
    if hf["model_type"] != "marian":
        raise UserError(f'{where}: model_type={json.dumps(hf["model_type"])} is not supported (expected '
                        '"marian")')
    architectures = hf.get("architectures", ["MarianMTModel"])
    if not isinstance(architectures, list) or "MarianMTModel" not in architectures:
        raise UserError(f"{where}: architectures={json.dumps(architectures)} is not supported "
                        f"(expected MarianMTModel)")
    for name, supported in FIXED_FIELDS.items():
        if name in hf and hf[name] != supported:
            raise UserError(f"{where}: {name}={json.dumps(hf[name])} is not supported "
                            f"(aiayn reads Marian models with {name}={json.dumps(supported)})")
    for name in TRAINING_ONLY:
        if hf.get(name, 0.0):
            log.warning("%s: %s=%s is ignored: aiayn has no such regularizer (inference is unaffected)",
                        where, name, hf[name])


# The config.json keys each `ModelConfig` field is read from, as `model_config_from_marian` reads them:
# two where Marian sets per stack what aiayn sets once. The fields it does not list are fixed.
MARIAN_KEYS = {
    "vocab_size": ("vocab_size",), "tgt_vocab_size": ("decoder_vocab_size",), "d_model": ("d_model",),
    "n_heads": ("encoder_attention_heads", "decoder_attention_heads"),
    "d_ff": ("encoder_ffn_dim", "decoder_ffn_dim"), "n_layers": ("encoder_layers",),
    "n_decoder_layers": ("decoder_layers",), "dropout": ("dropout",), "activation": ("activation_function",),
    "max_len": ("max_position_embeddings",), "share_embeddings": ("share_encoder_decoder_embeddings",),
    "tie_output": ("tie_word_embeddings",), "scale_embedding": ("scale_embedding",),
    "pad_id": ("pad_token_id",), "decoder_start_id": ("decoder_start_token_id",), "eos_id": ("eos_token_id",),
}
# A key that, absent, takes another's value: its problem is that key's (a pad id outside the vocabulary is
# named once, as pad_token_id, not again as a decoder_start_token_id the file does not have)
MARIAN_FALLBACKS = {"decoder_vocab_size": "vocab_size", "decoder_start_token_id": "pad_token_id"}
# A field in a problem, with its value where it has one: `n_heads=5`, `pad_id and eos_id are both 59`
_MODEL_FIELD = re.compile(rf"\b({'|'.join(MARIAN_KEYS)})\b(=[^\s,;)]+)?")


def _in_marian_keys(problem: str, hf: dict[str, Any]) -> str:
    """A `ModelConfig` problem in config.json's keys: `d_model=32 is not divisible by n_heads=5` as
    `... by encoder_attention_heads=5 and decoder_attention_heads=5`."""

    def keys(m: re.Match) -> str:
        names = (MARIAN_FALLBACKS.get(k, k) if hf.get(k) is None else k for k in MARIAN_KEYS[m[1]])
        return " and ".join(name + (m[2] or "") for name in names)

    return _MODEL_FIELD.sub(keys, problem)


def _embeds_each_copy(hf: dict[str, Any], where: str) -> bool:
    """Whether transformers reads a shared vocabulary's stored copies as matrices of their own: version 5
    with `tie_word_embeddings=false` embeds the encoder with model.encoder.embed_tokens.weight and the
    decoder with model.decoder.embed_tokens.weight (model.shared.weight is read by nothing); version 4
    embeds both sides with model.shared.weight. The version is config.json's `transformers_version`, the
    one that saved it; absent (older files), it is taken as 4."""
    if _field(hf, "tie_word_embeddings", bool, where, True):  # every copy is model.shared then
        return False
    version = _field(hf, "transformers_version", str, where, "")
    major = re.match(r"\d+", version)
    return major is not None and int(major[0]) >= 5


def model_config_from_marian(hf: dict[str, Any], where: str) -> ModelConfig:
    """A MarianConfig (config.json as a dict) -> `ModelConfig`, or `UserError` naming what differs.

    Defaults are MarianConfig's, for the fields that older files omit.
    """
    _check_supported(hf, where)
    activation = _field(hf, "activation_function", str, where, "gelu")
    if activation not in ACTIVATIONS:
        raise UserError(f"{where}: activation_function={json.dumps(activation)} is not supported; "
                        f"supported: {', '.join(map(json.dumps, ACTIVATIONS))}")
    shared = _field(hf, "share_encoder_decoder_embeddings", bool, where, True)
    vocab_size = _field(hf, "vocab_size", int, where)
    pad_id = _field(hf, "pad_token_id", int, where)
    values = dict(
        vocab_size=vocab_size,
        tgt_vocab_size=None if shared else _field(hf, "decoder_vocab_size", int, where, vocab_size),
        d_model=_field(hf, "d_model", int, where),
        n_heads=_same_field(hf, "encoder_attention_heads", "decoder_attention_heads", where),
        d_ff=_same_field(hf, "encoder_ffn_dim", "decoder_ffn_dim", where),
        n_layers=_field(hf, "encoder_layers", int, where),
        n_decoder_layers=_field(hf, "decoder_layers", int, where),
        dropout=_field(hf, "dropout", float, where, 0.1),
        activation=ACTIVATIONS[activation],
        norm_first=False,
        positions="sin_cos",
        max_len=_field(hf, "max_position_embeddings", int, where, 1024),
        share_embeddings=shared and not _embeds_each_copy(hf, where),  # one vocabulary, two matrices else
        tie_output=_field(hf, "tie_word_embeddings", bool, where, True),
        scale_embedding=_field(hf, "scale_embedding", bool, where, False),
        final_logits_bias=True,
        layer_norm_eps=1e-5,  # Marian's nn.LayerNorm default
        pad_id=pad_id,
        decoder_start_id=_field(hf, "decoder_start_token_id", int, where, pad_id),
        eos_id=_field(hf, "eos_token_id", int, where),
    )
    try:
        return from_dict(ModelConfig, values, where=where)
    except ConfigError as e:  # "n_heads=5" is aiayn's name: the user's file says encoder_attention_heads
        problems = dict.fromkeys(_in_marian_keys(problem, hf) for problem in e.problems)  # one for two
        raise UserError(f"{where}: {'; '.join(problems)}") from None


def _brief(e: Exception) -> str:
    """An exception as a few words: torch's messages run to paragraphs of advice."""
    text = str(e).strip().split("\n")[0].split(". ")[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _load_pickled_weights(path: Path) -> dict[str, Tensor]:
    """`pytorch_model.bin` with `weights_only=True`: tensors and plain containers, never code from the pickle.

    A refusal is one line without torch's advice to retry with `weights_only=False`, which is what
    must never be done with a file from the internet.
    """
    try:
        with warnings.catch_warnings():  # torch notes raw pickles' protocol; it refuses them below anyway
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a truncated or foreign file
        head = file_head(path)
        if _refused_pickle(e, head):
            named = re.search(r"GLOBAL (\S+)", str(e))
            asks = f" (the pickle asks for {named.group(1)})" if named else ""
            raise UserError(f"{path}: refused: not plain tensors{asks}; "
                            f"weights are never loaded with code execution") from None
        if foreign := _foreign(head):
            raise UserError(f"{path}: not a PyTorch weights file ({foreign})") from None
        # a zip archive or a pickle as torch writes them, damaged: most often a download cut short, which
        # "not a PyTorch weights file (OSError: [Errno 22] Invalid argument)" did not suggest
        raise UserError(f"{path}: damaged or cut short ({_brief(e)}); download it again") from None
    return _plain_tensors(weights, path)


def _refused_pickle(e: Exception, head: bytes | None) -> bool:
    """Whether torch's weights-only unpickler refused a pickle (a global it does not allow: code; an opcode
    it does not take) rather than met a file that is none: torch writes a zip archive or a pickle that
    starts 0x80 (protocol 2 and up), and a pickle of any protocol that asks for code names a global.
    Text (a server's "Invalid username or password.") starts with letters that are opcodes too: "I" is
    INT, and the unpickler refused it as "Unsupported operand 73", which called the file unsafe."""
    if not isinstance(e, pickle.UnpicklingError) or is_safetensors(head):
        return False
    # the whole name, as torch ends it: "config.json not found" began "GLOBAL onfig.json not found.foo was"
    asks = re.search(r"GLOBAL [A-Za-z_][\w.]*\.[A-Za-z_]\w* (was not|whose module)", str(e))
    return asks is not None or (head is not None and head.startswith((b"\x80", b"PK\x03\x04")))


def _foreign(head: bytes | None) -> str | None:
    """What a file that starts `head` is, where it is no PyTorch file at all (neither a zip archive nor a
    pickle, which starts 0x80 as torch writes it); None for one that is, but damaged (torch's error says),
    or that could not be read."""
    if is_safetensors(head):  # first: its length's first byte may be 0x80
        return "a safetensors file: name it model.safetensors"
    if head is None or head.startswith((b"PK\x03\x04", b"\x80")):
        return None
    return f"it starts {head[:24]!r}" if head else "empty"


def _plain_tensors(weights: Any, path: Path) -> dict[str, Tensor]:
    """A state dict is str -> Tensor; a safe pickle can still hold a list or numbers instead."""
    if not isinstance(weights, dict):
        raise UserError(f"{path}: holds type {type(weights).__name__}, expected a dict of name -> tensor")
    for name, value in weights.items():
        if not isinstance(name, str):
            raise UserError(f"{path}: key {name!r} is of type {type(name).__name__}, expected a string")
        if not isinstance(value, Tensor):
            raise UserError(f"{path}: {name} is of type {type(value).__name__}, expected a tensor")
    return _float_tensors(weights, path)


def _float_tensors(weights: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """The tensors, checked to be floating point, in the dtype stored (`convert_weights` makes them
    float32); an integer, bool or complex one is refused by name: `.float()` made garbage weights of it
    (a complex one with a two-line warning), and the model translated nonsense."""
    for name, value in weights.items():
        if not value.is_floating_point():
            dtype = str(value.dtype).removeprefix("torch.")
            raise UserError(f"{path}: {name} is {dtype}, not a float tensor")
    return weights


def load_marian_weights(directory: Path) -> tuple[dict[str, Tensor], Path]:
    """The tensors of `model.safetensors` (or its shards) or of `pytorch_model.bin`, in the dtype stored
    (a float16 table of positions is compared as float16), and the file they were read from (the index for
    shards), for error messages."""
    single, index, legacy = (directory / n for n in
                             ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    for path in (single, index, legacy):  # up to the one read: `git lfs pull --include` may fetch it alone
        _check_stand_in(path)
        if path.is_file():
            break
    if single.is_file():
        source, files = single, [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{index}: weight_map is not a mapping from tensor name to file name")
        names = sorted(set(weight_map.values()))
        if any(Path(name).name != name or name in ("", ".", "..") for name in names):  # ../../etc/passwd
            raise UserError(f"{index}: weight_map names a file outside {directory}")
        source, files = index, [directory / name for name in names]
        for f in files:
            _check_stand_in(f)
            if not f.is_file():
                raise UserError(f"{index}: names the shard {f.name}, which is missing")
    elif legacy.is_file():
        return _load_pickled_weights(legacy), legacy
    else:
        for path in (single, index, legacy):
            if path.is_dir():
                raise UserError(f"{path}: is a directory, not a file")
        raise UserError(f"{directory}: no model.safetensors or pytorch_model.bin")
    weights = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            if cut_short(e):  # as a cut-short pytorch_model.bin is said
                raise UserError(f"{f}: damaged or cut short ({e}); download it again") from None
            raise UserError(f"{f}: corrupt weights ({e})") from None
    return _float_tensors(weights, source), source


def _check_positions(hf: dict[str, Tensor], config: ModelConfig, where: str) -> None:
    """Older files store the sinusoid tables; they must be the formula aiayn computes (`sin_cos`), as
    rounded to the dtype stored: float16 and bfloat16 tables (model.half().save_pretrained()) are off
    float32's by up to 2.4e-4 and 4e-3, and were refused as learned positions."""
    for side in ("encoder", "decoder"):
        table = hf.pop(f"model.{side}.embed_positions.weight", None)
        if table is None:
            continue
        expected = sinusoidal_positions(table.shape[0], config.d_model, config.positions).to(table.dtype)
        # one unit in the last place at 1 (values are in [-1, 1]): the float32 tables computed by another
        # formula may round the other way; 1e-4 covers float32's own differences (sin of 511 radians)
        atol = max(1e-4, torch.finfo(table.dtype).eps)
        if table.shape != expected.shape or not torch.allclose(table.float(), expected.float(), atol=atol):
            raise UserError(f"{where}: model.{side}.embed_positions.weight is not the sin-then-cos sinusoid "
                            f"table; learned positions are not supported")


def _expected_shape(name: str, config: ModelConfig) -> tuple[tuple[int, ...], str] | None:
    """The shape config.json gives a MarianMT tensor, and the fields that give it; None for names it does
    not size (the position tables, which `_check_positions` reads)."""
    d, d_ff = config.d_model, config.d_ff
    vocab, tgt_vocab = config.vocab_size, config.target_vocab_size
    tgt_field = "vocab_size" if config.tgt_vocab_size is None else "decoder_vocab_size"
    if name in ("model.shared.weight", "model.encoder.embed_tokens.weight"):
        return (vocab, d), "vocab_size and d_model"
    if name in ("model.decoder.embed_tokens.weight", "lm_head.weight"):
        return (tgt_vocab, d), f"{tgt_field} and d_model"
    if name == "final_logits_bias":
        return None  # (V,) or (1, V): `_embeddings` checks it
    if ".layers." not in name:
        return None
    part, kind = name.rsplit(".", 2)[-2:]
    if part == "fc1":
        return ((d_ff, d) if kind == "weight" else (d_ff,)), "d_model and encoder_ffn_dim"
    if part == "fc2":
        return ((d, d_ff) if kind == "weight" else (d,)), "d_model and encoder_ffn_dim"
    return ((d, d) if kind == "weight" and part.endswith("_proj") else (d,)), "d_model"


def _check_shapes(hf: dict[str, Tensor], config: ModelConfig, where: str) -> None:
    """Each tensor in the shape config.json gives it: a config that does not describe its weights was
    reported in aiayn's own names ("src_embed.embed.weight (96, 32) vs (192, 64)")."""
    for name in sorted(hf):
        expected = _expected_shape(name, config)
        if expected is not None and tuple(hf[name].shape) != expected[0]:
            raise UserError(f"{where}: {name} has shape {tuple(hf[name].shape)}, not the {expected[0]} of "
                            f"config.json's {expected[1]}; the config does not describe these weights")
    for part, count in (("encoder", config.n_layers), ("decoder", config.decoder_layers)):
        extra = f"model.{part}.layers.{count}."
        if any(name.startswith(extra) for name in hf):
            raise UserError(f"{where}: holds {extra}*, but config.json's {part}_layers is {count}; the "
                            "config does not describe these weights")


def _check_copies(shared: Tensor | None, src: Tensor | None, tgt: Tensor | None, config: ModelConfig,
                  where: str) -> None:
    """One shared matrix stored three times must be stored alike: transformers keeps each stored tensor
    and ties the output to model.shared, and an edited or merged file whose copies differ converted
    silently into another model (logits off by up to 5 in a probe)."""
    for part, side in (("encoder", src), ("decoder", tgt)):
        name = f"model.{part}.embed_tokens.weight"
        if not config.share_embeddings or shared is None or side is None or torch.equal(side, shared):
            continue
        if config.tie_output:
            raise UserError(f"{where}: {name} differs from model.shared.weight, which transformers ties the "
                            "output to; the file is inconsistent")
        # transformers 4 embeds with model.shared, 5 with each copy (`_embeds_each_copy`)
        raise UserError(f"{where}: {name} differs from model.shared.weight, which transformers 4 embeds "
                        "with; transformers 5 (tie_word_embeddings=false) embeds with each copy, but "
                        "config.json's transformers_version is not 5 or later (or is absent): if "
                        "transformers 5 saved this file, set its transformers_version; else make the "
                        "copies agree")


def _embeddings(hf: dict[str, Tensor], config: ModelConfig, where: str) -> dict[str, Tensor]:
    """Token embeddings, output projection and logits bias, in aiayn's names; tying checked."""
    shared = hf.pop("model.shared.weight", None)
    src = hf.pop("model.encoder.embed_tokens.weight", None)
    tgt = hf.pop("model.decoder.embed_tokens.weight", None)
    lm_head = hf.pop("lm_head.weight", None)
    if config.tgt_vocab_size is None and not config.share_embeddings:  # `_embeds_each_copy`: transformers 5
        for part, side in (("encoder", src), ("decoder", tgt)):
            if side is None:  # transformers 5 initializes it at random, where model.shared stood in for it
                raise UserError(f"{where}: missing weight model.{part}.embed_tokens.weight, which "
                                "transformers 5 embeds with (tie_word_embeddings=false; model.shared.weight "
                                "is unused)")
        shared = None
    _check_copies(shared, src, tgt, config, where)
    src = shared if src is None else src
    # a separate target vocabulary has its own embeddings: model.shared is the source's
    tgt = (shared if config.share_embeddings else None) if tgt is None else tgt
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
    vocab = config.target_vocab_size
    if bias is not None and tuple(bias.shape) not in ((vocab,), (1, vocab)):  # (2, V/2) was flattened
        raise UserError(f"{where}: final_logits_bias has shape {tuple(bias.shape)}, not (1, {vocab})")
    out["final_logits_bias"] = torch.zeros(vocab) if bias is None else bias.reshape(-1)
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
    _check_shapes(hf, config, where)
    _check_positions(hf, config, where)
    hf = {name: t.float() for name, t in hf.items()}  # float16 and bfloat16 files too: aiayn's are float32
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
    first: dict[int, str] = {}
    for piece, i in vocab.items():  # two pieces on one id converted, and the checkpoint could not load
        if i in first:
            raise UserError(f"{path}: id {i} is given to both {first[i]!r} and {piece!r}")
        first[i] = piece
    return vocab


def _token_name(value: Any, where: str) -> str:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    name = value.get("content") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise UserError(f"{where}: expected a token string or a table with its \"content\", not {value!r}")
    return name


def _separate_vocabs(directory: Path, settings: dict[str, Any], config: ModelConfig) -> bool:
    """Whether the target side has its own vocabulary (target_vocab.json): tokenizer_config.json's
    `separate_vocabs` where it says, else config.json's `share_encoder_decoder_embeddings` (false: two
    vocabularies, as transformers' converter writes them) or a target_vocab.json beside vocab.json."""
    if "separate_vocabs" in settings:
        return _field(settings, "separate_vocabs", bool, str(directory / "tokenizer_config.json"))
    return config.tgt_vocab_size is not None or _there(directory / "target_vocab.json")


def marian_tokenizer(directory: Path, config: ModelConfig) -> Tokenizer:
    """source.spm/target.spm with vocab.json (and target_vocab.json), as `MarianTokenizer` reads them.

    Pieces come from the SentencePiece models and are mapped to ids through the JSON vocabularies
    (unknown pieces -> <unk>); `</s>` ends the source. Marian has no BOS: its slot is the decoder's
    start token (pad), which `decode_tgt` drops like a pad.
    """
    settings_path = directory / "tokenizer_config.json"
    settings = read_json(settings_path) if _there(settings_path) else {}
    vocab_path = directory / "vocab.json"
    vocab = _read_vocab(vocab_path)
    tgt_path = directory / "target_vocab.json"
    tgt_vocab = _read_vocab(tgt_path) if _separate_vocabs(directory, settings, config) else None
    specials = {}
    for key, default in (("pad", "<pad>"), ("eos", "</s>"), ("unk", "<unk>")):
        name = _token_name(settings.get(f"{key}_token", default), f"{settings_path}: {key}_token")
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
    for spm_model in ("source.spm", "target.spm"):  # a stand-in was "not found", "not a SentencePiece model"
        _check_stand_in(directory / spm_model)
    sides = ((vocab_path, vocab, config.vocab_size, "vocabulary"),
             (tgt_path, tgt_vocab, config.target_vocab_size, "target vocabulary"))
    for path, v, size, side in sides:
        if v is None:  # one vocabulary for both sides: vocab.json must also fit the decoder's
            path, v = vocab_path, vocab
        if set(v.values()) != set(range(size)):
            raise UserError(f"{path}: its {len(v)} ids are not exactly 0..{size - 1}, the model's {side} "
                            f"({size} ids in {directory / 'config.json'})")
    return Tokenizer(directory / "source.spm", directory / "target.spm", vocab, specials, tgt_vocab)


def generation_defaults(directory: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """The model's own decoding settings (beam size, length limit, banned tokens), kept for reference."""
    path = directory / "generation_config.json"
    source = read_json(path) if _there(path) else hf
    keys = ("num_beams", "max_length", "length_penalty", "bad_words_ids", "forced_eos_token_id")
    return {k: source[k] for k in keys if source.get(k) is not None}


def convert_marian(directory: str | Path, out: str | Path, force: bool = False) -> Path:
    """Read a local MarianMT directory and write an aiayn checkpoint to `out`; return its path.

    An existing `out` is replaced only with `force`, and only if it is empty or an earlier checkpoint with
    nothing else in it; never the Marian directory, one holding it, or a checkpoint of a training run."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: {'not a directory' if directory.exists() else 'not found'}")
    # before any work; Python callers too: convert_marian("models/opus", "models") replaced "models"
    check_outside_checkpoints(Path(out), may_be_one=True)  # first, as average's: --force cannot mend it
    check_output(Path(out), [directory], force, earlier=CHECKPOINT_KIND)
    for path in (directory, Path(out)):  # the source's weights read as "corrupt weights"; an output so
        check_utf8_path(path)  # named was written, then refused by every command that loads it
    if is_checkpoint(directory):  # "config.json: not found (is this a MarianMT directory?)"
        raise UserError(f"{directory}: an aiayn checkpoint already; translate, score or fine-tune it "
                        "as it is")
    hf = read_json(directory / "config.json")
    config = model_config_from_marian(hf, str(directory / "config.json"))
    tokenizer = marian_tokenizer(directory, config)
    weights, source = load_marian_weights(directory)
    weights = convert_weights(weights, config, str(source))
    model = model_from_weights(config, weights, source)
    meta = {"converted_from": {"format": "marian", "path": str(directory.resolve())},
            "marian_generation": generation_defaults(directory, hf)}
    # exist_ok=force: as average, an `out` that came while converting is no more replaced than one before
    saved = save_checkpoint(out, model.eval(), tokenizer, meta, replace_training_state=force, exist_ok=force)
    log.info("converted %s: %s parameters", directory, f"{model.num_parameters():,}")  # once it is written
    return saved
