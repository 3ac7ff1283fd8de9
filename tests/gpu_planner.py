"""On a GPU: where the memory planner's rows go (issue 27). Free memory before and after bench.py's bandwidth and
matmul probes and once the caching allocator is emptied, the planner's per-row and fixed bytes, then the largest
batch that really builds the step (the planner's, then 8 rows fewer at a time)."""
import torch

import bench
import memory
from model import Config

GiB = 2**30
dev, dtype = torch.device("cuda"), torch.bfloat16
model = bench.random_model(Config.from_dict(bench.SHAPES["Qwen3-8B"]), dev, dtype)
cfg = model.cfg
print(f"weights {bench.weight_bytes(model) / GiB:.2f} GiB; allocated {torch.cuda.memory_allocated() / GiB:.2f}, "
      f"free {torch.cuda.mem_get_info()[0] / GiB:.2f} of {torch.cuda.mem_get_info()[1] / GiB:.2f} GiB")
bench.copy_bandwidth(dev), bench.matmul_rate(dev, dtype)
print(f"after the probes: free {torch.cuda.mem_get_info()[0] / GiB:.2f} GiB, reserved {torch.cuda.memory_reserved() / GiB:.2f}, "
      f"allocated {torch.cuda.memory_allocated() / GiB:.2f}")
torch.cuda.empty_cache()  # what the probes left cached is free for the cache
free = torch.cuda.mem_get_info()[0]
per_row = memory.bytes_per_row(cfg, 3200, dtype)
fixed = memory.prefill_bytes(cfg, memory.PREFILL_TOKENS, dtype) + memory.SPARE
fits = memory.batch_that_fits(cfg, 3200, 128, free, dtype)
print(f"emptied: free {free / GiB:.2f} GiB; per row {per_row / 2**20:.1f} MiB, fixed {fixed / GiB:.2f} GiB -> {fits} rows")
for B in range(fits, 0, -8):
    try:
        torch.cuda.reset_peak_memory_stats()
        timer = bench.StepTimer(model, "longflow", B, 3200, True)
        ms = timer.seconds_per_step(3200) * 1e3
        print(f"{B} rows: built, {ms:.2f} ms/step, peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, "
              f"reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB")
        timer.free()
        break
    except torch.OutOfMemoryError as e:
        print(f"{B} rows: out of memory: {str(e).splitlines()[0][:300]}; peak {torch.cuda.max_memory_allocated() / GiB:.2f}")
        timer = None
        torch.cuda.empty_cache()

# the engine's ladder at that batch: its capture time, and the memory its graphs add to the one-size step's
from generate import Engine, sync_time  # noqa: E402
from policies import resolve_policy  # noqa: E402
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
engine, t = Engine(model), sync_time(dev)
engine._prepare(B, 3200, resolve_policy("longflow", 3200), "snapkv", "sample")
print(f"the engine at {B} rows: the step for {len(engine.stepper.sizes)} sizes in {sync_time(dev) - t:.1f} s, peak "
      f"{torch.cuda.max_memory_allocated() / GiB:.2f} GiB, reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB")
