"""Leftovers of killed writers: every temporary names its writer's process, and the next run removes
those whose writer is gone (a half-written encoded cache is hundreds of MB that nothing else deletes)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import aiayn.files as files
from aiayn.files import TEMPORARY, remove_abandoned, write_atomically

KILLED_WRITER = r"""
import os, signal, sys
from pathlib import Path
from aiayn.files import atomic_output, write_atomically
out = Path(sys.argv[1])
with atomic_output(out / "translation.txt") as f:
    f.write("half a transla")
    f.flush()
    def write(tmp):
        (tmp / "weights").write_bytes(b"0" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would, mid-write
    write_atomically(out / "step_000008", write)
"""


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped), so runs no more."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def temporary(directory: Path, target: str, writer: str, random: str = "") -> Path:
    """Where `writer` ("PID-MACHINE-START" as `files._writer` gives it; an older aiayn's "PID") writes
    `target` in `directory`: a fixed name, or tempfile's with 8 `random` characters."""
    return directory / f".{target}.aiayn-{writer}.{random + '.' if random else ''}tmp"


OTHER_MACHINE = "0123abcd"  # another machine's or container's `_machine`, as on a shared folder


def test_a_killed_writers_temporaries_are_named_and_removed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and all(TEMPORARY.fullmatch(n) for n in left), left  # nothing in place, both named
    assert {re.sub(r"\.aiayn-.*", "", n) for n in left} == {".translation.txt", ".step_000008"}
    assert sorted(p.name for p in remove_abandoned(tmp_path)) == left  # this machine's: its writer is gone
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_goes_only_once_its_writer_is_known_to_be_gone(tmp_path):
    """A live writer's temporary stays however long it sits unchanged (translate writes one at each chunk's
    end: an hour's silence had it deleted, all its work lost); another machine's or container's, whose
    process cannot be looked for here, stays for a week unchanged."""
    me = files._writer()
    live = temporary(tmp_path, "model.safetensors", me)
    dead = temporary(tmp_path, "model.safetensors", files._writer(dead_pid()))
    earlier = f"{os.getpid()}-{files._machine()}-{files._started(os.getpid()) - 1}"  # its id's last owner
    reused = temporary(tmp_path, "spm.model", earlier, "abcd1234")
    foreign = temporary(tmp_path, "out.txt", f"{dead_pid()}-{OTHER_MACHINE}-12345", "k2j4h5g6")
    older = temporary(tmp_path, "out.txt", str(dead_pid()))  # an older aiayn's: no machine named
    busy_dir = temporary(tmp_path, "step_000004", f"{dead_pid()}-{OTHER_MACHINE}-12345", "q9w8e7r6")
    user = [tmp_path / ".model.safetensors.tmp", tmp_path / "notes.123.tmp", tmp_path / ".bashrc",
            tmp_path / f".x.{dead_pid()}.tmp"]
    for p in (live, dead, reused, foreign, older, *user):
        p.write_text("x")
    busy_dir.mkdir()
    (busy_dir / "weights").write_text("x")
    for p in (live, foreign, older):
        age(p, 7200)
    assert sorted(remove_abandoned(tmp_path)) == sorted([dead, reused])
    week = files.UNCHECKABLE_SECONDS
    for p in (live, foreign, older, busy_dir, *user):
        age(p, week + 60)
    assert sorted(remove_abandoned(tmp_path)) == sorted([foreign, older])
    assert all(p.exists() for p in (live, busy_dir, *user))  # a file inside it changed just now
    age(busy_dir / "weights", week + 60)
    assert remove_abandoned(tmp_path) == [busy_dir] and live.exists()


def test_a_live_writers_temporary_outlives_a_write_beside_it(tmp_path):
    """`aiayn translate -o res/a.txt` between two chunks for over an hour: another command writing into
    res/ deleted its temporary, and it failed at the end with all its work lost."""
    from aiayn.files import atomic_output

    with atomic_output(tmp_path / "a.txt") as a:
        a.write("A's translation\n")
        (tmp,) = tmp_path.iterdir()
        age(tmp, 7200)
        with atomic_output(tmp_path / "b.txt") as b:
            b.write("B's\n")
        assert tmp.exists()
    assert (tmp_path / "a.txt").read_text() == "A's translation\n"


IN_A_CONTAINER = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
WAITING_WRITER = r"""
import sys
from pathlib import Path
from aiayn.files import atomic_output
with atomic_output(Path(sys.argv[1])) as f:
    f.write("A's translation\n")
    print("writing", flush=True)
    sys.stdin.readline()  # a chunk being translated
"""


def test_another_containers_live_writer_keeps_its_temporary(tmp_path):
    """Two containers (PID namespaces) sharing a folder: one's pid means nothing in the other, whose write
    beside it deleted its temporary as a dead process's."""
    if shutil.which("unshare") is None or subprocess.run([*IN_A_CONTAINER, "true"], check=False).returncode:
        pytest.skip("no unshare into a new PID namespace here")
    command = [*IN_A_CONTAINER, sys.executable, "-c", WAITING_WRITER, str(tmp_path / "a.txt")]
    writer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        (tmp,) = tmp_path.iterdir()
        assert TEMPORARY.fullmatch(tmp.name)["machine"] != files._machine()
        age(tmp, 7200)
        from aiayn.files import atomic_output

        with atomic_output(tmp_path / "b.txt") as b:
            b.write("B's\n")
        assert tmp.exists()
        writer.communicate("\n", timeout=60)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0 and (tmp_path / "a.txt").read_text() == "A's translation\n"


def test_a_directory_that_cannot_be_listed_is_no_error(tmp_path):
    assert remove_abandoned(tmp_path / "missing") == []


@pytest.mark.parametrize("pid", ["0", "-1"])
def test_a_process_group_id_is_no_writer(pid):
    assert not files._running(int(pid))


def test_a_lock_holder_removes_a_dead_writers_temporary_at_once(tmp_path):
    """In its own directory (a run's checkpoints/ and cache/) no one else writes: not another machine or
    container (a restarted one's namespace is new), nor the lock holder itself yet: a temporary of its own
    pid is a killed predecessor's (where a process's start cannot be read)."""
    dead = temporary(tmp_path, "model.safetensors", files._writer(dead_pid()))
    mine = temporary(tmp_path, "spm.model", f"{os.getpid()}-{files._machine()}-0")
    foreign = temporary(tmp_path, "spm.model", f"{os.getppid()}-{OTHER_MACHINE}-0")
    live = temporary(tmp_path, "spm.model", files._writer(os.getppid()))
    for p in (dead, mine, foreign, live):
        p.write_text("x")
    assert remove_abandoned(tmp_path) == [dead]
    assert sorted(remove_abandoned(tmp_path, locked=True)) == sorted([mine, foreign]) and live.exists()


def test_a_temporary_is_told_by_its_tag_and_pid():
    """8 random digits after the pid are not the pid; another program's hidden temporaries are not ours."""
    assert TEMPORARY.fullmatch(".step_000004.aiayn-4242.12345678.tmp")["pid"] == "4242"
    assert TEMPORARY.fullmatch(".a.2024.b.aiayn-17.tmp")["pid"] == "17"
    named = TEMPORARY.fullmatch(".a.2024.b.aiayn-17-0123abcd-99.12345678.tmp")
    assert (named["pid"], named["machine"], named["start"]) == ("17", "0123abcd", "99")
    assert TEMPORARY.fullmatch(".x.123456789.tmp") is None  # Go's os.CreateTemp(".x.*.tmp")
    assert TEMPORARY.fullmatch(".model.safetensors.4242.tmp") is None


@pytest.mark.parametrize("name", ["a" * 251 + ".txt", "ü" * 125 + ".txt"])
def test_an_output_of_the_longest_name_gets_a_temporary(tmp_path, name):
    """The temporary's name adds some 40 bytes to the output's: one of over 220 was 'File name too long'.
    Cut to fit, at a whole character (safetensors opens no name that is not UTF-8), it is still aiayn's."""
    from aiayn.files import atomic_output, temporary_path

    with atomic_output(tmp_path / name) as f:
        f.write("ok\n")
    directory = name[:-11]  # room for its ".NAME.aiayn-old" while it is replaced
    write_atomically(tmp_path / directory, lambda tmp: (tmp / "a").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, directory])
    tmp = temporary_path(tmp_path / name).name
    assert len(os.fsencode(tmp)) <= 255 and TEMPORARY.fullmatch(tmp) and tmp.encode().decode() == tmp


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_stop_python_dropped_is_raised_before_the_rename_and_the_old_output_stays(tmp_path, kind):
    """A Ctrl-C or SIGTERM whose exception Python dropped (raised in a weakref callback: the CLI records
    it) let the output replace the old one; it is raised at the rename instead, once."""
    from aiayn.files import atomic_output

    def write(text: str) -> None:
        if kind == "file":
            with atomic_output(tmp_path / "out") as f:
                f.write(text)
        else:
            write_atomically(tmp_path / "out", lambda tmp: (tmp / "a").write_text(text))

    write("old")
    files.record_dropped_stop(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write("new")
    read = (tmp_path / "out").read_text() if kind == "file" else (tmp_path / "out" / "a").read_text()
    assert read == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary
    write("new")  # raised once: the next write is as any
    read = (tmp_path / "out").read_text() if kind == "file" else (tmp_path / "out" / "a").read_text()
    assert read == "new"


def test_a_dropped_stop_is_said_as_the_stop_not_as_the_error_handled_where_it_came(capsys):
    """A SIGTERM Python dropped while an `except` recovered from an error kept that error as its context;
    raised at the command's end, the CLI took it for a SIGTERM on an error's way out and said the error
    (exit 2), recovered from, where the command was stopped (143)."""
    from aiayn.cli import _run
    from aiayn.errors import Terminated, UserError

    def command(args):
        try:
            raise UserError("meta.json: not JSON")  # a probe that falls back
        except UserError:
            try:
                raise Terminated(signal.SIGTERM)  # as the garbage collector's callback had it
            except Terminated as stop:
                files.record_dropped_stop(stop)
            if raised_in_handler:  # a write of the fallback's
                files.raise_dropped_stop()
        files.raise_dropped_stop()

    for raised_in_handler in (False, True):
        assert _run(SimpleNamespace(func=command, command="info")) == 128 + signal.SIGTERM
        assert capsys.readouterr().err == "aiayn: stopped by SIGTERM\n"


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_temporary_deleted_by_another_program_is_said_to_be(tmp_path, kind):
    """The rename then failed with a bare 'No such file or directory', which blamed nothing."""
    from aiayn.errors import UserError
    from aiayn.files import atomic_output

    def delete_temporaries():
        for p in tmp_path.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    deleted = (r"another program deleted its temporary \.out\.aiayn-[0-9a-f-]+\.[a-z0-9_]{8}\.tmp "
               "before it was complete")
    failed = "cannot write" if kind == "file" else "could not write checkpoint"
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'out'))}: {failed} \({deleted}\)$"):
        if kind == "file":
            with atomic_output(tmp_path / "out") as f:
                f.write("x")
                delete_temporaries()
        else:
            write_atomically(tmp_path / "out", lambda tmp: delete_temporaries())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("there", ["none", "earlier", "moved"])
def test_another_writer_of_the_same_output_at_once_is_said_to_be(tmp_path, monkeypatch, there):
    """Two `average -o OUT --force` at once: the loser's renames failed as a bare "Directory not empty" or
    "No such file or directory". Simulated: the other writer's output lands just before this one's (over
    none, or an earlier one), or it moves the earlier one aside just before this one does."""
    from aiayn.errors import UserError

    out, real = tmp_path / "out", os.rename
    if there != "none":
        write_atomically(out, lambda tmp: (tmp / "a").write_text("earlier"))

    def rename(src, dst):
        if there == "moved" and Path(src) == out:
            real(out, tmp_path / "other's")
        elif there != "moved" and Path(dst) == out and Path(src).name.endswith(".tmp"):
            out.mkdir()
            (out / "a").write_text("other")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(UserError, match=rf"^{re.escape(str(out))}: could not write checkpoint \(another "
                                        r"process wrote it at the same time\)$"):
        write_atomically(out, lambda tmp: (tmp / "a").write_text("mine"))
    assert (tmp_path / ("other's" if there == "moved" else "out") / "a").read_text() != "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_leftover_that_cannot_be_removed_is_said_to_be_not_another_writer(tmp_path, monkeypatch):
    """A user's `chmod a-w OUT`: the first replace could not empty its moved-aside copy, left as
    '.OUT.aiayn-old'; every later replace was refused as "another process wrote it at the same time"
    (the rename aside failed: "Directory not empty"). Simulated (tests may run as root, whom chmod does
    not stop): the copy's files cannot be unlinked."""
    from aiayn.errors import UserError

    out, real = tmp_path / "out", shutil.rmtree
    write_atomically(out, lambda tmp: (tmp / "a").write_text("first"))

    def rmtree(path, ignore_errors=False):
        if Path(path).name != ".out.aiayn-old":
            return real(path, ignore_errors=ignore_errors)
        if os.path.lexists(path) and not ignore_errors:
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    write_atomically(out, lambda tmp: (tmp / "a").write_text("second"))  # replaced; the copy stays
    assert (tmp_path / ".out.aiayn-old" / "a").read_text() == "first"
    said = r"\(cannot remove \.out\.aiayn-old, left by an earlier replace: Permission denied\)$"
    with pytest.raises(UserError, match=rf"^{re.escape(str(out))}: could not write checkpoint {said}"):
        write_atomically(out, lambda tmp: (tmp / "a").write_text("third"))
    assert (out / "a").read_text() == "second"
    assert sorted(os.listdir(tmp_path)) == [".out.aiayn-old", "out"]


def test_a_failure_after_the_rename_is_not_blamed_on_another_writer(tmp_path, monkeypatch):
    """The directory flushed after the rename: its failure (the parent deleted meanwhile) was said as
    "another process wrote it at the same time", the flag for the renames still set."""
    from aiayn.errors import UserError

    def fsync_dir(path):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(files, "fsync_dir", fsync_dir)
    with pytest.raises(UserError, match=r"out: could not write checkpoint \(No such file or directory\)$"):
        write_atomically(tmp_path / "out", lambda tmp: (tmp / "a").write_text("x"))


def test_without_exist_ok_an_output_that_came_meanwhile_is_refused(tmp_path):
    """`average -o OUT` without --force: an OUT there at the rename (another average's) was replaced."""
    from aiayn.errors import UserError

    out = tmp_path / "out"

    def write(tmp):
        out.mkdir()
        (out / "a").write_text("other")
        (tmp / "a").write_text("mine")

    with pytest.raises(UserError, match=rf"^{re.escape(str(out))}: already exists \(pass --force"):
        write_atomically(out, write, exist_ok=False)
    assert (out / "a").read_text() == "other" and sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(UserError, match="already exists"):  # and before the work
        write_atomically(out, lambda tmp: pytest.fail("written"), exist_ok=False)


def test_a_checkpoint_temporary_deleted_before_a_file_written_into_it_is_said_to_be(tmp_path):
    """The tokenizer writes its file into the checkpoint's temporary through atomic_output: the temporary
    deleted first, its 'out/spm.model: cannot write (No such file or directory)' blamed nothing."""
    from aiayn.errors import UserError
    from aiayn.files import atomic_output

    def write(tmp):
        shutil.rmtree(tmp)
        with atomic_output(tmp / "spm.model", binary=True) as f:
            f.write(b"x")

    deleted = r"another program deleted its temporary \.out\.aiayn-[0-9a-f-]+\.[a-z0-9_]{8}\.tmp"
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'out'))}: could not write checkpoint "
                                        rf"\({deleted} before it was complete\)$"):
        write_atomically(tmp_path / "out", write)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("aside", [".out.aiayn-old", ".out.old"])
def test_a_directory_left_moved_aside_is_put_back(tmp_path, aside):
    """A kill between the two renames of a replacement left only '.out.aiayn-old' (and the new one's
    temporary): the next write, or `recover_replaced`, puts the old one back; beside a complete one it is
    deleted. `recover_replaced`, for a run's checkpoints/ alone, recovers an older aiayn's '.out.old' too."""
    out = tmp_path / "out"
    write_atomically(out, lambda tmp: (tmp / "a").write_text("old"))
    os.rename(out, tmp_path / aside)
    files.recover_replaced(tmp_path)
    assert (out / "a").read_text() == "old" and not (tmp_path / aside).exists()
    shutil.copytree(out, tmp_path / aside)
    files.recover_replaced(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    if aside == ".out.aiayn-old":
        os.rename(out, tmp_path / aside)
        write_atomically(out, lambda tmp: (tmp / "a").write_text("new"))
        assert (out / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_users_own_dot_old_directory_beside_an_output_is_never_touched(tmp_path):
    """aiayn moved a replaced output aside as '.NAME.old' and put back or deleted any directory of that
    name: a user's backup `mv ct2 .ct2.old` was renamed back over the output (then 'already exists', and
    --force replaced the backup), and a '.ct2.old' beside an existing ct2 was deleted, even by a refusal."""
    from aiayn.errors import UserError
    from aiayn.files import check_output

    out, backup = tmp_path / "out", tmp_path / ".out.old"
    backup.mkdir()
    (backup / "notes.txt").write_text("precious")
    check_output(out, [], force=False)  # no output: the backup is not one
    write_atomically(out, lambda tmp: (tmp / "a").write_text("new"))
    with pytest.raises(UserError, match="already exists"):
        check_output(out, [], force=False)
    check_output(out, [], force=True)
    write_atomically(out, lambda tmp: (tmp / "a").write_text("newer"))
    assert (out / "a").read_text() == "newer" and (backup / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]


@pytest.mark.parametrize("name", [".", "", "sub/.."])
def test_an_output_directory_needs_a_name_of_its_own(tmp_path, monkeypatch, name):
    """`aiayn export CK . --force` (as the refusal without --force suggested) was a ValueError traceback."""
    from aiayn.errors import UserError
    from aiayn.files import check_output

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="names no directory of its own"):
        check_output(name, [], force=True)
    with pytest.raises(UserError, match="names no directory of its own"):
        write_atomically(Path(name), lambda tmp: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


@pytest.mark.parametrize("name", ["b" * 245, "c" * 256])
def test_an_output_directory_whose_name_leaves_no_room_to_replace_it_is_refused_first(tmp_path, name):
    """A valid name of 245 to 255 bytes failed after the work ('could not write checkpoint (File name too
    long)': its .NAME.aiayn-old did not fit), and one of 256 was an OSError traceback from exists()."""
    from aiayn.errors import UserError
    from aiayn.files import check_output

    refusal = (rf"an output directory's name of {len(name)} bytes is too long \(at most 244: a replaced one "
               r"is moved aside as \.NAME\.aiayn-old for a moment\)$")
    with pytest.raises(UserError, match=refusal):
        check_output(tmp_path / name, [], force=False)
    with pytest.raises(UserError, match=refusal):
        write_atomically(tmp_path / name, lambda tmp: (tmp / "a").write_text("x"))
    write_atomically(tmp_path / name[:244], lambda tmp: (tmp / "a").write_text("x"))
    write_atomically(tmp_path / name[:244], lambda tmp: (tmp / "a").write_text("y"))  # replaced: fits
    assert (tmp_path / name[:244] / "a").read_text() == "y"


def test_an_output_a_killed_writer_left_moved_aside_is_refused_as_any_existing_one(tmp_path, monkeypatch):
    """Put back from .out.aiayn-old by the write itself, after the guard had found no output: replaced without
    --force. The guard puts it back first and refuses it as any other."""
    from aiayn.errors import UserError
    from aiayn.files import check_output

    write_atomically(tmp_path / "out", lambda tmp: (tmp / "a").write_text("old"))
    os.rename(tmp_path / "out", tmp_path / ".out.aiayn-old")

    def refused(*args):  # a read-only parent: a PermissionError traceback
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(files.os, "rename", refused)
        with pytest.raises(UserError, match=r"out: cannot put back \.out\.aiayn-old, a killed writer's \(Op"):
            check_output(tmp_path / "out", [], force=False)
    with pytest.raises(UserError, match="already exists"):
        check_output(tmp_path / "out", [], force=False)
    assert (tmp_path / "out" / "a").read_text() == "old"


def test_a_file_name_too_long_is_one_line_in_every_command(tmp_path, capsys):
    """exists() and is_dir() let ENAMETOOLONG through: translate -o, plot -o, info with a name of 256
    bytes were OSError tracebacks."""
    from aiayn.cli import main

    long = tmp_path / ("f" * 256)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # a run's: its -o is checked
    for argv in (["info", str(long)], ["plot", str(tmp_path), "-o", f"{long}.png"]):
        assert main(argv) == 2
        err = capsys.readouterr().err  # the path whose check failed (plot: the .png/meta.json it looked for)
        assert err.startswith(f"aiayn: error: {long}") and err.endswith(": file name too long\n")
        assert err.count("\n") == 1
    split = tmp_path / ("f" * 256 + "\nb\udcff")  # its line feed split the line; its byte shown as \udcff
    assert main(["info", str(split)]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {tmp_path}/{'f' * 256}\\nb\\xff: file name too long\n"


def test_the_next_write_removes_a_killed_writers_leftover_beside_it(tmp_path):
    """A killed `average -o`, `export` or `translate -o` left its hidden temporary (for a big model,
    hundreds of MB) that only a training run ever swept, and only in its run directory."""
    from aiayn.files import atomic_output

    leftovers = [temporary(tmp_path, "avg", files._writer(dead_pid()), "zkmv1wbo"),
                 temporary(tmp_path, "out.txt", files._writer(dead_pid()))]
    leftovers[0].mkdir()
    (leftovers[0] / "model.safetensors").write_text("x")
    leftovers[1].write_text("x")
    for p in (leftovers[0] / "model.safetensors", *leftovers):
        age(p, 120)
    write_atomically(tmp_path / "avg", lambda d: (d / "meta.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg"]  # both swept by the first write beside them
    leftovers[1].write_text("x")
    age(leftovers[1], 120)
    with atomic_output(tmp_path / "out.txt") as f:
        f.write("ok\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg", "out.txt"]


@pytest.mark.parametrize("argv", [
    ["translate", "CK", "-o", ""], ["translate", "CK", "-i", ""], ["translate", ""], ["evaluate", "", "ref"],
    ["evaluate", "hyp", ""], ["average", ""], ["plot", "run", "-o", ""], ["attention", "--checkpoint", "",
    "--src", "x"], ["demo", "--out", ""], ["convert", "--from", "marian", "", "out"], ["info", ""],
    ["export", "--to", "ctranslate2", "CK", ""], ["train", "--config", ""],
    ["score", "CK", "--src", "", "--tgt", "t"], ["score", "CK", "--src", "s", "--tgt", "t", "-o", ""],
])
def test_an_empty_path_is_a_usage_error(argv, capsys):
    """`-o ""` said ": cannot write (No such file or directory)", `evaluate ""` ".: is a directory"."""
    from aiayn.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "invalid path value: ''" in capsys.readouterr().err


def test_an_output_folder_that_is_a_dangling_link_is_said_to_be_one(tmp_path):
    """`attention --out dang`, a link to nothing, was told it "exists and is not a directory"."""
    (tmp_path / "dang").symlink_to(tmp_path / "gone")
    said = f"^{tmp_path / 'dang'}: a symbolic link to {tmp_path / 'gone'}, which does not exist$"
    with pytest.raises(files.UserError, match=said):
        files.check_directory_path(tmp_path / "dang")
    (tmp_path / "file").write_text("x")
    with pytest.raises(files.UserError, match="file: exists and is not a directory$"):
        files.check_directory_path(tmp_path / "file")


def test_an_output_under_a_dangling_link_names_the_link(tmp_path):
    """`plot -o dang/c.png`, `attention --out dang/x`, `average -o dang/x`: "dang is not a directory" sent
    users to look for a file that is not there; the output's own link was said right already."""
    (tmp_path / "dang").symlink_to(tmp_path / "gone")
    said = f"{tmp_path / 'dang'} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    for out in (tmp_path / "dang" / "x", tmp_path / "dang" / "sub" / "x"):
        message = f"^{re.escape(str(out))}: {re.escape(said)}$"
        with pytest.raises(files.UserError, match=message):
            files.check_directory_path(out)
        with pytest.raises(files.UserError, match=message):
            files.check_output(out, [], force=False)
        with pytest.raises(files.UserError, match=message), files.directory_for(out.parent, out):
            pass
    assert not (tmp_path / "gone").exists()
    # a loop was "a symbolic link to loop, which does not exist"; a chain named its first link, which exists
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "mid").symlink_to(tmp_path / "nowhere" / "x")
    (tmp_path / "chain").symlink_to(tmp_path / "mid")
    for link, said in (("loop", "a loop of symbolic links"),
                       ("chain", f"a symbolic link to {tmp_path / 'nowhere' / 'x'}, which does not exist")):
        out = tmp_path / link / "x"
        with pytest.raises(files.UserError, match=f"^{re.escape(f'{out}: {tmp_path / link} is {said}')}$"):
            files.check_output(out, [], force=False)
        with pytest.raises(files.UserError, match=f"^{re.escape(f'{tmp_path / link}: {said}')}$"):
            files.check_directory_path(tmp_path / link)
