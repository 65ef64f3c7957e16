"""The metrics log (one JSON object per line) and a PNG of its curves."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.data.lines import SIGNATURES
from aiayn.errors import UserError
from aiayn.files import atomic_output, check_file_output, directory_for, resolved

log = logging.getLogger(__name__)
MAX_RUNS = 20  # runs `plot_metrics` overlays at most: tab20's colours
PPL_CAP = 50  # nats: exp overflows past ~709; the perplexity logged, printed and drawn is exp of at most this


def capped_ppl(nll: float) -> float:
    """Perplexity as logged and saved: exp of the NLL per token, at most exp(PPL_CAP) (a diverged run's
    NLL overflowed exp)."""
    return math.exp(min(nll, PPL_CAP))


def shown_ppl(nll: float, digits: int) -> str:
    """Perplexity as printed: past the cap, as a bound (exp(50) was printed as a diverged run's value)."""
    return f"{math.exp(nll):.{digits}f}" if nll <= PPL_CAP else f">{math.exp(PPL_CAP):.1e}"

# The keys the picture draws; where a record has one, it must be a number.
PLOTTED = ("step", "loss", "nll", "valid_loss", "valid_nll", "lr", "valid_bleu")
MAX_STEP = 2**53  # a step past any run (and past float precision: matplotlib's ticks failed on 1e308)
MAX_VALUE = 1e100  # a loss, NLL, BLEU or rate past any run (lr 1e308 beside -1e308: matplotlib failed)


class MetricsLog:
    """Appends records to `metrics.jsonl`; each line is flushed, so a crash loses at most one.

    Training, which starts at update `start_step` (0, or the checkpoint it resumes), first drops the records
    past it, as TensorBoard's `purge_step` does: they are those of a run that went on after its last
    checkpoint (or, at 0, one killed before its first), whose updates the weights no longer hold. Kept,
    `plot` drew them beside the new run's: a 20-update run over the 2,000 of a killed one, a resume
    from update 1,000 ending at 1,200 with the abandoned 1,201-1,250 after it. `revalidate`: the run
    validates `start_step` first (a signal's save skipped it), so that update's validation record, one a
    killed resume wrote before its checkpoint, goes too: it was logged twice."""

    def __init__(self, path: str | Path, start_step: int | None = None, revalidate: bool = False):
        self.path = Path(path)
        with self._errors():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                _end_with_whole_line(self.path)
                if start_step is not None and (dropped := _drop_records_after(self.path, start_step,
                                                                              revalidate)):
                    which = "went on after its last checkpoint" if start_step else "stopped before its first"
                    past = ("of update %d's validation (made again now) or past it" if revalidate
                            else "past update %d")
                    log.warning("%s: dropped %d record(s) " + past + ", from a run that %s", self.path,
                                dropped, start_step, which)

    def write(self, record: dict[str, Any]) -> None:
        with self._errors(), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")  # a full disk may cut it: the next run drops the cut line

    @contextlib.contextmanager
    def _errors(self):
        """An OSError (a full disk) as one line naming the log; the checkpoints saved so far stay."""
        try:
            yield
        except OSError as e:
            raise UserError(f"{self.path}: cannot write the training log ({e.strerror or e})") from None


def _end_with_whole_line(path: Path) -> None:
    """Make the log end in a newline, so that the next record starts a line of its own.

    A last line without its newline is the record a kill (SIGKILL, power loss) interrupted. If it
    parses, only the newline was lost: terminate it and keep the record. Otherwise drop it: a cut
    record cannot be completed, and terminating it would leave an unparsable line in the middle of
    the log, which `read_metrics` rightly refuses, so every later plot would fail. (Read whole: a log
    holds one short record per log line, and this runs once per run.)"""
    with open(path, "r+b") as f:
        data = f.read()  # and the position is now the end, where a newline goes
        start = data.rfind(b"\n") + 1  # where the last line begins
        tail = data[start:]
        if not tail:
            return
        if _parses_as_object(tail):
            f.write(b"\n")
        else:
            f.truncate(start)
            log.warning("%s: dropped a record cut short by an interrupted write: %r", path, tail[:80])
        f.flush()
        os.fsync(f.fileno())  # before new records follow it


def _drop_records_after(path: Path, step: int, revalidate: bool = False) -> int:
    """Rewrite the log (atomically) without the records whose "step" is past `step`, and with `revalidate`
    the validation records of `step` itself (training's records have a "loss"); how many went. Lines
    that are no such record (another writer's, damaged ones) stay for `read_metrics` to judge."""
    lines = path.read_bytes().splitlines(keepends=True)
    keep = [line for line in lines if not _past(line, step, revalidate)]
    if len(keep) < len(lines):
        with atomic_output(path, binary=True) as f:
            f.write(b"".join(keep))
    return len(lines) - len(keep)


def _past(line: bytes, step: int, revalidate: bool) -> bool:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # JSON's errors, invalid UTF-8, a 4,300-digit number, nesting
        return False
    value = record.get("step") if isinstance(record, dict) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return value > step or (revalidate and value == step and "loss" not in record)


def _parses_as_object(line: bytes) -> bool:
    try:
        return isinstance(_decode(line, ""), dict)
    except UserError:
        return False


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics log. A bad line is a `UserError` naming it, except an unparsable
    last line without a newline: that is the write a kill interrupted, skipped with a warning."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a metrics log" if path.is_dir() else "no metrics log"
        raise UserError(f"{path}: {what}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    if what := next((w for magic, w in SIGNATURES if data.startswith(magic)), None):
        # one line, not "invalid UTF-8 (the write a kill interrupted?)" and then "no metrics logged yet"
        raise UserError(f"{path}: not a metrics log (one JSON object a line): the file is {what}")
    lines = data.split(b"\n")  # bytes, split on newlines only: a bad byte is one line's error, with its line
    records = []
    not_finite = []  # (where, key, value): drawn as a gap, or a curve cut short, they are said
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = _decode(line, f"{path}:{n}")
        except UserError as e:
            # its first line, and no text: training writes ASCII JSON, so no log of its, nor a write that a kill
            # cut, is this (a binary file was "invalid UTF-8 (the write a kill interrupted?)", then "no metrics
            # logged yet"; one with a newline early on, a copy of /bin/ls, "metrics.jsonl:1: invalid UTF-8")
            if not records and not _is_utf8(line):
                raise UserError(f"{path}: not a metrics log (one JSON object a line): the file is not UTF-8 "
                                "text") from None
            if n < len(lines):  # a newline follows: a whole line, and a bad one
                raise
            log.warning("%s (the write a kill interrupted?); skipped", e)
            continue
        if not isinstance(record, dict):  # it parsed, so no interrupted write made it
            raise UserError(f"{path}:{n}: not a JSON object: {line.decode()[:40]}")
        _check_numbers(record, f"{path}:{n}")
        not_finite += [(f"{path}:{n}", key, record) for key in PLOTTED
                       if key in record and not math.isfinite(record[key])]
        records.append(record)
    if not_finite:
        _warn_not_finite(not_finite)
    return records


def _warn_not_finite(found: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Say where a log holds NaN or inf: matplotlib leaves such a point out, so a curve ended early or had a
    gap that nothing explained. Training stops before it logs a loss that is not finite (loop's
    `_check_finite`); a log with one was edited, or written before that check."""
    where, key, record = found[0]
    more = f"; {len(found) - 1} more value(s) in the log are not finite either" if len(found) > 1 else ""
    log.warning("%s: %r is %s at update %s, which is not drawn (its curve breaks or ends there)%s", where,
                key, record[key], record.get("step", "(none given)"), more)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _decode(line: bytes, where: str) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{where}: invalid UTF-8") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # a number of more than 4,300 digits, which Python's int() refuses
        raise UserError(f"{where}: not valid JSON ({e})") from None


def _check_numbers(record: dict[str, Any], where: str) -> None:
    for key in PLOTTED:
        value = record.get(key)
        if key in record and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{where}: {key!r} is {json.dumps(value)[:40]}, not a number")
        # inf and nan are accepted (and said: matplotlib leaves them out); a finite 1e308 beside -1e308
        # failed in matplotlib's ticks
        if key != "step" and key in record and math.isfinite(value) and abs(value) > MAX_VALUE:
            raise UserError(f"{where}: {key!r} is {value:.3g}, past any value a run logs")
    step = record.get("step", 1)
    # training logs updates from 1; -3 or 1.5 (a hand's edit) were drawn, and nan or 1e308 failed
    if not (1 <= step <= MAX_STEP and float(step).is_integer()):
        raise UserError(f"{where}: 'step' is {step}, not an update number (a whole number from 1)")


def plot_metrics(jsonl_paths: str | Path | Sequence[str | Path], png_path: str | Path,
                 log_scale: bool = False) -> Path:
    """Loss and NLL (train and validation) and the learning rate against the update number, of one log or
    of several overlaid (a colour a run, named by `run_names`), as a PNG written atomically (the old picture
    stays if writing fails); a missing directory is made. Never inside a checkpoint or a run's
    checkpoints/: training's keep_last deletes those whole (Python callers too). `log_scale`: the losses'
    axis is logarithmic (a long run's curve from 10 to 2 nats is flat on a linear one)."""
    from aiayn.train.state import check_outside_checkpoints

    one = isinstance(jsonl_paths, (str, os.PathLike))
    logs = [Path(jsonl_paths)] if one else list(map(Path, jsonl_paths))
    # first: "names a directory; give the picture's file name, such as ck/curves.png" of a checkpoint
    # offered a place refused next
    check_outside_checkpoints(Path(png_path))
    if str(png_path).endswith(("/", os.sep)) or Path(png_path).is_dir():  # Path drops a slash: `-o pics/`
        raise UserError(f"{png_path}: names a directory; give the picture's file name, such as "
                        f"{Path(png_path) / 'curves.png'}")
    _check_each_once(logs)  # first: `plot runs/a ./runs/a/ -o runs/a/curves.png` was "name another picture"
    _check_png_output(Path(png_path), logs)
    if len(logs) > MAX_RUNS:  # colours repeated past 10: two runs the legend could not tell apart
        raise UserError(f"{len(logs)} runs: at most {MAX_RUNS} are told apart in one picture (a colour each)")
    runs = [(name, _drawable_records(path, log_scale)) for name, path in zip(run_names(logs), logs)]
    png = io.BytesIO()
    _draw(runs, log_scale).savefig(png, format="png", dpi=100)
    png_path = Path(png_path)
    _write_png(png.getvalue(), png_path)
    return png_path


def run_names(logs: Sequence[Path]) -> list[str]:
    """Each log's run as the legend names it: the name of the folder that holds the log, with as many of
    the folders above as tell the runs apart (runs/a/base and runs/b/base: a/base and b/base)."""
    parts = [Path(os.path.abspath(log)).parent.parts for log in logs]  # `plot .` is named, not ""
    return [str(Path(*mine[-_folders_apart(mine, [p for p in parts if p is not mine]):])) for mine in parts]


def _folders_apart(mine: tuple[str, ...], others: list[tuple[str, ...]]) -> int:
    """How many of the last folders of `mine` no other path ends with (runs/big beside a/base, b/base: 1)."""
    return next((k for k in range(1, len(mine)) if all(p[-k:] != mine[-k:] for p in others)), len(mine))


def _check_each_once(logs: list[Path]) -> None:
    """The same log twice (runs/a and ./runs/a/, or a link to it) drew two curves of one run, one hiding
    the other, under two names."""
    seen: dict[Path, Path] = {}
    for log in logs:
        key = log.resolve()
        if key in seen:
            also = f" (as {seen[key]} too)" if seen[key] != log else ""
            raise UserError(f"{log}: the same log given twice{also}")
        seen[key] = log


def _drawable_records(path: Path, log_scale: bool) -> list[dict[str, Any]]:
    """The records of the log at `path`, refused in one line where there is nothing to draw, or (with
    `log_scale`) a loss that no log scale can draw."""
    records = read_metrics(path)
    if not records:  # an empty picture, exit 0, looked like a broken run
        raise UserError(f"{path}: no metrics logged yet (the first come after train.log_every updates)")
    if not any("step" in r for r in records):  # records, but none to draw: not "none logged yet"
        raise UserError(f"{path}: no record has a 'step' (the update each is drawn at), so there is nothing "
                        "to draw")
    if log_scale:
        for key, *_ in LOSSES:
            step = next((r["step"] for r in records if "step" in r and r.get(key, 1) <= 0), None)
            if step is not None:  # matplotlib put it at the axis's foot, or failed: an NLL of 0, hand-made
                raise UserError(f"{path}: update {step}: {key!r} is not positive, which a log scale cannot "
                                "draw; draw it without the log scale")
    return records


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png_output(png: Path, logs: list[Path]) -> None:
    """Replace an earlier picture, never anything else: `-o` naming a log, a checkpoint's weights or any
    other file (a slip of the shell's completion) lost it to a PNG."""
    check_file_output(png, logs)
    if png.is_file():
        try:
            with open(png, "rb") as f:
                head = f.read(len(PNG_SIGNATURE))
        except OSError as e:
            raise UserError(f"{png}: cannot read ({e.strerror or e})") from None
        if head not in (PNG_SIGNATURE, b""):
            raise UserError(f"{png}: exists and is not a PNG picture; will not replace it")
    if png.suffix.lower() != ".png":  # x.pdf got PNG bytes; `-o bdir` (a folder meant) a file named bdir
        raise UserError(f"{png}: the curves are drawn as a PNG picture; name the file .png")
    _check_not_another_runs_curves(png, logs)


def _check_not_another_runs_curves(png: Path, logs: list[Path]) -> None:
    """A run's own curves.png is its log's picture, which training redraws: `plot runs/a runs/b -o
    runs/a/curves.png` put the overlay there, `plot runs/a -o runs/b/curves.png` run a's curves as run
    b's. Drawing the run's own log there (`plot RUN`, training) is as training draws it. The picture is
    the one written: through a link to a run's curves.png (which the write follows), and Curves.png too
    (the same file on a case-insensitive file system, macOS's or Windows')."""
    from aiayn.train.state import LOCK, checkpoint_dirs

    real = resolved(png)
    run = real.parent
    if real.name.lower() != "curves.png" or not ((run / "metrics.jsonl").is_file() or (run / LOCK).exists()
                                                 or checkpoint_dirs(run)):
        return
    if [log.resolve() for log in logs] != [(run / "metrics.jsonl").resolve()]:
        if png.is_symlink():
            which = f"a link to run {run}'s"
        else:  # `-o curves.png` in the run's folder named it ".", as _check_plottable names a folder
            which = f"run {png.parent}" + (f" ({run})" if png.parent.name in ("", "..") else "") + "'s"
        raise UserError(f"{png}: {which} own curves, which training redraws from its metrics.jsonl; "
                        "name another picture (-o FILE.png)")


def _points(records: list[dict[str, Any]], key: str) -> tuple[list, list]:
    """The (step, value) pairs of the records that have `key`. A record without it is left out of
    this curve only: the log holds records of several kinds (a validation without a validation set
    has no `valid_nll`; a log from an older version may lack `nll`), and one sparse record is no
    reason to refuse the picture of all the others. A step logged twice keeps its last record: a run
    killed after logging it and resumed from an earlier checkpoint logs it again, and the curve should
    follow the run that went on, not zigzag between the two."""
    latest = {r["step"]: r[key] for r in records if "step" in r and key in r}
    steps = sorted(latest)
    return steps, [latest[s] for s in steps]


def _bleu_series(records: list[dict[str, Any]]) -> list[tuple[str, list, list]]:
    """(sacreBLEU signature, steps, values) of the validation BLEU, a series each time the signature
    changes: a --resume with another train.bleu_lang scores on another scale (13a BLEU 4.5, then char
    BLEU 21.3), which one line joined and one best compared; another sacreBLEU version alone does not. A
    record without a signature, or with one that is no text (a hand's edit), goes on the series before it."""
    steps, values = _points(records, "valid_bleu")
    signatures = {step: _without_version(signature)
                  for step, signature in zip(*_points(records, "bleu_signature"))
                  if isinstance(signature, str)}
    series: list[tuple[str, list, list]] = []
    for step, value in zip(steps, values):
        signature = signatures.get(step, series[-1][0] if series else "")
        if not series or series[-1][0] != signature:
            series.append((signature, [], []))
        series[-1][1].append(step)
        series[-1][2].append(value)
    return series


def _without_version(signature: str) -> str:
    """A sacreBLEU signature less its version field: an upgrade scores on the same scale."""
    return "|".join(f for f in signature.split("|") if not f.startswith("version:"))


def _signature_label(signature: str, all_signatures: set[str]) -> str:
    """The fields of `signature` that not every one of `all_signatures` shares (tok:13a, tok:char)."""
    shared = set.intersection(*(set(s.split("|")) for s in all_signatures))
    return "|".join(f for f in signature.split("|") if f not in shared) or "(no signature)"


def _best(pick, values: list[float], steps: list[int]) -> tuple[float, int]:
    """(value, step) of the best of `values` by `pick` (min or max), NaNs left out: a NaN compares as
    neither larger nor smaller, so a first NaN was taken as the best; (nan, first step) if all are."""
    real = [(v, s) for v, s in zip(values, steps) if not math.isnan(v)]
    # by value alone: min and max then keep the first of a tie (steps ascend); comparing (value, step)
    # gave min the first update of a tied loss and max the last of a tied BLEU
    return pick(real, key=lambda pair: pair[0], default=(math.nan, steps[0]))


# The loss panel's curves: key, label, line style, marker (solid: label-smoothed, dashed: NLL; dots: the
# validations). One run's curves have a colour each too; several runs' have their run's colour.
LOSSES = (
    # "smoothed" alone read as a moving average: it is the label-smoothed loss (the paper's section 5.4)
    ("loss", "train loss (label-smoothed)", "-", None),
    ("nll", "train NLL", "--", None),
    ("valid_loss", "valid loss (label-smoothed)", "-", "o"),
    ("valid_nll", "valid NLL", "--", "o"),
)
BLEU_MARKERS = "os^Dv<>p"  # several runs: a marker a BLEU scale (signature), where one run has a colour each


def _draw(runs: list[tuple[str, list[dict[str, Any]]]], log_scale: bool = False):
    """The curves' figure of `runs`, (name, records) each, made without pyplot: `matplotlib.use("Agg")`
    switched a notebook's backend (inline plots) for the rest of its session, and pyplot keeps every figure
    until it is closed. One run is the usual case; several are overlaid, a colour a run, named above."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    bleu = [(name, _bleu_series(records)) for name, records in runs]  # with train.bleu_every: a third panel
    has_bleu = any(series for _, series in bleu)
    fig = Figure(figsize=(16 if has_bleu else 11, 4 if len(runs) == 1 else 4.5), layout="constrained")
    axes = fig.subplots(1, 3 if has_bleu else 2)
    # None: a colour a curve; tab20's pairs of a hue past 10 runs
    palette = [f"C{i}" for i in range(10)] if len(runs) <= 10 else list(colormaps["tab20"].colors)
    colours = palette[: len(runs)] if len(runs) > 1 else [None]
    for (name, records), colour in zip(runs, colours):
        _draw_losses(axes[0], name, records, colour)
        steps, lrs = _points(records, "lr")
        if steps:
            axes[1].plot(steps, lrs, marker="o" if len(steps) == 1 else None, color=colour, gid=name,
                         markersize=3)
    _finish_losses(axes[0], runs, log_scale)
    axes[1].set_ylabel("learning rate")
    for ax, what in ((axes[0], "no loss"), (axes[1], "no learning rate")):  # else bare axes at -0.04..0.04
        if not any(math.isfinite(y) for line in ax.lines for y in line.get_ydata()):
            ax.text(0.5, 0.5, f"{what} logged (or none finite)", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
    if has_bleu:
        _draw_bleu(axes[2], bleu, colours)
    steps = [r["step"] for _, records in runs for r in records if "step" in r]
    for ax in axes:
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        _whole_updates(ax, steps)
    if len(runs) > 1:
        fig.legend([Line2D([], [], color=colour) for colour in colours], [name for name, _ in runs],
                   loc="outside upper center", ncols=min(len(runs), 5), frameon=False)
    return fig


def _draw_losses(ax, name: str, records: list[dict[str, Any]], colour: str | None) -> None:
    for key, label, linestyle, marker in LOSSES:
        steps, values = _points(records, key)
        if steps:  # one point of a line draws nothing: a run stopped after its first log_every
            ax.plot(steps, values, linestyle=linestyle, marker="o" if len(steps) == 1 else marker,
                    color=colour, label=label, gid=name, markersize=3)


def _finish_losses(ax, runs: list[tuple[str, list[dict[str, Any]]]], log_scale: bool) -> None:
    """The loss panel's axis, legend of the curves (several runs: in grey, each run's colour named above)
    and title, the best validation NLL of all runs."""
    from matplotlib.lines import Line2D

    ax.set_ylabel("nats per target token")
    if log_scale:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_plain_log_labels())
        ax.yaxis.set_minor_formatter(_plain_log_labels(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    if len(runs) > 1:
        drawn = {line.get_label() for line in ax.lines}
        ax.legend(handles=[Line2D([], [], linestyle=linestyle, marker=marker, markersize=3, color="0.35",
                                  label=label)
                           for _, label, linestyle, marker in LOSSES if label in drawn])
    elif ax.lines:
        ax.legend()
    points = [(name, *_points(records, "valid_nll")) for name, records in runs]
    if any(steps for _, steps, _ in points):
        nll, step, name = _best_of(min, points)
        of = f"\nof {name}" if len(runs) > 1 else ""  # a line of its own: a long name ran past the panel
        ax.set_title(f"best valid NLL {nll:.3f} (ppl {shown_ppl(nll, 2)}) at update {step}{of}"
                     if not math.isnan(nll) else "valid NLL: not a number at every validation")


def _plain_log_labels(**kwargs):
    """matplotlib's log-scale labels, at the ticks it chooses to label, as plain numbers: 6, 0.1 (a loss
    axis read 6×10⁰ and 1e-01)."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter(**kwargs)


def _draw_bleu(ax, bleu: list[tuple[str, list[tuple[str, list, list]]]], colours: list[str | None]) -> None:
    """A line per run and signature's series: one run's in a colour each, labelled where there are several;
    several runs' in their run's colour, a marker a signature. The best is on the scale that the (first)
    run scores on now, its last signature."""
    from matplotlib.lines import Line2D

    signatures = list(dict.fromkeys(signature for _, series in bleu for signature, _, _ in series))
    labels = {s: _signature_label(s, set(signatures)) for s in signatures} if len(signatures) > 1 else {}
    markers = {s: BLEU_MARKERS[i % len(BLEU_MARKERS)] if len(bleu) > 1 else "o"
               for i, s in enumerate(signatures)}
    for (name, series), colour in zip(bleu, colours):
        for signature, steps, values in series:
            ax.plot(steps, values, marker=markers[signature], markersize=3, color=colour, gid=name,
                    label=labels.get(signature))
    if labels:
        ax.legend(handles=[Line2D([], [], linestyle="", marker=markers[s], color="0.35", label=labels[s])
                           for s in signatures] if len(bleu) > 1 else None)
    ax.set_ylabel("valid BLEU (greedy, sacreBLEU)")
    last = next(series[-1][0] for _, series in bleu if series)
    points = [(name, [step for s, steps, _ in series if s == last for step in steps],
               [value for s, _, values in series if s == last for value in values]) for name, series in bleu]
    best, at, name = _best_of(max, points)
    of = f"\nof {name}" if len(bleu) > 1 else ""
    where = f" ({labels[last]})" if labels else ""
    ax.set_title(f"best valid BLEU {best:.2f} at update {at}{where}{of}" if not math.isnan(best)
                 else "valid BLEU: not a number at every validation")


def _best_of(pick, points: list[tuple[str, list[int], list[float]]]) -> tuple[float, int, str]:
    """(value, step, run) of the best by `pick` of the (run, steps, values) of every run that has values,
    NaNs left out: the first run's of a tie; (nan, its first step, first run) if all are NaN."""
    bests = [(*_best(pick, values, steps), name) for name, steps, values in points if steps]
    return pick((b for b in bests if not math.isnan(b[0])), key=lambda b: b[0], default=bests[0])


def _whole_updates(ax, run_steps: list) -> None:
    """Tick a panel's update axis at whole updates: a short run's ticks were 0.96, 0.98, ... or 1.25, 1.5.
    The span is that of the points the panel draws (matplotlib leaves out one that is not finite): the
    run's, 1 to 6, beside a BLEU panel of update 6 alone, ticked it 5.68, 5.76, ... A panel with no point
    (its text says so) spans the run's updates, not matplotlib's -0.06 to 0.06. Past 9,999 updates the
    labels are short (25k, 1.5M): six digits a label ran together from 150k updates (`75000100000125000`)."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    drawn = [x for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata()) if math.isfinite(y)]
    steps = drawn or run_steps
    if not steps:
        return
    if max(map(abs, steps)) >= 10_000:
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 0, 25k, 50k; below 10k the whole numbers
    if max(steps) - min(steps) < 2:  # under two updates apart: no two whole ticks to show
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    elif not drawn:
        ax.set_xlim(min(steps), max(steps))


def _write_png(data: bytes, path: Path) -> None:
    """Write `data` with `atomic_output` (temporary sibling, fsync, rename; an OSError becomes a
    UserError naming `path`). Missing directories are made, as `write_atomically` makes them."""
    with directory_for(path.parent, path), atomic_output(path, binary=True) as f:
        f.write(data)
