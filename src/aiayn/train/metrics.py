"""The metrics log (one JSON object per line) and a PNG of its curves."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from aiayn.data.dataset import SIGNATURES
from aiayn.errors import UserError
from aiayn.files import atomic_output, check_file_output, directory_for

log = logging.getLogger(__name__)
PPL_CAP = 50  # nats: exp overflows past ~709; the perplexity logged, printed and drawn is exp of at most this


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


def plot_metrics(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Loss and NLL (train and validation) and the learning rate against the update number, as a
    PNG written atomically (the old picture stays if writing fails); a missing directory is made. Never
    inside a checkpoint or a run's checkpoints/: training's keep_last deletes those whole (Python callers
    too)."""
    from aiayn.train.state import check_outside_checkpoints

    # first: "names a directory; give the picture's file name, such as ck/curves.png" of a checkpoint
    # offered a place refused next
    check_outside_checkpoints(Path(png_path))
    if str(png_path).endswith(("/", os.sep)) or Path(png_path).is_dir():  # Path drops a slash: `-o pics/`
        raise UserError(f"{png_path}: names a directory; give the picture's file name, such as "
                        f"{Path(png_path) / 'curves.png'}")
    _check_png_output(Path(png_path), Path(jsonl_path))
    records = read_metrics(jsonl_path)
    if not any("step" in r for r in records):  # an empty picture, exit 0, looked like a broken run
        raise UserError(f"{jsonl_path}: no metrics logged yet (the first come after train.log_every updates)")
    png = io.BytesIO()
    _draw(records).savefig(png, format="png", dpi=100)
    png_path = Path(png_path)
    _write_png(png.getvalue(), png_path)
    return png_path


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png_output(png: Path, log: Path) -> None:
    """Replace an earlier picture, never anything else: `-o` naming the log, a checkpoint's weights or any
    other file (a slip of the shell's completion) lost it to a PNG."""
    check_file_output(png, [log])
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


def _draw(records: list[dict[str, Any]]):
    """The curves' figure, made without pyplot: `matplotlib.use("Agg")` switched a notebook's backend
    (inline plots) for the rest of its session, and pyplot keeps every figure until it is closed."""
    from matplotlib.figure import Figure

    bleu_series = _bleu_series(records)  # with train.bleu_every: a third panel
    fig = Figure(figsize=(16 if bleu_series else 11, 4))
    axes = fig.subplots(1, 3 if bleu_series else 2)
    ax_loss, ax_lr = axes[0], axes[1]
    for key, label, style in (
        # "smoothed" alone read as a moving average: it is the label-smoothed loss (the paper's section 5.4)
        ("loss", "train loss (label-smoothed)", "-"),
        ("nll", "train NLL", "-"),
        ("valid_loss", "valid loss (label-smoothed)", "o-"),
        ("valid_nll", "valid NLL", "o-"),
    ):
        steps, values = _points(records, key)
        if steps:  # one point of a line style draws nothing: a run stopped after its first log_every
            ax_loss.plot(steps, values, "o-" if len(steps) == 1 else style, label=label, markersize=3)
    ax_loss.set_xlabel("update")
    ax_loss.set_ylabel("nats per target token")
    if ax_loss.lines:
        ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    steps, nlls = _points(records, "valid_nll")
    if steps:
        nll, step = _best(min, nlls, steps)
        ax_loss.set_title(f"best valid NLL {nll:.3f} (ppl {shown_ppl(nll, 2)}) at update {step}"
                          if not math.isnan(nll) else "valid NLL: not a number at every validation")
    lr_steps, lrs = _points(records, "lr")
    ax_lr.plot(lr_steps, lrs, "o-" if len(lr_steps) == 1 else "-", markersize=3)
    for ax, what in ((ax_loss, "no loss"), (ax_lr, "no learning rate")):  # else bare axes at -0.04..0.04
        if not any(math.isfinite(y) for line in ax.lines for y in line.get_ydata()):
            ax.text(0.5, 0.5, f"{what} logged (or none finite)", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
    ax_lr.set_xlabel("update")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    if bleu_series:
        _draw_bleu(axes[2], bleu_series)
    steps = [r["step"] for r in records if "step" in r]
    for ax in axes:
        _whole_updates(ax, steps)
    fig.tight_layout()
    return fig


def _draw_bleu(ax, series: list[tuple[str, list, list]]) -> None:
    """One line per signature's series, labelled where there are several; the best of the last
    signature's, the scale the run scores on now."""
    signatures = {signature for signature, _, _ in series}
    for signature, steps, values in series:
        label = _signature_label(signature, signatures) if len(signatures) > 1 else None
        ax.plot(steps, values, "o-", markersize=3, label=label)
    if len(signatures) > 1:
        ax.legend()
    ax.set_xlabel("update")
    ax.set_ylabel("valid BLEU (greedy, sacreBLEU)")
    last = series[-1][0]
    steps = [step for signature, s, _ in series if signature == last for step in s]
    values = [value for signature, _, v in series if signature == last for value in v]
    best, at = _best(max, values, steps)
    where = f" ({_signature_label(last, signatures)})" if len(signatures) > 1 else ""
    ax.set_title(f"best valid BLEU {best:.2f} at update {at}{where}" if not math.isnan(best)
                 else "valid BLEU: not a number at every validation")
    ax.grid(alpha=0.3)


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
