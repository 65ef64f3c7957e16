"""Plain-text lines: a UTF-8 file (or stream) read and checked, as training, `aiayn score` and `aiayn
evaluate` read them, and the same checks for text read a line at a time (`aiayn translate`).

Reading checks what users get wrong (bytes that are not UTF-8 or that no text holds, classic Mac line
ends, CRs inside lines, line counts that differ) and names the file and the line. Apart from `dataset`
so that scoring (`aiayn evaluate`) reads its files without importing torch or SentencePiece (2.2 s
before its first line was read, where sacreBLEU's own command takes 0.14 s).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import re
import shlex
import stat
import unicodedata
import weakref
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import BinaryIO

from aiayn.errors import UserError
from aiayn.files import require_file

log = logging.getLogger(__name__)


def read_lines(path: str | Path, stream: BinaryIO | None = None, done: str = "read") -> list[str]:
    """The lines of a UTF-8 file, without line ends or a leading byte order mark; invalid UTF-8, a NUL
    byte or CR-only line ends are a UserError naming the file (and the bad line). With `stream` (standard
    input), its lines, checked the same way and named `path` in errors. CRs inside lines are warned about
    once a file, saying what is `done` with the lines ("scored": see `InnerCRs.warn`)."""
    return list(chain.from_iterable(line_blocks(Path(path), stream, done)))


READ_BLOCK = 1 << 22  # bytes read at once (4 MiB): memory stays the lines kept, not 3x the file
# What a file that is not UTF-8 text often is, by its first bytes: said after "invalid UTF-8".
SIGNATURES = (
    (b"\x1f\x8b", "gzip-compressed; decompress it first (gunzip)"),
    (b"BZh", "bzip2-compressed; decompress it first (bunzip2)"),
    (b"\xfd7zXZ\x00", "xz-compressed; decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed; decompress it first (unzstd)"),
    (b"PK\x03\x04", "like a zip archive; extract it first (unzip)"),
    # UTF-32's byte order marks before UTF-16's, which begin the same way
    (b"\xff\xfe\x00\x00", "like UTF-32; convert it to UTF-8 (iconv -f UTF-32 -t UTF-8)"),
    (b"\x00\x00\xfe\xff", "like UTF-32; convert it to UTF-8 (iconv -f UTF-32 -t UTF-8)"),
    (b"\xff\xfe", "like UTF-16; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),  # its byte order marks
    (b"\xfe\xff", "like UTF-16; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
)


def line_blocks(path: Path, stream: BinaryIO | None = None, done: str | None = "read") -> Iterator[list[str]]:
    """The lines of `path` (or of `stream`, named `path`), as `read_lines`, a block at a time. Invalid
    UTF-8 raises where it is; a NUL byte or CR-only line ends raise after the last block, so that the error
    is the one the whole file decoded at once gave (invalid UTF-8 anywhere before a NUL byte anywhere), but
    for a line with a NUL that runs on past a read: the reading stops there (`_blocks`)."""
    if stream is None:
        require_file(path)
    newlines, lone_crs, nul, head, last, inner_crs = 0, 0, None, b"", b"", InnerCRs()
    for n, block in enumerate(_blocks(path, stream)):
        head = block[:HEAD_BYTES] if n == 0 else head
        text = _decode(path, block, newlines, head)
        if nul is None and (at := block.find(b"\0")) >= 0:  # valid UTF-8, but no text has it
            nul = newlines + block.count(b"\n", 0, at) + 1
        inner_crs.add(block, newlines + 1)
        lone_crs += lone_cr_count(block)  # a block ends after an LF: no CRLF is cut
        newlines += block.count(b"\n")
        # Notepad's BOM would stay glued to the first word (a hypothesis scored 99.84 BLEU against itself);
        # SentencePiece drops it from training text anyway.
        yield _split_lines(text.removeprefix("\ufeff") if n == 0 else text)
        last = block
    if nul is not None:
        raise nul_byte(f"{path}:{nul}", head)
    if not newlines and cr_only(last):  # else one line, refused later by SentencePiece
        raise cr_only_error(path)
    if newlines and lone_crs > newlines:  # CR line ends, an LF at the end: read as one line, silently
        raise cr_only_error(path, newlines, lone_crs)
    # fewer CRs alone than LFs: a stray CR in a sentence, or another system's line ends running lines together
    if done is not None:  # None: a check alone, before the reading that says it (recipes' --ensemble)
        inner_crs.warn(path, path if stream is None else stream, done)


def cr_only(text: bytes) -> bool:
    """Whether `text`, all of a file that holds no LF, has CR line ends: read as one line."""
    return b"\r" in text.rstrip(b"\r")


INNER_CR = re.compile(rb"\r(?=[^\r\n])")  # a CR with text after it, in a line (CRs at its end are dropped)


class InnerCRs:
    """CRs inside lines (`INNER_CR`) counted over an input read in pieces, then warned about (`warn`) once
    an input: the one count and warning of training, translate, score and evaluate."""

    def __init__(self) -> None:
        self.count = 0  # CRs with text after them in a line
        self.first_line = 0  # the first line (from 1) that has one; 0 while none has

    def add(self, text: bytes, line: int) -> None:
        """Count the CRs inside the lines of `text`: whole lines of the input, the first of them `line`."""
        if b"\r" in text and (first := INNER_CR.search(text)):  # memchr first: most text has no CR
            self.first_line = self.first_line or line + text.count(b"\n", 0, first.start())
            self.count += len(INNER_CR.findall(text, first.start()))

    def warn(self, name: str | Path, source: Path | BinaryIO, done: str) -> None:
        """Warn of the CRs counted, if any, in `source` (a file's path or the stream read), named `name`,
        whose lines are `done`: "read" (training), "translated", "scored"; unless `source` was warned about
        already (`_first_cr_warning`). What a CR becomes is not said: a space to SentencePiece's nmt_nfkc
        (aiayn's default, OPUS-MT's), an unknown character to nfkc and identity; either way, two sentences
        that a CR separated are one line."""
        if self.count and _first_cr_warning(source):
            log.warning("%s:%d: %d CR(s) inside lines; lines end at LFs only, so where a CR ended a line, "
                        "two sentences are %s as one", name, self.first_line, self.count, done)


# The inputs warned of CRs inside lines. A regular file counts once as it is, by (device, inode, size,
# modification time), whatever path or stream read it: a file read twice (checked, then translated; read
# again every epoch) or named twice (`aiayn score --src f --tgt f`, `aiayn evaluate f f`) is said once,
# while one changed since (edited with a CR left, or another file written to the same path) is said again,
# where a set of path strings kept a long-lived process silent about it for good. Any other stream (a pipe,
# standard input, a BytesIO) is read once, so counts by identity (weakly held: no stream kept alive). The
# CLI forgets both at each command (`forget_cr_warnings`): each command says it once a file, run in one
# process or several.
_CR_WARNED_FILES: set[tuple[int, int, int, int] | str] = set()
_CR_WARNED_STREAMS: weakref.WeakSet[BinaryIO] = weakref.WeakSet()


def _first_cr_warning(source: Path | BinaryIO) -> bool:
    """Whether `source` has not been warned of CRs inside lines (see above), noting that it now is."""
    try:
        info = os.stat(source) if isinstance(source, Path) else os.fstat(source.fileno())
    except (AttributeError, OSError, ValueError):  # gone since; no descriptor (BytesIO: UnsupportedOperation)
        info = None
    if info is not None and stat.S_ISREG(info.st_mode):
        key: tuple[int, int, int, int] | str = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    elif isinstance(source, Path):
        key = str(source)
    else:
        seen = source in _CR_WARNED_STREAMS
        _CR_WARNED_STREAMS.add(source)
        return not seen
    seen = key in _CR_WARNED_FILES
    _CR_WARNED_FILES.add(key)
    return not seen


def forget_cr_warnings() -> None:
    """Warn of CRs inside lines again, of inputs warned about before: the start of a CLI command."""
    _CR_WARNED_FILES.clear()
    _CR_WARNED_STREAMS.clear()


def lone_cr_count(text: bytes) -> int:
    """CRs not before an LF in `text`: line ends of a classic Mac file where they outnumber the LFs."""
    return text.count(b"\r") - text.count(b"\r\n")


def cr_only_error(path: Path | str, lfs: int = 0, lone_crs: int = 0) -> UserError:
    """The error for a file of CR line ends: with no LF (`lfs` 0), or with more CRs alone (not before an
    LF) than LFs. The way to convert it is a command that runs: standard input has no name to give tr."""
    ends = "no LF (a classic Mac OS file?), so it reads as one line"
    if lfs:
        ends = f"more CRs alone than LFs ({lone_crs} to {lfs}; a classic Mac OS file?), so lines run together"
    convert = f"tr '\\r' '\\n' < {shlex.quote(str(path))} > {shlex.quote(f'{path}.lf')}"
    try:  # /dev/stdin, /dev/fd/63 of <(...): no file beside them to write the converted text to
        stream = str(path).startswith(("<stdin>", "/dev/", "/proc/"))
        named = not stream and stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):  # a name given to this function alone (a test's): taken as a file's
        named = str(path) != "<stdin>"
    if not named:
        convert = "pipe it through tr '\\r' '\\n' before aiayn"
    return UserError(f"{path}: CR line ends and {ends}; convert it, e.g. {convert}")


# of a file's start, which `looks_like` reads: 128 UTF-16 characters, 3 lines of Chinese in one without a
# byte order mark (64 bytes held none of a line of 32 characters, whose newline was its only ASCII)
HEAD_BYTES = 256


def looks_like(head: bytes) -> str:
    """What a file that starts with `head` (its first HEAD_BYTES) looks like, if a known other format, to
    follow "invalid UTF-8" or "NUL byte"."""
    if what := next((f"; the file looks {what}" for magic, what in SIGNATURES if head.startswith(magic)), ""):
        return what
    # UTF-16 without a byte order mark (as some Windows tools write it), which read as UTF-8 was a bare "NUL
    # byte", or "invalid UTF-8" for an ß
    for order in ("LE", "BE"):
        if _reads_as_utf16(head, order):
            return (f"; the file looks like UTF-16 without a byte order mark; convert it to UTF-8 "
                    f"(iconv -f UTF-16{order} -t UTF-8)")
    return ""


# What binary data read as UTF-16 shows and text does not: control characters (U+0000 too), unassigned code
# points, private use, lone surrogates
BINARY_CATEGORIES = frozenset({"Cc", "Cn", "Co", "Cs"})


def _reads_as_utf16(head: bytes, order: str) -> bool:
    """Whether `head` is text in UTF-16 of byte `order` ("LE", "BE"): every character one text has, in any
    script (a NUL as every high byte, once the test, held for Latin text alone: Cyrillic, Greek or Chinese
    was a bare "NUL byte"), and two ASCII ones at least (a newline, a space, a digit: each a NUL byte). UTF-8
    text with a stray NUL has one; binary data has control, unassigned or private-use characters, U+0000."""
    try:  # incremental: a character cut at the end of `head` is no error
        text = codecs.getincrementaldecoder(f"utf-16-{order.lower()}")().decode(head)
    except UnicodeDecodeError:  # a lone surrogate
        return False
    # not isprintable(): it refuses every space but U+0020 (French's no-break spaces, U+2028)
    return sum(c < "\x80" for c in text) >= 2 and all(
        c in "\t\n\r" or unicodedata.category(c) not in BINARY_CATEGORIES for c in text)


def _blocks(path: Path, stream: BinaryIO | None = None) -> Iterator[bytes]:
    """`path`'s (or `stream`'s) bytes in blocks of about READ_BLOCK that end at a line end (all but perhaps
    the last): no line is cut, nor a UTF-8 character, since b"\\n" is never part of one. A line that holds
    a NUL byte and runs on past a whole read is the last block, all that was read of it but a character
    cut at its end (`whole_characters`: invalid UTF-8 after the NUL is still named first): it is refused
    whatever follows, and a stream of NULs (/dev/zero, a disk image) may never end it (held, it was read
    whole: 3.4 GB for a file of 1 GB; from /dev/zero, memory without bound)."""
    try:
        with open(path, "rb") if stream is None else contextlib.nullcontext(stream) as f:
            pending: list[bytes] = []  # read, but no line end yet
            nul = False  # whether `pending` holds a NUL byte
            while piece := f.read(READ_BLOCK):
                cut = piece.rfind(b"\n") + 1
                if cut:
                    yield b"".join([*pending, piece[:cut]])
                    pending, nul = [piece[cut:]], piece.find(b"\0", cut) >= 0
                    continue
                pending.append(piece)
                if nul or b"\0" in piece:
                    yield whole_characters(b"".join(pending))
                    return
            if rest := b"".join(pending):
                yield rest
    except OSError as e:  # unreadable (permissions, I/O error): still one line naming the file
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None


def whole_characters(data: bytes) -> bytes:
    """`data` less a UTF-8 character cut at its end (its first 1-3 bytes, where a read stopped), so that
    what is decoded of a line read in part is invalid only where the input is."""
    tail = data[-3:].lstrip(bytes(range(0x80, 0xC0)))  # from the last character's first byte (the bytes
    decoder = codecs.getincrementaldecoder("utf-8")()  # before it end an earlier one, or are invalid)
    try:
        decoder.decode(tail)
    except UnicodeDecodeError:  # invalid, not cut: it stays to be named
        return data
    return data[: len(data) - len(decoder.getstate()[0])]


def _decode(path: Path, block: bytes, newlines_before: int, head: bytes) -> str:
    """`block` as text, or a UserError naming the line of its first invalid byte and, from the file's first
    bytes `head`, what the file looks like if it is a known other format."""
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError as e:
        line = newlines_before + block.count(b"\n", 0, e.start) + 1
        raise invalid_utf8(f"{path}:{line}", block[e.start], head) from None


def invalid_utf8(where: str, byte: int, head: bytes) -> UserError:
    """The error of a line (`where`: FILE:LINE) that is no UTF-8 at `byte`, and what the file looks like
    from its first bytes `head`."""
    return UserError(f"{where}: invalid UTF-8 (byte {byte:#04x}){looks_like(head)}")


def nul_byte(where: str, head: bytes) -> UserError:
    """The error of a line (`where`: FILE:LINE) of valid UTF-8 with a NUL byte, which no text has."""
    return UserError(f"{where}: NUL byte (binary or corrupt input?){looks_like(head)}")


def decode_utf8(path: Path | str, data: bytes) -> str:
    """All of a small file's bytes `data` as text (a config), or the UserError `read_lines` gives: the line
    of the first invalid byte, and what the file looks like (UTF-16, gzip) if a known other format."""
    text = _decode(Path(path), data, 0, data[:HEAD_BYTES])
    if (nul := text.find("\0")) >= 0:  # valid UTF-8, as ASCII in UTF-16 without a byte order mark is
        line = text.count("\n", 0, nul) + 1
        raise nul_byte(f"{path}:{line}", data[:HEAD_BYTES])
    return text


def _split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start a new one
    return [line.rstrip("\r") for line in lines] if "\r" in text else lines


def require_same_count(src_path: str | Path, n_src: int, tgt_path: str | Path, n_tgt: int) -> None:
    """A UserError where a source file's line count is not its target file's (training's, score's)."""
    if n_src != n_tgt:  # named at the first line the other file lacks
        longer = src_path if n_src > n_tgt else tgt_path
        raise UserError(
            f"{longer}:{min(n_src, n_tgt) + 1}: line counts differ: "
            f"{src_path} has {n_src} line{'s' * (n_src != 1)}, {tgt_path} has {n_tgt}"
        )
