"""Tokens per second of one training step: aiayn against torch.nn.Transformer and HuggingFace MarianMT.

One step = forward, label-smoothed cross-entropy (0.1, pads ignored), backward, Adam (fused, the same for
every system), `zero_grad(set_to_none=True)`. The peers' loss is `F.cross_entropy(label_smoothing=0.1)`;
aiayn's is its own, as `aiayn train` runs it (only non-pad positions projected, `aiayn.train.loss`),
except in the compiled rows (`system_step`).
The process keeps freed memory (`aiayn.memory.keep_freed_memory`, as `aiayn train` does), which
speeds up every system alike. Every system gets the
same shapes (d_model, heads, d_ff, layers, vocabulary, ReLU, dropout 0.1, attention dropout 0, one shared
embedding tied to the output projection, sinusoidal positions) and the very same batch. Systems are
timed interleaved (A B C C B A ...), so that the noise of a shared machine falls on all of them alike;
what counts are ratios measured in the same run.

Also: model FLOP utilisation against a matmul peak measured here; the floor that the step's Linear
products alone set (`linear_products`: the same products as `torch.mm`, nothing else, timed in the same
rounds as the systems), which bounds any system's lead over the fastest peer; and the bfloat16 loss curve
against the float32 one from the same initialisation on the same batches.

    python benchmarks/train_step.py                 # small and base, fp32 and bf16, eager and compiled
    python benchmarks/train_step.py --quick         # small only, fewer steps: about a minute
    python benchmarks/train_step.py --configs base --precisions bf16 --no-compile
    python benchmarks/train_step.py --device cuda --configs base,base25k --loss-steps 150   # on a GPU

Writes benchmarks/results/local/train_step.{md,json} (ignored by git) unless --out names the markdown
(over a file git tracks, a committed result, only with --force), and with the loss curve its plot beside
them (.png); the json also keeps each configuration's shape, parameter count and FLOPs a step, so that
every MFU can be recomputed from it.
Without transformers (pip install -e '.[bench]') the Marian peer is skipped; on a CPU without a C++
compiler that torch.compile can build with, the compiled rows are, each said in one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    LOCAL_RESULTS,
    at_least,
    check_out,
    comma_choices,
    command_line,
    environment,
    markdown_table,
    peer_available,
    require_device,
    threads,
    timeit,
)

from aiayn.config import ModelConfig, model_config  # noqa: E402
from aiayn.data.dataset import Batch  # noqa: E402
from aiayn.decoding.compiled import check_compile_works  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.memory import keep_freed_memory  # noqa: E402
from aiayn.model import Transformer, sinusoidal_positions  # noqa: E402
from aiayn.model.compile import compile_for_training  # noqa: E402
from aiayn.train.loop import batch_loss  # noqa: E402

PAD, BOS = 0, 1
SHAPES = {  # the issue's two configurations; batch = pairs of source + target tokens
    "small": dict(preset="small", vocab=8000, batch=64, src_len=32, tgt_len=32),
    "base": dict(preset="base", vocab=32000, batch=64, src_len=32, tgt_len=32),
    # the paper's batch (about 25,000 source and 25,000 target tokens): what a GPU is fed
    "base25k": dict(preset="base", vocab=32000, batch=768, src_len=32, tgt_len=32),
    "tiny": dict(preset="tiny", vocab=1000, batch=8, src_len=12, tgt_len=10),  # a smoke test, not a figure
}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
LABEL_SMOOTHING = 0.1


# ----------------------------------------------------------------------------------------------------
# The three systems. Each is a module with `forward(src, tgt_in) -> logits (B, T, V)`.


class TorchTransformer(nn.Module):
    """torch.nn.Transformer(batch_first=True) with our kind of embeddings, sinusoids and tied projection."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.pad_id, self.scale = c.pad_id, math.sqrt(c.d_model)
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        nn.init.normal_(self.embed.weight, std=c.d_model**-0.5)
        self.register_buffer("pe", sinusoidal_positions(c.max_len, c.d_model), persistent=False)
        self.dropout = nn.Dropout(c.dropout)
        self.transformer = nn.Transformer(
            d_model=c.d_model, nhead=c.n_heads, num_encoder_layers=c.n_layers,
            num_decoder_layers=c.decoder_layers, dim_feedforward=c.d_ff, dropout=c.dropout,
            activation="relu", batch_first=True,
        )
        t = self.transformer
        t.encoder.norm = t.decoder.norm = None  # post-norm: no final LayerNorms, like the paper and aiayn
        for layer in [*t.encoder.layers, *t.decoder.layers]:  # the paper's dropout only, as aiayn and Marian:
            for attention in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                if attention is not None:
                    attention.dropout = 0.0  # none on the attention weights (which left SDPA's fused kernel)
            layer.dropout = nn.Identity()  # none inside the FFN

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.dropout(self.embed(tokens) * self.scale + self.pe[: tokens.shape[1]])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_pad = src == self.pad_id  # (B, S), True = ignore (nn.Transformer's convention)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device)
        h = self.transformer(
            self.embed_tokens(src), self.embed_tokens(tgt_in), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
        )  # (B, T, d)
        return h @ self.embed.weight.T  # (B, T, V) tied output projection


class Marian(nn.Module):
    """transformers.MarianMTModel built offline with the same shapes; returns its logits."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        from transformers import MarianConfig, MarianMTModel

        config = MarianConfig(
            vocab_size=c.vocab_size, decoder_vocab_size=c.vocab_size, d_model=c.d_model,
            encoder_layers=c.n_layers, decoder_layers=c.decoder_layers,
            encoder_attention_heads=c.n_heads, decoder_attention_heads=c.n_heads,
            encoder_ffn_dim=c.d_ff, decoder_ffn_dim=c.d_ff, activation_function="relu",
            dropout=c.dropout, attention_dropout=0.0, activation_dropout=0.0,
            max_position_embeddings=c.max_len, pad_token_id=c.pad_id, decoder_start_token_id=c.pad_id,
            eos_token_id=c.eos_id, scale_embedding=True, share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True, use_cache=False,
        )
        self.pad_id = c.pad_id
        self.model = MarianMTModel(config)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        out = self.model(input_ids=src, attention_mask=(src != self.pad_id).long(), decoder_input_ids=tgt_in)
        return out.logits  # (B, T, V)


def build(system: str, c: ModelConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if system == "aiayn":
        return Transformer(c)
    if system == "nn.Transformer":
        return TorchTransformer(c)
    if system == "Marian":
        return Marian(c)
    raise ValueError(system)


# ----------------------------------------------------------------------------------------------------
# One training step, the same for every system.


def label_smoothed_loss(logits: Tensor, tgt_out: Tensor) -> Tensor:
    """(B, T, V), (B, T) -> mean label-smoothed cross-entropy over non-pad targets."""
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD,
                           label_smoothing=LABEL_SMOOTHING)


def _floor_caveat(row: dict) -> str:
    """The floor is a median over the same rounds as the steps, but a noisy machine can still put it
    above a measured step; it then bounds nothing in this run (timed once after the rounds, it read
    -1,719 ms outside the products with three busy loops started after the last round), and the report
    says so."""
    if row["linear_floor_ms"] <= row["step_ms"] and row["peer_over_floor"] >= 1.0:
        return ""
    return (" (NOT a bound in this run: the floor exceeds a measured step, so the machine's load varied "
            "too much; run again on a quiet machine)")


def _mfu_caveat(row: dict) -> str:
    """MFU divides by a matmul peak measured once, before the rounds: over 100% that peak read lower than
    the step's own matmuls ran (the machine busier, or its clock lower, while the probe ran, or the probe's
    shape slower here than the model's), so the figure is no utilisation (aiayn fp32 `base` read 121.8% in
    train_step_base_v2), and the report says so."""
    return " (NOT meaningful: over 100%)" if row["mfu"] > 1.0 else ""


def make_step(model: nn.Module, forward: Callable, dtype: torch.dtype | None,
              opt: torch.optim.Optimizer | None = None) -> Callable:
    """A closure doing one training step on a batch; returns the loss as a float."""
    if opt is None:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    device_type = next(model.parameters()).device.type

    def step(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = forward(src, tgt_in, tgt_out)
        loss.backward()
        opt.step()
        return loss.item()  # a sync point (on GPU): the step is done when this returns

    return step


def system_step(system: str, c: ModelConfig, dtype: torch.dtype | None, compiled: bool, seed: int = 0,
                device: str = "cpu"):
    """One system's step closure; `compiled`: aiayn through `compile_for_training`, a peer through
    `torch.compile` of its forward and loss, the same wrapping, with the peers' loss (F.cross_entropy over
    every position): not `aiayn train`'s compiled step, which compiles the model alone and keeps
    aiayn's own loss outside the graph."""
    model = build(system, c, seed).to(device).train()
    if not compiled and system == "aiayn":
        forward = aiayn_loss(model)
    elif not compiled:
        def forward(src, tgt_in, tgt_out):
            return label_smoothed_loss(model(src, tgt_in), tgt_out)
    elif system == "aiayn":
        forward = compile_for_training(model, label_smoothed_loss)
    else:
        forward = torch.compile(lambda src, tgt_in, tgt_out: label_smoothed_loss(model(src, tgt_in), tgt_out),
                                dynamic=False)
    return make_step(model, forward, dtype)


def aiayn_loss(model: nn.Module) -> Callable:
    """(src, tgt_in, tgt_out) -> the mean loss as `aiayn train` computes it (aiayn.train.loop.train_step:
    only the real target positions projected, aiayn's own label-smoothed loss)."""

    def forward(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        batch = Batch.of(src, tgt_in, tgt_out, PAD)  # what collate makes
        loss, _ = batch_loss(model, batch, LABEL_SMOOTHING, nullcontext())
        return loss / batch.n_tokens

    return forward


def make_batch(shape: dict, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random full-length pairs: src (B, S), tgt_in (B, T) starting with BOS, tgt_out (B, T)."""
    b, v = shape["batch"], shape["vocab"]
    src = torch.randint(3, v, (b, shape["src_len"]), generator=generator)
    tgt = torch.randint(3, v, (b, shape["tgt_len"] + 1), generator=generator)
    tgt[:, 0] = BOS
    return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()


# ----------------------------------------------------------------------------------------------------
# FLOPs and the matmul peak.


def model_flops(c: ModelConfig, b: int, s: int, t: int) -> float:
    """FLOPs of one training step (forward + backward = 3 x forward), counting matmuls only.

    Matmul weights: 2 FLOPs per weight per position forward, so 6 * weights * positions per step:
      encoder layer per source position: 4 d^2 (Q, K, V, O) + 2 d d_ff;
      decoder layer per target position: 4 d^2 (self) + 2 d^2 (Q, O of cross) + 2 d d_ff,
        and per source position 2 d^2 (the cross-attention K, V of the memory);
      output projection per target position: d V (tied, counted once).
    Attention: Q K^T and A V are 2 * 2 * Tq * Tk * d FLOPs forward per layer and sentence, all of
    the square counted even where causal (as PaLM's MFU does); x 3 for forward + backward.
    Embedding lookups, LayerNorm, softmax and the loss are not counted.
    """
    d, f, v, le, ld = c.d_model, c.d_ff, c.target_vocab_size, c.n_layers, c.decoder_layers
    per_src = le * (4 * d * d + 2 * d * f) + ld * 2 * d * d
    per_tgt = ld * (6 * d * d + 2 * d * f) + d * v
    weights = 6 * b * (s * per_src + t * per_tgt)
    attention = 3 * 4 * b * d * (le * s * s + ld * (t * t + t * s))
    return float(weights + attention)


def peak_size(device: str) -> int:
    """The square matmul that measures the peak: 2048 fills a CPU, a GPU needs 8192."""
    return 8192 if torch.device(device).type == "cuda" else 2048


def matmul_peak(dtype: torch.dtype, device: str = "cpu", repeats: int = 5) -> float:
    """Measured FLOP/s of an n x n x n torch.matmul in `dtype` on `device` (median of repeats), n from
    `peak_size`. On CUDA float32 is true float32 (PyTorch's default, no TF32), as every system runs."""
    n = peak_size(device)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    seconds = timeit(lambda: torch.matmul(a, b), repeats=repeats, warmup=2, device=device)
    return 2 * n**3 / seconds


def linear_shapes(c: ModelConfig, b: int, s: int, t: int) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every Linear product of one forward pass, as `model_flops` counts them."""
    d, f, v = c.d_model, c.d_ff, c.target_vocab_size
    encoder = [(b * s, d, 3 * d), (b * s, d, d), (b * s, d, f), (b * s, f, d)]
    decoder = [(b * t, d, 3 * d), (b * t, d, d), (b * t, d, d), (b * s, d, 2 * d), (b * t, d, d),
               (b * t, d, f), (b * t, f, d)]  # self QKV, O; cross Q, KV (of the memory), O; FFN
    return encoder * c.n_layers + decoder * c.decoder_layers + [(b * t, d, v)]


def linear_products(c: ModelConfig, b: int, s: int, t: int, dtype: torch.dtype,
                    device: str = "cpu") -> Callable[..., None]:
    """The step's Linear products alone: each one's forward (x W^T), input gradient (g W) and weight
    gradient (g^T x) as one `torch.mm` in `dtype`, nothing else, done when the call returns (any
    arguments are ignored, so that it times as a system's step does). Every system makes these same
    products, so no step can be faster: the fastest peer's time over theirs bounds how far ahead of it
    any implementation could get on this machine."""
    mats = [tuple(torch.randn(*shape, device=device).to(dtype) for shape in ((n, i), (o, i), (n, o)))
            for n, i, o in linear_shapes(c, b, s, t)]

    def products(*_) -> None:
        for x, w, g in mats:
            torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    return products



# ----------------------------------------------------------------------------------------------------
# Timing: every (system, precision) of one configuration interleaved, round after round.


@dataclass
class Run:
    system: str  # aiayn, nn.Transformer or Marian
    precision: str  # fp32 or bf16
    compiled: bool
    step: Callable
    first_s: float = 0.0  # the first step: includes compilation when compiled
    times: list[float] | None = None

    @property
    def label(self) -> str:
        return self.system + (" (compiled)" if self.compiled else "")

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def time_config(name: str, args) -> tuple[list[Run], dict]:
    shape = SHAPES[name]
    c = model_config(shape["preset"], vocab_size=shape["vocab"])
    batch = tuple(x.to(args.device) for x in make_batch(shape, torch.Generator().manual_seed(0)))
    variants = [(s, False) for s in args.systems]
    if not args.no_compile:
        variants.append(("aiayn", True))
        if args.compile_peers:
            variants += [(s, True) for s in args.systems if s != "aiayn"]
    runs = []
    for precision in args.precisions:
        for system, compiled in variants:
            step = system_step(system, c, PRECISIONS[precision], compiled, device=args.device)
            run = Run(system, precision, compiled, step)
            start = time.perf_counter()
            run.step(*batch)
            run.first_s = time.perf_counter() - start
            for _ in range(args.warmup - 1):
                run.step(*batch)
            run.times = []
            runs.append(run)
            print(f"[{name}] {run.label} {precision}: first step {run.first_s:.1f} s", flush=True)
    dims = shape["batch"], shape["src_len"], shape["tgt_len"]
    # The Linear products alone take their turn in every round, as a system: timed once after the rounds,
    # a change of the machine's load landed on them alone (a "floor" of 2,357 ms under a 638 ms step)
    floors = [Run("Linear floor", p, False, linear_products(c, *dims, PRECISIONS[p] or torch.float32,
                                                            device=args.device)) for p in args.precisions]
    for floor in floors:
        floor.step()  # warm-up
        floor.times = []
    timed = runs + floors
    for r in range(args.steps):
        for run in timed if r % 2 == 0 else reversed(timed):  # A B C C B A ...: no system always first
            start = time.perf_counter()
            run.step(*batch)
            run.times.append(time.perf_counter() - start)
        print(f"[{name}] round {r + 1}/{args.steps}", flush=True)
    info = dict(config=name, **shape, tokens=shape["batch"] * (shape["src_len"] + shape["tgt_len"]),
                flops=model_flops(c, *dims), parameters=sum(p.numel() for p in Transformer(c).parameters()),
                linear_floor_s={f.precision: f.median_s for f in floors})
    return runs, info


def summarise(runs: list[Run], info: dict, peaks: dict) -> list[dict]:
    """One row per run: time, tokens/s, ratio to the fastest peer at its precision, MFU."""
    rows = []
    for run in runs:
        peers = [p for p in runs if p.precision == run.precision and p.system != "aiayn"
                 and p.compiled == run.compiled]
        if not peers:  # no compiled peers measured: compare with the eager ones, and say so
            peers = [p for p in runs if p.precision == run.precision and p.system != "aiayn"]
        fastest = min(peers, key=lambda p: p.median_s)
        s = run.median_s
        rows.append(dict(
            config=info["config"], precision=run.precision, system=run.label, step_ms=1000 * s,
            tokens_per_s=info["tokens"] / s, fastest_peer=fastest.label, vs_fastest_peer=fastest.median_s / s,
            mfu=info["flops"] / s / peaks[run.precision], first_step_s=run.first_s,
            compile_s=max(run.first_s - s, 0.0) if run.compiled else None,
            linear_floor_ms=1000 * info["linear_floor_s"][run.precision],
            peer_over_floor=fastest.median_s / info["linear_floor_s"][run.precision],
            times_ms=[round(1000 * t, 1) for t in run.times],
        ))
    return rows


# ----------------------------------------------------------------------------------------------------
# The bfloat16 loss curve against the float32 one.


def loss_curve(steps: int, seed: int = 0, device: str = "cpu") -> dict:
    """aiayn `small` from one initialisation on the same batches in fp32 and in bf16 autocast, with the
    loss and its gradient as `aiayn train` computes them.

    The task is learnable (the target is the source reversed, in a vocabulary of 8,000), so the curve
    falls and a drift would show. Dropout draws the same masks in both runs (same seed, same shapes).
    """
    shape = dict(SHAPES["small"], batch=16, src_len=12, tgt_len=12)  # short: 2 x steps on a CPU
    c = model_config("small", vocab_size=shape["vocab"])
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        src = torch.randint(3, 200, (shape["batch"], shape["src_len"]), generator=gen)  # 200 words in use
        tgt = torch.cat([torch.full((shape["batch"], 1), BOS), src.flip(1)], dim=1)
        batches.append(tuple(x.to(device) for x in (src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())))
    curves, every = {}, max(1, steps // 10)
    for precision in ("fp32", "bf16"):
        torch.manual_seed(seed)
        model = Transformer(c).to(device).train()
        opt = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        # The loss `aiayn train` minimizes, not the peers' F.cross_entropy.
        step = make_step(model, aiayn_loss(model), PRECISIONS[precision], opt)
        torch.manual_seed(seed + 2)  # the same dropout masks in both runs (all devices' generators)
        curves[precision] = []
        for i, batch in enumerate(batches, 1):
            curves[precision].append(step(*batch))
            if i % every == 0 or i == steps:  # 2 x 150 steps were ~100 s without a word, on a CPU
                print(f"[loss curve] {precision} step {i}/{steps}: loss {curves[precision][-1]:.4f}",
                      flush=True)
    diffs = [abs(a - b) for a, b in zip(curves["fp32"], curves["bf16"])]
    rel = [d / a for d, a in zip(diffs, curves["fp32"])]
    return dict(steps=steps, fp32=curves["fp32"], bf16=curves["bf16"], max_abs_diff=max(diffs),
                max_rel_diff=max(rel), final_fp32=curves["fp32"][-1], final_bf16=curves["bf16"][-1])


# ----------------------------------------------------------------------------------------------------
# Report.


def per_round_ratios(rows: list[dict], row: dict) -> list[float]:
    """Round by round, the fastest peer's time in that round / this row's time in that round: steps
    taken seconds apart share the machine's load, so these vary less than a ratio of medians."""
    peers = [r for r in rows if r["config"] == row["config"] and r["precision"] == row["precision"]
             and not r["system"].startswith("aiayn") and r["system"].endswith("(compiled)") ==
             row["fastest_peer"].endswith("(compiled)")]
    return [min(p["times_ms"][i] for p in peers) / t for i, t in enumerate(row["times_ms"])]


def config_record(info: dict) -> dict:
    """What the json keeps of one configuration: its shape, aiayn's parameter count and the FLOPs of one
    step (`model_flops`), so that each row's MFU can be recomputed from the json alone: flops_per_step /
    (step_ms / 1000) / peaks[precision]."""
    keys = ("preset", "vocab", "batch", "src_len", "tgt_len", "tokens", "parameters")
    return {**{k: info[k] for k in keys}, "flops_per_step": info["flops"]}


def timing_lines(rows: list[dict], peaks: dict, args) -> list[str]:
    """The report's timed part: the matmul peak, what the columns mean, the table, bf16's speed-ups and
    the Linear floors."""
    table = markdown_table(
        ["config", "precision", "system", "ms/step", "tokens/s", "x fastest peer",
         "per round: median [min, max]", "MFU", "compile s"],
        [[r["config"], r["precision"], r["system"], f"{r['step_ms']:.0f}", f"{r['tokens_per_s']:.0f}",
          f"{r['vs_fastest_peer']:.2f} ({r['fastest_peer']})",
          f"{statistics.median(q):.2f} [{min(q):.2f}, {max(q):.2f}]" if (q := r["per_round_vs_fastest_peer"])
          else "", f"{100 * r['mfu']:.1f}%" + _mfu_caveat(r), "" if r["compile_s"] is None
          else f"{r['compile_s']:.0f}"]
         for r in rows],
    )
    over = [] if not any(map(_mfu_caveat, rows)) else [
        ("MFU over 100% is NOT meaningful in this run: the matmul peak, measured once before the rounds, "
         "read lower than the step's own matmuls ran (the machine busier, or its clock lower, while the "
         f"{peak_size(args.device)}^3 probe ran, or that shape slower here than the model's), so those "
         "figures are no utilisation; the ratios between systems, timed in the same rounds, stand."), ""]
    speedups = []
    for cfg in dict.fromkeys(r["config"] for r in rows):
        for compiled in ("aiayn", "aiayn (compiled)"):
            t = {r["precision"]: r["step_ms"] for r in rows if r["config"] == cfg and r["system"] == compiled}
            rounds = {r["precision"]: r["times_ms"] for r in rows
                      if r["config"] == cfg and r["system"] == compiled}
            if "fp32" in t and "bf16" in t:
                q = [a / b for a, b in zip(rounds["fp32"], rounds["bf16"])]
                speedups.append(f"- {cfg}, {compiled}: bf16 is {t['fp32'] / t['bf16']:.2f}x fp32 (ratio of "
                                f"medians; per round: median {statistics.median(q):.2f} [{min(q):.2f}, "
                                f"{max(q):.2f}])")
    floors = [f"- {r['config']} {r['precision']}: the Linear products alone (forward, input and weight "
              f"gradients, `torch.mm`, nothing else) take {r['linear_floor_ms']:.0f} ms, so no step can be "
              f"more than {r['peer_over_floor']:.2f}x the fastest peer ({r['fastest_peer']}) here; aiayn "
              f"spends {r['step_ms'] - r['linear_floor_ms']:.0f} ms outside them" + _floor_caveat(r)
              for r in rows if r["system"] == "aiayn" and "linear_floor_ms" in r]
    shapes = "; ".join(f"{k} = preset {v['preset']}, vocab {v['vocab']}, batch {v['batch']} pairs of "
                       f"{v['src_len']} + {v['tgt_len']} tokens"
                       for k, v in SHAPES.items() if k in args.configs)
    return [
        (f"Measured matmul peak ({peak_size(args.device)}^3 torch.matmul on {args.device}): "
         f"fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s."), "",
        ("Step = forward, label-smoothed CE (0.1), backward, fused Adam (`zero_grad(set_to_none=True)`); "
         f"shapes: {shapes}. tokens/s counts source + target tokens. Median of the interleaved rounds. "
         "`x fastest peer` = fastest peer's time / this time, at the same precision (compiled rows against "
         "compiled peers when they were measured, else against the eager peers, named in brackets). MFU = "
         "model FLOPs (`model_flops`: 6 x matmul weights x positions + 12 x B x d x Tq x Tk per attention) "
         "/ time / measured matmul peak of that precision. `compile s` = first step minus a warm step."), "",
        table, "", *over, *speedups, "", *floors, "",
    ]


def curve_lines(curve: dict) -> list[str]:
    """The report's loss-curve section: the largest gap, and the losses of ten steps across the run, the
    last one among them."""
    shown = sorted({*range(0, curve["steps"], max(1, curve["steps"] // 10)), curve["steps"] - 1})
    return [
        f"## bf16 loss curve vs fp32 (aiayn small, {curve['steps']} steps, same init and batches)", "",
        (f"max |loss_bf16 - loss_fp32| = {curve['max_abs_diff']:.4f}, max relative = "
         f"{100 * curve['max_rel_diff']:.2f}%; final loss fp32 {curve['final_fp32']:.4f}, "
         f"bf16 {curve['final_bf16']:.4f}"), "",
        markdown_table(["step", "fp32", "bf16", "abs diff"], [
            [i + 1, f"{curve['fp32'][i]:.4f}", f"{curve['bf16'][i]:.4f}",
             f"{abs(curve['fp32'][i] - curve['bf16'][i]):.4f}"] for i in shown]),
        "",
    ]


def plot_curve(curve: dict, path: str) -> None:
    """The fp32 and bf16 loss curves over the steps, as a PNG at `path`: the report's table shows ten
    steps of them."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the file alone
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = range(1, curve["steps"] + 1)
    for precision, color in (("fp32", "tab:blue"), ("bf16", "tab:orange")):
        ax.plot(steps, curve[precision], color=color, lw=1.2, label=precision)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (label-smoothed, nats)")
    ax.set_title(f"aiayn small, fp32 and bf16 from the same initialisation on the same batches; "
                 f"largest gap {curve['max_abs_diff']:.4f}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measured_peers(rows: list[dict]) -> list[str]:
    """The peers timed in `rows`, by their full names: the title said "vs MarianMT" of a run that skipped
    Marian (no transformers)."""
    timed = {r["system"].removesuffix(" (compiled)") for r in rows}
    return [title for name, title in (("nn.Transformer", "torch.nn.Transformer"), ("Marian", "MarianMT"))
            if name in timed]


def write_report(rows: list[dict], peaks: dict, curve: dict | None, env: dict, args, path: str,
                 configs: dict[str, dict] | None = None) -> None:
    """The markdown report at `path` and the json beside it; `configs`: name -> `config_record`. With no
    rows (`--configs ''`), no peak and no timing part: it read "shapes: . tokens/s counts ..." and
    explained the columns of a table that was not there."""
    for r in rows:
        r["per_round_vs_fastest_peer"] = [round(x, 3) for x in per_round_ratios(rows, r)]
    lines = [
        f"# Training step: {' vs '.join(['aiayn', *measured_peers(rows)])}", "",
        f"Command: `{command_line(__file__, args.argv)}`", "",
        "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
        *(timing_lines(rows, peaks, args) if rows
          else ["No step timed in this run (`--configs ''`): the bf16 loss curve alone.", ""]),
    ]
    if skipped := getattr(args, "compile_skipped", None):  # the command line does not say it: no --no-compile
        lines += [f"No compiled rows: torch.compile could not build here ({skipped}).", ""]
    if curve:
        lines += curve_lines(curve)
        plot_curve(curve, os.path.splitext(path)[0] + ".png")
        lines += [f"The curves, every step: {os.path.basename(os.path.splitext(path)[0])}.png", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(dict(environment=env, peaks=peaks, configs=configs or {}, rows=rows, loss_curve=curve,
                       argv=args.argv, compiled_rows_skipped=getattr(args, "compile_skipped", None)), f,
                  indent=1)


def compile_problem(device: str) -> str | None:
    """Why torch.compile cannot build the compiled rows on `device` (said on stderr in one line), or None.
    On a CPU inductor builds C++: without a compiler that works the first compiled step was an 84-line
    traceback, and the eager steps of the run were lost with it."""
    if torch.device(device).type != "cpu":  # a GPU's kernels are Triton's
        return None
    try:
        check_compile_works("torch.compile on a CPU")
    except UserError as e:
        print(f"skipping the compiled rows: {e}", file=sys.stderr)
        return str(e)
    return None


DEFAULTS = {"configs": ["small", "base"], "steps": 5, "warmup": 2, "loss_steps": 150}
QUICK = {"configs": ["small"], "steps": 3, "warmup": 1, "loss_steps": 40}  # --quick


def settle(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`DEFAULTS`, or `QUICK` with --quick, for the options not given; a usage error for an option --quick
    sets given beside it (it replaced them silently), for an option of the timing given with --configs ''
    (it was ignored silently), for a contradiction, or for nothing to measure."""
    given = [f"--{name.replace('_', '-')}" for name in QUICK  # --loss-steps 0: the quick run, no curve
             if getattr(args, name) is not None and not (name == "loss_steps" and args.loss_steps == 0)]
    if args.quick and given:
        p.error(f"--quick sets --configs small, --steps 3, --warmup 1 and --loss-steps 40 (0 may go with "
                f"it): give {' and '.join(given)}, or --quick, not both")
    timing = [option for option, value in (("--precisions", args.precisions), ("--steps", args.steps),
                                           ("--warmup", args.warmup), ("--no-compile", args.no_compile),
                                           ("--compile-peers", args.compile_peers)) if value]
    if args.configs == [] and timing:  # [] only as given: the default is None until filled in below
        p.error(f"--configs '' times no step (the loss curve alone): {' and '.join(timing)} would be "
                f"ignored; give a configuration, or leave {'it' if len(timing) == 1 else 'them'} out")
    args.precisions = args.precisions or list(PRECISIONS)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.no_compile and args.compile_peers:  # --compile-peers was ignored
        p.error("--compile-peers times the peers under torch.compile, which --no-compile leaves out: "
                "give one of them")
    if not args.configs and not args.loss_steps:  # an empty report, exit 0
        p.error("--configs '' and --loss-steps 0: nothing to measure")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the four that --quick sets, and --precisions, default to None: one given beside --quick (or a timing
    # option beside --configs '') is refused, even at its default
    p.add_argument("--configs", type=comma_choices(list(SHAPES), allow_empty=True),
                   help="comma-separated: small, base, base25k (default small,base; tiny: a smoke test; "
                        "'': the loss curve only)")
    p.add_argument("--precisions", type=comma_choices(list(PRECISIONS)),
                   help="comma-separated: fp32, bf16 (default both)")
    p.add_argument("--steps", type=at_least(1), help="timed interleaved rounds (median reported; default 5)")
    p.add_argument("--warmup", type=at_least(1), help="untimed steps per system before timing (default 2)")
    p.add_argument("--no-compile", action="store_true", help="skip aiayn under torch.compile")
    p.add_argument("--compile-peers", action="store_true", help="also time the peers under torch.compile")
    p.add_argument("--loss-steps", type=at_least(0),
                   help="bf16 vs fp32 loss-curve steps (0: skip; default 150)")
    p.add_argument("--quick", action="store_true", help="--configs small --steps 3 --warmup 1 --loss-steps 40 "
                   "(none of those given with it, but --loss-steps 0: no loss curve)")
    p.add_argument("--threads", type=threads, default=None,
                   help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N): where every system runs")
    p.add_argument("--out", default=None, help="markdown path, the json (and the loss curve's png) beside "
                   "it (default benchmarks/results/local/train_step.md, ignored by git)")
    p.add_argument("--force", action="store_true",
                   help="write over files git tracks (committed results)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.device = str(require_device(args.device))
    settle(p, args)
    args.systems = ["aiayn", "nn.Transformer"]
    if args.configs and peer_available("transformers", "the Marian peer"):
        args.systems.append("Marian")
    out = args.out or str(LOCAL_RESULTS / "train_step.md")
    if not out.endswith(".md"):  # the json goes beside it: --out r.json was replaced by the json
        p.error(f"--out {out}: name the markdown report, ending in .md (the json is written beside it)")
    # a directory in the way failed after the timing
    drawn = [Path(out).with_suffix(".png")] if args.loss_steps else []  # the loss curve's plot
    check_out(Path(out), [Path(out), Path(out).with_suffix(".json"), *drawn], args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = keep_freed_memory()  # False with AIAYN_SYSTEM_MALLOC=1 or without glibc: slower steps
    # the machine's load before the compiler check's C++ build, as before the run
    env = environment(args.device, keeps_freed_memory=kept)
    if args.configs and not args.no_compile:
        args.compile_skipped = compile_problem(args.device)  # in the report: no --no-compile says it
        args.no_compile = args.compile_skipped is not None
    # the MFU's denominators: nothing to measure for the loss curve alone
    peaks = {name: matmul_peak(torch.float32 if name == "fp32" else torch.bfloat16, args.device)
             for name in PRECISIONS} if args.configs else {}
    if peaks:
        print("matmul peak GFLOP/s:", {k: round(v / 1e9) for k, v in peaks.items()}, flush=True)
    rows, configs = [], {}
    for name in args.configs:
        runs, info = time_config(name, args)
        rows += summarise(runs, info, peaks)
        configs[name] = config_record(info)
        del runs
        write_report(rows, peaks, None, env, args, out, configs)  # partial results survive an interruption
    curve = loss_curve(args.loss_steps, device=args.device) if args.loss_steps else None
    write_report(rows, peaks, curve, env, args, out, configs)
    print(open(out).read())


if __name__ == "__main__":
    main()
