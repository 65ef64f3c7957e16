"""Look inside a model: its attention weights for one sentence pair, drawn as heatmaps.

`record_attention(model)` switches on the recorder every `MultiHeadAttention` carries: while it is
open, each attention call also computes softmax(Q K^T / sqrt(d_k)) from the very Q and K that SDPA
received and appends it to that module's list. The model's output still comes from SDPA alone, so
asking for the weights does not change the logits.

Dimension key: L layers, H heads, S source length, T target length (decoder positions).
Three kinds of attention (paper section 3.2.3): encoder self-attention (S x S), masked decoder
self-attention (T x T) and encoder-decoder ("cross") attention (T x S).
"""

from __future__ import annotations

import base64
import html
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import generate
from aiayn.errors import SentenceTooLong
from aiayn.model import Transformer

log = logging.getLogger(__name__)

KINDS = ("encoder", "decoder", "cross")
TITLES = {
    "encoder": "encoder self-attention (rows: queries, columns: keys)",
    "decoder": "decoder self-attention (rows: token predicted, columns: decoder input)",
    "cross": "encoder-decoder attention (rows: token predicted, columns: source)",
}


def attention_modules(model: Transformer) -> dict[str, list]:
    """The model's MultiHeadAttention modules by kind, in layer order."""
    return {
        "encoder": [layer.self_attn for layer in model.encoder],
        "decoder": [layer.self_attn for layer in model.decoder],
        "cross": [layer.src_attn for layer in model.decoder],
    }


@contextmanager
def record_attention(model: Transformer) -> Iterator[dict[str, list[list[Tensor]]]]:
    """Yield records[kind][layer]: a list that gets one (B, H, T, L) weight tensor per attention call.

    One forward pass appends one tensor to every list; incremental decoding appends one per step.
    The recorders are switched off again on exit, even after an error.
    """
    modules = attention_modules(model)
    records = {kind: [[] for _ in mods] for kind, mods in modules.items()}
    for kind, mods in modules.items():
        for module, record in zip(mods, records[kind]):
            module.recorder = record
    try:
        yield records
    finally:
        for mods in modules.values():
            for module in mods:
                module.recorder = None


@dataclass(frozen=True)
class AttentionMaps:
    """The attention weights of one sentence pair, with subword labels for the axes."""

    src_tokens: list[str]  # source pieces and </s>: rows and columns of encoder, columns of cross
    tgt_in_tokens: list[str]  # decoder inputs (start token, then the target shifted right)
    tgt_out_tokens: list[str]  # tokens the decoder predicts at each position, ending with </s>
    encoder: Tensor  # (L, H, S, S)
    decoder: Tensor  # (L, H, T, T)
    cross: Tensor  # (L, H, T, S)
    logits: Tensor  # (T, V) the model's output in the same forward pass

    def weights(self, kind: str) -> Tensor:
        return {"encoder": self.encoder, "decoder": self.decoder, "cross": self.cross}[kind]

    def labels(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of one kind's maps."""
        return {
            "encoder": (self.src_tokens, self.src_tokens),
            "decoder": (self.tgt_out_tokens, self.tgt_in_tokens),
            "cross": (self.tgt_out_tokens, self.src_tokens),
        }[kind]


@torch.no_grad()
def extract_attention(
    model: Transformer, tokenizer: Tokenizer, src: str, tgt: str | None = None
) -> AttentionMaps:
    """Teacher-force `tgt` (or the greedy translation of `src`) through `model`; return every weight."""
    model.eval()
    src_ids = tokenizer.encode_src(src)
    if len(src_ids) > model.config.max_len:
        raise SentenceTooLong(0, len(src_ids), model.config.max_len, "the source")
    src_t = torch.tensor([src_ids])  # (1, S)
    if tgt is None:
        tgt_ids = generate(model, src_t, DecodeConfig(beam=1))[0][0].tokens  # greedy, up to EOS
    else:
        tgt_ids = tokenizer.encode_tgt(tgt) + [tokenizer.eos_id]
        if len(tgt_ids) > model.config.max_len:  # the decoder reads start + all but EOS: as many
            raise SentenceTooLong(0, len(tgt_ids), model.config.max_len, "the target")
    tgt_in = [model.config.decoder_start_id] + tgt_ids[:-1]
    with record_attention(model) as records:
        logits = model(src_t, torch.tensor([tgt_in]))  # (1, T, V)
    # records[kind][layer][0]: the one forward pass, (1, H, rows, cols) -> stacked (L, H, rows, cols)
    stacked = {kind: torch.stack([layer[0][0] for layer in records[kind]]).float() for kind in KINDS}
    return AttentionMaps(
        src_tokens=tokenizer.src_pieces(src),
        tgt_in_tokens=tokenizer.tgt_pieces(tgt_in),
        tgt_out_tokens=tokenizer.tgt_pieces(tgt_ids),
        logits=logits[0],
        **stacked,
    )


def plot_kind(maps: AttentionMaps, kind: str, path: str | Path) -> Path:
    """One PNG: a grid of heatmaps, a row per layer and a column per head, tokens on the axes."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; a no-op if pyplot already chose a backend
    import matplotlib.pyplot as plt

    weights = maps.weights(kind).numpy()  # (L, H, R, C)
    rows, cols = maps.labels(kind)
    n_layers, n_heads = weights.shape[:2]
    cell = 0.22  # inches per token: room for a readable label
    w, h = max(1.5, cell * len(cols)), max(1.5, cell * len(rows))
    label = 0.12 * max(map(len, rows + cols))  # inches of the longest tick label
    size = (w * n_heads + label + 1.5, h * n_layers + label + 1.0)
    fig, axes = plt.subplots(n_layers, n_heads, figsize=size, squeeze=False, layout="constrained")
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer][head]
            image = ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            # Every map of a kind shares its axes: label the left column and the bottom row only.
            ax.set_yticks(range(len(rows)), rows if head == 0 else [], fontsize=7)
            ax.set_xticks(range(len(cols)), cols if layer == n_layers - 1 else [], rotation=90, fontsize=7)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
    fig.suptitle(TITLES[kind], fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_html(maps: AttentionMaps, pngs: dict[str, Path], path: str | Path, title: str) -> Path:
    """One self-contained page: the sentence pair and each kind's PNG embedded as base64."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}img{max-width:100%}code{background:#eee}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        f"<p>source pieces: <code>{html.escape(' '.join(maps.src_tokens))}</code></p>",
        f"<p>target pieces: <code>{html.escape(' '.join(maps.tgt_out_tokens))}</code></p>",
    ]
    for kind, png in pngs.items():
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(TITLES[kind])}</h2>")
        parts.append(f"<img alt='{kind}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>\n")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def draw_attention(maps: AttentionMaps, out_dir: str | Path, title: str = "attention") -> dict[str, Path]:
    """Write attention_{encoder,decoder,cross}.png and attention.html into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = {kind: plot_kind(maps, kind, out_dir / f"attention_{kind}.png") for kind in KINDS}
    page = write_html(maps, pngs, out_dir / "attention.html", title)
    log.info("attention maps written to %s", out_dir)
    return {**pngs, "html": page}
