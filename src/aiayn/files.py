"""Writing outputs so that nothing is ever half written or lost: a file (`atomic_output`) or a directory
(`write_atomically`) is filled under a temporary name beside its target, flushed to disk, then renamed
into place, so a kill, a full disk or bad input leaves the old output as it was; `check_output` refuses
an output whose writing would delete an input. Checkpoints, exports, translations and pictures all go
through here; an OSError becomes a one-line `UserError` naming the output.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from safetensors import SafetensorError

from aiayn.errors import UserError

log = logging.getLogger(__name__)


# A stop that Python dropped: Ctrl-C's KeyboardInterrupt, or the CLI's `Terminated` for SIGTERM, raised by
# the signal's handler while the garbage collector ran a weakref callback or a __del__ (where matplotlib
# frees a drawn Figure), which Python prints as "Exception ignored in ..." and loses: `aiayn attention`
# ran on, replaced the previous maps and exited 0. The CLI records such a stop here (its
# `sys.unraisablehook`); the renames that put results in place raise it first, keeping what they replace.
_dropped_stops: list[BaseException] = []


def record_dropped_stop(stop: BaseException) -> None:
    """Keep `stop` (a KeyboardInterrupt or the CLI's Terminated) that Python dropped, for
    `raise_dropped_stop`."""
    _dropped_stops.append(stop)


def raise_dropped_stop() -> None:
    """Raise the stop Python dropped (`record_dropped_stop`), if there was one; once."""
    if _dropped_stops:
        stop = _dropped_stops[0]
        _dropped_stops.clear()
        # its traceback is the garbage collector's, no part of the command; `from None`: an error handled
        # where it came or where it is raised (an `except` that recovered) is none the command ends by, which
        # the CLI says of a SIGTERM on an error's way out (`__suppress_context__` marks it)
        raise stop.with_traceback(None) from None


def forget_dropped_stops() -> None:
    _dropped_stops.clear()


def fsync_file(path: Path) -> None:
    """Flush a file another writer (safetensors) wrote and closed to disk: renamed into place before its
    data is, a power loss can leave the name on a zero-length file."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def broken_link(path: Path) -> str | None:
    """Where the symbolic link `path` leads, said for a message, if it leads to nothing, else None: "a
    symbolic link to X, which does not exist", X the name at the end of a chain of links (the first link's
    target may be a link itself), or "a loop of symbolic links" (it said "a link to loop, which does not
    exist" of `ln -s loop loop`)."""
    if not path.is_symlink() or path.exists():
        return None
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a loop of symbolic links"
    return f"a symbolic link to {os.path.realpath(path)}, which does not exist"


def resolved(path: Path) -> Path:
    """`path.resolve()`, with a symlink loop on the way a one-line `UserError`: Python before 3.13 raised a
    RuntimeError for it, which no OSError handler caught, and 3.13 resolves it quietly (a write would
    then replace the link)."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path}: too many levels of symbolic links") from None
    except ValueError:  # a NUL in the name: the caller's own checks say so
        pass
    try:
        return path.resolve()
    except RuntimeError:
        raise UserError(f"{path}: too many levels of symbolic links") from None
    except OSError as e:
        raise UserError(f"{path}: {e.strerror or e}") from None


def require_file(path: Path, kind: str = "text", pipe: bool = False) -> None:
    """A UserError unless `path` is a regular file (or with `pipe`, a pipe: `--config <(...)`, read once),
    saying what it is instead: a corpus ("text") or a config file ("config")."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        if said := broken_link(path):  # "not found" sent the user looking for a file that is there, as a link
            raise UserError(f"{path}: {said}") from None
        raise UserError(f"{path}: {'' if kind == 'text' else kind + ' '}file not found") from None
    except OSError as e:  # a name too long (is_dir() let its error through: a traceback), a link loop
        raise UserError(f"{path}: {(e.strerror or str(e)).lower()}") from None
    except ValueError:  # a NUL in the name, which no file has
        raise UserError(f"{str(path)!r}: file not found (a NUL character in its name)") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{path}: is a directory, not a {kind} file")
    if not (stat.S_ISREG(mode) or (pipe and stat.S_ISFIFO(mode))):  # a device: reading may block or never end
        raise UserError(f"{path}: not a regular file")


def reads_stdin_once(path: str | Path) -> bool:
    """Whether reading `path` reads standard input where it can be read only once: "-", or another name
    (/dev/stdin, /proc/self/fd/0, a FIFO's path) of the pipe, FIFO or terminal it is. A regular file given
    as standard input is read anew by any of its names."""
    if str(path) == "-":
        return True
    if sys.stdin is None:  # started with it closed: fd 0 may be another file now
        return False
    try:
        stdin = os.fstat(sys.stdin.fileno())
        return not stat.S_ISREG(stdin.st_mode) and os.path.samestat(stdin, os.stat(path))
    except (OSError, ValueError, AttributeError):  # no such file; no descriptor behind stdin (a notebook's,
        return False  # a test's stand-in)


def overlap(out: Path, other: Path) -> str | None:
    """How `out` overlaps `other`: "is", "contains", "lies inside" or None (symlinks resolved)."""
    out, other = resolved(out), resolved(other)
    if out == other:
        return "is"
    if out in other.parents:
        return "contains"
    return "lies inside" if other in out.parents else None


@dataclass(frozen=True)
class OutputKind:
    """What a command writes as a directory, so that `--force` replaces an earlier one and nothing else:
    `what` names it, `test` finds one in a directory, `names` are the entries one may hold."""

    what: str
    test: Callable[[Path], bool]
    names: frozenset[str]


def check_not_inside(out: Path, kind: OutputKind) -> None:
    """Refuse an `out` inside an earlier output of `kind` (an export's model directory): a later --force
    of that model is refused as holding other files. Said before "already exists", which --force cannot
    mend."""
    for parent in Path(os.path.abspath(out)).parents:
        if kind.test(parent):
            raise UserError(f"{out}: lies inside {parent}, {kind.what}; export beside it")


def check_output(out: str | Path, inputs: list[Path], force: bool, enclosing: list[Path] | None = None,
                 earlier: OutputKind | None = None, forced: bool = True) -> None:
    """Refuse an output directory whose writing would lose data (the commands' guard, before any work).

    `out` may not be or contain any of `inputs`, nor replace something inside one, even with `force`
    (a new directory inside one deletes nothing, nor does an earlier output of `earlier`'s kind there that
    no link of the input leads into: `_own_earlier_output`); nor be or contain an `enclosing` directory (a run
    directory). An existing `out` is replaced only with `force`, only if it is a directory, never the
    current directory or one above it, and, with `earlier`, only if it is empty or holds an earlier
    output of that kind and nothing else: `convert ... RUN --force` replaced a whole training run, a live
    one too, `"$PWD" --force` the user's files, and `export ... --force` the SentencePiece models copied
    beside an earlier export. `forced`: whether `force` is the user's --force, as the refusals word it
    (False for an output the command replaces by itself: average's default, an earlier average).
    """
    out = Path(out)
    _check_named(out)
    try:  # an output a killed writer left moved aside is back, and judged as any other
        _recover_replaced(out)
    except OSError as e:  # a read-only parent: the write would fail the same way
        raise UserError(f"{out}: cannot put back {_old(out).name}, a killed writer's ({e.strerror or e})"
                        ) from None
    ancestor = next(p for p in out.absolute().parents if p.exists() or p.is_symlink())  # "/" is
    if not ancestor.is_dir():  # OUT under a file: a NotADirectoryError once the work was done
        raise UserError(f"{out}: {_no_directory(ancestor)}")
    exists = out.exists() or out.is_symlink()
    refused = [(p, ("is", "contains", "lies inside") if exists else ("is", "contains")) for p in inputs]
    refused += [(p, ("is", "contains")) for p in enclosing or []]
    for other, relations in refused:
        relation = overlap(out, Path(other))
        if relation == "lies inside" and _own_earlier_output(out, Path(other), earlier):
            continue  # replaced as an earlier output anywhere else is, by the rules below
        if relation in relations:  # inside: replacing it deletes part of the input's folder
            whole = "part of the input" if relation == "lies inside" else "the input"
            raise UserError(f"{out}: {relation} the input {other}; writing it would delete {whole}")
    if exists and out.is_symlink():  # replacing it would put a directory where the link was
        advice = " (name the directory it points to)" if out.is_dir() else ""
        raise UserError(f"{out}: is a symbolic link; will not replace it{advice}")
    if exists and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory; will not replace it")
    here = overlap(Path.cwd(), out) if exists else None  # "." was refused, "$PWD" was not
    if here in ("is", "lies inside"):
        raise UserError(f"{out}: {'is' if here == 'is' else 'contains'} the current directory; will not "
                        "replace it")
    # before "pass --force": a directory --force would not replace either was advised --force first
    if exists and earlier is not None:
        check_replaceable(out, earlier, forced=forced or not force)
    if exists and not force:
        raise already_exists(out)


class AlreadyExists(UserError):
    """`already_exists`'s refusal, told apart by its type (average's default output) and its `path`."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path}: already exists (pass --force, force=True in Python, to replace it)")
        self.path = Path(path)


def already_exists(out: Path) -> AlreadyExists:
    """The refusal of an existing `out` without --force: before the work (`check_output`), and at the write
    (`write_atomically` with exist_ok=False), where one that came meanwhile was replaced silently."""
    return AlreadyExists(out)


def _own_earlier_output(out: Path, source: Path, earlier: OutputKind | None) -> bool:
    """Whether `out`, inside the input directory `source`, is an earlier output of `earlier`'s kind that no
    link of the input leads into: replacing it deletes nothing of the input. `convert m m/out` wrote one,
    and `--force` again was refused as "would delete part of the input", of its own output."""
    if earlier is None or not out.is_dir() or out.is_symlink() or not earlier.test(out):
        return False
    inner = resolved(out)
    for root, dirs, names in os.walk(source):  # links are not followed, only checked for where they lead
        for link in (p for p in (Path(root, name) for name in dirs + names) if p.is_symlink()):
            target = Path(os.path.realpath(link))  # never raises: a loop leads nowhere
            if target == inner or inner in target.parents:
                return False
        dirs[:] = [d for d in dirs if Path(os.path.realpath(Path(root, d))) != inner]  # `out`'s are its own
    return True


def check_replaceable(out: Path, earlier: OutputKind, forced: bool = False) -> None:
    """Refuse to replace the directory `out` unless it is empty or holds an earlier output of `earlier`'s
    kind and nothing else (`check_output`'s last rule, and `save_checkpoint`'s own: a Python caller's
    `save_checkpoint("models", ...)` replaced a folder of other models)."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not earlier.test(out):
        raise UserError(f"{out}: holds files that are not {earlier.what}; will not replace it"
                        f"{', even with --force' if forced else ''} (delete it first if it should go)")
    others = sorted(p.name for p in out.iterdir() if p.name not in earlier.names)
    if others:
        named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        how = "--force replaces the whole directory" if forced else "replacing it would delete them"
        raise UserError(f"{out}: holds {named} beside {earlier.what}; {how}, so move them out first")


def check_file_output(out: str | Path, inputs: list[Path]) -> None:
    """Refuse, before any work, an output file that would replace one of `inputs` (a file, through any
    link) or lie inside one (a checkpoint directory, which training may replace or delete, and whose files
    it would overwrite). Any other file is fine: replacing an earlier output is what an output option is
    for."""
    out = Path(out)
    if _stream_only(out):  # /dev/stdout may be the terminal stdin reads too
        return
    for other in map(Path, inputs):
        if not other.exists():
            continue
        inside = other.is_dir() and overlap(out, other) == "lies inside"
        if inside and not out.exists():  # a new file destroys nothing there, but training may delete it whole
            raise UserError(f"{out}: lies inside the input {other}; write it elsewhere")
        if inside or (not other.is_dir() and out.exists() and os.path.samefile(out, other)):
            raise UserError(f"{out}: {'lies inside' if inside else 'is'} the input {other}; writing it "
                            "would destroy the input")


def check_not_read_back(inputs: list[str | None], out: str | None) -> None:
    """Refuse, before any work, writing to standard output (`out` None or "-", or a descriptor's name such
    as /dev/stdout, which `check_file_output` lets through) when it is a regular file among `inputs` (None
    or "-": standard input), as cat refuses "input file is output file": `translate CKPT -i f >> f` read
    its own translations back and appended them again, forever; `score --src e --tgt f >> f` read its
    scores as targets and blamed the line counts. A terminal or a pipe may be both."""
    stdout = out in (None, "-")
    if not stdout and not _stream_only(Path(out)):
        return
    written = _identity(sys.stdout if stdout else out)
    if written is None or not stat.S_ISREG(written.st_mode):
        return
    for path in inputs:
        stdin = path in (None, "-")
        if (read := _identity(sys.stdin if stdin else path)) and os.path.samestat(read, written):
            where = "standard output" if stdout else out
            raise UserError(f"{'<stdin>' if stdin else path}: input file is output file ({where} writes to "
                            "it); write the results elsewhere")


def _identity(file) -> os.stat_result | None:
    """The stat of a path or of an open stream's descriptor; None for a missing file, or a stream without
    a descriptor (closed at start, a notebook's, a test's stand-in)."""
    try:
        return os.stat(file) if isinstance(file, str) else os.fstat(file.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def _check_named(directory: Path) -> None:
    """An output directory must have a name of its own: "." or "" (the current directory) and "x/.." would
    be replaced by renaming a sibling over them, which cannot be done (it was a ValueError traceback)."""
    if directory.name in ("", ".."):
        raise UserError(f"{str(directory) or repr('')}: names no directory of its own (the current one or a "
                        "parent); give the output a new name")
    room = NAME_MAX - len(f".{MOVED_ASIDE}")  # `_old`'s name must fit too
    if (n := len(os.fsencode(directory.name))) > room:
        raise UserError(f"{directory}: an output directory's name of {n} bytes is too long (at most "
                        f"{room}: a replaced one is moved aside as .NAME{MOVED_ASIDE} for a moment)")


def check_directory_path(path: Path) -> None:
    """Refuse, before any work, a path that cannot become a directory: an existing non-directory, or a
    path under a file (its nearest existing ancestor is no directory). Creates nothing."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists() or p.is_symlink())  # "/" is
    if existing == path:  # "x: x is not a directory" said it twice
        if (link := broken_link(path)) is not None:  # "exists", of a link to nothing, misled
            raise UserError(f"{path}: {link}")
        if not existing.is_dir():
            raise UserError(f"{path}: exists and is not a directory")
    elif not existing.is_dir():
        raise UserError(f"{path}: {_no_directory(existing)}")


def _no_directory(path: Path) -> str:
    """Why `path`, which is there but no directory, cannot hold an output: a link to nothing was said to be
    "not a directory", which sent users to look at a file that is not there."""
    return f"{path} is {broken_link(path) or 'not a directory'}"


@contextlib.contextmanager
def directory_for(path: Path, where: Path) -> Iterator[None]:
    """`path` and its missing parents, made for writing `where` inside the block, and those made removed
    again if the block fails (a full disk left the new folders behind); an OSError making them is a
    UserError naming `where`, a file in the way named as such (mkdir said "File exists")."""
    try:
        made = _make_parents(path)
    except NotADirectoryError as e:
        raise UserError(f"{where}: {e.strerror}") from None
    except OSError as e:
        raise UserError(f"{where}: cannot make directory {e.filename or path} ({e.strerror or e})") from None
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise


def _make_parents(parent: Path) -> list[Path]:
    """Make `parent` and its missing ancestors; return those made, deepest last, to undo on failure."""
    missing = []
    while not parent.is_dir() and parent != parent.parent:
        if parent.exists() or parent.is_symlink():  # mkdir would say "File exists", which misleads
            raise NotADirectoryError(errno.ENOTDIR, _no_directory(parent))
        missing.append(parent)
        parent = parent.parent
    made: list[Path] = []
    try:
        for p in reversed(missing):
            p.mkdir()
            made.append(p)
    except BaseException:
        _remove_empty(made)
        raise
    return made


def _remove_empty(made: list[Path]) -> None:
    for p in reversed(made):
        with contextlib.suppress(OSError):
            p.rmdir()


# The name a replaced directory has for a moment: aiayn's own, as no user's backup is named (".NAME.old" was,
# and was put back over the output or deleted). An older aiayn's ".NAME.old" is recovered in a training
# run's checkpoints/ alone, where users put nothing; convert, average and export never touch it.
MOVED_ASIDE = ".aiayn-old"
MOVED_ASIDE_BEFORE = ".old"


def _old(directory: Path, suffix: str = MOVED_ASIDE) -> Path:
    """Where `_rename_into_place` moves the directory it replaces, for a moment."""
    return directory.with_name(f".{directory.name}{suffix}")


def _recover_replaced(directory: Path, suffix: str = MOVED_ASIDE) -> None:
    """A kill between `_rename_into_place`'s two renames left `directory` only as its moved-aside copy: put
    it back (the next write replaces it properly); beside a `directory` it is a leftover, deleted."""
    old = _old(directory, suffix)
    if not old.is_dir() or old.is_symlink():
        return
    if directory.exists() or directory.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(old, directory)
        log.info("%s: put back, where a killed writer had left it as %s", directory, old.name)


def moved_aside(directory: Path) -> Path | None:
    """Where a writer killed between `_rename_into_place`'s two renames left `directory`, which is then
    missing, else None. Readers name it and leave it: the next write of `directory` (a training run's
    start, for its checkpoints) puts it back, and a reader that renamed would be a second writer."""
    try:
        old = _old(directory)
        return None if os.path.lexists(directory) or old.is_symlink() or not old.is_dir() else old
    except (OSError, ValueError):  # a name too long, a NUL, "." (no name): nothing there
        return None


def recover_replaced(parent: Path) -> None:
    """`_recover_replaced` for every directory in `parent`, a training run's checkpoints/, that a kill left
    moved aside, an older aiayn's `.NAME.old` too."""
    with contextlib.suppress(OSError):
        for name in [entry.name for entry in parent.iterdir()]:  # listed first: recovering renames
            for suffix in (MOVED_ASIDE, MOVED_ASIDE_BEFORE):  # ".x.aiayn-old" does not end in ".old"
                if name.startswith(".") and name.endswith(suffix) and len(name) > len(suffix) + 1:
                    _recover_replaced(parent / name[1:-len(suffix)], suffix)


def _rename_into_place(tmp: Path, directory: Path, exist_ok: bool = True) -> None:
    """Rename `tmp` to `directory`; an existing one is moved aside first, put back if the rename fails, or
    refused (`already_exists`) unless `exist_ok`."""
    if not directory.exists():
        os.rename(tmp, directory)  # a non-empty directory come since fails it (ENOTEMPTY): not replaced
        return
    if not exist_ok:
        raise already_exists(directory)
    old = _old(directory)
    _remove_leftover(old)
    os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_leftover(old: Path) -> None:
    """Remove `old`, left by an earlier replace that could not delete it (a user's `chmod a-w OUT`: its
    files cannot be unlinked). Left there, it failed the rename aside as "Directory not empty", which was
    blamed on another writer at every later replace."""
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(old):
        try:
            shutil.rmtree(old)  # again, for its error
        except FileNotFoundError:  # another writer's removal of it
            pass
        except OSError as e:
            raise OSError(e.errno, f"cannot remove {old.name}, left by an earlier replace: {e.strerror or e}")


def write_atomically(directory: Path, write, what: str = "checkpoint", exist_ok: bool = True) -> None:
    """Call `write(tmp_dir)` to fill a temporary sibling of `directory`, then rename it into place.

    An existing `directory` is replaced (training re-saves a step), but never something that is not a
    directory, and not at all without `exist_ok`: then one there before the work or at the rename is
    refused (`already_exists`; one that came meanwhile was replaced). On any failure nothing is left
    behind: not the temporary, not the parents it made. An OSError, or safetensors' own error for one (a
    full disk), becomes a UserError naming `directory`.
    """
    directory = Path(directory)
    _check_named(directory)
    try:  # one look: another writer's renames made exists() and is_dir() disagree ("not a directory")
        mode = os.lstat(directory).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISDIR(mode):  # a link too
        raise UserError(f"{directory}: exists and is not a directory; will not replace it")
    made: list[Path] = []
    tmp = None
    renaming = False  # while `directory` itself is renamed, as another writer of it may rename it too
    try:
        made = _make_parents(directory.parent)
        renaming = True
        _recover_replaced(directory)
        renaming = False
        if not exist_ok and os.path.lexists(directory):  # before the work, which the rename would refuse
            raise already_exists(directory)
        remove_abandoned(directory.parent)  # a killed writer's leftovers there (average, convert, export)
        tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(directory), suffix=".tmp", dir=directory.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a checkpoint is as readable as any directory
        write(tmp)
        mode = new_file_mode()  # read once: reading the umask sets it for a moment
        for f in tmp.iterdir():  # flush every file before the rename makes them visible
            if f.is_file():
                # safetensors writes its files 0600 whatever the umask: other users of a shared run
                # could list the checkpoint but not read its weights
                os.chmod(f, mode)
                fsync_file(f)
        raise_dropped_stop()  # a Ctrl-C or SIGTERM dropped meanwhile: the old directory stays
        renaming = True
        _rename_into_place(tmp, directory, exist_ok)
        renaming = False  # a failing fsync_dir below is no other writer's doing
        tmp = None  # in place: not to be removed, nor missed
        fsync_dir(directory.parent)
    except BaseException as e:
        gone = _deleted_meanwhile(tmp, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        if isinstance(e, (OSError, SafetensorError)) or gone:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
            reason = gone or (_COLLIDED if renaming and _collided(e) else reason)
            raise UserError(f"{directory}: could not write {what} ({reason})") from None
        if isinstance(e, UserError) and tmp is not None and str(tmp) in str(e):
            # a file written inside through `atomic_output` (the tokenizer's) named the temporary, gone now
            raise type(e)(str(e).replace(str(tmp), str(directory))) from None
        raise


@contextlib.contextmanager
def atomic_output(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """A UTF-8 text file (bytes with `binary`) that appears at `path` only once complete: written to a temporary sibling,
    flushed to disk, then renamed over `path` (over the file a symlink points to, keeping the link;
    with the old file's permissions, or those `open(path, "w")` would give a new one), the directory
    flushed after the rename as `write_atomically` does. If anything fails on the way (bad
    input, a full disk, Ctrl-C), `path` keeps whatever it held before. A path that is no regular file
    (a FIFO) or names a file descriptor (/dev/stdout, which the shell may have opened for appending)
    is written as it is. An OSError becomes a `UserError` naming `path`."""
    tmp = None
    try:
        if _stream_only(Path(path)):  # appending: reopening /dev/stdout with "w" would truncate a `>>` file
            with open(path, "ab" if binary else "a", encoding=None if binary else "utf-8") as f:
                yield f
            return
        target = resolved(Path(path))
        remove_abandoned(target.parent)  # a killed writer's leftovers there (translate -o: only training swept)
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=".tmp", dir=target.parent)
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode) if target.exists() else new_file_mode())
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        raise_dropped_stop()  # a Ctrl-C or SIGTERM dropped meanwhile: the old file stays
        os.replace(tmp, target)
        tmp = None  # in place: not to be removed, nor missed
        fsync_dir(target.parent)  # the rename too, as `write_atomically` does
    except BaseException as e:
        gone = _deleted_meanwhile(tmp, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, BrokenPipeError):
            raise UserError(f"{path}: cannot write ({gone or e.strerror or e})") from None
        raise


_COLLIDED = "another process wrote it at the same time"


def _collided(e: BaseException) -> bool:
    """Whether renaming into place failed because another writer of the same directory renamed it, or its
    moved-aside copy, at the same moment (two `average -o OUT`): the error said only "Directory not empty"
    or "No such file or directory"."""
    return isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT)


def _deleted_meanwhile(tmp: str | Path | None, e: BaseException) -> str | None:
    """Why writing failed if another program deleted the temporary `tmp` meanwhile: the rename then said only
    "No such file or directory", which named nothing of it (a UserError: a file written into a deleted
    checkpoint's temporary through `atomic_output`, the tokenizer's)."""
    if tmp is None or not isinstance(e, (OSError, SafetensorError, UserError)) or os.path.lexists(tmp):
        return None
    return f"another program deleted its temporary {Path(tmp).name} before it was complete"


def _stream_only(path: Path) -> bool:
    """Whether `path` is a device, a FIFO, a socket or a descriptor's name: nothing to rename over."""
    return path.absolute().parts[1:2] in (("dev",), ("proc",)) or (path.exists() and not path.is_file())


def new_file_mode() -> int:
    """The permissions `open(path, "w")` gives a new file: for files that another writer (safetensors:
    0600) would make readable by their owner alone."""
    return 0o666 & ~_umask()


# A temporary whose writer cannot be checked from here (another machine's or container's on a shared folder,
# or an older aiayn's, which named no machine) goes only once unchanged this long. A live writer adds to it
# at least once a chunk (translate's 10,000 lines: minutes, hours on a slow CPU), never pausing for a week;
# and once a killed writer's machine or container restarts, nothing else would ever tell its leftovers gone.
UNCHECKABLE_SECONDS = 7 * 24 * 3600.0
NAME_MAX = 255  # bytes in a file name (ext4, XFS, btrfs, NFS, APFS)


def temporary_prefix(target: Path) -> str:
    """The start of the name of a temporary that becomes `target` when renamed: hidden, and naming its
    writer (`_writer`), so that `remove_abandoned` can tell a killed writer's leftovers. `target`'s name is
    cut to leave room for the rest (a name of 230 bytes made one too long to create)."""
    tag = f".aiayn-{_writer()}."
    room = NAME_MAX - len(os.fsencode(tag)) - len(".") - len("12345678.tmp")  # tempfile's random part
    name = Path(target).name
    while len(os.fsencode(name)) > room:  # whole characters: a UTF-8 name stays UTF-8 (safetensors needs it)
        name = name[:-1]
    return f".{name}{tag}"


def temporary_path(target: Path) -> Path:
    """A fixed temporary name for one writer's `target` (its pid makes it unique), renamed over it once
    written."""
    return target.with_name(f"{temporary_prefix(target)}tmp")


# What `temporary_prefix` starts: a file or directory of tempfile's (8 random characters, then .tmp), or
# a fixed name of one writer's (".tmp" alone). Tagged, so that no other program's temporaries match (Go's
# os.CreateTemp(".x.*.tmp") makes ".x.123456789.tmp"); the name before the tag is the shortest that fits,
# so that 8 random digits are never read as the pid. An older aiayn's names hold the pid alone.
TEMPORARY = re.compile(r"\..+?\.aiayn-(?P<pid>[0-9]+)(?:-(?P<machine>[0-9a-f]{8})-(?P<start>[0-9]+))?"
                       r"\.(?:[a-z0-9_]{8}\.)?tmp")


def _writer(pid: int | None = None) -> str:
    """Who writes a temporary, for its name: "PID-MACHINE-START", the process's id (this one's by default),
    the `_machine` where that id names it, and when it started (`_started`: a later process given the same
    id is another)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_machine()}-{_started(pid)}"


def _machine() -> str:
    """8 hex digits for where a process id names one process: this machine (its host name), this boot of it
    (/proc's boot_id: a reboot reuses ids), this PID namespace (a container's ids count from 1 again) and
    the time namespace `_started` counts in. Another machine's or container's temporary on a shared folder
    (NFS, a Docker volume) never matches, so its writer is never looked for among this one's processes."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid", "/proc/self/ns/time"):
        try:
            parts.append(os.readlink(path) if "/ns/" in path else Path(path).read_text().strip())
        except OSError:  # not Linux, or a kernel before time namespaces (5.6)
            parts.append("")
    return hashlib.sha256("\n".join(parts).encode(errors="surrogateescape")).hexdigest()[:8]


def _started(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field); 0 where that
    cannot be read (not Linux, another user's process under hidepid) or where /proc shows another PID
    namespace than this process's (its PID there may be another process)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return 0
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read()
        return int(fields[fields.rindex(b")") + 2:].split()[19])  # after the name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return 0


def remove_abandoned(directory: Path, locked: bool = False) -> list[Path]:
    """Delete aiayn's temporaries in `directory` (files, or directories and what they hold: names that
    fullmatch TEMPORARY) whose writer is gone: a SIGKILL leaves them, and nothing else would ever remove
    them. One written here (on this machine, in this PID namespace: `_machine`) goes once its process runs
    no more or another runs under its id (a later start); a live writer's stays however long it sits
    unchanged, as translate's does between chunks. One whose writer cannot be checked from here (another
    machine's or container's, or an older aiayn's) goes once nothing in it changed for UNCHECKABLE_SECONDS,
    or at once where the caller holds the directory's lock (`locked`: a run's checkpoints/ and cache/, which
    no one else writes), as does one of the caller's own pid there. Logged; a failure to list or delete is
    ignored, as leftovers are no reason to stop the caller."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    now, here = time.time(), _machine()
    removed = []
    for path in entries:
        match = TEMPORARY.fullmatch(path.name)
        if match is None or not _abandoned(path, match, here, now, locked):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        if not (path.exists() or path.is_symlink()):
            log.info("%s: removed, a temporary left by a killed process", path)
            removed.append(path)
    return removed


def _abandoned(path: Path, match: re.Match, here: str, now: float, locked: bool) -> bool:
    pid = int(match["pid"])
    if match["machine"] == here:  # its pid is one of this machine's processes, or was
        start, started = int(match["start"]), _started(pid)  # 0 where unknown: the pid alone tells then
        reused = 0 not in (start, started) and start != started  # the writer's id given to a later process
        # Under the lock the caller writes nothing yet: its own pid is a killed predecessor's
        return not _running(pid) or reused or (locked and pid == os.getpid())
    if locked:  # no one else writes there: a restarted container (a new namespace) finds its own leftovers
        return True
    try:
        return now - _last_change(path) > UNCHECKABLE_SECONDS
    except OSError:  # gone meanwhile: its writer renamed it into place
        return False


def _last_change(path: Path) -> float:
    """The newest mtime of `path` and, for a directory, of what it holds (a file being written there)."""
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                times.append(entry.stat(follow_symlinks=False).st_mtime)
    return max(times)


def _running(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (perhaps another user's, which signal 0 may not reach)."""
    if pid <= 0:  # 0 and negative numbers signal process groups: no process writes under such a name
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)  # reading it means setting it
    os.umask(mask)
    return mask
