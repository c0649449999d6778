#!/usr/bin/env bash
# The one GPU call: CUDA tests, kernel benchmarks, engine benchmarks; a short table last.
# Run through the device tool from the repo root (carry .whl: pytest & co. for the image):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; \
#   PYTHONPATH=/tmp/site bash experiments/gpu_check.sh [tests|kernels|engine|adapters|scaling|all ...]
# Details land under $OUT (or ./results/gpu).
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("${@:-all}")
want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }
summary=()
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

if want tests; then
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_csrc.py \
    tests/test_engine_triton.py tests/test_model_vs_hf.py tests/test_lora_vs_peft.py \
    tests/test_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -15
  summary+=("tests: $(grep -E '(passed|failed)' "$OUT/pytest.log" | tail -1)")
fi
if want kernels; then
  python3 experiments/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" | tail -60
fi
if want engine; then
  python3 experiments/bench_engine.py --out "$OUT" --race 2>&1 | tee "$OUT/bench_engine.log" | tail -30
fi
if want adapters; then
  python3 experiments/bench_prefetch.py --out "$OUT" 2>&1 | tee "$OUT/bench_prefetch.log" | tail -8
fi
if want scaling; then
  python3 experiments/bench_scaling.py --part all --out "$OUT" 2>&1 | tee "$OUT/bench_scaling.log" | tail -32
fi
echo; echo "== summary =="
for s in "${summary[@]}"; do echo "$s"; done
[ -f "$OUT/bench_kernels.log" ] && tail -40 "$OUT/bench_kernels.log"
[ -f "$OUT/bench_engine.log" ] && tail -12 "$OUT/bench_engine.log"
[ -f "$OUT/bench_prefetch.log" ] && tail -5 "$OUT/bench_prefetch.log"
[ -f "$OUT/bench_scaling.log" ] && tail -32 "$OUT/bench_scaling.log"
