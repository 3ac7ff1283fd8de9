"""On a GPU (issue 28): fp8.py's two kernels against the bf16 product (cuBLAS) on Qwen3-8B's projections, to choose
fp8.WEIGHT_ONLY_LAUNCH, fp8.TENSOR_CORE_LAUNCH and fp8.WEIGHT_ONLY_ROWS. Each kernel under each launch setting
of a grid at its numbers of rows; the weight-only kernel's best at one row, the tensor cores' best over all of
theirs; then, with those, the rows up to which the weight-only kernel is the faster one. --write puts the choice
into fp8.py.

    python tests/gpu_fp8_linear.py [--json OUT] [--write]
    python tests/gpu_fp8_linear.py --large      # the tensor cores' launch at 128 to 4,096 rows, against bf16

Every time is the GPU's, from a CUDA graph of calls each reading another copy of the weights (more than the
50 MB of L2 in all, as a step's layers are): a Triton launch from Python takes longer than these kernels run.
"""
import itertools
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import fp8  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
WARPS_STAGES = [(4, 4), (8, 3)]
WEIGHT_ONLY = [dict(block_n=b, waves=w, num_warps=nw, num_stages=ns)
               for b, w, (nw, ns) in itertools.product([32, 64, 128], [2, 4], WARPS_STAGES)]
TENSOR_CORES = [dict(block_m=64, block_n=b, waves=w, num_warps=nw, num_stages=ns)
                for b, w, (nw, ns) in itertools.product([64, 128], [0, 2], WARPS_STAGES)]
# --large: the tensor cores alone at many rows (decode at large batches, prefill's 4,096-row chunks)
LARGE = [dict(block_m=bm, block_n=b, waves=2, num_warps=nw, num_stages=ns) for bm, b, (nw, ns) in
         itertools.product([64, 128], [64, 128, 256], [(4, 3), (4, 4), (8, 3)]) if bm * b <= 128 * 128]
LARGE_M = (128, 512, 4096)
WEIGHT_ONLY_M, TENSOR_CORE_M = (1, 2, 4), (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def microseconds(calls) -> float:
    """GPU time of one call, the calls taken in turn (each reads another copy of the weights, together more than
    the 50 MB L2 holds, as a step's layers are): bench.graph_time, a CUDA graph of them."""
    turn = itertools.cycle(calls)
    return bench.graph_time(lambda: next(turn)()) * 1e6


def total_us(M, weight_only, launch) -> float:
    """The four projections' time at M rows (one layer's), microseconds."""
    us = 0.0
    for name, copies in layers.items():
        x = inputs[M][name]
        us += microseconds([lambda q=q: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block, weight_only,
                                                       **launch) for _, q in copies])
    return us


def write(chosen: dict):
    """The chosen settings into fp8.py (this copy of it)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fp8.py")
    text = open(path).read()
    for name, value in chosen.items():
        literal = f"dict({', '.join(f'{k}={v}' for k, v in value.items())})" if isinstance(value, dict) else value
        text, found = re.subn(rf"^{name} = .*$", f"{name} = {literal}", text, flags=re.M)
        assert found == 1, f"fp8.py has {found} lines `{name} = ...`, not one: write it by hand"
    open(path, "w").write(text)


dev = torch.device("cuda")
bandwidth = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
layers = {}
for name, (N, K) in SHAPES.items():
    copies = []
    for _ in range(max(2, -(-256 * 2**20 // (N * K)))):  # >= 256 MB of e4m3 weights in all
        linear = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        copies.append((linear.weight.detach(), fp8.Fp8Linear.of(linear)))
    layers[name] = copies
inputs = {M: {name: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for name, (_, K) in SHAPES.items()}
          for M in TENSOR_CORE_M + LARGE_M}


def bf16_us(M) -> float:
    return sum(microseconds([lambda w=w: F.linear(inputs[M][name], w) for w, _ in copies])
               for name, copies in layers.items())


if "--large" in sys.argv:
    for M in LARGE_M:
        results = sorted(((total_us(M, False, launch), launch) for launch in LARGE), key=lambda r: r[0])
        print(f"rows {M}: bf16 {bf16_us(M):.1f} us; tensor cores, best five: "
              + "; ".join(f"{us:.1f} us {launch}" for us, launch in results[:5]), flush=True)
    sys.exit()
floor_us = sum(N * K for N, K in SHAPES.values()) / bandwidth * 1e6  # e4m3 weights read once
sweep = [dict(kernel="weight-only", rows=M, launch=launch, us=total_us(M, True, launch))
         for M in WEIGHT_ONLY_M for launch in WEIGHT_ONLY]
sweep += [dict(kernel="tensor-cores", rows=M, launch=launch, us=total_us(M, False, launch))
          for M in TENSOR_CORE_M for launch in TENSOR_CORES]
best = {(r["kernel"], r["rows"]): min(s["us"] for s in sweep if (s["kernel"], s["rows"]) == (r["kernel"], r["rows"]))
        for r in sweep}
weight_only = min((r for r in sweep if r["kernel"] == "weight-only" and r["rows"] == 1), key=lambda r: r["us"])
# the tensor cores' setting: the least time over all their rows, each relative to the best at those rows
tensor_cores = min(TENSOR_CORES, key=lambda launch: sum(
    r["us"] / best[("tensor-cores", r["rows"])] for r in sweep if r["kernel"] == "tensor-cores" and r["launch"] == launch))
chosen = dict(WEIGHT_ONLY_LAUNCH=weight_only["launch"], TENSOR_CORE_LAUNCH=tensor_cores)
rows = []
for M in TENSOR_CORE_M:
    row = dict(rows=M, bf16_us=bf16_us(M), tensor_cores_us=next(r["us"] for r in sweep if r["kernel"] == "tensor-cores"
                                                          and r["rows"] == M and r["launch"] == tensor_cores))
    if M in WEIGHT_ONLY_M:
        row["weight_only_us"] = next(r["us"] for r in sweep if r["kernel"] == "weight-only" and r["rows"] == M
                                     and r["launch"] == weight_only["launch"])
    row["fp8_of_floor"] = floor_us / min(row["tensor_cores_us"], row.get("weight_only_us", float("inf")))
    rows.append(row)
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
faster = [r.get("weight_only_us", 1e9) < r["tensor_cores_us"] for r in rows]  # from one row up
chosen["WEIGHT_ONLY_ROWS"] = ([0] + [r["rows"] for r in rows])[(faster + [False]).index(False)]
print(f"chosen: {chosen}", flush=True)
if "--json" in sys.argv:
    with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
        json.dump(dict(bandwidth=bandwidth, floor_us=floor_us, chosen=chosen, rows=rows, sweep=sweep), f, indent=1)
if "--write" in sys.argv:
    write(chosen)
