"""The metrics log (one JSON object per line) and a PNG of its curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aiayn.errors import UserError


class MetricsLog:
    """Appends records to `metrics.jsonl`; each line is flushed, so a crash loses at most one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no metrics log")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{n}: not a JSON object") from None
    return records


def plot_metrics(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Loss and NLL (train and validation) and the learning rate against the update number."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, key, label, style in (
        (train, "loss", "train loss (smoothed)", "-"),
        (train, "nll", "train NLL", "-"),
        (valid, "valid_loss", "valid loss (smoothed)", "o-"),
        (valid, "valid_nll", "valid NLL", "o-"),
    ):
        if rows:
            ax_loss.plot([r["step"] for r in rows], [r[key] for r in rows], style, label=label, markersize=3)
    ax_loss.set_xlabel("update")
    ax_loss.set_ylabel("nats per target token")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if valid:
        best = min(valid, key=lambda r: r["valid_nll"])
        ax_loss.set_title(
            f"best valid NLL {best['valid_nll']:.3f} (ppl {math.exp(best['valid_nll']):.2f}) "
            f"at {best['step']}"
        )
    if train:
        ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train])
    ax_lr.set_xlabel("update")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
