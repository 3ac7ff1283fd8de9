"""On a GPU (issue 28): fp8.py's two kernels against the bf16 product (cuBLAS) on Qwen3-8B's projections, for
rows 1 to 512: microseconds and the weight bytes' share of the copy bandwidth, to choose fp8.WEIGHT_ONLY_ROWS.

    python tests/gpu_fp8_linear.py [--json OUT]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import fp8  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
ROWS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512]


def microseconds(fn, repeat=50) -> float:
    for _ in range(5):
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
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
rows = []
for name, (N, K) in SHAPES.items():
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    linear = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    linear.weight.data = w
    q = fp8.Fp8Linear.of(linear)
    for M in ROWS:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        row = dict(layer=name, N=N, K=K, rows=M, bf16_us=microseconds(lambda: F.linear(x, w)),
                   weight_only_us=microseconds(lambda: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block,
                                                                      weight_only=True)),
                   tensor_cores_us=microseconds(lambda: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block,
                                                                       weight_only=False)))
        row["weight_only_of_floor"] = N * K / bandwidth / (row["weight_only_us"] * 1e-6)
        row["bf16_of_floor"] = 2 * N * K / bandwidth / (row["bf16_us"] * 1e-6)
        rows.append(row)
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
if sys.argv[1:2] == ["--json"]:
    with open(sys.argv[2], "w") as f:
        json.dump(dict(bandwidth=bandwidth, rows=rows), f, indent=1)
