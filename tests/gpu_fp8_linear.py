"""On a GPU (issue 28): fp8.py's kernels against the bf16 product (cuBLAS) on Qwen3-8B's projections, to choose
fp8.WEIGHT_ONLY_LAUNCH and fp8.WEIGHT_ONLY_ROWS. The weight-only kernel at 1, 16 and 64 rows under each launch
setting of a grid (microseconds, and the weight bytes' share of the copy bandwidth), the best setting over the
four projections; then both kernels and bf16 at 1 to 512 rows with that setting.

    python tests/gpu_fp8_linear.py [--json OUT]
"""
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import fp8  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
GRID = [dict(block_n=b, waves=w, num_warps=4, num_stages=s) for b, w, s in
        itertools.product([16, 32, 64, 128], [0, 2, 4], [3, 5])]


def microseconds(fn, repeat=30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat * 1e3


dev = torch.device("cuda")
bandwidth = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
layers = {}
for name, (N, K) in SHAPES.items():
    linear = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    layers[name] = (linear.weight.detach(), fp8.Fp8Linear.of(linear))
inputs = {M: {name: torch.randn(M, SHAPES[name][1], device=dev, dtype=torch.bfloat16) for name in SHAPES}
          for M in (1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512)}
best, sweep = {}, []
for M in (1, 16, 64):
    for launch in GRID:
        us = {name: microseconds(lambda: fp8.fp8_linear(inputs[M][name], q.weight, q.weight_scale_inv, q.row_block,
                                                        weight_only=True, **launch)) for name, (_, q) in layers.items()}
        sweep.append(dict(rows=M, **launch, us=us, total_us=sum(us.values())))
    best[M] = min((r for r in sweep if r["rows"] == M), key=lambda r: r["total_us"])
    floor_us = sum(N * K for N, K in SHAPES.values()) / bandwidth * 1e6
    print(f"rows {M}: best {best[M]} ({floor_us / best[M]['total_us']:.0%} of the bytes floor)", flush=True)
chosen = {k: best[1][k] for k in fp8.WEIGHT_ONLY_LAUNCH}
rows = []
for M, xs in inputs.items():
    for name, (w, q) in layers.items():
        x, (N, K) = xs[name], SHAPES[name]
        row = dict(layer=name, rows=M, bf16_us=microseconds(lambda: F.linear(x, w)),
                   weight_only_us=microseconds(lambda: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block,
                                                                      weight_only=True, **chosen)),
                   tensor_cores_us=microseconds(lambda: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block,
                                                                       weight_only=False)))
        row.update(weight_only_of_floor=N * K / bandwidth / (row["weight_only_us"] * 1e-6),
                   bf16_of_floor=2 * N * K / bandwidth / (row["bf16_us"] * 1e-6))
        rows.append(row)
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
if sys.argv[1:2] == ["--json"]:
    with open(sys.argv[2], "w") as f:
        json.dump(dict(bandwidth=bandwidth, chosen=chosen, best=best, sweep=sweep, rows=rows), f, indent=1)
