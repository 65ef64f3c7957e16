"""The run directory's tokenizer (`run_tokenizer`): trained once on the training text, or the one found
there, checked first. A tokenizer left there by a first run that failed later, or put there by hand, must be
one that [data] trains (its kind, size, settings and special pieces); that of a resumed run must be the
one its checkpoints hold (put back from the latest where it is missing, refused where it differs).

Apart from `loop`, whose `_prepare_files` calls `run_tokenizer` on process 0 alone: these checks read
SentencePiece models and checkpoints' records, and train nothing; the loop reads shorter without them.
"""

from __future__ import annotations

import json
import logging
import struct
from contextlib import contextmanager, suppress
from pathlib import Path

from aiayn.checkpoint import META, checkpoint_tokenizer, config_section, read_meta
from aiayn.data.dataset import (
    TOKENIZER_INPUTS,
    check_tokenizer_inputs,
    find_tokenizer,
    read_parallel,
    refuse_other_tokenizer_settings,
    scan_parallel,
    tokenizer_inputs,
    train_tokenizer,
    write_tokenizer_inputs,
)
from aiayn.data.tokenizer import SHARED, SOURCE, TARGET, Tokenizer, trained_settings
from aiayn.errors import CorruptFile, UserError
from aiayn.train.config import NORMALIZATIONS, SPM_TYPES, RunConfig, toml_value
from aiayn.train.resume import config_tokenizer_settings, left_at_defaults, tokenizer_written_at
from aiayn.train.state import checkpoint_dirs

log = logging.getLogger(__name__)


def _check_found_tokenizer(found: Tokenizer, config: RunConfig, run_dir: Path) -> None:
    """A tokenizer left in run_dir (by a first run that failed later, or copied there) must be one that
    [data] trains: separate source.spm and target.spm under shared_vocab, or an 8,696-piece spm.model
    beside a record of 300, were used silently and recorded as trained with [data]'s settings.
    SentencePiece may make fewer pieces than asked (a small corpus), never more."""
    dc = config.data
    sizes = {found.src_vocab_size, found.tgt_vocab_size}
    problem = None
    if found.shared != dc.shared_vocab:
        kind = "one shared" if found.shared else "separate"
        problem = f"{kind} vocabulary, not data.shared_vocab={toml_value(dc.shared_vocab)}"
    elif max(sizes) > dc.vocab_size:
        problem = f"{max(sizes)} pieces, more than data.vocab_size={dc.vocab_size}"
    if problem:
        raise UserError(f"{run_dir}: its tokenizer has {problem}; delete it (spm.model, or source.spm and "
                        "target.spm) to train a new one, or use a new train.run_dir")
    _check_special_pieces(found)
    _check_trained_settings(found, config)


# [data]'s settings a SentencePiece model records and encodes by (`trained_settings`): another was overridden
# by the model unsaid, and recorded in meta.json as [data]'s (a case-folding model as "nmt_nfkc", a unigram
# one as "bpe"), which a fine-tune adopts and --resume compares
ENCODING_SETTINGS = {"spm_type": SPM_TYPES, "normalization": NORMALIZATIONS}


def _check_trained_settings(found: Tokenizer, config: RunConfig) -> None:
    """A tokenizer left in run_dir must have been trained with [data]'s spm_type and normalization (one
    that names no rule, built by hand, is not compared). data.character_coverage is not: it chose which
    characters training kept, and the pieces it made (checked above) are what the model holds; refused,
    the many models made with SentencePiece's default 0.9995 would need a `--set` that changes nothing
    but the record. Another is said instead."""
    dc = config.data
    models = [(found.src_path, found.src)] + ([] if found.shared else [(found.tgt_path, found.tgt)])
    for path, sp in models:
        trained = trained_settings(sp.serialized_model_proto(), path)
        other = {key: trained[key] for key in ENCODING_SETTINGS if trained[key] not in ("", getattr(dc, key))}
        delete = "delete the tokenizer (spm.model, or source.spm and target.spm) to train a new one"
        if cannot := [key for key, value in other.items() if value not in ENCODING_SETTINGS[key]]:
            key = cannot[0]
            raise UserError(f"{path}: trained with {key} {json.dumps(other[key])}, which data.{key} cannot "
                            f"be ({' or '.join(ENCODING_SETTINGS[key])}); {delete}")
        if other:
            was = " and ".join(f"{key} {json.dumps(value)}" for key, value in other.items())
            now = " and ".join(config.shown(f"data.{key}", getattr(dc, key)) for key in other)
            fix = " and ".join(f"data.{key}={json.dumps(value)}" for key, value in other.items())
            written = config.written_where(*(f"data.{key}" for key in other))
            raise UserError(f"{written}{path}: trained with {was}, not {now}; set {fix} to train with it, or "
                            f"{delete}")
        coverage = trained["character_coverage"]
        if struct.pack("<f", coverage) != struct.pack("<f", dc.character_coverage):
            log.info("%s: trained with character_coverage=%s, not data.character_coverage=%s, which only "
                     "training a tokenizer uses (the run records it as set)", path, coverage,
                     dc.character_coverage)


def _check_special_pieces(found: Tokenizer) -> None:
    """A SentencePiece model made elsewhere must have the pieces aiayn's batches use: pad, bos (the
    decoder's start) and eos. SentencePiece's defaults leave pad out (pad_id=-1): such a model was
    accepted, the corpus encoded and cached, and the model's configuration refused it after ("pad_id=-1
    is outside the vocabulary"). Any free ids will do. With two models, the ids come from target.spm
    (`Tokenizer`), so source.spm must give pad, eos and unk the same ones: its sentences are padded and
    ended with them, and their unknown pieces counted by them."""
    path, sp = (found.src_path, found.src) if found.shared else (found.tgt_path, found.tgt)
    ids = {"pad": sp.pad_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    if missing := [name for name, i in ids.items() if i < 0]:
        raise UserError(
            f"{path}: the SentencePiece model has no {' or '.join(missing)} piece "
            f"({', '.join(f'{name}_id=-1' for name in missing)}); aiayn needs pad, bos and eos pieces: train "
            "it with an id for each (SentencePiece leaves pad out unless given one: e.g. --pad_id=3 beside "
            "its default unk_id=0 bos_id=1 eos_id=2), or delete it to train a new one"
        )
    if found.shared:
        return
    src = {"pad": found.src.pad_id(), "eos": found.src.eos_id(), "unk": found.src.unk_id()}
    tgt = {"pad": ids["pad"], "eos": ids["eos"], "unk": sp.unk_id()}
    if other := [f"{name}_id={src[name]}, not {tgt[name]}" for name in src if src[name] != tgt[name]]:
        raise UserError(
            f"{found.src_path}: special ids other than {path}'s ({'; '.join(other)}); aiayn takes both "
            f"sides' from {path.name}: train both models with the same pad_id, eos_id and unk_id, or delete "
            "them to train new ones"
        )


def _other_tokenizer(run_dir: Path, saved: list[Path], latest: Tokenizer, found: Tokenizer) -> UserError:
    """The refusal of a run directory whose tokenizer (`found`) is not its latest checkpoint's (`latest`):
    the earlier checkpoints' copies tell which is odd. The run's was blamed always, and putting the
    checkpoint's back over it, as advised, trained on silently with a swapped spm.model where that one
    was the file replaced."""
    earlier = []
    for checkpoint in saved[:-1]:
        with suppress(UserError):  # a damaged one tells nothing
            earlier.append(checkpoint_tokenizer(checkpoint, read_meta(checkpoint)))
    if earlier and all(found.same_as(t) for t in earlier):  # CorruptFile: `resume_hint` adds the way out
        return CorruptFile(f"{_differing_file(latest, found, saved[-1])}: not the tokenizer of the run "
                           "directory and its earlier checkpoints (damaged, replaced, or another run's)")
    if earlier and all(latest.same_as(t) for t in earlier):
        return UserError(f"{run_dir}: its tokenizer is not the one {saved[-1].name} was trained with; put "
                         f"that checkpoint's back (the files in {saved[-1]}), or train in a new "
                         "train.run_dir")
    return UserError(f"{run_dir}: its tokenizer is not the one in {saved[-1]}, and no earlier checkpoint "
                     "tells which of the two the run was trained with; keep both, and train in a new "
                     "train.run_dir or put the right one in the other's place")


def _differing_file(latest: Tokenizer, found: Tokenizer, checkpoint: Path) -> Path:
    """The file of `checkpoint`'s tokenizer (`latest`) that is not `found`'s: a SentencePiece model, or
    meta.json where both models are the same (special ids, a vocabulary)."""
    (src, tgt), (their_src, their_tgt) = latest.models(), found.models()  # tgt None: one shared model
    if src != their_src or (tgt is None) != (their_tgt is None):
        return latest.src_path
    return latest.tgt_path if tgt != their_tgt and latest.tgt_path else checkpoint / META


@contextmanager
def _damaged_tokenizer():
    """A run directory's SentencePiece model that cannot be read: the remedy, which the checkpoints' own
    copy or a new tokenizer gives."""
    try:
        yield
    except CorruptFile as e:
        raise UserError(f"{e}; delete it: --resume puts the checkpoint's copy back, a run without "
                        "checkpoints trains a new one") from None


def _check_lone_model(run_dir: Path, trained_with: Tokenizer, checkpoint: Path) -> None:
    """Half of a resumed run's pair (a full disk or a kill while --resume put the pair back: source.spm
    is written first) is mended where it is the checkpoint's own model of its side; another is refused,
    named, not written over (it was, unsaid)."""
    if trained_with.shared:
        return
    for path, model, partner in ((run_dir / SOURCE, trained_with.src, TARGET),
                                 (run_dir / TARGET, trained_with.tgt, SOURCE)):
        if path.is_file() and Tokenizer(path).src.serialized_model_proto() != model.serialized_model_proto():
            raise UserError(f"{path}: not the {path.name} of {checkpoint}'s tokenizer (damaged, replaced, or "
                            f"another run's), and no {partner} beside it; move it out of {run_dir}: --resume "
                            "then puts the checkpoint's tokenizer back")


def run_tokenizer(config: RunConfig, run_dir: Path) -> tuple[Tokenizer, bool, bool]:
    """The run directory's tokenizer: trained once on the training text, then reused if it fits; whether it
    is kept for other text than it was trained on (a run resumed on other training files); and whether
    it was made elsewhere (put in a new run directory, with no record of aiayn's training), so that its
    rewriting of this text was never checked."""
    dc = config.data
    saved = checkpoint_dirs(run_dir)
    with _damaged_tokenizer():
        found = None if saved else find_tokenizer(run_dir)  # resumed: the checkpoints' kind, below
    inputs = tokenizer_inputs(dc.train_src, dc.train_tgt, config_tokenizer_settings(config))
    if saved:  # resumed: the tokenizer its checkpoints were trained with, which each of them holds
        latest = saved[-1]
        meta = read_meta(latest)
        trained_with = checkpoint_tokenizer(latest, meta)
        if (data := config_section(meta, "data")) is not None:  # what they were trained with, if recorded
            refuse_other_tokenizer_settings(latest, data, inputs, tokenizer_written_at(config, data),
                                            left_at_defaults(config))
        with _damaged_tokenizer():
            found = find_tokenizer(run_dir, trained_with.shared)
        if found is None:  # only checkpoints/ was copied here, or a pair's write stopped half way
            with _damaged_tokenizer():
                _check_lone_model(run_dir, trained_with, latest)
            trained_with.save(run_dir)  # put its tokenizer back, train none
            found = find_tokenizer(run_dir, trained_with.shared)
        elif not found.same_as(trained_with):
            raise _other_tokenizer(run_dir, saved, trained_with, found)
        mine = [SHARED] if found.shared else [SOURCE, TARGET]
        if others := [name for name in (SHARED, SOURCE, TARGET)
                      if name not in mine and (run_dir / name).is_file()]:
            log.warning("%s: %s left unused there: the checkpoints' tokenizer is %s", run_dir,
                        " and ".join(others), " and ".join(mine))
    if found is not None:  # resumed: the tokenizer of its checkpoints; else left by a first run that
        other_text = check_tokenizer_inputs(run_dir, inputs, resumed=bool(saved))  # failed later
        made_elsewhere = False
        if not saved:  # its record (tokenizer_inputs.json) says what it was asked, not what the files hold
            _check_found_tokenizer(found, config, run_dir)
            made_elsewhere = not (run_dir / TOKENIZER_INPUTS).is_file()
        # as the training line says it: "(200 pieces, shared)" (this read "(200, shared pieces)")
        pieces = "" if found.shared else f" and {found.tgt_vocab_size}"
        log.info("%s: using the tokenizer there (%d%s pieces, %s)", run_dir, found.src_vocab_size, pieces,
                 "shared" if found.shared else "separate")
        return found, other_text, made_elsewhere
    # Checked, not reported: the encoding that follows says what it dropped, once.
    if dc.valid_src:  # a bad validation file fails now, not after minutes of tokenizer training
        read_parallel(dc.valid_src, dc.valid_tgt, report=False)
    text = scan_parallel(dc.train_src, dc.train_tgt, report=False)  # streamed to SentencePiece, not held
    log.info(
        "training a %s SentencePiece model (%d pieces, %s) on %d pairs",
        dc.spm_type,
        dc.vocab_size,
        "shared" if dc.shared_vocab else "separate",
        len(text.src),
    )
    write_tokenizer_inputs(run_dir, inputs)
    # The sample of a large corpus is drawn with train_tokenizer's fixed seed, not train.seed: runs of other
    # seeds on one corpus get one tokenizer, as an ensemble of them needs
    return train_tokenizer(text, run_dir, dc.vocab_size, dc.spm_type, dc.shared_vocab,
                           dc.normalization, dc.character_coverage), False, False
