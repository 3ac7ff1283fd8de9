#!/usr/bin/env bash
# On a GPU machine (issue 27: the step at the busy rows, the memory planner), results into $OUT, every log line
# into $OUT/log.txt. Parts, in one device call or several:
#     bash tests/gpu_ladder.sh tests+step    # GPU tests; bench.py step of this tree and of before/ (static shapes)
#     bash tests/gpu_ladder.sh planner       # where the planner's rows go (tests/gpu_planner.py)
#     bash tests/gpu_ladder.sh throughput [auto fp8]   # LongFlow at the largest batch that fits, validated
#     bash tests/gpu_ladder.sh serve [saturated]  # server.py under a low load, then a sweep of loads (and its
#                                            # PNG), then the saturated load's 520 requests on the same server
#     bash tests/gpu_ladder.sh serve-profile # the same loads, the server's engine thread timed at every sync
#                                            # (LOADS="120,16 60,4": some of them, requests,rate)
#     bash tests/gpu_ladder.sh saturated     # 520 requests x 512 tokens at once: the server, then bench.py generate
#     bash tests/gpu_ladder.sh fp8           # issue 28: fp8.py's launch chosen (tests/gpu_fp8_linear.py --write),
#                                            # its tests on the GPU, bench.py step with bf16 and FP8 weights
#     bash tests/gpu_ladder.sh fp8-check     # the activations' quantization and the step with FP8 weights, again
#     bash tests/gpu_ladder.sh fp8-run       # a 128k prefill and throughput, FP8 weights and cache, then bf16
#     bash tests/gpu_ladder.sh select        # after a change to the fused kernel: its tests on the GPU, bench.py
#                                            # kernel, and the step at 256 / 507 rows of FP8 weights and cache
# before/ is another revision, exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs
# serve needs starlette and uvicorn, which the GPU machine lacks: their wheels in .whl/ (README of the device tool).
set -u
cd "$(dirname "$0")/.."
source tests/gpu_common.sh "$@"
case "$1" in
tests+step)
  timeout 200 python -m pytest -q tests/test_score.py tests/test_generate.py -p no:cacheprovider \
    -k "compiled_scoring or (cuda_graph and (longflow or rkv or full or h2o))" >> $log 2>&1
  echo "tests rc=$?" >> $log
  for tree in before after; do
    dir=$([ $tree = before ] && echo before || echo .)
    (cd $dir && timeout 200 python bench.py step --shape Qwen3-8B --batch 1 2 64 224 --policy longflow \
      --json $OUT/step_${tree}.json >> $log 2>&1)
    echo "step $tree rc=$?" >> $log
  done ;;
planner)
  timeout 150 python tests/gpu_planner.py 2>&1 | grep -v Warning >> $log ;;
throughput)
  shift
  for kv in ${@:-auto}; do
    timeout 240 python bench.py throughput --shape Qwen3-8B --policy longflow --kv-dtype $kv --validate 256 \
      --json $OUT/throughput_$kv.json >> $log 2>&1
    echo "throughput $kv rc=$?" >> $log
  done ;;
serve)
  start_server python server.py --model /dev/shm/q8 --budget 3200 --max-waiting 1000
  serve="python bench.py serve --new-tokens 256 --prompt-len 128 --vocab 151936"
  if [ -z "${RATES:-}" ]; then  # (RATES="64 inf": some of the sweep's loads, without the one user)
    timeout 60 $serve --requests 6 --rate 0.25 --json $OUT/serve_one.json >> $log 2>&1
    echo "serve one rc=$?" >> $log
  fi
  timeout 150 $serve --requests 120 --rate ${RATES:-4 16 64 inf} --json $OUT/serve_sweep.json \
    --plot $OUT/serve_sweep.png >> $log 2>&1
  echo "serve sweep rc=$?" >> $log
  if [ "${2:-}" = saturated ]; then  # the saturated load's server side too, on the same server
    timeout 150 python bench.py serve --new-tokens 512 --prompt-len 128 --vocab 151936 --requests 520 \
      --json $OUT/saturated_serve.json >> $log 2>&1; echo "serve saturated rc=$?" >> $log
  fi
  stop_server ;;
saturated)  # issue 27: served tokens/s at saturation against the engine's own on as many requests of the same size
  start_server python server.py --model /dev/shm/q8 --budget 3200 --max-waiting 1000
  timeout 150 python bench.py serve --new-tokens 512 --prompt-len 128 --vocab 151936 --requests 520 \
    --json $OUT/saturated_serve.json >> $log 2>&1; echo "serve rc=$?" >> $log
  stop_server
  # (its tokens/s is the decode's; served tokens/s counts the wall time: compare 520 x 512 / (prefill_s + decode_s))
  timeout 300 python bench.py generate --shape Qwen3-8B --policy longflow --batch 520 --new-tokens 512 \
    --prompt-len 128 --json $OUT/saturated_generate.json >> $log 2>&1; echo "generate rc=$?" >> $log ;;
fp8)
  timeout 300 python tests/gpu_fp8_linear.py --json $OUT/fp8_linear.json --write >> $log 2>&1
  echo "fp8 linear rc=$?" >> $log; grep -A4 "^WEIGHT_ONLY_LAUNCH" fp8.py >> $log
  timeout 150 python -m pytest -q tests/test_fp8.py -p no:cacheprovider -x >> $log 2>&1; echo "tests rc=$?" >> $log
  for weights in fp8 auto; do
    timeout 150 python bench.py step --shape Qwen3-8B --batch 1 4 64 --policy longflow --weights $weights --profile \
      --json $OUT/step_$weights.json > $OUT/step_$weights.txt 2>&1
    echo "step $weights rc=$?" >> $log
  done ;;
serve-profile)  # the server's engine thread timed under each load (tests/gpu_serve_profile.py)
  start_server python tests/gpu_serve_profile.py $OUT/engine_syncs.json $OUT/marks.txt -- --model /dev/shm/q8 \
    --budget 3200 --max-waiting 1000
  serve="python bench.py serve --new-tokens 256 --prompt-len 128 --vocab 151936"
  for load in ${LOADS:-6,0.25 60,4 120,16 120,64 120,inf}; do
    set -- ${load/,/ }
    start=$(date +%s.%N)
    timeout 100 $serve --requests $1 --rate $2 >> $log 2>&1; echo "serve rate $2 rc=$?" >> $log
    echo "rate-$2 $start $(date +%s.%N)" >> $OUT/marks.txt
  done
  stop_server ;;  # the profile prints its summary as the server stops
fp8-check)  # after a change to the kernels: the activations' quantization alone, and the step at 1 and 4 rows
  timeout 60 python -c "import bench, fp8, torch
for M in (1, 4, 64): x = torch.randn(M, 4096, device='cuda', dtype=torch.bfloat16); \
print(f'_quantize_kernel, {M} x 4096: {bench.graph_time(lambda: fp8._quantized(x)) * 1e6:.2f} us')" >> $log 2>&1
  timeout 100 python bench.py step --shape Qwen3-8B --batch 1 4 --policy longflow --weights fp8 \
    --json $OUT/step_check.json >> $log 2>&1; echo "step fp8 rc=$?" >> $log ;;
select)
  timeout 240 python -m pytest -q tests/test_kernel.py -p no:cacheprovider >> $log 2>&1; echo "tests rc=$?" >> $log
  timeout 120 python bench.py kernel --batch 64 256 --json $OUT/kernel.json >> $log 2>&1; echo "kernel rc=$?" >> $log
  timeout 200 python bench.py step --shape Qwen3-8B --batch 256 507 --policy longflow --kv-dtype fp8 --weights fp8 \
    --profile --json $OUT/step_507.json > $OUT/step_507.txt 2>&1; echo "step rc=$?" >> $log ;;
fp8-run)  # FP8 first; each run within what is left of the call's 570 s (BUDGET_S: another share)
  end=$((SECONDS + ${BUDGET_S:-570}))
  left() { echo $((end - SECONDS)); }
  for run in "fp8 fp8" "auto auto"; do
    set -- $run
    [ $(left) -gt 10 ] || { echo "long-prompt $2: no time left" >> $log; continue; }  # (timeout 0: no limit)
    timeout $(left) python bench.py long-prompt --shape Qwen3-8B --prompt-len 131072 --new-tokens 64 \
      --kv-dtype $1 --weights $2 --json $OUT/long_prompt_$2.json >> $log 2>&1; echo "long-prompt $2 rc=$?" >> $log
  done
  for run in "fp8 fp8" "auto auto"; do
    set -- $run
    [ $(left) -gt 10 ] || { echo "throughput $run: no time left" >> $log; continue; }
    timeout $(left) python bench.py throughput --shape Qwen3-8B --policy longflow --kv-dtype $1 \
      --weights $2 --validate 256 --json $OUT/throughput_$1_$2.json >> $log 2>&1; echo "throughput $run rc=$?" >> $log
  done ;;
esac
