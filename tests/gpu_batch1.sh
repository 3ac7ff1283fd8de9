#!/usr/bin/env bash
# On a GPU machine (issue 44: one user at the bandwidth floor), results into $OUT, every log line into $OUT/log.txt.
# Parts, in one device call or several:
#     bash tests/gpu_batch1.sh tests   # fp8.py's tests on the GPU
#     bash tests/gpu_batch1.sh step    # bench.py step with FP8 weights: this tree's (the LM head quantized too, and
#                                      # not: fp8-layers) and before/'s, batch BATCHES (default "1 4 16")
#     bash tests/gpu_batch1.sh bf16    # bench.py step, bf16 weights, this tree
#     bash tests/gpu_batch1.sh sweep   # the fused kernel's launch at few rows (tests/gpu_attention_sweep.py)
# before/ is another revision, exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs
set -u
cd "$(dirname "$0")/.."
log=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; echo "== $*"; } >> $log
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
    step . fp8 --batch ${BATCHES:-1 4 16} --weights fp8 --profile
    step before before-fp8 --batch ${BATCHES:-1 4 16} --weights fp8
    step . fp8-layers --batch ${BATCHES:-1 4 16} --weights fp8-layers ;;
  bf16)
    step . bf16 --batch ${BATCHES:-1 4 16} ;;
  sweep)
    timeout ${SWEEP_S:-240} python tests/gpu_attention_sweep.py --batch ${BATCHES:-1 4 16} --json $OUT/sweep.json \
      >> $log 2>&1
    echo "sweep rc=$?" >> $log ;;
  esac
done
date -u >> $log
