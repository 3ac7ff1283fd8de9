#!/usr/bin/env bash
# On a GPU machine: this tree's GPU tests, then the benchmarks of another revision and of this tree, side by
# side, results into $OUT. The other revision is exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs   (mkdir before first)
#     bash tests/gpu_compare.sh tests+step     # then: bash tests/gpu_compare.sh throughput
set -u
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
if [ "$1" = "tests+step" ]; then
  timeout 330 python -m pytest -q tests/test_kernel.py tests/test_rules.py tests/test_cache.py -p no:cacheprovider \
    > $OUT/tests.txt 2>&1; echo "tests rc=$?" | tee -a $OUT/gpu.txt; tail -3 $OUT/tests.txt
  for round in 1 2; do
    for tree in before after; do
      dir=$([ $tree = before ] && echo before || echo .)
      (cd $dir && python bench.py kernel --batch 1 64 256 --json $OUT/kernel_${tree}_$round.json > /dev/null 2>&1)
      echo "kernel $tree $round rc=$?"
    done
  done
  for tree in before after; do
    dir=$([ $tree = before ] && echo before || echo .)
    (cd $dir && timeout 200 python bench.py step --shape Qwen3-8B --batch 1 64 --policy longflow --json $OUT/step_${tree}.json > $OUT/step_${tree}.txt 2>&1)
    echo "step $tree rc=$?"
  done
else
  for tree in before after; do
    dir=$([ $tree = before ] && echo before || echo .)
    (cd $dir && timeout 280 python bench.py throughput --shape Qwen3-8B --policy longflow --json $OUT/throughput_${tree}.json > $OUT/throughput_${tree}.txt 2>&1)
    echo "throughput $tree rc=$?"
  done
fi
