"""The fused kernel's launch at few rows, swept on a GPU (issue 44: attention and its finish kernel took 12 us a
layer at batch 1 for 13 MB of K and V). For each batch: how many splits of the slots (the SMs' waves the grid aims
for, kernel._split_count), the attention kernel's warps and stages, the finish kernel's chunk of slots
(kernel._chunk_size); LongFlow over Qwen3-8B's heads (32 / 8, head_dim 128), 3,200 full slots, bf16, graph-replayed
in turn over input sets larger than the L2 cache. Each row: microseconds, the fraction of the bytes floor (K, V,
positions, ||v||_1), and whether its evicted slot and output are the shipped launch's.

    python tests/gpu_attention_sweep.py [--batch 1 4 16] [--json OUT]
"""
import argparse
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernel  # noqa: E402
from bench import copy_bandwidth, graph_time_in_turn  # noqa: E402

SHIPPED = dict(waves=2, warps=kernel.ATTEND_LAUNCH[True]["num_warps"], stages=kernel.ATTEND_LAUNCH[True]["num_stages"],
               chunk=None)


def launch(waves: int, warps: int, stages: int, chunk: int | None):
    """kernel.py's launch choices replaced by these (chunk None: _chunk_size's own)."""
    sm = kernel._sm_count(torch.device("cuda"))
    kernel._split_count = lambda n_programs, n_blocks, device: max(1, min(n_blocks, -(-waves * sm // n_programs)))
    kernel.ATTEND_LAUNCH[True] = dict(num_warps=warps, num_stages=stages)
    if chunk is not None:
        kernel._chunk_size = lambda B, S, device: chunk


def sets(B: int, S: int = 3200):
    kv_bytes = 2 * B * 8 * S * 128 * 2 + B * 8 * S * 8  # K, V bf16; positions int32, ||v||_1 fp32
    made = []
    for _ in range(max(1, math.ceil(1e9 / kv_bytes))):
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, 8, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pos = torch.arange(S, device="cuda", dtype=torch.int32).expand(B, 8, S).contiguous()
        made.append((q, k, v, pos, kernel.l1_norm(v)))
    return made, kv_bytes


def against(baseline, out, slot) -> tuple[dict, tuple]:
    """Whether a launch's output and evicted slot are the first launch's (the baseline, None before it): the
    comparison, and the baseline."""
    baseline = baseline or (out.float(), slot)
    return dict(same_slot=bool(torch.equal(slot, baseline[1])),
                out_diff=(out.float() - baseline[0]).abs().max().item()), baseline


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    default_chunk = kernel._chunk_size
    rows = []
    for B in args.batch:
        inputs, kv_bytes = sets(B)
        call = lambda s: kernel.decode_attention(s[0], s[1], s[2], s[3], vnorm=s[4])
        grid = [dict(waves=w, warps=n, stages=st, chunk=c) for w, n, st, c in
                itertools.product([1, 2, 4, 8], [2, 4], [2, 3], [None, 32, 64, 128])]
        baseline = None
        for cfg in [SHIPPED] + grid:
            launch(**cfg)
            if cfg["chunk"] is None:
                kernel._chunk_size = default_chunk
            agreement, baseline = against(baseline, *call(inputs[0]))
            t = graph_time_in_turn([lambda s=s: call(s) for s in inputs])
            rows.append(dict(batch=B, **cfg, us=t * 1e6, floor=kv_bytes / t / bandwidth, **agreement))
            print(json.dumps(rows[-1]), flush=True)
        best = min((r for r in rows if r["batch"] == B), key=lambda r: r["us"])
        print(f"batch {B}: shipped {rows[-len(grid) - 1]['us']:.1f} us, best {best['us']:.1f} us: {best}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
