#!/usr/bin/env bash
# On a GPU machine (issue 27: the step at the busy rows), results into $OUT. Three parts, one device call each:
#     bash tests/gpu_ladder.sh tests+step    # GPU tests; bench.py step of this tree and of before/ (static shapes)
#     bash tests/gpu_ladder.sh serve         # server.py under a low load and a sweep of loads
#     bash tests/gpu_ladder.sh throughput    # bf16 and FP8 LongFlow at the largest batch that fits, validated
# before/ is another revision, exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs
set -u
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
case "$1" in
tests+step)
  timeout 200 python -m pytest -q tests/test_score.py tests/test_generate.py -p no:cacheprovider \
    -k "compiled_scoring or (cuda_graph and (longflow or rkv or full or h2o))" > $OUT/tests.txt 2>&1
  echo "tests rc=$?" | tee -a $OUT/gpu.txt; tail -3 $OUT/tests.txt
  for tree in before after; do
    dir=$([ $tree = before ] && echo before || echo .)
    (cd $dir && timeout 200 python bench.py step --shape Qwen3-8B --batch 1 2 64 224 --policy longflow \
      --json $OUT/step_${tree}.json > $OUT/step_${tree}.txt 2>&1)
    echo "step $tree rc=$?"; grep -E "^workload" $OUT/step_${tree}.txt | cut -c1-200
  done ;;
serve|all)
  [ "$1" = all ] && bash "$0" throughput
  export PYTHONPATH=$PWD/gpu_site  # starlette and uvicorn, carried (the GPU machine has neither)
  python bench.py checkpoint --shape Qwen3-8B --out /dev/shm/q8 > $OUT/checkpoint.txt 2>&1; echo "checkpoint rc=$?"
  python server.py --model /dev/shm/q8 --budget 3200 --max-waiting 1000 > $OUT/server.txt 2>&1 &
  server=$!
  for _ in $(seq 240); do grep -q "^serving" $OUT/server.txt && break; sleep 1; done
  cat $OUT/server.txt
  serve="python bench.py serve --new-tokens 256 --prompt-len 128 --vocab 151936"
  timeout 60 $serve --requests 8 --rate 0.25 --json $OUT/serve_one.json > $OUT/serve_one.txt 2>&1
  echo "serve one rc=$?"; tail -2 $OUT/serve_one.txt
  timeout 120 $serve --requests 200 --rate 4 16 64 inf --json $OUT/serve_sweep.json \
    > $OUT/serve_sweep.txt 2>&1
  echo "serve sweep rc=$?"; tail -5 $OUT/serve_sweep.txt
  kill -INT $server; sleep 5; tail -3 $OUT/server.txt ;;
planner)
  timeout 150 python tests/gpu_planner.py 2>&1 | grep -v Warning | tail -12 ;;
throughput)
  for kv in auto fp8; do
    timeout 140 python bench.py throughput --shape Qwen3-8B --policy longflow --kv-dtype $kv --validate 256 \
      --json $OUT/throughput_$kv.json > $OUT/throughput_$kv.txt 2>&1
    echo "throughput $kv rc=$?"; grep -E "^workload" $OUT/throughput_$kv.txt | cut -c1-600
  done ;;
esac
