#!/usr/bin/env bash
# The GPU runs of the open issues as device calls on an nvidia-h200-x2 machine: two lanes
# run side by side, one per GPU, each under its own time limit, and everything they write is
# packed into $OUT/results.tgz (the device tool returns no file whose name holds "=", as the
# suite results' do). Run from the repo root through the device tool, kind nvidia-h200-x2,
# carry [".whl"], timeout 600:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     >/dev/null 2>&1; bash experiments/gpu_session.sh 1      # then 2
# Lane limits default to 540 s (LIMIT=...); a lane cut short still returns what it wrote.
#   call 1  GPU0: CUDA tests, bench_prefetch (#4), slora profile (#7, -> $OUT/h200-llama2-7b.json),
#           decode steps at batch 1/32 with the kernel tables of a decode and a mixed step
#           GPU1: Table 3 S1 and S2 at 5/100/1000/2000 adapters, 30 s of traffic each (#6)
#   call 2  GPU0: replay vs simulate on three traces with the profile (#7), the PEFT race (#5a)
#           GPU1: bench_scaling (#5b adapter scaling, #5c decode vs byte floor + kernel table),
#                 bench_kernels (MBGMV/MBGMM/attention vs copy bandwidth)
#   call 3  both lanes again after a change to kernels, runner or scheduler: GPU0 CUDA tests,
#           a fresh profile validated against replay, bench_prefetch; GPU1 decode steps and
#           kernel tables, the PEFT race, adapter scaling, bench_kernels
# Before call 2, commit call 1's profile as experiments/profiles/h200-llama2-7b.json.
set -u
# One OpenMP thread per process: two lanes of torch processes with a thread per core each can
# spin-wait on the cores the other lane's Python thread needs (./run sets the same for CPU).
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export OUT=${OUT:-results/gpu}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
nvidia-smi -L
NGPU=$(nvidia-smi -L | wc -l)
lane() {  # lane GPU NAME COMMANDS: run COMMANDS on GPU under the limit, log to $OUT/NAME.log
  # (on a one-GPU machine the lanes run one after the other on GPU 0, each under LIMIT)
  if [ "$NGPU" -lt 2 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" bash -c "$3" >"$OUT/$2.log" 2>&1; echo "[$2 exit $?]" >>"$OUT/$2.log"
  else
    (CUDA_VISIBLE_DEVICES=$1 timeout "$LIMIT" bash -c "$3" >"$OUT/$2.log" 2>&1; echo "[$2 exit $?]" >>"$OUT/$2.log") &
  fi
}
before_tree() {  # before_tree FILE...: /tmp/before, a copy of the tree with each slora/FILE
  # from before_<its name> (untracked, made by `git show <rev>:slora/FILE`), for "before" lanes
  rm -rf /tmp/before && mkdir /tmp/before && cp -r slora experiments csrc /tmp/before/ || return
  for f; do cp "before_$(basename "$f")" "/tmp/before/slora/$f"; done
}
# one line per row of a bench_scaling.json (run in the folder above scaling/)
SHOW="import json; [print(r['adapters'], r['modules'], round(r['wall_s'], 2), round(r['mixed_s'], 2), round(r['eager_s'], 2), round(r['ratio'], 3)) for r in json.load(open('scaling/bench_scaling.json'))['scaling']]"
# S2 q/k/v/o at 2,000 adapters (bench_scaling's arguments; print its rows with SHOW)
S2_QKVO='experiments/bench_scaling.py --part scaling --adapters 2000 --num-requests 400 --modules qkvo'
profile_s2_lanes() {  # profile_s2_lanes "FIRST": GPU0 runs FIRST, the engine's CUDA tests and a
  # fresh profile validated on n100; GPU1 S2 (q/k/v/o, all seven; 1 and 2,000 adapters) on
  # this tree, then on /tmp/before (before_tree), then the larger traces with that profile
  local S2='experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400'
  lane 0 gpu0 "$1
      python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1
      bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch \$OUT/profile.done
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=\$OUT/sim-vs-replay-0 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -14"
  lane 1 gpu1 "python3 $S2 --out \$OUT/scaling 2>&1 | tail -1; (cd \$OUT && python3 -c \"$SHOW\")
      (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $S2 --out \$OUT/scaling-before/scaling 2>&1 | tail -1; cd \$OUT/scaling-before && python3 -c \"$SHOW\")
      while [ ! -f \$OUT/profile.done ]; do sleep 5; done
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY='n1000-a0.5-r8 n2000-a1-r10' \\
        RESULTS=\$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -16"
}
s2_after_before() {  # s2_after_before TESTS: GPU0 runs the CUDA tests TESTS, then S2 at 2,000
  # adapters (q/k/v/o and all seven) on this tree; GPU1 S2 q/k/v/o on /tmp/before (before_tree)
  local S2='experiments/bench_scaling.py --part scaling --adapters 2000 --num-requests 400'
  lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider $1 2>&1 | tail -1
      python3 $S2 --modules qkvo,all --out \$OUT/scaling 2>&1 | grep -E '^scaling: warm'; (cd \$OUT && python3 -c \"$SHOW\")"
  lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $S2 --modules qkvo --out \$OUT/scaling-before/scaling 2>&1 | grep -E '^scaling: warm'; cd \$OUT/scaling-before && python3 -c \"$SHOW\""
}
case "${1:-}" in
  1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k cuda 2>&1 | tail -2
      python3 -m pytest -q -p no:cacheprovider tests/test_csrc.py tests/test_engine_triton.py 2>&1 | tail -2
      python3 experiments/bench_prefetch.py --out $OUT 2>&1 | tail -13
      bash experiments/profile_h200.sh profile 2>&1 | tail -12
      python3 experiments/bench_scaling.py --part decode --batches 1,32 --out $OUT/breakdown 2>&1 | tail -60'
    lane 1 gpu1 'for s in s1 s2; do python3 experiments/run_suite.py experiments/suites/table3-$s.json \
      --results $OUT/suites --set duration=30 --quiet; done'
    ;;
  2)
    lane 0 gpu0 'DURATION=40 bash experiments/profile_h200.sh validate 2>&1 | tail -12
      python3 experiments/bench_engine.py --models llama-2-7b --batches 1,32 --race --out $OUT/engine 2>&1 | tail -8'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --out $OUT/breakdown 2>&1 | tail -90
      python3 experiments/bench_scaling.py --part scaling --num-requests 400 --out $OUT/scaling 2>&1 | tail -30
      python3 experiments/bench_kernels.py --out $OUT/kernels 2>&1 | tail -40'
    ;;
  3)  # after a change to the kernels, the runner or the scheduler: everything it moves, once
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py -k "cuda or triton or mbgmm" 2>&1 | tail -2
      bash experiments/profile_h200.sh profile 2>&1 | tail -6
      python3 experiments/bench_prefetch.py --out $OUT 2>&1 | tail -13
      PROFILE=$OUT/h200-llama2-7b.json DURATION=30 bash experiments/profile_h200.sh validate 2>&1 | tail -7'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 1,32 --out $OUT/breakdown 2>&1 | tail -75
      python3 experiments/bench_engine.py --models llama-2-7b --batches 1,32 --race --out $OUT/engine 2>&1 | tail -8
      python3 experiments/bench_kernels.py --out $OUT/kernels 2>&1 | tail -12
      python3 experiments/bench_scaling.py --part scaling --num-requests 400 --out $OUT/scaling 2>&1 | tail -14'
    ;;
  5)  # the next session's first call (notes/GPU_PLAN.md): #4's prefetch, #7's profile (now with
      # serving steps) and its validation with step logs, #5's adapter scaling
    lane 0 gpu0 'python3 experiments/bench_prefetch.py --out $OUT 2>&1 | tail -13
      bash experiments/profile_h200.sh profile 2>&1 | tail -8
      PROFILE=$OUT/h200-llama2-7b.json DURATION=30 bash experiments/profile_h200.sh validate 2>&1 \
        | grep -v "^  [a-zA-Z]" | tail -40'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --num-requests 400 --out $OUT/scaling 2>&1 | tail -14
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6'
    ;;
  6)  # the next session's second call: decode steps against their floor with kernel tables
      # at batch 32 and 256 (256 took 22 ms against an 11.7 ms floor), the CUDA tests
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --breakdown 32,256 --out $OUT/breakdown 2>&1 | tail -120'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py tests/test_csrc.py 2>&1 | tail -2
      python3 experiments/bench_kernels.py --out $OUT/kernels 2>&1 | tail -40'
    ;;
  4)  # a short call: the validation traces a call 3 did not finish, and q/k/v/o scaling
    lane 0 gpu0 'PROFILE=${PROFILE:-experiments/profiles/h200-llama2-7b.json} DURATION=30 \
      ONLY="${ONLY:-n1000-a0.5-r8 n2000-a1-r10}" bash experiments/profile_h200.sh validate 2>&1 | tail -7'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --num-requests 400 \
      --out $OUT/scaling 2>&1 | tail -12'
    ;;
  7)  # #7 after the cost model's host piece and resident serving adapters: a fresh profile,
      # validated with step logs that carry each copy's bytes; the CUDA tests beside it
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -8
      PROFILE=$OUT/h200-llama2-7b.json DURATION=30 bash experiments/profile_h200.sh validate 2>&1 \
        | grep -v "^  [a-zA-Z]" | tail -40'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py tests/test_csrc.py 2>&1 | tail -2'
    ;;
  8)  # #7's check of the shipped profile on 60 s traces, nothing else on the host's CPUs but a
      # short decode lane: the breakdown of a decode and a mixed step at batch 128 (#5)
    lane 0 gpu0 'DURATION=60 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -40'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --breakdown 128 --out $OUT/breakdown 2>&1 | tail -100'
    ;;
  9)  # mixed-step CUDA graphs (EngineConfig.mixed_graph_tokens, never yet on a GPU): their
      # CUDA tests, then the mixed steps' breakdown and the S2 scaling with them on and off
    lane 0 gpu0 'python3 -m pytest -q -rf -p no:cacheprovider tests/test_engine_triton.py tests/test_kernels_attention.py tests/test_kernels_lora.py 2>&1 | grep -E "passed|failed|Error|FAILED" | tail -8
      python3 experiments/bench_kernels.py --only-mixed --out $OUT/kernels 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32,128 --mixed-graph-tokens 2048 --out $OUT/breakdown-graphs 2>&1 | tail -120
      python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --out $OUT/breakdown-eager 2>&1 | tail -60'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --mixed-graph-tokens 2048 --out $OUT/scaling-graphs 2>&1 | tail -8
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8'
    ;;
  10)  # the prefill kernels' work tiles and the decode rows of every mixed step through the
       # decode kernels: CUDA tests, mixed-step breakdowns eager and graphed, S2 scaling both
       # ways, the race
    lane 0 gpu0 'python3 -m pytest -q -rf -p no:cacheprovider tests/test_engine_triton.py tests/test_kernels_attention.py tests/test_kernels_lora.py 2>&1 | grep -E "passed|failed|Error|FAILED" | tail -8
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown 32,128 --out $OUT/breakdown-eager 2>&1 | grep -A12 "^kernel breakdown, mixed\|^ *batch"
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown 32,128 --mixed-graph-tokens 2048 --out $OUT/breakdown-graphs 2>&1 | grep -A12 "^kernel breakdown, mixed\|^ *batch"
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --mixed-graph-tokens 2048 --out $OUT/scaling-graphs 2>&1 | tail -8'
    ;;
  11)  # #7 with mixed-step graphs on by default: a fresh profile, then replay vs simulate with
       # it on three 60 s traces, one on GPU0 after the profile, two on GPU1 once it exists
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -8; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -12'
    lane 1 gpu1 'while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14'
    ;;
  12)  # as 11 after the warm-up covers every mixed bucket and the cost model's mixed/padded
       # features; then the race and the batch-32 breakdown with its GPU idle gaps split
       # (GPU0), S2 scaling (GPU1), at the defaults
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -8; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -12
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32 --out $OUT/breakdown 2>&1 | grep -A6 "^kernel breakdown\|^ *batch"'
    lane 1 gpu1 'while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8'
    ;;
  13)  # as 12, with the MBGMV tile sweep (batch 16-256, now 32 too) on GPU1 while the profile runs
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -8; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -12
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32 --out $OUT/breakdown 2>&1 | grep -A8 "^kernel breakdown\|^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_kernels.py --tune mbgmv --tune-only --out $OUT/kernels 2>&1 | grep -A4 "^tune"
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8'
    ;;
  15)  # CUDA tests (GPU1, while GPU0 profiles), then as 13 with batch-128 decode rows and the
       # host profile of decode steps (call 14, at 7675c59, also timed one-piece graphs)
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown 32 --out $OUT/breakdown 2>&1 | grep -A12 "^kernel breakdown\|^ *batch\|^host"'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k cuda 2>&1 | tail -2
      python3 -m pytest -q -p no:cacheprovider tests/test_csrc.py tests/test_engine_triton.py 2>&1 | tail -2
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8'
    ;;
  16)  # the shipped profile on a fresh machine, after the warm-up reaches every mixed bucket:
       # replay vs simulate on the three traces (n100 on GPU0; n1000, n2000 on GPU1)
    lane 0 gpu0 'PROFILE=experiments/profiles/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 \
        RESULTS=$OUT/sim-vs-replay-0 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14'
    lane 1 gpu1 'PROFILE=experiments/profiles/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  17)  # async scheduling: the batch-32 decode table without (GPU0) and with it (GPU1), then
       # its tests on CUDA (real graphs, pinned copies, events)
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown "" --out $OUT/sync 2>&1 | grep -A4 "^ *batch"
      python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py 2>&1 | tail -2'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown "" --async-scheduling --out $OUT/async 2>&1 | grep -A4 "^ *batch"'
    ;;
  18)  # async scheduling at batch 128 (GPU0 without, GPU1 with), then S2 with it (GPU1)
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown "" --out $OUT/sync 2>&1 | grep -A4 "^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown "" --async-scheduling --out $OUT/async 2>&1 | grep -A4 "^ *batch"
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 2000 --num-requests 400 --async-scheduling --out $OUT/scaling 2>&1 | tail -6'
    ;;
  19)  # session 7's first call: decode attention tile sweep (tl.dot or CUDA-core sums, keys a
       # step, warps, stages, splits) and the decode GEMMs' weight layout, with the attention
       # tests on CUDA, then the race with async scheduling beside sync (GPU0); S2 q/k/v/o with
       # async scheduling (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | tail -2
      python3 experiments/bench_kernels.py --tune attention --tune-only --out $OUT/kernels 2>&1 | grep -v "^ *attention {"
      python3 experiments/bench_kernels.py --tune gemm --tune-only --out $OUT/kernels-gemm 2>&1 | tail -5
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --sync-too --out $OUT/engine 2>&1 | tail -8'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --async-scheduling --out $OUT/scaling 2>&1 | tail -8'
    ;;
  20)  # async scheduling on by default (no host waits in its launches): the CUDA tests, a profile
       # timed in its order validated on three 60 s traces (n100 GPU0; n1000, n2000 GPU1), the
       # decode table (GPU0), the race with sync beside it and S2 q/k/v/o (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py tests/test_engine_triton.py 2>&1 | tail -2
      bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A8 "^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --sync-too --out $OUT/engine 2>&1 | tail -7
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -6
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  21)  # as 20 after the warm-up's eager steps (S2's first eager steps took 0.4-1.3 s in call 2),
       # with S2 for all seven modules too
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A8 "^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  22)  # the decode kernel's split count a runtime argument (no compile per count) and the step
       # logs' Triton compiles: attention and engine tests on CUDA (call 4 of session 7 ran the
       # attention ones), the decode table and the race (GPU0);
       # S2 with the compiles of its stalls named (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_engine_triton.py tests/test_async_scheduling.py 2>&1 | tail -2
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A8 "^ *batch"
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -12'
    ;;
  # 23 (session 8, call 1) timed MBGMV as one launch and programmatic dependent launch; both
  # lost or tied and are gone (notes/h200-2026-11-30-s8/README.md)
  24)  # where S2's LoRA time goes in its steps with prompts (+1.4-1.7 s over 119 steps in call
       # 1 of session 8): graphed mixed steps' kernels at batch 256 and 128 with 1-2 prompts
       # of 256 tokens (rank 64 GPU0, 16 GPU1); S2 q/k/v/o with its eager steps' time apart
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 256 --breakdown 256 --mixed-prompts 1 --mixed-prompt-len 256 --decode-rank 64 --out $OUT/breakdown-256 2>&1 | grep -A16 "^kernel breakdown, mixed"
      python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --mixed-prompts 2 --mixed-prompt-len 256 --decode-rank 16 --out $OUT/breakdown-128 2>&1 | grep -A16 "^kernel breakdown"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8'
    ;;
  25)  # MBGMV over a mixed graph's sequence rows only (not its token bucket), the MBGMM sweep
       # (d_in slices for short prompts): CUDA tests, the mixed-step kernels at batch 128, S2
       # q/k/v/o (GPU0); MBGMM sweep, the batch-256 rank-64 mixed step (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py tests/test_async_scheduling.py 2>&1 | tail -2
      python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --mixed-prompts 2 --mixed-prompt-len 256 --decode-rank 16 --out $OUT/breakdown-128 2>&1 | grep -A12 "^kernel breakdown, mixed"
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -7'
    lane 1 gpu1 'python3 experiments/bench_kernels.py --tune mbgmm --tune-only --out $OUT/kernels 2>&1 | grep "^tune"
      python3 experiments/bench_scaling.py --part decode --batches 256 --breakdown 256 --mixed-prompts 1 --mixed-prompt-len 256 --decode-rank 64 --out $OUT/breakdown-256 > $OUT/b256.log 2>&1; grep -A14 "^kernel breakdown, mixed" $OUT/b256.log || tail -20 $OUT/b256.log'
    ;;
  26)  # MBGMM launch settings from call 25's sweep (shrink 8 warps and its d_in split, expand 2
       # stages): the LoRA CUDA tests, the kernel tables (MBGMV vs copy, MBGMM), the decode
       # table and a batch-128 mixed step, S2 q/k/v/o and all seven at 2,000 adapters
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py 2>&1 | tail -2
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | tail -45
      python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown 128 --mixed-prompts 2 --mixed-prompt-len 256 --out $OUT/breakdown 2>&1 | grep -B2 -A9 "^ *batch\|^kernel breakdown, mixed"
      python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -7'
    ;;
  27)  # MBGMM's d_in split capped by the tokens a graph holds (not its bucket's worst-case
       # programs): the MBGMM CUDA tests, the race, a batch-128 mixed step, S2 q/k/v/o
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k mbgmm 2>&1 | tail -1
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --mixed-prompts 2 --mixed-prompt-len 256 --out $OUT/breakdown 2>&1 | grep -A11 "^kernel breakdown, mixed"
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -5'
    ;;
  28)  # the shipped profile against replay after this session's mixed-step LoRA changes, on the
       # two traces with many adapters
    lane 0 gpu0 'DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" RESULTS=$OUT/sim-vs-replay-1 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  29)  # where an S2-like graphed mixed step's LoRA time goes: 192 decode rows of rank 64 and one
       # 256-token prompt (S2's mixed steps: ~250 rows, ranks 8-64, 1-2 prompts)
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 192 --breakdown 192 --mixed-prompts 1 --mixed-prompt-len 256 --decode-rank 64 --out $OUT/breakdown-192 2>&1 | grep -A14 "^ *batch\|^kernel breakdown\|^host, mixed"'
    ;;
  30)  # session 9: the decode GEMMs through the few-rows Triton kernel (slora.kernels.gemm):
       # its CUDA tests, the tile sweep against cuBLAS, the decode table without and with it
       # (GPU0); S2's no-LoRA stall with CUDA's lazy module loading and without (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py 2>&1 | tail -1
      python3 experiments/bench_kernels.py --tune gemm --tune-only --out $OUT/kernels 2>&1 | grep "^tune"
      for r in 0 64; do python3 experiments/bench_scaling.py --part decode --batches 1,32,64 --gemm-rows $r --breakdown "" --out $OUT/breakdown-rows$r 2>&1 | grep -A9 "^ *batch"; done'
    lane 1 gpu1 'for m in LAZY EAGER; do echo "CUDA_MODULE_LOADING=$m"; CUDA_MODULE_LOADING=$m python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1 --num-requests 400 --out $OUT/scaling-$m 2>&1 | tail -7; done'
    ;;
  31)  # the few-rows GEMM with K split across programs (call 30: without a split it lost to
       # cuBLAS at 32 and 64 rows): its CUDA tests and the tile sweep (GPU0); the engine's
       # CUDA tests and the decode table without and with it (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py 2>&1 | tail -1
      python3 experiments/bench_kernels.py --tune gemm --tune-only --out $OUT/kernels 2>&1 | grep "^tune\|Error"'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1
      for r in 0 64; do python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --gemm-rows $r --breakdown "" --out $OUT/breakdown-rows$r 2>&1 | grep -A12 "^ *batch"; done'
    ;;
  32)  # as 31 after the K slices' start regained its divisibility hint (call 31's kernel
       # issued no 16-byte cp.async: the PTX, compiled on CPU)
    lane 0 gpu0 'python3 experiments/bench_kernels.py --tune gemm --tune-only --out $OUT/kernels 2>&1 | grep "^tune\|Error"'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py 2>&1 | tail -1
      for r in 0 64; do python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --gemm-rows $r --breakdown "" --out $OUT/breakdown-rows$r 2>&1 | grep -A12 "^ *batch"; done'
    ;;
  33)  # the few-rows GEMM's tiles from call 32's sweep, up to 32 rows: its CUDA tests, the
       # engine's, the decode table without and with it (GPU0); the race, S2 q/k/v/o (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py tests/test_engine_triton.py 2>&1 | tail -1
      for r in 0 32; do python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --gemm-rows $r --breakdown "" --out $OUT/breakdown-rows$r 2>&1 | grep -A12 "^ *batch"; done'
    lane 1 gpu1 'python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -6'
    ;;
  34)  # where a batch-32 decode step's time goes with the few-rows GEMM (GPU0) and with cuBLAS
       # (GPU1): the decode table and the kernel breakdown
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32 --out $OUT/breakdown-rows32 2>&1 | grep -A22 "^ *batch\|^kernel breakdown, decode"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32 --gemm-rows 0 --out $OUT/breakdown-rows0 2>&1 | grep -A22 "^ *batch\|^kernel breakdown, decode"'
    ;;
  35)  # the engine's CUDA tests after the GEMM change (GPU0); the batch-16/32 decode table under
       # five tile rules of the few-rows GEMM (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py tests/test_async_engine.py tests/test_csrc.py tests/test_engine.py tests/test_kernels_fused.py 2>&1 | tail -2'
    lane 1 gpu1 'python3 notes/h200-2026-11-30-s9/call7/gemm_rules.py 2>&1 | grep -A7 "^== rule\|^ *batch" | grep -v "^--"'
    ;;
  36)  # S2's no-LoRA stall: torch.profiler over each row's first 8 steps (no LoRA, one adapter)
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1 --num-requests 400 --trace-steps 8 --out $OUT/scaling 2>&1 | grep -v "^USDT"'
    ;;
  37)  # session 10, call 1: the decode attention sweep with a register cap (maxnreg 96 / 80:
       # 126 registers hold it to 4 programs an SM) beside tiles and splits, the batch-32
       # decode table and its kernels without LoRA and with all seven modules (GPU0); the
       # MBGMV tile sweep and MBGMV / MBGMM against copy (GPU1)
    lane 0 gpu0 'python3 experiments/bench_kernels.py --tune attention --tune-only --out $OUT/kernels-attn 2>&1 | grep -A6 "^tune attention"
      python3 experiments/bench_scaling.py --part decode --batches 32 --breakdown 32 --breakdown-modules none,all --out $OUT/breakdown 2>&1 | grep -A14 "^ *batch\|^kernel breakdown, decode"'
    lane 1 gpu1 'python3 experiments/bench_kernels.py --tune mbgmv --tune-only --out $OUT/kernels-mbgmv 2>&1 | grep -A4 "^tune"
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | tail -40'
    ;;
  38)  # the decode kernel with the rotary + K/V store folded in (rope_paged_decode_attention):
       # the attention, fused and engine CUDA tests, the kernel table (two launches against
       # one) (GPU0); the decode table at batch 1/32/128 and batch 32's kernels (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_engine_triton.py 2>&1 | tail -2
      python3 experiments/bench_kernels.py --out $OUT/kernels 2>&1 | grep "decode attn\|^ *64 \|^ *128 \|^ *256 "'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 1,32,128 --breakdown 32 --breakdown-modules none --out $OUT/breakdown 2>&1 | grep -A12 "^ *batch\|^kernel breakdown, decode"'
    ;;
  39)  # as 21 after the rotary fold's rule (fold_rope: one launch while the decode kernel's
       # programs fit a wave): a fresh profile validated against replay, the attention CUDA
       # tests, the decode table at batch 1/32/128 (GPU0); S2, the race, replay (GPU1)
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | tail -1
      python3 experiments/bench_scaling.py --part decode --batches 1,32,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A11 "^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  40)  # the kernel tables with MBGMV against a copy of its own bytes beside the 2 GiB copy
       # (GPU0); the decode table at batch 1/16/32/64 (GPU1)
    lane 0 gpu0 'python3 experiments/bench_kernels.py --out $OUT/kernels 2>&1 | tail -48'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A14 "^ *batch"'
    ;;
  41)  # the one-split decode kernel with several items a program (items_per_program, at
       # e49e0b0; it lost at every shape and is gone, so the sweep no longer runs): the
       # attention and engine CUDA tests, its items sweep (GPU0); the decode table at batch
       # 32/64/128/256 (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_engine_triton.py 2>&1 | tail -2
      python3 notes/h200-2026-11-30-s10/call6/attn_items.py 2>&1 | tail -20'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 32,64,128,256 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A14 "^ *batch"'
    ;;
  42)  # the key loop with each tile's page ids loaded a tile ahead (at c8ec58e; reverted after
       # this call: slower at the default tiles, 158 registers): attention CUDA tests, the
       # same-bytes layouts (call 5's script) and the attention tile sweep (GPU0); the decode
       # table at batch 1/32/128 (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | tail -1
      python3 notes/h200-2026-11-30-s10/call5/attn_rounds.py 2>&1 | tail -16
      python3 experiments/bench_kernels.py --tune attention --tune-only --out $OUT/kernels-attn 2>&1 | grep -A3 "^tune attention"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 1,32,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A11 "^ *batch"'
    ;;
  43)  # the MBGMV tile sweep with one-trip tiles added (shrink CH 64, expand BLOCK_R 16 / CHN 1)
    lane 0 gpu0 'python3 experiments/bench_kernels.py --tune mbgmv --tune-only --out $OUT/kernels-mbgmv 2>&1 | grep -A4 "^tune"'
    ;;
  44)  # the few-rows GEMM with the LoRA expand in its epilogue (gemm.LoraExpand,
       # EngineConfig.lora_in_gemm, off by default): its kernel, attention and engine CUDA tests,
       # each decode GEMM + rank-16 expand in two launches against one at 1 / 16 / 32 rows
       # (GPU0); the decode table at batch 1/16/32 without and with it (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_engine_triton.py 2>&1 | tail -1
      python3 experiments/bench_kernels.py --gemm-lora --out $OUT/kernels 2>&1 | grep "^gemm+lora"'
    lane 1 gpu1 'for f in "" --lora-in-gemm; do echo "== $f"; python3 experiments/bench_scaling.py --part decode --batches 1,16,32 --breakdown "" $f --out $OUT/breakdown$f 2>&1 | grep -A11 "^ *batch"; done'
    ;;
  45)  # programmatic dependent launch (slora.kernels.pdl) with each kernel's next launched
       # at its start and the few-rows GEMM's L2 prefetch (at a467aa8, session 11 call 2: lost
       # at batch 1 and 16 without LoRA; the prefetch lost everywhere): the kernels' and engine
       # CUDA tests (GPU0); the decode table at batch 1/16/32/64, PDL off, on with 0 / 512 /
       # 1024 / 4096 prefetched columns (GPU1, notes/h200-2026-11-30-s11/call2)
    echo "case 45 ran at a467aa8; see notes/h200-2026-11-30-s11/call2" ;;
  46)  # PDL with the next kernel launched after each main loop, and the LoRA expand in the
       # GEMM's epilogue at 17-32 rows (session 11 call 3, at 6f3518f, when --lora-in-gemm was
       # off by default): CUDA tests (GPU0); decode table at batch 1/16/32/64 with PDL off and
       # on, then with the LoRA epilogue (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_engine_triton.py tests/test_async_scheduling.py 2>&1 | tail -3'
    lane 1 gpu1 'for f in --no-pdl --pdl "--pdl --lora-in-gemm" "--no-pdl --lora-in-gemm"; do echo "== $f"; python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" $f --out $OUT/breakdown${f// /} 2>&1 | grep -A14 "^ *batch"; done'
    ;;
  47)  # PDL with the small kernels' launch_next at their start or as they exit (at d4b4735,
       # session 11 call 5: at their start won at batch 1, 3.97 -> 3.92 ms, tied elsewhere; it
       # is what ships): fused, attention and engine CUDA tests; decode table each way twice
    echo "case 47 ran at d4b4735; see notes/h200-2026-11-30-s11/call5" ;;
  48)  # PDL with each kernel's metadata (context lengths, cos / sin, adapter slots, ranks,
       # offsets) read before its wait (session 11 call 6, at 94f8650): LoRA, attention and
       # engine CUDA tests (GPU0); the decode table at batch 1/16/32/64 without and with PDL,
       # then the MBGMV / MBGMM tables against copy (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_attention.py tests/test_engine_triton.py 2>&1 | tail -1'
    lane 1 gpu1 'for f in --no-pdl --pdl; do echo "== $f"; python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" $f --out $OUT/breakdown$f 2>&1 | grep -A14 "^ *batch"; done
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | grep -A36 "^NVIDIA"'
    ;;
  49)  # the few-rows GEMM with W's tiles through TMA (at 8063ffa; removed after this call,
       # session 12 call 1: tied or lost at every shape and row count, decode steps 0.3-1.1%
       # slower): GEMM and engine CUDA tests with TMA forced on, then the GEMM sweep (GPU0);
       # the decode table at batch 1/16/32 without and with --gemm-tma (GPU1)
    lane 0 gpu0 'python3 -c "import sys, pytest, slora.kernels.gemm as g; g.TMA = True; sys.exit(pytest.main([\"-q\", \"-p\", \"no:cacheprovider\", \"tests/test_kernels_fused.py\", \"tests/test_engine_triton.py\"]))" 2>&1 | tail -1
      python3 experiments/bench_kernels.py --tune gemm --tune-only --out $OUT/kernels-gemm 2>&1 | grep "^tune gemm"'
    lane 1 gpu1 'for f in "" --gemm-tma; do echo "== $f"; python3 experiments/bench_scaling.py --part decode --batches 1,16,32 --breakdown "" $f --out $OUT/breakdown$f 2>&1 | grep -A11 "^ *batch"; done'
    ;;
  50)  # (at 523776d; session 12 call 2: MBGMV won 9-11% in small launches, lost 1-4% in large
       # ones, so session 12 kept it below a size; the GEMM's preload lost, 3.91 -> 4.12 ms at
       # batch 1, and was removed)
       # MBGMV with each program's first A / B tile loaded before its PDL wait, and the
       # few-rows GEMM with its first W tile so (gemm.PRELOAD, off): CUDA tests with PRELOAD
       # forced on, then the MBGMV / MBGMM tables against copy with and without the MBGMV change
       # (before_lora.py: lora.py as it was, untracked, in a copy of the tree) (GPU0); the decode
       # table before, after, and after with --gemm-preload (GPU1)
    rm -rf /tmp/before && mkdir /tmp/before && cp -r slora experiments /tmp/before/ && cp before_lora.py /tmp/before/slora/kernels/lora.py
    lane 0 gpu0 'python3 -c "import sys, pytest, slora.kernels.gemm as g; g.PRELOAD = True; sys.exit(pytest.main([\"-q\", \"-p\", \"no:cacheprovider\", \"tests/test_kernels_lora.py\", \"tests/test_kernels_fused.py\", \"tests/test_engine_triton.py\"]))" 2>&1 | tail -1
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | grep -A36 "^NVIDIA"
      echo "== before"; (cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels-before 2>&1 | grep -A36 "^NVIDIA")'
    lane 1 gpu1 'echo "== before"; (cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" --out $OUT/breakdown-before 2>&1 | grep -A14 "^ *batch")
      for f in "" --gemm-preload; do echo "== $f"; python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" $f --out $OUT/breakdown$f 2>&1 | grep -A14 "^ *batch"; done'
    ;;
  51)  # as 39 after session 12's MBGMV rule (first adapter tile before the wait while a launch
       # reads <= 256 token x rank rows): a fresh profile validated against replay, the LoRA
       # CUDA tests, the decode table at batch 1/16/32/64/128, MBGMV / MBGMM against copy
       # (GPU0); S2, the race, replay (GPU1)
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py 2>&1 | tail -1
      python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A17 "^ *batch"
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | grep -A36 "^NVIDIA"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -8
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  52)  # MBGMV without its first tile early keeps the loop as before session 12 (call 3 had
       # both ways peeled): LoRA CUDA tests, MBGMV / MBGMM against copy (GPU0); the decode
       # table at batch 1/16/32/64/128, S2 q/k/v/o (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py 2>&1 | tail -1
      python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | grep -A36 "^NVIDIA"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A17 "^ *batch"
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -3
      python3 -c "import json; [print(r[\"adapters\"], r[\"modules\"], round(r[\"wall_s\"], 2), round(r[\"ratio\"], 3)) for r in json.load(open(\"$OUT/scaling/bench_scaling.json\"))[\"scaling\"]]"'
    ;;
  53)  # MBGMV with its loop's code as in session 11 (the same PTX without the early tile) and
       # the early first tile only at <= 256 token x rank rows: MBGMV / MBGMM against copy
       # (GPU0); LoRA CUDA tests, the decode table at batch 1/16/32/64 (GPU1)
    lane 0 gpu0 'python3 experiments/bench_kernels.py --skip-attention --out $OUT/kernels 2>&1 | grep -A36 "^NVIDIA"'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py 2>&1 | tail -1
      python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A14 "^ *batch"'
    ;;
  54)  # as 51 at session 12's last kernels, without the tables call 5 ran: a fresh profile
       # validated against replay, the decode table at batch 1/16/32/64/128 (GPU0); S2 q/k/v/o
       # and all seven, the race, replay (GPU1)
    lane 0 gpu0 'bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch $OUT/profile.done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=$OUT/sim-vs-replay-0 \
        bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -14
      python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64,128 --breakdown "" --out $OUT/breakdown 2>&1 | grep -A17 "^ *batch"'
    lane 1 gpu1 'python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out $OUT/scaling 2>&1 | tail -1
      python3 -c "import json; [print(r[\"adapters\"], r[\"modules\"], round(r[\"wall_s\"], 2), round(r[\"ratio\"], 3)) for r in json.load(open(\"$OUT/scaling/bench_scaling.json\"))[\"scaling\"]]"
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out $OUT/engine 2>&1 | tail -5
      while [ ! -f $OUT/profile.done ]; do sleep 5; done
      PROFILE=$OUT/h200-llama2-7b.json DURATION=60 ONLY="n1000-a0.5-r8 n2000-a1-r10" \
        RESULTS=$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v "^  [a-zA-Z]" | tail -16'
    ;;
  55)  # for the next session (not yet run): where S2's steps with prompts spend their LoRA time
       # (session 12 call 6: +9.4 ms a step with one adapter, +11.6 with 2,000, over 119 steps
       # of ~864 prompt tokens). Kernel tables of a batch-128 decode step and of the same batch
       # with 4 prompts of 216 tokens joining, each with its own rank-32 adapter, without LoRA,
       # q/k/v/o and all seven (GPU0); the MBGMM tile sweep (GPU1)
    lane 0 gpu0 'python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules none,qkvo,all --mixed-prompts 4 --mixed-prompt-len 216 --decode-rank 32 --out $OUT/mixed 2>&1 | tail -90'
    lane 1 gpu1 'python3 experiments/bench_kernels.py --tune mbgmm --tune-only --out $OUT/kernels-mbgmm 2>&1 | grep -A12 "^tune"'
    ;;
  56)  # MBGMM with each expand program walking a span of columns (xa tile and page lookups
       # loaded once) and both kernels' page lookups hoisted out of their loops (session 13):
       # LoRA and engine CUDA tests, a batch-128 step with 4 prompts of 216 tokens joining
       # (rank 32; none / q,k,v,o / all seven), S2 q/k/v/o (GPU0); the MBGMM sweep, then as it
       # was (before_lora.py, untracked: `git show e7b23c9:slora/kernels/lora.py`, in a copy of the tree): the
       # sweep's defaults and the same mixed step (GPU1)
    before_tree kernels/lora.py
    MIXED='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules none,qkvo,all --mixed-prompts 4 --mixed-prompt-len 216 --decode-rank 32'
    lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py 2>&1 | tail -1
      python3 $MIXED --out \$OUT/mixed 2>&1 | grep -A7 '^kernel breakdown, mixed'
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out \$OUT/scaling 2>&1 | tail -1
      python3 -c \"import json; [print(r['adapters'], r['modules'], round(r['wall_s'], 2), round(r['mixed_s'], 2), round(r['eager_s'], 2), round(r['ratio'], 3)) for r in json.load(open('\$OUT/scaling/bench_scaling.json'))['scaling']]\""
    lane 1 gpu1 "python3 experiments/bench_kernels.py --tune mbgmm --tune-only --out \$OUT/kernels-mbgmm 2>&1 | grep -v '^  mbgmm'
      echo '== before'; cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      python3 experiments/bench_kernels.py --tune mbgmm --tune-only --out \$OUT/kernels-mbgmm-before 2>&1 | grep -v '^  mbgmm'
      python3 $MIXED --out \$OUT/mixed-before 2>&1 | grep -A7 '^kernel breakdown, mixed'"
    ;;
  57)  # (session 13) MBGMM expand after call 2 (case 56): its tile compiled to 224 registers at
       # rank 32 with 4 warps (139 at 16, 122 at 64), and the mixed step at rank 32 lost. The
       # sweep at ranks 16 / 32 / 64 (GPU1); the mixed step's q/k/v/o kernels at ranks 32 and 64
       # with the expand's defaults, with 8 warps (GPU0), and as before the change (GPU1)
    before_tree kernels/lora.py
    MIXED='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules qkvo --mixed-prompts 4 --mixed-prompt-len 216'
    W8='import runpy, sys, slora.kernels.lora as l; o = l._mbgmm_cfg; l._mbgmm_cfg = lambda *a, **k: {**o(*a, **k), **({} if k.get(\"shrink\") else dict(num_warps=8))}; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name=\"__main__\")'
    lane 0 gpu0 "for r in 32 64; do echo \"== rank \$r\"; python3 $MIXED --decode-rank \$r --out \$OUT/mixed-\$r 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'
      echo \"== rank \$r, expand with 8 warps\"; python3 -c \"$W8\" $MIXED --decode-rank \$r --out \$OUT/mixed-w8-\$r 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'; done"
    lane 1 gpu1 "python3 experiments/bench_kernels.py --tune mbgmm --tune-only --out \$OUT/kernels-mbgmm 2>&1 | grep '^tune mbgmm expand'
      cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      for r in 32 64; do echo \"== before, rank \$r\"; python3 $MIXED --decode-rank \$r --out \$OUT/mixed-before-\$r 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'; done"
    ;;
  58)  # as 54 after session 13's MBGMM expand (a 64-rank tile at least, a span of columns a
       # program): a fresh profile validated against replay, the decode table, the mixed step's
       # q/k/v/o kernels at ranks 32 and 64, the LoRA CUDA tests (GPU0); S2 q/k/v/o and all
       # seven, replay (GPU1)
    MIXED='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules qkvo --mixed-prompts 4 --mixed-prompt-len 216'
    lane 0 gpu0 "bash experiments/profile_h200.sh profile 2>&1 | tail -9; touch \$OUT/profile.done
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=\$OUT/sim-vs-replay-0 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -14
      python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64,128 --breakdown '' --out \$OUT/breakdown 2>&1 | grep -A17 '^ *batch'
      for r in 32 64; do echo \"== rank \$r\"; python3 $MIXED --decode-rank \$r --out \$OUT/mixed-\$r 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'; done
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py 2>&1 | tail -1"
    lane 1 gpu1 "python3 experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 1,2000 --num-requests 400 --out \$OUT/scaling 2>&1 | tail -1
      python3 -c \"import json; [print(r['adapters'], r['modules'], round(r['wall_s'], 2), round(r['mixed_s'], 2), round(r['eager_s'], 2), round(r['ratio'], 3)) for r in json.load(open('\$OUT/scaling/bench_scaling.json'))['scaling']]\"
      while [ ! -f \$OUT/profile.done ]; do sleep 5; done
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY='n1000-a0.5-r8 n2000-a1-r10' \\
        RESULTS=\$OUT/sim-vs-replay-1 bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -16"
    ;;
  59)  # (session 13, scratch) MBGMM shrink: ncu on one launch at 4 x 216 tokens rank 64 (GPU0);
       # a sweep of BLOCK_R, stages, d_in slices and warps (its call5/scratch_shrink.py) (GPU1)
    lane 0 gpu0 "ncu --clock-control none --kernel-name regex:_mbgmm_shrink --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 notes/h200-2026-11-30-s13/call5/scratch_shrink.py --one 2>&1 | tail -120"
    lane 1 gpu1 "python3 notes/h200-2026-11-30-s13/call5/scratch_shrink.py 2>&1 | grep -v '^fail'"
    ;;
  60)  # (session 13) the race after the MBGMM expand change (GPU0); the mixed step's q/k/v/o
       # kernels at rank 16, where the 64-rank tile was expected to lose, after and before
       # (before_lora.py as in case 56, in a copy of the tree) (GPU1)
    before_tree kernels/lora.py
    MIXED='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules qkvo --mixed-prompts 4 --mixed-prompt-len 216 --decode-rank 16'
    lane 0 gpu0 "python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out \$OUT/engine 2>&1 | tail -5"
    lane 1 gpu1 "echo '== after'; python3 $MIXED --out \$OUT/mixed-16 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'
      echo '== before'; cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      python3 $MIXED --out \$OUT/mixed-before-16 2>&1 | grep -E '^kernel breakdown, mixed|_mbgmm'"
    ;;
  61)  # (session 13) S2's eager steps: a batch-128 step with 31 prompts of 256 tokens joining
       # (~8k tokens, past the mixed graphs), every sequence its own rank-64 adapter, q/k/v/o:
       # the kernel tables after (GPU0) and before (GPU1; before_lora.py as in case 56) session
       # 13's MBGMM expand
    before_tree kernels/lora.py
    EAGER='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules none,qkvo --mixed-prompts 31 --mixed-prompt-len 256 --decode-rank 64'
    lane 0 gpu0 "python3 $EAGER --out \$OUT/eager 2>&1 | grep -A12 '^kernel breakdown, mixed'"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      python3 $EAGER --out \$OUT/eager-before 2>&1 | grep -A12 '^kernel breakdown, mixed'"
    ;;
  62)  # (session 13) the rotary + K/V store over 16-token blocks from 512 tokens on: a fresh
       # profile validated against replay (n100), the kernel tables of an 8k-token step and a
       # 4 x 216-token mixed step (rank 64; none / q,k,v,o), the fused and attention CUDA tests
       # (GPU0); S2 q/k/v/o, replay n1000 and n2000 (GPU1)
    EAGER='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules none,qkvo --decode-rank 64'
    lane 0 gpu0 "bash experiments/profile_h200.sh profile 2>&1 | tail -3; touch \$OUT/profile.done
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=\$OUT/sim-vs-replay-0 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -14
      for p in '31 256' '4 216'; do set -- \$p; echo \"== \$1 x \$2\"; python3 $EAGER --mixed-prompts \$1 --mixed-prompt-len \$2 --out \$OUT/breakdown-\$1 2>&1 | grep -E '^kernel breakdown, mixed|_rope_kv|_mbgmm'; done
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py tests/test_kernels_attention.py 2>&1 | tail -1"
    lane 1 gpu1 "python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 1,2000 --num-requests 400 --out \$OUT/scaling 2>&1 | tail -1
      python3 -c \"import json; [print(r['adapters'], r['modules'], round(r['wall_s'], 2), round(r['mixed_s'], 2), round(r['eager_s'], 2), round(r['ratio'], 3)) for r in json.load(open('\$OUT/scaling/bench_scaling.json'))['scaling']]\"
      while [ ! -f \$OUT/profile.done ]; do sleep 5; done
      for t in n1000-a0.5-r8 n2000-a1-r10; do PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=\$t \\
        RESULTS=\$OUT/sim-vs-replay-\$t bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -9; done"
    ;;
  63)  # for the next session (not yet run): the CUDA tests after session 13's kernels (the
       # rotary + K/V store over 16-token blocks, 2b63f34, whose tests call 8 could not reach;
       # the MBGMM expand): fused, attention and LoRA kernels (GPU0); the Triton engine (GPU1)
    lane 0 gpu0 'python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py tests/test_kernels_attention.py tests/test_kernels_lora.py 2>&1 | tail -3'
    lane 1 gpu1 'python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -3'
    ;;
  64)  # (session 14) MBGMV when one launch mixes ranks 64/32/16/8 (S2's decode steps): token
       # order interleaved / sorted, the expand's grid as shipped and with the token slowest
       # (GPU0; the scratch patches a2c93d7's lora.py, so it runs only on that tree); the kernel
       # table of a batch-128 decode step, rank 16 and 64, none / q,k,v,o (GPU1)
    lane 0 gpu0 'python3 notes/h200-2026-11-30-s14/scratch_mixed.py 2>&1 | tail -40'
    lane 1 gpu1 'for r in 16 64; do python3 experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules none,qkvo --decode-rank $r --out $OUT/breakdown-$r 2>&1 | grep -B1 -A14 "^kernel breakdown"; done'
    ;;
  65)  # (session 14) MBGMV expand with the token on the grid's slow axis and decode rows in
       # order of adapter size (largest first): S2 q/k/v/o and all seven at 2,000 adapters, the
       # MBGMV CUDA tests, the engine's CUDA tests (GPU0); S2 as it was (GPU1; before_lora.py and
       # before_scheduler.py, untracked: `git show a2c93d7:<path>`, in a copy of the tree)
    rm -rf /tmp/before && mkdir /tmp/before && cp -r slora experiments csrc /tmp/before/ && cp before_lora.py /tmp/before/slora/kernels/lora.py && cp before_scheduler.py /tmp/before/slora/core/scheduler.py
    S2='experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 2000 --num-requests 400'
    lane 0 gpu0 "python3 $S2 --out \$OUT/scaling 2>&1 | tail -1; (cd \$OUT && python3 -c \"$SHOW\")
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k mbgmv 2>&1 | tail -1
      python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      python3 $S2 --out \$OUT/scaling-before/scaling 2>&1 | tail -1; (cd \$OUT/scaling-before && python3 -c \"$SHOW\")"
    ;;
  66)  # (session 14) the LoRA shrinks on a side stream beside the base GEMM: S2 q/k/v/o and all
       # seven at 2,000 adapters, the decode table at batch 64 / 128, the engine's CUDA tests
       # (GPU0); the same before (GPU1; before_init.py, untracked: `git show 9e92969:
       # slora/kernels/__init__.py`, in a copy of the tree)
    rm -rf /tmp/before && mkdir /tmp/before && cp -r slora experiments csrc /tmp/before/ && cp before_init.py /tmp/before/slora/kernels/__init__.py
    S2='experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 2000 --num-requests 400'
    DEC="experiments/bench_scaling.py --part decode --batches 64,128 --breakdown ''"
    lane 0 gpu0 "python3 $S2 --out \$OUT/scaling 2>&1 | tail -1; (cd \$OUT && python3 -c \"$SHOW\")
      python3 $DEC --out \$OUT/breakdown 2>&1 | grep -A8 '^ *batch'
      python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site
      python3 $S2 --out \$OUT/scaling-before/scaling 2>&1 | tail -1; (cd \$OUT/scaling-before && python3 -c \"$SHOW\")
      python3 $DEC --out \$OUT/breakdown-before 2>&1 | grep -A8 '^ *batch'"
    ;;
  67)  # (session 14) the shrink on the side stream beside the few-rows Triton GEMM too (1-32
       # rows; variant_init.py, untracked: d22d02c's slora/kernels/__init__.py without the
       # `uses_kernel` condition, in a copy of the tree), with the expand in the GEMM's epilogue
       # at 17-32 rows and without (GPU0); the decode table as shipped (GPU1)
    rm -rf /tmp/variant && mkdir /tmp/variant && cp -r slora experiments csrc /tmp/variant/ && cp variant_init.py /tmp/variant/slora/kernels/__init__.py
    DEC="experiments/bench_scaling.py --part decode --batches 1,16,32 --breakdown ''"
    lane 0 gpu0 "cd /tmp/variant && export PYTHONPATH=/tmp/variant:/tmp/site
      python3 $DEC --out \$OUT/variant 2>&1 | grep -A10 '^ *batch'
      echo '== no lora_in_gemm'; python3 $DEC --no-lora-in-gemm --batches 32 --out \$OUT/variant-nogemm 2>&1 | grep -A4 '^ *batch'"
    lane 1 gpu1 "python3 $DEC --out \$OUT/shipped 2>&1 | grep -A10 '^ *batch'"
    ;;
  68)  # (session 14) the shipped form: the shrink on a side stream in every decode-only step,
       # lora_in_gemm off by default: the decode table, the engine's CUDA tests (GPU0); the race (GPU1)
    lane 0 gpu0 "python3 experiments/bench_scaling.py --part decode --batches 1,16,32,64,128 --breakdown '' --out \$OUT/breakdown 2>&1 | grep -A17 '^ *batch'
      python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1"
    lane 1 gpu1 "python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out \$OUT/engine 2>&1 | tail -5"
    ;;
  69)  # (session 15) a step's own adapter loads on the copy stream, each piece of layers
       # waiting for its copies: the engine's CUDA tests, a fresh profile validated against
       # replay (GPU0); S2 q/k/v/o and all seven at 1 and 2,000 adapters, after and before
       # (before_runner.py, before_graphs.py, untracked: `git show b15123f:slora/<file>`, in a
       # copy of the tree), then replay of the two larger traces (GPU1)
    before_tree runner.py graphs.py
    profile_s2_lanes ""
    ;;
  70)  # (session 15) the step's own adapter loads beside its forward, after (GPU0) and before
       # (GPU1; before_runner.py / before_graphs.py as in 69) on one machine: bench_prefetch
       # (a prefill step with blocking loads) and replay of the two larger traces (the
       # simulator's column from the shipped profile in both)
    before_tree runner.py graphs.py
    RUN="python3 experiments/bench_prefetch.py --out \$OUT/NAME 2>&1 | tail -9
      PROFILE=experiments/profiles/h200-llama2-7b.json DURATION=60 ONLY='n1000-a0.5-r8 n2000-a1-r10' \\
        RESULTS=\$OUT/sim-vs-replay-NAME bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -16"
    lane 0 gpu0 "${RUN//NAME/after}"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; ${RUN//NAME/before}"
    ;;
  71)  # (session 15) bench_prefetch after (GPU0) and before (GPU1), as 70's first half (call 3
       # met bench_prefetch's graph counter taking one argument: fixed since)
    before_tree runner.py graphs.py
    lane 0 gpu0 "python3 experiments/bench_prefetch.py --out \$OUT/after 2>&1 | tail -9"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 experiments/bench_prefetch.py --out \$OUT/before 2>&1 | tail -9"
    ;;
  72)  # (session 15) kernel tables without PDL (a PDL launch starts early and waits inside,
       # so its table time includes the wait): decode steps at batch 32 and 128, rank 16, none
       # / q,k,v,o / all seven (GPU0); the batch-128 mixed step with 4 x 216-token prompts,
       # rank 32, q,k,v,o, with and without PDL (GPU1)
    MIXED='experiments/bench_scaling.py --part decode --batches 128 --breakdown 128 --breakdown-modules qkvo --mixed-prompts 4 --mixed-prompt-len 216 --decode-rank 32'
    lane 0 gpu0 "python3 experiments/bench_scaling.py --part decode --batches 32,128 --breakdown 32,128 --breakdown-modules none,qkvo,all --no-pdl --out \$OUT/breakdown-nopdl 2>&1 | grep -A12 '^ *batch\|^kernel breakdown'"
    lane 1 gpu1 "for p in no-pdl pdl; do echo \"== \$p\"; python3 $MIXED --\$p --out \$OUT/breakdown-mixed-\$p 2>&1 | grep -A16 '^kernel breakdown, mixed'; done"
    ;;
  73)  # the CUDA tests, split over the two GPUs: LoRA and fused kernels (GPU0); the engine,
       # attention and csrc ones (GPU1)
    lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_fused.py 2>&1 | tail -1"
    lane 1 gpu1 "python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py tests/test_kernels_attention.py tests/test_csrc.py 2>&1 | tail -1"
    ;;
  74)  # (session 16) where S2's eager steps (its first 9: ~8k prompt tokens each) spend the
       # GPU's time: a timeline of each row's first 9 steps, no LoRA / 1 adapter / 2,000
       # adapters, q/k/v/o (GPU0) and all seven (GPU1), summarised by experiments/timeline.py
    for m in qkvo all; do g=$([ $m = qkvo ] && echo 0 || echo 1)
      lane $g gpu$g "python3 experiments/bench_scaling.py --part scaling --modules $m --adapters 1,2000 --num-requests 400 --trace-steps 9 --out \$OUT/scaling-$m 2>&1 | grep -E '^scaling:|^trace of|^ +[0-9]+ +(none|qkvo|all) '
        python3 experiments/timeline.py \$OUT/scaling-$m/timeline-*.json.gz --gaps 12
        f=\$OUT/scaling-$m/timeline-2000-$m.json.gz; [ \$(stat -c%s \$f) -lt 15000000 ] && cp \$f \$OUT/"
    done
    ;;
  75)  # (session 16) adapter copies as one index_copy_ per adapter and piece: the kernels one
       # copy into a pool past 32-bit indexing launches, the engine's CUDA tests, a fresh
       # profile validated against replay (GPU0); S2 q/k/v/o and all seven at 1 and 2,000
       # adapters after and before (before_runner.py, untracked: `git show <rev>:slora/runner.py`,
       # in a copy of the tree), then replay of the two larger traces (GPU1)
    before_tree runner.py
    KERNELS="import torch; from torch.profiler import profile, ProfilerActivity as A
pool = torch.zeros(32 * 2100, 131072, dtype=torch.bfloat16, device='cuda'); src = torch.ones(8 * 16, 131072, dtype=torch.bfloat16, device='cuda')
rows = (torch.arange(8)[:, None] * 2100 + torch.arange(5, 37, 2)).flatten().cuda(); torch.cuda.synchronize()
with profile(activities=[A.CUDA]) as p: pool.index_copy_(0, rows, src); torch.cuda.synchronize()
print('index_copy_ of 128 rows into a pool of', pool.numel(), 'elements:', sum(1 for e in p.events() if e.device_type.name == 'CUDA'), 'kernel(s)')"
    profile_s2_lanes "python3 -c \"$KERNELS\""
    ;;
  76)  # (session 16) adapter copies by index_copy_, after (GPU0) and before (GPU1;
       # before_runner.py as in 75) on one machine: bench_prefetch (decode steps with prefetch
       # copies, a prefill step with blocking loads) and replay of the two larger traces
    before_tree runner.py
    RUN="python3 experiments/bench_prefetch.py --out \$OUT/NAME 2>&1 | tail -9
      PROFILE=experiments/profiles/h200-llama2-7b.json DURATION=60 ONLY='n1000-a0.5-r8 n2000-a1-r10' \\
        RESULTS=\$OUT/sim-vs-replay-NAME bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -16"
    lane 0 gpu0 "${RUN//NAME/after}"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; ${RUN//NAME/before}"
    ;;
  77)  # (session 16) where S2's steady steps (20-169: graphed, with and without prompts) leave
       # the GPU idle: the device's kernels and copies alone (no host ops recorded), no LoRA
       # and 2,000 adapters, q/k/v/o (GPU0) and all seven (GPU1), summarised by timeline.py
    for m in qkvo all; do g=$([ $m = qkvo ] && echo 0 || echo 1)
      lane $g gpu$g "python3 experiments/bench_scaling.py --part scaling --modules $m --adapters 2000 --num-requests 400 --trace-steps 150 --trace-skip 20 --trace-device-only --out \$OUT/scaling-$m 2>&1 | grep -E '^scaling:|^trace of|^ +[0-9]+ +(none|qkvo|all) '
        python3 experiments/timeline.py \$OUT/scaling-$m/timeline-*.json.gz --gaps 10"
    done
    ;;
  78)  # (session 16) a step's adapter copies queued after its inputs' uploads (the copy engine
       # served a whole prefetch before them): the engine's CUDA tests, S2 at 2,000 adapters
       # (q/k/v/o, all seven), a fresh profile validated on n100 (GPU0); S2 the same before
       # (before_runner.py, before_graphs.py: `git show <rev>:slora/<file>`, in a copy) (GPU1)
    before_tree runner.py graphs.py
    S2='experiments/bench_scaling.py --part scaling --modules qkvo,all --adapters 2000 --num-requests 400'
    lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1
      python3 $S2 --out \$OUT/scaling 2>&1 | tail -1; (cd \$OUT && python3 -c \"$SHOW\")
      bash experiments/profile_h200.sh profile 2>&1 | tail -9
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=\$OUT/sim-vs-replay-0 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -12"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $S2 --out \$OUT/scaling-before/scaling 2>&1 | tail -1; cd \$OUT/scaling-before && python3 -c \"$SHOW\""
    ;;
  79)  # (session 17) graphs hold only the LoRA kernels of their batch's module groups (q/k/v/o
       # adapters launched the gate/up and down kernels at rank 0): the engine's CUDA tests and
       # S2 after / before (before_graphs.py, before_engine.py, before_bench_scaling.py:
       # `git show <rev>:<path>`)
    before_tree graphs.py engine.py && cp before_bench_scaling.py /tmp/before/experiments/bench_scaling.py
    s2_after_before tests/test_engine_triton.py
    ;;
  80)  # (session 17) MBGMV expand's [4 x 4]-chunk tiles below 4,096 programs (o at S2's 128-256
       # rows: 2,048 programs of [2 x 8]): the LoRA kernels' CUDA tests and S2 after / before
       # (before_lora.py: `git show <rev>:slora/kernels/lora.py`)
    before_tree kernels/lora.py
    s2_after_before tests/test_kernels_lora.py
    ;;
  81)  # (session 17, for the next) a fresh profile after session 17's graphs (module groups,
       # the union's graph for mixed batches), validated on n100; one lane, for the one-GPU
       # kind. Then ship $OUT/h200-llama2-7b.json as experiments/profiles/ and run 82.
    lane 0 gpu0 "bash experiments/profile_h200.sh profile 2>&1 | tail -9
      PROFILE=\$OUT/h200-llama2-7b.json DURATION=60 ONLY=n100-a1-r4 RESULTS=\$OUT/sim-vs-replay-0 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -14"
    ;;
  82)  # (session 17, for the next) the shipped profile on the two larger traces, and the
       # engine's CUDA tests
    lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py 2>&1 | tail -1
      DURATION=60 ONLY='n1000-a0.5-r8 n2000-a1-r10' RESULTS=\$OUT/sim-vs-replay-1 \\
        bash experiments/profile_h200.sh validate 2>&1 | grep -v '^  [a-zA-Z]' | tail -16"
    ;;
  83)  # (session 18 call 4, with notes/h200-2026-12-01-s18/mbgmm_parts.patch applied: MBGMM
       # with PDL, the shrink's d_in slices in parts of xa that the expand adds; it lost and
       # was not kept) PTX checks, the LoRA kernels' and engine's CUDA tests, the mixed-step
       # LoRA pair and MBGMM's pair in a graphed mixed step's grid (scratch_mbgmm.py) after /
       # before, S2 q/k/v/o after / before (before_lora.py: `git show <rev>:slora/kernels/lora.py`)
    before_tree kernels/lora.py
    MIX="experiments/bench_kernels.py --only-mixed 2>&1 | tail -4; python3 $PWD/notes/h200-2026-12-01-s18/scratch_mbgmm.py"
    lane 0 gpu0 "python3 experiments/compile_check.py 2>&1 | grep -i 'mbgmm\|fail\|error'
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_engine_triton.py 2>&1 | tail -1
      echo '== after'; python3 $MIX
      echo '== before'; (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $MIX)
      python3 $S2_QKVO --out \$OUT/scaling 2>&1 | grep -E '^scaling: warm|^ceilings'; (cd \$OUT && python3 -c \"$SHOW\")"
    lane 1 gpu1 "cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $S2_QKVO --out \$OUT/scaling-before/scaling 2>&1 | grep -E '^scaling: warm'; cd \$OUT/scaling-before && python3 -c \"$SHOW\""
    ;;
  84)  # (session 18, for the next) today's standing figures on one GPU: the race, S2 at
       # 2,000 adapters with all seven modules, and a device-only timeline of S2's steady
       # steps with q/k/v/o (kernel time by name: what is left after MBGMM's device-sized work)
    lane 0 gpu0 "python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --out \$OUT/engine 2>&1 | tail -6
      python3 experiments/bench_scaling.py --part scaling --modules all --adapters 2000 --num-requests 400 --out \$OUT/scaling 2>&1 | grep -E '^scaling: warm'; (cd \$OUT && python3 -c \"$SHOW\")
      python3 experiments/bench_scaling.py --part scaling --modules qkvo --adapters 2000 --num-requests 400 --trace-steps 150 --trace-skip 20 --trace-device-only --out \$OUT/scaling-trace 2>&1 | grep -E '^scaling:|^trace of'
      python3 experiments/timeline.py \$OUT/scaling-trace/timeline-*.json.gz --kernels 20"
    ;;
  85)  # (session 19) an MBGMV change: this tree against /tmp/before (before_tree with the
       # slora files named in BEFORE, default kernels/lora.py: each from before_<name>), each
       # with bench_kernels' MBGMV table and S2 q/k/v/o at 2,000 adapters, one after the other
       # (session 19 call 2 also ran a third tree, this one with before_lora_cb.py)
    before_tree ${BEFORE:-kernels/lora.py}
    EACH="python3 experiments/bench_kernels.py --only mbgmv --out \$OUT/kernels-\$TAG 2>&1 | grep -A34 '^NVIDIA'
      python3 $S2_QKVO --out \$OUT/s2-\$TAG/scaling 2>&1 | grep -E '^scaling: warm'; (cd \$OUT/s2-\$TAG && python3 -c \"$SHOW\")"
    lane 0 gpu0 "python3 experiments/compile_check.py 2>&1 | grep -i 'mbgmv\|fail\|error'
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k 'mbgmv or shrink or expand' 2>&1 | tail -1
      echo '== after (this tree)'; TAG=after; $EACH
      echo '== before'; (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site TAG=before; $EACH)"
    ;;
  86)  # (session 19) head-major KV pages (kv_views): this tree against /tmp/before
       # (before_reference.py), each with bench_kernels' attention table, the race and S2
       # q/k/v/o at 2,000 adapters, one after the other
    before_tree kernels/reference.py
    EACH="python3 experiments/bench_kernels.py --only attention --out \$OUT/kernels-\$TAG 2>&1 | grep -A12 '^NVIDIA'
      python3 experiments/bench_engine.py --models llama-2-7b --batches 32 --race --skip-hf --out \$OUT/engine-\$TAG 2>&1 | tail -3
      python3 $S2_QKVO --out \$OUT/s2-\$TAG/scaling 2>&1 | grep -E '^scaling: warm'; (cd \$OUT/s2-\$TAG && python3 -c \"$SHOW\")"
    lane 0 gpu0 "python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_fused.py tests/test_engine_triton.py 2>&1 | tail -1
      echo '== head-major (this tree)'; TAG=new; $EACH
      echo '== before'; (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site TAG=old; $EACH)"
    ;;
  87)  # (session 19) the MBGMM shrink's row pages once a slice (_row_pages / _chunk_base, as
       # the expand does) against before_lora.py: the graphed mixed step's MBGMM pair
       # (scratch_mbgmm.py) and S2 q/k/v/o after / before, then the LoRA kernels' CUDA tests
    before_tree kernels/lora.py
    MIX="$PWD/notes/h200-2026-12-01-s18/scratch_mbgmm.py"
    lane 0 gpu0 "echo '== after'; python3 $MIX
      echo '== before'; (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $MIX)
      echo '== S2 after'; python3 $S2_QKVO --out \$OUT/scaling 2>&1 | grep -E '^scaling: warm'; (cd \$OUT && python3 -c \"$SHOW\")
      echo '== S2 before'; (cd /tmp/before && export PYTHONPATH=/tmp/before:/tmp/site; python3 $S2_QKVO --out \$OUT/scaling-before/scaling 2>&1 | grep -E '^scaling: warm'; cd \$OUT/scaling-before && python3 -c \"$SHOW\")
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py -k 'mbgmm or device_counts' 2>&1 | tail -1"
    ;;
  *) echo "usage: $0 N, N one of the cases in this file (1-13, 15-22, 24-87)" >&2; exit 2 ;;
esac
wait
(cd "$OUT" && tar czf results.tgz --exclude=traces --exclude='timeline-*' $(ls -d suites sim-vs-replay* scaling* breakdown* pieces* sync async engine kernels* 2>/dev/null) 2>/dev/null \
  && rm -rf suites sim-vs-replay*)
for f in "$OUT"/gpu0.log "$OUT"/gpu1.log; do [ -f "$f" ] && { echo "==== $f"; tail -60 "$f"; }; done; true
