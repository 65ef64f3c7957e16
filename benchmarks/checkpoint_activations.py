"""What `train.checkpoint_activations` trades: the memory of a training step against its time.

With it, each encoder and decoder layer keeps only its input for the backward pass and runs its forward
again there (`Transformer.checkpoint_activations`, through `torch.utils.checkpoint`). This script runs
aiayn's training step (forward over the real target positions, aiayn's label-smoothed loss, backward,
fused Adam: `train_step.py`'s) with the activations kept and recomputed, side by side, and the same for
the peer that offers it, HuggingFace's MarianMTModel built with the same shapes (`train_step.py`'s, its
`activation_checkpointing_enable`, or an older transformers' `gradient_checkpointing_enable`, with
`use_reentrant=False`; `F.cross_entropy` over every position), and reports
per system, configuration and precision:

- kept MiB: the activations autograd holds for the backward pass after the forward (the distinct
  tensors `saved_tensors_hooks` is handed outside any checkpoint, parameters left out): exact, the same
  on every machine;
- peak MiB: the step's peak memory above what was allocated before it (weights, gradients and Adam's
  moments of an earlier step included in "before"). GPU: `torch.cuda.max_memory_allocated`. CPU: the
  growth of the peak resident set (VmHWM, reset through /proc/self/clear_refs) over one step, in a fresh
  process per figure, after one untimed step and `malloc_trim` (the earlier step's freed pages handed
  back, else its activations were still resident and the growth read low): every page the step
  touched, whoever allocated it;
- ms: the step's median time over interleaved rounds, and the ratio recomputed / kept.

    python benchmarks/checkpoint_activations.py                      # small and base, fp32 and bf16, CPU
    python benchmarks/checkpoint_activations.py --device cuda --configs base,base25k --precisions bf16

Writes benchmarks/results/local/checkpoint_activations_{device}.{json,md} unless --out names a file stem.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` and `train_step` beside this file
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
    status_kib,
    sync,
    with_suffix_added,
)
from train_step import PRECISIONS, SHAPES, aiayn_loss, build, label_smoothed_loss, make_batch, make_step

from aiayn.config import model_config
from aiayn.memory import keep_freed_memory, release_freed_memory

MODES = ("kept", "recomputed")
MIB = 2**20


SYSTEMS = ("aiayn", "Marian")


def step_for(system: str, config: str, precision: str, mode: str, device: str):
    """`system`'s model at `config`'s shapes, its batch, its loss's forward and a training step closure,
    activations per `mode`."""
    shape = SHAPES[config]
    model = build(system, model_config(shape["preset"], vocab_size=shape["vocab"])).to(device).train()
    if system == "aiayn":
        model.checkpoint_activations = mode == "recomputed"
        forward = aiayn_loss(model)
    else:
        if mode == "recomputed":  # 5.24 has the new name (the old one warns); older transformers the old
            hf, kwargs = model.model, {"use_reentrant": False}
            if hasattr(hf, "activation_checkpointing_enable"):
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

        def forward(src, tgt_in, tgt_out):
            return label_smoothed_loss(model(src, tgt_in), tgt_out)
    batch = [t.to(device) for t in make_batch(shape, torch.Generator().manual_seed(1))]
    return model, batch, forward, make_step(model, forward, PRECISIONS[precision])


def kept_bytes(model: torch.nn.Module, forward, batch: list[torch.Tensor], precision: str,
               device: str) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward pass of one forward."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dtype = PRECISIONS[precision]
    autocast = torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16,
                              enabled=dtype is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        forward(*batch)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in kept.items() if ptr not in weights)


def peak_bytes(system: str, config: str, precision: str, mode: str, device: str) -> tuple[int, str]:
    """The step's peak memory above what was there before it (see the module's docstring), in this
    process: call it in a fresh one on a CPU (`measure_in_child`)."""
    _, batch, _, step = step_for(system, config, precision, mode, device)
    step(*batch)  # Adam's moments and the allocator's first-call costs off the books
    if torch.device(device).type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(*batch)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before, "torch.cuda.max_memory_allocated"
    release_freed_memory()  # the heap's free pages back to the kernel: resident now is what is live
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the resident set now
        f.write("5")
    before = status_kib("VmRSS")
    step(*batch)
    return (status_kib("VmHWM") - before) * 1024, "VmHWM after malloc_trim and clear_refs, fresh process"


def measure_in_child(system: str, config: str, precision: str, mode: str, device: str) -> dict:
    """`peak_bytes` in a fresh interpreter (a clean heap and peak); a failure is reported, not raised."""
    cmd = [sys.executable, __file__, "--peak", system, config, precision, mode, "--device", device]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_modes(runs: dict, device: str, rounds: int, steps: int) -> dict[tuple[str, str], float]:
    """Median seconds per step of each run (system, mode): `rounds` interleaved rounds of `steps` steps."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _, batch, _, step in runs.values():
        step(*batch)  # warm-up
    for _ in range(rounds):
        for key, (_, batch, _, step) in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(*batch)
            sync(device)
            times[key].append((time.perf_counter() - start) / steps)
    return {key: statistics.median(t) for key, t in times.items()}


def measure(systems: list[str], config: str, precision: str, device: str, rounds: int, steps: int
            ) -> list[dict]:
    """One row per system: its kept bytes and peak in each mode, and the times of all in one set of rounds
    (each system and mode built once: its kept bytes are counted before it is timed)."""
    runs = {(system, mode): step_for(system, config, precision, mode, device)
            for system in systems for mode in MODES}
    rows = []
    for system in systems:
        row = {"system": system, "config": config, "precision": precision}
        for mode in MODES:
            model, batch, forward, _ = runs[system, mode]
            row[f"{mode}_kept_bytes"] = kept_bytes(model, forward, batch, precision, device)
            peak = measure_in_child(system, config, precision, mode, device)
            row[f"{mode}_peak_bytes"], row[f"{mode}_peak_method"] = peak.get("peak_bytes"), peak.get("method")
            row[f"{mode}_peak_error"] = peak.get("error")
        rows.append(row)
    times = time_modes(runs, device, rounds, steps)
    for row in rows:
        row.update({f"{mode}_s": times[row["system"], mode] for mode in MODES})
    return rows


def _mib(n: int | None) -> str:
    return "failed" if n is None else f"{n / MIB:,.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def table(rows: list[dict]) -> str:
    """Each system kept against recomputed."""
    body = [[r["system"], r["config"], r["precision"], _mib(r["kept_kept_bytes"]),
             _mib(r["recomputed_kept_bytes"]), _ratio(r["kept_kept_bytes"], r["recomputed_kept_bytes"]),
             _mib(r["kept_peak_bytes"]), _mib(r["recomputed_peak_bytes"]),
             _ratio(r["kept_peak_bytes"], r["recomputed_peak_bytes"]), f"{r['kept_s'] * 1e3:,.0f}",
             f"{r['recomputed_s'] * 1e3:,.0f}", _ratio(r["recomputed_s"], r["kept_s"])]
            for r in rows]
    header = ["system", "config", "precision", "kept MiB (kept)", "kept MiB (recomputed)", "less",
              "peak MiB (kept)", "peak MiB (recomputed)", "less", "ms (kept)", "ms (recomputed)", "slower"]
    return markdown_table(header, body)


def versus(rows: list[dict]) -> str:
    """The peer over aiayn in each mode (above 1: aiayn keeps less, peaks lower, steps faster)."""
    body, peers = [], {r["system"] for r in rows} - {"aiayn"}
    for r in rows:
        peer = next((q for q in rows if q["system"] != "aiayn" and r["system"] == "aiayn"
                     and (q["config"], q["precision"]) == (r["config"], r["precision"])), None)
        if peer is None:
            continue
        for mode in MODES:
            body.append([r["config"], r["precision"], mode,
                         _ratio(peer[f"{mode}_kept_bytes"], r[f"{mode}_kept_bytes"]),
                         _ratio(peer[f"{mode}_peak_bytes"], r[f"{mode}_peak_bytes"]),
                         _ratio(peer[f"{mode}_s"], r[f"{mode}_s"])])
    if not body:
        return ""
    over = f"{', '.join(sorted(peers))} / aiayn"
    return markdown_table(["config", "precision", "activations", f"{over} kept MiB", "peak MiB", "ms"], body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=comma_choices([c for c in SHAPES if c != "tiny"] + ["tiny"]),
                   default=["small", "base"])
    p.add_argument("--precisions", type=comma_choices(list(PRECISIONS)), default=list(PRECISIONS))
    p.add_argument("--systems", type=comma_choices(list(SYSTEMS)), default=list(SYSTEMS),
                   help="aiayn and the peer (default both; Marian needs transformers)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument("--steps", type=at_least(1), default=2, help="steps per round and mode")
    p.add_argument("--out", type=Path,
                   help="file stem (default benchmarks/results/local/checkpoint_activations_DEVICE)")
    p.add_argument("--force", action="store_true", help="write over committed results")
    p.add_argument("--peak", nargs=4, metavar=("SYSTEM", "CONFIG", "PRECISION", "MODE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kept = keep_freed_memory()  # as `aiayn train` runs: freed memory reused, not faulted in again each step
    if args.peak:  # a child of `measure_in_child`
        peak, method = peak_bytes(*args.peak, args.device)
        print(json.dumps({"peak_bytes": peak, "method": method}))
        return
    device = require_device(args.device)
    stem = args.out or LOCAL_RESULTS / f"checkpoint_activations_{device.type}"
    files = [with_suffix_added(stem, ".json"), with_suffix_added(stem, ".md")]
    check_out(stem, files, args.force, args.out)
    systems = [s for s in args.systems if s == "aiayn" or peer_available("transformers", s)]
    env = environment(device, keeps_freed_memory=kept)
    command = command_line(__file__, argv)
    rows = []
    for config in args.configs:
        for precision in args.precisions:
            rows += measure(systems, config, precision, str(device), args.rounds, args.steps)
            report = write_report(files, command, env, rows, device)  # after each: a run cut short (gpu.sh's
            print(f"{config} {precision} done", file=sys.stderr)  # time limit) keeps what it measured
    print(report)


def write_report(files: list[Path], command: str, env: dict, rows: list[dict], device: torch.device) -> str:
    """The .json and .md of the rows so far; the .md's text."""
    methods = sorted({r[f"{m}_peak_method"] for r in rows for m in MODES if r[f"{m}_peak_method"]})
    failed = [f"- peak of {r['system']} {r['config']} {r['precision']} {m} failed: {r[f'{m}_peak_error']}"
              for r in rows for m in MODES if r[f"{m}_peak_error"]]
    report = "\n".join([f"# train.checkpoint_activations: memory against time ({device})", "",
                        f"    {command}", "", table(rows), "", versus(rows), "", *failed, "",
                        (f"peak: {'; '.join(methods) or 'none measured'}; batch: the configurations of "
                         "train_step.py (pairs of 32 + 32 tokens)"), "",
                        "```", json.dumps(env, indent=2), "```", ""])
    files[0].write_text(json.dumps({"command": command, "environment": env, "rows": rows}, indent=2) + "\n")
    files[1].write_text(report)
    return report


if __name__ == "__main__":
    main()
