"""Speed and memory of tinyflow on a GPU, each figure set against its floor (bandwidth and matmul rate).

    python bench.py kernel --batch 1 8 64 256           # fused attention + LongFlow selection vs SDPA
    python bench.py step --shape Qwen3-8B --batch 1      # one decode step (--profile: its kernels)
    python bench.py throughput --shape Qwen3-8B          # 16k outputs at the largest batch that fits,
                                                         # longflow and full (--validate N: check it)
    python bench.py throughput --batch 16 64 128 --budget 1024 2048 3200 --plot sweep.png   # a sweep
    python bench.py generate --shape Qwen3-0.6B          # end to end through the engine
    python bench.py long-prompt --shape R1-Distill-Llama-8B --prompt-len 131072 --new-tokens 256
    python bench.py hf --shape Qwen3-8B --batch 1 32     # transformers full-KV generate, the baseline
    python bench.py serve --url http://127.0.0.1:8000 --requests 1000 --rate 20   # a running server.py
    python bench.py checkpoint --shape Qwen3-8B --out /dev/shm/q8   # random weights as a folder server.py loads

A decode step must read every weight once and every cached K/V once, and multiply each weight by every
token of the batch: its floor is a roofline, for each part (weights, attention) the larger of bytes / copy
bandwidth and FLOPs / matmul rate, both measured at the start of the run (a large device-to-device copy, a
large matrix product). Small batches are memory-bound; at a few hundred sequences the projections become
compute-bound, and each row's `compute_bound` says which parts are. With --shape the weights are random (bf16) of that model's real shape: speed does
not depend on the values, and no checkpoint can be downloaded on the benchmark machine.

Bad or unused options are refused in one line before anything runs. --json writes strict JSON (null for a
figure that does not exist, such as peak memory on a CPU), also of a run stopped by Ctrl-C: the rows measured
until then, with "complete": false.
"""
import argparse
import asyncio
import importlib.util
import itertools
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line, no traceback (main() restores Ctrl-C)
    signal.signal(signal.SIGINT, lambda *_: os._exit(print("interrupted", file=sys.stderr) or 130))

import torch
import torch.nn.functional as F

import calibration
import fp8
import kernel
from cache import KV_DTYPES, KVCache, Layer
from policies import POLICIES, KernelPolicy, RecentQueries, TriAttention, resolve_policy
from eval import ProgressBar, interrupted  # the live bar of eval.py (tqdm, when installed); Ctrl-C's one line
from generate import Engine, pick_device, sync_time
from memory import PREFILL_TOKENS, batch_that_fits, device_free_bytes, pick_batch
from sampling import Sampler, Sampling
from step import State, Stepper
from cli import Parser, add_weights_option, non_negative_int, positive_int, run_as_command, run_command
import parallel
from model import Config, checkpoint_params, empty_model, load, plural
from parallel import SINGLE, Group

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


def matmul_rate(device, dtype) -> float:
    """FLOP/s of a large matrix product in the model's dtype (8192^3 on a GPU), or with dtype fp8.FP8 of e4m3
    matrices on the FP8 tensor cores (cuBLAS, through torch._scaled_mm): the compute side of the roofline,
    measured in the same run as the bandwidth."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16 if dtype == fp8.FP8 else dtype) for _ in range(2))
    product = lambda: a @ b
    if dtype == fp8.FP8:
        one = torch.ones((), device=device)
        a, b = a.to(dtype), b.to(dtype).T  # _scaled_mm takes its second matrix column-major
        product = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    times = []
    for _ in range(11):
        t = sync_time(device)
        product()
        times.append(sync_time(device) - t)
    return 2 * n**3 / sorted(times[1:])[5]


@dataclass
class Machine:
    """What the floor of a step is measured against, both measured at the start of the run."""
    bandwidth: float  # bytes/s of a device-to-device copy
    matmul_rate: float  # FLOP/s of a large matrix product
    fp8_matmul_rate: float = math.nan  # of one on the FP8 tensor cores (FP8 weights; on a CPU, matmul_rate)


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device):
    """Start a new peak: each row reports its own, not the largest of the rows before it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


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


def graph_time_in_turn(calls: list, reps: int = 20) -> float:
    """graph_time of `calls` taken in turn, each reading other inputs (together more than the L2 cache holds, so
    that a small call is not timed from it): seconds per call."""
    turn = itertools.cycle(calls)
    return graph_time(lambda: next(turn)(), reps=max(len(calls), reps))

# ---- the fused kernel --------------------------------------------------------------------------------
def bench_kernel(args, hw: Machine, _):
    """Attention over S full slots, Qwen3-8B heads: each rule the fused kernel scores (--policy, default all),
    attention alone and SDPA. Several input sets rotate so that small batches are not served from the 60 MB L2
    cache."""
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
        # + ||v||_1 per slot, as the cache keeps it, and a per-slot state for the rules that keep one
        sets = [(*s, kernel.l1_norm(s[2]), torch.zeros(B, Hkv, S, device="cuda")) for s in sets]
        variants = {name: kernel_rule_call(resolve_policy(name, S), B, Hq, Hkv, S, D) for name in args.policy}
        variants |= {  # name: (call, bytes read beyond K, V and positions)
            "no selection": (lambda q, k, v, p, n, st: kernel.decode_attention(q, k, v, p, select=False), 0),
            "torch SDPA": (lambda q, k, v, p, n, st: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                                     enable_gqa=True), 0),
        }
        # an FP8 cache: K and V as e4m3 bits (half the bytes) and an fp32 scale per slot for each, and the bound
        # on each row's value scales, computed once as the cache keeps it (not in the timed call)
        fp8_sets = [(q, *kernel.quantize(k), *kernel.quantize(v), p, n) for q, k, v, p, n, _ in sets]
        fp8_sets = [(*s, s[4].amax(-1)) for s in fp8_sets]  # + v_top [B, H_kv]
        fp8 = lambda q, k, ks, v, vs, p, n, top, **kw: kernel.decode_attention(q, k, v, p, vnorm=n, k_scale=ks,
                                                                                 v_scale=vs, v_top=top, **kw)
        vnorm_bytes = B * Hkv * S * 4
        fp8_bytes = 2 * B * Hkv * S * D + B * Hkv * S * (4 + 4 + 8)  # K, V e4m3; positions, ||v||_1, 2 scales
        fp8_variants = {"longflow fp8": (fp8, fp8_bytes - kv_bytes),
                        "no selection fp8": (lambda *a: fp8(*a, select=False), fp8_bytes - kv_bytes - vnorm_bytes)}
        for name, (fn, extra_bytes), inputs in [(name, v, sets) for name, v in variants.items()] + \
                [(name, v, fp8_sets) for name, v in fp8_variants.items()]:
            t = graph_time_in_turn([lambda s=s: fn(*s) for s in inputs])
            rows.append(dict(workload="kernel", variant=name, batch=B, slots=S, us=t * 1e6,
                             bandwidth_fraction=(kv_bytes + extra_bytes) / t / hw.bandwidth))
        us = {r["variant"]: r["us"] for r in rows if r["batch"] == B}
        for r in rows:
            if r["batch"] == B:  # the FP8 rows against attention alone over the FP8 cache
                base = us["no selection fp8"] if r["variant"].endswith(" fp8") else us["no selection"]
                r["vs_no_selection"] = r["us"] / base - 1
                finished(r)


def kernel_rule_call(p: KernelPolicy, B: int, H_q: int, H_kv: int, S: int, D: int):
    """The kernel's call for rule p (resolved: its sinks and window) over an input set (q, k, v, pos, ||v||_1,
    state), and the bytes it reads beyond K, V and positions: ||v||_1, and the state read and written. A rule
    scored by a given query gets a random one and random pair weights (TriAttention's are a model's)."""
    s = p.scoring
    given_query, pair_weight = (torch.randn(B, H_q, D, device="cuda"), torch.rand(H_q, D // 2, device="cuda")) \
        if s.query == "given" else (None, None)
    call = lambda q, k, v, pos, n, st: kernel.decode_attention(q, k, v, pos, per_head=p.per_head, scoring=s,
                                                                n_sink=p.n_sink, window=p.window,
                                                                vnorm=n if s.value_norm else None,
                                                                state=st if s.keeps_state else None,
                                                                given_query=given_query, pair_weight=pair_weight)
    return call, 4 * B * H_kv * S * (s.value_norm + 2 * s.keeps_state)


# ---- the decode step at a given cache fill --------------------------------------------------------------
def random_model(cfg: Config, device, dtype, seed: int = 0, tp: Group = SINGLE):
    """Random weights of a real shape, for benchmarks where no checkpoint can be downloaded (tp: this rank's
    part of them)."""
    model = empty_model(cfg, device, dtype, tp)
    gen = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02, generator=gen)
    return model


def make_model(args):
    if args.model:
        return load(args.model, args.device, args.dtype, args.tp, args.weights)[0]
    model = random_model(Config.from_dict(SHAPES[args.shape]), args.device, args.dtype, tp=args.tp)
    if args.weights != "auto":
        fp8.check_split(model.full_cfg, args.tp)
    return fp8.quantize(model, args.weights)


def save_checkpoint(args, hw, model):
    """--out: the random weights of --shape as a checkpoint folder (config.json, model.safetensors, and a
    word-level tokenizer whose tokens are "t0" ... "tN", eos "t0"), so that server.py and generate.py load
    a real shape exactly as a downloaded model where nothing can be downloaded."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = dict(SHAPES[args.shape], architectures=[ARCHITECTURES[SHAPES[args.shape]["model_type"]]],
               max_position_embeddings=40960, eos_token_id=0,
               torch_dtype="bfloat16")
    os.makedirs(args.out, exist_ok=True)
    tensors = {name: t.to("cpu", torch.bfloat16).contiguous() for name, t in checkpoint_params(model).items()}
    save_file(tensors, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t0"}, f)
    finished(dict(workload="checkpoint", shape=args.shape, out=args.out, tensors=len(tensors),
                  gib=sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30))


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: all of them (FP8 ones a byte each, and their block factors),
    but of the input embedding only B rows, and of a tied one the rows its lm_head uses (all of them, or this
    rank's share under tensor parallel)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - unread_embedding_rows(model) * model.model.embed_tokens.weight.element_size()


def weights_read(model) -> int:
    """How many weights a step multiplies each token by (weight_bytes' weights, counted, not their bytes)."""
    total = sum(p.numel() for name, p in model.named_parameters() if not name.endswith("weight_scale_inv"))
    return total - unread_embedding_rows(model)


def unread_embedding_rows(model) -> int:
    """The input embedding's weights a step does not read: all but B rows, or but the lm_head's if it is the head."""
    embed = model.model.embed_tokens.weight
    head_rows = len(range(embed.shape[0])[model.vocab_part]) if model.embedding_is_head else 0
    return (embed.shape[0] - head_rows) * embed.shape[1]


def ready(policy, model):
    """The policy ready for model (Policy.for_model). On random weights (--shape) TriAttention has no calibrated
    statistics: it is timed with random ones of the model's shapes, which its step costs the same with."""
    if isinstance(policy, TriAttention) and model.folder is None:
        return replace(policy, stats=calibration.random_stats(model.cfg, model.inv_freq))
    return policy.for_model(model)


class StepTimer:
    """The engine's own compiled, graph-captured decode step for one (policy, batch, slots); times its
    replays with the cache filled to any length. Only data changes between fills, so one capture serves."""

    def __init__(self, model, policy: str, batch: int, slots: int, compile: bool, kv_dtype: str = "auto"):
        self.model, self.policy, self.batch, self.slots, self.compile = model, policy, batch, slots, compile
        self.kv_dtype, self.kv_storage = kv_dtype, KV_DTYPES[kv_dtype]
        self.device, self.dtype = model.inv_freq.device, model.model.norm.weight.dtype
        reset_peak(self.device)
        # the full cache has no budget: its slots are simply room for every token
        resolved = ready(resolve_policy(policy, None if policy == "full" else slots), model)
        self.cache = KVCache(model.cfg, batch, slots, self.device, self.dtype, resolved, kv_dtype=self.kv_storage,
                             tp=model.tp)
        self.state = State.empty(batch, self.device)
        t = time.perf_counter()
        sampler = Sampler.empty(batch, model.cfg.vocab_size, self.device)  # greedy rows, as the step runs any
        self.stepper = Stepper(model, self.cache, self.state, sampler, compile, sizes=[batch])  # this batch alone
        self.setup_s = time.perf_counter() - t  # compiling and capturing the step, or (--no-compile) building it

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
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        print(table)
        if path:
            prof.export_chrome_trace(path)

    def kv_bytes_read(self, filled: int) -> int:
        """LongFlow reads every slot; the full cache reads the slots filled so far."""
        read = self.slots if self.policy != "full" else filled
        return KVCache.bytes_needed(self.model.cfg, self.batch, read, self.dtype, self.cache.policy, self.kv_storage)

    def free(self):
        self.stepper = self.cache = self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def fill_cache(cache: KVCache, filled: int):
    """Random K/V in the first `filled` slots of every layer and sequence, positions 0..filled-1, and what
    the policy keeps recomputed from them (for what is history: no accumulated score yet, random queries)."""
    for layer in cache.layers:
        if cache.fp8:  # random e4m3 bits below 0x7F (NaN), so finite values in [0, 448], scaled to [0, 1]
            layer.k.random_(0, 0x7F)
            layer.v.random_(0, 0x7F)
            layer.k_scale.fill_(1 / 448)
            layer.v_scale.fill_(1 / 448)
            layer.v_top.fill_(1 / 448)
        else:
            layer.k.normal_()
            layer.v.normal_()
        layer.pos.fill_(-1)
        layer.pos[..., :filled] = torch.arange(filled, dtype=torch.int32, device=layer.pos.device)
        layer.next_slot.fill_(min(filled, cache.slots - 1))
        for name, kept in cache.policy.keeps.items():
            if kept.recompute(cache.with_values(rows_of(layer, 0, 1))) is None:  # history: nothing accumulated yet
                # (as a new token starts), random queries
                layer.kept[name].normal_() if isinstance(kept, RecentQueries) else layer.kept[name].zero_()
                continue
            for b in range(0, len(layer.pos), 16):  # 16 rows at a time: the values recomputed from (an FP8
                # cache's dequantized, fp32) K and V of a whole layer would take gigabytes the step never needs
                layer.kept[name][b:b + 16] = kept.recompute(cache.with_values(rows_of(layer, b, b + 16)))


def rows_of(layer: Layer, start: int, end: int) -> Layer:
    """Rows start..end-1 of a layer's slots and of what its policy keeps (a one-row stand-in stays as it is)."""
    cut = lambda t: t[start:end] if t.shape[0] > 1 else t
    return replace(layer, **{name: cut(getattr(layer, name)) for name in Layer.ROWS if name != "kept"},
                   kept={name: cut(t) for name, t in layer.kept.items()})


def step_floor(timer: StepTimer, filled: int, hw: Machine) -> tuple[float, list[str]]:
    """The roofline of a step: for each part, the larger of its bytes / bandwidth and its FLOPs / matmul
    rate. Weights: every weight read once, 2 FLOPs per weight and token. Attention: every K/V read once,
    4 FLOPs per query head, slot and dimension (q.k and the weighted sum of v). Returns the floor in
    seconds and the parts that are compute-bound."""
    model, cfg, B = timer.model, timer.model.cfg, timer.batch
    read = timer.slots if timer.policy != "full" else filled
    parts = {"weights": (weight_bytes(model), 2 * B * weights_read(model)),
             "attention": (timer.kv_bytes_read(filled), 4 * B * cfg.n_layers * cfg.n_heads * read * cfg.head_dim)}
    # FP8 weights at WEIGHT_ONLY_ROWS rows or fewer: fp32 multiply-adds, no tensor cores, at a rate not measured;
    # the bf16 rate stands in (at so few rows the weights' bytes bound the step either way)
    rates = {"weights": hw.fp8_matmul_rate if fp8.weights_of(model) != "auto" and B > fp8.WEIGHT_ONLY_ROWS else hw.matmul_rate,
             "attention": hw.matmul_rate}
    times = {name: (n_bytes / hw.bandwidth, flops / rates[name]) for name, (n_bytes, flops) in parts.items()}
    return sum(max(t) for t in times.values()), [name for name, (memory, compute) in times.items() if compute > memory]


def step_row(timer: StepTimer, filled: int, hw: Machine, **extra) -> dict:
    t = timer.seconds_per_step(filled)
    floor, compute_bound = step_floor(timer, filled, hw)
    return dict(policy=timer.policy, kv_dtype=timer.kv_dtype, weights=fp8.weights_of(timer.model),
                batch=timer.batch, slots=timer.slots, kv_tokens=filled,
                ms_per_step=t * 1e3,
                tokens_per_s=timer.batch / t, floor_fraction=floor / t, compute_bound=compute_bound,
                **setup_time(timer.setup_s, timer.compile),
                peak_gib=peak_gib(timer.device), **extra)


def setup_time(seconds: float, compiled: bool) -> dict:
    """A row's setup time: compile_s, or setup_s under --no-compile, where nothing was compiled (as generate.py's
    stats line words it)."""
    return {"compile_s" if compiled else "setup_s": seconds}


def slots_for(policy: str, args) -> int:
    return args.budget if policy != "full" else args.prompt_len + args.new_tokens


def bench_step(args, hw: Machine, model):
    """Steady state: every slot of a LongFlow cache filled; a full cache holding --context tokens."""
    for policy in args.policy:
        for B in args.batch:
            slots = args.budget if policy != "full" else args.context + 64
            timer = StepTimer(model, policy, B, slots, args.compile, args.kv_dtype)
            finished(step_row(timer, args.budget if policy != "full" else args.context, hw, workload="step"))
            if args.profile:
                timer.profile()
            timer.free()


def bench_throughput(args, hw: Machine, model):
    """Tokens/s over a whole run of --new-tokens outputs at the largest batch that fits (or --batch).
    The step time is measured at 5 cache fills across the run and integrated over its length (a
    LongFlow step costs the same at every fill: it always reads its `budget` slots)."""
    rows = []
    for policy in args.policy:
        slots = slots_for(policy, args)
        fits = None
        if args.device.type == "cuda":
            fits = model.tp.smallest(batch_that_fits(model.cfg, slots, args.prompt_len, device_free_bytes(args.device),
                                                     args.dtype, kv_dtype=KV_DTYPES[args.kv_dtype]))
        if not args.batch and fits == 0:
            raise ValueError(f"not even one sequence of {slots} KV slots ({policy}) fits in free GPU memory; "
                             f"lower --budget, --prompt-len or --new-tokens")
        for B in args.batch or [fits]:
            timer = StepTimer(model, policy, B, slots, args.compile, args.kv_dtype)
            if policy == "full":
                span = max(args.new_tokens - 64, 0)  # room for the timed steps after the last fill
                fills = [args.prompt_len + round(f * span) for f in (0, .25, .5, .75, 1)]
            else:
                fills = [args.budget]
            steps = [step_row(timer, f, hw) for f in fills]
            ms = run_mean([r["ms_per_step"] for r in steps])
            floor_ms = run_mean([r["ms_per_step"] * r["floor_fraction"] for r in steps])
            rows.append(dict(workload="throughput", policy=policy, kv_dtype=args.kv_dtype,
                             weights=fp8.weights_of(model),
                             batch=B, slots=slots,
                             fits=fits,
                             new_tokens=args.new_tokens, ms_per_step=ms, tokens_per_s=B / ms * 1e3,
                             floor_fraction=floor_ms / ms, compute_bound=steps[-1]["compute_bound"],
                             peak_gib=steps[-1]["peak_gib"],
                             **setup_time(timer.setup_s, timer.compile)))
            if args.dp:
                rows[-1] = data_parallel_row(rows[-1])
            finished(rows[-1])  # measured: kept (--json) even if its validation fails
            if args.validate:
                checked = validate(args, model, timer, policy, B)
                rows[-1].update(checked)
                finished_validation(checked)
            timer.free()
    by = {r["policy"]: r["tokens_per_s"] for r in rows}
    if "longflow" in by and "full" in by:
        print(f"longflow / full throughput: {by['longflow'] / by['full']:.2f}x")


def data_parallel_row(row: dict) -> dict:
    """--dp: every rank ran its batch (--batch, or the largest that fits its GPU) on its own GPU; together they
    serve the sum of their tokens/s (the slowest rank's step time stands for the step)."""
    rows = parallel.gather(row)
    return dict(row, ranks=len(rows), batch=sum(r["batch"] for r in rows),
                ms_per_step=max(r["ms_per_step"] for r in rows),
                tokens_per_s=sum(r["tokens_per_s"] for r in rows),
                tokens_per_s_per_rank=[r["tokens_per_s"] for r in rows])


def graphs_compiled() -> int:
    """How many graphs torch.compile has made in this process (torch._dynamo imported here, when a run is
    validated: importing it takes a second of every start)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def validate(args, model, timer: StepTimer, policy: str, B: int) -> dict:
    """Check the method once against reality: a real run of --validate new tokens through the engine
    (prefill, graph replays, host syncs) against the step time predicted for the same fills. The run
    must not compile anything again, and its memory must stay the same from its first token to its last."""
    n = args.validate
    fills = [args.prompt_len, args.prompt_len + n] if policy == "full" else [args.budget]
    predicted = run_mean([timer.seconds_per_step(f) for f in fills])
    timer.free()  # the engine allocates its own cache of the same size
    engine = new_engine(model, args)
    # the rows as the engine plans them, as `generate.py --batch-size max` would: one fewer than B when the timer's
    # step left a little memory in pieces (validate_batch says; the prediction stays B's)
    slots = args.budget if policy != "full" else args.prompt_len + n
    batch = pick_batch(engine, None, B, slots, args.prompt_len)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, args.prompt_len)).tolist()
    seen = []  # (GPU memory, graphs compiled so far) at every host sync of the run, from the first token on
    memory = lambda: torch.cuda.memory_allocated() if args.device.type == "cuda" else 0
    with TokenBar(n, f"validate {policy}, batch {batch}") as bar:
        def record(out):
            seen.append((memory(), graphs_compiled()))
            bar(out)
        _, st = engine.generate(prompts, n, [], args.budget if policy != "full" else None, policy, seed=0,
                                batch_size=batch, on_tokens=record)
    assert len(set(seen)) == 1, f"memory grew or something compiled while decoding: {seen}"
    steps = -(-(n - 1) // engine.sync_every) * engine.sync_every  # the engine steps in whole sync chunks
    sizes = validate_shrinking(args, engine, prompts * 3, policy, batch, seen[0])
    return dict(validate_tokens=n, validate_batch=batch, predicted_ms_per_step=predicted * 1e3,
                real_ms_per_step=st.decode_s / steps * 1e3, validate_step_sizes=sizes,
                validate_setup_s=st.setup_s)  # setup: the engine's whole ladder


def validate_shrinking(args, engine: Engine, prompts, policy: str, B: int, before: tuple) -> list[int]:
    """The same engine on three times as many prompts, sampled, each ending at the first it draws of one id in
    --validate / 4 (about a quarter of the tokens, on average): rows end at different steps and are refilled, so
    the busy rows shrink and grow and the step runs at many sizes of its ladder. Nothing may compile and the
    memory in use must stay what it was. Returns the sizes the step ran at."""
    seen, sizes = [], set()
    memory = lambda: torch.cuda.memory_allocated() if args.device.type == "cuda" else 0

    def record(_):
        seen.append((memory(), graphs_compiled()))
        sizes.add(engine.stepper.size)
    eos = list(range(0, engine.model.cfg.vocab_size, max(2, args.validate // 4)))
    engine.generate(prompts, args.validate, eos, args.budget if policy != "full" else None, policy,
                    Sampling(temperature=1.0), seed=0, batch_size=B, on_tokens=record)
    assert set(seen) == {before}, f"memory grew or something compiled while the busy rows changed: {seen}"
    return sorted(sizes)


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
def new_engine(model, args) -> Engine:
    """An engine that runs past the model's trained context: the tokens here are random, only their number
    counts (a 128k prompt on a checkpoint trained for 128k would be refused for its new tokens)."""
    return Engine(model, compile=args.compile, allow_long_context=True, kv_dtype=KV_DTYPES[args.kv_dtype])


def bench_generate(args, hw: Machine, model):
    """Whole runs through the engine (prefill, compiled graph-replayed step, host syncs), for checking
    the step timings above against reality."""
    engine = new_engine(model, args)
    for policy in args.policy:
        for B in args.batch or [1]:
            prompts = torch.randint(0, model.cfg.vocab_size, (B, args.prompt_len)).tolist()
            budget = args.budget if policy != "full" else None
            reset_peak(args.device)
            with TokenBar(args.new_tokens, f"{policy}, batch {B}") as bar:
                outs, st = engine.generate(prompts, args.new_tokens, [], budget, policy, seed=0, on_tokens=bar)
            assert all(len(o) == args.new_tokens for o in outs)
            finished(dict(workload="generate", policy=policy, kv_dtype=args.kv_dtype, slots=st.slots, batch=B,
                          new_tokens=args.new_tokens,
                          **setup_time(st.setup_s, st.compiled), prefill_s=st.prefill_s,
                          tokens_per_s=B * (args.new_tokens - 1) / st.decode_s,
                          ms_per_step=st.decode_s / (args.new_tokens - 1) * 1e3, peak_gib=peak_gib(args.device)))


def prefill_floor(model, tokens: int, hw: Machine) -> float:
    """Seconds a prefill of `tokens` takes at the measured matmul rate: 2 FLOPs per layer weight and token,
    and causal attention's 4 FLOPs per query head, dimension and (query, key at or before it) pair (the
    embedding lookup and the last token's lm_head are negligible; so is SnapKV's scoring)."""
    cfg = model.cfg
    layer_weights = sum(p.numel() for name, p in model.model.layers.named_parameters()
                        if not name.endswith("weight_scale_inv"))
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * (tokens + 1) // 2
    return (2 * tokens * layer_weights + attention) / hw.matmul_rate


def bench_long_prompt(args, hw: Machine, model):
    """The KVPress case: one --prompt-len prompt (default 128k) compressed at prefill to half its length
    and to --budget, against the full cache; peak memory and decode speed."""
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len)).tolist()
    engine = new_engine(model, args)
    # untimed, one prefill group: the prefill's kernels compiled (Triton's, for FP8 weights) before any row is timed
    engine.generate([prompt[0][:PREFILL_TOKENS]], 2, [], None, "full", seed=0)
    for name, budget in [("full", None), ("50%", args.prompt_len // 2), (f"budget {args.budget}", args.budget)]:
        reset_peak(args.device)
        with TokenBar(args.new_tokens, f"long-prompt, {name}") as bar:  # still at 0 during the prefill
            _, st = engine.generate(prompt, args.new_tokens, [], budget, "longflow" if budget else "full", seed=0,
                                    on_tokens=bar)
        finished(dict(workload="long-prompt", cache=name, kv_dtype=args.kv_dtype, prompt_tokens=args.prompt_len,
                      slots=st.slots,
                      prefill_s=st.prefill_s,
                      prefill_floor_fraction=prefill_floor(model, args.prompt_len, hw) / st.prefill_s,
                      decode_tokens_per_s=(args.new_tokens - 1) / st.decode_s,
                      peak_gib=peak_gib(args.device)))
        engine = new_engine(model, args)  # drop the previous cache before the next size


HF_TRIES = 5  # pairs of runs whose median difference is the hf step (odd: the median is one of them)


def bench_hf(args, hw: Machine, _):
    """Hugging Face transformers full-KV generate on the same shape (random weights, sdpa): the step time
    from runs of two lengths, so prefill and setup cancel out."""
    import transformers
    cfg = transformers.AutoConfig.for_model(**SHAPES[args.shape])
    with args.device:
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=args.dtype, attn_implementation="sdpa")
    for B in args.batch or [1]:
        reset_peak(args.device)
        ids = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device=args.device)

        def run(n):  # seconds for n new tokens, EOS or not
            t = sync_time(args.device)
            hf.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            return sync_time(args.device) - t
        run(2)
        step = step_from_run_lengths(run, args.new_tokens, f"batch {B}")
        finished(dict(workload="hf", policy="transformers full", batch=B, prompt_len=args.prompt_len,
                      ms_per_step=step * 1e3, tokens_per_s=B / step, peak_gib=peak_gib(args.device)))


def step_from_run_lengths(run, n: int, what: str) -> float:
    """Seconds per decode step: the median, over HF_TRIES pairs, of the difference between a run of n new tokens
    and one of n // 4, per token between them. One difference alone came out negative on a loaded machine (the
    shorter run slowed more than the longer); a median that is still not positive is refused, never reported."""
    short = max(n // 4, 1)  # transformers refuses to generate no token
    steps = sorted((run(n) - run(short)) / (n - short) for _ in range(HF_TRIES))
    step = steps[HF_TRIES // 2]
    if not step > 0:
        raise ValueError(f"the hf step at {what} could not be timed: {n} new tokens took no longer than {short} "
                         f"in {sum(s <= 0 for s in steps)} of {HF_TRIES} tries (a machine too busy, or runs too "
                         f"short); give a larger --new-tokens, or run it on a quieter machine")
    return step


# ---- a running server under load -----------------------------------------------------------------------------
async def one_request(client, args, prompt: list[int], delay: float) -> dict:
    import httpx
    """One streamed completion of exactly --new-tokens tokens (EOS ignored), sent `delay` seconds after the
    start: when each text chunk came back, and how many tokens it was in all."""
    await asyncio.sleep(delay)
    body = {"model": args.served_model, "prompt": prompt, "max_tokens": args.new_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent, chunks, tokens = time.perf_counter(), [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:  # 429: start the server with a larger --max-waiting, or lower --rate
                return dict(error=f"status {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    chunks.append(time.perf_counter() - sent)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, OSError, ValueError) as e:  # one broken request does not lose the run
        return dict(error=f"{type(e).__name__}: {e}")
    return dict(sent=sent, chunks=chunks, tokens=tokens)


def busy_as_seen(decoding: list[tuple[float, float]]) -> float:
    """The busy rows as a request sees them, averaged over every request's decoding time: the integral of n(t)^2
    over that of n(t), n(t) the requests decoding at time t (from their intervals). A request's time per token
    follows the step it decodes in, and busier times hold more requests: this is what its step held, on average,
    above the time average (mean_busy_rows) whenever the load ramps up and down."""
    events = sorted([(start, 1) for start, _ in decoding] + [(end, -1) for _, end in decoding])
    n, before, seen, alive = 0, None, 0.0, 0.0
    for t, change in events:
        if before is not None:
            seen, alive = seen + n * n * (t - before), alive + n * (t - before)
        n, before = n + change, t
    return seen / alive if alive else 0.0


def percentiles(values: list[float]) -> str:
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1e3
    return f"{at(0.5):.1f} / {at(0.99):.1f}"


async def load_run(args, rate: float) -> dict:
    """--requests requests with Poisson arrivals at `rate` per second (all at once: inf), prompts of
    --prompt-len random token ids."""
    import httpx
    gen = random.Random(0)
    clock, delays = 0.0, []
    for _ in range(args.requests):
        delays.append(clock)
        clock += gen.expovariate(rate) if math.isfinite(rate) else 0.0
    vocab = args.vocab
    prompts = [[gen.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.requests + 8, max_keepalive_connections=args.requests + 8)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, args, p, d) for p, d in zip(prompts, delays)))
        seconds = time.perf_counter() - start
    ok = [r for r in results if "error" not in r and r["tokens"] == args.new_tokens]
    failed = [r for r in results if r not in ok]
    if failed:
        print(f"{plural(len(failed), 'request')} did not complete, first: {failed[0].get('error', failed[0])}",
              file=sys.stderr)
    # time per output token: a request's time from its first chunk to its last over its tokens after the
    # first (the server sends a chunk per host sync, 16 tokens, so gaps between chunks are not per token)
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / max(1, args.new_tokens - 1) for r in ok if len(r["chunks"]) > 1]
    # the mean number of requests being decoded (from first chunk to last), which the server's step had to hold
    decoding = [(r["sent"] + r["chunks"][0], r["sent"] + r["chunks"][-1]) for r in ok if r["chunks"]]
    busy = sum(end - start for start, end in decoding) / seconds
    return dict(workload="serve", requests=args.requests, completed=len(ok), rate=rate, mean_busy_rows=busy,
                busy_rows_seen=busy_as_seen(decoding),
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, seconds=seconds,
                tokens_per_s=sum(r["tokens"] for r in ok) / seconds,
                ttft_ms_p50_p99=percentiles([r["chunks"][0] for r in ok]) if ok else None,
                tpot_ms_p50_p99=percentiles(tpot) if tpot else None)


def bench_serve(args, hw, _):
    """A server already running at --url (server.py), under --requests streamed requests: served tokens/s,
    time to first token and time per output token (median / 99th percentile), and that every request completed."""
    import httpx
    try:
        models = httpx.get(args.url + "/v1/models", timeout=10,
                           headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
        args.served_model = models["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"no tinyflow server answers at {args.url} ({type(e).__name__}); start server.py first") from None
    for rate in args.rate:
        finished(asyncio.run(load_run(args, rate)))
        if ROWS[-1]["completed"] != args.requests:
            raise ValueError(f"{plural(args.requests - ROWS[-1]['completed'], 'request')} of {args.requests} did not "
                             f"complete at --rate {rate}")


ROWS = []  # every row measured so far, in order: what --json writes, also when the run is cut short


def finished(row: dict):
    """A row is measured: print it and keep it."""
    ROWS.append(row)
    print(formatted(row), flush=True)


def finished_validation(checked: dict):
    """The last row's validation (in that row already): print it."""
    print("  " + formatted(checked), flush=True)


def formatted(row: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def plot(rows, path):
    """Throughput against batch size, one line per policy and budget, or a serve sweep (matplotlib: checked in
    check_args)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if rows and rows[0]["workload"] == "serve":
        return plot_serve(rows, path, plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    label = lambda r: r["policy"] if r["policy"] == "full" else f"{r['policy']} {r['slots']}"
    for name in sorted({label(r) for r in rows}):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if label(r) == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xlabel="batch size", ylabel="tokens/s", xscale="log", title="decode throughput")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_serve(rows, path, plt):
    """Time per output token (median) and served tokens/s against the offered load, one point per rate."""
    fig, (slow, served) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["all at once" if math.isinf(r["rate"]) else f"{r['rate']:g}/s" for r in rows]
    tpot = [float(r["tpot_ms_p50_p99"].split(" / ")[0]) if r["tpot_ms_p50_p99"] else math.nan for r in rows]
    slow.plot(labels, tpot, marker="o")
    slow.set(xlabel="requests per second (Poisson)", ylabel="ms per output token (p50)", title="time per token")
    served.plot(labels, [r["tokens_per_s"] for r in rows], marker="o")
    served.set(xlabel="requests per second (Poisson)", ylabel="tokens/s", title="served throughput")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def finite(x):
    """x with every NaN or infinite float as None: strict JSON has no such numbers (peak_gib is NaN on a CPU)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write_json(path: str, args, hw: Machine, complete: bool):
    """The rows measured so far and the options as given; complete is false for a run cut short."""
    record = dict(bandwidth=hw and hw.bandwidth, matmul_rate=hw and hw.matmul_rate,  # None: serve measures none
                  fp8_matmul_rate=hw and (None if math.isnan(hw.fp8_matmul_rate) else hw.fp8_matmul_rate),
                  device=str(args.device), torch=torch.__version__, complete=complete,
                  args=vars(args), rows=ROWS)
    with open(path, "w") as f:  # default=str: the device and the dtype
        json.dump(finite(record), f, indent=1, allow_nan=False, default=str)


def save_plot(args, hw: Machine):
    """The plot, drawn once every row is measured. Writing it can still fail then (a full disk, the folder
    gone): the rows must not go with it, so they are in --json (written first) or else in a file of their
    own, and the one error line says where."""
    try:
        plot(ROWS, args.plot)
    except OSError as e:
        saved = args.json
        if not saved:
            handle, saved = tempfile.mkstemp(prefix="bench-rows-", suffix=".json")
            os.close(handle)
            write_json(saved, args, hw, complete=True)
        raise ValueError(f"--plot {args.plot} could not be written ({e.strerror or e}); what was measured "
                         f"({plural(len(ROWS), 'row')}) is in {saved}") from None


WORKLOADS = {"kernel": bench_kernel, "step": bench_step, "throughput": bench_throughput,
             "generate": bench_generate, "long-prompt": bench_long_prompt, "hf": bench_hf, "serve": bench_serve,
             "checkpoint": save_checkpoint}
# The options each workload reads (argparse names). Given to another workload, one would do nothing, so it is
# refused; --device and --json apply to all.
READS = {
    "kernel": {"batch", "slots", "policy"},
    "step": {"shape", "model", "batch", "budget", "context", "policy", "compile", "profile", "plot", "kv_dtype",
             "weights"},
    "throughput": {"shape", "model", "batch", "budget", "policy", "prompt_len", "new_tokens", "compile", "kv_dtype",
                   "validate", "plot", "dp", "weights"},
    "generate": {"shape", "model", "batch", "budget", "policy", "prompt_len", "new_tokens", "compile", "kv_dtype",
                 "weights"},
    "long-prompt": {"shape", "model", "budget", "prompt_len", "new_tokens", "compile", "kv_dtype", "weights"},
    "hf": {"shape", "batch", "prompt_len", "new_tokens"},
    "serve": {"url", "requests", "rate", "prompt_len", "new_tokens", "api_key", "vocab", "plot"},
    "checkpoint": {"shape", "out"},
}


def parser() -> Parser:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--shape", default="Qwen3-8B", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="a real checkpoint instead of random weights")
    p.add_argument("--batch", type=positive_int, nargs="+", default=None,
                   help="default: 1 and 64, or the largest that fits")
    p.add_argument("--budget", type=positive_int, nargs="+", default=[3200],
                   help="several: the workload runs for each")
    p.add_argument("--slots", type=positive_int, default=3200, help="kernel: slots per sequence")
    p.add_argument("--context", type=positive_int, default=16384, help="step, full policy: tokens in the cache")
    p.add_argument("--policy", nargs="+", default=None, choices=list(POLICIES), metavar="POLICY",
                   help=f"one or more of {', '.join(POLICIES)} (default: longflow and full; kernel: every rule the "
                        f"fused kernel scores)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="default: 131072 for long-prompt, else 128")
    p.add_argument("--new-tokens", type=positive_int, default=16384)
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--profile", action="store_true", help="step: print the step's slowest kernels (needs a GPU)")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                   help="the KV cache's storage: auto (the model's dtype) or fp8 (e4m3 and per-slot scales)")
    add_weights_option(p)
    p.add_argument("--validate", type=non_negative_int, default=0,
                   help="throughput: also run this many new tokens end to end and compare with the prediction")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="serve: the running server.py")
    p.add_argument("--requests", type=positive_int, default=1000, help="serve: requests sent in all")
    p.add_argument("--rate", type=positive_float, nargs="+", default=[math.inf],
                   help="serve: mean requests per second, Poisson arrivals (default: all at once); several: a "
                        "sweep, one load run of --requests each")
    p.add_argument("--vocab", type=positive_int, default=1000, help="serve: prompt ids are drawn below this")
    p.add_argument("--api-key", default=None, help="serve: the server's --api-key")
    p.add_argument("--out", default=None, help="checkpoint: the folder to write")
    p.add_argument("--dp", action="store_true", help="throughput under torchrun: a whole model per process (GPU), "
                   "tokens/s summed over them (without it, the model is split over the processes)")
    p.add_argument("--json", default=None, help="write the raw rows here")
    p.add_argument("--plot", default=None, help="a PNG of throughput against batch size (serve: against --rate)")
    return p


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (inf: all at once), got {text!r}")
    return value


def check_args(args, p: Parser):
    """Everything that can be checked before the benchmark starts, so that a bad option fails at once and not
    after hours (ValueError: what is wrong and what to do). Sets the device and the defaults that depend on it."""
    args.device, args.dtype = pick_device(args.device, None)
    check_parallel(args)
    check_used(args, p)
    if args.workload == "kernel" and args.device.type != "cuda":
        raise ValueError("the kernel workload times CUDA kernels and needs a GPU")
    if args.workload == "hf" and importlib.util.find_spec("transformers") is None:
        raise ValueError("the hf workload runs Hugging Face transformers: pip install transformers")
    if args.workload == "checkpoint":
        check_out(args.out)
    if args.profile and args.device.type != "cuda":
        raise ValueError("--profile lists the CUDA kernels of a step and needs a GPU; drop it on the CPU")
    if args.batch is None and (args.workload in ("kernel", "step") or args.device.type != "cuda"):
        args.batch = [1, 64] if args.device.type == "cuda" else [1, 2]
    if args.prompt_len is None:
        args.prompt_len = 131072 if args.workload == "long-prompt" else 128
    check_sizes(args)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:  # rank 0 alone writes it, so it alone tries (two ranks trying raced), and every rank refuses
            parallel.on_rank0(lambda: check_writable(option, path))
    if args.plot:
        check_plot(args.plot, args.json)


def check_parallel(args):
    """Under torchrun the step, throughput, generate and long-prompt workloads split the model over the
    processes (tensor parallel), or with --dp (throughput) run a whole model on each; the others run in one
    process. Joins the processes and sets each one's device."""
    if args.dp and not parallel.launched():
        raise ValueError("--dp runs a whole model on each of torchrun's processes: start bench.py with torchrun "
                         "--nproc-per-node N, or drop --dp")
    if parallel.launched() and args.workload not in ("step", "throughput", "generate", "long-prompt"):
        raise ValueError(f"the {args.workload} workload runs in one process; start it without torchrun")
    args.tp, args.device = parallel.join(args.device, args.dp)


def check_used(args, p: Parser):
    """Options given that the run would not read (each would silently do nothing) are refused."""
    w = args.workload
    given = lambda name: getattr(args, name) != p.get_default(name)
    flag = lambda name: "--no-compile" if name == "compile" else "--" + name.replace("_", "-")
    unused = [flag(name) for name in sorted(set().union(*READS.values()) - READS[w]) if given(name)]
    if unused:
        raise ValueError(f"the {w} workload does not use {', '.join(unused)}; drop {'them' if unused[1:] else 'it'}")
    if args.policy is None:
        args.policy = [n for n, p in POLICIES.items() if isinstance(p, KernelPolicy)] if w == "kernel" else \
            ["longflow", "full"]
    if args.model and given("shape"):
        raise ValueError("--model and --shape both say which model to run; give one of them")
    if len(args.budget) > 1 and w not in ("step", "throughput", "generate"):
        raise ValueError(f"the {w} workload takes one --budget; several are for step, throughput and generate")
    if set(args.policy) == {"full"} and given("budget"):
        raise ValueError("--policy full keeps every token and takes no --budget; drop it, or add a policy that evicts")
    if "full" not in args.policy and given("context"):
        raise ValueError("--context is the fill of the full cache; add full to --policy, or drop --context")
    engine_runs = w in ("throughput", "generate", "long-prompt") or args.validate
    if "triattention" in args.policy and engine_runs and not args.model:
        raise ValueError("policy triattention reads a checkpoint's calibrated statistics: on random weights (--shape) "
                         "only bench.py step and kernel time it (with random ones); give --model DIR, calibrated, "
                         "for this")
    unfused = [name for name in args.policy if not isinstance(POLICIES[name], KernelPolicy)]
    if w == "kernel" and unfused:
        raise ValueError(f"the kernel workload times the rules the fused kernel scores, not {', '.join(unfused)}: "
                         f"time them in a decode step (bench.py step --policy ...)")


def check_sizes(args):
    """Token counts, budgets and policies that the workload can run with."""
    if args.new_tokens < 2:  # generate, long-prompt and hf divide by the steps after the first token
        raise ValueError("--new-tokens must be at least 2: the first comes from the prefill, the speed is that "
                         "of the decode steps after it")
    if args.validate and not 2 <= args.validate <= args.new_tokens:
        raise ValueError(f"--validate runs that many of the --new-tokens ({args.new_tokens}) for real: give 2 to "
                         f"{args.new_tokens}, or 0 for none")
    for policy, budget in itertools.product(args.policy, args.budget):
        try:
            resolve_policy(policy, None if policy == "full" else budget)  # the full cache runs without one
        except ValueError as e:
            raise ValueError(f"--policy {policy} with --budget {budget}: {e}") from None
    if args.workload == "long-prompt":
        check_long_prompt(args.prompt_len, args.budget[0])


def check_long_prompt(prompt_len: int, budget: int):
    """long-prompt compresses its prompt to half its length and to --budget: both must compress, and work."""
    if budget >= prompt_len:
        raise ValueError(f"--budget {budget} holds the whole {prompt_len}-token prompt, so nothing is compressed; "
                         f"give a budget below --prompt-len")
    try:
        resolve_policy("longflow", prompt_len // 2)
    except ValueError as e:
        raise ValueError(f"half of the {prompt_len}-token prompt: {e}; give a longer --prompt-len") from None


def check_out(folder: str | None):
    """The checkpoint workload writes a new folder (never into one that holds something)."""
    if not folder:
        raise ValueError("the checkpoint workload writes a checkpoint folder; give it with --out DIR")
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise ValueError(f"--out {folder} already exists and is not an empty folder; give a new one")
    parent = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--out {folder}: cannot create it in {parent}; give a folder in a writable place")


def check_writable(option: str, path: str):
    """A file can be written at path (found now, not once the benchmark has run). It is opened for writing
    rather than asked about: os.access calls /proc writable for root, where no file can be created. A file
    made by the try is removed again."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: folder {folder} does not exist; create it or give another path")
    existed = os.path.exists(path)
    try:
        open(path, "a").close()  # "a": an existing file keeps its content until the run writes it
    except OSError as e:
        raise ValueError(f"{option} {path} cannot be written ({e.strerror}); give another path") from None
    if not existed:
        os.remove(path)


def check_plot(path: str, json_path: str | None):
    """The plot can be drawn, in a format matplotlib writes, and leaves the JSON alone."""
    if json_path and os.path.abspath(path) == os.path.abspath(json_path):
        raise ValueError(f"--plot and --json are both {path}: the plot would overwrite the rows; give two paths")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib, or drop --plot")
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = os.path.splitext(path)[1][1:].lower()
    if kind and kind not in kinds:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{kind} files; end the name with one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")


def sweep(args):
    """The options of each run of a sweep over --budget: one budget each, and the full cache (which has
    none) in the first run only. args itself stays as given, for the JSON."""
    for i, budget in enumerate(args.budget):
        policies = args.policy if i == 0 else [p for p in args.policy if p != "full"]
        yield argparse.Namespace(**{**vars(args), "budget": budget, "policy": policies})


def benchmark(args):
    """Set up (the model first: a bad --model fails before anything is measured), measure, write."""
    model = make_model(args) if args.workload not in ("kernel", "hf", "serve") else None
    hw = None
    if args.workload not in ("serve", "checkpoint"):  # the server's machine is measured by the server's own runs
        hw = Machine(copy_bandwidth(args.device), matmul_rate(args.device, args.dtype))
        if model is not None and fp8.weights_of(model) != "auto":  # --weights fp8, or an FP8 checkpoint
            hw.fp8_matmul_rate = matmul_rate(args.device, fp8.FP8) if args.device.type == "cuda" else hw.matmul_rate
        fp8_rate = "" if math.isnan(hw.fp8_matmul_rate) else f" (fp8 {per_second(hw.fp8_matmul_rate, 'FLOP')})"
        print(f"{torch.cuda.get_device_name() if args.device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
              f"copy bandwidth {per_second(hw.bandwidth, 'B')}, matmul {per_second(hw.matmul_rate, 'FLOP')}{fp8_rate}, "
              f"{'random weights of ' + args.shape + ' shape' if not args.model else args.model}", flush=True)
    try:
        for one in sweep(args):
            WORKLOADS[args.workload](one, hw, model)
    except BaseException:  # Ctrl-C or an error midway: the rows measured so far are kept all the same
        if args.json and ROWS:
            write_json(args.json, args, hw, complete=False)
        raise
    if args.json:
        write_json(args.json, args, hw, complete=True)
    if args.plot:
        save_plot(args, hw)


def per_second(value: float, unit: str) -> str:
    """A rate in the SI prefix that fits it, three significant digits: a CPU copies some GB/s, an H200 some
    TB/s (rounded first, so that 999.7 GB/s is 1 TB/s, not 1e+03 GB/s)."""
    value = float(f"{value:.3g}")
    prefix, scale = next(((p, x) for p, x in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if value >= x),
                         ("", 1))
    return f"{value / scale:.3g} {prefix}{unit}/s"


def main():
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again
    p = parser()
    args = p.parse_args()
    ROWS.clear()  # this run's rows only, when main runs more than once in a process (the tests call it)
    run_command(lambda: check_and_run(args, p), torch.OutOfMemoryError, out_of_memory, lambda: stopped(args))


def check_and_run(args, p: Parser):
    check_args(args, p)
    if parallel.rank() > 0:  # rank 0 alone writes --json and --plot (it alone tried them, in check_args)
        args.json = args.plot = None
    benchmark(args)


def out_of_memory() -> str:  # a --batch or --context too large for this GPU (the finished rows are kept)
    return (f"out of GPU memory after {plural(len(ROWS), 'row')}; lower --batch, --budget or --context, or leave "
            f"--batch out for the largest batch that fits")


def stopped(args):  # Ctrl-C: the rows measured until then, and where they are written
    interrupted(f"{plural(len(ROWS), 'row')} measured" + (f", written to {args.json}" if args.json and ROWS else ""))


if __name__ == "__main__":
    run_as_command(main)
