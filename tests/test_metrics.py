"""The metrics log and its picture: a kill mid-write, bad lines and unwritable outputs give a resumable
log, a `file:line` error or a one-line error, never a traceback, a glued record or a half-written PNG."""

import errno
import itertools
import json
import logging
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from aiayn import cli
from aiayn.errors import UserError
from aiayn.train import loop
from aiayn.train.metrics import (
    PPL_CAP,
    MetricsLog,
    _points,
    capped_ppl,
    plot_metrics,
    read_metrics,
    shown_ppl,
)
from aiayn.train.state import TrainState

TRAIN = [{"step": s, "epoch": 1, "loss": 3.0 / s, "nll": 2.5 / s, "lr": 1e-4 * s} for s in (1, 2, 3)]
VALID = {"step": 3, "epoch": 1, "valid_loss": 1.2, "valid_nll": 1.0, "valid_ppl": 2.72}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path, *lines: bytes):
    """metrics.jsonl from raw lines: each ends in a newline unless it is the last and cut short."""
    path.write_bytes(b"".join(lines))
    return path


def whole(record) -> bytes:
    return json.dumps(record).encode() + b"\n"


def draw(records, log_scale=False):
    """The figure of one run's records."""
    from aiayn.train.metrics import _draw

    return _draw([("run", records)], log_scale)


@pytest.fixture
def log_path(tmp_path):
    return write_log(tmp_path / "metrics.jsonl", *map(whole, TRAIN))


def test_the_perplexity_saved_is_capped_where_the_one_shown_is_a_bound():
    """exp of a diverged run's NLL overflowed (exp(710)): the value logged and saved stops at
    exp(PPL_CAP), which the printed one shows as a bound, not as the run's value."""
    assert capped_ppl(1.0) == pytest.approx(math.e)
    assert capped_ppl(800.0) == capped_ppl(PPL_CAP) == math.exp(PPL_CAP)
    assert shown_ppl(1.0, 2) == "2.72" and shown_ppl(800.0, 2) == f">{math.exp(PPL_CAP):.1e}"


# D5: a kill during MetricsLog.write, then --resume


def test_resumed_log_drops_the_cut_record_and_keeps_the_rest(log_path, caplog):
    with open(log_path, "ab") as f:
        f.write(json.dumps(VALID).encode()[:30])  # SIGKILL mid-write: no closing brace, no newline
    new = {"step": 4, "epoch": 1, "loss": 0.7, "nll": 0.6, "lr": 4e-4}
    MetricsLog(log_path).write(new)
    assert read_metrics(log_path) == [*TRAIN, new]
    assert "dropped a record cut short" in caplog.text


def test_a_run_starting_at_update_n_drops_the_records_past_it(log_path, caplog):
    """A resume from update 2 (or a fresh start, 0) after a run that went on past its last checkpoint:
    that run's later records were kept, and `plot` drew them beside the new run's (a resume ending
    before them left them at the end). Lines that are no record with a step stay for the reader."""
    with open(log_path, "ab") as f:
        f.write(whole(VALID) + b'{"note": "no step"}\n')
    new = {"step": 3, "epoch": 1, "loss": 0.5, "nll": 0.4, "lr": 3e-4}
    MetricsLog(log_path, start_step=2).write(new)
    assert read_metrics(log_path) == [TRAIN[0], TRAIN[1], {"note": "no step"}, new]
    assert "dropped 2 record(s) past update 2, from a run that went on after its last" in caplog.text
    MetricsLog(log_path, start_step=0)  # killed before its first checkpoint: a fresh start
    assert read_metrics(log_path) == [{"note": "no step"}]
    caplog.clear()
    MetricsLog(log_path, start_step=0)  # nothing past: the log untouched, nothing said
    assert read_metrics(log_path) == [{"note": "no step"}] and "dropped" not in caplog.text


@pytest.mark.parametrize("steps", [[1], [1, 2, 3], [100, 4000, 100000]])
def test_the_update_axis_has_whole_numbers_only(steps):
    """A one-update run's axis read 0.96, 0.98, 1.00 ...; three updates, 1.25, 1.5 ..."""
    records = [{"step": s, "loss": 1.0, "nll": 1.0, "lr": 1e-4, "valid_bleu": 1.0} for s in steps]
    for ax in draw(records).axes:
        ticks = ax.get_xticks()
        assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks


NAN = float("nan")


@pytest.mark.parametrize("records", [
    # max_updates=6, valid_every=bleu_every=6, log_every=1: the BLEU panel's one point read 5.68, 5.76, ...
    [{"step": s, "loss": 1.0, "nll": 1.0, "lr": 1e-4} for s in range(1, 7)]
    + [{"step": 6, "valid_bleu": 1.0}],
    # one finite lr: ticked 2.84, ...
    [{"step": s, "loss": 1.0, "lr": 1e-4 if s == 3 else NAN} for s in range(1, 7)],
    [{"step": s, "loss": 1.0} for s in range(1, 7)],  # no lr: an empty panel read -0.060, -0.045, ...
])
def test_each_panels_update_axis_is_labelled_with_whole_numbers(records):
    """The narrow-range guard looked at the updates of all records together, not at those of each panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = draw(records)
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_visible()]
        assert labels and all(re.fullmatch(r"\d+", label) for label in labels), labels


@pytest.mark.parametrize("last, bleu", [(8_000, True), (150_000, True), (200_000, False), (2_000_000, True),
                                        (10**15, False)])
def test_the_update_labels_of_a_long_run_do_not_run_together(last, bleu):
    """From 150k updates (3 panels) or 200k (2), the labels read `0 25000 50000 75000100000125000...`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    steps = [last * k // 200 for k in range(1, 201)]
    records = [{"step": s, "loss": 3.0, "nll": 2.8, "lr": 5e-4, **({"valid_bleu": 20.0} if bleu else {})}
               for s in steps]
    fig = draw(records)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        low, high = ax.get_xlim()  # the locator's ticks past the axis's ends are not drawn
        labels = [t for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= x <= high]
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert len(boxes) >= 3 and all(a.x1 + 2 < b.x0 for a, b in itertools.pairwise(boxes)), (
            [t.get_text() for t in labels])
        if last >= 10_000:  # short labels: 50k, 1.5M
            assert all(re.fullmatch(r"0|\d+(\.\d+)?[kMGTP]", t.get_text()) for t in labels), (
                [t.get_text() for t in labels])


def test_panels_without_numbers_say_so():
    """A log without lr records drew bare axes (-0.04 to 0.04); one of NaNs, blank panels titled "best
    valid NLL nan" (and "best valid BLEU nan")."""
    nan = float("nan")
    fig = draw([{"step": 1, "loss": nan, "nll": nan}, {"step": 2, "valid_loss": nan, "valid_nll": nan}])
    loss, lr = fig.axes
    assert [t.get_text() for t in loss.texts] == ["no loss logged (or none finite)"]
    assert [t.get_text() for t in lr.texts] == ["no learning rate logged (or none finite)"]
    assert loss.get_title() == "valid NLL: not a number at every validation"
    bleu = draw([{"step": 2, "valid_nll": 1.5, "valid_bleu": nan}]).axes[2]  # titled "best valid BLEU nan"
    assert bleu.get_title() == "valid BLEU: not a number at every validation"
    fig = draw([{"step": 1, "loss": 2.0, "nll": 1.0, "lr": 1e-4}])
    assert not fig.axes[0].texts and not fig.axes[1].texts


def test_a_directory_named_with_its_slash_is_no_picture(log_path, tmp_path):
    """`-o pics/` (no such directory yet) wrote a file named pics."""
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'pics'}/: names a directory; give the")):
        plot_metrics(log_path, f"{tmp_path / 'pics'}/")
    assert not (tmp_path / "pics").exists()


def test_an_existing_directory_is_no_picture_and_a_log_is_no_run(log_path, tmp_path, capsys):
    """`-o pics` naming a directory said "cannot write (Is a directory)"; `plot run/metrics.jsonl` said
    "run/metrics.jsonl/metrics.jsonl: no metrics log"."""
    (tmp_path / "pics").mkdir()
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'pics'}: names a directory; give the")):
        plot_metrics(log_path, tmp_path / "pics")
    assert cli.main(["plot", str(log_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"aiayn: error: {log_path}: a file; give the run directory, the folder that holds metrics.jsonl"]


@pytest.mark.parametrize("content, said", [
    (b"\x1f\x8b\x08\x00rest", "the file is gzip-compressed; decompress it first (gunzip)"),
    ('{"step": 1}\n'.encode("utf-16"), "the file is like UTF-16; convert it to UTF-8"),
    (None, "is a directory, not a metrics log"),
])
def test_a_log_that_is_no_text_log_is_one_line(tmp_path, content, said):
    """gzip said "invalid UTF-8 (the write a kill interrupted?)" and then "no metrics logged yet"; a
    directory, "no metrics log"."""
    path = tmp_path / "metrics.jsonl"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(f"{path}: ") + ".*" + re.escape(said)):
        read_metrics(path)


def test_a_resume_that_validates_its_update_first_drops_that_updates_validation_record(log_path, caplog):
    """A signal's save skipped update N's validation; a resume logged it, was killed while writing its
    checkpoint, and the next resume, from the same interrupted checkpoint, logged it again: twice."""
    step = VALID["step"]
    with open(log_path, "ab") as f:
        f.write(whole(VALID))
    MetricsLog(log_path, start_step=step, revalidate=True)
    assert read_metrics(log_path) == [r for r in TRAIN if r["step"] <= step]  # its training record stays
    assert f"dropped 1 record(s) of update {step}'s validation (made again now) or past it" in caplog.text


def test_resumed_log_keeps_a_record_that_lost_only_its_newline(log_path):
    with open(log_path, "ab") as f:
        f.write(json.dumps(VALID).encode())
    MetricsLog(log_path).write(TRAIN[0])
    assert read_metrics(log_path) == [*TRAIN, VALID, TRAIN[0]]


def test_reader_skips_a_cut_last_line_with_a_warning(log_path, caplog):
    with open(log_path, "ab") as f:
        f.write(b'{"step": 1250, "loss": 0.9\xff\xfe')  # the probe's bytes: cut, and bad UTF-8 too
    with caplog.at_level(logging.WARNING):
        assert read_metrics(log_path) == TRAIN
    assert "metrics.jsonl:4: invalid UTF-8" in caplog.text and "skipped" in caplog.text


def test_plot_during_training_failing_does_not_stop_training(log_path, tmp_path, monkeypatch, caplog):
    """_validate_and_save with everything but the log and the picture faked: the unreadable log makes
    plot_metrics raise, and the validation still returns its result."""
    write_log(log_path, whole(TRAIN[0]), b"not json\n")
    monkeypatch.setattr(loop, "rng_states", lambda d: None)
    monkeypatch.setattr(loop, "save_training_checkpoint", lambda *a, **k: tmp_path / "step_3")
    monkeypatch.setattr(loop, "prune", lambda *a: None)
    monkeypatch.setattr(loop, "_check_finite_weights", lambda *a: None)  # no model here
    train_cfg = SimpleNamespace(bleu_every=0, run_dir=str(tmp_path), keep_last=1, label_smoothing=0.1)
    config = SimpleNamespace(train=train_cfg, to_dict=dict)
    state = TrainState(step=3)
    d = SimpleNamespace(is_main=True, enabled=False)
    data = SimpleNamespace(valid=None, tokenizer=None)
    result = loop._validate_and_save(None, None, None, state, data, config, d, None, MetricsLog(log_path))
    assert result == {"step": 3, "epoch": 1}
    assert "curves.png not drawn" in caplog.text and "metrics.jsonl:2:" in caplog.text


# D4: bad lines


@pytest.mark.parametrize(
    "bad, problem",
    [
        (b'{"step": 1250, "loss": 0.9\n', "not valid JSON"),
        (b'{"step": 1250, "loss": 0.9\xff\xfe}\n', "invalid UTF-8"),
        (b"42\n", "not a JSON object"),
        (b"[1, 2]", "not a JSON object"),  # last and without a newline, but it parsed: no cut record
        (b'{"step": 5, "loss": "low"}\n', "'loss' is \"low\", not a number"),
    ],
)
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, bad, problem):
    after = [whole(TRAIN[1])] if bad.endswith(b"\n") else []  # a whole line is in the middle
    path = write_log(tmp_path / "metrics.jsonl", whole(TRAIN[0]), bad, *after)
    with pytest.raises(UserError) as e:
        read_metrics(path)
    assert str(e.value).startswith(f"{path}:2: {problem}")


def test_plot_command_gives_one_line_for_a_bad_line(tmp_path, capsys):
    write_log(tmp_path / "metrics.jsonl", whole(TRAIN[0]), b"42\n", whole(TRAIN[1]))
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"aiayn: error: {tmp_path / 'metrics.jsonl'}:2: not a JSON object: 42"]


@pytest.mark.parametrize("line, problem", [
    (b'{"step": 2, "valid_loss": 1.0, "valid_bleu": "abc"}\n', "'valid_bleu' is \"abc\", not a number"),
    (b'{"step": 2, "valid_bleu": null}\n', "'valid_bleu' is null, not a number"),  # these two: TypeError
    (b'{"step": 1e308, "loss": 1.0}\n', "'step' is 1e+308, not an update number"),  # a ValueError traceback
    (b'{"step": -3, "loss": 1.0}\n', "'step' is -3, not an update number (a whole number from 1)"),  # drawn
    (b'{"step": 1.5, "loss": 1.0}\n', "'step' is 1.5, not an update number"),  # drawn between 1 and 2
    (b'{"step": 0, "loss": 1.0}\n', "'step' is 0, not an update number"),  # training logs from update 1
    (b'{"step": NaN, "loss": 1.0}\n', "'step' is nan, not an update number"),
    (b'{"step": 2, "lr": -1e308}\n', "'lr' is -1e+308, past any value a run logs"),  # matplotlib failed
    (b'{"step": 2, "loss": 1' + b"0" * 5000 + b'}\n', "not valid JSON (Exceeds the limit"),  # int() refused
])
def test_plot_command_refuses_values_it_cannot_draw(tmp_path, capsys, line, problem):
    write_log(tmp_path / "metrics.jsonl", whole(TRAIN[0]), line)
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"aiayn: error: {tmp_path / 'metrics.jsonl'}:2: {problem}") and "\n" not in err
    with pytest.raises(SystemExit) as e:  # "" was the default path, silently; now argparse's usage error
        cli.main(["plot", str(tmp_path), "-o", ""])
    assert e.value.code == 2 and "-o/--output: invalid path value: ''" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "curves.png").exists()


def test_a_value_that_is_not_finite_is_said_not_drawn(tmp_path, caplog, capsys):
    """matplotlib leaves NaN and inf out: a log with one (training stops before it logs one) drew a curve
    cut short, and nothing said why."""
    path = write_log(tmp_path / "metrics.jsonl", *map(whole, TRAIN),
                     whole({"step": 4, "loss": math.nan, "nll": math.inf, "lr": 4e-4}))
    with caplog.at_level(logging.WARNING):
        assert len(read_metrics(path)) == 4
    said = (f"{path}:4: 'loss' is nan at update 4, which is not drawn (its curve breaks or ends there); "
            "1 more value(s) in the log are not finite either")
    assert caplog.messages == [said]
    caplog.clear()
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 0  # the command's own prefix
    assert f"aiayn: warning: {said}\n" in capsys.readouterr().err  # it printed the bare message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        read_metrics(write_log(path, *map(whole, TRAIN)))
    assert not caplog.messages


@pytest.mark.parametrize("content", [b"", b'{"step": 1, "lo'])  # nothing yet; only a line cut by a kill
def test_plot_command_refuses_a_log_with_no_metrics(tmp_path, capsys, content):
    write_log(tmp_path / "metrics.jsonl", content)
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 2  # was an empty picture, 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"aiayn: error: {tmp_path / 'metrics.jsonl'}: no metrics logged yet "
        "(the first come after train.log_every updates)")
    assert not (tmp_path / "c.png").exists()


def test_plot_says_a_binary_log_a_log_without_steps_and_a_folder_that_is_no_run_in_one_line(tmp_path, capsys,
                                                                                            monkeypatch):
    """A binary metrics.jsonl (no newline in it) was warned of as "invalid UTF-8 (the write a kill
    interrupted?)", then said to have "no metrics logged yet", as was a log of records without a 'step';
    `plot .` in a folder that is no run said "metrics.jsonl: no metrics log", naming no folder."""
    binary, early_newline, stepless, other = (tmp_path / name for name in ("binary", "newline", "stepless",
                                                                            "other"))
    for folder in (binary, early_newline, stepless, other):
        folder.mkdir()
    write_log(binary / "metrics.jsonl", b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00\x00")  # an executable's start
    write_log(stepless / "metrics.jsonl", b'{"loss": 7.0}\n')
    # a binary with a newline early on (a copy of /bin/ls) was "metrics.jsonl:1: invalid UTF-8"
    write_log(early_newline / "metrics.jsonl", b"\xcf\xfa\xed\xfe\x0c\x00\n\x00\x80\xff\n")
    monkeypatch.chdir(other)
    for run, said in (
        *((log.parent, f"{log}: not a metrics log (one JSON object a line): the file is not UTF-8 text")
          for log in (binary / "metrics.jsonl", early_newline / "metrics.jsonl")),
        (stepless, (f"{stepless / 'metrics.jsonl'}: no record has a 'step' (the update each is drawn at), so "
                    "there is nothing to draw")),
        (".", f". ({other}): no metrics.jsonl here; give a training run's directory (its train.run_dir)"),
        (other, f"{other}: no metrics.jsonl here; give a training run's directory (its train.run_dir)"),
    ):
        assert cli.main(["plot", str(run)]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {said}\n"  # one line, no warning before it
    assert not list(tmp_path.rglob("*.png"))


def test_plot_says_what_the_run_directory_is_when_it_holds_no_log(tmp_path, capsys):
    """"RUN/metrics.jsonl: no metrics log" for a run that had trained but not yet logged (a SIGTERM before
    train.log_every updates, a run just started) sent the user looking for another run directory."""
    (tmp_path / "young" / "checkpoints").mkdir(parents=True)
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / ".lock").touch()
    (tmp_path / "drawn" / "curves.png").mkdir(parents=True)
    write_log(tmp_path / "drawn" / "metrics.jsonl", *map(whole, TRAIN))
    cases = {"young": "no metrics logged yet (the first come after train.log_every updates)",
             "started": "no metrics logged yet (the first come after train.log_every updates)",
             "typo": "no such run directory",
             "drawn/curves.png": "is a directory, not a picture; draw elsewhere with -o FILE.png"}
    for name, problem in cases.items():
        run = "drawn" if name == "drawn/curves.png" else name
        assert cli.main(["plot", str(tmp_path / run)]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {tmp_path / name}: {problem}\n"
    checkpoint = tmp_path / "young" / "checkpoints" / "step_000002"
    checkpoint.mkdir()
    for name in ("model.safetensors", "meta.json"):  # what makes a checkpoint to is_checkpoint
        (checkpoint / name).touch()
    assert cli.main(["plot", str(checkpoint)]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {checkpoint}: a checkpoint; give its run directory, "
                                       "the folder that holds metrics.jsonl\n")


def test_plot_names_the_run_directory_of_a_demo_folder_or_a_checkpoints_folder(tmp_path, capsys, monkeypatch):
    """`plot demo` (the demo prints demo/run/curves.png) and `plot run/checkpoints` said "no metrics log"."""
    run = tmp_path / "demo" / "run"
    (run / "checkpoints").mkdir(parents=True)
    write_log(run / "metrics.jsonl", *map(whole, TRAIN))
    for given in (tmp_path / "demo", run / "checkpoints"):
        assert cli.main(["plot", str(given)]) == 2
        expected = f"aiayn: error: {given}: no metrics.jsonl here; the run directory is {run}\n"
        assert capsys.readouterr().err == expected
    monkeypatch.chdir(run / "checkpoints")
    assert cli.main(["plot", "."]) == 2
    assert capsys.readouterr().err == "aiayn: error: .: no metrics.jsonl here; the run directory is ..\n"
    assert cli.main(["plot", ".."]) == 0 and (run / "curves.png").is_file()


def test_bleu_of_another_signature_is_a_line_of_its_own_and_the_best_its_own():
    """A --resume with another train.bleu_lang joined 13a BLEU 4.5 and char BLEU 21.3 in one line, titled
    with the best of both scales."""
    sig = "nrefs:1|case:mixed|eff:no|tok:{}|smooth:exp|version:2.6.0"
    records = [{"step": 80, "valid_bleu": 2.0, "bleu_signature": sig.format("13a")},
               {"step": 160, "valid_bleu": 4.5, "bleu_signature": sig.format("13a")},
               {"step": 240, "valid_bleu": 21.3, "bleu_signature": sig.format("char")},
               {"step": 320, "valid_bleu": 19.0}]  # no signature (a hand's edit): the series before it's
    bleu = draw(records).axes[2]
    assert [(list(line.get_xdata()), line.get_label()) for line in bleu.lines] == [
        ([80, 160], "tok:13a"), ([240, 320], "tok:char")]
    assert bleu.get_title() == "best valid BLEU 21.30 at update 240 (tok:char)"
    assert [t.get_text() for t in bleu.get_legend().get_texts()] == ["tok:13a", "tok:char"]
    upgraded = [{**records[0], "bleu_signature": sig.format("13a").replace("2.6.0", "2.5.1")}, records[1],
                {"step": 200, "valid_bleu": 5.0, "bleu_signature": None}]  # no text: as if missing
    assert len(draw(upgraded).axes[2].lines) == 1  # another sacreBLEU version alone is the same scale
    one = draw(records[:2]).axes[2]  # one scale: one line, no legend, the title as before
    assert len(one.lines) == 1 and one.get_legend() is None
    assert one.get_title() == "best valid BLEU 4.50 at update 160"


def test_the_legend_says_label_smoothed_and_the_titles_say_update():
    """"train loss (smoothed)" read as a moving average; "best valid NLL 5.193 (ppl 180.05) at 45": 45 of
    what?"""
    records = [*TRAIN, {**VALID, "valid_bleu": 12.5}]
    loss, _, bleu = draw(records).axes
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "train loss (label-smoothed)", "train NLL", "valid loss (label-smoothed)", "valid NLL"]
    assert loss.get_title() == "best valid NLL 1.000 (ppl 2.72) at update 3"
    assert bleu.get_title() == "best valid BLEU 12.50 at update 3"


def test_a_tied_best_is_the_first_for_bleu_as_for_the_loss(tmp_path, monkeypatch):
    from aiayn.train import metrics

    drawn = []
    real = metrics._draw
    monkeypatch.setattr(metrics, "_draw", lambda *args: drawn.append(real(*args)) or drawn[-1])
    tied = [whole({"step": s, "valid_loss": 2.0, "valid_nll": 1.5, "valid_bleu": 12.5}) for s in (10, 20)]
    plot_metrics(write_log(tmp_path / "a.jsonl", *map(whole, TRAIN), *tied), tmp_path / "a.png")
    titles = [axes.get_title() for axes in drawn[0].axes]
    assert titles[2] == "best valid BLEU 12.50 at update 10" and "at update 10" in titles[0], titles


def test_records_without_a_curves_keys_are_left_out_of_that_curve(tmp_path):
    """A train record without `nll` (the probe's) and a validation without a validation set."""
    path = write_log(
        tmp_path / "metrics.jsonl",
        *map(whole, TRAIN),
        whole({"step": 1250, "loss": 0.97}),
        whole({"step": 3}),
    )
    png = plot_metrics(path, tmp_path / "c.png")
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_validation_bleu_gets_its_own_panel(tmp_path, monkeypatch):
    """README: curves.png records validation BLEU (train.bleu_every); it was logged but never drawn."""
    from aiayn.train import metrics

    drawn = []
    real = metrics._draw
    monkeypatch.setattr(metrics, "_draw", lambda *args: drawn.append(real(*args)) or drawn[-1])
    bleu = [whole({"step": 10, "valid_loss": 2.0, "valid_nll": 1.9, "valid_bleu": 12.5}),
            whole({"step": 20, "valid_loss": 1.8, "valid_nll": 1.7, "valid_bleu": 17.25})]
    plot_metrics(write_log(tmp_path / "a.jsonl", *map(whole, TRAIN)), tmp_path / "a.png")
    plot_metrics(write_log(tmp_path / "b.jsonl", *map(whole, TRAIN), *bleu), tmp_path / "b.png")
    without, with_bleu = drawn
    assert len(without.axes) == 2 and len(with_bleu.axes) == 3
    assert [list(line.get_ydata()) for line in with_bleu.axes[2].lines] == [[12.5, 17.25]]
    assert with_bleu.axes[2].get_title() == "best valid BLEU 17.25 at update 20"


def test_drawing_leaves_the_callers_matplotlib_backend_and_figures_alone(log_path, tmp_path):
    """matplotlib.use("Agg") switched a notebook's backend (inline plots) for the rest of its session
    whenever training saved a checkpoint, and pyplot kept the figures."""
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    plt.switch_backend("svg")  # a stand-in for a notebook's inline backend
    try:
        plot_metrics(log_path, tmp_path / "c.png")
        assert matplotlib.get_backend() == "svg" and not plt.get_fignums()
    finally:
        plt.switch_backend(backend)


# D6: the PNG


def test_plot_makes_missing_directories(log_path, tmp_path):
    png = plot_metrics(log_path, tmp_path / "missing" / "dir" / "curves.png")
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_plot_under_a_regular_file_is_one_line_and_leaves_nothing(log_path, tmp_path):
    """A path below a file cannot be made even by root."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for png in (blocker / "c.png", blocker / "sub" / "c.png"):  # the first said "File exists"
        message = f"^{re.escape(str(png))}: {re.escape(str(blocker))} is not a directory$"
        with pytest.raises(UserError, match=message):
            plot_metrics(log_path, png)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "metrics.jsonl"]
    assert blocker.read_text() == "not a directory"


def test_plot_under_a_dangling_link_names_the_link(log_path, tmp_path, capsys):
    """`plot RUN -o brok/c.png` said "brok is not a directory"; `attention` said what brok is."""
    from aiayn.cli import main

    (tmp_path / "brok").symlink_to(tmp_path / "gone")
    png = tmp_path / "brok" / "c.png"
    assert main(["plot", str(tmp_path), "-o", str(png)]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {png}: {tmp_path / 'brok'} is a symbolic link to "
                                       f"{tmp_path / 'gone'}, which does not exist\n")
    assert not (tmp_path / "gone").exists()


def test_full_disk_keeps_the_old_png(log_path, tmp_path, monkeypatch):
    png = tmp_path / "curves.png"
    plot_metrics(log_path, png)
    old = png.read_bytes()
    with open(log_path, "ab") as f:
        f.write(whole(VALID))  # the new picture would differ

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(
        UserError, match=f"^{re.escape(str(png))}: cannot write \\(No space left on device\\)$"
    ):
        plot_metrics(log_path, png)
    assert png.read_bytes() == old
    with pytest.raises(UserError, match="cannot write"):  # the folders it made went with the picture
        plot_metrics(log_path, tmp_path / "new" / "dir" / "c.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]  # no temporary left


def test_a_step_logged_again_after_a_resume_keeps_its_last_record():
    """Killed after logging steps 1-3, resumed from a checkpoint at step 1: steps 2 and 3 come again."""
    killed = TRAIN
    resumed = [{**r, "loss": r["loss"] / 2} for r in TRAIN[1:]]
    steps, losses = _points(killed + resumed, "loss")
    assert steps == [1, 2, 3]
    assert losses == [TRAIN[0]["loss"], TRAIN[1]["loss"] / 2, TRAIN[2]["loss"] / 2]


def test_plot_replaces_a_picture_but_never_its_log_or_another_file(tmp_path, capsys):
    """`-o` over the log, a checkpoint's weights or any other file turned it into a PNG, exit 0."""
    log = write_log(tmp_path / "metrics.jsonl", *map(whole, TRAIN))
    kept = log.read_bytes()
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"weights")
    assert cli.main(["plot", str(tmp_path), "-o", str(log)]) == 2
    assert "is the input" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path), "-o", str(other)]) == 2
    assert "exists and is not a PNG picture; will not replace it" in capsys.readouterr().err
    assert log.read_bytes() == kept and other.read_bytes() == b"weights"
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "curves.pdf")]) == 2  # got PNG bytes
    assert "curves.pdf: the curves are drawn as a PNG picture; name the file .png" in capsys.readouterr().err
    assert not (tmp_path / "curves.pdf").exists()
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "bdir")]) == 2  # a folder meant: a file
    assert "bdir: the curves are drawn as a PNG picture; name the file .png" in capsys.readouterr().err
    assert not (tmp_path / "bdir").exists()
    for _ in range(2):  # a new picture, then the same one drawn again over it
        assert cli.main(["plot", str(tmp_path)]) == 0
        assert (tmp_path / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_a_full_disk_while_logging_is_one_line_naming_the_log(tmp_path, monkeypatch):
    """It was an OSError traceback from the middle of training, exit 1."""
    import errno as errnos

    import aiayn.train.metrics as metrics

    log = MetricsLog(tmp_path / "metrics.jsonl")

    def full(*args, **kwargs):
        raise OSError(errnos.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics, "open", full, raising=False)
    with pytest.raises(UserError, match=r"metrics\.jsonl: cannot write the training log \(No space left on device\)"):
        log.write({"step": 1})


def test_the_best_validation_score_ignores_nan(tmp_path):
    """A NaN first compared as the least: the title read 'best valid NLL nan (ppl nan) at 100'."""
    records = [{"step": 100, "valid_nll": math.nan, "valid_bleu": math.nan},
               {"step": 200, "valid_nll": 0.5, "valid_bleu": 12.0},
               {"step": 300, "valid_nll": 0.7, "valid_bleu": 9.0}]
    titles = [ax.get_title() for ax in draw(records).axes]
    assert titles[0] == "best valid NLL 0.500 (ppl 1.65) at update 200"
    assert titles[2] == "best valid BLEU 12.00 at update 200"


def test_plot_output_inside_a_checkpoint_is_refused(tmp_path, capsys):
    """Training's keep_last deletes a checkpoint directory whole, the picture with it; `..` is taken out
    first (a/ck/../x is not inside a/ck)."""
    write_log(tmp_path / "metrics.jsonl", whole(TRAIN[0]), whole(TRAIN[1]))
    ck = tmp_path / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"")
    assert cli.main(["plot", str(tmp_path), "-o", str(ck / "c.png")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"lies inside the checkpoint {ck}; write it elsewhere")
    assert not (ck / "c.png").exists()
    long = tmp_path / ("a" * 300 + ".png")  # was "LONG.png/meta.json: file name too long": no such name given
    assert cli.main(["plot", str(tmp_path), "-o", str(long)]) == 2
    assert capsys.readouterr().err.startswith(f"aiayn: error: {long}: ")
    for folder in (ck, ck.parent):  # "names a directory; give the picture's file name, such as ck/curves.png"
        assert cli.main(["plot", str(tmp_path), "-o", str(folder)]) == 2
        assert "curves.png" not in capsys.readouterr().err
    # nor anywhere in the run's checkpoints/: a step_N there is pruned, or read as a checkpoint
    for inside in (ck / ".." / "c.png", ck.parent / "step_000099" / "c.png"):
        assert cli.main(["plot", str(tmp_path), "-o", str(inside)]) == 2
        assert capsys.readouterr().err.strip().endswith(
            f"lies inside {ck.parent}, which training owns (it resumes from and prunes what is there); "
            "write it elsewhere")
    assert not (ck.parent / "c.png").exists() and not (ck.parent / "step_000099").exists()
    with pytest.raises(UserError, match="which training owns"):  # plot_metrics from Python drew there
        plot_metrics(tmp_path / "metrics.jsonl", ck.parent / "c.png")
    assert not (ck.parent / "c.png").exists()
    assert cli.main(["plot", str(tmp_path), "-o", str(ck / ".." / ".." / "c.png")]) == 0
    assert (tmp_path / "c.png").is_file()


def test_a_curve_of_one_point_is_drawn_as_a_marker():
    """A run stopped right after its first log_every has one record: as a line it drew an empty panel."""
    fig = draw([{"step": 10, "loss": 5.0, "nll": 4.9, "lr": 0.001}])
    assert [[line.get_marker() for line in ax.lines] for ax in fig.axes] == [["o", "o"], ["o"]]
    fig = draw([{"step": s, "loss": 5.0, "nll": 4.9, "lr": 0.001} for s in (10, 20)])
    markers = [[line.get_marker() for line in ax.lines] for ax in fig.axes]
    assert markers == [["None", "None"], ["None"]]  # a curve: lines, as before


def _run(path, scale=1.0, bleu=None):
    """A run directory whose metrics.jsonl holds three updates and a validation at update 3."""
    path.mkdir(parents=True)
    valid = {**VALID, "valid_nll": VALID["valid_nll"] * scale, **({"valid_bleu": bleu} if bleu else {})}
    write_log(path / "metrics.jsonl", *(whole({**r, "loss": r["loss"] * scale}) for r in TRAIN), whole(valid))
    return path


def test_past_ten_runs_each_keeps_a_colour_of_its_own_and_past_twenty_they_are_refused(tmp_path, capsys,
                                                                                       monkeypatch):
    """The colours cycled C0-C9: the 11th run drew in the 1st's, and the legend could not tell them apart."""
    from aiayn.train import metrics

    drawn = []
    real = metrics._draw
    monkeypatch.setattr(metrics, "_draw", lambda *args: drawn.append(real(*args)) or drawn[-1])
    runs = [_run(tmp_path / f"r{i:02d}", 1.0 + i / 10) for i in range(21)]
    assert cli.main(["plot", *map(str, runs[:12]), "-o", str(tmp_path / "twelve.png")]) == 0
    colours = {line.get_gid(): line.get_color() for line in drawn[0].axes[1].lines}  # the lr: one a run
    assert len(colours) == 12 and len({str(c) for c in colours.values()}) == 12
    capsys.readouterr()
    assert cli.main(["plot", *map(str, runs), "-o", str(tmp_path / "all.png")]) == 2
    assert capsys.readouterr().err == ("aiayn: error: 21 runs: at most 20 are told apart in one picture (a "
                                       "colour each)\n")


def test_several_runs_are_overlaid_a_colour_a_run_each_named_by_its_folders(tmp_path, capsys, monkeypatch):
    """TensorBoard overlays runs; `plot` drew one run a picture."""
    from aiayn.train import metrics

    drawn = []
    real = metrics._draw
    monkeypatch.setattr(metrics, "_draw", lambda *args: drawn.append(real(*args)) or drawn[-1])
    runs = [_run(tmp_path / "runs" / "a" / "base", 1.0, 20.0), _run(tmp_path / "runs" / "b" / "base", 0.5),
            _run(tmp_path / "runs" / "big", 2.0, 25.0)]
    out = tmp_path / "all.png"
    assert cli.main(["plot", *map(str, runs), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n" and out.read_bytes().startswith(PNG_MAGIC)
    fig = drawn[0]
    names = ["a/base", "b/base", "big"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names
    loss, lr, bleu = fig.axes
    for ax, per_run in ((loss, 4), (lr, 1), (bleu, 1)):
        colours = {name: {line.get_color() for line in ax.lines if line.get_gid() == name} for name in names}
        have = [name for name in names if colours[name]]
        assert all(len([line for line in ax.lines if line.get_gid() == name]) == per_run for name in have)
        assert all(len(colours[name]) == 1 for name in have)  # a colour a run ...
        assert len({c for name in have for c in colours[name]}) == len(have)  # ... another for each
    assert [len([line for line in bleu.lines if line.get_gid() == name]) for name in names] == [1, 0, 1]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "train loss (label-smoothed)", "train NLL", "valid loss (label-smoothed)", "valid NLL"]
    assert loss.get_title() == "best valid NLL 0.500 (ppl 1.65) at update 3\nof b/base"
    assert bleu.get_title() == "best valid BLEU 25.00 at update 3\nof big"
    one = _run(tmp_path / "one")  # one run: as before, a colour a curve and no run named
    assert cli.main(["plot", str(one)]) == 0
    assert not drawn[1].legends and len({line.get_color() for line in drawn[1].axes[0].lines}) == 4
    assert drawn[1].axes[0].get_title() == "best valid NLL 1.000 (ppl 2.72) at update 3"


def test_several_runs_need_an_output_and_a_bad_run_is_one_line_naming_it(tmp_path, capsys):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    for argv, said in (
        ([a, b], "2 runs drawn together: name their picture with -o FILE.png"),
        ([a, tmp_path / "typo", "-o", tmp_path / "c.png"], f"{tmp_path / 'typo'}: no such run directory"),
        ([a, b, f"{a}/", "-o", tmp_path / "c.png"], f"{a / 'metrics.jsonl'}: the same log given twice"),
        ([a, b, "-o", b / "metrics.jsonl"], f"{b / 'metrics.jsonl'}: is the input {b / 'metrics.jsonl'}"),
    ):
        assert cli.main(["plot", *map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"aiayn: error: {said}") and err.count("\n") == 1, err
    assert not list(tmp_path.rglob("*.png"))
    (b / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": true}\n')
    assert cli.main(["plot", str(a), str(b), "-o", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {b / 'metrics.jsonl'}:1: 'loss' is true, not a number\n"


def test_no_run_s_own_curves_png_gets_another_picture(tmp_path, capsys, monkeypatch):
    """`plot runs/a runs/b -o runs/a/curves.png` put the overlay where run a's own picture is (training's to
    redraw), `plot runs/a -o runs/b/curves.png` run a's curves as run b's; both exit 0."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    young = tmp_path / "young"  # trained, nothing logged yet
    (young / "checkpoints" / "step_000001").mkdir(parents=True)
    for run in (a, b):
        (run / "curves.png").write_bytes(PNG_MAGIC)
    for argv, png in (([a, b], a / "curves.png"), ([a], b / "curves.png"), ([a], young / "curves.png")):
        assert cli.main(["plot", *map(str, argv), "-o", str(png)]) == 2
        assert capsys.readouterr().err == (
            f"aiayn: error: {png}: run {png.parent}'s own curves, which training redraws from its "
            "metrics.jsonl; name another picture (-o FILE.png)\n")
    assert [(run / "curves.png").read_bytes() for run in (a, b)] == [PNG_MAGIC, PNG_MAGIC]
    assert not (young / "curves.png").exists()
    monkeypatch.chdir(tmp_path)  # the run's own picture, however the run is named: as training draws it
    for argv in (["a"], ["./a/", "-o", "a/curves.png"], [str(a), "-o", "a/curves.png"]):
        (a / "curves.png").write_bytes(PNG_MAGIC)
        assert cli.main(["plot", *argv]) == 0
        assert (a / "curves.png").stat().st_size > len(PNG_MAGIC)
    assert cli.main(["plot", "a", "b", "-o", "a/ab.png"]) == 0  # another name in a run's folder: the user's


def test_a_link_to_a_run_s_curves_png_and_curves_png_in_capitals_are_its_own_picture(tmp_path, capsys):
    """`-o elsewhere/b.png`, a link to runs/b/curves.png, wrote run a's curves there through the link (the
    name checked was the link's); Curves.png is curves.png on a case-insensitive file system."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    (b / "curves.png").write_bytes(PNG_MAGIC)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "b.png"
    link.symlink_to(Path("..") / "b" / "curves.png")
    for png, which in ((link, f"a link to run {b}"), (b / "Curves.png", f"run {b}")):
        assert cli.main(["plot", str(a), "-o", str(png)]) == 2
        assert capsys.readouterr().err == (f"aiayn: error: {png}: {which}'s own curves, which training "
                                           "redraws from its metrics.jsonl; name another picture (-o FILE.png)\n")
    assert (b / "curves.png").read_bytes() == PNG_MAGIC and not (b / "Curves.png").exists()
    assert cli.main(["plot", str(b), "-o", str(link)]) == 0  # run b's own, through the link: as training's
    assert link.is_symlink() and (b / "curves.png").stat().st_size > len(PNG_MAGIC)


def test_a_run_s_own_curves_png_names_the_run_and_a_log_given_twice_is_said_first(tmp_path, capsys,
                                                                                   monkeypatch):
    """`cd runs/a; plot ../b -o curves.png` said "run .'s own curves"; `plot a ./a/ -o a/curves.png` said
    "name another picture", and once named, "the same log given twice"."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    monkeypatch.chdir(a)
    assert cli.main(["plot", "../b", "-o", "curves.png"]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: curves.png: run . ({a})'s own curves, which training "
                                       "redraws from its metrics.jsonl; name another picture (-o FILE.png)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plot", "a", "./a/", "-o", "a/curves.png"]) == 2
    assert capsys.readouterr().err == "aiayn: error: a/metrics.jsonl: the same log given twice\n"
    assert not list(tmp_path.rglob("*.png")) and b.exists()


def test_run_names_are_the_fewest_folders_that_tell_the_runs_apart(tmp_path, monkeypatch):
    from aiayn.train.metrics import run_names

    logs = [tmp_path / run / "metrics.jsonl" for run in ("runs/a/base", "runs/b/base", "runs/big", "x/y/big")]
    assert run_names(logs) == ["a/base", "b/base", "runs/big", "y/big"]
    assert run_names(logs[:3]) == ["a/base", "b/base", "big"]  # each run its own fewest
    monkeypatch.chdir(tmp_path)
    assert run_names([tmp_path / "metrics.jsonl"]) == run_names([Path("metrics.jsonl")]) == [tmp_path.name]


def test_log_scale_draws_the_losses_on_a_log_axis_with_plain_labels(tmp_path, capsys, monkeypatch):
    """A 300k-update curve from 10 to 2 nats is flat at a linear scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from aiayn.train import metrics

    drawn = []
    real = metrics._draw
    monkeypatch.setattr(metrics, "_draw", lambda *args: drawn.append(real(*args)) or drawn[-1])
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / "metrics.jsonl", *(whole({"step": s, "loss": 10 / s**0.5, "nll": 9 / s**0.5, "lr": 1e-4})
                                      for s in range(1, 101)))
    assert cli.main(["plot", str(run), "--log"]) == 0
    loss, lr = drawn[0].axes
    assert (loss.get_yscale(), lr.get_yscale()) == ("log", "linear")
    FigureCanvasAgg(drawn[0]).draw()
    low, high = loss.get_ylim()
    labels = [t.get_text() for minor in (False, True)
              for t, y in zip(loss.get_yticklabels(minor=minor), loss.get_yticks(minor=minor))
              if low <= y <= high]
    assert [x for x in labels if x] and all(re.fullmatch(r"(\d+(\.\d+)?)?", x) for x in labels), labels
    assert cli.main(["plot", str(run)]) == 0 and drawn[1].axes[0].get_yscale() == "linear"
    write_log(run / "metrics.jsonl", whole(TRAIN[0]), whole({"step": 2, "valid_loss": 1.0, "valid_nll": 0.0}))
    assert cli.main(["plot", str(run), "--log"]) == 2
    assert capsys.readouterr().err.endswith(
        f"aiayn: error: {run / 'metrics.jsonl'}: update 2: 'valid_nll' is not positive, which a log scale "
        "cannot draw; draw it without the log scale\n")
