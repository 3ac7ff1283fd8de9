"""On a GPU (issue 28): how fast can e4m3 weights be turned into something to multiply by? The weight-only kernel
of fp8.py first gave no gain over bf16 at batch 1; this times five ways of reading one weight block on
Qwen3-8B's projections at 1, 16 and 64 rows (the two without a dot at one row only), each at its best launch,
against linear_ref (its largest error) and cuBLAS bf16, and fp8.py's own two kernels:

  convert-bf16  e4m3 -> bf16 through Triton's conversion, tensor-core dot (fp8.py's first kernel)
  convert-fp16  e4m3 -> fp16 (one instruction for two values), the activations in fp16, tensor-core dot
  bits-bf16     the e4m3 bits moved into a bf16's (sign, exponent, mantissa): the value times 2^-120, exact;
                2^120 goes into the block's factor; tensor-core dot
  gemv-convert  no dot: e4m3 -> fp32 through Triton's conversion, multiply-add in fp32 (one row only)
  gemv-bits     no dot: the e4m3 bits moved into an fp32's, times 2^-120 (one row only)

    python tests/gpu_fp8_dequant.py [--json OUT]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import fp8  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
HOWS = ["convert-bf16", "convert-fp16", "bits-bf16", "gemv-convert", "gemv-bits"]


@triton.jit
def _variant(x, w, s, out, M, N, K, KB_PER, KB, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HOW: tl.constexpr,
             SPLIT: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m, c = tl.arange(0, BLOCK_M), tl.arange(0, 128)
    if HOW >= 3:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(split * KB_PER, (split + 1) * KB_PER):
        k = kb * 128 + c
        b = tl.load(w + n[:, None] * K + k[None, :])  # [BLOCK_N, 128] uint8: the e4m3 bits
        factor = tl.load(s + (n // 128) * KB + kb)  # [BLOCK_N]
        if HOW == 0:
            xs = tl.load(x + m[:, None] * K + k[None, :], mask=m[:, None] < M, other=0.0)
            part = tl.dot(xs, tl.trans(b.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)))
            acc += part * factor[None, :]
        elif HOW == 1:
            xs = tl.load(x + m[:, None] * K + k[None, :], mask=m[:, None] < M, other=0.0).to(tl.float16)
            part = tl.dot(xs, tl.trans(b.to(tl.float8e4nv, bitcast=True).to(tl.float16)))
            acc += part * factor[None, :]
        elif HOW == 2:
            xs = tl.load(x + m[:, None] * K + k[None, :], mask=m[:, None] < M, other=0.0)
            h = b.to(tl.uint16)
            wv = (((h & 0x7F) << 4) | ((h & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
            part = tl.dot(xs, tl.trans(wv))
            acc += part * (factor * 1.329227995784916e36)[None, :]
        elif HOW == 3:
            xr = tl.load(x + k).to(tl.float32)
            acc += tl.sum(b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xr[None, :], 1) * factor
        else:
            xr = tl.load(x + k).to(tl.float32)
            u = b.to(tl.uint32)
            wv = (((u & 0x7F) << 20) | ((u & 0x80) << 24)).to(tl.float32, bitcast=True)
            acc += tl.sum(wv * xr[None, :], 1) * (factor * 1.329227995784916e36)
    if HOW >= 3:
        tl.store(out + split * N + n, acc)
    else:
        tl.store(out + split * M * N + m[:, None] * N + n[None, :], acc, mask=m[:, None] < M)


def run(how, x, weight, scale, block_n, splits, warps, stages):
    M, K = x.shape
    N, KB = weight.shape[0], K // 128
    out = torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
    _variant[(N // block_n, splits)](x, weight, scale, out, M, N, K, KB // splits, KB,
                                     BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                     HOW=HOWS.index(how), SPLIT=splits > 1, num_warps=warps, num_stages=stages)
    return out.sum(0).to(x.dtype) if splits > 1 else out[0].to(x.dtype)


def microseconds(calls) -> float:
    """GPU time of one call, the calls taken in turn (each reads another copy of the weights, together more than
    the 50 MB L2 holds, as a step's layers are)."""
    return bench.graph_time_in_turn(calls) * 1e6


dev = torch.device("cuda")
bandwidth = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
torch.manual_seed(0)
layers = {}
for name, (N, K) in SHAPES.items():
    copies = []
    for _ in range(max(2, -(-256 * 2**20 // (N * K)))):  # >= 256 MB of e4m3 weights in all
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        values, scale = fp8.quantize_blocks(w)
        copies.append((w, values.view(torch.uint8), scale, values))
    layers[name] = copies
results = []
for M in (1, 16, 64):
    for name, copies in layers.items():
        (w, bits, scale, values), (N, K) = copies[0], SHAPES[name]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        row_block = torch.arange(N, device=dev) // 128
        ref = fp8.linear_ref(x, values, scale, row_block).float()
        bf16_us = microseconds([lambda c=c: F.linear(x, c[0]) for c in copies])
        for kernel in ("weight_only", "tensor_cores"):  # fp8.py's Triton kernels as they are
            us = microseconds([lambda c=c: fp8.fp8_linear(x, c[3], c[2], row_block, kernel) for c in copies])
            print(f"rows={M} layer={name} fp8.py {kernel} us={us:.3g} bf16_us={bf16_us:.3g}", flush=True)
            results.append(dict(rows=M, layer=name, how=f"fp8.py {kernel}", us=us, bf16_us=bf16_us))
        floor_us = N * K / bandwidth * 1e6
        for how in HOWS:
            if how.startswith("gemv") and M > 1:
                continue
            best = None
            for block_n in (32, 64, 128):
                for splits in (1, 2, 4, 8):
                    if (K // 128) % splits or N // block_n * splits > 8 * 132:
                        continue
                    for warps, stages in ((4, 4), (8, 3)):
                        launch = (block_n, splits, warps, stages)
                        try:
                            us = microseconds([lambda c=c: run(how, x, c[1], c[2], *launch) for c in copies])
                        except Exception as e:  # a launch this GPU cannot run (shared memory): try the next
                            print(f"{how} {block_n} {splits} {warps} {stages}: {type(e).__name__}", flush=True)
                            continue
                        if best is None or us < best["us"]:
                            best = dict(us=us, block_n=block_n, splits=splits, warps=warps, stages=stages)
            if best is None:
                raise SystemExit(f"{how}: no launch of the grid ran on this GPU")
            err = (run(how, x, bits, scale, best["block_n"], best["splits"], best["warps"], best["stages"]).float()
                   - ref).abs().max().item() / ref.abs().max().item()
            row = dict(rows=M, layer=name, how=how, **best, of_floor=floor_us / best["us"], bf16_us=bf16_us,
                       speedup=bf16_us / best["us"], max_rel_err=err)
            results.append(row)
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
if sys.argv[1:2] == ["--json"]:
    with open(sys.argv[2], "w") as f:
        json.dump(dict(bandwidth=bandwidth, results=results), f, indent=1)
