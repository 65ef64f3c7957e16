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
import dataclasses
import html
import io
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import generate
from aiayn.errors import SentenceTooLong, UserError, check_unicode
from aiayn.files import atomic_output, check_directory_path, directory_for
from aiayn.model import Transformer, evaluating

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
    Under beam search the shapes follow the search's layout instead: self-attention rows are the live
    beams, and cross-attention, which a sentence's beams share, folds its K beams into the query axis,
    (B, H, K x T, S). Recordings may nest (`extract_attention` inside one): each gets every call made
    while it is open. The recorders are switched off again on exit, even after an error.
    """
    modules = attention_modules(model)
    records = {kind: [[] for _ in mods] for kind, mods in modules.items()}
    thread = threading.get_ident()
    with _RECORDING:
        for kind, mods in modules.items():
            for module, record in zip(mods, records[kind]):
                if module.recorder is None:
                    module.recorder = _Recorders()
                module.recorder.by_thread.setdefault(thread, []).append(record)
    try:
        yield records
    finally:
        with _RECORDING:
            for kind, mods in modules.items():
                for module, record in zip(mods, records[kind]):
                    module.recorder.remove(thread, record)
                    if not module.recorder.by_thread:
                        module.recorder = None


_RECORDING = threading.Lock()  # around installing and removing recorders, which threads share


class _Recorders:
    """A module's open records by recording thread, each getting that thread's calls alone: a
    `Translator`'s model may be translating, or drawn, in another thread meanwhile, whose calls landed in
    the one record (wrong maps, silently), and whose recorder replaced and then removed this one's.
    A thread's recordings may nest, so it has a list of them, and every call goes to each: with one
    record per thread the inner one replaced the outer's, which missed the calls from then on and
    raised on its own exit."""

    def __init__(self) -> None:
        self.by_thread: dict[int, list[list[Tensor]]] = {}

    def append(self, weights: Tensor) -> None:
        for record in self.by_thread.get(threading.get_ident(), ()):
            record.append(weights)

    def remove(self, thread: int, record: list[Tensor]) -> None:
        """Close `thread`'s `record`, found by identity: records of equal contents are other recordings'
        (and comparing lists of tensors raises), and a generator may close them out of order."""
        records = self.by_thread[thread]
        del records[next(i for i, r in enumerate(records) if r is record)]
        if not records:
            del self.by_thread[thread]


@dataclass(frozen=True)
class AttentionMaps:
    """The attention weights of one sentence pair, with subword labels for the axes."""

    src_tokens: list[str]  # source pieces and </s>: rows and columns of encoder, columns of cross
    tgt_in_tokens: list[str]  # decoder inputs (start token, then the target shifted right)
    tgt_out_tokens: list[str]  # tokens the decoder predicts at each position, ending with </s> (not when
    # `target` is "greedy_cut": the greedy translation ran to the length limit without one)
    encoder: Tensor  # (L, H, S, S)
    decoder: Tensor  # (L, H, T, T)
    cross: Tensor  # (L, H, T, S)
    logits: Tensor  # (T, V) the model's output in the same forward pass
    target: str = "given"  # what the decoder read: "given" (teacher-forced), "greedy" (the model's own)
    # or "greedy_cut" (the model's own, cut at the length limit)
    layers: tuple[int, ...] = ()  # the 1-based layer numbers asked of `select`; () = all
    heads: tuple[int, ...] = ()  # the same for heads
    # after `select`: each stack's numbers of the layers held (those of `layers` the stack has)
    kind_layers: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def weights(self, kind: str) -> Tensor:
        return {"encoder": self.encoder, "decoder": self.decoder, "cross": self.cross}[kind]

    def layer_numbers(self, kind: str) -> tuple[int, ...]:
        if self.layers:
            return self.kind_layers[kind]
        return tuple(range(1, self.weights(kind).shape[0] + 1))

    def head_numbers(self) -> tuple[int, ...]:
        return self.heads or tuple(range(1, self.encoder.shape[1] + 1))

    def select(self, layers: Sequence[int] = (), heads: Sequence[int] = ()) -> AttentionMaps:
        """These maps for some layers and heads only (1-based, as the pictures number them; empty: all):
        a 6 x 8 grid of 100-token maps has 2-point labels, one layer or head of it readable ones.
        A layer number picks that layer in each stack that has it: with 3 encoder and 1 decoder layers,
        layer 3 is the encoder's alone, and the decoder's kinds then hold no map."""
        if self.layers or self.heads:  # numbers would refer to positions in the selection
            raise ValueError("select() on maps that are already a selection")
        layers, heads = tuple(dict.fromkeys(layers)), tuple(dict.fromkeys(heads))  # 2,2 drew one map twice
        n_layers = max(self.encoder.shape[0], self.decoder.shape[0])
        check_selection(layers, heads, n_layers, self.encoder.shape[1])
        kind_layers = {kind: tuple(n for n in layers if n <= self.weights(kind).shape[0]) for kind in KINDS}

        def pick(kind: str) -> Tensor:  # (L, H, R, C) -> (L', H', R, C)
            w = self.weights(kind)
            w = w[[n - 1 for n in kind_layers[kind]]] if layers else w
            return w[:, [n - 1 for n in heads]] if heads else w

        return dataclasses.replace(
            self, encoder=pick("encoder"), decoder=pick("decoder"), cross=pick("cross"), layers=layers,
            heads=heads, kind_layers=kind_layers if layers else {})

    def labels(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of one kind's maps."""
        return {
            "encoder": (self.src_tokens, self.src_tokens),
            "decoder": (self.tgt_out_tokens, self.tgt_in_tokens),
            "cross": (self.tgt_out_tokens, self.src_tokens),
        }[kind]


def check_selection(layers: Sequence[int], heads: Sequence[int], n_layers: int, n_heads: int) -> None:
    """Layer and head numbers (1-based) that a model of `n_layers` (its deeper stack) and `n_heads` has."""
    for name, chosen, count in (("layer", layers, n_layers), ("head", heads, n_heads)):
        if bad := [n for n in chosen if not 1 <= n <= count]:
            raise UserError(f"{name} {bad[0]}: choose {name}s from 1 to {count}")


# Why refuse rather than shrink: a map needs about 0.22 inch (24 px at 110 dpi) per token for its 7-point
# tick labels; past ~100 tokens a map is a blur whose labels cannot be read, and at 0.22 inch a 150-word
# source already drew a 14834 x 7510 px encoder grid (16 s, 1.6 GB; 1,000 words were killed at 24 GB).
# Refusing up front, before the model runs, is cheaper and clearer than a picture nobody can read.
MAX_TOKENS = 100  # source or target tokens (with EOS) drawn at most
CELL_INCHES = 0.22  # per token: room for a 7-point tick label
MAX_FIGURE_INCHES = 60.0  # per side (6600 px at DPI): bounds memory when a model has many heads or layers
DPI = 110


@torch.no_grad()
def extract_attention(
    model: Transformer, tokenizer: Tokenizer, src: str, tgt: str | None = None, max_tokens: int | None = MAX_TOKENS
) -> AttentionMaps:
    """Teacher-force `tgt` (or the greedy translation of `src`) through `model`; return every weight.

    A side with more than `max_tokens` tokens is refused (None: no limit), before the model runs where
    the length is known (all but the greedy translation's). The model runs in eval mode and is left in
    the mode it was in (a model inspected in the middle of training trained on without dropout).
    """
    for side, text, allowed in (("src", src, str), ("tgt", tgt, (str, type(None)))):
        if not isinstance(text, allowed):  # bytes or a list: an AttributeError from deep inside
            raise TypeError(f"{side} is {type(text).__name__}: one sentence, as a str")
    if isinstance(model, Ensemble):  # an AttributeError: 'Ensemble' object has no attribute 'tgt_embed'
        raise TypeError("attention maps are of one model, not an Ensemble: pass a member of it "
                        "(model.members[i])")
    with evaluating(model):
        return _extract(model, tokenizer, src, tgt, max_tokens)


def _extract(model: Transformer, tokenizer: Tokenizer, src: str, tgt: str | None, max_tokens: int | None
             ) -> AttentionMaps:
    """`extract_attention` of a model in eval mode."""
    # the ids where the model is (they were on the CPU always); the embedding, as a packed or int8
    # generator has no weight tensor
    device = model.tgt_embed.embed.weight.device
    check_unicode(src, "the source")
    if tgt is not None:
        check_unicode(tgt, "the target")
    if not src.strip():
        raise UserError("the source is empty: there is nothing to attend to")
    if tgt is not None and not tgt.strip():
        raise UserError("the target is empty (leave it out to draw the model's own translation)")
    src_ids = tokenizer.encode_src(src)
    if len(src_ids) < 2:  # only EOS: a zero-width space or control characters, which the tokenizer drops
        raise UserError("the source has no piece the tokenizer reads: there is nothing to attend to")
    # the drawing's limit first where it is the lower: 2,001 tokens were told the model's 1,024 positions, and
    # a source trimmed to 1,000 then the drawing's 100
    check_drawable(len(src_ids), "the source", max_tokens)
    if len(src_ids) > model.config.max_len:
        raise SentenceTooLong(0, len(src_ids), model.config.max_len, "the source")
    src_t = torch.tensor([src_ids], device=device)  # (1, S)
    if tgt is None:
        tgt_ids = generate(model, src_t, DecodeConfig(beam=1))[0][0].tokens  # greedy, up to EOS
    else:
        tgt_ids = tokenizer.encode_tgt(tgt) + [tokenizer.eos_id]
        if len(tgt_ids) < 2:  # only zero-width or control characters, which the tokenizer drops
            raise UserError("the target has no piece the tokenizer reads (leave it out to draw the model's "
                            "own translation)")
        check_drawable(len(tgt_ids), "the target", max_tokens)  # first, as the source's
        if len(tgt_ids) > model.config.max_len:  # the decoder reads start + all but EOS: as many
            raise SentenceTooLong(0, len(tgt_ids), model.config.max_len, "the target")
    ended = tgt is not None or (bool(tgt_ids) and tgt_ids[-1] == tokenizer.eos_id)
    if tgt is None:  # a model that repeats itself: its own output can run to the length limit
        check_drawable(len(tgt_ids), "the greedy translation", max_tokens, " (give a target to draw instead)",
                       eos=ended)
        if not ended:  # drawn as if it were the model's whole answer, with nothing said
            log.warning("the greedy translation reached the length limit (%d tokens) without </s>: the maps "
                        "show it cut there", len(tgt_ids))
    tgt_in = [model.config.decoder_start_id] + tgt_ids[:-1]
    with record_attention(model) as records:
        logits = model(src_t, torch.tensor([tgt_in], device=device))  # (1, T, V)
    # records[kind][layer][0]: the one forward pass, (1, H, rows, cols) -> stacked (L, H, rows, cols)
    stacked = {kind: torch.stack([layer[0][0] for layer in records[kind]]).float().cpu() for kind in KINDS}
    return AttentionMaps(
        src_tokens=source_labels(tokenizer, src, src_ids),
        tgt_in_tokens=tokenizer.tgt_pieces(tgt_in),
        tgt_out_tokens=tokenizer.tgt_pieces(tgt_ids),
        logits=logits[0].cpu(),
        target="given" if tgt is not None else "greedy" if ended else "greedy_cut",
        **stacked,
    )


def check_drawable(tokens: int, side: str, max_tokens: int | None = MAX_TOKENS, hint: str = "",
                   eos: bool = True) -> None:
    """`eos`: the count includes an EOS (a greedy translation cut at its length limit has none)."""
    if max_tokens is not None and tokens > max_tokens:
        raise UserError(f"{side}: {tokens} tokens{' (with EOS)' if eos else ''}, more than {max_tokens}; "
                        f"attention maps of more tokens are unreadable, so they are not drawn{hint}")


def source_labels(tokenizer: Tokenizer, src: str, src_ids: list[int]) -> list[str]:
    """The source pieces as the model saw them: a piece it read as `unk_id` (an emoji, a CJK character
    outside the vocabulary) is labelled <unk>, not with the text it never saw."""
    pieces = tokenizer.src_pieces(src)  # one per id, a Marian language code (>>fra<<) included
    return ["<unk>" if i == tokenizer.unk_id else p for p, i in zip(pieces, src_ids)]


def figure_layout(n_layers: int, n_heads: int, n_rows: int, n_cols: int) -> tuple[float, float]:
    """(inches per token, font size) for a grid of n_layers x n_heads maps of n_rows x n_cols tokens:
    CELL_INCHES, shrunk so that neither side of the grid passes MAX_FIGURE_INCHES, the font with it."""
    fit = min(MAX_FIGURE_INCHES / (n_heads * max(n_cols, 1)), MAX_FIGURE_INCHES / (n_layers * max(n_rows, 1)))
    cell = min(CELL_INCHES, fit)
    return cell, 7.0 * cell / CELL_INCHES


# Fonts that matplotlib falls back to, in order, for labels DejaVu Sans lacks (Chinese, Japanese, Korean,
# Devanagari, Thai, emoji...), when installed; none ships with matplotlib.
FALLBACK_FONTS = ("Noto Sans CJK JP", "Noto Sans CJK SC", "Source Han Sans", "WenQuanYi Zen Hei",
                  "Droid Sans Fallback", "Noto Sans Devanagari", "Noto Sans Thai", "Noto Color Emoji",
                  "Arial Unicode MS")


def label_fonts() -> list[str]:
    """DejaVu Sans (matplotlib's own) and the installed `FALLBACK_FONTS`, for matplotlib's per-glyph fallback."""
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    return ["DejaVu Sans"] + [name for name in FALLBACK_FONTS if name in installed]


def render_kind(maps: AttentionMaps, kind: str) -> tuple[bytes, set[str]]:
    """One PNG, in memory: a grid of heatmaps, a row per layer and a column per head, tokens on the axes;
    and the label characters that no installed font has (drawn as boxes)."""
    import matplotlib  # no pyplot: matplotlib.use("Agg") switched a notebook's backend for its session

    fonts = {"font.family": label_fonts()}
    with matplotlib.rc_context(fonts), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # matplotlib's multi-line warning per missing glyph: counted, not shown
        png = _render(maps, kind)
    missing = set()
    for w in caught:
        found = re.match(r"Glyph (\d+) ", str(w.message))
        if found:
            missing.add(chr(int(found.group(1))))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return png, missing


def _render(maps: AttentionMaps, kind: str) -> bytes:
    """`render_kind`'s figure."""
    from matplotlib.figure import Figure

    weights = maps.weights(kind).numpy()  # (L, H, R, C)
    rows, cols = maps.labels(kind)
    layer_numbers, head_numbers = maps.layer_numbers(kind), maps.head_numbers()
    n_layers, n_heads = weights.shape[:2]
    cell, font = figure_layout(n_layers, n_heads, len(rows), len(cols))
    w, h = max(1.5, cell * len(cols)), max(1.5, cell * len(rows))
    label = 0.12 * font / 7.0 * max(map(len, rows + cols))  # inches of the longest tick label
    size = (min(w * n_heads, MAX_FIGURE_INCHES) + label + 1.5, min(h * n_layers, MAX_FIGURE_INCHES) + label + 1.0)
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer][head]
            image = ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            # Every map of a kind shares its axes: ticks and labels on the left column and the bottom row
            # only (a tick is a handful of matplotlib objects: ticks on every map took half the time).
            # parse_math=False: a piece such as "$$" or "$x$" is text, not matplotlib's math (which
            # raised on "$$" and drew "$x$" as an italic x)
            left, bottom = head == 0, layer == n_layers - 1
            ax.set_yticks(range(len(rows)) if left else [], rows if left else [], fontsize=font,
                          parse_math=False)
            ax.set_xticks(range(len(cols)) if bottom else [], cols if bottom else [], rotation=90,
                          fontsize=font, parse_math=False)
            ax.set_title(f"layer {layer_numbers[layer]}, head {head_numbers[head]}", fontsize=9)
    fig.suptitle(TITLES[kind], fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    png = io.BytesIO()
    fig.savefig(png, dpi=DPI, bbox_inches="tight")
    return png.getvalue()


TARGETS = {  # what the decoder read, said on the page: a greedy translation can differ from translate's beam 4
    "given": "the given target, teacher-forced",
    "greedy": "the model's greedy translation, which can differ from aiayn translate's beam search",
    "greedy_cut": "the model's greedy translation, cut at the length limit without reaching </s>; it can "
                  "differ from aiayn translate's beam search",
}


def html_page(maps: AttentionMaps, pngs: dict[str, bytes], title: str) -> str:
    """One self-contained page: the sentence pair and each kind's PNG embedded as base64."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}img{max-width:100%}code{background:#eee}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
        f"<p>source pieces: <code>{html.escape(' '.join(maps.src_tokens))}</code></p>",
        (f"<p>target pieces: <code>{html.escape(' '.join(maps.tgt_out_tokens))}</code> "
         f"({html.escape(TARGETS[maps.target], quote=False)})</p>"),
    ]
    for kind in KINDS:
        parts.append(f"<h2>{html.escape(TITLES[kind])}</h2>")
        if kind not in pngs:  # `select`ed layers that this stack does not have
            layers = ", ".join(map(str, maps.layers))
            parts.append(f"<p>none: this stack has no layer {html.escape(layers)}</p>")
            continue
        data = base64.b64encode(pngs[kind]).decode("ascii")
        parts.append(f"<img alt='{kind}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# Suffixes of a file's name: `--out map.png` (no such folder yet) made a folder map.png/ of the maps
FILE_SUFFIXES = (".png", ".pdf", ".svg", ".html", ".htm", ".jpg", ".jpeg")


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse an output folder that cannot be one, before any work: an empty name (it would mean the
    current directory), an existing non-directory, a path under a file, a new name that ends in a
    picture's or page's suffix (`FILE_SUFFIXES`), which was meant as a file, or a folder that is or lies
    inside a checkpoint or a run's checkpoints/ (training's keep_last deletes those whole), or one whose
    nearest existing folder the user may not write in (`/usr/maps` was refused after the drawing). Creates
    nothing: root passes the last check anywhere (/sys/maps), which making the folder first catches (cli)."""
    from aiayn.train.state import check_outside_checkpoints

    if str(out_dir) == "":
        raise UserError("the output folder name is empty")
    folder = str(out_dir).endswith(("/", os.sep))  # `maps.png/`: a folder by its slash, which Path drops
    out_dir = Path(out_dir)
    check_directory_path(out_dir)
    check_outside_checkpoints(out_dir)  # the one read, too: as translate -o (Python callers too)
    if out_dir.suffix.lower() in FILE_SUFFIXES and not out_dir.exists() and not folder:
        raise UserError(f"{out_dir}: names a file; --out (out_dir in Python) is the folder that gets "
                        f"attention_*.png and attention.html, such as {out_dir.with_suffix('')}")
    existing = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())  # a directory: checked
    if not os.access(existing, os.W_OK | os.X_OK):  # new files (and folders) go in it
        where = "" if existing == out_dir else f"{existing}, where it would be made, "
        raise UserError(f"{out_dir}: {where}is not writable")
    return out_dir


def map_paths(out_dir: Path) -> dict[str, Path]:
    """Where `draw_attention` puts each kind's map, and the page ("html"), in `out_dir`."""
    return {kind: out_dir / f"attention_{kind}.png" for kind in KINDS} | {"html": out_dir / "attention.html"}


def draw_attention(maps: AttentionMaps, out_dir: str | Path, title: str = "attention") -> dict[str, Path]:
    """Write attention_{encoder,decoder,cross}.png and attention.html into `out_dir`.

    Each file is replaced atomically and only after every picture was drawn and every file written, so
    a Ctrl-C or an error (a full disk) leaves the old set whole; other files in `out_dir` are the user's
    and are kept. A kind with no map (layers its stack does not have) gets none, and an earlier drawing's
    PNG of it is removed. (`write_atomically` on the folder would replace them too.)
    """
    out_dir = check_out_dir(out_dir)
    check_drawable(len(maps.src_tokens), "the source")  # maps extracted with max_tokens=None
    if maps.target == "given":
        check_drawable(len(maps.tgt_out_tokens), "the target")
    else:  # as extract_attention says it, not "the target: N tokens (with EOS)" of one cut without EOS
        check_drawable(len(maps.tgt_out_tokens), "the greedy translation", hint=" (give a target to draw "
                       "instead)", eos=maps.target == "greedy")
    drawn = [kind for kind in KINDS if maps.weights(kind).shape[0]]  # a stack without the chosen layers: none
    rendered = {}
    for kind in drawn:  # seconds each for a base-sized grid: say what is being drawn
        layers, heads = maps.weights(kind).shape[:2]
        log.info("drawing the %s (%d layer%s x %d head%s)", TITLES[kind].split(" (")[0], layers,
                 "s"[: layers != 1], heads, "s"[: heads != 1])
        rendered[kind] = render_kind(maps, kind)
    pngs = {kind: png for kind, (png, _) in rendered.items()}
    missing = sorted(set().union(*(chars for _, chars in rendered.values())))
    if missing:
        log.warning("%d label character(s) (%s) are in no installed font and show as boxes in the PNGs; "
                    "attention.html lists the pieces as text (a font such as Noto Sans CJK draws them)",
                    len(missing), "".join(missing[:10]))
    files = {kind: path for kind, path in map_paths(out_dir).items() if kind in pngs or kind == "html"}
    for path in files.values():  # before any is replaced: a directory in the way left a mixed set
        if path.is_dir():
            raise UserError(f"{path}: is a directory; will not replace it")
    # Every file is written and flushed to disk before any is renamed into place: a full disk on the last
    # one left the PNGs of the new drawing beside the page of the old.
    with directory_for(out_dir, out_dir), ExitStack() as stack:
        pages = [(files[kind], png, True) for kind, png in pngs.items()]
        pages.append((files["html"], html_page(maps, pngs, title), False))
        for path, content, binary in pages:
            f = stack.enter_context(atomic_output(path, binary=binary))
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    for kind in sorted(set(KINDS) - set(drawn)):  # an earlier drawing's map of it would pass for this one's
        stale = map_paths(out_dir)[kind]
        if stale.is_file():
            stale.unlink()
        log.info("no %s map: that stack has none of layers %s", kind, ",".join(map(str, maps.layers)))
    log.info("attention maps written to %s", out_dir)
    return files
