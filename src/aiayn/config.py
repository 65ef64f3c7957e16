"""Configuration: one frozen dataclass per concern, paper defaults, loud about mistakes.

`ModelConfig` holds the architecture of SPEC.md / the paper (section 3). Presets live in a plain dict,
`PRESETS`; `model_config(preset, **overrides)` builds one and checks it. Other concerns (data, training,
decoding) keep their own dataclasses next to the code that uses them and reuse `from_dict` here, so
every configuration is read the same way: an unknown key or a wrong type raises `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping

# CPU threads per process (train.threads, translate --threads): libgomp could not create 20,000 threads
# (its own one-line error) and segfaulted at 100,000; torch.set_num_threads overflows past 2^31.
MAX_THREADS = 1024

ACTIVATIONS = ("relu", "gelu", "silu")
POSITIONS = ("interleaved", "sin_cos")
MAX_WIDTH = 2**24  # d_model and d_ff: 16.7 M, past any model that fits in memory
MAX_IDS = 2**31 - 1  # vocabulary sizes: token ids are 32-bit in SentencePiece and CTranslate2
MAX_LAYERS = 2**12
MAX_POSITIONS = 2**20  # max_len's bound: the sinusoid table holds max_len x d_model floats (4 GB at 1024)
# translate's and score's batch budget (padded tokens), the library's and the CLI's default alike; here, not
# in translate.py, which imports torch: the CLI's parser is built without it
DEFAULT_MAX_TOKENS = 4096


class ConfigError(ValueError):
    """A configuration that names an unknown key, has a wrong type or contradicts itself. Its `problems`
    are each problem's own message (the error's joins them, after `context`), so that a config file's
    reader can say where each wrong value was written."""

    def __init__(self, *problems: str, context: str = "") -> None:
        super().__init__(context + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ModelConfig:
    """The Transformer's shape (paper section 3, Table 3). Field names follow the paper."""

    vocab_size: int  # source vocabulary size; also the target's when tgt_vocab_size is None (shared)
    tgt_vocab_size: int | None = None  # None: one vocabulary shared by source and target (paper, EN-DE)
    d_model: int = 512  # width of every sub-layer output and of the embeddings
    n_heads: int = 8  # h; d_k = d_v = d_model / h
    d_ff: int = 2048  # inner size of the position-wise FFN (4 x d_model in the paper)
    n_layers: int = 6  # N, encoder layers
    n_decoder_layers: int | None = None  # None: same as n_layers (paper)
    dropout: float = 0.1  # P_drop on sub-layer outputs and on embedding + position sums
    activation: str = "relu"  # FFN non-linearity: relu (paper), gelu, silu (Marian's swish)
    norm_first: bool = False  # False: post-norm LayerNorm(x + Sublayer(x)) (paper); True: pre-norm
    positions: str = "interleaved"  # interleaved: PE(2i)=sin, PE(2i+1)=cos (paper); sin_cos: all sines
    # then all cosines, with the paper's frequencies (Marian), needed to load Marian's weights
    max_len: int = 1024  # longest sequence the sinusoid table covers
    share_embeddings: bool = True  # one matrix for source, target embeddings: needs tgt_vocab_size None
    tie_output: bool = True  # pre-softmax projection shares the target embedding matrix (section 3.4)
    scale_embedding: bool = True  # multiply embeddings by sqrt(d_model) (section 3.4)
    final_logits_bias: bool = False  # a bias on the logits (Marian); the paper has none
    layer_norm_eps: float = 1e-5  # epsilon of every LayerNorm: PyTorch's default (the paper gives none)
    pad_id: int = 0  # the tokenizer's padding id: builds the source padding mask
    decoder_start_id: int = 1  # first decoder input: BOS for aiayn's tokenizers, pad for Marian
    eos_id: int = 2  # end of sentence, from the tokenizer

    def __post_init__(self) -> None:
        check_types(self)
        # Positivity first: the divisibility and vocabulary checks below would divide by or compare with
        # a zero or negative size (n_heads=0 was a ZeroDivisionError).
        problems = [
            f"{name}={getattr(self, name)} must be positive"
            for name in ("vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_layers",
                         "n_decoder_layers", "max_len")
            if getattr(self, name) is not None and getattr(self, name) <= 0
        ]
        if problems:
            raise ConfigError(*problems, context="ModelConfig: ")
        if self.max_len > MAX_POSITIONS:  # a tampered meta.json asked for a 200 GB position table
            problems.append(f"max_len={self.max_len} is more than {MAX_POSITIONS:,} positions")
        for name, bound in (("vocab_size", MAX_IDS), ("tgt_vocab_size", MAX_IDS), ("d_model", MAX_WIDTH),
                            ("d_ff", MAX_WIDTH)):  # else an allocation or overflow traceback
            if (getattr(self, name) or 0) > bound:
                problems.append(f"{name}={getattr(self, name)} is more than {bound:,}")
        for name in ("n_layers", "n_decoder_layers"):
            if (getattr(self, name) or 0) > MAX_LAYERS:
                problems.append(f"{name}={getattr(self, name)} is more than {MAX_LAYERS:,} layers")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.positions not in POSITIONS:
            problems.append(f"positions={self.positions!r} is not one of {POSITIONS}")
        if self.d_model % 2:
            problems.append(f"d_model={self.d_model} must be even for sinusoidal positions")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} is not in [0, 1)")
        if not (math.isfinite(self.layer_norm_eps) and self.layer_norm_eps > 0):  # else NaN after some updates
            problems.append(f"layer_norm_eps={self.layer_norm_eps} must be a finite number > 0")
        # A given tgt_vocab_size is the target's own vocabulary, even of vocab_size's size: sharing one
        # matrix between two vocabularies tied unrelated pieces silently (meta_model_config still reads
        # such a saved config, as the one vocabulary it was built with)
        if self.share_embeddings and self.tgt_vocab_size is not None:
            problems.append(
                f"share_embeddings=True needs one vocabulary, but vocab_size={self.vocab_size} and "
                f"tgt_vocab_size={self.tgt_vocab_size} are two: leave tgt_vocab_size None to share one, "
                "or set share_embeddings=False"
            )
        size = min(self.vocab_size, self.target_vocab_size)  # ids 0..size-1 on both sides
        for name in ("pad_id", "decoder_start_id", "eos_id"):
            if not 0 <= getattr(self, name) < size:
                problems.append(f"{name}={getattr(self, name)} is outside the vocabulary of {size:,}")
        if self.pad_id == self.eos_id:  # the search masks padding: no output could ever end
            problems.append(f"pad_id and eos_id are both {self.pad_id}: padding and the end of a sentence "
                            "need two ids")
        if problems:
            raise ConfigError(*problems, context="ModelConfig: ")

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size if self.tgt_vocab_size is None else self.tgt_vocab_size

    @property
    def decoder_layers(self) -> int:
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads


def resolved_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields (`values`: all of them) with each None read as what it means, so that two
    descriptions of one model compare equal: a fine-tune restating n_decoder_layers=1 of a 1-layer
    checkpoint saved with None was refused, and `aiayn average` called the two "different models"."""
    resolved = dict(values)
    if resolved["n_decoder_layers"] is None:  # as `ModelConfig.decoder_layers`
        resolved["n_decoder_layers"] = resolved["n_layers"]
    if resolved["tgt_vocab_size"] is None:  # as `ModelConfig.target_vocab_size`
        resolved["tgt_vocab_size"] = resolved["vocab_size"]
    return resolved


# The paper's two models (Table 3) and smaller ones that train on a CPU in minutes. Vocabulary size
# and special ids come from the tokenizer, so presets leave them out.
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, dropout=0.1),
    "big": dict(d_model=1024, n_heads=16, d_ff=4096, n_layers=6, dropout=0.3),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, n_layers=3, dropout=0.1),
    "tiny": dict(d_model=128, n_heads=4, d_ff=512, n_layers=2, dropout=0.1),
    "micro": dict(d_model=32, n_heads=2, d_ff=64, n_layers=1, dropout=0.0),
}


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    """A preset with overrides, e.g. `model_config("base", vocab_size=37000)`."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return from_dict(ModelConfig, {**PRESETS[preset], **overrides})


def from_dict(cls: type, values: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a mapping, naming any unknown key (and `where` it came from)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        place = f" in {where}" if where else ""
        raise ConfigError(
            f"unknown {cls.__name__} key(s){place}: {', '.join(unknown)}; known: {', '.join(sorted(names))}"
        )
    try:
        return cls(**values)
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{cls.__name__}: {e}") from None


def check_types(obj: Any, paths: tuple[str, ...] = ()) -> None:
    """Raise ConfigError if a dataclass field's value does not match its annotation. The str fields named
    in `paths` also take an os.PathLike (`TrainConfig(run_dir=Path("x"))` was refused), kept as its str:
    the config is still written to meta.json and TOML as it was, and equals one read from a file."""
    for name in paths:
        if isinstance(value := getattr(obj, name), os.PathLike):
            object.__setattr__(obj, name, os.fspath(value))  # frozen: settled once, as it is made
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if not matches_type(value, hint):
            raise ConfigError(f"{type(obj).__name__}.{f.name}={value!r} has type {type(value).__name__}, "
                              f"expected {type_name(hint)}")


def type_name(hint: Any) -> str:
    """A type annotation as its code writes it: `str`, `int | None` (a class printed as <class 'str'>)."""
    return hint.__name__ if isinstance(hint, type) else str(hint)


def matches_type(value: Any, hint: Any) -> bool:
    """Whether `value` fits the type annotation `hint` (a bool is no int; an int is a float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, origin)
    if origin is dict:
        return isinstance(value, dict)
    if hint is Any:
        return True
    return isinstance(value, hint)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)
