"""Speed and memory of tinyflow on a GPU, each figure set against the memory-bandwidth floor.

    python bench.py kernel --batch 1 8 64 256           # fused attention + LongFlow selection vs SDPA
    python bench.py step --shape Qwen3-8B --batch 1      # one decode step (--profile: its kernels)
    python bench.py throughput --shape Qwen3-8B          # 16k outputs at the largest batch that fits,
                                                         # longflow and full (--validate N: check it)
    python bench.py throughput --batch 16 64 128 --budget 1024 2048 3200 --plot sweep.png   # a sweep
    python bench.py generate --shape Qwen3-0.6B          # end to end through the engine
    python bench.py long-prompt --shape R1-Distill-Llama-8B --prompt-len 131072 --new-tokens 256
    python bench.py hf --shape Qwen3-8B --batch 1 32     # transformers full-KV generate, the baseline

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
from torch._dynamo.utils import counters

import kernel
from cache import KVCache, unit_key_sum
from eval import ProgressBar  # the live bar of eval.py (tqdm, when installed)
from generate import Engine, Sampler, State, Stepper, batch_that_fits, pick_device, sync_time
from model import Config, empty_model, load

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
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # runs on a CPU in seconds
}


def copy_bandwidth(device) -> float:
    """Bytes per second of a large copy in device memory (4 GiB on a GPU; read + write counted)."""
    x = torch.randn(2**30 if device.type == "cuda" else 2**25, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(11):
        t = sync_time(device)
        y.copy_(x)
        times.append(sync_time(device) - t)
    return 2 * x.numel() * x.element_size() / sorted(times[1:])[5]


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


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
def bench_kernel(args, bw, _):
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
        sets = [(*s, kernel.l1_norm(s[2])) for s in sets]  # + ||v||_1 per slot, as the cache keeps it
        vnorm_bytes = B * Hkv * S * 4
        variants = {  # name: (call, bytes read beyond K, V and positions)
            "longflow": (lambda q, k, v, p, n: kernel.decode_attention(q, k, v, p, vnorm=n), vnorm_bytes),
            "longflow-head": (lambda q, k, v, p, n: kernel.decode_attention(q, k, v, p, per_head=True, vnorm=n),
                              vnorm_bytes),
            "tova (no value norm)": (lambda q, k, v, p, n: kernel.decode_attention(q, k, v, p, value_norm=False), 0),
            "no selection": (lambda q, k, v, p, n: kernel.decode_attention(q, k, v, p, select=False), 0),
            "torch SDPA": (lambda q, k, v, p, n: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True),
                           0),
        }
        for name, (fn, extra_bytes) in variants.items():
            it = iter(range(10**9))
            t = graph_time(lambda: fn(*sets[next(it) % n_sets]), reps=max(n_sets, 20))
            rows.append(dict(workload="kernel", variant=name, batch=B, slots=S, us=t * 1e6,
                             bandwidth_fraction=(kv_bytes + extra_bytes) / t / bw))
        base = next(r["us"] for r in rows if r["batch"] == B and r["variant"] == "no selection")
        for r in rows:
            if r["batch"] == B:
                r["vs_no_selection"] = r["us"] / base - 1
                progress(r)
    return rows


# ---- the decode step at a given cache fill --------------------------------------------------------------
def random_model(cfg: Config, device, dtype, seed: int = 0):
    """Random weights of a real shape, for benchmarks where no checkpoint can be downloaded."""
    model = empty_model(cfg, device, dtype)
    gen = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02, generator=gen)
    return model


def make_model(args):
    if args.model:
        return load(args.model, args.device, args.dtype)[0]
    return random_model(Config.from_dict(SHAPES[args.shape]), args.device, args.dtype)


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: all of them, but of an untied input embedding only B rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_embeddings:
        total -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total


class StepTimer:
    """The engine's own compiled, graph-captured decode step for one (policy, batch, slots); times its
    replays with the cache filled to any length. Only data changes between fills, so one capture serves."""

    def __init__(self, model, policy: str, batch: int, slots: int, compile: bool):
        self.model, self.policy, self.batch, self.slots = model, policy, batch, slots
        self.device, self.dtype = model.inv_freq.device, model.model.norm.weight.dtype
        self.cache = KVCache(model.cfg, batch, slots, self.device, self.dtype, policy)
        self.state = State.empty(batch, self.device)
        t = time.perf_counter()
        sampler = Sampler.empty(batch, model.cfg.vocab_size, self.device)  # greedy rows, as the step runs any
        self.stepper = Stepper(model, self.cache, self.state, sampler, compile)
        self.compile_s = time.perf_counter() - t

    def seconds_per_step(self, filled: int, steps: int = 20) -> float:
        fill_cache(self.cache, filled)
        self.state.positions.fill_(filled)
        for _ in range(3):
            self.stepper()
        t = sync_time(self.device)
        for _ in range(steps):
            self.stepper()
        return (sync_time(self.device) - t) / steps

    def profile(self, path=None, steps: int = 3):
        """The kernels of a few compiled steps (run outside the graph), slowest first."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.stepper.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
        print(table)
        if path:
            prof.export_chrome_trace(path)

    def kv_bytes_read(self, filled: int) -> int:
        """LongFlow reads every slot; the full cache reads the slots filled so far."""
        read = self.slots if self.policy != "full" else filled
        return KVCache.bytes_needed(self.model.cfg, self.batch, read, self.dtype, self.cache.policy)

    def free(self):
        self.stepper = self.cache = self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def fill_cache(cache: KVCache, filled: int):
    """Random K/V in the first `filled` slots of every layer and sequence, positions 0..filled-1."""
    for layer in cache.layers:
        layer.k.normal_()
        layer.v.normal_()
        if cache.policy.keeps_vnorm:
            layer.vnorm.copy_(kernel.l1_norm(layer.v))
        if cache.policy.keeps_queries:
            layer.queries.normal_()
        if cache.policy.keeps_key_norm:
            layer.score.copy_(layer.k.float().norm(dim=-1))
        layer.pos.fill_(-1)
        layer.pos[..., :filled] = torch.arange(filled, dtype=torch.int32, device=layer.pos.device)
        if cache.policy.keeps_key_sum:
            layer.key_sum.copy_(unit_key_sum(layer.k, layer.pos))
        layer.next_slot.fill_(min(filled, cache.slots - 1))


def step_row(timer: StepTimer, filled: int, bw: float, **extra) -> dict:
    t = timer.seconds_per_step(filled)
    floor = (weight_bytes(timer.model) + timer.kv_bytes_read(filled)) / bw
    return dict(policy=timer.policy, batch=timer.batch, slots=timer.slots, kv_tokens=filled, ms_per_step=t * 1e3,
                tokens_per_s=timer.batch / t, floor_fraction=floor / t, compile_s=timer.compile_s,
                peak_gib=peak_gib(timer.device), **extra)


def slots_for(policy: str, args) -> int:
    return args.budget if policy != "full" else args.prompt_len + args.new_tokens


def bench_step(args, bw, model):
    """Steady state: every slot of a LongFlow cache filled; a full cache holding --context tokens."""
    rows = []
    for policy in args.policy:
        for B in args.batch:
            slots = args.budget if policy != "full" else args.context + 64
            timer = StepTimer(model, policy, B, slots, args.compile)
            rows.append(step_row(timer, args.budget if policy != "full" else args.context, bw, workload="step"))
            progress(rows[-1])
            if args.profile:
                timer.profile()
            timer.free()
    return rows


def bench_throughput(args, bw, model):
    """Tokens/s over a whole run of --new-tokens outputs at the largest batch that fits (or --batch).
    The step time is measured at 5 cache fills across the run and integrated over its length (a
    LongFlow step costs the same at every fill: it always reads its `budget` slots)."""
    rows = []
    for policy in args.policy:
        slots = slots_for(policy, args)
        fits = None
        if args.device.type == "cuda":
            fits = batch_that_fits(model.cfg, slots, args.prompt_len, torch.cuda.mem_get_info()[0], args.dtype)
        for B in args.batch or [fits]:
            timer = StepTimer(model, policy, B, slots, args.compile)
            if policy == "full":
                span = max(args.new_tokens - 64, 0)  # room for the timed steps after the last fill
                fills = [args.prompt_len + round(f * span) for f in (0, .25, .5, .75, 1)]
            else:
                fills = [args.budget]
            steps = [step_row(timer, f, bw) for f in fills]
            ms = run_mean([r["ms_per_step"] for r in steps])
            floor_ms = run_mean([r["ms_per_step"] * r["floor_fraction"] for r in steps])
            rows.append(dict(workload="throughput", policy=policy, batch=B, slots=slots, fits=fits,
                             new_tokens=args.new_tokens, ms_per_step=ms, tokens_per_s=B / ms * 1e3,
                             floor_fraction=floor_ms / ms, peak_gib=steps[-1]["peak_gib"],
                             compile_s=timer.compile_s))
            if args.validate:
                rows[-1].update(validate(args, model, timer, policy, B))
            progress(rows[-1])
            timer.free()
    by = {r["policy"]: r["tokens_per_s"] for r in rows}
    if "longflow" in by and "full" in by:
        print(f"longflow / full throughput: {by['longflow'] / by['full']:.2f}x")
    return rows


def validate(args, model, timer: StepTimer, policy: str, B: int) -> dict:
    """Check the method once against reality: a real run of --validate new tokens through the engine
    (prefill, graph replays, host syncs) against the step time predicted for the same fills. The run
    must not compile anything again, and its memory must stay the same from its first token to its last."""
    n = args.validate
    fills = [args.prompt_len, args.prompt_len + n] if policy == "full" else [args.budget]
    predicted = run_mean([timer.seconds_per_step(f) for f in fills])
    timer.free()  # the engine allocates its own cache of the same size
    prompts = torch.randint(0, model.cfg.vocab_size, (B, args.prompt_len)).tolist()
    engine = Engine(model, compile=args.compile)
    seen = []  # (GPU memory, graphs compiled so far) at every host sync of the run, from the first token on
    memory = lambda: torch.cuda.memory_allocated() if args.device.type == "cuda" else 0
    with TokenBar(n, f"validate {policy}, batch {B}") as bar:
        def record(out):
            seen.append((memory(), counters["stats"]["unique_graphs"]))
            bar(out)
        _, st = engine.generate(prompts, n, [], args.budget if policy != "full" else None, policy, seed=0,
                                batch_size=B, on_tokens=record)
    assert len(set(seen)) == 1, f"memory grew or something compiled while decoding: {seen}"
    steps = -(-(n - 1) // engine.sync_every) * engine.sync_every  # the engine steps in whole sync chunks
    return dict(validate_tokens=n, predicted_ms_per_step=predicted * 1e3, real_ms_per_step=st.decode_s / steps * 1e3)


class TokenBar(ProgressBar):
    """A live bar over the new tokens of a run, fed by the engine's on_tokens (the first prompt's output)."""

    def __init__(self, total: int, name: str):
        super().__init__(total, name, unit="tok")
        self.done = 0

    def __call__(self, out: list[int]):
        self.update(len(out) - self.done)
        self.done = len(out)


def run_mean(values: list[float]) -> float:
    """The mean over a run of values measured at equally spaced points of it (trapezoid rule)."""
    if len(values) == 1:
        return values[0]
    return (sum(values) - (values[0] + values[-1]) / 2) / (len(values) - 1)


# ---- end to end -----------------------------------------------------------------------------------------
def bench_generate(args, bw, model):
    """Whole runs through the engine (prefill, compiled graph-replayed step, host syncs), for checking
    the step timings above against reality."""
    rows = []
    engine = Engine(model, compile=args.compile)
    for policy in args.policy:
        for B in args.batch or [1]:
            prompts = torch.randint(0, model.cfg.vocab_size, (B, args.prompt_len)).tolist()
            budget = args.budget if policy != "full" else None
            with TokenBar(args.new_tokens, f"{policy}, batch {B}") as bar:
                outs, st = engine.generate(prompts, args.new_tokens, [], budget, policy, seed=0, on_tokens=bar)
            assert all(len(o) == args.new_tokens for o in outs)
            rows.append(dict(workload="generate", policy=policy, batch=B, new_tokens=args.new_tokens,
                             compile_s=st.setup_s, prefill_s=st.prefill_s,
                             tokens_per_s=B * (args.new_tokens - 1) / st.decode_s,
                             ms_per_step=st.decode_s / (args.new_tokens - 1) * 1e3, peak_gib=peak_gib(args.device)))
            progress(rows[-1])
    return rows


def bench_long_prompt(args, bw, model):
    """The KVPress case: one --prompt-len prompt (default 128k) compressed at prefill to half its length
    and to --budget, against the full cache; peak memory and decode speed."""
    rows = []
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len)).tolist()
    engine = Engine(model, compile=args.compile)
    for name, budget in [("full", None), ("50%", args.prompt_len // 2), (f"budget {args.budget}", args.budget)]:
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, st = engine.generate(prompt, args.new_tokens, [], budget, "longflow" if budget else "full", seed=0)
        rows.append(dict(workload="long-prompt", cache=name, prompt_tokens=args.prompt_len, slots=st.slots,
                         prefill_s=st.prefill_s, decode_tokens_per_s=(args.new_tokens - 1) / st.decode_s,
                         peak_gib=peak_gib(args.device)))
        progress(rows[-1])
        engine = Engine(model, compile=args.compile)  # drop the previous cache before the next size
    return rows


def bench_hf(args, bw, _):
    """Hugging Face transformers full-KV generate on the same shape (random weights, sdpa): the step time
    from two runs of different lengths, so prefill and setup cancel out."""
    import transformers
    cfg = transformers.AutoConfig.for_model(**SHAPES[args.shape])
    with args.device:
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=args.dtype, attn_implementation="sdpa")
    rows = []
    for B in args.batch or [1]:
        ids = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device=args.device)

        def run(n):  # seconds for n new tokens, EOS or not
            t = sync_time(args.device)
            hf.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            return sync_time(args.device) - t
        run(2)
        n = args.new_tokens
        step = (run(n) - run(n // 4)) / (n - n // 4)
        rows.append(dict(workload="hf", policy="transformers full", batch=B, prompt_len=args.prompt_len,
                         ms_per_step=step * 1e3, tokens_per_s=B / step, peak_gib=peak_gib(args.device)))
        progress(rows[-1])
    return rows


def progress(row: dict):
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def plot(rows, path):
    """Throughput against batch size, one line per policy and budget (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    label = lambda r: r["policy"] if r["policy"] == "full" else f"{r['policy']} {r['slots']}"
    for name in sorted({label(r) for r in rows}):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if label(r) == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xlabel="batch size", ylabel="tokens/s", xscale="log", title="decode throughput")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


WORKLOADS = {"kernel": bench_kernel, "step": bench_step, "throughput": bench_throughput,
             "generate": bench_generate, "long-prompt": bench_long_prompt, "hf": bench_hf}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--shape", default="Qwen3-8B", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="a real checkpoint instead of random weights")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 and 64, or the largest that fits")
    p.add_argument("--budget", type=int, nargs="+", default=[3200], help="several: the workload runs for each")
    p.add_argument("--slots", type=int, default=3200, help="kernel: slots per sequence")
    p.add_argument("--context", type=int, default=16384, help="step, full policy: tokens in the cache")
    p.add_argument("--policy", nargs="+", default=["longflow", "full"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16384)
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--profile", action="store_true", help="step: print the step's slowest kernels")
    p.add_argument("--validate", type=int, default=0,
                   help="throughput: also run this many new tokens end to end and compare with the prediction")
    p.add_argument("--json", default=None, help="write the raw rows here")
    p.add_argument("--plot", default=None, help="a PNG of throughput against batch size")
    args = p.parse_args()
    args.device, args.dtype = pick_device(args.device, None)
    if args.device.type != "cuda" and args.workload == "kernel":
        raise SystemExit("error: the kernel workload times CUDA kernels and needs a GPU")
    if len(args.budget) > 1 and args.workload not in ("step", "throughput", "generate"):
        raise SystemExit(f"error: the {args.workload} workload takes one --budget; several are for step, "
                         "throughput and generate")
    if args.batch is None and (args.workload in ("kernel", "step") or args.device.type != "cuda"):
        args.batch = [1, 64] if args.device.type == "cuda" else [1, 2]
    bw = copy_bandwidth(args.device)
    print(f"{torch.cuda.get_device_name() if args.device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"{'random weights of ' + args.shape + ' shape' if not args.model else args.model}", flush=True)
    model = make_model(args) if args.workload not in ("kernel", "hf") else None
    rows, budgets, policies = [], args.budget, args.policy
    for i, args.budget in enumerate(budgets):  # a sweep over budgets: the full cache needs no second run
        args.policy = policies if i == 0 else [p for p in policies if p != "full"]
        rows += WORKLOADS[args.workload](args, bw, model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bw, device=str(args.device), torch=torch.__version__,
                           args={k: str(v) for k, v in vars(args).items()}, rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
