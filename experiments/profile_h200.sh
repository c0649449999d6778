#!/usr/bin/env bash
# Calibrate the simulator on this GPU for the Llama-2-7B shape (random weights: config.json only),
# then check it against the real engine; each step fits one device call (under 10 minutes):
#   bash experiments/profile_h200.sh profile    # -> $OUT/h200-llama2-7b.json
#   bash experiments/profile_h200.sh validate   # replay vs simulate on three 60 s traces
#                                               #   -> $OUT/sim-vs-replay/table.md
# A new profile ships as experiments/profiles/h200-llama2-7b.json, its table in docs/simulator.md.
# validate uses $PROFILE (default: the shipped profile if present, else the one `profile` wrote to
# $OUT). DURATION=30 shortens the validation traces; ONLY="n100-a1-r4" runs a subset; RESULTS=DIR
# writes elsewhere; MIXED=N profiles and replays with mixed-step CUDA graphs
# (EngineConfig.mixed_graph_tokens=N).
set -euo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL=experiments/models/llama-2-7b
SHIPPED=experiments/profiles/h200-llama2-7b.json
step=${1:-profile}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
case "$step" in
  profile)
    python3 -m slora.cli profile --model "$MODEL" --load-format dummy --name llama-2-7b \
      ${MIXED:+--mixed-graph-tokens $MIXED} -o "$OUT/h200-llama2-7b.json" 2>&1 | tee "$OUT/profile.log"
    ;;
  validate)
    if [ -z "${PROFILE:-}" ]; then
      if [ -f "$SHIPPED" ]; then PROFILE=$SHIPPED; else PROFILE=$OUT/h200-llama2-7b.json; fi
    fi
    python3 experiments/sim_vs_replay.py --model "$MODEL" --profile "$PROFILE" \
      --duration "${DURATION:-60}" --results "${RESULTS:-$OUT/sim-vs-replay}" ${ONLY:+--only $ONLY} \
      ${MIXED:+--engine "{\"mixed_graph_tokens\": $MIXED}"} \
      2>&1 | tee "$OUT/sim-vs-replay.log"
    ;;
  *) echo "usage: $0 profile|validate" >&2; exit 2 ;;
esac
