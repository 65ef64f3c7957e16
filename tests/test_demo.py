"""`aiayn demo` end to end: corpus files, the real training path, beam search, scores, curves, attention."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.demo import MARKER, DemoConfig, check_out, demo_run_config, run_demo
from aiayn.demo_corpus import CorpusConfig
from aiayn.errors import UserError


def check_outputs(out, n_test):
    """What a demo run leaves behind, whatever its accuracy."""
    hyps = (out / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    refs = (out / "data" / "test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == n_test
    checkpoints = sorted((out / "run" / "checkpoints").iterdir())
    meta = json.loads((checkpoints[-1] / "meta.json").read_text())
    assert meta["format"] == "aiayn-1" and (checkpoints[-1] / "spm.model").is_file()
    assert (out / "run" / "metrics.jsonl").is_file()
    for png in ("run/curves.png", "attention/attention_encoder.png", "attention/attention_decoder.png",
                "attention/attention_cross.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert (out / "attention" / "attention.html").read_text(encoding="utf-8").count("base64,") == 3
    return hyps, refs, checkpoints[-1]


def test_short_demo_through_the_cli(tmp_path, capsys):
    """The whole path in seconds: a micro model that learns little, but every stage runs."""
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "12", "--train-pairs", "600",
            "--test-pairs", "12", "--beam", "2"]
    assert main(argv) == 0
    hyps, refs, _ = check_outputs(out, 12)
    printed = capsys.readouterr().out
    correct = sum(h == r for h, r in zip(hyps, refs))
    assert f"held-out exact match: {correct}/12" in printed and "12 updates" in printed
    assert main(["demo", "--size", "huge"]) == 2 and "huge" in capsys.readouterr().err
    err = capsys.readouterr().err if main(argv) == 2 else ""  # never mixes two runs; deleting run/ is enough
    assert f"holds an earlier demo run; delete {out / 'run'} or choose another --out" in err
    shutil.rmtree(out / "run")  # the demo's own corpus is replaced: it wrote it
    assert main(argv) == 0
    assert check_outputs(out, 12)[1] == refs


def test_the_training_time_is_the_runs_own(tmp_path, capsys, monkeypatch):
    """"N s of training" counted the tokenizer's training, the corpus' encoding and the model's building
    (`--steps 1` reported 3 s): it is the time the run's checkpoint records, train.max_minutes's clock."""
    import aiayn.demo

    results = []
    monkeypatch.setattr(aiayn.demo, "run_demo", lambda config: results.append(run_demo(config)) or results[0])
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
                 "--test-pairs", "4", "--beam", "1"]) == 0
    last = max((out / "run" / "checkpoints").iterdir())
    recorded = json.loads((last / "trainer.json").read_text())["state"]["seconds"]
    assert results[0].train_seconds == recorded
    assert f"(beam 1, 2 updates, {recorded:.0f} s of training)" in capsys.readouterr().out


def test_one_update_is_said_in_the_singular(tmp_path, capsys, caplog):
    """`--steps 1` said "1 updates" in the summary and the log."""
    caplog.set_level(logging.INFO)
    assert main(["demo", "--out", str(tmp_path / "d"), "--size", "tiny", "--steps", "1", "--train-pairs",
                 "300", "--test-pairs", "2", "--beam", "1"]) == 0
    assert "(beam 1, 1 update, " in capsys.readouterr().out
    assert any(m.startswith("trained 1 update in ") for m in caplog.messages)
    assert "stopped (max_updates=1) after 1 update, " in caplog.text and "1 updates" not in caplog.text


def test_config_errors():
    with pytest.raises(ConfigError, match="size"):
        DemoConfig(size="giant")
    with pytest.raises(ConfigError, match="steps"):
        DemoConfig(steps=0)


@pytest.mark.parametrize("option, value", [
    ("--beam", "0"), ("--minutes", "nan"), ("--minutes", "-1"), ("--minutes", "inf"), ("--seed", str(10**29)),
    ("--test-pairs", "10000000"), ("--train-pairs", "1000000000"), ("--device", "tpu"),
    *([("--device", "cuda")] if not torch.cuda.is_available() else []),
])
def test_a_bad_option_fails_in_one_line_before_anything_is_written(tmp_path, capsys, option, value):
    """These failed after minutes of training, or with a traceback, leaving a run directory behind."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("option, value, said", [
    ("--beam", "0", "--beam 0 must be at least 1"),  # as translate says it
    ("--size", "huge", "--size 'huge' is not tiny, small or medium"),
])
def test_a_bad_option_is_said_as_the_option(tmp_path, capsys, option, value, said):
    """'demo --beam 0: DecodeConfig: beam=0 must be at least 1' named an internal class and field, and
    "demo size 'huge' is not one of [...]" no option."""
    assert main(["demo", "--out", str(tmp_path / "d"), option, value]) == 2
    assert capsys.readouterr().err == f"aiayn: error: demo {said}\n"


@pytest.mark.parametrize("rank, local_rank", [(0, 0), (1, 1), (2, 0)])
def test_a_torchrun_job_is_refused_in_one_line(tmp_path, capsys, monkeypatch, rank, local_rank):
    """`torchrun --nproc_per_node 2 -m aiayn demo`: both processes made the corpus in one --out, trained as
    a job of two (twice the batch), translated and drew into the same files, and printed every line twice.
    Said once a machine: by its first process (another machine's log had no word of it)."""
    job = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "4", "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--size", "tiny"]) == 2
    err = capsys.readouterr().err
    said = "aiayn: error: demo runs in one process, not in a torchrun job of 4: run `aiayn demo` alone"
    assert err.startswith(said) if local_rank == 0 else err == ""  # each machine's process 0 says it
    assert len(err.splitlines()) == (local_rank == 0) and not out.exists()


def test_demo_seeds_are_those_the_cpu_generator_tells_apart():
    """--seed 2**32 + 1 was accepted (train.seed's range) and initialized and ordered the batches as seed
    1 does on a CPU; the range is translate --seed's."""
    assert DemoConfig(seed=0).seed == 0 and DemoConfig(seed=2**32 - 1).seed == 2**32 - 1
    for seed in (-1, 2**32, 2**32 + 1):
        with pytest.raises(ConfigError, match=rf"^demo --seed {seed} must be between 0 and 2\*\*32 - 1 "):
            DemoConfig(seed=seed)


def test_the_held_out_limit_is_what_the_corpus_can_make():
    """~1.22 million meanings, a tenth of them held out, 300 of those for validation."""
    assert CorpusConfig().max_held_out == 121_900
    assert DemoConfig(n_test=121_600).n_test == 121_600
    with pytest.raises(ConfigError, match="--test-pairs 121601"):
        DemoConfig(n_test=121_601)
    with pytest.raises(ConfigError, match="too many"):
        CorpusConfig(n_test=121_901)


def test_the_users_own_corpus_is_never_replaced(tmp_path, capsys):
    mine = tmp_path / "project" / "data" / "train.en"
    mine.parent.mkdir(parents=True)
    mine.write_text("my own sentences\n", encoding="utf-8")
    assert main(["demo", "--out", str(tmp_path / "project"), "--size", "tiny"]) == 2
    assert "no demo wrote" in capsys.readouterr().err
    assert mine.read_text(encoding="utf-8") == "my own sentences\n"
    assert sorted(p.name for p in mine.parent.iterdir()) == ["train.en"]


@pytest.mark.parametrize("name", ["test.hyp.de", "attention/index.html", "run/metrics.jsonl"])
def test_the_users_own_translations_or_maps_are_never_replaced(tmp_path, capsys, name):
    mine = tmp_path / "project" / name
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("mine\n", encoding="utf-8")
    assert main(["demo", "--out", str(tmp_path / "project"), "--size", "tiny"]) == 2
    assert f"{mine.relative_to(tmp_path).parts[1]}: exists and no demo wrote it" in capsys.readouterr().err
    assert mine.read_text(encoding="utf-8") == "mine\n"
    assert sorted(p.name for p in (tmp_path / "project").iterdir()) == [mine.relative_to(tmp_path).parts[1]]
    (tmp_path / "project" / "data").mkdir()
    (tmp_path / "project" / "data" / MARKER).touch()  # a demo wrote here before: its outputs may be replaced
    check_out(tmp_path / "project")


@pytest.mark.parametrize("under", ["", "x"])
def test_out_under_a_regular_file_is_one_line(tmp_path, capsys, under):
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    assert main(["demo", "--out", str(tmp_path / "afile" / under)]) == 2
    out = tmp_path / "afile" / under
    problem = f"{tmp_path / 'afile'} is not a directory" if under else "exists and is not a directory"
    assert capsys.readouterr().err.strip().endswith(f"{out}: {problem}")  # not "afile: afile is not ..."
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "x"


@pytest.mark.parametrize("name", ["data", "run", "attention"])
def test_a_folder_that_is_a_link_is_refused(tmp_path, name):
    """A data/ linked into another demo's folder had that demo's corpus overwritten through the link."""
    other = tmp_path / "other"
    (other / name).mkdir(parents=True)
    if name == "data":
        (other / "data" / ".aiayn-demo").touch()  # another demo's, which check_out let through
    out = tmp_path / "d"
    out.mkdir()
    (out / name).symlink_to(other / name)
    with pytest.raises(UserError, match=f"^{out / name}: is a symbolic link .*remove the link"):
        check_out(out)


def test_only_checkpoints_make_an_earlier_run(tmp_path, capsys):
    """An empty run directory, left by a run that failed at once, must not block the rerun; nor a tokenizer
    without checkpoints, left by a demo stopped before its first (a SIGTERM while it encoded): it was
    refused as 'holds an earlier demo run' though nothing was trained, and with another --seed training
    would have refused that tokenizer as trained for other data, naming train.run_dir. (Without the
    demo's data marker a run/ holding anything is the user's: "no demo wrote it".)"""
    (tmp_path / "run").mkdir()
    check_out(tmp_path)
    (tmp_path / "run" / "spm.model").write_bytes(b"")
    with pytest.raises(UserError, match="run: exists and no demo wrote it"):
        check_out(tmp_path)
    out = tmp_path / "d"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
            "--test-pairs", "4", "--beam", "1"]
    assert main(argv) == 0
    assert main(argv) == 2 and "holds an earlier demo run" in capsys.readouterr().err  # checkpoints
    shutil.rmtree(out / "run" / "checkpoints")  # as stopped before its first: the tokenizer is left
    assert (out / "run" / "spm.model").is_file()
    assert main([*argv, "--seed", "2"]) == 0, capsys.readouterr().err
    check_outputs(out, 4)


def test_a_rerun_removes_the_earlier_demos_translations_and_maps(tmp_path, caplog, monkeypatch):
    """A rerun (run/ deleted, as told) stopped during its training left the earlier test.hyp.de (3 lines)
    and attention/ beside its new data/test.en (5 lines), which they do not match. A file of the user's
    in attention/ stays (draw_attention keeps them)."""
    from aiayn.errors import Stopped
    from aiayn.train import loop

    out = tmp_path / "d"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
            "--test-pairs", "3", "--beam", "1"]
    assert main(argv) == 0
    assert len((out / "test.hyp.de").read_text(encoding="utf-8").splitlines()) == 3
    (out / "attention" / "notes.txt").write_text("mine")
    shutil.rmtree(out / "run")

    def stopped(config, resume=False):
        raise Stopped("stopped by SIGINT at update 1", 2)

    monkeypatch.setattr(loop, "train", stopped)
    caplog.set_level(logging.INFO, logger="aiayn.demo")
    assert main([*argv[:-3], "5", "--beam", "1"]) == 130
    assert "removed the earlier demo's translations and attention maps" in caplog.text
    assert len((out / "data" / "test.en").read_text(encoding="utf-8").splitlines()) == 5
    assert not (out / "test.hyp.de").exists()
    assert [p.name for p in (out / "attention").iterdir()] == ["notes.txt"]


def test_a_demo_writing_in_out_keeps_another_out(tmp_path, capsys):
    """Two demos into one --out both passed the checks and both wrote data/: one then failed in training
    ('set another train.run_dir', no option of the demo's), the other's test.hyp.de no longer in line
    with data/test.en. Or the second was told to delete the first one's live run/ as an earlier one."""
    from aiayn.train.state import RunLock

    out, theirs = tmp_path / "d", "the first demo's"
    (out / "run").mkdir(parents=True)
    (out / "run" / "spm.model").write_text(theirs)
    (out / "data").mkdir()
    (out / "data" / MARKER).touch()
    (out / "data" / "train.en").write_text(theirs)
    held = RunLock(out / "data")  # as another process holding it: flock is per open file
    held.acquire()
    try:
        assert main(["demo", "--out", str(out), "--size", "tiny", "--steps", "2"]) == 2
    finally:
        held.release()
    assert capsys.readouterr().err == (f"aiayn: error: {out}: another demo is writing there (process "
                                       f"{os.getpid()} on {socket.gethostname()}); wait for it to end, or "
                                       "choose another --out\n")
    assert (out / "data" / "train.en").read_text() == (out / "run" / "spm.model").read_text() == theirs


@pytest.mark.slow
def test_same_seed_same_run(tmp_path):
    config = dict(size="tiny", steps=30, n_train=800, n_test=20, n_valid=20, beam=2)
    a = run_demo(DemoConfig(out=str(tmp_path / "a"), **config))
    b = run_demo(DemoConfig(out=str(tmp_path / "b"), **config))
    wa, wb = (load_file(str(r.checkpoint / "model.safetensors")) for r in (a, b))
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "test.hyp.de").read_text() == (tmp_path / "b" / "test.hyp.de").read_text()


@pytest.mark.slow
def test_default_demo_reaches_99_percent(tmp_path):
    """The README's claim: the default demo translates >= 99% of its held-out sentences exactly."""
    result = run_demo(DemoConfig(out=str(tmp_path / "demo")))
    hyps, refs, _ = check_outputs(tmp_path / "demo", result.total)
    assert result.correct == sum(h == r for h, r in zip(hyps, refs))
    assert result.accuracy >= 0.99, result.examples


def test_a_beam_wider_than_the_vocabulary_and_an_empty_out_are_refused_up_front(tmp_path, capsys):
    """--beam 100000000 failed with 'out of memory' after the training, and its run/ blocked a rerun;
    --out '' wrote into the current directory."""
    assert main(["demo", "--out", str(tmp_path / "d"), "--beam", "100000000"]) == 2
    assert "--beam 100000000 is more than the 500 pieces" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's usage error, as for every empty path
        main(["demo", "--out", ""])
    assert e.value.code == 2 and "--out: invalid path value: ''" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--out is empty"):  # and the library's own check
        DemoConfig(out="")
    assert not any(tmp_path.iterdir())


def test_a_demo_stopped_by_a_signal_names_what_it_left(tmp_path, monkeypatch):
    """The trainer's message said '--resume continues from there'; the demo has no --resume."""
    from aiayn.errors import Stopped
    from aiayn.train import loop

    def stopped(config, resume=False):
        raise Stopped("stopped by SIGINT at update 3, saved in x; --resume continues from there", 2)

    monkeypatch.setattr(loop, "train", stopped)
    with pytest.raises(Stopped, match="demo stopped by SIGINT during training") as e:
        run_demo(DemoConfig(out=str(tmp_path / "d"), size="tiny", steps=5, n_train=300, n_test=5))
    assert "--resume" not in str(e.value) and e.value.exit_status == 130
    assert "checkpoint" not in str(e.value)  # none saved: none named

    def saved_one(config, resume=False):  # `aiayn translate d2/run` is refused: the checkpoint is named
        ck = tmp_path / "d2" / "run" / "checkpoints" / "step_000003"
        ck.mkdir(parents=True)
        (ck / "meta.json").write_text("{}")
        (ck / "model.safetensors").write_bytes(b"")
        stopped(config)

    monkeypatch.setattr(loop, "train", saved_one)
    with pytest.raises(Stopped, match=r"its checkpoint .*d2/run/checkpoints/step_000003 can translate"):
        run_demo(DemoConfig(out=str(tmp_path / "d2"), size="tiny", steps=5, n_train=300, n_test=5))


def test_a_signal_at_the_last_update_stops_the_demo_after_its_training(tmp_path, capsys, monkeypatch):
    """Training ends as usual at its budget, validated and saved, whatever came during its last update:
    the demo went on translating every test pair and drawing the maps (80 s with --test-pairs 3000), and
    exited 0, the signal taken and then ignored."""
    from aiayn.train import loop

    real_step, calls = loop.train_step, []

    def step_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the last update
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_then_signal)
    out = tmp_path / "d"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
            "--test-pairs", "4", "--beam", "1"]
    assert main(argv) == 128 + signal.SIGTERM
    captured = capsys.readouterr()
    ck = out / "run" / "checkpoints" / "step_000002"
    assert captured.err.splitlines()[-1] == "aiayn: " + after_training("SIGTERM", out, ck)
    assert captured.out == "" and not (out / "test.hyp.de").exists() and not (out / "attention").exists()
    assert "valid_loss" in json.loads((ck / "meta.json").read_text())["metrics"]  # ended as usual: validated


def after_training(name: str, out, ck) -> str:
    """The message of a demo stopped by signal `name` once its training ended, checkpoint `ck` in `out`."""
    return (f"demo stopped by {name} after training; trained, its checkpoint {ck} translates the held-out "
            f"sentences (`aiayn translate {ck} -i {out / 'data' / 'test.en'} -o {out / 'test.hyp.de'}`) and "
            f"draws attention (`aiayn attention --checkpoint {ck} --src SENTENCE --out {out / 'attention'}`); "
            f"to run the demo again, delete {out / 'run'} or choose another --out")


@pytest.mark.parametrize("phase", ["translate", "extract_attention", "draw_attention"])
def test_a_stop_after_training_names_the_trained_checkpoint(tmp_path, capsys, monkeypatch, phase):
    """A Ctrl-C or SIGTERM while the demo translated or drew said 'aiayn: stopped by SIGTERM' alone, and the
    rerun was then refused for the run it left: its minutes of finished training were to be deleted, and
    no word said so, nor named the checkpoint that could still translate."""
    import aiayn.demo
    from aiayn.cli import Terminated

    def stop(*args, **kwargs):
        raise KeyboardInterrupt if phase == "translate" else Terminated(signal.SIGTERM)

    monkeypatch.setattr(aiayn.demo, phase, stop)
    out = tmp_path / "d"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
            "--test-pairs", "4", "--beam", "1"]
    name = "SIGINT" if phase == "translate" else "SIGTERM"
    assert main(argv) == 128 + getattr(signal, name)
    captured = capsys.readouterr()
    ck = out / "run" / "checkpoints" / "step_000002"
    assert captured.err.splitlines()[-1] == "aiayn: " + after_training(name, out, ck)
    assert captured.out == "" and not (out / "attention").exists()
    assert (out / "test.hyp.de").exists() == (phase != "translate")  # written before the maps


def test_an_error_a_sigterm_came_on_the_way_out_of_is_said_by_the_demo(tmp_path, capsys, monkeypatch):
    """As every command says it (torchrun's SIGTERM follows a process' error): the demo said the signal."""
    import aiayn.demo
    from aiayn.errors import Terminated

    def draw(*args, **kwargs):
        try:
            raise UserError("attention/map.png: no space left on device")
        finally:
            raise Terminated(signal.SIGTERM)

    monkeypatch.setattr(aiayn.demo, "draw_attention", draw)
    argv = ["demo", "--out", str(tmp_path / "d"), "--size", "tiny", "--steps", "2", "--train-pairs", "300",
            "--test-pairs", "4", "--beam", "1"]
    assert main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "aiayn: error: attention/map.png: no space left on device"


@pytest.mark.parametrize("phase, name", [("write_corpus", "SIGHUP"), ("translate", "SIGTERM")])
def test_a_signal_outside_training_is_said_as_for_every_command(tmp_path, phase, name):
    """SIGTERM or SIGHUP while the demo wrote its corpus, trained its tokenizer, translated or drew killed
    it without a word (exit 143), where every other command says 'aiayn: stopped by SIGTERM'. A process of
    its own: the old default action killed the test session."""
    code = ("import os, signal, sys\nimport aiayn.demo as demo\nfrom aiayn.cli import main\n"
            # under nohup SIGHUP arrives ignored, which aiayn respects (and the demo ran through)
            f"signal.signal(signal.{name}, signal.SIG_DFL)\nreal = demo.{phase}\n"
            f"def signalled(*args, **kwargs):\n    os.kill(os.getpid(), signal.{name})\n"
            "    return real(*args, **kwargs)\n"
            f"demo.{phase} = signalled\nsys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "d"
    run = subprocess.run([sys.executable, "-c", code, "demo", "--out", str(out), "--size", "tiny", "--steps",
                          "2", "--train-pairs", "300", "--test-pairs", "4", "--beam", "1"], check=False,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 128 + getattr(signal, name), run.stderr
    said = f"stopped by {name}" if phase == "write_corpus" else after_training(
        name, out, out / "run" / "checkpoints" / "step_000002")  # trained: its checkpoint named
    assert run.stderr.splitlines()[-1] == f"aiayn: {said}" and run.stdout == ""
    assert not (out / "test.hyp.de").exists()


def test_out_inside_a_checkpoint_or_a_runs_checkpoints_is_refused_before_the_corpus(tmp_path, capsys):
    """The corpus (10 MB by default) was written inside, then training refused its run_dir; pruning
    would have deleted it with the checkpoint."""
    ck = tmp_path / "run" / "checkpoints" / "step_000005"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"")
    owned = "which training owns (it resumes from and prunes what is there)"
    for out, problem in ((ck / "demo", f"lies inside the checkpoint {ck}"),
                         (ck.parent / "demo", f"lies inside {ck.parent}, {owned}")):
        argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "5", "--train-pairs", "300"]
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == f"aiayn: error: {out}: {problem}; write it elsewhere"
        assert not out.exists()


def test_a_tilde_in_out_is_the_home_directory_throughout(tmp_path, capsys, monkeypatch):
    """`--out=~/x` (no shell expands ~ after =): the corpus went to a literal ./~/x/data and training,
    which expands ~, looked in $HOME/x/data: 'file not found', or an earlier demo's corpus trained on."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--out=~/x", "--size", "tiny", "--steps", "2", "--train-pairs", "300",
                 "--test-pairs", "4", "--beam", "1"]) == 0
    out = tmp_path / "home" / "x"
    check_outputs(out, 4)
    assert f"checkpoint: {out / 'run' / 'checkpoints'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no directory named ~
    assert DemoConfig(out="~/y").out == str(tmp_path / "home" / "y")  # from Python too


def test_an_out_not_utf8_is_refused_before_the_corpus(tmp_path, capsys):
    """`--out $'bad\\xff'` was refused only after the 40,000-pair corpus was written there, and named
    data.train_src, not --out."""
    out = f"{tmp_path}/bad\udcff"  # the byte 0xff as Python keeps it from the command line
    assert main(["demo", "--out", out, "--size", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"aiayn: error: demo --out '{tmp_path}/bad\\xff': the name is not "
                                        "UTF-8, which the checkpoints record it in; rename it"), err
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"^demo --out 'x\\ud800': the name is not UTF-8"):
        DemoConfig(out="x\ud800")  # from Python, a lone surrogate, which no byte is: was a traceback


def test_the_translation_bar_is_shown_on_a_terminal_only(tmp_path, monkeypatch):
    """`aiayn demo 2>log` filled the log with the bar's carriage-return frames; disable=None leaves it out
    where stderr is not a terminal, as training's bar and run.py's."""
    from tqdm import tqdm

    import aiayn.demo

    options = []
    monkeypatch.setattr(aiayn.demo, "tqdm", lambda **kwargs: options.append(kwargs) or tqdm(**kwargs))
    run_demo(DemoConfig(out=str(tmp_path / "d"), size="tiny", steps=2, n_train=300, n_test=3, beam=1))
    assert [(o["desc"], o["total"], o.get("disable", "not given")) for o in options] == [
        ("translating held-out sentences", 3, None)]


def test_translating_off_a_terminal_says_its_progress(tmp_path, monkeypatch, caplog):
    """Where stderr is no terminal the bar is not shown, and translating a large --test-pairs (a minute
    for 3000) went without a word: a line every PROGRESS_SECONDS, as training's data preparation gives."""
    import logging

    import aiayn.data.dataset

    monkeypatch.setattr(aiayn.data.dataset, "PROGRESS_SECONDS", 0.0)  # a line a batch
    caplog.set_level(logging.INFO, logger="aiayn")
    run_demo(DemoConfig(out=str(tmp_path / "d"), size="tiny", steps=2, n_train=300, n_test=3, beam=1))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("translated ")]
    assert lines and lines[-1].startswith("translated 3 of 3 held-out sentences (100%, "), lines


def test_the_readme_says_what_the_last_update_of_the_cooldown_runs_at(tmp_path):
    """The README said the lr falls 'to zero over the last quarter of the updates': each update takes its
    rate from the budget used before it, so the last runs at 1/(0.25 x updates) of the schedule."""
    from aiayn.train.schedule import cooldown_factor

    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert "so the last of 1,200 updates runs at 1/300 of the schedule's, not at zero" in readme
    config = DemoConfig()
    paths = {f"{s}_{side}": tmp_path / f"{s}.{side}" for s in ("train", "valid") for side in ("src", "tgt")}
    train = demo_run_config(config, paths, tmp_path / "run").train
    assert config.steps == train.max_updates == 1200
    assert cooldown_factor((config.steps - 1) / config.steps, train.cooldown) == pytest.approx(1 / 300)


def test_an_out_with_a_control_character_is_refused_before_the_corpus(tmp_path, capsys):
    """demo --out $'de\nmo' wrote the 40,000-pair corpus, then was refused as data.train_src with TOML's
    advice, naming a setting the user never wrote: now --out itself, before any work."""
    out = tmp_path / "de\nmo"
    assert main(["demo", "--out", str(out), "--steps", "1"]) == 2
    said = f"aiayn: error: demo --out {str(out)!r} holds a line feed (\\n), which no path should have\n"
    assert capsys.readouterr().err == said
    assert not out.exists()
