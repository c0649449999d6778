#!/usr/bin/env bash
# The one GPU call: the CUDA tests, then the headline benchmarks, then one table of each figure
# beside the ceiling or peer measured in the same run and their ratio (experiments/gpu_table.py).
#
#   bash experiments/gpu.sh [--tree DIR] [--label NAME] [--no-tests] [--bench LIST] [--compare NAME] [--quantization fp8]
#
#   --tree DIR      test and benchmark another copy of the repository (default: this one) from DIR,
#                   PYTHONPATH=DIR, same command lines; the table reads fields both carry
#   --label NAME    the run's name (default: new): $OUT/NAME.tar.gz holds every log and JSON,
#                   $OUT/NAME.txt the table; $OUT defaults to results/gpu
#   --no-tests      the benchmarks alone (a tree whose tests are laid out otherwise)
#   --bench LIST    of: engine s2 decode serve fp8 dora prefix chunk long shared vllm (default: engine s2 decode);
#                   serve: S2 via `slora serve`; fp8: bench_fp8's GEMMs; dora: decode + DoRA; prefix: shared-prompt
#                   trace, caching off/on; chunk: S2 at $CHUNKS (step logs); long: a 100k prompt; shared: S2 on one
#                   adapter, at popularity alphas 0.1/0.5/1, and the shared-adapter (and half-on-one) decode table;
#                   vllm: one LoRA layer, MBGMV beside vLLM's kernels (vllm_peer.py's, in $VLLM_PEER: results/peer)
#   --quantization fp8  engine, s2 and decode with FP8 base weights (the table names them)
#   --compare NAME  the table also holds run NAME (an earlier $OUT/NAME.tar.gz), and this one over it
# Before / after in one call, an older tree copied to results/base (carried to the device): bash
#   experiments/gpu.sh --tree results/base --label base --no-tests; bash experiments/gpu.sh --compare base
# The tree's commit: $SLORA_COMMIT, else its git HEAD (a copy's .git may be stale). JOBS=N: tests in N xdist
# workers (default 8; 0: one process). REPEATS=R: each S2 row (s2, chunk, shared) R times, interleaved, median kept.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd -P)
TREE=$HERE LABEL=new TESTS=1 COMPARE= BENCH="engine s2 decode" QUANT=()
usage() { sed -n 5p "$0" | sed 's/^#   //' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tree) TREE=$(cd "${2:?}" && pwd -P) || usage; shift 2 ;;
    --label) LABEL=${2:?}; shift 2 ;;
    --no-tests) TESTS=0; shift ;;
    --bench) BENCH=${2?}; shift 2 ;;
    --compare) COMPARE=${2:?}; shift 2 ;;
    --quantization) QUANT=(--quantization "${2:?}"); shift 2 ;;
    *) usage ;;
  esac; done
OUT=${OUT:-$HERE/results/gpu}; mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
D=$OUT/$LABEL
rm -rf "$D" "$OUT/$LABEL.tar.gz" && mkdir -p "$D"
export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$TREE" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >"$D/gpu.txt" 2>&1
# the tree's commit, for results whose JSON names none (a tree older than the harness)
head=$([ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$TREE" ] && git rev-parse -q --verify HEAD)
echo "${SLORA_COMMIT:-${head:-unknown}}" >"$D/commit.txt"
failed=(); step() {  # step NAME SECONDS COMMAND...: COMMAND's output in $D/NAME.log, under a time limit
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  printf '== %s:' "$name"; printf ' %q' "$@"; echo
  timeout "$limit" "$@" >"$D/$name.log" 2>&1; local rc=$?; echo "   exit $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || { tail -n 5 "$D/$name.log"; failed+=("$name"); }
}
if [ "$TESTS" = 1 ]; then
  xdist=(); python3 -c 'import xdist' 2>/dev/null && [ "${JOBS:-8}" != 0 ] && xdist=(-n "${JOBS:-8}")
  # the folders whose tests have CUDA paths; the rest of the suite is CPU-only and runs in CI
  step pytest 480 python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" tests/kernels tests/model tests/engine
  [[ " ${failed[*]} " == *" pytest "* ]] || tail -n 1 "$D/pytest.log"
fi
bench() { [[ " $BENCH " == *" $1 "* ]]; }
bench fp8 && step fp8 240 python3 experiments/bench_fp8.py --rows 1,32,64,128,256 --out "$D/fp8"
bench engine && step engine 240 python3 experiments/bench_engine.py --models llama-2-7b \
  --batches 32 --race --skip-hf "${QUANT[@]}" --out "$D/engine"
sc=experiments/bench_scaling.py; rep=$([ -n "${REPEATS:-}" ] && grep -q -- --repeats $sc && echo "--repeats $REPEATS")
s2=(--part scaling --adapters 2000 --num-requests 400 --modules qkvo $rep "${QUANT[@]}")
bench s2 && step s2 300 python3 $sc "${s2[@]}" --out "$D/s2"
bench chunk && step chunk 600 python3 $sc "${s2[@]}" --max-prefill-chunk "${CHUNKS:-0,512,1024,2048,4096}" \
  $(grep -q -- --step-logs $sc && echo --step-logs) --out "$D/chunk"
bench shared && step shared 600 python3 $sc "${s2[@]}" --part scaling,shared --adapters 1,2000 --alpha 0.1,0.5,1 $(
  grep -q -- --shared-hot $sc && echo --shared-hot 0.5) --out "$D/shared"
bench long && step long 420 python3 $sc --part long --model experiments/models/llama-3-8b "${QUANT[@]}" --out "$D/long"
bench vllm && step vllm 240 python3 experiments/bench_kernels.py --only mbgmv --modules 1 \
  --batches 1,4,16,64,256 --ranks 8,16,64 --vllm "${VLLM_PEER:-$HERE/results/peer}" --out "$D/vllm"
bench decode && step decode 300 python3 $sc --part decode --batches 32 --breakdown '' "${QUANT[@]}" \
  $(bench dora && echo --dora) --out "$D/decode"
bench serve && step serve 420 python3 experiments/bench_serve.py --out "$D/serve" && tail -n 12 "$D/serve.log"
bench prefix && step prefix 300 python3 experiments/bench_prefix.py \
  --profile experiments/profiles/h200-llama2-7b.json --out "$D/prefix" && tail -n 8 "$D/prefix.log"
tar czf "$OUT/$LABEL.tar.gz" -C "$OUT" "$LABEL" && rm -rf "$D"
runs=(${COMPARE:+"$OUT/$COMPARE.tar.gz"} "$OUT/$LABEL.tar.gz"); echo
python3 "$HERE/experiments/gpu_table.py" "${runs[@]}" | tee "$OUT/$LABEL.txt"
[ ${#failed[@]} = 0 ] || { echo "failed: ${failed[*]} (logs in $OUT/$LABEL.tar.gz)"; exit 1; }
