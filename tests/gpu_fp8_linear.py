"""On a GPU (issue 28): fp8.py's kernels against the bf16 product (cuBLAS) on Qwen3-8B's projections, to choose
fp8.WEIGHT_ONLY_LAUNCH, fp8.TENSOR_CORE_LAUNCH, fp8.WEIGHT_ONLY_ROWS and fp8.CUBLAS_ROWS. The weight-only kernel
under each launch setting of a grid at one row, Triton's tensor-core kernel likewise at 2 to 512 rows, cuBLAS's
blockwise product (torch._scaled_mm) at each; then where each takes over. --write puts the choice into fp8.py.

    python tests/gpu_fp8_linear.py [--json OUT] [--write]
    python tests/gpu_fp8_linear.py --large      # Triton's tensor cores and cuBLAS at 128 to 4,096 rows, and bf16

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
WEIGHT_ONLY = [dict(block_n=b, groups=g, waves=w, num_warps=nw, num_stages=ns)
               for b, g, w, (nw, ns) in itertools.product([8, 16, 32, 64], [1, 2, 4], [0, 2, 4], [(4, 3), (8, 3)])
               if b * g <= 128]
TENSOR_CORES = [dict(block_m=64, block_n=b, waves=w, num_warps=nw, num_stages=ns)
                for b, w, (nw, ns) in itertools.product([64, 128], [0, 2], [(4, 4), (8, 3)])]
# --large: the tensor cores alone at many rows (decode at large batches, prefill's 4,096-row chunks)
LARGE = [dict(block_m=bm, block_n=b, waves=2, num_warps=nw, num_stages=ns) for bm, b, (nw, ns) in
         itertools.product([64, 128], [64, 128, 256], [(4, 3), (4, 4), (8, 3)]) if bm * b <= 128 * 128]
LARGE_M = (128, 512, 4096)
TENSOR_CORE_M = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def microseconds(calls) -> float:
    """GPU time of one call, the calls taken in turn (each reads another copy of the weights, together more than
    the 50 MB L2 holds, as a step's layers are)."""
    return bench.graph_time_in_turn(calls) * 1e6


def total_us(M, kernel, launch=None) -> float:
    """The four projections' time at M rows (one layer's), microseconds."""
    us = 0.0
    for name, copies in layers.items():
        x = inputs[M][name]
        us += microseconds([lambda q=q: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block, kernel,
                                                       **(launch or {})) for _, q in copies])
    return us


def cublas_error(M=64) -> str:
    """cuBLAS's product against linear_ref with the activations quantized: the largest error relative to the
    largest output, per projection (or why it does not run)."""
    errors = []
    for name, copies in layers.items():
        q, x = copies[0][1], inputs[M][name]
        try:
            got = fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block, "cublas").float()
        except RuntimeError as e:
            return f"cuBLAS does not run: {str(e).splitlines()[0]}"
        want = fp8.linear_ref(x.float(), q.weight, q.weight_scale_inv, q.row_block, quantized_x=True)
        errors.append(f"{name} {((got - want).abs().max() / want.abs().max()).item():.2e}")
    return "cuBLAS against linear_ref, largest error / largest output: " + ", ".join(errors)


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
          for M in (1,) + TENSOR_CORE_M + LARGE_M}


def bf16_us(M) -> float:
    return sum(microseconds([lambda w=w: F.linear(inputs[M][name], w) for w, _ in copies])
               for name, copies in layers.items())


errors = cublas_error()
print(errors, flush=True)
for M in (1, 4, 64, 256):  # the activations' quantization alone, one row of K = 4,096 (in L2)
    print(f"_quantize_kernel, {M} x 4096: {microseconds([lambda M=M: fp8._quantized(inputs[M]['o_proj'])]):.2f} us")
cublas_runs = not errors.startswith("cuBLAS does not run")
if "--large" in sys.argv:
    for M in LARGE_M:
        results = sorted(((total_us(M, "tensor_cores", launch), launch) for launch in LARGE), key=lambda r: r[0])
        cublas = f"cuBLAS {total_us(M, 'cublas'):.1f} us; " if cublas_runs else ""
        print(f"rows {M}: bf16 {bf16_us(M):.1f} us; {cublas}Triton tensor cores, best five: "
              + "; ".join(f"{us:.1f} us {launch}" for us, launch in results[:5]), flush=True)
    sys.exit()
floor_us = sum(N * K for N, K in SHAPES.values()) / bandwidth * 1e6  # e4m3 weights read once
sweep = [dict(kernel="weight_only", rows=1, launch=launch, us=total_us(1, "weight_only", launch))
         for launch in WEIGHT_ONLY]
sweep += [dict(kernel="tensor_cores", rows=M, launch=launch, us=total_us(M, "tensor_cores", launch))
          for M in TENSOR_CORE_M for launch in TENSOR_CORES]
best = {M: min(r["us"] for r in sweep if r["kernel"] == "tensor_cores" and r["rows"] == M) for M in TENSOR_CORE_M}
weight_only = min((r for r in sweep if r["kernel"] == "weight_only"), key=lambda r: r["us"])
print("weight-only at one row, best five: " + "; ".join(
    f"{r['us']:.1f} us {r['launch']}" for r in sorted(sweep[:len(WEIGHT_ONLY)], key=lambda r: r["us"])[:5]))
# Triton's tensor cores: the least time over all their rows, each relative to the best at those rows
tensor_cores = min(TENSOR_CORES, key=lambda launch: sum(
    r["us"] / best[r["rows"]] for r in sweep if r["kernel"] == "tensor_cores" and r["launch"] == launch))
chosen = dict(WEIGHT_ONLY_LAUNCH=weight_only["launch"], TENSOR_CORE_LAUNCH=tensor_cores)
rows = []
for M in (1,) + TENSOR_CORE_M:
    row = dict(rows=M, bf16_us=bf16_us(M))
    row["weight_only_us" if M == 1 else "tensor_cores_us"] = weight_only["us"] if M == 1 else next(
        r["us"] for r in sweep if r["kernel"] == "tensor_cores" and r["rows"] == M and r["launch"] == tensor_cores)
    if cublas_runs:
        row["cublas_us"] = total_us(M, "cublas")
    row["fp8_of_floor"] = floor_us / min(v for k, v in row.items() if k.endswith("us") and k != "bf16_us")
    rows.append(row)
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
# one row: the weight-only kernel unless cuBLAS is faster there; cuBLAS from the fewest rows past which it is
# always the faster tensor-core product
chosen["WEIGHT_ONLY_ROWS"] = int(rows[0]["weight_only_us"] <= rows[0].get("cublas_us", float("inf")))
slower = [r["rows"] for r in rows[1:] if r.get("cublas_us", float("inf")) >= r["tensor_cores_us"]]
chosen["CUBLAS_ROWS"] = max(slower) * 2 if slower else 2
print(f"chosen: {chosen}", flush=True)
if "--json" in sys.argv:
    with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
        json.dump(dict(bandwidth=bandwidth, floor_us=floor_us, chosen=chosen, rows=rows, sweep=sweep), f, indent=1)
if "--write" in sys.argv:
    write(chosen)
