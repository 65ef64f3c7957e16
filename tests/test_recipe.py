"""recipes/multi30k/run.py: the end-to-end recipe script, at a toy size (its real run takes 82 minutes)."""

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "multi30k"
sys.path.insert(0, str(RECIPE))
import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_failed_member_stops_the_other_instead_of_orphaning_it():
    """--ensemble trains two processes; when one failed, the other trained on after the script exited."""
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    assert run.wait_all([failing, slow], poll_s=0.05) == [3, -15]  # SIGTERM: a training saves and stops
    assert time.monotonic() - start < 30
    ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert run.wait_all(ok, poll_s=0.05) == [0, 0]


def test_a_failure_of_the_second_member_stops_the_first():
    """wait_all polled with any(): it stopped at the first member, still running, and saw the second's
    failure only once the first had ended (in the recipe, its whole 80 minutes of training)."""
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    assert run.wait_all([slow, failing], poll_s=0.05) == [-15, 3]
    assert time.monotonic() - start < 10


def test_a_missing_data_folder_is_one_line(tmp_path, capsys):
    assert run.main(["--data", str(tmp_path / "nowhere"), "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and "nowhere" in err and err.count("\n") == 1


def test_a_data_file_is_said_to_be_no_folder(tmp_path, capsys):
    """`--data m30/train.en` looked for m30/train.en/train.en: "file not found", of a file that is there."""
    data = dog_data(tmp_path / "data")
    assert run.main(["--data", str(data / "train.en"), "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == (f"run.py: error: {data / 'train.en'}: --data names a file; give the "
                                       f"folder that holds the train, val and test_2016_flickr files (here "
                                       f"{data.resolve()}?)\n")
    assert not (tmp_path / "run").exists()
    # a file beside no training file: no folder to guess ("(here /dev?)" of /dev/null)
    assert run.main(["--data", os.devnull, "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.endswith("the train, val and test_2016_flickr files\n")


def test_the_help_says_the_direction_and_the_defaults(capsys):
    """--pair had no help text, --average no word of its default of 5."""
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    said = " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone
    assert "--pair {en-de,de-en} the direction: " in said and "(default: en-de)" in said
    assert "average the last K checkpoints (default: 5)" in said


@pytest.mark.parametrize("option", ["--beam", "--average"])
def test_a_count_below_one_is_refused(tmp_path, capsys, option):
    # --beam 0 became the pair's beam, --average 0 averaged every checkpoint
    with pytest.raises(SystemExit) as e:
        run.main(["--data", str(tmp_path), option, "0"])
    assert e.value.code == 2 and "invalid positive integer value: '0'" in capsys.readouterr().err


def numbers_data(folder: Path) -> Path:
    """50 training and 10 validation pairs of "the number N is even/odd" in English and German."""
    folder.mkdir()
    en = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(60)]
    de = [f"die Zahl {i} ist {'gerade' if i % 2 == 0 else 'ungerade'}" for i in range(60)]
    for split, rows in (("train", slice(0, 50)), ("val", slice(50, 60))):
        (folder / f"{split}.en").write_text("\n".join(en[rows]) + "\n", encoding="utf-8")
        (folder / f"{split}.de").write_text("\n".join(de[rows]) + "\n", encoding="utf-8")
    return folder


def tiny_run(run_dir: Path, updates: int = 2) -> list[str]:
    """--set options for a training of seconds in `run_dir`, a checkpoint every update."""
    tiny = ["model.preset=micro", "data.vocab_size=60", f"train.max_updates={updates}", "train.valid_every=1",
            "train.warmup=2", "train.threads=1", f"train.run_dir={run_dir}", "--beam", "1"]
    return [a for s in tiny for a in (("--set", s) if "=" in s else (s,))]


def test_no_train_records_the_checkpoints_config_and_the_environment(tmp_path, monkeypatch):
    """--no-train scored the trained model but recorded the options given to it (another preset here).
    The paths (command, checkpoints) are as given, relative to a working directory it did not record."""
    monkeypatch.chdir(tmp_path)
    run_dir = Path("the run")  # a space: the command was joined with " ", and could not be re-run
    data, sets = numbers_data(Path("data")), tiny_run(run_dir)
    assert run.main(["--data", str(data), *sets]) == 0
    options = ["--data", str(data), "--no-train", *sets, "--set", "model.preset=base"]
    assert run.main(options) == 0
    trained = json.loads((run_dir / "results.json").read_text())
    scored = json.loads((run_dir / "results_scored.json").read_text())
    assert scored["configs"] == trained["configs"] and trained["configs"][0]["model"]["preset"] == "micro"
    assert shlex.split(scored["command"]) == ["recipes/multi30k/run.py", *options]
    assert {"commit", "cpu", "torch", "date", "load_average"} <= set(scored["environment"])
    assert scored["cwd"] == str(tmp_path) and (Path(scored["cwd"]) / scored["checkpoints"][0]).is_dir()


def test_decoding_shows_its_progress(tmp_path, monkeypatch):
    """Decoding val (and test) gave no sign of life for minutes; the bar is left out where stderr is not a
    terminal (disable=None), as training's is: a logged run kept its carriage returns."""
    bars = []

    class Bar:
        def __init__(self, **options):
            self.options, self.done, self.disable = options, 0, False  # a terminal's: a bar shown
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.done += n

    monkeypatch.setattr(run, "tqdm", Bar)
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    assert run.main(["--data", str(data), *sets]) == 0
    assert [(b.options["desc"], b.options["total"], b.done, b.options["disable"]) for b in bars] == [
        ("translating val", 10, 10, None)]  # val's 10 sentences, counted as decoded


def test_a_val_only_scoring_keeps_the_test_scoring(tmp_path):
    """`--no-train --test`, then `--no-train`, replaced results_scored.json: the test figures, scored
    once per recipe change, were lost."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    for lang in ("en", "de"):
        (data / f"test_2016_flickr.{lang}").write_text((data / f"val.{lang}").read_text())
    assert run.main(["--data", str(data), *sets]) == 0
    assert run.main(["--data", str(data), "--no-train", "--test", *sets]) == 0
    assert run.main(["--data", str(data), "--no-train", *sets]) == 0
    tested = json.loads((tmp_path / "run" / "results_scored_test.json").read_text())
    scored = json.loads((tmp_path / "run" / "results_scored.json").read_text())
    assert [r["split"] for r in tested["results"]] == ["val", "test_2016_flickr"]
    assert [r["split"] for r in scored["results"]] == ["val"]
    # each results file's translations beside it, its own (they were never written)
    assert [r["hypotheses"] for r in tested["results"]] == ["results_scored_test.val.hyp.de",
                                                             "results_scored_test.test_2016_flickr.hyp.de"]
    assert scored["results"][0]["hypotheses"] == "results_scored.val.hyp.de"
    assert (tmp_path / "run" / "results.val.hyp.de").is_file()


def test_the_translations_are_written_beside_the_results(tmp_path):
    """results.json held only the scores: a look at the translations, or another metric, decoded again."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    assert run.main(["--data", str(data), *sets]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    [val] = results["results"]
    hyps = (tmp_path / "run" / val["hypotheses"]).read_text(encoding="utf-8").splitlines()
    refs = (data / "val.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == 10
    assert [round(s.score, 2) for s in run.corpus_scores(hyps, [refs])] == [s["score"] for s in val["scores"]]


def test_a_rewritten_results_file_keeps_no_translations_of_splits_it_does_not_list(tmp_path):
    """A --resume that trained on without --test rewrote results.json (val only) and left the older model's
    results.test_2016_flickr.hyp.de beside it, named by no results file."""
    data, run_dir = numbers_data(tmp_path / "data"), tmp_path / "run"
    for lang in ("en", "de"):
        (data / f"test_2016_flickr.{lang}").write_text((data / f"val.{lang}").read_text())
    assert run.main(["--data", str(data), *tiny_run(run_dir), "--test"]) == 0
    assert run.main(["--data", str(data), "--no-train", *tiny_run(run_dir)]) == 0  # another results file's
    assert (run_dir / "results.test_2016_flickr.hyp.de").is_file()
    assert run.main(["--data", str(data), *tiny_run(run_dir, updates=3), "--resume"]) == 0
    assert [r["split"] for r in json.loads((run_dir / "results.json").read_text())["results"]] == ["val"]
    kept = ["results.val.hyp.de", "results_scored.val.hyp.de"]
    assert sorted(p.name for p in run_dir.glob("*.hyp.de")) == kept


def test_a_checkpoint_of_the_other_direction_is_refused(tmp_path, capsys):
    """`--no-train --pair de-en` on an en-de run scored it silently (BLEU 0.1), and with --test would
    have spent the once-only test score."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    assert run.main(["--data", str(data), *sets]) == 0
    capsys.readouterr()
    averaged = tmp_path / "run" / "average_last_2"
    averaged.rename(tmp_path / "kept")  # refused before averaging: it rewrote the run's average_last_2
    assert run.main(["--data", str(data), "--no-train", "--pair", "de-en", *sets]) == 2
    err = capsys.readouterr().err
    newest = tmp_path / "run" / "checkpoints" / "step_000002"
    assert err.startswith(f"run.py: error: {newest}: trained from ")
    assert err.endswith("the reverse of --pair de-en; give --pair en-de\n") and err.count("\n") == 1
    assert not (tmp_path / "run" / "results_scored.json").exists() and not averaged.exists()


def test_a_resume_in_the_other_direction_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """`--resume` with the other --pair (or none, en-de being the default, on a de-en run) trained the run on
    the reverse data, warned only, then replaced its results.json; each --ensemble member's the same."""
    import shutil

    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    assert run.main(["--data", str(data), *sets]) == 0
    for member in "ab":  # as an en-de --ensemble's first invocation saved them
        shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "ens" / member / "checkpoints")
    capsys.readouterr()
    never_trains(monkeypatch)
    for run_dir, ensemble in (("run", []), ("ens", ["--ensemble", "--partner", "train.seed=3"])):
        options = ["--data", str(data), "--pair", "de-en", "--resume", *ensemble, *sets,
                   "--set", f"train.run_dir={tmp_path / run_dir}"]
        assert run.main(options) == 2
        err = capsys.readouterr().err
        newest = tmp_path / run_dir / ("a" if ensemble else "") / "checkpoints" / "step_000002"
        assert err.startswith(f"run.py: error: {newest}: trained from ") and err.count("\n") == 1, err
        assert err.endswith("the reverse of --pair de-en; give --pair en-de\n")
    assert json.loads((tmp_path / "run" / "results.json").read_text())["pair"] == "en-de"


def test_a_signal_to_the_ensemble_script_stops_its_members_too(monkeypatch):
    """SIGTERM to `run.py --ensemble` ended it (143) and left both member trainings running as orphans."""
    import os
    import signal
    import threading

    slow = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(run.Stopped, match="SIGTERM") as e:
        run.wait_all(slow, poll_s=0.05)
    assert [p.returncode for p in slow] == [-15, -15] and e.value.exit_status == 143
    # killed by it, the members saved nothing (still preparing their data): it said each saved its update
    assert "saved its update" not in str(e.value) and "exit codes [-15, -15]" in str(e.value)

    saving = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
              "time.sleep(60)")
    members = [subprocess.Popen([sys.executable, "-c", saving]) for _ in range(2)]
    time.sleep(1.0)  # their handlers in place
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(run.Stopped, match="SIGTERM: each member saved its update; --resume continues"):
        run.wait_all(members, poll_s=0.05)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this system")
def test_a_closed_terminal_stops_the_ensemble_script_as_sigterm_does(hangup_caught):
    """A closed terminal sends SIGHUP to run.py and its members: the members save and exit 129, and
    run.py died by the signal without a word; it now waits for them and says so."""
    import os
    import threading

    saving = ("import signal, sys, time; signal.signal(signal.SIGHUP, lambda *a: sys.exit(129)); "
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(129)); time.sleep(60)")
    members = [subprocess.Popen([sys.executable, "-c", saving]) for _ in range(2)]
    time.sleep(1.0)  # their handlers in place
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGHUP)).start()
    with pytest.raises(run.Stopped, match="SIGHUP: each member saved its update; --resume continues") as e:
        run.wait_all(members, poll_s=0.05)
    assert e.value.exit_status == 129 and [p.returncode for p in members] == [129, 129]
    # a member that saved on SIGHUP did not fail: the other one did
    assert run.member_failure([129, 2], ["ra", "rb"]).startswith("ensemble member b (rb) failed (exit 2;")


def members_that_signal_back(codes: list[int | None]) -> list[subprocess.Popen]:
    """Members whose SIGTERM or SIGHUP handler sends that signal to their parent, the test, (a second
    signal, certain to come while the parent waits for them to stop), then exit 128 + it after 1 s; a code
    exits at once with it (a member that failed). Started when their handlers are in place."""
    back = ("import os, signal, sys, time\n"
            "def stop(signum, frame):\n"
            "    os.kill(os.getppid(), signum)\n"
            "    time.sleep(1.0)\n"
            "    sys.exit(128 + signum)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "signal.signal(signal.SIGHUP, stop)\n"
            "print('ready', flush=True)\n"
            "sys.exit(int(sys.argv[1])) if len(sys.argv) > 1 else time.sleep(60)\n")
    members = [subprocess.Popen([sys.executable, "-c", back, *([] if c is None else [str(c)])],
                                stdout=subprocess.PIPE, text=True) for c in codes]
    for p in members:
        assert p.stdout.readline() == "ready\n"
    return members


@contextmanager
def watchdog(seconds: int):
    """A hang as a TimeoutError, not a test session waiting for ever."""
    def timed_out(signum, frame):
        raise TimeoutError("wait_all hung")

    before = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this system")
def test_a_second_signal_while_the_members_stop_is_taken_as_the_first(hangup_caught):
    """A closed terminal sends SIGHUP twice (the kernel's, the shell's): the second ran stop_all again
    inside the first one's p.wait(), which then waited for ever on the lock the first held; so did a signal
    while a failed member's partner stopped. The members, stopping on SIGHUP, were sent SIGTERM on top and
    said they were stopped by it."""
    import os
    import threading

    members = members_that_signal_back([None, None])
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGHUP)).start()
    with watchdog(20), pytest.raises(run.Stopped, match="SIGHUP: each member saved its update") as e:
        run.wait_all(members, poll_s=0.05)
    assert e.value.exit_status == 129 and [p.returncode for p in members] == [129, 129]
    members = members_that_signal_back([1, None])  # the first failed: its partner is stopped, and signals
    with watchdog(20):
        assert run.wait_all(members, poll_s=0.05) == [1, 143]


def test_files_it_would_score_and_search_options_are_checked_before_training(tmp_path, capsys):
    """A missing test file, or --lenpen 20, failed after the whole training (80 minutes in the recipe)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        for lang in ("en", "de"):
            (data / f"{split}.{lang}").write_text("ein Hund\n", encoding="utf-8")
    base = ["--data", str(data), "--set", f"train.run_dir={tmp_path / 'run'}"]
    assert run.main([*base, "--test"]) == 2
    assert "test_2016_flickr.en: file not found" in capsys.readouterr().err
    assert run.main([*base, "--lenpen", "20"]) == 2
    # the option, as aiayn translate names it: it said "DecodeConfig: lenpen=20.0 must be", a class
    assert capsys.readouterr().err == "run.py: error: --lenpen 20.0 must be a number between -10.0 and 10.0\n"
    assert not (tmp_path / "run").exists()


def test_a_length_penalty_at_beam_1_is_refused_and_not_recorded(tmp_path, capsys, monkeypatch):
    """Greedy search ranks nothing: `--beam 1 --lenpen 3` ran and recorded "lenpen": 3.0 (aiayn translate
    refuses it), and a --beam 1 alone recorded the pair's 1.2 as if used."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")  # --beam 1
    with monkeypatch.context() as m:
        never_trains(m)
        assert run.main(["--data", str(data), *sets, "--lenpen", "3"]) == 2
    assert capsys.readouterr().err == ("run.py: error: --lenpen 3.0 has no effect at --beam 1 (greedy search "
                                       "ranks nothing): drop it\n")
    assert run.main(["--data", str(data), *sets]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["beam"], results["lenpen"]) == (1, None)


@pytest.mark.parametrize("bad", ["unequal", "utf8", "empty"])
def test_each_scored_pair_of_files_is_read_and_checked_before_training(tmp_path, capsys, monkeypatch, bad):
    """Only is_file() was checked: a val or test pair of unequal length, invalid UTF-8 or no lines failed
    after the whole training and decoding, naming no file ("reference 1 has 38 lines but ...")."""
    def trained(config, resume=False):
        raise AssertionError("trained")

    monkeypatch.setattr(run, "train", trained)
    data = dog_data(tmp_path / "data")
    for lang in ("en", "de"):
        (data / f"test_2016_flickr.{lang}").write_text("ein Hund\n", encoding="utf-8")
    broken = {"unequal": b"ein Hund\nzwei Hunde\n", "utf8": b"ein Hund\n\xff\n", "empty": b""}[bad]
    (data / "test_2016_flickr.de").write_bytes(broken)
    if bad == "empty":
        (data / "test_2016_flickr.en").write_bytes(b"")
    base = ["--data", str(data), "--set", f"train.run_dir={tmp_path / 'run'}"]
    assert run.main([*base, "--test"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and err.count("\n") == 1
    expected = {"unequal": f"test_2016_flickr.en has 1 lines but {data / 'test_2016_flickr.de'} has 2",
                "utf8": "test_2016_flickr.de:2: invalid UTF-8", "empty": "test_2016_flickr.de are empty"}[bad]
    assert expected in err, err
    with pytest.raises(AssertionError, match="trained"):  # without --test, test's files are not read
        run.main(base)


def test_a_line_too_long_for_the_model_is_named_by_file_and_line_before_any_decoding(tmp_path, capsys,
                                                                                     monkeypatch):
    """A test line of more pieces than the model's positions failed after val's decoding, as "run.py: error:
    text 2: ...", naming no file; its length needs the tokenizer, so it is found after training."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    (data / "test_2016_flickr.en").write_text("the number 1 is odd\n" + "the number 3 " * 20 + "\n")
    (data / "test_2016_flickr.de").write_text("die Zahl 1 ist ungerade\ndie Zahl 3\n")
    decoded, translate = [], run.Translator.translate
    monkeypatch.setattr(run.Translator, "translate",
                        lambda self, texts, **kw: decoded.append(texts) or translate(self, texts, **kw))
    short = ["--set", "model.max_len=16", "--set", "data.max_len=16"]
    assert run.main(["--data", str(data), "--test", *sets, *short]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"run.py: error: {re.escape(str(data / 'test_2016_flickr.en'))}:2: \d+ tokens "
                        r"\(with EOS\), more than the 16 positions of this model\n", err), err
    assert decoded == []  # not even val


def test_decoding_off_a_terminal_says_its_progress(monkeypatch, caplog):
    """Where stderr is no terminal tqdm shows no bar, and each split decoded for a minute without a word
    (the demo's translating says its progress there; the recipe's did not)."""
    class Translator:
        def translate(self, texts, progress, **options):
            for _ in texts:
                progress(1)
            return list(texts)

    monkeypatch.setattr(run, "PROGRESS_SECONDS", 0.0)  # a line a sentence
    with caplog.at_level(logging.INFO):
        run.score(Translator(), Path("data/val.en"), "val", ["a"] * 3, ["a"] * 3, beam=4, lenpen=1.0)
    said = [m for m in caplog.messages if m.startswith("translated ")]
    assert said and said[-1].startswith("translated 3 of 3 val sentences (100%, "), caplog.messages


def test_a_decoding_error_names_the_file_and_line():
    """Out of memory at a batch's first text (a TextError) was named "text 5" too."""
    class Translator:
        def translate(self, texts, **options):
            raise run.TextError(4, "out of memory decoding a batch of 2 sentence(s) at beam 4")

    with pytest.raises(run.UserError, match=r"^data/val.en:5: out of memory decoding a batch"):
        run.score(Translator(), Path("data/val.en"), "val", ["a"] * 6, ["b"] * 6, beam=4, lenpen=1.0)


def test_a_stopped_training_is_one_line_with_the_signals_status(tmp_path, capsys, monkeypatch):
    """It was a Stopped traceback, exit 1, advising a --resume the script did not have."""
    def stopped(config, resume=False):
        raise run.Stopped("stopped by SIGTERM at update 601, saved in x; --resume continues from there", 15)

    monkeypatch.setattr(run, "train", stopped)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        for lang in ("en", "de"):
            (data / f"{split}.{lang}").write_text("ein Hund\n", encoding="utf-8")
    assert run.main(["--data", str(data), "--set", f"train.run_dir={tmp_path / 'run'}"]) == 143
    assert capsys.readouterr().err.strip().startswith("run.py: stopped by SIGTERM")
    assert run.parse_args(["--data", "x", "--resume"]).resume is True  # what that line advises


def test_trainings_messages_name_the_option_alone(tmp_path, capsys, monkeypatch):
    """run.py has --resume and no Python call: training's "--resume (resume=True in Python)" came through."""
    data, sets = numbers_data(tmp_path / "data"), tiny_run(tmp_path / "run")
    assert run.main(["--data", str(data), *sets]) == 0
    capsys.readouterr()
    assert run.main(["--data", str(data), *sets]) == 2  # a rerun without --resume
    err = capsys.readouterr().err
    assert "already holds checkpoints; pass --resume to continue" in err and "Python" not in err, err

    def stopped(config, resume=False):  # as the training loop says a stop
        raise run.Stopped("stopped by SIGTERM at update 3, saved in x; --resume (resume=True in Python) "
                          "continues from there", signal.SIGTERM)

    monkeypatch.setattr(run, "train", stopped)
    assert run.main(["--data", str(data), *sets, "--resume"]) == 143
    assert capsys.readouterr().err == ("run.py: stopped by SIGTERM at update 3, saved in x; --resume "
                                       "continues from there\n")


def test_a_ctrl_c_outside_training_is_one_line(tmp_path, capsys, monkeypatch):
    """A Ctrl-C while preparing data, averaging or decoding printed a 35-line KeyboardInterrupt traceback
    (`aiayn` says "aiayn: interrupted" and exits 130)."""
    def interrupted(config, resume=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "train", interrupted)
    options = ["--data", str(dog_data(tmp_path / "data")), "--set", f"train.run_dir={tmp_path / 'run'}"]
    try:
        assert run.main(options) == 130
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt went through main: a traceback")
    assert capsys.readouterr().err == "run.py: interrupted\n"
    # an --ensemble member dies by the signal, as Python's own exit on a Ctrl-C: its script tells that
    # (nothing saved) from the 130 of a training that saved its update
    code = (f"import sys; sys.path.insert(0, {str(RECIPE)!r}); import run\n"
            "def train(config, resume=False): raise KeyboardInterrupt\n"
            f"run.train = train; sys.exit(run.main({[*options, '--train-only']!r}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert done.returncode == -2 and done.stderr.endswith("run.py: interrupted\n"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_sigterm_while_averaging_or_decoding_is_one_line(tmp_path):
    """It exited 143 without a word; `aiayn translate` says "aiayn: stopped by SIGTERM" (same status)."""
    options = ["--data", str(dog_data(tmp_path / "data")), "--set", f"train.run_dir={tmp_path / 'run'}"]
    code = (f"import os, signal, sys; sys.path.insert(0, {str(RECIPE)!r}); import run\n"
            "run.train = lambda config, resume=False: {'step': 1}\n"
            "run.average_last = lambda *args: os.kill(os.getpid(), signal.SIGTERM)\n"
            f"sys.exit(run.main({options!r}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (128 + signal.SIGTERM, "run.py: stopped by SIGTERM\n")


def test_a_sigterm_before_the_first_update_is_one_line(tmp_path):
    """During the data's preparation (before training's own handlers) it was killed without a word (143);
    `aiayn train` says "stopped by SIGTERM" there. An --ensemble member still dies by the signal: its
    script tells that (nothing saved) from the 143 of a training that saved its update."""
    options = ["--data", str(dog_data(tmp_path / "data")), "--set", f"train.run_dir={tmp_path / 'run'}"]
    for member, status in (([], 128 + signal.SIGTERM), (["--train-only"], -signal.SIGTERM)):
        code = (f"import os, signal, sys; sys.path.insert(0, {str(RECIPE)!r}); import run\n"
                "def train(config, resume=False):\n"
                "    os.kill(os.getpid(), signal.SIGTERM)\n"
                "    raise AssertionError('trained on')\n"
                f"run.train = train; sys.exit(run.main({[*options, *member]!r}))")
        done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (status, "run.py: stopped by SIGTERM\n")


def test_a_signal_at_the_last_update_stops_before_averaging(tmp_path, capsys, monkeypatch):
    """Training ends as usual on a signal at its budget's last update, and says so ("signal"): the script
    went on averaging and decoding (minutes of beam search after a scheduler's SIGTERM), then exit 0."""
    monkeypatch.setattr(run, "train", lambda config, resume=False: {"step": 2, "signal": "SIGTERM"})
    monkeypatch.setattr(run, "average_last", lambda *args: pytest.fail("averaged after the signal"))
    options = ["--data", str(dog_data(tmp_path / "data")), "--set", f"train.run_dir={tmp_path / 'run'}"]
    assert run.main(options) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ("run.py: stopped by SIGTERM after the training, saved; --resume "
                                       "averages and decodes\n")


@pytest.mark.parametrize("options", [["--partner", "train.seed=3"], ["--no-train", "--resume"]])
def test_contradictory_options_are_refused(capsys, options):
    """--partner without --ensemble, and --resume with --no-train, were silently ignored."""
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--data", "x", *options])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: ") and options[0] in err.splitlines()[-1]


def dog_data(folder: Path) -> Path:
    """train and val files of one line: enough for what is checked before training."""
    folder.mkdir()
    for split in ("train", "val"):
        for lang in ("en", "de"):
            (folder / f"{split}.{lang}").write_text("ein Hund\n", encoding="utf-8")
    return folder


def never_trains(monkeypatch) -> None:
    """Training fails the test: what is checked must be refused before it."""
    def trained(*args, **kwargs):
        raise AssertionError("trained")

    monkeypatch.setattr(run, "train", trained)
    monkeypatch.setattr(run, "train_members", trained)


def saved_step(run_dir: Path) -> None:
    """A checkpoint of `run_dir` as far as is read before training: its meta.json (no config recorded)."""
    step = run_dir / "checkpoints" / "step_000200"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"format": "aiayn-1"}), encoding="utf-8")


def test_ensemble_members_that_would_train_the_same_model_are_refused(tmp_path, capsys, monkeypatch):
    """`--ensemble --set train.seed=2` gave member b en-de's partner seed 2 as well: one model trained
    twice, bit for bit, and scored as an ensemble."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"]
    assert run.main([*base, "--set", "train.seed=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and "--partner train.seed=3" in err and err.count("\n") == 1
    assert run.main([*base, "--partner", "train.foo=1"]) == 2
    err = capsys.readouterr().err  # was named --set's, though no --set said it
    assert err.startswith("run.py: error: --partner 'train.foo=1': unknown train key 'foo'")
    assert "--set" not in err
    # valid with the --set beside it (the check left --set out, and refused it), then named as --partner's
    with pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--set", "data.max_len=64", "--partner", "train.max_tokens=100"])
    assert run.main([*base, "--partner", "train.max_tokens=100"]) == 2
    err = capsys.readouterr().err
    assert "--partner 'train.max_tokens=100': data.max_len=128 does not fit" in err, err
    assert run.main([*base, "--partner", "train.log_every=7"]) == 2  # bookkeeping: the same weights
    capsys.readouterr()
    assert run.main([*base, "--partner", "data.normalization=nmt_nfkc"]) == 2  # the default written: compared
    capsys.readouterr()  # as meta.json records them (the fields of what was written made them differ)
    with pytest.raises(AssertionError, match="trained"):  # the recipe's own partner differs
        run.main(base)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("item", ["train.run_dir=elsewhere", " train.threads = 2"])
def test_a_partner_item_of_what_the_recipe_sets_per_member_is_refused(tmp_path, capsys, monkeypatch, item):
    """The recipe sets each member's run_dir (RUN_DIR/b) and threads (half) after --partner's items: these
    were dropped unsaid, and over a --set of the same key the log said member b trained with them."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    options = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}",
               "--set", "train.threads=2", "--partner", "train.seed=3", "--partner", item]
    assert run.main(options) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: --partner {item!r}: the recipe sets it for both members (")
    assert err.endswith("); drop it\n") and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("partner", [
    ["model.activation=\"relu\""], ["model.n_heads=4"], ["model.norm_first=false"],
    ["model.n_decoder_layers=3"], ["train.keep_last=2"], ["train.valid_every=7"],
    ["train.checkpoint_activations=true"],
    ["train.bleu_every=5", "train.bleu_lang=de"],
    [f"train.device={'cuda' if torch.cuda.is_available() else 'cpu'}"],  # the device "auto" takes here
])
def test_a_partner_restating_the_recipe_or_changing_bookkeeping_is_refused(tmp_path, capsys, monkeypatch,
                                                                           partner):
    """Each trained two members equal bit for bit (80 minutes each): the check compared [model] as written
    (a default or the `small` preset's value restated differed) and took these train keys for changes."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"]
    # a budget of updates, not the recipe's minutes, which count the validations' time
    base += ["--set", "train.max_minutes=0", "--set", "train.max_updates=9000"]
    assert run.main([*base, *(a for p in partner for a in ("--partner", p))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: the two --ensemble members would train the same model"), err


@pytest.mark.parametrize("counted", [["train.patience=3"], []])
def test_validation_steps_differ_where_patience_or_the_minutes_count_them(tmp_path, monkeypatch, counted):
    """Patience may stop the members at other updates; the recipe's max_minutes (80) counts the time of
    validation and BLEU, so another valid_every trains other updates, cooldown's lr falling on others."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    with pytest.raises(AssertionError, match="trained"):
        run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}",
                  *(a for c in counted for a in ("--set", c)), "--partner", "train.valid_every=7"])


def test_recomputed_activations_differ_where_the_minutes_count_updates(tmp_path, monkeypatch):
    """train.checkpoint_activations leaves every update's weights as they were, but slows the updates: under
    the recipe's max_minutes (80) fewer fit, so a partner apart in it alone trains another model."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    with pytest.raises(AssertionError, match="trained"):
        run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}",
                  "--partner", "train.checkpoint_activations=true"])


def test_fine_tuning_members_are_compared_as_the_checkpoints_model(tmp_path, capsys, monkeypatch):
    """With train.init_from the model is the checkpoint's and [model] may restate it: compared so, and a
    [model] the checkpoint refuses is said before training, as the partner's."""
    from conftest import numbers_checkpoint

    never_trains(monkeypatch)
    ck = numbers_checkpoint(tmp_path, d_model=256, n_heads=4, d_ff=1024, n_layers=3)  # the recipe's `small`
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}", "--set",
            f"train.init_from={ck}"]
    assert run.main([*base, "--partner", "model.n_decoder_layers=3"]) == 2  # the checkpoint's
    assert "would train the same model" in capsys.readouterr().err
    assert run.main([*base, "--partner", "model.n_heads=2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"run.py: error: --partner 'model.n_heads=2': model.n_heads=2 differs from {ck}'s 4; with "
                   "train.init_from only model.dropout may be set\n")
    with pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--partner", "model.dropout=0.1"])


def test_a_resumed_fine_tuning_ensemble_needs_no_init_from(tmp_path, capsys, monkeypatch):
    """The training loop reads a resumed fine-tune's model from the member's own checkpoint, but the
    members' comparison read train.init_from's: once it was deleted, --resume was refused ("ck: not an
    aiayn checkpoint (no meta.json)")."""
    import shutil

    from conftest import numbers_checkpoint

    never_trains(monkeypatch)
    ck = numbers_checkpoint(tmp_path, d_model=256, n_heads=4, d_ff=1024, n_layers=3)  # the recipe's `small`
    for member in "ab":  # as each member's first invocation saved it
        shutil.copytree(ck, tmp_path / "r" / member / "checkpoints" / "step_000200")
    shutil.rmtree(ck)
    options = ["--data", str(dog_data(tmp_path / "data")), "--ensemble", "--set", f"train.init_from={ck}",
               "--partner", "train.seed=3"]
    with pytest.raises(AssertionError, match="trained"):
        run.main([*options, "--resume", "--set", f"train.run_dir={tmp_path / 'r'}"])
    # members with nothing saved yet start from init_from: its absence is said before training
    assert run.main([*options, "--resume", "--set", f"train.run_dir={tmp_path / 'new'}"]) == 2
    assert f"{ck}: checkpoint not found" in capsys.readouterr().err


def test_the_pairs_own_partner_items_are_not_named_as_set_items(tmp_path, capsys, monkeypatch):
    """With no --partner, member b gets the pair's PARTNER as --set items: a fine-tune's checkpoint refusing
    de-en's `model.d_model=128` was said as "--set 'model.d_model=128'", which nobody wrote."""
    from conftest import numbers_checkpoint

    train_members = run.train_members
    never_trains(monkeypatch)
    ck = numbers_checkpoint(tmp_path, d_model=256, n_heads=4, d_ff=1024, n_layers=3)  # the recipe's `small`
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--pair", "de-en", "--set", f"train.run_dir={tmp_path / 'r'}"]
    assert run.main([*base, "--ensemble", "--set", f"train.init_from={ck}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: the de-en recipe's partner item 'model.d_model=128' (replace it "
                          "with --partner): model.d_model=128 differs from "), err

    def refused(config, resume=False):  # as the member's training refuses an item (initial_checkpoint)
        raise config.refusal("model.d_model", config.model["d_model"], "refused")

    monkeypatch.setattr(run, "train", refused)
    member = [*base, "--train-only", "--set", "model.d_model=128"]
    assert run.main([*member, "--recipe-partner"]) == 2  # member b, as train_members starts it
    assert capsys.readouterr().err == ("run.py: error: the de-en recipe's partner item 'model.d_model=128' "
                                       "(replace it with --partner): refused\n")
    assert run.main(member) == 2  # member a: its --set items are --set's
    assert capsys.readouterr().err == "run.py: error: --set 'model.d_model=128': refused\n"
    # the user's own --set of the same item is --set's, in member b too (it holds the item twice)
    assert run.main([*member, "--set", "model.d_model=128", "--recipe-partner"]) == 2
    assert capsys.readouterr().err == "run.py: error: --set 'model.d_model=128': refused\n"
    assert run.main([*base, "--ensemble", "--set", f"train.init_from={ck}", "--set", "model.d_model=128"]) == 2
    assert capsys.readouterr().err.startswith("run.py: error: --set 'model.d_model=128': model.d_model=128 "
                                              "differs from ")
    commands, popen = [], subprocess.Popen  # train_members starts b so, and a not

    def started(command, **kwargs):
        commands.append(command)
        return popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(run.subprocess, "Popen", started)
    monkeypatch.setattr(run, "wait_all", lambda procs: [0, 0])
    train_members(run.parse_args([*base, "--ensemble"]), [["train.seed=1"], ["train.seed=2"]], ["a", "b"])
    assert ["--recipe-partner" in command for command in commands] == [False, True]


def test_a_partner_item_over_a_set_item_is_said(tmp_path, caplog, monkeypatch):
    """The partner's items come after --set in member b, by design: `--pair de-en --set model.d_model=32`
    trained b at the partner's 128 without a word."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"]
    with caplog.at_level(logging.INFO), pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--pair", "de-en", "--set", "model.d_model=32", "--set", "train.lr_scale=1.8"])
    said = ("--ensemble member b: the de-en recipe's partner items override --set: 'model.d_model=128' over "
            "'model.d_model=32' (member a trains with --set's; --partner replaces them)")
    assert [m for m in caplog.messages if "member b" in m] == [said]  # train.lr_scale: the same for both
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--set", "model.dropout=0.2", "--partner", "model.dropout=0.1"])
    assert ("member b: --partner overrides --set: 'model.dropout=0.1' over 'model.dropout=0.2' (member a "
            "trains with --set's)\n") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--set", "model.dropout=0.2"])  # en-de's partner sets train.seed alone
    assert "member b" not in caplog.text


def test_a_tilde_in_data_is_the_home_directory(tmp_path, monkeypatch):
    """`--data=~/m30` (no shell expands ~ after =) was refused: "~/m30/train.en: file not found"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    data = dog_data(tmp_path / "m30")
    configs = []

    def trained(config, resume):
        configs.append(config)
        raise AssertionError("trained")

    monkeypatch.setattr(run, "train", trained)
    with pytest.raises(AssertionError, match="trained"):  # its files were found
        run.main(["--data=~/m30", "--set", f"train.run_dir={tmp_path / 'r'}"])
    assert configs[0].data.train_src == str(data / "train.en")


def test_ensemble_members_with_other_vocabularies_are_refused_before_training(tmp_path, capsys, monkeypatch):
    """A partner with another tokenizer setting or training files was refused by the ensemble's check
    of its members' vocabularies, after both trainings (80 minutes)."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    base = ["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"]
    assert run.main([*base, "--partner", "data.vocab_size=300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and err.count("\n") == 1
    assert "data.vocab_size is 8000 for member a and 300 for member b" in err
    other = data / "other.en"
    other.write_text("ein Hund\n", encoding="utf-8")
    assert run.main([*base, "--partner", f"data.train_src={other}"]) == 2
    err = capsys.readouterr().err
    assert f"data.train_src is {str(data / 'train.en')!r} for member a and {str(other)!r} for member b" in err
    # a fine-tune keeps its checkpoint's tokenizer: equal [data] settings said nothing of it (reviewer)
    assert run.main([*base, "--partner", f"train.init_from={tmp_path / 'other_run'}"]) == 2
    err = capsys.readouterr().err
    assert f"train.init_from is '' for member a and {str(tmp_path / 'other_run')!r} for member b" in err


def test_a_single_run_and_an_ensemble_do_not_share_a_run_directory(tmp_path, capsys, monkeypatch):
    """Both defaulted to runs/multi30k-PAIR: the ensemble's a/ and b/ went inside the single run's
    directory, and each replaced the other's results.json."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    (tmp_path / "single" / "checkpoints" / "step_000200").mkdir(parents=True)
    saved_step(tmp_path / "ens" / "b")
    for run_dir, ensemble in (("single", ["--ensemble"]), ("ens", [])):
        assert run.main(["--data", str(data), *ensemble, "--set", f"train.run_dir={tmp_path / run_dir}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"run.py: error: {tmp_path / run_dir} holds ") and err.count("\n") == 1
        assert "--set train.run_dir=" in err
    with pytest.raises(AssertionError, match="trained"):  # each in its own kind of directory
        run.main(["--data", str(data), "--ensemble", "--resume", "--set",
                  f"train.run_dir={tmp_path / 'ens'}"])
    # both kinds in one directory, as the shared default left them: "another directory" holds nothing to
    # score or resume, so the members are to move (reviewer)
    (tmp_path / "single" / "a" / "checkpoints" / "step_000200").mkdir(parents=True)
    for ensemble in (["--ensemble"], []):
        assert run.main(["--data", str(data), "--no-train", *ensemble,
                         "--set", f"train.run_dir={tmp_path / 'single'}"]) == 2
        assert "move the members into a directory of their own" in capsys.readouterr().err


def test_each_members_lines_say_whose_they_are(tmp_path, capsys, monkeypatch):
    """The two trainings' lines (configuration, updates, stops, errors) interleaved on one stream, alike but
    for their numbers, without saying which member a line came from."""
    popen = subprocess.Popen

    def member(cmd, **kwargs):  # each member writes its lines, the last without its newline
        if "--train-only" not in cmd:
            return popen(cmd, **kwargs)
        code = ("import sys, time\n"
                "for i in range(3): print(f'update {i}', file=sys.stderr, flush=True); time.sleep(0.05)\n"
                "sys.stderr.write('stopped')")
        return popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(run.subprocess, "Popen", member)
    run.train_members(run.parse_args(["--data", "d", "--ensemble"]), [["train.seed=1"], ["train.seed=2"]],
                      ["ra", "rb"])
    said = capsys.readouterr().err.splitlines()
    for name in "ab":  # each member's in its order, whole
        assert [line for line in said if line.startswith(name)] == [
            f"{name}: update 0", f"{name}: update 1", f"{name}: update 2", f"{name}: stopped"], said
    assert len(said) == 8


@pytest.mark.parametrize("status", [2, 1])
def test_a_failed_member_is_named_with_its_run_directory(tmp_path, capsys, monkeypatch, status):
    """It said only "an ensemble member failed: exit codes [-15, 2]": which one, and where, was for the
    reader to find among two trainings' lines. A member's refusal of its settings (exit 2) is the script's
    usage error, as a single run's: it exited 1."""
    popen = subprocess.Popen

    def member(cmd, **kwargs):  # b fails at once, a would train on; other commands (git) run as they are
        if "--train-only" not in cmd:
            return popen(cmd, **kwargs)
        fails = f"train.run_dir={tmp_path / 'r' / 'b'}" in cmd
        code = f"import sys; sys.exit({status})" if fails else "import time; time.sleep(20)"
        return popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(run.subprocess, "Popen", member)
    data = dog_data(tmp_path / "data")
    with pytest.raises(SystemExit) as e:
        run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"])
    assert e.value.code == status
    assert capsys.readouterr().err.endswith(f"run.py: ensemble member b ({tmp_path / 'r' / 'b'}) failed "
                                            f"(exit {status}; its error is above)\n")
    assert run.member_failure([2, 1], ["x/a", "x/b"]) == (
        "ensemble members a (x/a) and b (x/b) failed (exit 2, 1; their errors are above)")
    assert run.member_failure([143, -15], ["x/a", "x/b"]).startswith("ensemble members a (x/a) and b (x/b)")


def test_what_both_members_would_refuse_is_said_once_before_they_start(tmp_path, capsys, monkeypatch):
    """A rerun without --resume, or a train.run_dir that is a file: both members said it, then the script
    named one as the failure (three lines, exit 1)."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    (tmp_path / "afile").write_text("")
    for member in "ab":  # as a first invocation saved them
        saved_step(tmp_path / "r" / member)
    base = ["--data", str(data), "--ensemble"]
    refusals = {"r": "r/a: already holds checkpoints; pass --resume to continue",
                "afile": "afile: train.run_dir exists and is not a directory",
                "afile/x": "afile/x: train.run_dir cannot be used (Not a directory)"}
    for run_dir, said in refusals.items():
        assert run.main([*base, "--set", f"train.run_dir={tmp_path / run_dir}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"run.py: error: {tmp_path}/{said}") and err.count("\n") == 1, err
    with pytest.raises(AssertionError, match="trained"):
        run.main([*base, "--resume", "--set", f"train.run_dir={tmp_path / 'r'}"])


@pytest.mark.parametrize("bad, said", [
    ("unequal", "train.en:2: line counts differ: "), ("utf8", "train.de:1: invalid UTF-8 (byte 0xff)"),
    ("empty", "train.de: both files are empty (no lines)"),
])
def test_an_ensembles_training_pair_is_checked_once_before_the_members_start(tmp_path, capsys, monkeypatch,
                                                                             bad, said):
    """Both members said the training files' error, then the script named them as failed: three lines, and
    an empty RUN_DIR left behind."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    contents = {"unequal": ("ein Hund\nzwei\n", "a dog\n"), "utf8": ("ein Hund\n", "a \xff dog\n"),
                "empty": ("", "")}[bad]
    for lang, text in zip(("en", "de"), contents):
        (data / f"train.{lang}").write_bytes(text.encode("latin-1"))
    assert run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: {data}") and said in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_an_ensembles_check_of_its_training_pair_leaves_the_members_to_warn(tmp_path, capsys, monkeypatch,
                                                                            caplog):
    """A CR inside a training line was said by the script's check and by both members: three times."""
    never_trains(monkeypatch)
    data = dog_data(tmp_path / "data")
    (data / "train.de").write_text("ein\rHund\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="trained"):
        run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}"])
    assert "CR(s) inside lines" not in caplog.text + capsys.readouterr().err


def test_a_partner_item_the_member_refuses_is_named_as_the_partners(tmp_path, capfd, monkeypatch):
    """Member b gets the partner's items as --set items: a refusal on this machine (`--partner
    train.device=cuda` on a CPU) named `--set 'train.device=cuda'`, which no --set said."""
    popen = subprocess.Popen

    def member(cmd, **kwargs):  # b runs, a waits to be stopped
        if f"train.run_dir={tmp_path / 'r' / 'a'}" in cmd:
            return popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
        return popen(cmd, **kwargs)

    monkeypatch.setattr(run.subprocess, "Popen", member)
    data = dog_data(tmp_path / "data")
    with pytest.raises(SystemExit) as e:  # fp16 needs a GPU: refused on every machine on a CPU
        run.main(["--data", str(data), "--ensemble", "--set", f"train.run_dir={tmp_path / 'r'}",
                  "--partner", "train.device=cpu", "--partner", "train.precision=fp16"])
    assert e.value.code == 2
    said = capfd.readouterr().err.splitlines()
    assert said[-1].startswith("run.py: ensemble member b (")
    assert said[-2] == ("b: run.py: error: --partner 'train.precision=fp16': train.precision='fp16' needs a "
                        "GPU (use 'bf16' on a CPU)")


def test_results_record_the_whole_training_and_a_run_that_trained_nothing_keeps_them(tmp_path):
    """train_s was the wall time around this invocation: a --resume after a stop recorded only its own
    part, and a --resume of a finished run (nothing to train) replaced results.json, 17.5 s with 2.5 s."""
    data, run_dir = numbers_data(tmp_path / "data"), tmp_path / "run"
    assert run.main(["--data", str(data), *tiny_run(run_dir)]) == 0
    first = (run_dir / "results.json").read_text()
    assert run.main(["--data", str(data), *tiny_run(run_dir), "--resume"]) == 0  # already at update 2
    assert (run_dir / "results.json").read_text() == first
    scored = json.loads((run_dir / "results_scored.json").read_text())
    assert scored["train_s"] == json.loads(first)["train_s"] and scored["updates"] == [2]

    trainer = run_dir / "checkpoints" / "step_000002" / "trainer.json"
    saved = json.loads(trainer.read_text())
    saved["state"]["seconds"] += 1000.0  # as if the invocation before the stop had trained 1000 s
    trainer.write_text(json.dumps(saved))
    assert run.main(["--data", str(data), *tiny_run(run_dir, updates=4), "--resume"]) == 0
    resumed = json.loads((run_dir / "results.json").read_text())
    newest = run_dir / "checkpoints" / "step_000004" / "trainer.json"
    seconds = json.loads(newest.read_text())["state"]["seconds"]
    assert resumed["updates"] == [4] and resumed["train_s"] == round(seconds, 1) and seconds > 1000
    assert resumed["total_s"] >= resumed["train_s"]


def test_an_extension_stopped_while_decoding_rewrites_results_when_completed(tmp_path, monkeypatch):
    """A --resume to more updates, stopped after its training (averaging, decoding), trains nothing when run
    again: its figures went to results_scored.json, and results.json kept the shorter run's."""
    data, run_dir = numbers_data(tmp_path / "data"), tmp_path / "run"
    assert run.main(["--data", str(data), *tiny_run(run_dir)]) == 0

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(run, "decoded", interrupted)
        assert run.main(["--data", str(data), *tiny_run(run_dir, updates=4), "--resume"]) == 130
    assert json.loads((run_dir / "results.json").read_text())["updates"] == [2]
    assert run.main(["--data", str(data), *tiny_run(run_dir, updates=4), "--resume"]) == 0
    assert json.loads((run_dir / "results.json").read_text())["updates"] == [4]
    assert not (run_dir / "results_scored.json").exists()


def test_a_copy_of_the_recipe_outside_the_repository_runs(tmp_path):
    """It imported benchmarks/common.py by its place in the repository: a copy elsewhere failed on that
    import with a traceback, before reading its options."""
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("run.py", "en-de.toml"):
        shutil.copy(RECIPE / name, copy / name)
    command = [sys.executable, str(copy / "run.py"), "--data", str(tmp_path / "nowhere"),
               "--set", f"train.run_dir={tmp_path / 'run'}"]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("run.py: error: ") and "nowhere" in done.stderr
