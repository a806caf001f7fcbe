#!/usr/bin/env bash
# Second device call: compiled-gradient tests, then compiled rows without graph breaks against torchtitan.
set -uo pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
R=$OUT
LLMTRAIN_AUTOTUNE=0 timeout 75 python3 -m pytest -q -p no:cacheprovider -rfEs -n 12 tests/kernels/test_compile.py tests/kernels/test_launch_layout.py > $R/compile_tests.log 2>&1
echo "compile tests rc=$? at $((SECONDS-START))s"; tail -3 $R/compile_tests.log
timeout 95 python3 benchmarks/gpu/bench_e2e.py --out $R/e2e_1b.json --configs configs/llama-1b.yaml --precision bf16 --compile blocks none --profile --steps 7 --warmup 3 --budget-s 60 > $R/e2e_1b.log 2>&1
echo "e2e 1b rc=$? at $((SECONDS-START))s"; grep -E "^\{" $R/e2e_1b.log | cut -c1-220
LEFT=$((280 - (SECONDS - START)))
timeout $LEFT python3 benchmarks/gpu/bench_e2e.py --out $R/e2e_3b.json --configs configs/llama-3b.yaml --precision bf16 fp8 --compile blocks --profile --steps 6 --warmup 2 --budget-s $((LEFT - 45)) > $R/e2e_3b.log 2>&1
echo "e2e 3b rc=$? at $((SECONDS-START))s"; grep -E "^\{" $R/e2e_3b.log | cut -c1-220
echo "done at $((SECONDS-START))s"
