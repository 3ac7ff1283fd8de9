#!/usr/bin/env bash
# On a GPU machine (issue 44: one user at the bandwidth floor), results into $OUT, every log line into $OUT/log.txt.
# Parts, in one device call or several:
#     bash tests/gpu_batch1.sh tests   # fp8.py's tests on the GPU
#     bash tests/gpu_batch1.sh step    # bench.py step with FP8 weights: this tree's (the LM head quantized too:
#                                      # fp8-all, and not) and before/'s, batch BATCHES (default "1 4 16")
#     bash tests/gpu_batch1.sh bf16    # bench.py step, bf16 weights, this tree
#     bash tests/gpu_batch1.sh ab      # the graph-replayed step against eager (longflow); bench.py step of this tree
#                                      # and before/'s in turn, FP8 weights then bf16, batch BATCHES
#     bash tests/gpu_batch1.sh sweep   # the fused kernel's launch at few rows (tests/gpu_attention_sweep.py)
#     bash tests/gpu_batch1.sh serve   # one user of server.py (--weights fp8-all): TPOT against the step at batch 1
#     bash tests/gpu_batch1.sh ties    # which of equal values torch.topk keeps on this GPU (LazyEviction's ties)
# serve needs starlette and uvicorn, which the GPU machine lacks: their wheels in .whl/ (README of the device tool).
# before/ is another revision, exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs
set -u
cd "$(dirname "$0")/.."
source tests/gpu_common.sh "$@"
step() {  # tree, name, then bench.py step's options
  local dir=$1 name=$2; shift 2
  (cd $dir && timeout ${STEP_S:-150} python bench.py step --shape Qwen3-8B --policy longflow "$@" \
    --json $OUT/step_$name.json >> $log 2>&1)
  echo "step $name rc=$?" >> $log
}
for part in "$@"; do
  case $part in
  tests)
    timeout ${TESTS_S:-150} python -m pytest -q tests/test_fp8.py -p no:cacheprovider >> $log 2>&1
    echo "fp8 tests rc=$?" >> $log ;;
  step)
    step . fp8-all --batch ${BATCHES:-1 4 16} --weights fp8-all --profile
    step before before-fp8 --batch ${BATCHES:-1 4 16} --weights fp8
    step . fp8 --batch ${BATCHES:-1 4 16} --weights fp8 ;;
  bf16)
    step . bf16 --batch ${BATCHES:-1 4 16} ;;
  ab)
    timeout ${TESTS_S:-150} python -m pytest -q tests/test_generate.py -p no:cacheprovider \
      -k "cuda_graph_replay and longflow" >> $log 2>&1
    echo "graph tests rc=$?" >> $log
    for w in ${WEIGHTS:-fp8-all auto}; do
      step . $w-after --batch ${BATCHES:-1 4 16} --weights $w
      step before $w-before --batch ${BATCHES:-1 4 16} --weights $w
    done ;;
  serve)
    start_server python server.py --model /dev/shm/q8 --budget 3200 --weights fp8-all
    timeout 90 python bench.py serve --new-tokens 256 --prompt-len 128 --vocab 151936 --requests 6 --rate 0.25 \
      --json $OUT/serve_one.json >> $log 2>&1
    echo "serve one rc=$?" >> $log
    stop_server ;;
  ties)
    python -c "import torch; x = torch.ones(1, 1, 100, device='cuda', dtype=torch.float16)
print('topk of 100 equal values, k=50, kept:', sorted(x.topk(50, dim=-1)[1][0, 0].tolist()))" >> $log 2>&1 ;;
  graph)
    timeout ${TESTS_S:-150} python -m pytest -q tests/test_fp8.py -p no:cacheprovider -k "graph_replayed" >> $log 2>&1
    echo "fp8 graph tests rc=$?" >> $log ;;
  sweep)
    timeout ${SWEEP_S:-240} python tests/gpu_attention_sweep.py --batch ${BATCHES:-1 4 16} --json $OUT/sweep.json \
      >> $log 2>&1
    echo "sweep rc=$?" >> $log ;;
  esac
done
date -u >> $log
