"""On a GPU (issue 28, next experiment): one row on the FP8 tensor cores with the weights as the product's M side.

fp8.py's weight-only kernel widens every e4m3 weight to fp32 in registers, and at one row that costs
instructions at the rate the bytes arrive (70.5 us a layer in the step, 65% of its floor). The FP8 tensor cores
read e4m3 as it is stored; at one row fp8.py's tensor-core kernel wastes them on a block of 16 activation rows
as the M side. Here the weights are the M side instead (W x^T: a block of 64 or 128 weight rows against the
activations quantized and padded to 16 rows as the N side), so the weights go from memory to the tensor cores
without a conversion. Timed against the weight-only kernel at 1 row on Qwen3-8B's four projections (the
activations' quantization included), after checking it against linear_ref(quantized_x=True).

    python tests/gpu_fp8_swap.py [--json OUT]
"""
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import fp8  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
LAUNCHES = [dict(block_n=b, waves=w, num_warps=nw, num_stages=ns)
            for b, w, (nw, ns) in itertools.product([64, 128], [1, 2, 4], [(4, 3), (4, 4), (8, 3)])]


@triton.jit
def _swapped_kernel(w, s, row_block, a, a_scales, out, partials, arrived, M, M_PAD, N, K, KB_PER, n_splits,
                    stride_wn, stride_sn, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr):
    """out [M, N] = x W^T for x quantized (a [M_PAD, K] e4m3, a_scales [KB, M_PAD]), M <= ROWS: program (0, n block,
    split) multiplies its weight rows [BLOCK_N, 128] by a^T [128, ROWS] on the tensor cores, each K block's
    product times its weight rows' and the activation rows' factors."""
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split, m, c = tl.program_id(2), tl.arange(0, ROWS), tl.arange(0, 128)
    scale_row = tl.load(row_block + n, mask=n < N, other=0)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    KB = tl.cdiv(K, 128)
    for kb in range(split * KB_PER, tl.minimum((split + 1) * KB_PER, KB)):
        k = kb * 128 + c
        ws = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        xs = tl.load(a + m[:, None] * KB * 128 + k[None, :], mask=m[:, None] < M_PAD, other=0.0)  # [ROWS, 128]
        factors = tl.load(s + scale_row * stride_sn + kb, mask=n < N, other=0.0)[:, None] * \
            tl.load(a_scales + kb * M_PAD + m, mask=m < M_PAD, other=0.0)[None, :]
        acc += tl.dot(ws, tl.trans(xs)) * factors  # [BLOCK_N, ROWS]
    row = tl.sum(tl.where(m[None, :] == 0, acc, 0.0), axis=1)  # the one row timed here (M = 1)
    if SPLIT:
        fp8._add_splits(row, partials, arrived, out, n, n < N, n_splits, M * N)
    else:
        tl.store(out + n, row.to(out.dtype.element_ty), mask=n < N)


def swapped(x, weight, scale_inv, row_block, block_n, waves, num_warps, num_stages):
    """x [1, K] times W^T through _swapped_kernel (the one row this experiment times)."""
    M, K = x.shape
    assert M == 1, "the kernel keeps the product's first row only"
    N, KB = weight.shape[0], -(-K // fp8.BLOCK)
    a, a_scales = fp8._quantized(x, rows_multiple=16)
    n_blocks = triton.cdiv(N, block_n)
    kb_per, splits = fp8._splits(n_blocks, KB, waves, x.device)
    grid = (1, n_blocks, splits)
    out, partials, arrived = fp8._outputs(x, N, grid)
    _swapped_kernel[grid](weight, scale_inv, row_block, a, a_scales, out, partials, arrived, M, a.shape[0], N, K,
                          kb_per, splits, weight.stride(0), scale_inv.stride(0), BLOCK_N=block_n, ROWS=16,
                          SPLIT=splits > 1, num_warps=num_warps, num_stages=num_stages)
    return out


def main():
    dev = torch.device("cuda")
    bandwidth = bench.copy_bandwidth(dev)
    layers, inputs = {}, {}
    for name, (N, K) in SHAPES.items():
        layers[name] = [fp8.Fp8Linear.of(torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16))
                        for _ in range(max(2, -(-256 * 2**20 // (N * K))))]  # >= 256 MB of e4m3 weights in all
        inputs[name] = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    for (name, copies), launch in itertools.product(layers.items(), LAUNCHES):  # against the reference first
        q, x = copies[0], inputs[name]
        want = fp8.linear_ref(x.float(), q.weight, q.weight_scale_inv, q.row_block, quantized_x=True)
        got = swapped(x, q.weight, q.weight_scale_inv, q.row_block, **launch).float()
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < 1e-2, f"{name} {launch}: largest error {error:.2e} of the largest output (bf16's: ~4e-3)"
    print("every launch equals linear_ref(quantized_x=True) to bf16's rounding", flush=True)

    def total(fn) -> float:
        return sum(bench.graph_time_in_turn([lambda q=q: fn(inputs[name], q) for q in copies]) * 1e6 for name, copies in layers.items())
    weight_only = total(lambda x, q: fp8.fp8_linear(x, q.weight, q.weight_scale_inv, q.row_block, "weight_only"))
    results = sorted(((total(lambda x, q, launch=launch: swapped(x, q.weight, q.weight_scale_inv, q.row_block,
                                                                 **launch)), launch) for launch in LAUNCHES),
                     key=lambda r: r[0])
    floor = sum(N * K for N, K in SHAPES.values()) / bandwidth * 1e6
    print(f"one layer's four projections at 1 row: floor {floor:.1f} us, weight-only {weight_only:.1f} us; "
          "weights as M, best five: " + "; ".join(f"{us:.1f} us {launch}" for us, launch in results[:5]), flush=True)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(dict(bandwidth=bandwidth, floor_us=floor, weight_only_us=weight_only,
                           swapped=[dict(us=us, launch=launch) for us, launch in results]), f, indent=1)


if __name__ == "__main__":
    main()
