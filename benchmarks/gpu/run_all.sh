#!/usr/bin/env bash
# The first run on one GPU (issue 18), in one command, within ten minutes:
#   1. env          device, driver, versions, git commit                          (env_info.py)
#   2. tests-*      kernel tests compiled on CUDA in fp32/fp16/bf16, model and training tests (pytest)
#   3. kernels      our Triton kernels vs eager, torch.compile, SDPA, flash-attn 2, Liger  (bench_kernels_peers.py)
#   4. e2e          LLaMA 1B / 3B tokens/s, TFLOP/s, MFU, peak memory; bf16/fp8, compile sweep (bench_e2e.py)
#   5. loss_curves  bf16 and fp8 loss curves against fp32's                       (loss_curves.py)
# then report.py writes README.md + results.json. Every step has its own budget (seconds): it is killed
# at the budget so a slow or hung step cannot eat the others' time, and the next one starts.
#
# Usage:  benchmarks/gpu/run_all.sh [--cpu-dry-run] [--results-root DIR]
#   --cpu-dry-run   (or LLMTRAIN_GPU_DRY_RUN=1) every step on CPU at tiny shapes under TRITON_INTERPRET=1
#   --results-root  where the new folder <date>-<device> goes (default benchmarks/results; a dry run's
#                   default is ${TMPDIR:-/tmp}/llmtrain-results, so it never lands among real results)
#   LLMTRAIN_WHEELS=DIR  install the vendored wheels in DIR first (pip --no-index --no-deps)
#   STEPS="tests-kernels e2e"  run only these steps (env always runs), e.g. to rerun what a budget cut
#   KERNEL_TESTS="tests/kernels/test_attention.py ..."  the kernel test files to run (default: all)
#   E2E_ARGS="--configs configs/llama-1b.yaml --compile blocks"  bench_e2e.py's sweep (default: its own)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/benchmarks/gpu"
DRY="${LLMTRAIN_GPU_DRY_RUN:-0}"
RESULTS_ROOT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) DRY=1 ;;
    --results-root) RESULTS_ROOT="$2"; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  DEVICE=cpu-dry-run
  RESULTS_ROOT="${RESULTS_ROOT:-${TMPDIR:-/tmp}/llmtrain-results}"
  FLAG=--dry-run
  # Budgets (s): generous for a loaded 2-core CPU; the GPU ones below sum to under ten minutes.
  B_ENV=60; B_TESTS_KERNELS=420; B_TESTS_TRAIN=300; B_KERNELS=420; B_E2E=420; B_CURVES=240
  TESTS_KERNELS=(tests/kernels/test_bf16.py tests/kernels/test_dispatch.py tests/kernels/test_glu.py -m "not slow")
  TESTS_TRAIN=(tests/training/test_fp8.py -m "not slow")
  E2E_ARGS=(--configs "$ROOT/configs/llama-1b.yaml")
else
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "run_all.sh: no CUDA GPU visible to torch; use --cpu-dry-run to exercise the suite on CPU" >&2
    exit 2
  fi
  DEVICE="$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9]+', '-', torch.cuda.get_device_name()).strip('-'))")"
  RESULTS_ROOT="${RESULTS_ROOT:-$ROOT/benchmarks/results}"
  FLAG=
  # Budgets (s), each overridable from the environment (e.g. B_E2E=300 for a longer sweep); they sum to
  # 540 s, leaving room for start-up and the report within ten minutes.
  # Measured on an H100 (2026-11-25): the attention and compile tests take ~70 s without autotuning, the
  # kernels step spends ~60 s autotuning attention at seq 8192, each e2e process 30-60 s (compile included).
  B_ENV=${B_ENV:-15}; B_TESTS_KERNELS=${B_TESTS_KERNELS:-140}; B_TESTS_TRAIN=${B_TESTS_TRAIN:-35}
  B_KERNELS=${B_KERNELS:-130}; B_E2E=${B_E2E:-175}; B_CURVES=${B_CURVES:-45}
  # Left out: the vocab-parallel cross-entropy test (4 gloo ranks on CPU: one GPU cannot host 4 NCCL ranks)
  # and bench_kernels' interpreter smoke run (CPU only); the kernels step benchmarks on the GPU instead.
  read -r -a KERNEL_TEST_PATHS <<<"${KERNEL_TESTS:-tests/kernels}"
  TESTS_KERNELS=("${KERNEL_TEST_PATHS[@]}" -k "not gloo and not smoke_run")
  # Compiling every kernel variant is CPU-bound: spread the tests over 8 workers where pytest-xdist is.
  if "$PY" -c "import xdist" 2>/dev/null; then TESTS_KERNELS+=(-n 8); fi
  TESTS_TRAIN=(tests/models tests/training/test_fp8.py tests/training/test_lr_schedule.py -m "not slow")
  read -r -a E2E_ARGS <<<"${E2E_ARGS:-}"
fi

# Optional peers vendored as wheels (the GPU machine has no network): LLMTRAIN_WHEELS=DIR installs every
# DIR/*.whl without dependencies or an index (e.g. torchao and liger-kernel, which are pure Python; and the
# e2e peer torchtitan 0.2.2 with what its model imports need: torchdata, tyro, docstring_parser, typeguard).
if [ -n "${LLMTRAIN_WHEELS:-}" ]; then
  "$PY" -m pip install --no-index --no-deps "$LLMTRAIN_WHEELS"/*.whl || echo "run_all.sh: some wheels did not install"
fi

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="$RESULTS_ROOT/$STAMP-$DEVICE"
n=1
while [ -e "$OUT" ]; do OUT="$RESULTS_ROOT/$STAMP-$DEVICE-$n"; n=$((n + 1)); done  # never overwrite
mkdir -p "$OUT"
cd "$ROOT" || exit 2
echo "run_all.sh: results go to $OUT"

# step NAME BUDGET_SECONDS COMMAND...: runs COMMAND with its log in NAME.log, stopped at the budget.
step() {
  local name="$1" budget="$2"
  shift 2
  if [ -n "${STEPS:-}" ] && [ "$name" != env ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "== $name: not in STEPS, skipped"
    return
  fi
  local command
  command="$(printf '%q ' "$@")"  # quoted, so the recorded command can be pasted as it is
  echo "== $name (budget ${budget}s): $command"
  local start=$SECONDS
  # SIGINT first: pytest then stops like on Ctrl-C and still writes its JUnit report; SIGKILL 15 s later.
  timeout --signal=INT --kill-after=15 "$budget" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "   $name hit its ${budget}s budget and was stopped" | tee -a "$OUT/$name.log"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$budget" "${command% }" >>"$OUT/steps.tsv"
  tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
}

step env "$B_ENV" "$PY" "$HERE/env_info.py" --out "$OUT/env.json" $FLAG
# Correctness steps skip autotuning (LLMTRAIN_AUTOTUNE=0: each kernel's first config), which would compile
# and time every config for every test shape; test_attention.py runs each attention config on its own.
step tests-kernels "$B_TESTS_KERNELS" env LLMTRAIN_AUTOTUNE=0 "$PY" -m pytest -v -rfEs -p no:cacheprovider "${TESTS_KERNELS[@]}" \
  --junitxml "$OUT/tests-kernels.xml"
step tests-train "$B_TESTS_TRAIN" env LLMTRAIN_AUTOTUNE=0 "$PY" -m pytest -v -rfEs -p no:cacheprovider "${TESTS_TRAIN[@]}" \
  --junitxml "$OUT/tests-train.xml"
# Each Python step stops starting new cases 40 s before its budget, so it can still write its JSON.
step kernels "$B_KERNELS" "$PY" "$HERE/bench_kernels_peers.py" --out "$OUT/kernels.json" \
  --budget-s $((B_KERNELS - 40)) $FLAG
step e2e "$B_E2E" "$PY" "$HERE/bench_e2e.py" --out "$OUT/e2e.json" --budget-s $((B_E2E - 40)) \
  "${E2E_ARGS[@]}" $FLAG
step loss_curves "$B_CURVES" env LLMTRAIN_AUTOTUNE=0 "$PY" "$HERE/loss_curves.py" --out "$OUT/loss_curves.json" $FLAG
"$PY" "$HERE/report.py" "$OUT"
echo "run_all.sh: done in ${SECONDS}s; results in $OUT (README.md, results.json, one .log per step)"
