"""Speed and memory of tinyflow on a GPU, each figure set against the memory-bandwidth floor.

    python bench.py kernel                                   # fused attention + LongFlow selection
    python bench.py step --shape Qwen3-8B --batch 1 64 --budget 3200 --policy longflow full
    python bench.py generate --shape Qwen3-0.6B --batch 1    # end to end through the engine

Decode is memory-bound: a step must read every weight once and every cached K/V once, so
floor = (weight bytes + KV bytes) / copy bandwidth, with the bandwidth measured here by a large
device-to-device copy. With --shape the weights are random (bf16) of that model's real shape: speed does
not depend on the values, and no checkpoint can be downloaded on the benchmark machine.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import kernel
from cache import KVCache
from generate import Engine, Sampling, State, Stepper
from model import Config, load, random_model

SHAPES = {
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1e6),
    "Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1e6),
    "R1-Distill-Llama-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, rope_theta=5e5, rope_scaling={
                                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "R1-Distill-Qwen-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                               intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, rope_theta=1e4),
}


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write counted), median of 10."""
    x = torch.randn(2**30, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * x.element_size() / sorted(times[1:])[5]


def graph_time(fn, reps: int = 20, rounds: int = 15) -> float:
    """Median seconds per call of `fn`, `reps` calls captured in one CUDA graph (no launch gaps)."""
    fn()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


# ---- the fused kernel --------------------------------------------------------------------------------
def bench_kernel(args, bw):
    """Attention over S full slots, Qwen3-8B heads: Triton with / without selection, against SDPA. Several
    input sets rotate so that small batches are not served from the 60 MB L2 cache."""
    Hq, Hkv, D, S = 32, 8, 128, args.slots
    rows = []
    for B in args.batch:
        kv_bytes = 2 * B * Hkv * S * D * 2 + B * Hkv * S * 4  # K, V (bf16) and positions, read once
        n_sets = max(1, math.ceil(1e9 / kv_bytes))
        sets = [(torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16),
                 torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16),
                 torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16),
                 torch.arange(S, device="cuda", dtype=torch.int32).expand(B, Hkv, S).contiguous())
                for _ in range(n_sets)]
        variants = {
            "longflow": lambda q, k, v, p: kernel.decode_attention(q, k, v, p),
            "longflow-head": lambda q, k, v, p: kernel.decode_attention(q, k, v, p, per_head=True),
            "no selection": lambda q, k, v, p: kernel.decode_attention(q, k, v, p, select=False),
            "torch SDPA": lambda q, k, v, p: F.scaled_dot_product_attention(
                q[:, :, None], k, v, enable_gqa=True),
        }
        for name, fn in variants.items():
            it = iter(range(10**9))
            t = graph_time(lambda: fn(*sets[next(it) % n_sets]), reps=max(n_sets, 20))
            rows.append(dict(workload="kernel", variant=name, batch=B, slots=S, us=t * 1e6,
                             bandwidth_fraction=kv_bytes / t / bw))
        base = next(r["us"] for r in rows if r["batch"] == B and r["variant"] == "no selection")
        for r in rows:
            if r["batch"] == B:
                r["vs_no_selection"] = r["us"] / base - 1
    return rows


# ---- one decode step at steady state -------------------------------------------------------------------
def make_model(args):
    if args.model:
        return load(args.model, torch.device("cuda"), torch.bfloat16)[0]
    return random_model(Config.from_dict(SHAPES[args.shape]), torch.device("cuda"), torch.bfloat16)


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: all of them, but of an untied input embedding only B rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_embeddings:
        total -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total


def bench_step(args, bw, model):
    """Time graph replays of the decode step with every slot filled (the steady state of a long run)."""
    cfg, rows = model.cfg, []
    steps = 50
    for policy in args.policy:
        for B in args.batch:
            slots = args.budget if policy != "full" else args.context + steps + 2
            cache = KVCache(cfg, B, slots, "cuda", torch.bfloat16, policy)
            z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device="cuda")
            state = State(z(B), z(B), z(B), z(B, 4 * steps + 8), z(1))
            stepper = Stepper(model, cache, state, Sampling(), compile=True)
            filled = args.budget if policy != "full" else args.context  # slots holding a token
            fill_cache(cache, filled)
            state.positions.fill_(filled)
            for _ in range(3):
                stepper()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                stepper()
            torch.cuda.synchronize()
            t = (time.perf_counter() - start) / steps
            kv = KVCache.bytes_needed(cfg, B, filled, torch.bfloat16)
            floor = (weight_bytes(model) + kv) / bw
            rows.append(dict(workload="step", shape=args.shape or args.model, policy=policy, batch=B,
                             kv_tokens=filled, ms=t * 1e3, tokens_per_s=B / t, floor_fraction=floor / t,
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            del stepper, cache, state
            torch.cuda.empty_cache()
    return rows


def fill_cache(cache: KVCache, filled: int):
    """Random K/V in the first `filled` slots of every layer and sequence, positions 0..filled-1."""
    cache.k.normal_()
    cache.v.normal_()
    cache.pos.fill_(-1)
    cache.pos[..., :filled] = torch.arange(filled, dtype=torch.int32, device=cache.pos.device)
    cache.next_slot.fill_(min(filled, cache.slots - 1))


# ---- end to end -----------------------------------------------------------------------------------------
def bench_generate(args, bw, model):
    rows = []
    engine = Engine(model, compile=True)
    for B in args.batch:
        prompts = torch.randint(0, model.cfg.vocab_size, (B, args.prompt_len)).tolist()
        budget = args.budget if args.policy[0] != "full" else None
        outs, st = engine.generate(prompts, args.new_tokens, [], budget, args.policy[0], seed=0)
        rows.append(dict(workload="generate", shape=args.shape or args.model, policy=args.policy[0],
                         batch=B, new_tokens=args.new_tokens, compile_s=st.setup_s, prefill_s=st.prefill_s,
                         decode_tokens_per_s=B * (args.new_tokens - 1) / st.decode_s,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=["kernel", "step", "generate"])
    p.add_argument("--shape", default="Qwen3-8B", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="a real checkpoint instead of random weights")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--budget", type=int, default=3200)
    p.add_argument("--slots", type=int, default=3200, help="kernel: slots per sequence")
    p.add_argument("--context", type=int, default=16384, help="step, full policy: tokens in the cache")
    p.add_argument("--policy", nargs="+", default=["longflow"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json", default=None, help="write the raw rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench.py measures GPU speed and needs CUDA")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.workload == "kernel":
        rows = bench_kernel(args, bw)
    else:
        model = make_model(args)
        rows = (bench_step if args.workload == "step" else bench_generate)(args, bw, model)
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bw, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
