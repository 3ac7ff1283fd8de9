"""Prefill, the compiled decode step, CUDA-graph replay, sampling or teacher forcing, the generation loop,
and the command line.

    python generate.py --model Qwen/Qwen3-8B --budget 3200 --prompt "How many primes are below 100?"

The decode step (Stepper.step) reads and advances its own state in place (current tokens, positions,
the output history), so the host only replays it: one layer compiled with torch.compile and used for
every layer, the sampling compiled, the whole step captured once as a CUDA graph, never synchronised
with inside the step. The host looks at the output every `sync_every` steps to stop at EOS and to
stream text.
"""
import argparse
import math
import os
import random
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line, no traceback (main() restores Ctrl-C)
    signal.signal(signal.SIGINT, lambda *_: os._exit(print("interrupted", file=sys.stderr) or 130))

import torch

from cache import KV_DTYPES, KVCache
from policies import POLICIES, Policy, hash32, is_int, resolve_policy
from cli import (Parser, add_cache_options, batch_size, check_policy_args, check_sampling_args, positive_int,
                 read_prompt, run_command)
import kernel
import parallel
from model import DTYPES, MLP_TOKENS, Transformer, load

# ---- sampling without host syncs ---------------------------------------------------------------------
def uniform_noise(seeds, positions, vocab: int):
    """Uniform (0, 1) noise [B, vocab] that depends only on (seed, position, token id): the same prompt
    and seed give the same sample in any batch, on any device, with no generator state to capture."""
    # the seed's high 32 bits folded in (hash32(0) = 0: seeds 0 to 2^32 - 1 draw what they always drew)
    row = hash32((seeds * 0x9E3779B1 + positions) ^ hash32(seeds >> 32))  # [B]
    x = hash32(row[:, None] * 0x85EBCA77 + torch.arange(vocab, device=seeds.device))  # [B, V]
    return ((x >> 8).float() + 0.5) / 2**24  # top 24 bits: exact in fp32, never 0 or 1


def apply_penalty(logits, seen, penalty):
    """transformers' repetition_penalty: the logit of every token id already in the prompt or the output is
    divided by the penalty when positive, multiplied by it when negative. logits: [B, V] fp32; seen: [B, V]
    bool; penalty: [B] (1: none)."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def sample(logits, seeds, positions, temperature, top_k, top_p):
    """One token per row from logits [B, V] fp32, each row with its own settings: temperature [B] fp32 (0:
    greedy, the argmax exactly), top_k [B] int64 (0: no limit), top_p [B] fp32. positions: [B], the
    positions of the tokens being sampled. Returns [B]. Settings are values, not branches, so one compiled
    step serves every mix of them (at the price of one sort of the vocabulary per row and step)."""
    V = logits.shape[-1]
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature, 1.0)[:, None]  # [B, V]
    ordered = scaled.sort(-1, descending=True).values  # [B, V]
    # top-k: the tokens below the k-th largest logit go (ties with it stay, as in transformers)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]  # [B, 1]
    kept = ordered >= ordered.gather(1, k - 1)  # [B, V], in sorted order
    # top-p: a token goes once the more likely tokens before it already cover top_p
    probs = ordered.masked_fill(~kept, float("-inf")).softmax(-1)
    kept &= (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1)  # fp32 sums reach 1 early
    kept[:, 0] = True  # the most likely token always stays (a top_p that rounds to 0 in fp32 would keep none)
    # both cut the sorted row: what stays is every logit down to the last kept one (ties with it too)
    lowest = ordered.gather(1, kept.sum(-1, keepdim=True) - 1)  # [B, 1]
    probs = scaled.masked_fill(scaled < lowest, float("-inf")).softmax(-1)
    # argmax(p / E) with E ~ Exponential(1) is a draw from p (the exponential-race trick)
    drawn = (probs / -uniform_noise(seeds, positions, V).log()).argmax(-1)
    return torch.where(hot, drawn, logits.argmax(-1))


# The decode step calls sample() as one opaque operator: its PyTorch kernels run as they are, inside the
# CUDA graph like the rest of the step, instead of being fused by the compiler, whose code generation
# (torch 2.11's inductor) fails on this function at batch 64 and above (InductorError in get_block_shape).
@torch.library.custom_op("tinyflow::sample", mutates_args=())
def sample_op(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return sample(logits, seeds, positions, temperature, top_k, top_p)


@sample_op.register_fake
def _(logits, seeds, positions, temperature, top_k, top_p):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (the decode step reads them per row from a Sampler)."""
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # 1: none

    def __post_init__(self):
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        # below 1e-6, logits / temperature can overflow to inf and the softmax to NaN
        if not (number(self.temperature) and (self.temperature == 0 or self.temperature >= 1e-6)
                and number(self.top_p) and 0 < self.top_p <= 1
                and is_int(self.top_k) and 0 <= self.top_k < 2**63):
            raise ValueError(f"sampling needs temperature 0 (greedy) or >= 1e-6, an integer top-k >= 0 (below 2^63) "
                             f"and 0 < top-p <= 1; got {self.temperature!r}, {self.top_k!r}, {self.top_p!r}")
        # fp32 holds it (and its inverse) as a normal number: 1e-300 would be 0 there, and the logits inf
        if not (number(self.repetition_penalty) and 1e-30 <= self.repetition_penalty <= 1e30):
            raise ValueError(f"repetition penalty must be a number from 1e-30 to 1e30 (1: none), got "
                             f"{self.repetition_penalty!r}")

    @classmethod
    def with_defaults(cls, defaults: dict, temperature=None, top_k=None, top_p=None,
                      repetition_penalty=None) -> "Sampling":
        """The given settings, and the model's generation_config.json defaults for those left None."""
        pick = lambda value, name, default: defaults.get(name, default) if value is None else value
        return cls(float(pick(temperature, "temperature", 0.0)), int(pick(top_k, "top_k", 0)),
                   float(pick(top_p, "top_p", 1.0)), float(pick(repetition_penalty, "repetition_penalty", 1.0)))


@dataclass
class Sampler:
    """What the decode step samples with, per row, in static device buffers: the settings of the request
    each row serves and the token ids its penalty remembers. A new setting is a new value in these tensors,
    never new code, and rows with different settings share one batch."""
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = no limit
    top_p: torch.Tensor  # [B] fp32
    penalty: torch.Tensor  # [B] fp32, 1 = none
    seen: torch.Tensor  # [B, V] bool: the ids in the row's prompt and output so far

    @classmethod
    def empty(cls, batch: int, vocab: int, device):
        f32 = lambda value: torch.full((batch,), value, dtype=torch.float32, device=device)
        return cls(f32(0.0), torch.zeros(batch, dtype=torch.int64, device=device), f32(1.0), f32(1.0),
                   torch.zeros(batch, vocab, dtype=torch.bool, device=device))

    def start(self, rows, settings: list[Sampling], prompts: list[list[int]]):
        """Rows `rows` [n] start serving these requests: their settings, and their prompts' ids seen."""
        for name, attr in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                           ("penalty", "repetition_penalty")):
            buffer = getattr(self, name)
            buffer[rows] = torch.tensor([getattr(s, attr) for s in settings], dtype=buffer.dtype, device=rows.device)
        self.seen[rows] = False
        for row, prompt in zip(rows.tolist(), prompts):
            self.seen[row, torch.tensor(prompt, device=rows.device)] = True

    def pick(self, logits, seeds, positions, rows=None, hot: bool = True):
        """The next token of rows `rows` (default: all) from their logits [n, V]; marks it seen. hot=False
        when no row samples: the argmax alone, without sample()'s sort of the vocabulary."""
        at = slice(None) if rows is None else rows  # the decode step: every row, views rather than copies
        logits = apply_penalty(logits, self.seen[at], self.penalty[at])
        nxt = sample_op(logits, seeds, positions, self.temperature[at], self.top_k[at], self.top_p[at]) if hot \
            else logits.argmax(-1)
        rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows
        self.seen.index_put_((rows, nxt), torch.ones_like(nxt, dtype=torch.bool))
        return nxt

    def read(self, cols, tokens: list[list[int]]) -> list[list[int]]:
        """What each row's output keeps of the steps in ring columns cols: their tokens (Forcing.read: records)."""
        return tokens


# ---- the decode step ---------------------------------------------------------------------------------
RING = 64  # the output history is a ring of 64 steps; the host reads it every sync_every (< 64) steps


@dataclass
class State:
    """Everything the decode step reads and advances, in static device buffers (CUDA-graph safe)."""
    tokens: torch.Tensor  # [B] the last token of each sequence, not yet in the cache
    positions: torch.Tensor  # [B] its position
    seeds: torch.Tensor  # [B] the sampling seed of the sequence in each row
    history: torch.Tensor  # [B, RING] the tokens of the last RING steps
    count: torch.Tensor  # [1] steps taken

    @classmethod
    def empty(cls, batch: int, device):
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)
        return cls(z(batch), z(batch), z(batch), z(batch, RING), z(1))


def run_block(block, *args):
    """One layer of the decode step. Compiled once: every layer has the same shapes, and its weights and
    cache tensors are arguments, so the compiled code serves all of them (a 36-layer model compiles one
    layer, not 36)."""
    return block(*args)


def push(state: State, nxt):
    """Make nxt [B] the current tokens and move the state one step on, in place."""
    state.history.index_copy_(1, state.count % RING, nxt[:, None])
    state.tokens.copy_(nxt)
    state.positions.add_(1)
    state.count.add_(1)


def advance(logits, state: State, sampler: Sampler):
    """Sample the next token from logits [B, V] and move the state on."""
    push(state, sampler.pick(logits, state.seeds, state.positions + 1))


def advance_greedy(logits, state: State, sampler: Sampler):
    """advance when no row samples: the argmax (after the penalty), without sorting the vocabulary."""
    push(state, sampler.pick(logits, state.seeds, state.positions + 1, hot=False))


@dataclass
class Forcing:
    """Teacher forcing (LLM.score): instead of a sample, each row is fed the next token of a given
    continuation, and the step records how likely the model found it. Static buffers, like State."""
    tokens: torch.Tensor  # [B, L] the continuation each row scores (padded with 0)
    start: torch.Tensor  # [B] the position of its first token (the prompt's length)
    logprobs: torch.Tensor  # [B, RING] fp32 log p of the continuation's token, per step
    argmax: torch.Tensor  # [B, RING] the most likely token, per step
    dists: torch.Tensor  # [B, RING, V] fp32 log-softmax of every step when kept, else a [1, 1, 1] stand-in

    @classmethod
    def empty(cls, batch: int, length: int, vocab: int, keep_dists: bool, device):
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)
        dists = z(batch, RING, vocab, dtype=torch.float32) if keep_dists else z(1, 1, 1, dtype=torch.float32)
        return cls(z(batch, length), z(batch), z(batch, RING, dtype=torch.float32), z(batch, RING), dists)

    def read(self, cols, tokens: list[list[int]]) -> list[list[tuple]]:
        """(token, logprob, argmax) of the steps in ring columns cols, per row; tokens: their history."""
        return [list(zip(*row)) for row in zip(tokens, self.logprobs[:, cols].tolist(), self.argmax[:, cols].tolist())]


def advance_forced(logits, state: State, f: Forcing):
    """Record log p and the argmax of the continuation's next token under logits [B, V], then feed that
    token. The token's index in the continuation follows from the row's position: no host copy per step."""
    logp = logits.log_softmax(-1)  # [B, V]
    index = (state.positions + 1 - f.start).clamp(0, f.tokens.shape[1] - 1)  # [B] the token being predicted
    nxt = f.tokens.gather(1, index[:, None])  # [B, 1]
    col = state.count % RING
    f.logprobs.index_copy_(1, col, logp.gather(1, nxt))
    f.argmax.index_copy_(1, col, logits.argmax(-1, keepdim=True))
    if f.dists.shape[-1] == logp.shape[-1]:  # kept (a shape, so decided when compiling)
        f.dists.index_copy_(1, col, logp[:, None])
    push(state, nxt[:, 0])


# Up to this batch the compiler also autotunes the layer's kernels (its matrix-vector products above all):
# faster at batch 1 for more compile time, slower or no faster above (measured: docs/performance.md).
TUNED_BATCH = 1


def autotuned(model, state: State) -> bool:
    """Whether the compiler autotunes the step: on CUDA, up to TUNED_BATCH rows, and not under tensor parallel
    (ranks tuned apart could pick kernels that round differently, and sample different tokens from the same
    logits)."""
    return state.tokens.is_cuda and state.tokens.shape[0] <= TUNED_BATCH and model.tp.size == 1


def compiler(enabled: bool, tune: bool):
    """What the decode step's functions go through: torch.compile (fullgraph, static shapes; tune: autotuned
    too), or nothing when not enabled."""
    keep_many_versions()
    options = dict(max_autotune=True, coordinate_descent_tuning=True) if tune else None
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, options=options) if enabled else fn


def keep_many_versions():
    """Every batch shape and policy compiles its own code (a full cache's shape is the longest prompt +
    max_new_tokens); dynamo keeps 8 versions of a function by default and, with fullgraph, fails on the ninth.
    Replays never check the versions, so a long-lived Engine keeps many."""
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, 1024)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4096)


class Stepper:
    """Runs the decode step: its layers and its sampling compiled (fullgraph, static shapes) and, on CUDA,
    the whole step captured as one CUDA graph and replayed. Compilation and capture happen here, on the
    empty cache, which is then emptied again (the warm-up steps wrote junk tokens that are simply marked
    as empty slots). Generation has two versions of the step, both made here: greedy rows only (the
    argmax), and some rows sampling (a sort of the vocabulary per row); `hot` says which one runs."""

    def __init__(self, model, cache, state, mode, compile=True):
        """mode: a Sampler (generate) or a Forcing (score): what decides the next token."""
        self.model, self.cache, self.state, self.mode = model, cache, state, mode
        compiled = compiler(compile, tune=autotuned(model, state))
        self.run_block = compiled(run_block)
        # two functions, not one with a flag: each compiles once, so neither ever counts as a recompile
        self.advance = {False: compiled(advance_forced)} if isinstance(mode, Forcing) else \
            {False: compiled(advance_greedy), True: compiled(advance)}
        self.graphs, self.hot = {}, False
        for hot in self.advance:
            if state.tokens.is_cuda:
                self._warm_up(hot)
                self._capture(hot)
            else:
                self.step(hot)  # compiles it now, not in the middle of a generation
        cache.reset()

    def _warm_up(self, hot: bool):
        """Two steps (compile, autotune, allocate) off the capture stream, as CUDA graph capture needs."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(hot)
        torch.cuda.current_stream().wait_stream(stream)

    def _capture(self, hot: bool):
        self.graphs[hot] = torch.cuda.CUDAGraph()
        # one memory pool for both versions: nothing a step allocates outlives it (all it keeps goes
        # into the static buffers), and only one of them ever runs at a time
        pool = self.graphs[False].pool() if hot else None
        with torch.cuda.graph(self.graphs[hot], pool=pool):
            self.step(hot)

    def step(self, hot: bool = False):
        st = self.state
        logits = self.model(st.tokens[:, None], st.positions[:, None], self.cache, run_block=self.run_block)
        self.advance[hot](logits[:, 0], st, self.mode)  # logits: [B, 1, V]

    def __call__(self):
        if self.graphs:
            self.graphs[self.hot].replay()
        else:
            self.step(self.hot)


# ---- memory: what fits ----------------------------------------------------------------------------------
PREFILL_TOKENS = 16384  # prompts are prefilled in groups of about this many (padded) tokens
SPARE = 2**30  # for the compiler's and cuBLAS's workspaces, the graph pool, fragmentation


def bytes_per_row(cfg, slots: int, dtype, extra: int = 0, kv_dtype=None) -> int:
    """GPU memory one more sequence costs: its KV slots (stored in kv_dtype, default dtype), its share of the
    decode step's logits, probabilities, noise and sort buffers (fp32/int64 over the vocabulary: 40 bytes
    per id), the ids its repetition penalty has seen (1 byte per id), and `extra` bytes. With FP8, also one
    layer's keys as values, which the rules that read keys (keydiff, rkv, knorm) dequantize each step."""
    keys = slots * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize if kv_dtype == kernel.FP8 else 0
    return KVCache.bytes_needed(cfg, 1, slots, dtype, kv_dtype=kv_dtype) + keys + 41 * cfg.vocab_size + extra


def prefill_bytes(cfg, tokens: int, dtype) -> int:
    """Transient memory of prefilling `tokens` (padded) prompt tokens: activations, one layer's K/V expanded
    to every query head, the SnapKV window's attention (fp32), the MLP of one chunk of tokens, and the
    fp32 scores of H2O / VATP's column sums (policies.attention_column_sums, within its budget)."""
    per_token = 4 * cfg.hidden_size + 6 * cfg.n_heads * cfg.head_dim
    mlp = min(tokens, MLP_TOKENS) * 3 * cfg.intermediate_size * dtype.itemsize
    return tokens * (per_token * dtype.itemsize + 4 * 32 * cfg.n_heads) + mlp + 2**28


def batch_that_fits(cfg, slots: int, longest_prompt: int, free: int, dtype, extra: int = 0, kv_dtype=None) -> int:
    """The most sequences whose cache and decode buffers fit in `free` bytes, after prefill's needs."""
    fixed = prefill_bytes(cfg, max(PREFILL_TOKENS, longest_prompt), dtype) + SPARE
    return max(0, (free - fixed) // bytes_per_row(cfg, slots, dtype, extra, kv_dtype))


# ---- the generation loop ------------------------------------------------------------------------------
@dataclass
class Stats:
    prompt_tokens: int
    generated_tokens: int
    batch: int  # sequences decoded together
    setup_s: float  # compiling the step and capturing its graph (0 when reused)
    prefill_s: float
    decode_s: float
    policy: str  # the eviction rule, "full" for none
    slots: int  # KV slots per sequence and layer
    kv_dtype: str  # what K and V are stored in
    kv_bytes: int
    full_kv_bytes: int  # what a full cache (of the same kv_dtype) for the same rows would need, each holding
    #                     the longest sequence

    def line(self) -> str:
        rate = self.generated_tokens / max(self.prefill_s + self.decode_s, 1e-9)
        kv = f"KV cache {self.policy}, {self.slots} slots/seq in {self.kv_dtype}, {self.kv_bytes / 2**20:.1f} MiB"
        if self.policy != "full":
            kv += f" (a full cache would need {self.full_kv_bytes / 2**20:.1f} MiB)"
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok in "
                f"{self.prefill_s + self.decode_s:.2f} s ({rate:.1f} tok/s, batch {self.batch}; prefill "
                f"{self.prefill_s:.2f} s, compile {self.setup_s:.1f} s); {kv}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a generation: what was generated so far (ids per prompt, as Engine.generate returns
    them) and its statistics, so that nothing finished is lost."""

    def __init__(self, outputs: list, stats: Stats):
        super().__init__()
        self.outputs, self.stats = outputs, stats


@dataclass
class Progress:
    """A run's outputs so far (per prompt) and its prefill time: what Interrupted reports."""
    outs: list | dict  # per prompt (a server's: by request number, while it runs)
    prefill_s: float = 0.0


@dataclass
class Requests:
    """What a run decodes for, by request number, and their outputs; generate and score hand over all of
    them at once, in lists (serve's arrive from a feed: FedRequests)."""
    prompts: list | dict
    limits: list | dict  # the tokens each request produces at most
    eos: list | dict  # the ids that end each request's output
    seed: list | dict | None = None  # generate and serve: each request's sampling seed and Sampling
    sampling: list | dict | None = None
    continuations: list | None = None  # score: what teacher forcing feeds each request
    on_done: Callable | None = None  # on_done(p, outs[p]) as request p is done
    on_dists: Callable | None = None  # score: on_dists(p, index, logp [n, V]) (Engine.score)
    outs: list | dict = None  # each output so far: its tokens, or teacher forcing's (token, logprob, argmax)
    waiting: deque = field(init=False)  # the requests that have no row yet

    def __post_init__(self):
        self.outs = [[] for _ in self.prompts] if self.outs is None else self.outs
        self.waiting = deque(range(len(self.prompts)))

    def ended(self, p) -> bool:
        """Request p's output ends with one of its EOS ids or has reached its limit."""
        out = self.outs[p]
        if not out:
            return False
        last = out[-1][0] if self.continuations else out[-1]  # teacher forcing's records: (token, ...)
        return last in self.eos[p] or len(out) == self.limits[p]

    def stopped(self, p) -> bool:  # only a feed stops requests early
        return False

    def keep(self, p, records) -> int:
        """Add a block's records to request p's output, up to its end (a request stopped early still keeps
        what this block decoded); returns the output's length before."""
        out, before = self.outs[p], len(self.outs[p])
        for r in records:
            if not self.ended(p):
                out.append(r)
        return before

    def settle(self, p) -> bool:
        """After request p's output grew: done (ended or stopped), it is released and this says True;
        still running, its progress is told."""
        if self.ended(p) or self.stopped(p):
            self.release(p)
            return True
        self.progress(p)
        return False

    def progress(self, p):  # only a feed is told the tokens of requests still running
        pass

    def release(self, p):
        if self.on_done:
            self.on_done(p, self.outs[p])


class FedRequests(Requests):
    """serve's requests, numbered as they arrive from the feed (feed.arrivals, between syncs), stopped early
    when it says so (feed.stopped), their tokens told at every sync (feed.progress) and at their end
    (feed.finished), then forgotten: a server runs for ever."""

    def __init__(self, feed):
        super().__init__({}, {}, {}, seed={}, sampling={}, on_done=feed.finished, outs={})
        self.feed, self.arrived = feed, 0  # arrived: requests the feed has handed over

    def arrive(self, idle: bool) -> bool:
        """Take the feed's new requests (idle: nothing runs, so this waits for one); False: the server stops."""
        arrived = self.feed.arrivals(idle=idle)
        if arrived is None:
            return False
        for prompt, limit, ends, sample_with, sample_seed in arrived:
            self.waiting.append(self.arrived)
            for values, value in ((self.prompts, prompt), (self.limits, limit), (self.eos, ends),
                                  (self.sampling, sample_with), (self.seed, sample_seed), (self.outs, [])):
                values[self.arrived] = value
            self.arrived += 1
        for p in [p for p in self.waiting if self.stopped(p)]:  # gone before they got a row: no prefill
            self.waiting.remove(p)
            self.release(p)
        return True

    def stopped(self, p) -> bool:
        return self.feed.stopped(p)

    def progress(self, p):
        self.feed.progress(p, self.outs[p])

    def release(self, p):
        super().release(p)
        for values in (self.prompts, self.outs, self.sampling, self.eos, self.limits, self.seed):
            del values[p]


class Engine:
    """Owns the model and, per batch shape, the cache, the state buffers and the compiled step.

    More prompts than rows are served as rows free up: when a sequence ends (EOS or max_new_tokens,
    seen at the next sync), the next waiting prompt is prefilled into its row of the cache and
    decoding goes on; the captured step never notices."""

    def __init__(self, model: Transformer, compile=True, sync_every=16, allow_long_context=False, kv_dtype=None):
        """allow_long_context: let sequences run past the model's max_position_embeddings (refused otherwise:
        RoPE positions past the trained context give garbage). kv_dtype: what the cache stores K and V in,
        None (the model's dtype) or kernel.FP8."""
        assert 0 < sync_every < RING
        self.model, self.compile, self.sync_every = model, compile, sync_every
        self.allow_long_context, self.kv_dtype = allow_long_context, kv_dtype
        self.key = self.stepper = self.cache = self.state = self.mode = None  # of the last batch shape
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        if self.device.type == "cuda" and not kernel.HAS_TRITON:
            raise ValueError("decoding on CUDA runs Triton kernels and Triton is not installed: pip install triton "
                             "(on Windows: triton-windows), or run on the CPU")
        head_dim = model.cfg.head_dim
        if self.device.type == "cuda" and head_dim & (head_dim - 1):  # tl.arange over the head needs a power of 2
            raise ValueError(f"the decode kernel needs a head_dim that is a power of two, and this model's is "
                             f"{head_dim}: run it on the CPU (--device cpu), which decodes without the kernel")
        if self.device.type == "cuda" and kv_dtype == kernel.FP8:
            capability = torch.cuda.get_device_capability(self.device)
            if capability < (8, 9):  # Triton's float8 e4m3 starts with Ada and Hopper
                raise ValueError(f"an FP8 KV cache needs compute capability 8.9 or newer (Ada, Hopper); "
                                 f"{torch.cuda.get_device_name(self.device)} is {capability[0]}.{capability[1]}: "
                                 f"use --kv-dtype auto")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                 budget: int | None = None, policy: str | Policy | None = None,
                 sampling: Sampling | list[Sampling] = Sampling(), seed: int | list[int] | None = None,
                 batch_size: int | None = None, on_tokens=None, prompt_rule: str = "snapkv",
                 on_done=None) -> tuple[list[list[int]], Stats]:
        """Generate for token-id prompts; returns the new ids of each (EOS included when produced)
        and the run's statistics. policy: a name from policies.POLICIES or a resolved Policy (None: longflow
        with a budget, full without). sampling: one
        Sampling for all prompts or one per prompt (rows with different settings share the batch).
        batch_size: rows decoded together (default: all prompts, or as many as fit).
        on_tokens(new_ids) streams the first prompt's output; on_done(index, new_ids) is called as each
        prompt finishes. prompt_rule: how prompts longer than the budget are compressed (policies.PROMPT_RULES)."""
        check_request(prompts, max_new_tokens, self.model.cfg.vocab_size)
        sampling = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(sampling) != len(prompts) or not all(isinstance(s, Sampling) for s in sampling):
            raise ValueError(f"sampling must be one Sampling or one per prompt ({len(prompts)})")
        if not isinstance(seed, (list, tuple)):  # one seed per prompt: its samples do not depend on its row
            seed = self.model.tp.same(random.randrange(2**31)) if seed is None else seed  # every rank's
            seed = [int(seed) + i for i in range(len(prompts))] if is_int(seed) else [seed]
        if len(seed) != len(prompts) or not all(map(is_int, seed)):
            raise ValueError(f"seed must be one int or one int per prompt ({len(prompts)}); got {seed!r}")
        seed = [int(s) for s in seed]
        if not all(-2**63 <= s < 2**63 for s in seed):  # the decode step keeps them in an int64 tensor
            raise ValueError(f"seeds must fit in 64 bits (-2**63 <= seed < 2**63; with one seed, prompt i gets "
                             f"seed + i); got {max(seed, key=abs)}")
        requests = Requests(prompts, [max_new_tokens] * len(prompts), [set(eos_ids)] * len(prompts), seed, sampling,
                            on_done=on_done)
        return drain(self._serve(requests, budget, policy, prompt_rule, "sample", batch_size, on_tokens))

    def score(self, prompts: list[list[int]], continuations: list[list[int]], budget: int | None = None,
              policy: str | Policy | None = None, batch_size: int | None = None, prompt_rule: str = "snapkv",
              on_dists=None) -> tuple[list[list[tuple[int, float, int]]], Stats]:
        """Teacher forcing: prefill each prompt (compressed as generate would), then feed its continuation
        one token at a time through the same decode step, evicting as generation would. Returns, per
        pair, (token, log p(token | everything before it), the argmax there) for every continuation token.
        on_dists(pair, index, logp [n, V]) receives the full log-distributions of continuation tokens
        index .. index + n - 1 as they are computed (it costs a [B, RING, V] buffer)."""
        return drain(self.score_steps(prompts, continuations, budget, policy, batch_size, prompt_rule, on_dists))

    def score_steps(self, prompts, continuations, budget=None, policy=None, batch_size=None,
                    prompt_rule="snapkv", on_dists=None):
        """score, as a generator that yields after every host sync and returns score's result: several
        engines advanced in turn score in lock-step (eval.py's fidelity compares their distributions
        position by position without keeping them)."""
        check_request(prompts, 1, self.model.cfg.vocab_size)
        if not isinstance(continuations, (list, tuple)) or len(continuations) != len(prompts):
            raise ValueError(f"give one continuation per prompt: {len(prompts)} prompts, "
                             f"{len(continuations) if isinstance(continuations, (list, tuple)) else 'no list of'} "
                             f"continuations")
        check_request(continuations, 1, self.model.cfg.vocab_size, "continuation")
        # the buffer's length is part of the compiled step's shapes: a power of two (>= RING) lets continuations
        # of many lengths share one compiled step (the index into it is clamped, the padding never fed)
        length = max(RING, 2 ** math.ceil(math.log2(max(map(len, continuations)))))
        forcing = (length, on_dists is not None)
        requests = Requests(prompts, [len(c) for c in continuations], [set()] * len(prompts),
                            continuations=continuations, on_dists=on_dists)
        return (yield from self._serve(requests, budget, policy, prompt_rule, forcing, batch_size))

    def _serve(self, requests: Requests, budget, policy, prompt_rule, mode, batch_size, on_tokens=None):
        """The common part of generate and score, a generator that yields at every host sync. mode: "sample",
        or (continuation buffer length, keep_dists) for teacher forcing."""
        if batch_size is not None and (not is_int(batch_size) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, or None for as many as fit; got {batch_size!r}")
        if not isinstance(policy, Policy):
            policy = resolve_policy(policy, budget, prompt_rule=prompt_rule)
        if (budget is None) == policy.evicts:
            raise ValueError(f"policy {policy.name!r} and budget {budget} do not go together: an "
                             f"evicting policy needs a budget, the full policy takes none")
        prompts, limits = requests.prompts, requests.limits
        self.check_context(prompts, limits)
        longest = max(map(len, prompts))
        if budget is None:  # no compression: room for every token
            budget = longest + max(limits)
        dists = 4 * RING * self.model.cfg.vocab_size if requests.on_dists else 0  # bytes per row of Forcing.dists
        batch = self._batch_size(batch_size, len(prompts), budget, longest, dists)
        t0 = sync_time(self.device)
        self._prepare(batch, budget, policy, prompt_rule, mode)
        t1 = sync_time(self.device)
        run = Progress(requests.outs)
        stats = lambda: self._stats(prompts, run, batch, t1 - t0, sync_time(self.device) - t1, budget, policy)
        try:
            yield from self._run(run, requests, on_tokens)
        except KeyboardInterrupt:
            raise Interrupted(run.outs, stats()) from None
        return run.outs, stats()

    def _stats(self, prompts, run: Progress, batch, setup_s, seconds, slots, policy) -> Stats:
        cfg, outs = self.model.cfg, run.outs
        longest = max(len(p) + len(o) for p, o in zip(prompts, outs) if o) if any(outs) else 0  # a full cache's rows
        admitted = sum(len(p) for p, o in zip(prompts, outs) if o)  # all, unless interrupted
        return Stats(admitted, sum(map(len, outs)), batch, setup_s, run.prefill_s,
                     seconds - run.prefill_s, policy.name, slots,
                     "fp8" if self.kv_dtype == kernel.FP8 else str(self.dtype).removeprefix("torch."),
                     # every rank's KV heads (cfg is one rank's part under tensor parallel)
                     self.model.tp.size * KVCache.bytes_needed(cfg, batch, slots, self.dtype, policy, self.kv_dtype),
                     self.model.tp.size * KVCache.bytes_needed(cfg, batch, longest, self.dtype, POLICIES["full"],
                                                               self.kv_dtype))

    def check_context(self, prompts, limits):
        """Refuse sequences longer than the model's trained context, unless allowed."""
        limit = self.model.cfg.max_position_embeddings
        i = max(range(len(prompts)), key=lambda i: len(prompts[i]) + limits[i])
        if limit and not self.allow_long_context and len(prompts[i]) + limits[i] > limit:
            raise ValueError(f"prompt ({len(prompts[i])} tokens) + new tokens ({limits[i]}) = "
                             f"{len(prompts[i]) + limits[i]} positions, past the model's max_position_embeddings "
                             f"{limit} (RoPE beyond its trained context gives garbage); shorten them, or allow it "
                             f"explicitly (--allow-long-context, LLM(allow_long_context=True))")

    def free_bytes(self) -> int:
        """Free GPU memory, counting the current cache, which is given back before a new one is made."""
        free = torch.cuda.mem_get_info(self.device)[0]
        if self.cache is not None:
            free += KVCache.bytes_needed(self.model.cfg, self.state.tokens.shape[0], self.cache.slots, self.dtype,
                                         self.cache.policy, self.kv_dtype)
        return free

    def _batch_size(self, asked: int | None, n_prompts: int, slots: int, longest: int, extra: int = 0) -> int:
        """Check an asked batch size against free GPU memory (before allocating), or pick one. extra: bytes
        per row beyond the cache and the decode step's buffers."""
        batch = min(asked or n_prompts, n_prompts)
        if self.device.type != "cuda":  # only a check that the cache can exist in this machine's memory
            need = KVCache.bytes_needed(self.model.cfg, batch, slots, self.dtype, kv_dtype=self.kv_dtype)
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > ram:
                raise ValueError(f"{batch} sequences of {slots} KV slots need {need / 2**30:.1f} GiB, more than "
                                 f"this machine's {ram / 2**30:.1f} GiB; lower the batch size ({batch}), "
                                 f"--max-new-tokens or --budget")
            return batch
        free = self.free_bytes()
        # tensor parallel: the rows every rank can hold (cfg is this rank's part of the model)
        fits = self.model.tp.smallest(batch_that_fits(self.model.cfg, slots, longest, free, self.dtype, extra,
                                                      self.kv_dtype))
        if asked is None and fits > 0:
            return min(batch, fits)
        if batch > fits:
            need = (batch * bytes_per_row(self.model.cfg, slots, self.dtype, extra, self.kv_dtype) + SPARE
                    + prefill_bytes(self.model.cfg, max(PREFILL_TOKENS, longest), self.dtype))
            raise ValueError(f"{batch} sequences of {slots} KV slots need {need / 2**30:.2f} GiB of GPU "
                             f"memory but {free / 2**30:.2f} GiB is free ({fits} would fit); lower the "
                             f"batch size, --max-new-tokens or --budget")
        return batch

    def _prepare(self, batch, slots, policy, prompt_rule, mode):
        """Reuse the cache, buffers and captured graph when the shape and policy repeat. mode: "sample", or
        teacher forcing's (continuation buffer length, keep_dists)."""
        key = (batch, slots, policy, prompt_rule, mode)
        if self.key == key:
            self.cache.reset()
            return
        self.key = self.stepper = self.cache = self.state = self.mode = None  # free the old cache first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = KVCache(self.model.cfg, batch, slots, self.device, self.dtype, policy, prompt_rule,
                             self.kv_dtype, self.model.tp)
        self.state = State.empty(batch, self.device)
        vocab = self.model.cfg.vocab_size
        self.mode = Sampler.empty(batch, vocab, self.device) if mode == "sample" else \
            Forcing.empty(batch, mode[0], vocab, mode[1], self.device)
        self.stepper = Stepper(self.model, self.cache, self.state, self.mode, self.compile)
        self.key = key

    def serve(self, feed, batch_size: int, slots: int, policy: Policy, prompt_rule: str = "snapkv"):
        """Continuous batching, for server.py: a generator that decodes the requests feed.arrivals() hands
        over, each admitted into a free row at a host sync, until it returns None. slots: KV slots per row (the
        budget; for the full policy, room for the longest request the feed will give). The feed also says
        which requests to stop early (feed.stopped(i)) and is given each one's tokens (feed.progress(i, ids)
        at every sync, feed.finished(i, ids) at its end)."""
        self._prepare(batch_size, slots, policy, prompt_rule, "sample")
        requests = FedRequests(feed)
        yield from self._run(Progress(requests.outs), requests)

    def _run(self, run: Progress, requests: Requests, on_tokens=None):
        """Decode until every request is done, refilling rows as they free up, yielding after each host sync.
        Fills run.outs (requests.outs). With a feed (serve), requests arrive between syncs and the loop waits
        for them when it has none."""
        serving = [None] * self.state.tokens.shape[0]  # the request each row decodes for
        fed = isinstance(requests, FedRequests)  # serve: requests arrive between syncs
        self.state.count.zero_()
        steps_read = 0
        while True:
            if fed and not self._take_arrivals(requests, serving):
                return  # the server stops
            while requests.waiting and None in serving:  # fill free rows (a request may end at its first token)
                run.prefill_s += self._fill_free_rows(requests, serving)
            if on_tokens:
                on_tokens(requests.outs[0])
            if all(p is None for p in serving):
                if fed:
                    continue  # a server waits for its next request
                return
            if requests.sampling:  # the step that sorts the vocabulary only while some row samples
                self.stepper.hot = any(requests.sampling[p].temperature > 0 for p in serving if p is not None)
            for _ in range(self.sync_every):
                self.stepper()
            # the one host sync every sync_every steps. Its index lives on the host and the device copies are
            # freed at once, so the GPU memory in use stays the same from the first token to the last (bench.py
            # --validate asserts it; an index kept on the GPU until the next sync added one block after the first)
            cols = torch.arange(steps_read, steps_read + self.sync_every) % RING
            block = self.mode.read(cols, self.state.history[:, cols].tolist())  # [B][sync_every] records
            steps_read += self.sync_every
            self._keep_block(requests, serving, block, cols)
            yield

    def _take_arrivals(self, requests: FedRequests, serving: list) -> bool:
        """serve, at every sync: the feed's new requests (when nothing runs, this waits for one). A free row keeps
        decoding junk, so its cache is emptied each time (else a full cache's row would fill up). False: the
        server stops."""
        if not requests.arrive(idle=not requests.waiting and all(p is None for p in serving)):
            return False
        free = [b for b in range(len(serving)) if serving[b] is None]
        if free:
            self.cache.reset(torch.tensor(free, device=self.device))
        return True

    def _fill_free_rows(self, requests: Requests, serving: list) -> float:
        """Prefill waiting requests into the free rows, each with its first output (a request done at once
        frees its row again). Returns the seconds it took."""
        rows = [b for b in range(len(serving)) if serving[b] is None][:len(requests.waiting)]
        taken = [requests.waiting.popleft() for _ in rows]
        t = sync_time(self.device)
        firsts = self._admit(rows, requests, taken)
        for b, p, first in zip(rows, taken, firsts):
            requests.outs[p].append(first)
            serving[b] = p
            if requests.settle(p):
                serving[b] = None
        return sync_time(self.device) - t

    def _keep_block(self, requests: Requests, serving: list, block: list, cols):
        """Each busy row's records of the block (ring columns cols) into its request's output; with teacher
        forcing's on_dists, their log-distributions handed over too. A request that is done frees its row."""
        for b, p in enumerate(serving):
            if p is None:
                continue
            before = requests.keep(p, block[b])
            if requests.on_dists:
                requests.on_dists(p, before, self.mode.dists[b, cols[:len(requests.outs[p]) - before]])
            if requests.settle(p):
                serving[b] = None

    def _admit(self, rows: list[int], requests: Requests, taken: list[int]) -> list:
        """Prefill requests `taken` into cache `rows`, set those rows' decode state, and return each
        request's first output: a sampled token, or with teacher forcing the first continuation token's
        record. Groups of about PREFILL_TOKENS padded tokens at a time."""
        prompts, firsts = requests.prompts, []
        while rows:
            n = max(1, PREFILL_TOKENS // max(len(prompts[p]) for p in taken))
            group, rows, batch, taken = rows[:n], rows[n:], taken[:n], taken[n:]
            T = max(len(prompts[p]) for p in batch)
            tokens = torch.zeros(len(batch), T, dtype=torch.int64)
            positions = torch.full((len(batch), T), -1, dtype=torch.int64)
            for i, p in enumerate(batch):
                tokens[i, :len(prompts[p])] = torch.tensor(prompts[p])
                positions[i, :len(prompts[p])] = torch.arange(len(prompts[p]))
            r = torch.tensor(group, device=self.device)
            lengths = torch.tensor([len(prompts[p]) for p in batch], device=self.device)
            logits = self.model(tokens.to(self.device), positions.to(self.device), self.cache, rows=r,
                                last=lengths - 1)  # [n, V]
            if requests.continuations:
                first, records = self._force_first(group, batch, lengths, logits, requests)
            else:
                first, records = self._sample_first(r, batch, lengths, logits, requests)
            self.state.tokens[r], self.state.positions[r] = first, lengths
            firsts += records
        return firsts

    def _sample_first(self, r, batch, lengths, logits, requests: Requests):
        """The first token of requests `batch`, sampled from their prompts' last logits [n, V] with their own
        settings; rows r [n] take their settings and seeds. Returns the tokens [n], and as a list (their records)."""
        seeds = torch.tensor([requests.seed[p] for p in batch], device=self.device)
        self.mode.start(r, [requests.sampling[p] for p in batch], [requests.prompts[p] for p in batch])
        first = self.mode.pick(logits, seeds, lengths, r)
        self.state.seeds[r], records = seeds, first.tolist()
        return first, records

    def _force_first(self, rows: list[int], batch, lengths, logits, requests: Requests):
        """Teacher forcing: the prompts' last logits score each continuation's first token; the rows get
        their continuation, which the step then feeds. Returns the first tokens [n] and their records."""
        f, r, continuations = self.mode, torch.tensor(rows, device=self.device), requests.continuations
        f.tokens[r] = 0
        for row, p in zip(rows, batch):
            f.tokens[row, :len(continuations[p])] = torch.tensor(continuations[p], device=self.device)
        f.start[r] = lengths
        first = f.tokens[r, 0]
        logp = logits.log_softmax(-1)  # [n, V]
        if requests.on_dists:
            for i, p in enumerate(batch):
                requests.on_dists(p, 0, logp[i:i + 1])
        records = zip(first.tolist(), logp.gather(1, first[:, None])[:, 0].tolist(), logits.argmax(-1).tolist())
        return first, list(records)


def drain(steps):
    """Run a generator to its end and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def check_request(prompts, max_new_tokens, vocab_size: int, what: str = "prompt"):
    if not prompts:
        raise ValueError(f"no {what}s given: give a list of at least one")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"empty {what}: give at least one token of {what} text")
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not all(is_int(t) and 0 <= t < vocab_size for p in prompts for t in p):
        raise ValueError(f"{what} token ids must be integers in [0, {vocab_size}) for this model")


def sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def pick_device(device: str | None, dtype: str | torch.dtype | None):
    """CUDA when available, else CPU; bfloat16 on CUDA, float32 on CPU, unless asked otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ValueError(f"unsupported device {str(device)!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was asked for but is not available on this machine; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{device} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    return device, dtype


# ---- the command line ---------------------------------------------------------------------------------
DEFAULT_PROMPT = "Briefly, why is the sky blue?"


def parse_args(argv=None):
    p = Parser(prog="generate.py", description="Generate text with LongFlow KV-cache compression.")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="Hugging Face id or local folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt text")
    src.add_argument("--prompt-file", help="a file whose whole content is the prompt ('-': standard input)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when it has one)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="let Qwen3 think before answering (its chat template's enable_thinking)")
    add_cache_options(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="tokens generated at most")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let prompt + new tokens run past the model's max_position_embeddings")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (default: generation_config.json)")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of ids already seen (transformers' definition); default: "
                        "generation_config.json, else 1 (none)")
    p.add_argument("--batch-size", type=batch_size, default=1,
                   help="sequences generated together, or 'max': as many as fit in GPU memory")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    return p.parse_args(argv)


def run(args):
    check_policy_args(args)
    rule = args.prompt_compression or "snapkv"
    policy = resolve_policy(args.policy, args.budget, args.sinks, args.window, rule)
    device, dtype = pick_device(args.device, args.dtype)
    tp, device = parallel.join(device)  # under torchrun: this rank's part of the model, its GPU
    text = parallel.on_rank0(lambda: read_prompt(args))  # standard input is rank 0's
    if not text.strip():
        raise ValueError("the prompt is empty; give some text with --prompt or --prompt-file")
    model, tok = load(args.model, device, dtype, tp)
    sampling = Sampling.with_defaults(tok.defaults, args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    check_sampling_args(args, sampling)
    ids = prompt_ids(tok, text, args)
    engine = Engine(model, compile=not args.no_compile, allow_long_context=args.allow_long_context,
                    kv_dtype=KV_DTYPES[args.kv_dtype])
    batch = args.batch_size if args.batch_size != "max" else max_batch(engine, args, len(ids))
    screen = Screen(tok, batch)
    try:
        outs, stats = engine.generate([ids] * batch, args.max_new_tokens, tok.eos_ids, args.budget, policy, sampling,
                                      args.seed, batch, on_tokens=screen.stream if batch == 1 else None,
                                      prompt_rule=rule)
    except Interrupted as stop:  # Ctrl-C: what was generated so far, and its statistics
        screen.show(stop.outputs, stop.stats)
        raise
    screen.show(outs, stats)


def prompt_ids(tok, text: str, args) -> list[int]:
    """The prompt through the model's chat template (--chat; by default when it has one), or as plain text."""
    if args.chat and tok.template is None:
        raise ValueError("--chat: this model has no chat template; drop --chat to give the prompt as plain text")
    chat = tok.template is not None if args.chat is None else args.chat
    return tok.chat([{"role": "user", "content": text}], args.thinking) if chat else tok.encode(text)


def max_batch(engine: Engine, args, prompt_len: int) -> int:
    """--batch-size max: the most copies of the prompt whose cache fits for the whole output length."""
    if engine.device.type != "cuda":
        raise ValueError("--batch-size max sizes the batch from free GPU memory; give a number on the CPU")
    slots = prompt_len + args.max_new_tokens if args.budget is None else args.budget
    fits = engine.model.tp.smallest(batch_that_fits(engine.model.cfg, slots, prompt_len, engine.free_bytes(),
                                                    engine.dtype, kv_dtype=engine.kv_dtype))
    if fits == 0:
        raise ValueError("not even one sequence fits in free GPU memory; lower --max-new-tokens or --budget")
    return fits


class Screen:
    """What generate.py prints: a single sequence streamed as it is generated, several each whole at the end,
    then the run's statistics."""

    def __init__(self, tok, batch: int):
        self.tok, self.batch, self.printed = tok, batch, ""

    def stream(self, new_ids, last=False):  # print the text decoded so far, past what is already on screen
        out = self.tok.decode(new_ids)
        if out.endswith("\ufffd") and not last:  # half of a multi-byte character: wait for the rest
            return
        print(out[len(self.printed):], end="", flush=True)
        self.printed = out

    def show(self, outs, stats):  # the text (a single sequence has streamed already), then the statistics
        if self.batch == 1:
            self.stream(outs[0], last=True)  # whatever a cut-off character held back
        else:
            for i, o in enumerate(outs):
                print(f"--- sequence {i} ---\n{self.tok.decode(o)}")
        print("\n" + stats.line(), flush=True)


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again
    args = parse_args(argv)
    # MemoryError: before any check can run, e.g. the prompt copied for --batch-size 10**11
    run_command(lambda: run(args), MemoryError,
                lambda: "out of host memory; lower --batch-size, --max-new-tokens or --budget")


if __name__ == "__main__":
    main()
