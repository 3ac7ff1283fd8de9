"""Copies of kernel.py timed against each other on a GPU, the whole fused op (attention, finish kernel, the FP8 row
maximum) replayed as a CUDA graph: Qwen3-8B's heads (32 / 8, head_dim 128), 3,200 full slots, LongFlow, bf16
queries; an FP8 cache at 64, 256 and 507 rows, bf16 at 256. The first file is the baseline: each row says whether
its evicted slots are the baseline's and how far its output is. The GPU machine has no git, so copy the revisions
first (git show REV:kernel.py > variants/before.py). docs/performance.md, "The FP8 kernel's selection, taken apart".

    python tests/gpu_variants.py kernel.py variants/before.py ... [--json OUT]
    ncu --clock-control none -k regex:_attend_kernel python tests/gpu_variants.py FILES --once   # one call each
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import graph_time  # noqa: E402

SHAPES = [(64, True), (256, True), (507, True), (256, False)]  # (rows, FP8 cache)


def load(path: str, i: int):
    """kernel.py at `path` as its own module, its torch op under a name of its own."""
    source = open(path).read().replace("tinyflow::", f"variant{i}::").replace("ops.tinyflow.", f"ops.variant{i}.")
    copy = os.path.join(tempfile.mkdtemp(), f"kernel_variant{i}.py")  # Triton reads a kernel's source from its file
    with open(copy, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"kernel_variant{i}", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(B: int, fp8: bool, quantize):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, 8, 3200, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pos = torch.arange(3200, device="cuda", dtype=torch.int32).expand(B, 8, 3200).contiguous()
    vnorm = v.float().abs().sum(-1)  # ||v||_1, as the cache keeps it
    if not fp8:
        return q, k, v, pos, vnorm, None, None
    (k8, k_scale), (v8, v_scale) = quantize(k), quantize(v)
    return q, k8, v8, pos, vnorm, k_scale, v_scale


def op(module, x):
    q, k, v, pos, vnorm, k_scale, v_scale = x
    return module.decode_attention(q, k, v, pos, vnorm=vnorm, k_scale=k_scale, v_scale=v_scale)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="copies of kernel.py, the first the baseline")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--once", action="store_true", help="call each op once at 256 rows, FP8 (for ncu)")
    args = p.parse_args()
    modules = [load(path, i) for i, path in enumerate(args.files)]
    rows = []
    for B, fp8 in [(256, True)] if args.once else SHAPES:
        x = inputs(B, fp8, modules[0].quantize)
        base = op(modules[0], x)
        for path, module in zip(args.files, modules):
            if args.once:
                op(module, x)
                continue
            out, evict = op(module, x)
            rows.append(dict(file=path, rows=B, cache="fp8" if fp8 else "bf16",
                             us=round(graph_time(lambda: op(module, x)) * 1e6, 1),
                             same_slots=bool(torch.equal(evict, base[1])),
                             out_max_diff=(out.float() - base[0].float()).abs().max().item()))
            print(json.dumps(rows[-1]), flush=True)
        del x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
