# Sourced by the tests/gpu_*.sh scripts after they cd to the repository: the log ($OUT/log.txt) opened with the
# GPU, torch and triton versions, the date and the parts asked for; the server's start and stop for the serve parts.
log=$OUT/log.txt
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u; echo "== $*"; } >> $log
# the serve extra from .whl/, random Qwen3-8B weights in /dev/shm/q8, then "$@" (a server) until it serves
start_server() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> $log 2>&1 && export PYTHONPATH=/tmp/site
  python bench.py checkpoint --shape Qwen3-8B --out /dev/shm/q8 >> $log 2>&1; echo "checkpoint rc=$?" >> $log
  "$@" > $OUT/server.txt 2>&1 &
  server=$!
  for _ in $(seq 300); do grep -q "^serving" $OUT/server.txt && break; sleep 1; done
}
stop_server() {  # Ctrl-C (5 s of grace for open streams), at most 40 s, then its output into the log
  kill -INT $server; for _ in $(seq 40); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -KILL $server 2>/dev/null; cat $OUT/server.txt >> $log; rm $OUT/server.txt
}
