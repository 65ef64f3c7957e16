"""Checkpoints: a directory per checkpoint, self-contained, written atomically, loaded without pickle.

    step_000100/
      model.safetensors   the weights (a shared embedding stored once, under its source name)
      meta.json           {"format": "aiayn-1", "model": ModelConfig, "tokenizer": ..., "step": ..., ...}
      spm.model           the tokenizer (or source.spm and target.spm)
      trainer.safetensors optional: optimizer, schedule and random-generator state as tensors (training)
      trainer.json        optional: the non-tensor part of that state

A checkpoint is written into a temporary sibling directory, flushed, then renamed into place: a
kill at any moment leaves either the old set of checkpoints or the new one, never a broken one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from aiayn.config import ConfigError, ModelConfig, from_dict, to_dict
from aiayn.data.tokenizer import SHARED, SOURCE, TARGET, Tokenizer
from aiayn.errors import CorruptFile, UserError, check_path, is_out_of_memory
from aiayn.files import OutputKind, already_exists, check_replaceable, moved_aside, write_atomically
from aiayn.model import Transformer

FORMAT = "aiayn-1"
WEIGHTS, META = "model.safetensors", "meta.json"
# The meta.json entries save_checkpoint writes from what it saves; a caller's `meta` never sets them
WRITTEN = ("format", "model", "tokenizer")


@dataclass
class Checkpoint:
    model: Transformer
    tokenizer: Tokenizer
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def __repr__(self) -> str:  # the dataclass's printed the model's module tree: 53 lines
        step = f", step={self.meta['step']}" if "step" in self.meta else ""
        where = "path=None" if self.path is None else repr(str(self.path))  # not 'None', a path so named
        return f"Checkpoint({where}{step}, parameters={self.model.num_parameters():,})"


def state_dict_for_saving(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights without tied duplicates and without compile/DDP prefixes, on the CPU."""
    return {name: tensor.contiguous().cpu() for name, tensor in _untied_state(model).items()}


def _untied_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict, where it lies, without tied duplicates and without wrapper prefixes."""
    model = unwrap(model)
    seen: set[int] = set()  # the tensors themselves (keep_vars: a tied Parameter is one object)
    addresses: set[int] = set()  # and their memory: on the meta device every tensor's address is 0
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        address = set() if tensor.is_meta else {tensor.data_ptr()}
        if id(tensor) in seen or address & addresses:
            continue  # a tied weight (the shared embedding) is stored once
        seen.add(id(tensor))
        addresses |= address
        out[name] = tensor.detach()
    return out


def weights_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`dtype`, a floating-point torch dtype or its name ("bfloat16", as `Translator.load` takes it): a
    name went on to `Module.to` as a device ("Invalid device string: 'bfloat16'")."""
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be a torch dtype or its name, not {type(dtype).__name__} ({dtype!r})")
    parsed = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if parsed not in WEIGHT_DTYPES:  # float8's kernels are missing: it loaded, then failed to translate
        raise ValueError(f"dtype {dtype!r} is not one a model computes in: float32, float64, bfloat16 or "
                         "float16, as a torch dtype or by name")
    return parsed


WEIGHT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def inference_device(device: str | torch.device, int8: bool = False) -> torch.device:
    """`device` parsed, for a model to run on (`load_checkpoint`, `Translator.load`): the CPU or a CUDA
    device this machine has (the CPU only with `int8`); anything else is a UserError."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a device name: cpu, cuda, cuda:1, ...") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":  # meta, mps...: untested here, and meta has no weights to compute with
        raise UserError(f"device {device!r}: aiayn runs models on cpu or cuda only")
    if int8:  # before the CUDA checks: the answer is the same on a machine with or without a GPU
        raise UserError(f"int8 (--int8) is a CPU path (torch.ao's dynamic quantization has no CUDA kernels): "
                        f"drop it on device {str(device)!r}, or use device cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = "" if torch.backends.cuda.is_built() else " (this PyTorch is built without CUDA)"
        raise UserError(f"device {device!r}: no CUDA device is available{build}")
    if (parsed.index or 0) >= count:
        raise UserError(f"device {device!r}: this machine has {count} CUDA device(s), "
                        f"cuda:0 to cuda:{count - 1}")
    return parsed


def model_from_weights(config: ModelConfig, weights: dict[str, torch.Tensor], where: str | Path,
                       device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32
                       ) -> Transformer:
    """A `Transformer` of `config` on `device` in `dtype` (`weights_dtype`) holding `weights` (checked by
    `load_into`'s rules).

    Built on the meta device and checked against the weights there, then given memory: a damaged d_ff
    in a meta.json asked for a terabyte first (a RuntimeError traceback), not a line naming the file.
    No random initialization either, which the weights would overwrite (0.5 s for `base` on one CPU
    thread, 2 s for `big`). `Transformer.to_empty` computes the position tables and ties the output
    projection again. Another `dtype` is given memory as such: a float32 model cast afterwards held both
    copies at once."""
    dtype = weights_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    check_fits(model, weights, where)
    try:
        model = model.to_empty(device=device)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        raise UserError(f"{where}: out of memory for its {model.num_parameters():,}-parameter model") from None
    model.load_state_dict(weights, strict=False)  # tied copies are absent by design
    return model

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DistributedDataParallel (`module.`) and torch.compile (`_orig_mod.`) wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def save_checkpoint(
    directory: str | Path, model: torch.nn.Module, tokenizer: Tokenizer, meta: dict[str, Any] | None = None,
    trainer_tensors: dict[str, torch.Tensor] | None = None, trainer_meta: dict[str, Any] | None = None,
    *, check_weights: bool = True, owned: bool = False, replace_training_state: bool = False,
    exist_ok: bool = True,
) -> Path:
    """Write a self-contained checkpoint directory atomically; return its path. An existing `directory`
    is replaced only if it is empty or a checkpoint with nothing else in it (no training state: resaving a
    run's step_N dropped what --resume needs); none is written inside another checkpoint.

    Nothing is written that `load_checkpoint` would refuse and blame on the file ("not the tokenizer
    this model was trained with", "the file is damaged"): a tokenizer that does not fit the model, or a
    NaN or infinite weight, is a UserError first. `check_weights=False` skips the scan for the latter
    where the caller has just made it (training, on the device, before every save). `owned`: `directory`
    is the caller's own, replaced whatever it holds (training's step_N, which its checkpoints/ owns).
    `replace_training_state`: a training checkpoint may be replaced (`average` and `convert` with --force,
    which replaces one whole); else one is refused. `exist_ok=False`: an existing `directory` is refused,
    before the work and at the rename (`average` and `convert` without --force: their early check was
    the only one, and an output that came meanwhile, another average's, was replaced).

    `meta` adds entries to meta.json, less those in `WRITTEN`, which describe what is saved: they are
    dropped rather than refused, as `meta=checkpoint.meta` is the natural way to keep a loaded
    checkpoint's provenance, and its "model" then replaced the model being saved (its weights were
    saved under the old configuration: another dropout, max_len, ...)."""
    model = unwrap(model)
    directory = Path(directory)
    check_savable(model, directory)
    if not isinstance(tokenizer, Tokenizer):  # None failed later: "'NoneType' object has no attribute ..."
        raise TypeError(f"save_checkpoint saves the model's Tokenizer with it, not {type(tokenizer).__name__}"
                        ": load_checkpoint(path).tokenizer, or Tokenizer(spm_model_path)")
    if not owned:  # an earlier checkpoint, or none
        if (inside := enclosing_checkpoint(directory, itself=False)) is not None:  # then unsavable over
            raise UserError(f"{directory}: lies inside the checkpoint {inside[1]}; save it elsewhere")
        if not exist_ok and os.path.lexists(directory):
            if directory.is_dir() and not CHECKPOINT_KIND.test(directory):  # exist_ok would not replace
                check_replaceable(directory, CHECKPOINT_KIND)  # it either: said first (empty: passes)
            raise already_exists(directory)
        trainer = not replace_training_state and any((directory / name).exists() for name in TRAINER_FILES)
        if trainer:  # resaving a loaded step_N in place
            raise UserError(f"{directory}: a training checkpoint, whose state ({', '.join(TRAINER_FILES)}) "
                            "resuming needs; saving over it would delete that, so save elsewhere")
        check_replaceable(directory, CHECKPOINT_KIND)
    problem = vocabulary_problem(model.config, tokenizer)
    if problem:
        raise UserError(f"{directory}: not saved: {problem}")
    weights = state_dict_for_saving(model)
    broken = nonfinite(weights) if check_weights else []  # on the CPU copies: one pass, no device sync
    if broken:
        raise UserError(f"{directory}: not saved: {len(broken)} tensor(s) of the model hold NaN or infinite "
                        f"values ({', '.join(broken[:3])})")
    extra = {k: v for k, v in (meta or {}).items() if k not in WRITTEN}

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / WEIGHTS))
        full = {"format": FORMAT, "model": to_dict(model.config), "tokenizer": tokenizer.save(tmp), **extra}
        try:
            text = json.dumps(full, indent=2, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\udcff" in a meta.json an average copies) has no
            text = json.dumps(full, indent=2).encode("ascii")  # UTF-8 (a traceback); JSON's escape keeps it
        (tmp / META).write_bytes(text + b"\n")
        if trainer_tensors is not None:
            save_file({k: v.contiguous().cpu() for k, v in trainer_tensors.items()}, str(tmp / "trainer.safetensors"))
            (tmp / "trainer.json").write_text(json.dumps(trainer_meta or {}, indent=2) + "\n")

    write_atomically(directory, write, exist_ok=exist_ok)
    return directory


def check_savable(model: torch.nn.Module, directory: Path) -> None:
    """`model` holds the tensors of a `Transformer` of its config, by name: a model the `Translator` packed
    for the CPU (`aiayn.decoding.cpu.PackedLinear`, its weights outside the state_dict) was saved without
    its Linear weights and refused only on loading ("weights do not fit this model: missing ..."), and an
    int8 one, whose state_dict holds packed parameters, failed with an AttributeError."""
    if not isinstance(model, Transformer):
        raise TypeError(f"save_checkpoint saves a Transformer, not a {type(model).__name__}")
    with torch.device("meta"):  # names only
        expected = set(Transformer(model.config).state_dict())
    state = model.state_dict()
    missing = sorted(expected - set(state))
    odd = sorted(k for k, v in state.items() if k not in expected or not isinstance(v, torch.Tensor))
    if missing or odd:
        found = "; ".join(part for part in (f"missing {missing[:2]}" if missing else "",
                                            f"unexpected {odd[:2]}" if odd else "") if part)
        raise UserError(f"{directory}: not saved: the model does not hold a Transformer's weights ({found}); "
                        "a model packed for the CPU or quantized to int8 for decoding (Translator.load) "
                        "keeps them in another form: save the model load_checkpoint gives")


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint directory: its weights and meta.json. A name the system cannot look
    up (too long) is none: the error was said of PATH/meta.json, a file the user never named."""
    try:
        return (path / META).is_file() and (path / WEIGHTS).is_file()
    except OSError:
        return False


# What `--force` may replace (convert, average): a checkpoint directory with no file of anyone else's.
TRAINER_FILES = ("trainer.json", "trainer.safetensors")  # a training checkpoint's state, for --resume
CHECKPOINT_KIND = OutputKind("an aiayn checkpoint", is_checkpoint, frozenset(
    {WEIGHTS, META, *TRAINER_FILES, SHARED, SOURCE, TARGET}))


def enclosing_checkpoint(path: str | Path, itself: bool = True) -> tuple[str, Path] | None:
    """("is" or "lies inside", the checkpoint directory) where `path` is (when `itself`) or lies inside a
    checkpoint (weights and meta.json), else None, as `train.state.training_owned` says it of a run's
    checkpoints/. `..` is taken out first, as the kernel would: a/ck/../x is a/x."""
    target = Path(os.path.abspath(path))
    for place in (target, *target.parents) if itself else target.parents:
        if is_checkpoint(place):
            return ("is" if place == target else "lies inside"), place
    return None


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META
    if not path.is_file():
        if not Path(directory).exists() or moved_aside(Path(directory)) is not None:  # not "no meta.json"
            raise UserError(f"{directory}: {not_found(Path(directory))}")
        # here only: the training package imports this one
        from aiayn.train.state import checkpoint_dirs, run_of_checkpoints_folder, runs_meant

        here = Path(directory)
        found = checkpoint_dirs(directory)  # a run directory: its checkpoints are inside
        what = "a run directory"
        for run in runs_meant(here) if not found else ():  # a demo's --out (its run/), a run's checkpoints/
            if found := checkpoint_dirs(run):
                mine = run == run_of_checkpoints_folder(here)
                what = "a run's checkpoints folder" if mine else f"its run is {run}"
                break
        hint = f"; {what}: name one of its checkpoints, e.g. {found[-1]}" if found else _other_model(here)
        raise UserError(f"{directory}: not an aiayn checkpoint (no {META}){hint}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON's and UTF-8's errors, a 4,300-digit number (int()'s
        # ValueError: a traceback), [[[...]]] past the stack
        raise CorruptFile(f"{path}: corrupt checkpoint metadata ({e})") from None
    except OSError as e:  # permissions, an I/O error: a PermissionError traceback
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        if _newer_format(found):  # "not an aiayn-1 checkpoint" left the user to guess the cure
            raise UserError(f"{path}: written by a newer aiayn (format {found!r}; this one reads {FORMAT}); "
                            "upgrade aiayn to read it")
        raise UserError(f"{path}: not an {FORMAT} checkpoint (format={found!r})")
    return meta


def _newer_format(found: Any) -> bool:
    """Whether meta.json's "format" is aiayn-N with N past this aiayn's `FORMAT`."""
    numbered = re.fullmatch(r"aiayn-([0-9]{1,9})", found) if isinstance(found, str) else None
    return numbered is not None and int(numbered[1]) > int(FORMAT.removeprefix("aiayn-"))


def _other_model(directory: Path) -> str:
    """What a directory without meta.json holds where it is another kind of model, as advice ("; ..."),
    else "": a CTranslate2 export was only "not an aiayn checkpoint (no meta.json)"."""
    if not (directory / "config.json").is_file():
        return ""
    if (directory / "model.bin").is_file():  # first: an export may keep the spm models beside it
        return ("; a CTranslate2 model (what export writes): load it with ctranslate2.Translator, or name "
                "the aiayn checkpoint it was exported from")
    if any((directory / name).is_file() for name in ("source.spm", "vocab.json")):
        return "; a MarianMT (OPUS-MT) directory: import it with aiayn convert --from marian"
    return ""


def config_section(meta: dict[str, Any], section: str) -> dict[str, Any] | None:
    """A section ("data", "train") of the run configuration a training checkpoint's meta.json records;
    None where there is none (a converted or hand-made checkpoint)."""
    config = meta.get("config")
    part = config.get(section) if isinstance(config, dict) else None
    return part if isinstance(part, dict) else None


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    path = weights_path(directory)
    try:
        return load_file(str(path))  # safetensors: plain tensors, never unpickles code
    except (SafetensorError, OSError, ValueError) as e:
        raise _weights_error(path, e) from None


def _weights_error(path: Path, e: Exception) -> UserError:
    """safetensors' failure to read `path`: a file it could not read or map (safetensors reports the OS's
    error as "No such device (os error 19)") is not called corrupt, as meta.json's or spm.model's is not,
    nor a CorruptFile, for which --resume advises an earlier checkpoint (on the same mount)."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    os_error = re.fullmatch(r"(.*) \(os error \d+\)", text)
    if isinstance(e, OSError) or os_error:
        return UserError(f"{path}: cannot read ({os_error.group(1) if os_error else text})")
    if cut_short(e):  # first: a safetensors file cut to its first bytes may start as a pickle does
        return CorruptFile(f"{path}: damaged or cut short ({e})")
    return _pickle_error(path) or CorruptFile(f"{path}: corrupt weights ({e})")


# safetensors' words for a file whose size is not what its header gives (shorter than 8 bytes, shorter than
# the header, or than the tensors it lists): most often a copy or a download cut short. 0.6 and later say
# them in words; 0.4 and 0.5 by the names of their error variants
_CUT_SHORT = (
    "incomplete metadata, file not fully covered", "invalid header length", "header too small",
    "MetadataIncompleteBuffer", "InvalidHeaderLength", "HeaderTooSmall",
)


def cut_short(e: Exception) -> bool:
    """Whether safetensors' error `e` says its file is cut short (or has bytes added), where "corrupt
    weights (... incomplete metadata, file not fully covered)" did not say so."""
    return isinstance(e, SafetensorError) and any(words in str(e) for words in _CUT_SHORT)


def _pickle_error(path: Path) -> UserError | None:
    """A UserError saying `path` is a PyTorch pickle (`pytorch_file`: a pytorch_model.bin renamed, say), or
    another zip archive, which safetensors' refusal ("header too large") called corrupt weights; None where
    it is neither. Only named: unpickling can run any code."""
    head = file_head(path)
    if (kind := pytorch_file(head)) is not None:
        # save_file(model.state_dict()) refuses a tied model's shared memory, and save_model names the tied
        # tensor as it chooses: state_dict_for_saving stores it once under the name loading reads
        return UserError(f"{path}: a PyTorch pickle ({kind}), not safetensors; aiayn never reads pickles "
                         "(loading one can run any code): save the model with aiayn.checkpoint."
                         "save_checkpoint(directory, model, tokenizer), or its weights with safetensors."
                         "torch.save_file(aiayn.checkpoint.state_dict_for_saving(model), path)")
    if head is not None and head.startswith(ZIP):
        return UserError(f"{path}: a zip archive, not safetensors")
    return None


def file_head(path: Path) -> bytes | None:
    """The first bytes of `path`, to tell what it is (a zip archive's first entry's name too, which torch
    makes of its file's name); None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(1024)
    except OSError:
        return None


def is_safetensors(head: bytes | None) -> bool:
    """Whether `head` starts a safetensors file: its JSON header's length (8 bytes, little-endian, at most
    safetensors' 100 MB), then the header, whose first byte the unpickler took for an opcode."""
    return head is not None and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= 100_000_000


ZIP = b"PK\x03\x04"  # a zip archive's first local file header
# torch.save's legacy format (_use_new_zipfile_serialization=False) starts with its magic number
# 0x1950a86a20f9469cfc6c, pickled with protocol 2: a byte 0x80 alone (any pickle's, or a safetensors
# header's length) called damaged weights "a raw pickle"
TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def pytorch_file(head: bytes | None) -> str | None:
    """What a file torch.save wrote that starts `head` is: its zip archive (the default; its first entry
    is ARCHIVE/data.pkl) or its legacy raw pickle; None for anything else, another zip archive too."""
    if head is None or is_safetensors(head):
        return None
    if head.startswith(ZIP):
        name = head[30:30 + int.from_bytes(head[26:28], "little")]  # the first entry's, after 30 bytes
        return "torch.save's zip archive" if name.endswith(b"/data.pkl") else None
    return "a raw pickle, torch.save's legacy format" if head.startswith(TORCH_LEGACY_MAGIC) else None


def weights_path(directory: str | Path) -> Path:
    """The checkpoint's weights file, checked to be one safetensors can open: a missing one, a directory
    or a dangling link in its place, or a path that is not valid UTF-8 (read as "corrupt weights") is
    one line."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        what = "is not a file" if path.exists() else "is missing"
        what = "is a link that leads to no file" if path.is_symlink() and not path.exists() else what  # or loops
        raise UserError(f"{directory}: checkpoint has no {WEIGHTS} ({path} {what})")
    check_utf8_path(path)
    return path


def check_utf8_path(path: Path, reader: str = "safetensors") -> None:
    """A path that is not valid UTF-8 is a UserError: `reader` opens none (safetensors: "corrupt weights";
    ctranslate2.Translator takes a str it hands to C++ as UTF-8, a TypeError of one with surrogates)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{path}: a path that is not valid UTF-8, which {reader} cannot open; "
                        "rename it") from None


def _castable(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether load_state_dict's cast keeps the values: any float into a float (a float16 or bfloat16
    checkpoint loads as float32), otherwise only the same dtype. Integers copied into float weights
    would load "fine" and translate garbage."""
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


def load_into(model: Transformer, weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Copy `weights` into `model`, naming any missing, unexpected, mis-shaped or mis-typed tensor.
    Every weight `model` saves must be there, so `model` is wholly overwritten."""
    check_fits(model, weights, where)
    model.load_state_dict(weights, strict=False)  # tied copies are absent by design


def check_fits(model: Transformer, weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """`load_into`'s checks, which a model on the meta device can take before it is given memory."""
    problem = fit_problem(model, weights)
    if problem:
        raise UserError(f"{where}: weights do not fit this model: {problem}")
    check_finite(weights, where)


def fit_problem(model: Transformer, weights: dict[str, torch.Tensor]) -> str | None:
    """How `weights` do not fit `model` (tensors missing, unexpected, of another shape, or of a dtype
    loading cannot cast), or None where they fit."""
    expected = _untied_state(model)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in weights and weights[k].shape != v.shape]
    dtypes = [f"{k} {weights[k].dtype} vs {v.dtype}" for k, v in expected.items()
              if k in weights and not _castable(weights[k].dtype, v.dtype)]
    parts = [f"missing {missing[:3]}" if missing else "",
             f"unexpected {unexpected[:3]}" if unexpected else "",
             f"wrong shape {shapes[:3]}" if shapes else "", f"wrong dtype {dtypes[:3]}" if dtypes else ""]
    return "; ".join(p for p in parts if p) or None


def check_meta_describes_weights(directory: Path, config: ModelConfig) -> None:
    """`directory`'s weights (their header: names, shapes, dtypes) are those of `config`, the model its
    meta.json records, else a CorruptFile naming meta.json: a meta.json copied from a checkpoint of another
    model was blamed on the run's [model] by --resume, which keeps the model's settings."""
    with torch.device("meta"):  # shapes only
        model = Transformer(config)
    problem = fit_problem(model, stored_tensors(directory))
    if problem:
        raise CorruptFile(f"{directory / META}: not the model its {WEIGHTS} holds ({problem}); damaged, or "
                          "copied from another checkpoint")


def check_meta_vocabulary(directory: Path, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Where meta.json's vocabulary sizes (`config`) are not the tokenizer's but the weights' are (the
    model it records, sized as the tokenizer, fits them), meta.json is the odd one out of the three, and
    named so (`check_meta_describes_weights`): an edited vocab_size was blamed on the weights ("do not fit
    this model") by translate and average, on spm.model by info, and on the run's settings by --resume.
    Where the weights side with meta.json, or with neither, the checks that follow name what they find."""
    if _size_mismatch(config, tokenizer) is None:
        return
    src, tgt = tokenizer.src_vocab_size, tokenizer.tgt_vocab_size
    try:  # its sharing as recorded: a tokenizer of two sizes makes a shared model none (ConfigError)
        sized = replace(config, vocab_size=src, tgt_vocab_size=None if config.tgt_vocab_size is None and (
            tgt == src) else tgt)
    except ValueError:
        return
    with torch.device("meta"):  # shapes only
        model = Transformer(sized)
    if fit_problem(model, stored_tensors(directory)) is None:
        check_meta_describes_weights(directory, config)


def check_finite(weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Nothing saves NaN or infinite weights (`save_checkpoint`; training stops first, in
    loop._check_finite_weights): such a file was damaged."""
    broken = nonfinite(weights)
    if broken:
        raise CorruptFile(f"{where}: {len(broken)} tensor(s) hold NaN or infinite values ({', '.join(broken[:3])}); "
                          "the file is damaged")


def nonfinite(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the float tensors holding a NaN or an infinity."""
    return [k for k, t in weights.items()  # (meta tensors: shapes only, as `describe_checkpoint` reads)
            if t.is_floating_point() and not t.is_meta
            and not bool(torch.isfinite(t if t.element_size() > 1 else t.float()).all())]  # float8: none


def tokenizer_description(meta: dict[str, Any], where: Path) -> dict[str, Any]:
    """meta["tokenizer"], checked for what Tokenizer.load reads (its file names), else a UserError."""
    description = meta.get("tokenizer")
    files = description.get("files") if isinstance(description, dict) else None
    if not isinstance(files, dict) or not isinstance(files.get("source"), str) or not all(
            isinstance(v, str) for v in files.values()):
        raise UserError(f'{where}: missing or malformed "tokenizer" entry (it needs "files": {{"source": FILE}})')
    outside = [v for v in files.values() if Path(v).name != v]  # an absolute path or ../x: read from elsewhere
    if outside:
        raise CorruptFile(f'{where}: tokenizer file {outside[0]!r} is not a file name inside the checkpoint')
    return description


def checkpoint_tokenizer(directory: Path, meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint holds; a hand-edited or damaged description is one line, not a KeyError."""
    where = directory / META
    try:
        return Tokenizer.load(directory, tokenizer_description(meta, where))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptFile(f'{where}: malformed "tokenizer" entry ({type(e).__name__}: {e})') from None


def check_vocabulary(config: ModelConfig, tokenizer: Tokenizer, where: Path) -> None:
    """The tokenizer's ids must fit the model's embeddings (`vocabulary_problem`), else a CorruptFile naming
    the file at fault: the side's SentencePiece model where its pieces do not match the embeddings (a
    damaged or swapped file: it was blamed on meta.json), else `where`."""
    mismatch = _size_mismatch(config, tokenizer)
    if mismatch and mismatch[1] is not None:
        raise CorruptFile(f"{mismatch[1]}: {mismatch[0]}: a damaged file, or not the tokenizer this model "
                          "was trained with")
    problem = vocabulary_problem(config, tokenizer)
    if problem:
        raise CorruptFile(f"{where}: {problem}")


def _size_mismatch(config: ModelConfig, tokenizer: Tokenizer) -> tuple[str, Path | None] | None:
    """(how a side's piece count differs from the model's embeddings, the SentencePiece file they were
    counted in, or None for a vocabulary's: Marian's, in meta.json), or None where they fit."""
    sizes = [("source", tokenizer.src_vocab_size, config.vocab_size, tokenizer.src_path),
             ("target", tokenizer.tgt_vocab_size, config.target_vocab_size, tokenizer.tgt_path)]
    for side, pieces, rows, path in sizes:
        # aiayn builds the model from its own SentencePiece model's size, and convert from a vocabulary of
        # exactly its ids: fewer pieces than rows (a vocabulary cut by hand) decoded an id without a piece,
        # a KeyError traceback, and scored garbage
        if pieces != rows:
            counted_in = None if tokenizer.vocab is not None else path or tokenizer.src_path  # shared: one
            return f"the {side} tokenizer has {pieces} pieces but the model {rows} embeddings", counted_in
    return None


def vocabulary_problem(config: ModelConfig, tokenizer: Tokenizer) -> str | None:
    """Why the tokenizer's ids do not fit the model's embeddings, or None: a swapped spm.model with more
    pieces failed in the embedding lookup, one with the same count translated garbage unnoticed (this
    cannot see that)."""
    mismatch = _size_mismatch(config, tokenizer)
    if mismatch:
        return f"{mismatch[0]}: not the tokenizer this model was trained with"
    for side, vocab in (("source", tokenizer.vocab), ("target", tokenizer.tgt_vocab)):
        # ids past the embeddings failed in their lookup (an IndexError traceback); a gap, in decoding an
        # id that no piece has (a KeyError). A vocabulary's ids are 0 .. n-1, each once.
        if vocab is not None and sorted(vocab.values()) != list(range(len(vocab))):
            wrong = sorted(set(vocab.values()) ^ set(range(len(vocab))))[:3]
            return (f"the {side} vocabulary's ids are not 0 to {len(vocab) - 1}, each once "
                    f"(e.g. {', '.join(map(str, wrong)) or 'one twice'})")
    specials = dict(pad=tokenizer.pad_id, bos=tokenizer.bos_id, eos=tokenizer.eos_id, unk=tokenizer.unk_id)
    bad = [f"{k}={v}" for k, v in specials.items() if not -1 <= v < config.target_vocab_size]
    if bad:
        return (f"special ids {', '.join(bad)} outside the model's {config.target_vocab_size} target "
                "embeddings")
    # The model masks config.pad_id and stops at config.eos_id; the tokenizer pads and ends sentences with
    # its own: another pad was attended (results changed with batching), -1 failed in the embedding
    pairs = (("pad", tokenizer.pad_id, config.pad_id), ("eos", tokenizer.eos_id, config.eos_id))
    for name, ours, model in pairs:
        if ours != model:
            return (f"the tokenizer's {name} id is {ours}, the model's {name}_id {model}: not the tokenizer "
                    "this model was trained with")
    return None


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype = torch.float32) -> Checkpoint:
    """Model (eval mode, on `device`: the CPU or a CUDA device this machine has, `inference_device`; in
    `dtype`: a floating-point torch dtype or its name, "bfloat16"), tokenizer and metadata of a checkpoint
    directory."""
    # before any reading: CUDA on a CPU-only torch was an AssertionError, "meta" a model without weights
    device = inference_device(device)
    dtype = weights_dtype(dtype)
    directory, meta, config = _checkpoint_meta(directory)
    tokenizer = checkpoint_tokenizer(directory, meta)
    check_meta_vocabulary(directory, config, tokenizer)  # before the weights are blamed for meta.json
    model = model_from_weights(config, load_weights(directory), directory / WEIGHTS, device, dtype)
    check_vocabulary(config, tokenizer, directory / META)
    return Checkpoint(model.eval(), tokenizer, meta, directory)


def _checkpoint_meta(directory: str | Path) -> tuple[Path, dict[str, Any], ModelConfig]:
    """(the directory, its meta.json, the ModelConfig that records), each checked: one line naming what
    is missing or wrong."""
    check_path(directory, "checkpoint", "a checkpoint directory's path")
    directory = Path(os.fsdecode(directory))
    if not directory.is_dir():
        what = "is a file, not a checkpoint directory" if directory.exists() else not_found(directory)
        if directory.exists() and is_checkpoint(directory.parent):  # its model.safetensors, say
            # "." for a file of the current directory: "name the checkpoint it is in, ." read as a typo
            parent = directory.parent if directory.parent != Path() else "the current directory (.)"
            what += f"; name the checkpoint it is in, {parent}"
        raise UserError(f"{directory}: {what}")
    meta = read_meta(directory)
    return directory, meta, meta_model_config(directory, meta)


def not_found(directory: Path) -> str:
    """Why `directory` is no checkpoint: "checkpoint not found", and where a save killed as it replaced
    it left it moved aside (`files.moved_aside`), that and how to put it back: "not found" alone sent the
    user looking for a checkpoint that is there under another name."""
    if (old := moved_aside(directory)) is None:
        return "checkpoint not found"
    trained = directory.parent.name == "checkpoints"  # a training run's: its start puts them back
    itself = " (`aiayn train --resume` of its run does so itself)" if trained else ""
    return (f"checkpoint not found: a save killed as it replaced it left it as {old.name}; rename that back "
            f"to {directory.name}{itself}")


def meta_model_config(directory: Path, meta: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` a checkpoint's meta.json records, checked; else one line naming the file."""
    if not isinstance(meta.get("model"), dict):  # a string was read key by key: "unknown keys c, i, m"
        raise CorruptFile(f"{directory / META}: corrupt checkpoint metadata ('model' is not a table)")
    values = dict(meta["model"])
    if values.get("share_embeddings", True) and values.get("tgt_vocab_size") == values.get("vocab_size"):
        # ModelConfig once took this as one shared vocabulary (and built one matrix); it now refuses it
        values["tgt_vocab_size"] = None
    try:
        return from_dict(ModelConfig, values, where=str(directory / META))
    except (ConfigError, KeyError, TypeError) as e:
        # a CorruptFile: a damaged file, for which --resume advises the checkpoint before (resume.resume_hint)
        raise CorruptFile(f"{directory / META}: bad model configuration ({e})") from None


def describe_checkpoint(directory: str | Path) -> list[str]:
    """`aiayn info CHECKPOINT`'s lines: the model, its weights as stored, the tokenizer and where the
    checkpoint came from. The weights file's header is read, not its tensors: a `big` checkpoint is
    described in a blink, and a damaged header or a file that does not fit the model is still named."""
    directory, meta, config = _checkpoint_meta(directory)
    tokenizer = checkpoint_tokenizer(directory, meta)
    check_meta_vocabulary(directory, config, tokenizer)  # before spm.model is blamed for meta.json
    check_vocabulary(config, tokenizer, directory / META)
    with torch.device("meta"):  # shapes only
        model = Transformer(config)
    stored = stored_tensors(directory)
    check_fits(model, stored, directory / WEIGHTS)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in stored.values()})
    size = (directory / WEIGHTS).stat().st_size
    size_text = f"{size / 1e6:,.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"
    lines = [f"checkpoint: {directory}", str(config),
             f"parameters: {model.num_parameters():,} ({', '.join(dtypes)}; {WEIGHTS} {size_text})"]
    files = tokenizer_description(meta, directory / META)["files"]
    one = tokenizer.shared and tokenizer.vocab is None or tokenizer.vocab is not None and (
        tokenizer.tgt_vocab is tokenizer.vocab)  # Marian's one vocabulary over two SentencePiece models
    pieces = (f"{tokenizer.src_vocab_size:,} pieces, both sides" if one
              else f"{tokenizer.src_vocab_size:,} source and {tokenizer.tgt_vocab_size:,} target pieces")
    lines.append(f"tokenizer: SentencePiece ({', '.join(files.values())}), {pieces}")
    lines += _provenance(meta)
    return lines


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The weights file's tensors as empty meta-device tensors of their stored dtypes and shapes."""
    path = weights_path(directory)
    try:
        with safe_open(str(path), framework="pt") as f:  # the header alone
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: torch.empty(part.get_shape(), device="meta",
                                      dtype=_SAFETENSORS_DTYPES.get(part.get_dtype(), torch.uint8))
                    for name, part in slices.items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise _weights_error(path, e) from None


# safetensors' dtype names (its header's); one not listed is named to `check_fits` as uint8, not a float
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _trained_path(path: str, workdir: Any) -> str:
    """A training file's path as the run was given it, made whole with the directory it ran in: `tr.de`
    meant nothing to `aiayn info` run from another one."""
    return os.path.join(workdir, path) if isinstance(workdir, str) and path else path


def trained_on(meta: dict[str, Any]) -> tuple[str, str] | None:
    """The training files (source, target) a training checkpoint's meta.json records, made whole with the
    directory it ran in where it records that (`_trained_path`); None where it records none."""
    data = config_section(meta, "data") or {}
    if not (isinstance(data.get("train_src"), str) and isinstance(data.get("train_tgt"), str)):
        return None
    return _trained_path(data["train_src"], meta.get("workdir")), _trained_path(data["train_tgt"],
                                                                                meta.get("workdir"))


def averaged_from(meta: dict[str, Any]) -> str | None:
    """The checkpoints an average was made of, as its meta.json names them ("2 checkpoints, A, B"); None
    for one that is no average."""
    averaged = meta.get("averaged")
    if not isinstance(averaged, list):
        return None
    return f"{checkpoints_said(len(averaged))}, {', '.join(map(str, averaged))}"


def checkpoints_said(n: int) -> str:
    """'1 checkpoint', '3 checkpoints' ("averaged 1 checkpoints" was said of a run that had saved one)."""
    return f"{n} checkpoint{'s' * (n != 1)}"


def _provenance(meta: dict[str, Any]) -> list[str]:
    """Where a checkpoint came from, as its meta.json says: training (step, validation), an average, or
    a conversion."""
    def count(value: Any) -> bool:  # a hand's edit printed "epoch True" or "update -5"
        return type(value) is int and value >= 0

    lines = []
    averaged = meta.get("averaged") if isinstance(meta.get("averaged"), list) else None
    if count(meta.get("step")):
        # An average keeps the newest checkpoint's meta.json, whose validation scored that one alone
        metrics = meta.get("metrics") if isinstance(meta.get("metrics"), dict) and averaged is None else {}
        scores = [f"{k} {v:.4g}" for k, v in metrics.items()
                  if k.startswith("valid_") and isinstance(v, (int, float)) and not isinstance(v, bool)]
        epoch = f", epoch {meta['epoch']}" if count(meta.get("epoch")) else ""
        scored = f"; {', '.join(scores)}" if scores else ""
        interrupted = " (saved on a signal, not validated)" if meta.get("interrupted") is True else ""
        lines.append(f"trained: update {meta['step']:,}{epoch}{scored}{interrupted}")
    if (files := trained_on(meta)) is not None:
        src, tgt = files
        older = not isinstance(meta.get("workdir"), str) and not (os.path.isabs(src) and os.path.isabs(tgt))
        relative = " (relative to the directory training ran in)" if older else ""
        lines.append(f"data: {src} -> {tgt}{relative}")
    tuned_from = (config_section(meta, "train") or {}).get("init_from")
    if isinstance(tuned_from, str) and tuned_from:
        lines.append(f"fine-tuned from: {tuned_from}")
    if averaged is not None:
        lines.append(f"averaged: {averaged_from(meta)} (not validated as an average)")
    source = meta.get("converted_from")
    if isinstance(source, dict):
        lines.append(f"converted from: {source.get('format')} {source.get('path')}")
    return lines
