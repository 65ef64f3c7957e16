"""Subwords with SentencePiece: one model shared by source and target (the paper), or one each.

Special ids come from here and nowhere else. Models trained by aiayn use pad=0, bos=1, eos=2, unk=3.
An imported model (Marian) may map SentencePiece pieces to ids through its own vocabulary: `vocab`,
and with separate vocabularies a second one for the target side, `tgt_vocab`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
from itertools import islice
from pathlib import Path
from typing import IO, Iterable, Sequence

import sentencepiece as spm

from aiayn.errors import CorruptFile, UserError
from aiayn.files import atomic_output

SHARED, SOURCE, TARGET = "spm.model", "source.spm", "target.spm"
SEED_SENTENCES = 2_000_000  # sentences a model is trained on at most: of more, a seeded sample (dataset.py)
MIN_CHARACTER_COVERAGE = 0.98  # SentencePiece's least character_coverage, and data.character_coverage's


class Tokenizer:
    """Text <-> ids for the source and the target side.

    `encode_src` ends a sentence with EOS (the encoder's input); `encode_tgt` returns the bare pieces
    (training adds BOS/EOS where the decoder needs them); `decode_tgt` stops at EOS and drops specials.
    With a `vocab` (piece -> id, as Marian ships), ids are looked up there instead of in the models;
    `tgt_vocab` is the target side's when it differs (Marian's `separate_vocabs`), else `vocab` serves both.
    """

    def __init__(
        self,
        src_model: str | Path,
        tgt_model: str | Path | None = None,
        vocab: dict[str, int] | None = None,
        specials: dict[str, int] | None = None,
        tgt_vocab: dict[str, int] | None = None,
    ):
        self.src_path = Path(src_model)
        self.tgt_path = Path(tgt_model) if tgt_model is not None else None
        self.src = _load_spm(self.src_path)
        self.tgt = _load_spm(self.tgt_path) if self.tgt_path is not None else self.src
        self.vocab = vocab
        self.tgt_vocab = tgt_vocab if tgt_vocab is not None else vocab
        self.id_to_piece = {i: p for p, i in self.tgt_vocab.items()} if self.tgt_vocab is not None else None
        if specials is None:
            specials = dict(pad=self.tgt.pad_id(), bos=self.tgt.bos_id(), eos=self.tgt.eos_id(), unk=self.tgt.unk_id())
        self.pad_id, self.bos_id = specials["pad"], specials["bos"]
        self.eos_id, self.unk_id = specials["eos"], specials["unk"]
        # A hand-edited meta.json's null or "2" failed later in a comparison, as a traceback.
        ids = [("special id", k, v) for k, v in specials.items()]
        ids += [("vocabulary id", k, v) for table in (vocab, tgt_vocab) if table for k, v in table.items()]
        if bad := next(((what, k, v) for what, k, v in ids if type(v) is not int), None):
            raise ValueError(f"{bad[0]} {bad[1]!r} is {bad[2]!r}, not an integer")

    def __repr__(self) -> str:
        """One vocabulary (vocab_size) or two, and the SentencePiece model or models, which `shared` counts:
        Marian's one vocabulary over two models printed as "shared=False", and the target's model not."""
        one_vocabulary = self.tgt_vocab is self.vocab and (self.shared or self.vocab is not None)
        sizes = (f"vocab_size={self.src_vocab_size}" if one_vocabulary
                 else f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}")
        models = (f"SentencePiece model {self.src_path}" if self.shared
                  else f"SentencePiece models {self.src_path}, {self.tgt_path}")
        return f"Tokenizer({sizes}, {models})"

    @property
    def shared(self) -> bool:
        return self.tgt_path is None

    @property
    def src_vocab_size(self) -> int:
        return len(self.vocab) if self.vocab is not None else self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.tgt_vocab) if self.tgt_vocab is not None else self.tgt.get_piece_size()

    def _pieces(self, sp: spm.SentencePieceProcessor, vocab: dict[str, int] | None, text: str) -> list[str]:
        """One string per id that `_ids` gives: with a `vocab`, a leading target-language code (>>fra<<,
        which Marian's multilingual models read as one token) is one piece, not the several that
        SentencePiece would cut it into."""
        end = text.find("<<") if vocab is not None and text.startswith(">>") else -1
        if end != -1:
            return [text[: end + 2]] + sp.encode(text[end + 2 :], out_type=str)
        return sp.encode(text, out_type=str)

    def _ids(self, sp: spm.SentencePieceProcessor, vocab: dict[str, int] | None, text: str) -> list[int]:
        if vocab is None:
            return sp.encode(text)
        return [vocab.get(p, self.unk_id) for p in self._pieces(sp, vocab, text)]

    def encode_src(self, text: str) -> list[int]:
        _one_text(text, "encode_src")
        return self._ids(self.src, self.vocab, text) + [self.eos_id]

    def encode_tgt(self, text: str) -> list[int]:
        _one_text(text, "encode_tgt")
        return self._ids(self.tgt, self.tgt_vocab, text)

    def encode_src_batch(self, texts: list[str], threads: int = -1) -> list[list[int]]:
        """`encode_src` of each text: the same ids, from one call into SentencePiece for the whole list,
        in `threads` threads (-1: one per core)."""
        _texts(texts, "encode_src_batch")
        return [ids + [self.eos_id] for ids in self._ids_batch(self.src, self.vocab, texts, threads)]

    def encode_tgt_batch(self, texts: list[str], threads: int = -1) -> list[list[int]]:
        """`encode_tgt` of each text, as `encode_src_batch`."""
        _texts(texts, "encode_tgt_batch")
        return self._ids_batch(self.tgt, self.tgt_vocab, texts, threads)

    def _ids_batch(
        self, sp: spm.SentencePieceProcessor, vocab: dict[str, int] | None, texts: list[str], threads: int
    ) -> list[list[int]]:
        if vocab is not None:  # Marian's vocabulary and its >>fra<< pieces: line by line, as `_ids`
            return [self._ids(sp, vocab, text) for text in texts]
        return sp.encode(texts, num_threads=threads)

    def decode_tgt(self, ids: Sequence[int]) -> str:
        """The text of target ids, up to the first EOS, without padding. BOS is not removed here: in
        aiayn's own models it is a control piece SentencePiece decodes to nothing, and in a Marian
        model whose decoder starts from an ordinary piece (`bos_id` is then that piece) it is text."""
        if isinstance(ids, (str, bytes)):  # read character by character: "invalid literal for int()"
            raise TypeError(f"Tokenizer.decode_tgt takes target ids (a list of ints), not {type(ids).__name__}")
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i != self.pad_id:
                out.append(int(i))
        if self.id_to_piece is None:
            return self.tgt.decode(out)
        # As MarianTokenizer.decode(skip_special_tokens=True): <unk> dropped, and a word boundary left in a
        # piece that target.spm does not hold (OPUS-MT's one vocab.json lists the source side's pieces
        # too) is a space, not a literal U+2581.
        pieces = [self.id_to_piece[i] for i in out if i != self.unk_id]
        return self.tgt.decode_pieces(pieces).replace("\u2581", " ").strip()

    def src_pieces(self, text: str) -> list[str]:
        """Subword strings of a source sentence and its EOS, one per id of `encode_src` (axis labels for
        attention maps)."""
        return self._pieces(self.src, self.vocab, text) + ["</s>"]

    def tgt_pieces(self, ids: Sequence[int]) -> list[str]:
        if self.id_to_piece is not None:
            return [self.id_to_piece[int(i)] for i in ids]
        return [self.tgt.id_to_piece(int(i)) for i in ids]

    def same_as(self, other: "Tokenizer") -> bool:
        """Whether `other` turns every text into the same ids and back (the same models, vocabularies
        and special ids): the condition for decoding two models as one ensemble."""
        def key(t: Tokenizer) -> tuple:
            return (t.src.serialized_model_proto(), t.tgt.serialized_model_proto(), t.vocab, t.tgt_vocab,
                    (t.pad_id, t.bos_id, t.eos_id, t.unk_id))
        return key(self) == key(other)

    def models(self) -> tuple[bytes, bytes | None]:
        """The SentencePiece model files' bytes (source, target or None when shared), from memory: the
        files it was loaded from may be gone (a fine-tuning run's checkpoint, pruned by keep_last)."""
        return self.src.serialized_model_proto(), None if self.shared else self.tgt.serialized_model_proto()

    def save(self, directory: str | Path) -> dict:
        """Write the model files into `directory`; return the JSON description `load` reads back.

        Each file is written whole or not at all (`atomic_output`; an OSError is a UserError naming it):
        `--resume` writes them into a run directory that has only checkpoints/, where a full disk or a kill
        left a truncated spm.model that every later resume refused."""
        directory = Path(directory)
        src, tgt = self.models()
        files = {"source": SHARED} if tgt is None else {"source": SOURCE, "target": TARGET}
        for name, data in zip(files.values(), (src, tgt)):
            write_model(directory / name, data)
        specials = dict(pad=self.pad_id, bos=self.bos_id, eos=self.eos_id, unk=self.unk_id)
        description = {"files": files, "vocab": self.vocab, "specials": specials}
        if self.tgt_vocab is not self.vocab:
            description["tgt_vocab"] = self.tgt_vocab
        return description

    @classmethod
    def load(cls, directory: str | Path, description: dict) -> "Tokenizer":
        directory = Path(directory)
        files = description["files"]
        tgt = directory / files["target"] if "target" in files else None
        return cls(directory / files["source"], tgt, description.get("vocab"), description.get("specials"),
                   description.get("tgt_vocab"))


def _one_text(text: str, method: str) -> None:
    """A list given where one text goes came back as a list per text and an EOS ([[27, 67], [162], 2]),
    silently: refused (the type once per call, as the batch's checks, not per piece)."""
    if isinstance(text, bytes):  # no list: the batch's hint would not help
        raise TypeError(f"Tokenizer.{method} takes a str, not bytes: decode it first (text.decode())")
    if not isinstance(text, str):
        raise TypeError(f"Tokenizer.{method} takes one text (str), not {type(text).__name__}: "
                        f"{method}_batch encodes a list of texts")


def _texts(texts: list[str], method: str) -> None:
    """One str given where a list goes was read character by character, or failed inside: refused."""
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"Tokenizer.{method} takes a list of texts, not one {type(texts).__name__}: pass "
                        f"[text], or {method.removesuffix('_batch')}(text)")


def _load_spm(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise UserError(f"{path}: SentencePiece model not found")
    sp = spm.SentencePieceProcessor()
    try:  # the bytes, not the name: SentencePiece's C++ took no path that is not UTF-8 (a TypeError)
        proto = path.read_bytes()
        if not proto:  # SentencePiece takes b"" for no model at all: a ValueError, blamed on meta.json
            raise CorruptFile(f"{path}: empty, not a SentencePiece model")
        sp.load(model_proto=proto)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    except RuntimeError as e:
        raise CorruptFile(f"{path}: not a SentencePiece model ({' '.join(str(e).split())})") from None
    try:
        numbers = _field_numbers(proto)
    except (IndexError, ValueError) as e:  # one SentencePiece loads, which the wire reader misreads
        raise CorruptFile(f"{path}: not read as a SentencePiece model ({e})") from None
    if not numbers & AFTER_PIECES:  # a file cut between two pieces parses: fewer pieces
        raise CorruptFile(f"{path}: truncated: it ends after {sp.get_piece_size()} pieces, without the "
                          "training settings and normalization rules that follow them in a SentencePiece "
                          "model")
    return sp


# ModelProto's field numbers of trainer_spec and normalizer_spec, which SentencePiece's training writes
# after the pieces (field 1): a model with neither was cut short. (One alone loads and encodes: a model
# built by hand may lack the other.)
AFTER_PIECES = {2, 3}
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}  # TrainerSpec.ModelType's numbers


def trained_settings(model: bytes, path: str | Path = "the SentencePiece model") -> dict[str, str | float]:
    """What a SentencePiece model says it was trained with, by [data]'s names: `spm_type` (TrainerSpec's
    model_type, field 3, which SentencePiece encodes by), `normalization` (NormalizerSpec's name, field 1:
    the rule it applies to text; "" where unnamed, as in a model built by hand) and `character_coverage`
    (TrainerSpec's field 10, a float32, written as the shortest decimal that is it: 0.9995). A field left
    out has the proto's default, which SentencePiece does not write: unigram, 0.9995. Read from the wire
    format: SentencePiece's Python API exposes none of them, and its sentencepiece_model_pb2 needs protobuf,
    which aiayn does not depend on. Read as protobuf reads them: a message given twice is the two merged,
    a field keeps its last value of its own wire type (one of another is an unknown field, which a model
    that loads may hold), and a model_type of no known number is an unknown enum value, which leaves the
    one before it (or the default). What cannot be read is a CorruptFile naming `path`."""
    try:
        top = _fields(model)
        trainer, normalizer = (_fields(b"".join(_values(top, number, LENGTH))) for number in (2, 3))
        model_type = ([1] + [v for v in _values(trainer, 3, VARINT) if v in MODEL_TYPES])[-1]
        coverage = ([None] + _values(trainer, 10, FIXED32))[-1]
        name = ([b""] + _values(normalizer, 1, LENGTH))[-1]
        return {"spm_type": MODEL_TYPES[model_type], "normalization": name.decode("utf-8", "replace"),
                "character_coverage": 0.9995 if coverage is None else _shortest_float32(coverage)}
    except (IndexError, ValueError, struct.error) as e:  # a model SentencePiece loaded, which this misreads
        raise CorruptFile(f"{path}: its training settings cannot be read ({e})") from None


def _shortest_float32(raw: bytes) -> float:
    """The float32 of 4 little-endian bytes as the shortest decimal that rounds to it (0.9995, not
    0.9994999766349792): as it was written in a configuration."""
    value = struct.unpack("<f", raw)[0]
    return next((float(f"{value:.{digits}g}") for digits in range(1, 10)
                 if struct.pack("<f", float(f"{value:.{digits}g}")) == raw), value)  # 9 digits always do


VARINT, FIXED64, LENGTH, START_GROUP, END_GROUP, FIXED32 = range(6)  # protobuf's wire types


def _values(fields: dict[int, list[tuple[int, int | bytes]]], number: int, wire: int) -> list:
    """The values of field `number` given with wire type `wire`, in their order."""
    return [value for their_wire, value in fields.get(number, ()) if their_wire == wire]


def _fields(proto: bytes) -> dict[int, list[tuple[int, int | bytes]]]:
    """A protobuf message's own fields (not those of messages inside them), by number, read from the wire
    format of a `proto` that parsed: each is a varint key (number << 3 | wire type), then its value, here a
    varint's integer, or the bytes of a string, a message, a fixed-size number or a group. Each field's
    values, with their wire type, in order: the last of a singular field's own wire type is its value, as
    protobuf reads it."""
    fields, at = {}, 0
    while at < len(proto):
        number, wire, start, at = _field(proto, at)
        value = _varint(proto, start)[0] if wire == VARINT else proto[start:at]
        fields.setdefault(number, []).append((wire, value))
    return fields


def _field_numbers(proto: bytes) -> set[int]:
    """The numbers of a message's own fields, as `_fields` reads them, without their values: `_load_spm`'s
    check reads every piece of a model (500,000 of them, a third of a second more a load sliced)."""
    numbers, at = set(), 0
    while at < len(proto):  # `_field`'s reading inline for the usual wire types: a call a piece cost 50%
        key, end = _varint(proto, at)
        wire = key & 7
        if wire == LENGTH:
            size, end = _varint(proto, end)
            at = end + size
        elif wire == VARINT:
            at = _varint(proto, end)[1]
        else:
            at = _field(proto, at)[3]
        numbers.add(key >> 3)
    return numbers


def _field(proto: bytes, at: int) -> tuple[int, int, int, int]:
    """The field at `proto[at]`: its number, wire type, where its value starts and where the next field
    begins."""
    key, start = _varint(proto, at)
    number, wire = key >> 3, key & 7
    if wire == VARINT:
        end = _varint(proto, start)[1]
    elif wire == LENGTH:  # a length, then as many bytes: a string or a message
        size, start = _varint(proto, start)
        end = start + size
    elif wire in (FIXED64, FIXED32):
        end = start + (8 if wire == FIXED64 else 4)
    elif wire == END_GROUP:  # a group's last field, without a value
        end = start
    elif wire == START_GROUP:  # SentencePiece writes none, but parses one: fields up to its END_GROUP
        end = start
        while (inner := _field(proto, end))[:2] != (number, END_GROUP):
            end = inner[3]
        end = inner[3]
    else:
        raise ValueError(f"wire type {wire} at byte {at}")
    if end > len(proto):
        raise ValueError(f"a field past the end at byte {at}")
    return number, wire, start, end


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The protobuf varint at `data[at]` (7 bits a byte, least significant first) and where the next
    field begins."""
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at

MAX_LINE_BYTES = 2**16  # longest line SentencePiece learns from; far past any data.max_len in tokens
CHILD = Path(__file__).with_name("spm_child.py")  # the process SentencePiece trains in
CHUNK_LINES = 1000  # lines sent to it at a time: held twice meanwhile (strings, pickle), 0.4 MB of WMT


def train_sentencepiece(
    lines: Iterable[str], prefix: str | Path, vocab_size: int, model_type: str = "bpe",
    character_coverage: float = 1.0, normalization: str = "nmt_nfkc",
) -> Path:
    """Train a SentencePiece model on every one of `lines` (`sentencepiece_model`); write `prefix`.model
    (`write_model`) and return its path."""
    path = Path(f"{prefix}.model")
    write_model(path, sentencepiece_model(lines, vocab_size, model_type, character_coverage, normalization))
    return path


def sentencepiece_model(
    lines: Iterable[str], vocab_size: int, model_type: str = "bpe", character_coverage: float = 1.0,
    normalization: str = "nmt_nfkc",
) -> bytes:
    """The bytes of a SentencePiece model trained on every one of `lines`. SentencePiece holds them all: a
    caller with more than SEED_SENTENCES samples them first, as `train_tokenizer` does. SentencePiece's own
    sampling (input_sentence_size) draws from a generator no seed reaches: two runs of one configuration
    trained different models.

    Ids are fixed: pad=0, bos=1, eos=2, unk=3, so that batches pad with 0. `hard_vocab_limit=False`
    lets a small corpus end with fewer pieces than asked instead of failing. `normalization` is the
    rule the model applies to text (SentencePiece's `normalization_rule_name`): "nmt_nfkc", its
    default, turns a zero-width non-joiner into a space; "nfkc" keeps it; "identity" keeps every
    character, though SentencePiece still writes a run of spaces as one and drops those at the ends of a
    line.

    It trains in a child process (spm_child.py), fed `lines` as they are read: its C++ held off a Ctrl-C
    here until it was done. Any exception here (KeyboardInterrupt, what reading `lines` raises, a CLI
    command's SIGTERM) kills the child at once; SentencePiece's refusal is a RuntimeError with its
    message, as its own call raised."""
    options = {
        "vocab_size": vocab_size, "model_type": model_type, "character_coverage": character_coverage,
        "normalization_rule_name": normalization, "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3,
        "hard_vocab_limit": False, "input_sentence_size": 0,  # 0: every line, no sample of SentencePiece's
        "max_sentence_length": MAX_LINE_BYTES,  # its default, 4,192, left longer lines out silently
        # Fixed, not train.threads or the machine's cores: a unigram model's pieces differ with the thread
        # count (12 of 2,000 on Multi30k at 1, 2 and 4), and one corpus must give one tokenizer everywhere
        # (an ensemble's members share it; the record of its inputs holds no thread count)
        "num_threads": 2, "minloglevel": 2,
    }
    # -I: none of the user's site or PYTHON* variables; the child takes this process's sys.path instead.
    # Its own session: a terminal's Ctrl-C reaches this process alone, which ends the child.
    child = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        _send(child.stdin, lines, options)
        reply = child.stdout.read()
        child.wait()
    finally:
        if child.returncode is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout):
            with contextlib.suppress(OSError):  # a stdin the child stopped reading: its unsent rest
                stream.close()
    return _model_of(reply, child.returncode)


def _send(stream: IO[bytes], lines: Iterable[str], options: dict) -> None:
    """`lines` and what to do with them, to spm_child.py; the lines as they are read, so that neither
    process holds them twice."""
    try:
        pickle.dump((sys.path, os.getpid(), options), stream)
        it = iter(lines)
        while chunk := list(islice(it, CHUNK_LINES)):
            pickle.dump(chunk, stream)
        pickle.dump(None, stream)  # the end: a child that reads no None trains nothing
        stream.close()
    except BrokenPipeError:  # it stopped reading: SentencePiece refused before the end, its reply says why
        pass


def _model_of(reply: bytes, status: int) -> bytes:
    if not reply:  # killed (out of memory?), or a Python error of its own, printed above
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        raise UserError(f"SentencePiece's training failed: its process ended ({how})")
    kind, value = pickle.loads(reply)
    if kind == "refused":
        raise RuntimeError(value)
    return value


def write_model(path: Path, model: bytes) -> None:
    """Write a SentencePiece model's bytes to `path` whole or not at all, and durably (`atomic_output`:
    flushed to disk before and after the rename; renamed unflushed, a power loss could leave an empty
    spm.model). An OSError is a UserError naming `path`; a killed writer's temporary is removed by the
    next run."""
    with atomic_output(path, binary=True) as f:
        f.write(model)
