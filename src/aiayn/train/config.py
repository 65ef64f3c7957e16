"""Training configuration: a TOML file with [model], [data] and [train] sections, `--set` overrides.

    [model]            preset = "base" plus any ModelConfig field (vocabulary size and special
                       ids come from the tokenizer, so they are not set here); with
                       train.init_from the model is the checkpoint's: only `dropout` may change
    [data]             DataConfig: files, tokenizer, maximum length
    [train]            TrainConfig: batching, optimizer, schedule, stopping, checkpoints

Every key is checked: an unknown one or a wrong type raises `ConfigError` naming it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as the tomli package, a dependency there
    import tomli as tomllib

from aiayn.config import (
    ACTIVATIONS, MAX_THREADS, POSITIONS, PRESETS, ConfigError, ModelConfig, check_types, from_dict,
    matches_type, model_config, resolved_settings, to_dict,
)
from aiayn.data.tokenizer import MIN_CHARACTER_COVERAGE
from aiayn.errors import (
    ESCAPED_CONTROLS,
    UserError,
    check_path,
    control_character,
    non_utf8_name,
    str_list,
)
from aiayn.files import require_file

TOKENIZER_FIELDS = ("vocab_size", "tgt_vocab_size", "pad_id", "decoder_start_id", "eos_id")
# [data]'s settings that a tokenizer is trained with (`aiayn.data.dataset.tokenizer_settings`)
TOKENIZER_SETTINGS = ("vocab_size", "spm_type", "shared_vocab", "normalization", "character_coverage")
DATA_FILES = ("train_src", "train_tgt", "valid_src", "valid_tgt")  # [data]'s paths of the corpus' files
SPM_TYPES = ("bpe", "unigram")  # data.spm_type's values
NORMALIZATIONS = ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity")  # SentencePiece's rule names
TRAIN_PATHS = ("run_dir", "init_from")  # [train]'s paths
PATHS = {"data": DATA_FILES, "train": TRAIN_PATHS}  # the settings that take a pathlib.Path in Python
SECTIONS = ("data", "model", "train")
# A [model] setting named in ModelConfig's problems ("n_heads=8"); the tokenizer's are not [model]'s to set
MODEL_KEY = re.compile(r"(?<![.\w])({})(?==)".format(
    "|".join(name for name in ModelConfig.__dataclass_fields__ if name not in TOKENIZER_FIELDS)))
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
# The string settings that take one of these names: a number written there needs no quotes but a name
CHOICES = {"model.preset": tuple(PRESETS), "model.activation": ACTIVATIONS, "model.positions": POSITIONS,
           "data.spm_type": SPM_TYPES, "data.normalization": NORMALIZATIONS, "train.precision": PRECISIONS,
           "train.device": DEVICES}
# train.seed's bound. torch takes seeds in [-2**63, 2**64 - 1], but `epoch_order` seeds its generator with
# seed * 100_003 + epoch, so a seed must stay within 2**63 / 100_003 of 0: 2**46 is 7e13 (x 100_003 = 7.04e18).
# The CPU's generator keeps a seed's low 32 bits (1 and 2**32 + 1 train alike there): `train` warns of a seed
# outside 0 to 2**32 - 1 rather than refuse it, since runs trained with one must resume as they began.
MAX_SEED = 2**46

MAX_VOCAB = 2**24  # data.vocab_size's bound (SentencePiece reads a 32-bit integer; 16.7 M is past any use)

@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text is and how it becomes subwords."""

    train_src: str = ""  # training source text, one sentence per line
    train_tgt: str = ""  # training target text, aligned line by line
    valid_src: str = ""  # validation source text ("" = no validation)
    valid_tgt: str = ""  # validation target text
    vocab_size: int = 8000  # SentencePiece vocabulary (the paper: ~37,000 shared BPE for WMT EN-DE)
    spm_type: str = "bpe"  # "bpe" (the paper's byte-pair encoding) or "unigram"
    shared_vocab: bool = True  # one vocabulary for source and target (the paper), else one per side
    max_len: int = 256  # pairs with a side longer than this many tokens (with EOS) are dropped
    normalization: str = "nmt_nfkc"  # SentencePiece's rule for the text: "nmt_nfkc" (SentencePiece's and
    # Marian's default: NFKC, and the zero-width non-joiner U+200C becomes a space), "nfkc" (keeps ZWNJ),
    # "nmt_nfkc_cf" / "nfkc_cf" (also case-folded) or "identity" (keeps every character; SentencePiece still
    # writes a run of spaces as one, and drops those at the ends of a line)
    character_coverage: float = 1.0  # share of the characters the vocabulary covers, 0.98 to 1;
    # SentencePiece recommends 0.9995 for Chinese and Japanese (rarer characters become <unk>)

    def __post_init__(self) -> None:
        check_types(self, DATA_FILES)
        problems = []  # each naming its setting and value: a config file's reader says where it was written
        if self.spm_type not in SPM_TYPES:
            problems.append(f"data.spm_type={self.spm_type!r} is not 'bpe' or 'unigram'")
        if self.normalization not in NORMALIZATIONS:
            problems.append(f"data.normalization={self.normalization!r} is not one of "
                            f"{', '.join(NORMALIZATIONS)}")
        if not MIN_CHARACTER_COVERAGE <= self.character_coverage <= 1.0:  # SentencePiece's; refuses nan
            problems.append(f"data.character_coverage={self.character_coverage} is not in "
                            f"[{MIN_CHARACTER_COVERAGE}, 1] (SentencePiece's range)")
        if self.vocab_size < 8:
            problems.append(f"data.vocab_size={self.vocab_size} must be >= 8")
        if self.vocab_size > MAX_VOCAB:  # SentencePiece's int32 parse failed with a traceback, after reading
            problems.append(f"data.vocab_size={self.vocab_size} is more than {MAX_VOCAB:,}")
        if self.max_len < 2:
            problems.append(f"data.max_len={self.max_len} must be >= 2")
        if bool(self.valid_src) != bool(self.valid_tgt):  # else validation silently reads one side only
            problems.append("data.valid_src and data.valid_tgt go together: set both or neither")
        if problems:
            raise ConfigError(*problems)
        _settle_paths(self, "data", DATA_FILES)


def _settle_paths(section: Any, name: str, fields: tuple[str, ...]) -> None:
    """Paths as a shell reads them: a leading ~ is the home directory. Neither TOML nor the shell
    (`--set train.run_dir=~/runs/x`) expands it, nor Python (`TrainConfig(run_dir="~/x")` made a literal
    `./~/x`), and a literal `~` directory in the working directory is one `rm -rf ~` away from the user's
    home. A path whose name is not UTF-8 (bytes Python keeps as surrogates) trained, then failed with a
    UnicodeEncodeError traceback at the first checkpoint, whose meta.json records the paths: refused. So is
    one with a control character (`_control_character`)."""
    for field_name in fields:
        value = os.path.expanduser(getattr(section, field_name))
        object.__setattr__(section, field_name, value)  # frozen: settled once, as it is made
        if (shown := non_utf8_name(value)) is not None:
            raise ConfigError(f"{name}.{field_name}='{shown}': the name is not UTF-8, which the checkpoints "
                              "record it in; rename it")
        if problem := _control_character(value):
            raise ConfigError(f"{name}.{field_name}={value!r} {problem}")


def _control_character(value: str) -> str | None:
    """What is wrong with a path that holds a control character (C0 or DEL), else None. Mostly a TOML
    escape nobody meant: `run_dir = "C:\\runs\\new"` (a Windows habit) or --set 'train.run_dir="a\\nb"'
    trained into a directory whose name held CR and LF, which split the log's and the result's lines. The
    advice is for a path written in "...": said as such, since a literal tab in '...' holds one too."""
    if (found := control_character(value)) is None:
        return None
    escape = ("; in TOML's \"...\" a backslash starts an escape: write such a path in '...', which keeps "
              "backslashes, or with /" if found in ESCAPED_CONTROLS.values() else "")
    return f"holds {found}, which no path should have{escape}"


# [train]'s counts, and what 0 means for each (as its field's comment says): one "0 = no limit / off"
# told train.threads=-1 that 0 turned threads off, where it is PyTorch's default
COUNTS_ZERO_MEANS = {"max_updates": "no limit", "max_epochs": "no limit", "patience": "never stop early",
                     "threads": "PyTorch's default", "bleu_every": "no validation BLEU"}


@dataclass(frozen=True)
class TrainConfig:
    """The paper's recipe (section 5) and the loop's bookkeeping."""

    run_dir: str = "runs/default"  # checkpoints, tokenizer, cache, metrics.jsonl, curves.png
    seed: int = 1  # model initialization, dropout and batch order (up to ±MAX_SEED; runs of their own only
    # from 0 to 2**32 - 1, decoding.options.MAX_CPU_SEED: the rest is warned of)
    max_tokens: int = 4096  # padded tokens per batch and side, per process
    update_freq: int = 1  # batches accumulated per update; tokens/update ~ max_tokens*update_freq*processes
    lr_scale: float = 1.0  # multiplies the paper's schedule
    warmup: int = 4000  # warmup_steps of the schedule (the paper: 4000)
    adam_beta1: float = 0.9  # the paper's Adam: beta1 0.9, beta2 0.98, eps 1e-9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1  # eps_ls (section 5.4)
    clip_norm: float = 0.0  # clip the gradient norm to this (0 = no clipping; the paper does not clip)
    max_updates: int = 0  # stop after this many updates (0 = no limit); paper: 100k base, 300k big
    max_epochs: int = 0  # stop after this many epochs (0 = no limit)
    max_minutes: float = 0.0  # stop after this much training wall time, resumed runs included (0 = no limit)
    cooldown: float = 0.0  # over this last fraction of the budget (max_minutes, max_updates or max_epochs,
    # whichever ends first) the lr falls linearly toward 0 (under max_updates=N the last update runs at
    # 1/(cooldown x N) of the schedule); 0 = the paper's schedule to the end
    patience: int = 0  # stop after this many validations without a better loss (0 = never)
    valid_every: int = 1000  # validate and checkpoint every this many updates (and at the end)
    keep_last: int = 5  # checkpoints kept (the paper averages the last 5 for base, 20 for big)
    log_every: int = 50  # updates between lines of metrics.jsonl (and a shorter last one at the budget's end)
    precision: str = "fp32"  # "fp32", "bf16" (autocast, CPU or GPU) or "fp16" (GPU, dynamic loss scaling)
    device: str = "auto"  # "auto" (CUDA if present), "cpu" or "cuda"
    compile: bool = False  # torch.compile the model (the checkpoint keeps plain names)
    checkpoint_activations: bool = False  # recompute each layer's activations in the backward pass instead
    # of keeping them: less memory for a third more arithmetic, the same updates (bit for bit on a CPU)
    threads: int = 0  # CPU threads per process (0 = PyTorch's default); 1 on a busy shared machine
    bleu_every: int = 0  # validation BLEU (greedy, sacreBLEU) every this many updates (0 = off)
    bleu_lang: str = ""  # the target language's code for BLEU's tokenizer, as `aiayn evaluate -l`: zh, ja
    # and ko get sacreBLEU's own, th/lo/km/my characters; "" or others 13a, which scores unspaced text near 0
    init_from: str = ""  # fine-tune this checkpoint (aiayn or converted Marian): its weights, model and
    # tokenizer, a fresh optimizer and step 0; "" = a new model and a SentencePiece model trained here

    def __post_init__(self) -> None:
        check_types(self, TRAIN_PATHS)
        _settle_paths(self, "train", TRAIN_PATHS)
        problems = []
        if self.precision not in PRECISIONS:
            problems.append(f"train.precision={self.precision!r} is not one of {PRECISIONS}")
        if self.device not in DEVICES:
            problems.append(f"train.device={self.device!r} is not auto, cpu or cuda")
        for name in ("max_tokens", "update_freq", "warmup", "valid_every", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.warmup > 2**53:  # the schedule's warmup^-1.5 in floats: an OverflowError at the first update
            problems.append(f"train.warmup={self.warmup} is more than 2^53 updates")
        if not 0.0 <= self.cooldown < 1.0:
            problems.append(f"train.cooldown={self.cooldown} is not in [0, 1)")
        if self.cooldown and not (self.max_minutes or self.max_updates or self.max_epochs):
            problems.append("train.cooldown needs a budget to end at: train.max_minutes, "
                            "train.max_updates or train.max_epochs")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append(f"train.label_smoothing={self.label_smoothing} is not in [0, 1)")
        for name in ("adam_beta1", "adam_beta2"):  # torch.optim.Adam's bounds, checked before any data work
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"train.{name}={getattr(self, name)} is not in [0, 1)")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):  # 0 divides by a zero second moment
            problems.append(f"train.adam_eps={self.adam_eps} must be a finite number > 0")
        problems += self._budget_problems() + self._bleu_problems()
        if problems:
            raise ConfigError(*problems)

    def _bleu_problems(self) -> list[str]:
        if not self.bleu_lang:  # nothing to check: sacreBLEU's import was 2.6 s of every cold `train` start
            return []
        if not self.bleu_every:
            return [f"train.bleu_lang={self.bleu_lang!r} needs train.bleu_every (validation BLEU is off)"]
        from aiayn.evaluate import target_language  # sacreBLEU, only for this check

        try:
            target_language(self.bleu_lang, "train.bleu_lang")
        except UserError as e:
            return [str(e)]
        return []

    def _budget_problems(self) -> list[str]:
        """Numbers TOML lets through (nan, inf, negatives) that mean nothing as a rate, a norm or a budget."""
        problems = []
        for name in ("lr_scale", "clip_norm", "max_minutes"):  # 0 is meaningful: no lr, no clipping, no limit
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"train.{name}={value} must be a finite number >= 0")
        for name, zero in COUNTS_ZERO_MEANS.items():
            if getattr(self, name) < 0:
                problems.append(f"train.{name}={getattr(self, name)} must be >= 0 (0 = {zero})")
        if self.threads > MAX_THREADS:  # torch.set_num_threads overflowed, libgomp crashed
            problems.append(f"train.threads={self.threads} is more than {MAX_THREADS:,}")
        if not -MAX_SEED <= self.seed <= MAX_SEED:  # else: an overflow traceback once training starts
            problems.append(f"train.seed={self.seed} must be between -2**46 and 2**46 ({MAX_SEED:,})")
        if not self.run_dir.strip():
            problems.append("train.run_dir is empty; name the directory for checkpoints")
        return problems


@dataclass(frozen=True)
class RunConfig:
    model: dict[str, Any] = field(default_factory=dict)  # preset (default "base") + ModelConfig fields
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    # [data] keys a file or --set wrote into `data_read` (see `given_data_keys`)
    data_given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    data_read: DataConfig | None = field(default=None, compare=False, repr=False)
    # fine-tuning a model whose checkpoint records no tokenizer settings (a converted Marian model, or a
    # fine-tune of one): [data]'s tokenizer settings describe nothing, and are left out of `to_dict`
    tokenizer_imported: bool = field(default=False, compare=False, repr=False)
    # where each setting was written, and its value there ("data.max_len" -> ("run.toml:3", 64)): what
    # `load_config` read, for problems found later (`finetune_model_config`, against a checkpoint)
    origins: dict[str, tuple[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, kind in (("model", dict), ("data", DataConfig), ("train", TrainConfig)):
            if not isinstance(getattr(self, name), kind):  # a dict for data was "'dict' object has no
                # attribute 'max_len'"
                raise TypeError(f"RunConfig's {name} is {type(getattr(self, name)).__name__}: it is a "
                                f"{kind.__name__} (run_config builds a RunConfig from dicts)")
        set_by_tokenizer = sorted(set(self.model) & set(TOKENIZER_FIELDS))
        if set_by_tokenizer:
            raise ConfigError(f"model.{set_by_tokenizer[0]} comes from the tokenizer and cannot be set")
        if not self.train.init_from:  # check the model keys now, before any data is read. (With init_from
            # the model is the checkpoint's, compared with [model] in `finetune_model_config`: checked
            # against the base preset, restating its d_model=36 was "not divisible by n_heads=8")
            model_len = self.model_config(vocab_size=64).max_len
            if self.data.max_len > model_len:
                raise ConfigError(f"{self.shown('data.max_len', self.data.max_len)} is longer than "
                                  f"{self.shown('model.max_len', model_len)}")
        else:  # what does not depend on the checkpoint's shape, before run_dir is made
            self._check_finetune_keys()
        if self.model.get("final_logits_bias") is True and not self.train.init_from:
            raise ConfigError("model.final_logits_bias=true is a fixed buffer that imported Marian models "
                              "bring (HuggingFace does not train it either): a new model would keep it at zero; "
                              "leave it out")
        # Not with init_from: shared_vocab may be the checkpoint's (`with_checkpoint_tokenizer_settings`
        # adopts it), blamed on a user who never wrote it; `finetune_model_config` compares [model] there
        unshared = not self.data.shared_vocab and not self.train.init_from
        if unshared and self.model.get("share_embeddings") is True:
            raise ConfigError("model.share_embeddings=true needs one vocabulary, but data.shared_vocab=false "
                              "trains one per side")
        if self.data.max_len > self.train.max_tokens:
            raise ConfigError(f"{self.shown('data.max_len', self.data.max_len)} does not fit in "
                              f"{self.shown('train.max_tokens', self.train.max_tokens)}")
        for name in ("patience", "bleu_every"):  # they read the validation set: without one, silently nothing
            if getattr(self.train, name) and not self.data.valid_src:
                raise ConfigError(f"train.{name}={getattr(self.train, name)} needs a validation set "
                                  "(data.valid_src and data.valid_tgt)")

    def _check_finetune_keys(self) -> None:
        """With train.init_from: a known preset, if any, and dropout (the one key that may differ from the
        checkpoint's) in [0, 1)."""
        preset, dropout = self.model.get("preset"), self.model.get("dropout", 0.0)
        if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
            raise ConfigError(f"model.preset={toml_value(preset)} is not one of {sorted(PRESETS)}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={toml_value(dropout)} is not in [0, 1)")

    def written_at(self, setting: str, value: Any) -> str | None:
        """Where `setting` ("data.max_len") was written, if it still has the `value` written there (a
        config `dataclasses.replace`d since may not); None where not known."""
        where, written = self.origins.get(setting, (None, None))
        return where if where is not None and written == value else None

    def written_where(self, *settings: str) -> str:
        """A refusal's start naming where `settings` ("train.seed") were written, each if it still has the
        value written there: "run.toml:5: ", "run.toml:5 and --set 'train.seed=2': "; "" where none was
        (defaults, or settings replaced since)."""
        written = (self.written_at(setting, self._value(setting)) for setting in settings)
        places = _in_line_order(place for place in written if place is not None)
        return f"{' and '.join(places)}: " if places else ""

    def _value(self, setting: str) -> Any:
        section, key = setting.split(".", 1)
        return self.model.get(key) if section == "model" else getattr(getattr(self, section), key)

    def shown(self, setting: str, value: Any) -> str:
        """`setting=value` for a problem, "(the default)" after it where no file or --set wrote it: the
        problem is placed at the line of the other setting it names, which blamed the user for this one
        too ("run.toml:2: data.max_len=256 is longer than model.max_len=5", [data] never written)."""
        return f"{setting}={value}{' (the default)' * self.is_default(setting, value)}"

    def is_default(self, setting: str, value: Any) -> bool:
        """Whether `setting` has `value` as its default, written by no file or --set."""
        section, key = setting.split(".", 1)
        cls = {"data": DataConfig, "train": TrainConfig, "model": ModelConfig}[section]
        return self.written_at(setting, value) is None and value == cls.__dataclass_fields__[key].default

    def refusal(self, setting: str, value: Any, problem: str) -> ConfigError:
        """A ConfigError for `problem` with `setting`, found after loading (against a checkpoint, the
        machine), named where it was written if it still has the `value` written there, as `load_config`
        names its own: run.toml:5: ..., or the --set item."""
        place = self.written_at(setting, value)
        return ConfigError(f"{place}: {problem}" if place else problem)

    def unnamed_training_files(self) -> str | None:
        """The refusal of a run whose data.train_src or train_tgt is empty, after where that was written
        (`--set data.train_src=` was not named), else None."""
        empty = [f"data.{key}" for key in ("train_src", "train_tgt") if not getattr(self.data, key)]
        if not empty:
            return None
        return f"{self.written_where(*empty)}data.train_src and data.train_tgt must name the training files"

    def given_data_keys(self) -> frozenset[str] | None:
        """The [data] keys a file or --set wrote (fine-tuning adopts the checkpoint's tokenizer settings for
        the others and compares these: vocab_size=8000 written was taken as unset), or None where that is
        not known: a RunConfig built in Python, or one whose `data` was replaced since it was read (the
        keys were another DataConfig's). Then a value equal to its default counts as unset."""
        return self.data_given if self.data_read is self.data else None

    def model_config(self, **tokenizer_fields: Any) -> ModelConfig:
        values = dict(self.model)
        preset = values.pop("preset", "base")
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"model.preset={toml_value(preset)} is not one of {sorted(PRESETS)}")
        try:
            return model_config(preset, **values, **tokenizer_fields)
        except ConfigError as e:  # "dropout=1.5 ..." named as [model] writes it, for `run_config` to place;
            # every setting a problem names ("d_model=36 is not divisible by n_heads=8" blamed d_model alone)
            raise ConfigError(*(MODEL_KEY.sub(r"model.\1", p) for p in e.problems)) from None

    def to_dict(self) -> dict[str, Any]:
        data = to_dict(self.data)
        if self.tokenizer_imported:  # the defaults were saved as the model's: vocab_size 8000 for 51 pieces
            data = {k: v for k, v in data.items() if k not in TOKENIZER_SETTINGS}
        train = to_dict(self.train)
        if train["init_from"]:  # as written, relative, it named nothing from another directory: a --resume
            train["init_from"] = os.path.abspath(train["init_from"])  # from there was refused
        return {"model": dict(self.model), "data": data, "train": train}


def finetune_model_config(config: RunConfig, saved: ModelConfig, where: str | Path) -> ModelConfig:
    """The model of train.init_from's checkpoint `saved`, with [model]'s dropout if it sets one.

    The weights fix everything else, so any other [model] key must equal the checkpoint's value (or be
    absent). A `preset` may name the checkpoint's shape (fine-tuning a `small` run with configs/small.toml):
    each of its keys but dropout, as [model] overrides it (the run's own config: preset micro, d_model 48),
    must then equal the checkpoint's too.
    """
    values = dict(config.model)
    preset = values.pop("preset", None)
    # compared as what they mean: n_decoder_layers=1 restates a 1-layer checkpoint's None
    theirs = resolved_settings(asdict(saved))
    mine = resolved_settings({**asdict(saved), **values})
    for key, value in values.items():
        if key != "dropout" and mine[key] != theirs[key]:
            raise config.refusal(f"model.{key}", value, f"model.{key}={toml_value(value)} differs from "
                                 f"{where}'s {toml_value(theirs[key])}; with train.init_from only "
                                 "model.dropout may be set")
    if preset is not None:  # a known one (`RunConfig._check_finetune_keys`)
        differ = [f"{key}={toml_value(value)} (the checkpoint's: {toml_value(theirs[key])})"  # keys [model]
                  for key, value in PRESETS[preset].items()  # leaves to it
                  if key != "dropout" and key not in values and theirs[key] != value]
        if differ:
            raise config.refusal("model.preset", preset, f"model.preset={toml_value(preset)} has "
                                 f"{', '.join(differ)}; with train.init_from the model is {where}'s: remove "
                                 "the preset or name the checkpoint's")
    if (max_len := config.data.max_len) > saved.max_len:
        raise config.refusal("data.max_len", max_len, f"{config.shown('data.max_len', max_len)} is longer "
                             f"than {where}'s max_len={saved.max_len}; set data.max_len <= {saved.max_len}")
    return replace(saved, dropout=values.get("dropout", saved.dropout))


def vocabulary_model_config(config: RunConfig, **vocabulary: Any) -> ModelConfig:
    """[model] with a vocabulary's `TOKENIZER_FIELDS` (sizes and special ids): one with a target size of
    its own (separate vocabularies) cannot share one matrix, unless [model] says so itself (refused)."""
    shared = vocabulary.get("tgt_vocab_size") is None or "share_embeddings" in config.model
    return config.model_config(**vocabulary, **({} if shared else {"share_embeddings": False}))


def run_config(values: dict[str, Any], where: str = "", written: str = "",
               origins: dict[str, str] | None = None) -> RunConfig:
    """A RunConfig from nested dicts ({"model": ..., "data": ..., "train": ...}); `where` they came from
    names unknown keys, `written` (by default `where`: "FILE with --set" when either may hold it) a value
    out of range or contradicting another. With `origins` ("data.max_len" -> "run.toml:3" or "--set
    'data.max_len=1'"), each such problem is named where the settings it names were written instead."""
    if not isinstance(values, dict):  # None: "'NoneType' object has no attribute 'items'"
        raise TypeError(f"run_config takes a dict of sections ({{'model': {{...}}, 'train': {{...}}}}), not "
                        f"{type(values).__name__}; load_config(path) reads a TOML file")
    if origins is None:  # a caller's dicts; `load_config` checked its file's, and `parse_override` --set's
        try:
            _check_file(values, lambda name: "")
        except ConfigError as e:  # one place for every item, said once ("config: a; config: b")
            raise ConfigError(*e.problems, context=f"{where or 'config'}: ") from None
    model = dict(values.get("model", {}))  # no preset: "base" (RunConfig.model_config), or init_from's shape
    try:
        data, train = _sections(values, where)
        placed = {name: (place, values[section][key])
                  for name, place in (origins or {}).items() for section, key in [name.split(".", 1)]}
        return RunConfig(model, data, train, frozenset(values.get("data", {})), data, origins=placed)
    except ConfigError as e:  # a value out of range or contradicting another: name where it was written
        written = written or where
        if origins is not None:  # "FILE with --set" blamed --set for a file's max_len = 1
            raise ConfigError(*_placed(e.problems, origins, written)) from None
        if not written or f" in {where}" in str(e) or str(e).startswith(f"{written}:"):  # named already
            raise
        raise ConfigError(f"{written}: {e}") from None


def _sections(values: dict[str, Any], where: str) -> tuple[DataConfig, TrainConfig]:
    """[data] and [train], the problems of both in one error: [data]'s alone were said, and [train]'s
    only once those were mended."""
    built, problems = [], []
    for name, cls in (("data", DataConfig), ("train", TrainConfig)):
        try:
            built.append(from_dict(cls, values.get(name, {}), where))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(*problems)
    return built[0], built[1]


SETTING = re.compile(r"\b(?:data|model|train)\.\w+")  # a setting named in a problem: data.max_len


def _in_line_order(places: Iterable[str]) -> list[str]:
    """`places` ("run.toml:10", "--set 'train.seed=2'") once each, a file's by file and line, then the
    --set items as given: in the settings' order they read "ed.toml:10 and ed.toml:16 and ed.toml:9"."""
    def line(place: str) -> tuple[bool, str, int]:
        if place.startswith("--set "):
            return True, "", 0  # sorted() keeps their order
        at = re.fullmatch(r"(.*):(\d+)", place)  # else a file's key not found: named without a line
        return (False, at[1], int(at[2])) if at else (False, place, 0)

    return sorted(dict.fromkeys(places), key=line)


def _placed(problems: tuple[str, ...], origins: dict[str, str], fallback: str) -> list[str]:
    """Each of `problems` after where the settings it names were written (both places for a contradiction
    between a file's line and a --set), or `fallback` where it names none that was (defaults, a preset's);
    those of one place after it once: `--set model.d_model=33`'s two problems each repeated the item."""
    placed: dict[str, list[str]] = {}
    for problem in problems:
        places = _in_line_order(origins[name] for name in SETTING.findall(problem) if name in origins)
        placed.setdefault(" and ".join(places) or fallback, []).append(problem)
    return [f"{place}: {'; '.join(said)}" for place, said in placed.items()]


# A TOML key (bare or quoted) and a dotted path of them: tomllib gives no positions, so these find a key's
# line for an error. They read [section] headers, `key =` lines, dotted keys (data.max_len = 1) and
# one-line inline tables (data = {max_len = 1}); a key not found is named without a line.
_KEY = r"""[A-Za-z0-9_-]+|"[^"\n]*"|'[^'\n]*'"""
_PATH = rf"(?:{_KEY})(?:\s*\.\s*(?:{_KEY}))*"
_TABLE_LINE = re.compile(rf"\s*\[\s*({_PATH})\s*\]")
_ARRAY_LINE = re.compile(rf"\s*\[\[\s*({_PATH})\s*\]\]")
_KEY_LINE = re.compile(rf"\s*({_PATH})\s*=")
_INLINE_KEY = re.compile(rf"[{{,]\s*({_PATH})\s*=")


def key_lines(text: str) -> dict[str, int]:
    """The line (from 1) where each table and key of TOML `text` is first written, by dotted name: "data",
    "data.max_len"."""
    lines: dict[str, int] = {}
    for path, n in _written(text, arrays=True):  # [[train]]'s line too: "train = [...] is not a table"
        for end in range(1, len(path) + 1):  # data.max_len = 1 also writes the table "data"
            lines.setdefault(".".join(path[:end]), n)
    return lines


def _written(text: str, arrays: bool = False) -> Iterator[tuple[list[str], int]]:
    """Each table header and key of TOML `text` as it is written, by its full path (["data", "max_len"])
    and its line (from 1); with `arrays`, the headers of arrays of tables ([[train]]) too."""
    table: list[str] | None = []  # None: in an array of tables ([[x]]), which no section is
    closing = None  # the delimiter of the multi-line string the line is in, whose lines may look like keys
    # "\n" only: splitlines also splits at U+2028, U+2029 and U+0085, which TOML allows in comments and
    # strings
    for n, line in enumerate(text.split("\n"), 1):
        if closing is not None:
            closing = None if closing in line else closing
            continue
        closing = _opens_multiline_string(line)
        if line.lstrip().startswith("[["):
            table = None
            if arrays and (header := _ARRAY_LINE.match(line)):
                yield _names(header[1]), n
        elif header := _TABLE_LINE.match(line):
            table = _names(header[1])
            yield table, n
        elif table is not None and (key := _KEY_LINE.match(line)):
            path = table + _names(key[1])
            yield path, n
            if line[key.end():].lstrip().startswith("{"):  # an inline table: its keys are on this line
                for inner in _INLINE_KEY.finditer(line, key.end()):
                    yield path + _names(inner[1]), n


def _opens_multiline_string(line: str) -> str | None:
    """The delimiter of a multi-line string that starts on `line` and goes on past it: a value or an
    array's item that starts with three quotes. Three quotes elsewhere (in a comment, a one-line string)
    counted as one, and the keys after them were placed in the wrong table, or not at all."""
    key = _KEY_LINE.match(line)
    value = (line[key.end():] if key else line).lstrip().lstrip("[").lstrip()
    for delimiter in ('"""', "'''"):
        if value.startswith(delimiter) and delimiter not in value[3:]:
            return delimiter
    return None


def _names(path: str) -> list[str]:
    return [name.strip("\"'") for name in re.findall(_KEY, path)]


def load_config(path: str | Path | None, overrides: list[str] | None = ()) -> RunConfig:
    """Read a TOML file (or start from defaults) and apply `section.key=value` overrides."""
    values: dict[str, dict[str, Any]] = {}
    where = "command line"
    origins: dict[str, str] = {}  # "data.max_len" -> where it was written: "run.toml:3", "--set '...'"
    if path is not None:
        check_path(path, "load_config's path", "a TOML file's path, or None for the defaults (run_config "
                   "builds a RunConfig from dicts)")
        path = Path(os.fsdecode(path))
        values, lines = _read_toml(path)
        where = str(path)

        def place(name: str) -> str:
            return f"{path}:{lines[name]}" if name in lines else where

        _check_file(values, place)  # before --set changes a value: the file's mistakes named by line
        origins = {f"{s}.{k}": place(f"{s}.{k}") for s, table in values.items() for k in table}
    if isinstance(overrides, str):  # read character by character: "--set 't': expected section.key=value"
        raise TypeError(f"overrides is a list of SECTION.KEY=VALUE strings: pass [{overrides!r}]")
    overrides = str_list(() if overrides is None else overrides, "overrides", "SECTION.KEY=VALUE strings",
                         "'train.max_updates=100'")
    for item in overrides:
        section, key, value = parse_override(item)
        values.setdefault(section, {})[key] = value
        origins[f"{section}.{key}"] = f"--set {item!r}"
    # a value out of range is named where it was written (an unknown key is the file's: --set's are checked)
    written = f"{where} with --set" if overrides and path is not None else where
    return run_config(values, where, written, origins)


def _read_toml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """A config file's tables, and the line of each table and key (`key_lines`)."""
    if str(path) == "-" and not os.path.lexists(path):  # as translate's input: it was "file not found"
        raise UserError("-: a config file is not read from standard input as '-'; name a file (or "
                        "/dev/stdin, to pipe one)")
    require_file(path, "config", pipe=True)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    # here: it imports torch, which demo's MAX_SEED need not
    from aiayn.data.lines import cr_only_error, decode_utf8, lone_cr_count

    # invalid UTF-8 named by line, as a corpus' is, and a UTF-16 file as one (it was "not valid TOML
    # ('utf-8' codec can't decode byte 0xff in position 0)"); a UTF-8 BOM (Windows editors) is skipped
    text = decode_utf8(path, raw).removeprefix("\ufeff")
    try:
        return tomllib.loads(text), key_lines(text)
    except tomllib.TOMLDecodeError as e:
        lfs, lone_crs = raw.count(b"\n"), lone_cr_count(raw)
        if lone_crs > lfs:  # classic Mac line ends: tomllib's "Expected newline ... at column 8" of line 1
            raise cr_only_error(path, lfs, lone_crs) from None
        raise UserError(_toml_error(path, text, str(e)) + _json_hint(path, text)) from None


def _json_hint(path: Path, text: str) -> str:
    """What to do instead with a JSON file given as --config, most likely a checkpoint's meta.json, the
    one place a run records its configuration: it was "not valid TOML (Invalid statement at column 1)"."""
    if not (text.lstrip().startswith("{") or _is_json(text)):  # not the name: a TOML file named x.json
        return ""
    hint = "; --config takes a TOML file, and this is JSON"
    if path.name != "meta.json":
        return hint
    checkpoint, absolute = path.parent, Path(os.path.abspath(path.parent))
    if checkpoint.parent.name != "checkpoints" and absolute.parent.name == "checkpoints":
        checkpoint = absolute  # `--config meta.json` inside the checkpoint: its run named
    run = (f"train.run_dir={checkpoint.parent.parent}" if checkpoint.parent.name == "checkpoints"
           else "train.run_dir its run's directory")
    return (f"{hint} (a checkpoint's meta.json: to continue its run, give the run's TOML file with --resume "
            f"and {run}; to fine-tune from it, train.init_from={checkpoint})")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _toml_error(path: Path, text: str, message: str) -> str:
    """tomllib's `message` named by the file's line: a key or table written twice by its name, else with a
    hint where the value refused looks like a number or a boolean written as another language writes it
    (`lr_scale = .5`: "Invalid value"), or is a bare word that a string setting needs quoted."""
    at = re.search(r" \(at line (\d+), column (\d+)\)$", message)
    if at is None:  # "(at end of document)"
        return _toml_error_at_end(path, text, message)
    n = int(at[1])
    written = next((name for name, m in _written(text) if m == n), None)  # the line's table or key
    twice = message.startswith(("Cannot overwrite a value", "Cannot declare")) and written
    if twice and (again := _written_twice(text, n, written)):  # tomllib names neither key nor first line
        return f"{path}:{n}: {again}"
    hint = _file_value_hint(text.split("\n")[n - 1], written)
    return (f"{path}:{n}: not valid TOML ({message[:at.start()]} at column {at[2]})"
            + (f"; {hint}" if hint else ""))


def _toml_error_at_end(path: Path, text: str, message: str) -> str:
    """tomllib's `message` "... (at end of document)" named by the file's last line, and by the line that
    opened an array, an inline table or a multi-line string never closed: `keep_last = [1,` and a newline
    was "not valid TOML (Invalid value (at end of document))", with no line at all."""
    lines = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]  # CRLF too: a prefix
    # ending in a bare CR is no TOML, and every line then looked like the one left open
    problem = message.removesuffix(" (at end of document)")
    said = f"{path}:{len(lines)}: not valid TOML ({problem} at the end of the file)"
    # The unfinished statement starts at the last line before which the file is valid TOML (the check is
    # tomllib's own, not a second parser's; a config file is short)
    start = next(n for n in range(len(lines), 0, -1) if _valid_toml("\n".join(lines[:n - 1])))
    key = _KEY_LINE.match(lines[start - 1])
    value = lines[start - 1][key.end():].lstrip() if key else ""
    openers = {'"""': "multi-line string", "'''": "multi-line string", "[": "array", "{": "inline table"}
    kind = next((kind for opener, kind in openers.items() if value.startswith(opener)), None)
    return f"{said}; the {kind} that line {start} opens is never closed" if kind else said


def _valid_toml(text: str) -> bool:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _written_twice(text: str, n: int, written: list[str]) -> str | None:
    """The table or key that line `n`, which writes `written`, writes again, and where it was first
    written: the longest part of its path that an earlier line wrote (`warmup.x = 1` after `warmup = 1`)."""
    first = key_lines(text)
    lines = text.split("\n")
    for end in range(len(written), 0, -1):
        if (before := first[".".join(written[:end])]) < n:
            again = written[:end]
            name = f"[{again[0]}] {'.'.join(again[1:])}" if len(again) > 1 else again[0]
            # a value there (`warmup = 1`), not a table: "[train.warmup] is declared twice" named no table
            value = not _TABLE_LINE.match(lines[before - 1]) and [again, before] in map(list, _written(text))
            if _TABLE_LINE.match(lines[n - 1]):
                if value:
                    return f"[{'.'.join(again)}]: {name} is a value already (line {before}), not a table"
                return f"[{'.'.join(again)}] is declared twice (first at line {before})"
            return f"{name} is set twice (first at line {before})"
    return None


def _file_value_hint(line: str, written: list[str] | None) -> str | None:
    """`_value_hint` for the value a config file's `line` writes to the setting `written` (["train",
    "precision"]), and for a bare word where a string may go (an unknown setting's too), its quotes: --set
    takes `train.precision=bf16` as it is, a file refused `precision = bf16` with no hint."""
    key = _KEY_LINE.match(line)
    if key is None:
        return None
    value = line[key.end():].partition("#")[0].strip()
    known = written is not None and len(written) == 2 and written[0] in SECTIONS
    expected = _key_types(written[0]).get(written[1]) if known else None
    if hint := _value_hint(value, expected):
        return hint
    if expected in (None, str) and re.fullmatch(r"[^\s\"'\[\]{},=#]+", value):
        quote = "'" if "\\" in value else '"'  # a Windows path: backslashes are escapes in "..."
        return f"TOML strings need quotes: {line[:key.end()].strip()} {quote}{value}{quote}"
    return None


def _check_file(values: dict[str, Any], place: Callable[[str], str]) -> None:
    """Refuse a config file's unknown sections and keys, a section that is no table and values of the wrong
    type, each named by `place` ("run.toml:6") as the file writes it: [data], not DataConfig."""
    problems = []
    for section, table in values.items():
        # a table, or an array of them ([[foo]]), not a value: `preset = "big"` above [model]
        tables = isinstance(table, dict) or (isinstance(table, list) and bool(table)
                                             and all(isinstance(t, dict) for t in table))
        if section not in SECTIONS and not tables:
            problems.append(_outside_sections(place(section), section))
            continue
        if section not in SECTIONS:
            problems.append(f"{_at(place(section))}unknown section [{section}] (known: {', '.join(SECTIONS)})")
            continue
        if not isinstance(table, dict):
            problems.append(_not_a_table(place(section), section, table))
            continue
        known = _key_types(section)
        if unknown := [key for key in table if key not in known]:
            problems.append(_unknown_keys(section, unknown, place))
        for key, value in table.items():
            written = f"{_at(place(f'{section}.{key}'))}[{section}] {key} = "
            if key in known and (problem := _type_problem(section, key, value, written)):
                hint = _quotes_hint(section, key, value, known[key])
                problems.append(problem + (f"; {hint}" if hint else ""))
    if problems:
        raise ConfigError(*problems)


def _at(where: str) -> str:
    """How an item of an error begins: "run.toml:6: ", nothing where the error names its one place once."""
    return f"{where}: " if where else ""


def _unknown_keys(section: str, keys: list[str], place: Callable[[str], str]) -> str:
    """Unknown keys of a file's [section], each named with its line and, where another section has such a
    setting, that section (`[train] max_len` said nothing of [data]'s); the known keys listed for the
    rest."""
    said = []
    for key in keys:
        homes = _homes(key, section)
        said.append(f"{_at(place(f'{section}.{key}'))}unknown [{section}] key {key}"
                    + (f" (put it under {' or '.join(homes)})" if homes else ""))
    homeless = any(not _homes(key, section) for key in keys)
    return "; ".join(said) + (f" (known: {', '.join(_settable(section))})" if homeless else "")


def _homes(key: str, other_than: str = "") -> list[str]:
    """The sections other than `other_than` that have a setting named `key`, as a file writes them."""
    return [f"[{section}]" for section in SECTIONS if section != other_than and key in _settable(section)]


def _quotes_hint(section: str, key: str, value: Any, expected: Any) -> str | None:
    """The quotes a file's number, date or boolean needs where a string setting goes (--set takes
    `run_dir=2024-05-01` as a name, `parse_override`, a file a date, which was refused with no hint), or
    the names such a setting takes (`preset = 5` was told to write "5", no preset either); the quotes a
    number or boolean written as a string has to lose (`warmup = "4000"` was told nothing)."""
    if expected is str and isinstance(value, (int, datetime.date, datetime.time)):  # bool: an int
        if choices := CHOICES.get(f"{section}.{key}"):
            return f"{key} is one of {', '.join(toml_value(c) for c in choices)}"
        return f'TOML strings need quotes: {key} = "{toml_value(value)}"'
    if (unquoted := _unquoted(value, expected)) is not None:
        return f"TOML {_kind_in_toml(expected)} take no quotes: {key} = {unquoted}"
    return None


def _unquoted(value: Any, expected: Any) -> str | None:
    """`value`, a string, as the TOML value of the type `expected` that it reads as without its quotes
    ("4000" for an int), else None."""
    if not isinstance(value, str) or matches_type(value, expected):
        return None
    try:
        read = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return None
    fits = list(read) == ["v"] and not isinstance(read["v"], str) and matches_type(read["v"], expected)
    return value.strip() if fits else None


def _kind_in_toml(expected: Any) -> str:
    return "booleans" if expected is bool else "numbers"


def _outside_sections(where: str, key: str) -> str:
    """A key written before any [section] header: TOML makes it a top-level value, which was refused as an
    "unknown section [preset]". Where it is a setting's name, the section that holds it."""
    homes = _homes(key)
    fix = (f"put it under {' or '.join(homes)}" if homes
           else f"no section has such a key (sections: {', '.join(SECTIONS)})")
    return f"{_at(where)}{key} is outside any section; {fix}"


def _not_a_table(where: str, section: str, value: Any) -> str:
    return f"{_at(where)}{section} = {toml_value(value)} is not a table; write a [{section}] section"


def _key_types(section: str) -> dict[str, Any]:
    """A section's keys and their types ([model]: ModelConfig's fields and `preset`)."""
    cls = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}[section]
    types = typing.get_type_hints(cls)
    return {"preset": str, **types} if section == "model" else types


def _settable(section: str) -> list[str]:
    """The keys an unknown one's error lists: [model]'s tokenizer fields are known, but refused with their
    own reason, so listing them offered settings that are then refused."""
    return sorted(k for k in _key_types(section) if section != "model" or k not in TOKENIZER_FIELDS)


def _check_override_key(item: str, section: str, key: str) -> None:
    """An unknown `--set` key is named as the command line's, not blamed on the TOML file."""
    if section not in SECTIONS:
        raise ConfigError(f"--set {item!r}: unknown section {section!r}; known: {', '.join(SECTIONS)}")
    if key not in _key_types(section):
        if homes := _homes(key, section):  # as a file's [train] max_len: a setting of another section
            meant = " or ".join(f"{home.strip('[]')}.{key}" for home in homes)
            raise ConfigError(f"--set {item!r}: unknown {section} key {key!r}; did you mean {meant}?")
        raise ConfigError(f"--set {item!r}: unknown {section} key {key!r}; known: "
                          f"{', '.join(_settable(section))}")


def parse_override(item: str) -> tuple[str, str, Any]:
    """`train.max_tokens=2048` -> ("train", "max_tokens", 2048). Values are TOML; bare words are strings,
    and so is a number, boolean or date where a string goes (run_dir=2024-05-01 is a name); an array or
    table there is refused, as a file's is; a comment after a value (` # ...`, after a space) is dropped."""
    name, eq, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not eq or not dot or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.max_tokens=2048")
    key = key.strip()
    _check_override_key(item, section, key)
    expected = _key_types(section)[key]
    if "\n" in text.strip() or "\r" in text.strip():  # "2048\ntrain.seed=3": TOML read the second line as
        # another key and dropped it; a bare word kept it, and named a run_dir across two lines
        raise ConfigError(f"--set {item!r}: one value per --set (the value holds a line break)")
    # as TOML drops a comment after a value (warmup=20 # c: 20), so after a bare word: run_dir=runs/x # c
    # trained into 'runs/x # c'. A '#' within a word (runs/exp#3) is the name's.
    bare = re.sub(r"\s+#.*", "", text.strip())
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = bare  # a path or other bare word
    # run_dir=2024-05-01 or =123 is a name, not a TOML date or number; an array or table stays one, refused
    # as a file's: run_dir=["a"] trained into a directory named ["a"], train_src=["x","y"] was not found
    if expected is str and not isinstance(value, (str, list, dict)):
        value = bare
    if problem := _type_problem(section, key, value, f"--set {item!r}: "):
        hint = _value_hint(bare, expected)
        # run_dir=[1] meant as a name, maybe (not d_model=[512]: a string is no number either)
        if expected is str and isinstance(value, (list, dict)) and "'" not in bare:
            hint = f"a name is a TOML string: {section}.{key}='{bare}'"
        elif (unquoted := _unquoted(value, expected)) is not None:  # train.warmup='"4000"'
            hint = f"TOML {_kind_in_toml(expected)} take no quotes: {section}.{key}={unquoted}"
        raise ConfigError(problem + (f" ({hint})" if hint else ""))
    return section, key, value


# A number with a point but no digit on one side of it (.5, 5., -.5e3): Python reads it, TOML does not
_POINTED = re.compile(r"([+-]?)(\d[\d_]*)?\.(\d[\d_]*)?([eE][+-]?\d+)?")


def _value_hint(text: str, expected: Any = None) -> str | None:
    """What TOML wants instead of `text`, a value it refused, where that looks like a number or a boolean
    as Python or YAML writes them; with the type `expected`, only a hint whose value would be one."""
    text = text.strip()
    if (number := _POINTED.fullmatch(text)) and (number[2] is None) != (number[3] is None):
        sign, whole, fraction, exponent = number.groups()
        fixed = f"{sign}{whole or 0}.{fraction or 0}{exponent or ''}"
        if expected is None or matches_type(tomllib.loads(f"v = {fixed}")["v"], expected):
            return f"TOML numbers need a digit on each side of the point: {fixed}"
    written_otherwise = text.lower() in ("true", "false") and text not in ("true", "false")  # True, FALSE
    if (expected is None and written_otherwise) or expected is bool:  # or yes, on, 1 for a bool setting
        return "TOML booleans are true and false"
    return None


def _type_problem(section: str, key: str, value: Any, where: str) -> str | None:
    """What is wrong with a value of the wrong type for a known key, after `where` it was written (a file's
    line and key, or the --set item). Unknown keys and sections are refused elsewhere, with the known ones."""
    hint = _key_types(section).get(key) if section in SECTIONS else None
    if hint is None or matches_type(value, hint):
        return None
    if isinstance(value, os.PathLike) and key in PATHS.get(section, ()):  # kept as its str, `check_types`
        return None
    expected = getattr(hint, "__name__", str(hint))
    kind = type(value).__name__
    return f"{where}{toml_value(value)} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, expected {expected}"


def toml_value(value: Any) -> str:
    """`value` as TOML writes it where Python's repr differs: `datetime.date(2024, 1, 1)` and `True` read
    as Python in an error about a TOML file's `2024-01-01` and `true`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, str):  # repr's 'C:\\x' is two backslashes in TOML's '...', and 'a\'b' none of TOML's
        if "'" not in value and not any(c < " " or c == "\x7f" for c in value):
            return f"'{value}'"  # a literal string: as written, backslashes and all
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")  # TOML's basic string
    if isinstance(value, list):
        return f"[{', '.join(map(toml_value, value))}]"
    return repr(value)  # numbers: TOML's too


def with_train(config: RunConfig, **changes: Any) -> RunConfig:
    """A copy with some TrainConfig fields changed (tests)."""
    return replace(config, train=replace(config.train, **changes))
