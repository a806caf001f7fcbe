#!/usr/bin/env bash
# One device call: compiled-gradient tests and diagnosis, then e2e rows against torchtitan with profiles.
set -uo pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
R=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -c "import torch, triton, torchao, torchtitan; print(torch.__version__, triton.__version__, torchao.__version__, torchtitan.__version__)" >> $R/env.txt 2>&1
git rev-parse HEAD >> $R/env.txt 2>/dev/null; cat $R/env.txt
# 1. compiled gradients (issue point 1), and the diagnosis beside it (both CPU-bound compiles, 16 cores)
timeout 120 python3 .gpu/diagnose_compile.py $R/diagnose.json > $R/diagnose.log 2>&1 &
DIAG=$!
LLMTRAIN_AUTOTUNE=0 timeout 110 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_norms.py tests/kernels/test_glu.py tests/kernels/test_rotary.py > $R/eager_tests.log 2>&1 &
EAGER=$!
LLMTRAIN_AUTOTUNE=0 timeout 115 python3 -m pytest -q -p no:cacheprovider -rfEs -n 8 tests/kernels/test_compile.py tests/kernels/test_launch_layout.py > $R/compile_tests.log 2>&1
echo "compile tests rc=$? at $((SECONDS-START))s"; tail -4 $R/compile_tests.log
wait $EAGER; echo "eager tests rc=$?"; tail -2 $R/eager_tests.log
wait $DIAG; echo "diagnosis done at $((SECONDS-START))s"
# 2. e2e: 1B against torchtitan, profiled
timeout 150 python3 benchmarks/gpu/bench_e2e.py --out $R/e2e_1b.json --configs configs/llama-1b.yaml --precision bf16 --compile none blocks --profile --steps 7 --warmup 3 --budget-s 100 > $R/e2e_1b.log 2>&1
echo "e2e 1b rc=$? at $((SECONDS-START))s"; grep -E "tokens_per_s|status" $R/e2e_1b.log | cut -c1-300
# 3. 3B: bf16 compiled, torchtitan, fp8 compiled
timeout 150 python3 benchmarks/gpu/bench_e2e.py --out $R/e2e_3b.json --configs configs/llama-3b.yaml --precision bf16 fp8 --compile blocks --profile --steps 6 --warmup 2 --budget-s 95 > $R/e2e_3b.log 2>&1
echo "e2e 3b rc=$? at $((SECONDS-START))s"; grep -E "tokens_per_s|status" $R/e2e_3b.log | cut -c1-300
# 4. an 8B-shaped stack (hidden 4096, ffn 14336), bf16 against fp8
LEFT=$((575 - (SECONDS - START)))
if [ $LEFT -gt 60 ]; then
timeout $LEFT python3 benchmarks/gpu/bench_e2e.py --out $R/e2e_8b.json --configs configs/llama3-8b.yaml --set parallel.tp=1 parallel.sequence_parallel=false model.num_layers=12 model.seq_length=4096 model.recompute=selective --precision bf16 fp8 --compile blocks --torchtitan off --steps 5 --warmup 2 --budget-s $((LEFT - 50)) > $R/e2e_8b.log 2>&1
echo "e2e 8b rc=$? at $((SECONDS-START))s"; grep -E "tokens_per_s|status" $R/e2e_8b.log | cut -c1-300
fi
echo "done at $((SECONDS-START))s"
