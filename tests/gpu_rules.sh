#!/usr/bin/env bash
# On a GPU machine (issue 42: the rules through kernel.Scoring), results into $OUT, every log line into
# $OUT/log.txt. Parts, in the order given, in one device call or several:
#     bash tests/gpu_rules.sh tests    # the kernel's GPU tests (TESTS_K: a pytest -k filter, default all)
#     bash tests/gpu_rules.sh kernel   # bench.py kernel of this tree and of before/ in turn (ROUNDS, default two
#                                      # rounds), every rule the kernel scores (each tree's own list) or KERNEL_POLICIES
#     bash tests/gpu_rules.sh graph    # the graph-replayed step against eager, never recompiling (GRAPHED)
#     bash tests/gpu_rules.sh step     # bench.py step of every rule (POLICIES; BATCHES, default "1 64")
#     bash tests/gpu_rules.sh given    # the kernel scoring by a given query (TriAttention), its launch swept, then
#                                      # the step at STEP_BATCHES with each one's fastest launch
# before/ is another revision, exported next to the tree first (the GPU machine has no git):
#     git archive REV | tar -x -C before --exclude tests --exclude data --exclude docs
set -u
cd "$(dirname "$0")/.."
source tests/gpu_common.sh "$@"
for part in "$@"; do
  case $part in
  tests)
    timeout ${TESTS_S:-120} python -m pytest -q tests/test_kernel.py -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
      >> $log 2>&1
    echo "kernel tests rc=$?" >> $log ;;
  kernel)
    for round in ${ROUNDS:-1 2}; do
      for tree in after before; do
        dir=$([ $tree = before ] && echo before || echo .)
        (cd $dir && timeout ${KERNEL_S:-80} python bench.py kernel --batch 1 64 256 \
          ${KERNEL_POLICIES:+--policy $KERNEL_POLICIES} --json $OUT/kernel_${tree}_$round.json > /dev/null 2>> $log)
        echo "kernel $tree $round rc=$?" >> $log
      done
    done ;;
  graph)
    timeout ${GRAPH_S:-300} python -m pytest -q tests/test_generate.py -p no:cacheprovider \
      -k "cuda_graph_replay and (${GRAPHED:-longflow or lazy or snapkv or triattention})" >> $log 2>&1
    echo "graph tests rc=$?" >> $log ;;
  step)
    for policy in ${POLICIES:-longflow longflow-ema h2o snapkv-decode lazy triattention}; do
      timeout ${STEP_S:-50} python bench.py step --shape Qwen3-8B --batch ${BATCHES:-1 64} --policy $policy \
        --json $OUT/step_$policy.json >> $log 2>&1
      echo "step $policy rc=$?" >> $log
    done ;;
  given)
    timeout ${SWEEP_S:-240} python tests/gpu_given_sweep.py --batch ${BATCHES:-1 64} --json $OUT/given_sweep.json \
      --step ${STEP_BATCHES:-} >> $log 2>&1
    echo "given sweep rc=$?" >> $log ;;
  esac
done
date -u >> $log
