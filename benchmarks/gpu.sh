#!/usr/bin/env bash
# The checks that only a CUDA GPU can make, in one go, for a machine lent for minutes:
#
#   OUT=some/folder bash benchmarks/gpu.sh [SECONDS]
#
# the GPU tests (tests/test_cuda.py and the other CUDA-only ones), the training step (small, base and the
# paper's 25k-token batch, fp32 and bf16, against nn.Transformer and Marian, with the bf16 loss curve),
# decoding against HuggingFace (and CTranslate2 where its CUDA libraries load), the demo on the GPU,
# train.checkpoint_activations's memory and time, then aiayn compiled, then the whole default test suite (in
# parallel where pytest-xdist is). Every step gets at most what is left of SECONDS (default 540), so the
# script ends in time and what it measured so far is kept; the suite gets all that is left. A step that
# fails or runs out of its time does not stop the later ones, but the script then exits 1, its last line
# naming those steps (a step skipped because no time is left is not a failure). Needs a python3 with CUDA
# PyTorch, the package's dependencies (sentencepiece, sacrebleu, safetensors, matplotlib, tqdm, numpy),
# transformers, pytest and pytest-timeout (the last three are in the [test] extra; pyproject.toml's addopts
# pass --timeout, which pytest refuses without that plugin, so its absence stops the script first, in one
# line), and a CUDA device that torch sees (without one it stops at once, in one line); the package runs
# from src/ (nothing installed). Runs from the repository root wherever it is started. Writes $OUT/log.txt
# and the benchmarks' reports (OUT: default benchmarks/results/local/gpu in the repository).
set -u -o pipefail  # pipefail: the status of the steps' block, not tee's 0
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # the comment above, as usage (it said "SECONDS must be...")
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0
fi
# the steps name tests/, benchmarks/ and src/ from the repository root: run from elsewhere they failed
# (or tested an installed aiayn); an OUT given is taken from where the script was run, as typed
[[ -n ${OUT:-} && $OUT != /* ]] && OUT="$PWD/$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || { echo "gpu.sh: cannot go to the repository root" >&2; exit 2; }
OUT=${OUT:-benchmarks/results/local/gpu}
budget=${1:-540}
if ! [[ $budget =~ ^[0-9]+$ ]] || ((10#$budget < 10)); then
  echo "gpu.sh: SECONDS must be a whole number of seconds, at least 10, not '$budget'" >&2; exit 2
fi
# without pytest-timeout every pytest step failed on "unrecognized arguments: --timeout=600", minutes in
if ! python3 -c "import pytest, pytest_timeout" 2>/dev/null; then
  echo "gpu.sh: the tests need pytest and pytest-timeout (pyproject.toml's addopts pass --timeout):" \
    "pip install pytest pytest-timeout" >&2; exit 2
fi
# without CUDA every step failed in turn (nvidia-smi, a traceback, each --device cuda), then the CPU suite
# ran for all the time left
# a torch that cannot be imported (its CUDA libraries missing) says why, not "no CUDA device"
if ! imported=$(python3 -c "import torch" 2>&1); then
  echo "gpu.sh: python3 cannot import torch: $(printf '%s\n' "$imported" | tail -n 1)" >&2; exit 2
fi
if ! python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "gpu.sh: no CUDA device here (python3 -c 'import torch; assert torch.cuda.is_available()' fails):" \
    "run it on a machine with one" >&2; exit 2
fi
mkdir -p "$OUT" || { echo "gpu.sh: cannot make the folder OUT=$OUT" >&2; exit 2; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + 10#$budget))

failed=""  # the steps that exited non-zero (a timeout's 124 included), for the last line and the status
run() {  # run CAP COMMAND...: COMMAND under min(CAP, seconds left), its status and time said, never fatal
  local cap=$1 left=$((deadline - SECONDS)) began=$SECONDS status
  shift
  ((left < cap)) && cap=$left
  if ((cap < 10)); then echo "== skipped (time is up): $*"; return 0; fi
  echo "== $(date +%T) [${cap} s at most] $*"
  timeout -k 5 "$cap" "$@"  # -k: a step that ignores SIGTERM is killed, not left to overrun SECONDS
  status=$?
  echo "== exit $status after $((SECONDS - began)) s"
  local step="$*"
  step=${step%%$'\n'*}  # its first line, 50 characters of it: a name for the last line, not the command
  ((status == 0)) || failed+=" [${step:0:50}... exit $status]"
}

{
  run 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  run 30 python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
torch.cuda.get_device_name())"
  run 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_data.py \
    tests/test_train_step_benchmark.py -k "cuda or gpu"
  run 150 python3 benchmarks/train_step.py --device cuda --configs small,base,base25k --no-compile \
    --steps 10 --warmup 3 --loss-steps 150 --out "$OUT/train_step_gpu.md"
  run 120 python3 benchmarks/decode.py --device cuda --repeats 5 --out "$OUT/decode_gpu"
  run 90 python3 -m aiayn demo --device cuda --out "${TMPDIR:-/tmp}/aiayn-gpu-demo-$$"
  run 120 python3 benchmarks/checkpoint_activations.py --device cuda --configs base25k --precisions bf16 \
    --rounds 3 --out "$OUT/checkpoint_activations_gpu"
  run 150 python3 benchmarks/train_step.py --device cuda --configs base25k --precisions bf16 \
    --steps 10 --warmup 3 --loss-steps 0 --out "$OUT/train_step_gpu_compiled.md"
  # the whole default suite where CUDA is present, each test's outcome on its own line as it ends (-v): a
  # suite cut off at its time limit still names its failures (-q named none before the end)
  parallel=$(python3 -c "import os, xdist; print('-n', max(1, (os.cpu_count() or 2) - 1))" 2>/dev/null)
  # all the time left, less 15 s: timeout's 5 s grace before its kill, and the summary after it. --timeout
  # 300: the compiled-decoding tests' fixture compiles a CPU step in 81 s alone, past 240 s under 15 workers
  run $((deadline - SECONDS - 15)) python3 -m pytest -p no:cacheprovider -v $parallel --timeout 300 tests \
    >"$OUT/suite.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|[0-9]+ (passed|failed)|== (exit|skipped)" "$OUT/suite.txt" | tail -40
  if [[ -n $failed ]]; then echo "gpu.sh: failed:$failed"; exit 1; fi
  echo "gpu.sh: every step that ran exited 0"
} 2>&1 | tee "$OUT/log.txt"
