"""Where one training step's time goes: torch.profiler over a few steps of one system of train_step.py.

    python benchmarks/profile_step.py --config base --precision bf16                 # aiayn, CPU
    python benchmarks/profile_step.py --device cuda --config base25k --system Marian --compile

Prints the command and the environment (hardware, versions, commit), as the other scripts record
them, then the operators that take the most time (on a GPU: the time of the kernels each one launched
itself), summed over the profiled steps and divided by their count: per-step milliseconds, to set beside
train_step.py's table. --by-shape splits each operator by its input shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402
from common import at_least, command_line, environment, require_device  # noqa: E402

from aiayn.config import model_config  # noqa: E402
from aiayn.decoding.compiled import check_compile_works  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.memory import keep_freed_memory  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=list(train_step.SHAPES), default="base",
                   help="train_step.py's model and batch shape (default base)")
    p.add_argument("--precision", choices=list(train_step.PRECISIONS), default="bf16",
                   help="fp32, or bf16 autocast as train_step.py times it (default bf16)")
    p.add_argument("--system", choices=["aiayn", "nn.Transformer", "Marian"], default="aiayn",
                   help="the model profiled: aiayn or one of train_step.py's peers (default aiayn)")
    p.add_argument("--compile", action="store_true", help="aiayn through compile_for_training, a peer "
                   "through torch.compile")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N) (default cpu)")
    p.add_argument("--steps", type=at_least(1), default=3,
                   help="profiled steps, after 3 warm-up steps (default 3)")
    p.add_argument("--top", type=at_least(1), default=25, help="rows printed (default 25)")
    p.add_argument("--by-shape", action="store_true", help="one row per operator and input shapes")
    args = p.parse_args(argv)
    if args.system == "Marian" and importlib.util.find_spec("transformers") is None:  # an ImportError trace
        raise SystemExit("--system Marian needs transformers: pip install -e '.[bench]'")
    device = str(require_device(args.device))
    # inductor builds C++ on a CPU: without a compiler that works, an 84-line traceback at the first step
    if args.compile and torch.device(device).type == "cpu":
        try:
            check_compile_works("--compile on a CPU")
        except UserError as e:
            raise SystemExit(f"{e}; or leave out --compile") from None
    kept = keep_freed_memory()  # as train_step.py and `aiayn train`: large buffers reused, not re-faulted
    # what a figure quoted from this output needs beside it; before the steps, so the load is the machine's
    print(f"command: {command_line(__file__, argv)}")
    print(f"environment: {environment(device, keeps_freed_memory=kept)}", flush=True)
    shape = train_step.SHAPES[args.config]
    c = model_config(shape["preset"], vocab_size=shape["vocab"])
    batch = tuple(x.to(device) for x in train_step.make_batch(shape, torch.Generator().manual_seed(0)))
    step = train_step.system_step(args.system, c, train_step.PRECISIONS[args.precision], args.compile,
                                  device=device)
    for _ in range(3):
        step(*batch)  # compilation, allocator and kernel caches out of the profile
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=args.by_shape) as prof:
        for _ in range(args.steps):
            step(*batch)
    events = prof.key_averages(group_by_input_shape=args.by_shape)
    gpu_key = next(k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(events[0], k))
    key = gpu_key if cuda else "self_cpu_time_total"
    if cuda:  # operators only: a kernel's own row would count its time a second time
        events = [e for e in events if e.device_type == DeviceType.CPU]
    events = sorted(events, key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) / args.steps / 1000
    print(f"{args.system}{' (compiled)' if args.compile else ''} {args.config} {args.precision} on {device}: "
          f"{total:.1f} ms of {'GPU kernel' if cuda else 'CPU operator'} self time per step")
    print(f"{'ms/step':>8} {'share':>6} {'calls':>6}  name")
    for e in events[: args.top]:
        ms = getattr(e, key) / args.steps / 1000
        shapes = f"  {e.input_shapes}"[:120] if args.by_shape else ""
        print(f"{ms:8.2f} {100 * ms / total:5.1f}% {e.count // args.steps:6d}  {e.key[:100]}{shapes}")


if __name__ == "__main__":
    main()
