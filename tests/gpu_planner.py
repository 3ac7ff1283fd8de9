"""On a GPU: where the memory planner's rows go (issue 27). Free memory before and after bench.py's bandwidth and
matmul probes and what the caching allocator then holds for no tensor; what the decode step takes beside the
weights and the cache at two batch sizes (bench.py's one-size step, then the engine's ladder of sizes), from
which the memory a row costs beyond its cache; the planner's rows for bf16 and FP8 caches of 3,200 slots."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import memory  # noqa: E402
from cache import KVCache  # noqa: E402
from generate import Engine  # noqa: E402
from model import Config  # noqa: E402
from policies import resolve_policy  # noqa: E402

GiB, SLOTS = 2**30, 3200
dev, dtype = torch.device("cuda"), torch.bfloat16
model = bench.random_model(Config.from_dict(bench.SHAPES["Qwen3-8B"]), dev, dtype)
cfg, weights = model.cfg, torch.cuda.memory_allocated()


def say(when: str):
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    pieces = torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0)
    print(f"{when}: device free {free / GiB:.2f} of {total / GiB:.2f} GiB; allocator reserved {reserved / GiB:.2f}, "
          f"allocated {allocated / GiB:.2f}, unused {(reserved - allocated) / GiB:.2f} GiB of which {pieces / GiB:.2f} "
          f"in pieces of blocks in use; the planner counts {memory.device_free_bytes(dev) / GiB:.2f} GiB free",
          flush=True)


say(f"weights {weights / GiB:.2f} GiB")
bench.copy_bandwidth(dev), bench.matmul_rate(dev, dtype)
say("after the probes")
torch.cuda.empty_cache()
beyond = {}  # (what, batch) -> GiB the step took beyond the weights and the cache, at its peak
for what, B in (("one size", 32), ("one size", 160), ("ladder", 160)):
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    policy = resolve_policy("longflow", SLOTS)
    if what == "one size":
        made = bench.StepTimer(model, "longflow", B, SLOTS, True)
        made.seconds_per_step(SLOTS)
    else:
        made = Engine(model)
        made._prepare(B, SLOTS, policy, "snapkv", "sample")
    kv = KVCache.bytes_needed(cfg, B, SLOTS, dtype, policy)
    peak = torch.cuda.max_memory_allocated()
    beyond[what, B] = (peak - weights - kv) / GiB
    say(f"{what} step at batch {B} built in {time.perf_counter() - t:.1f} s, peak {peak / GiB:.2f} GiB, beyond the "
        f"weights and the cache {beyond[what, B]:.2f} GiB")
    del made
    torch.cuda.empty_cache()
per_row = (beyond["one size", 160] - beyond["one size", 32]) / 128 * GiB
print(f"the step beyond the cache: {per_row / 2**20:.1f} MiB a row, {per_row / cfg.vocab_size:.0f} bytes per "
      f"vocabulary id and row; at batch 32 {beyond['one size', 32]:.2f} GiB; the ladder adds "
      f"{beyond['ladder', 160] - beyond['one size', 160]:.2f} GiB at batch 160")
fixed = memory.prefill_bytes(cfg, memory.PREFILL_TOKENS, dtype) + memory.SPARE
for kv in (None, memory.kernel.FP8):
    rows = memory.batch_that_fits(cfg, SLOTS, 128, memory.device_free_bytes(dev), dtype, kv_dtype=kv)
    print(f"{'fp8' if kv else 'bf16'} cache: per row {memory.bytes_per_row(cfg, SLOTS, dtype, kv_dtype=kv) / 2**20:.1f} "
          f"MiB, fixed {fixed / GiB:.2f} GiB -> {rows} rows")
