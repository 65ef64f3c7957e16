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


def test_a_killed_writers_temporaries_are_named_and_removed(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and all(TEMPORARY.fullmatch(n) for n in left), left  # nothing in place, both named
    assert {re.sub(r"\.aiayn-[0-9]+\..*", "", n) for n in left} == {".translation.txt", ".step_000008"}
    assert remove_abandoned(tmp_path) == []  # within a minute of its last write: perhaps another machine's
    monkeypatch.setattr(files, "DEAD_WRITER_SECONDS", 0.0)
    assert sorted(p.name for p in remove_abandoned(tmp_path)) == left
    assert list(tmp_path.iterdir()) == []


def test_only_abandoned_temporaries_go(tmp_path):
    live = tmp_path / f".model.safetensors.aiayn-{os.getpid()}.tmp"  # this process writes it
    dead = tmp_path / f".model.safetensors.aiayn-{dead_pid()}.tmp"
    stale = tmp_path / f".spm.model.aiayn-{os.getpid()}.abcd1234.tmp"  # a live pid (reused?) silent for hours
    busy_dir = tmp_path / f".step_000004.aiayn-{dead_pid()}.k2j4h5g6.tmp"  # a file inside it changes
    user = [tmp_path / ".model.safetensors.tmp", tmp_path / "notes.123.tmp", tmp_path / ".bashrc",
            tmp_path / f".x.{dead_pid()}.tmp"]
    for p in (live, dead, stale, *user):
        p.write_text("x")
    busy_dir.mkdir()
    (busy_dir / "weights").write_text("x")
    for p in (live, dead, stale, busy_dir, *user):
        age(p, 7200 if p in (stale, *user) or p == busy_dir else 120)
    assert sorted(remove_abandoned(tmp_path)) == sorted([dead, stale])
    assert all(p.exists() for p in (live, busy_dir, *user))
    age(busy_dir / "weights", 120)  # its writer stopped writing
    assert remove_abandoned(tmp_path) == [busy_dir]


def test_a_directory_that_cannot_be_listed_is_no_error(tmp_path):
    assert remove_abandoned(tmp_path / "missing") == []


@pytest.mark.parametrize("pid", ["0", "-1"])
def test_a_process_group_id_is_no_writer(pid):
    assert not files._running(int(pid))


def test_a_lock_holder_removes_a_dead_writers_temporary_at_once(tmp_path):
    """In its own directory (a run's checkpoints/ and cache/) no other machine writes: no waiting. Nor
    does the lock holder itself yet: a temporary of its own pid is a killed predecessor's (a container's
    training process has the same pid every run)."""
    dead = tmp_path / f".model.safetensors.aiayn-{dead_pid()}.tmp"
    mine = tmp_path / f".spm.model.aiayn-{os.getpid()}.tmp"
    live = tmp_path / f".spm.model.aiayn-{os.getppid()}.tmp"
    for p in (dead, mine, live):
        p.write_text("x")
    assert remove_abandoned(tmp_path) == []
    assert sorted(remove_abandoned(tmp_path, locked=True)) == sorted([dead, mine]) and live.exists()


def test_a_temporary_is_told_by_its_tag_and_pid():
    """8 random digits after the pid are not the pid; another program's hidden temporaries are not ours."""
    assert TEMPORARY.fullmatch(".step_000004.aiayn-4242.12345678.tmp")["pid"] == "4242"
    assert TEMPORARY.fullmatch(".a.2024.b.aiayn-17.tmp")["pid"] == "17"
    assert TEMPORARY.fullmatch(".x.123456789.tmp") is None  # Go's os.CreateTemp(".x.*.tmp")
    assert TEMPORARY.fullmatch(".model.safetensors.4242.tmp") is None


def test_a_directory_left_moved_aside_is_put_back(tmp_path):
    """A kill between the two renames of a replacement left only '.out.old' (and the new one's temporary):
    the next write, or `recover_replaced`, puts the old one back; beside a complete one it is deleted."""
    out = tmp_path / "out"
    write_atomically(out, lambda tmp: (tmp / "a").write_text("old"))
    os.rename(out, tmp_path / ".out.old")
    files.recover_replaced(tmp_path)
    assert (out / "a").read_text() == "old" and not (tmp_path / ".out.old").exists()
    os.rename(out, tmp_path / ".out.old")
    write_atomically(out, lambda tmp: (tmp / "a").write_text("new"))
    assert (out / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    shutil.copytree(out, tmp_path / ".out.old")
    files.recover_replaced(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


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


def test_the_next_write_removes_a_killed_writers_leftover_beside_it(tmp_path):
    """A killed `average -o`, `export` or `translate -o` left its hidden temporary (for a big model,
    hundreds of MB) that only a training run ever swept, and only in its run directory."""
    from aiayn.files import atomic_output

    leftovers = [tmp_path / f".avg.aiayn-{dead_pid()}.zkmv1wbo.tmp", tmp_path / f".out.txt.aiayn-{dead_pid()}.tmp"]
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
