"""The fused kernel scoring by a given query (TriAttention), its launch swept on a GPU (issue 42: at batch 64 the
kernel took 1.25x LongFlow's on an H100, the step 1.16x). For each batch: the attention kernel's warps and stages
(kernel.GIVEN_ATTEND_LAUNCH) and the slots the finish kernel's programs read a round (kernel.GIVEN_CHUNK); Qwen3-8B's
heads (32 / 8, head_dim 128), 3,200 full slots, bf16, a window of 200, graph-replayed in turn over input sets larger
than the L2 cache, LongFlow's shipped launch first for comparison. Each row: microseconds, the fraction of the bytes
floor (K, V, positions and ||v||_1, as gpu_attention_sweep counts them), and whether its evicted slot and output are
the shipped launch's. The JSON is written after each batch. With --step B.., then `bench.py step` of LongFlow and
TriAttention after that batch's sweep, TriAttention's kernel launched as its fastest row (JSON beside).

    python tests/gpu_given_sweep.py [--batch 1 64 256] [--json OUT] [--step 64]
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernel  # noqa: E402
import bench  # noqa: E402
from bench import copy_bandwidth, graph_time_in_turn  # noqa: E402
from gpu_attention_sweep import against, sets  # noqa: E402

GIVEN = kernel.Scoring(query="given")
SHIPPED = dict(warps=kernel.GIVEN_ATTEND_LAUNCH["num_warps"], stages=kernel.GIVEN_ATTEND_LAUNCH["num_stages"],
               chunk=kernel.GIVEN_CHUNK)


def timed(B: int, inputs, kv_bytes: int, bandwidth: float, call, **row) -> dict:
    t = graph_time_in_turn([lambda s=s: call(s) for s in inputs])
    return dict(batch=B, **row, us=t * 1e6, floor=kv_bytes / t / bandwidth)


def step_with(best: dict, json_path: str):
    """bench.py step, LongFlow then TriAttention, at best's batch with best's launch of the given-query kernel."""
    kernel.GIVEN_ATTEND_LAUNCH.update(num_warps=best["warps"], num_stages=best["stages"])
    kernel.GIVEN_CHUNK = best["chunk"]
    sys.argv = ["bench.py", "step", "--shape", "Qwen3-8B", "--batch", str(best["batch"]), "--policy", "longflow",
                "triattention", "--json", json_path]
    print(f"step with {best}", flush=True)
    bench.main()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--json", default=None)
    p.add_argument("--step", type=int, nargs="*", default=[], help="the step of both rules at these batches (of "
                   "--batch), each after its sweep, with its fastest launch")
    args = p.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for B in args.batch:
        inputs, kv_bytes = sets(B)
        given_query = torch.randn(B, 32, 128, device="cuda")
        pair_weight = torch.rand(32, 64, device="cuda")
        call = lambda s: kernel.decode_attention(s[0], s[1], s[2], s[3], per_head=True, window=200, scoring=GIVEN,
                                                 given_query=given_query, pair_weight=pair_weight)
        longflow = lambda s: kernel.decode_attention(s[0], s[1], s[2], s[3], vnorm=s[4])
        rows.append(timed(B, inputs, kv_bytes, bandwidth, longflow, rule="longflow"))
        print(json.dumps(rows[-1]), flush=True)
        baseline = None
        grid = [c for c in itertools.product([2, 4, 8], [2, 3], [256, 1024, 4096]) if c != tuple(SHIPPED.values())]
        for warps, stages, chunk in [tuple(SHIPPED.values())] + grid:
            kernel.GIVEN_ATTEND_LAUNCH.update(num_warps=warps, num_stages=stages)
            kernel.GIVEN_CHUNK = chunk
            agreement, baseline = against(baseline, *call(inputs[0]))
            rows.append(timed(B, inputs, kv_bytes, bandwidth, call, rule="triattention", warps=warps, stages=stages,
                              chunk=chunk, **agreement))
            print(json.dumps(rows[-1]), flush=True)
        best = min((r for r in rows if r["batch"] == B and r["rule"] == "triattention"), key=lambda r: r["us"])
        print(f"batch {B}: best {best}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), bandwidth=bandwidth, rows=rows), f, indent=1)
        if B in args.step:
            step_with(best, (args.json or "given").replace(".json", "") + f"_step_{B}.json")


if __name__ == "__main__":
    main()
