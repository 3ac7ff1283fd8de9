"""The decode step: one token for every row of the batch, as the host replays it.

The step (Stepper.step) reads and advances its own state in place (current tokens, positions, the output
history), so the host only replays it: one layer compiled with torch.compile and used for every layer,
the sampling compiled, the whole step captured as a CUDA graph, never synchronised with inside the step. It is
made for a ladder of batch sizes (batch_sizes) and runs at the smallest that holds as many rows as are busy: the
engine moves busy rows down into it (move_rows), so a lone request decodes at the speed of batch 1. What decides
the next token is the step's mode: a Sampler (generation) or a Forcing (teacher forcing: the next token of a
given continuation, and how likely the model found it).
"""
import copy
import sys
import time
import types
from dataclasses import dataclass
from typing import ClassVar

import torch

from sampling import Sampler, on_device

RING = 64  # the output history is a ring of 64 steps; the host reads it every sync_every (< 64) steps


@dataclass
class State:
    """Everything the decode step reads and advances, in static device buffers (CUDA-graph safe)."""
    tokens: torch.Tensor  # [B] the last token of each sequence, not yet in the cache
    positions: torch.Tensor  # [B] its position
    seeds: torch.Tensor  # [B] the sampling seed of the sequence in each row
    history: torch.Tensor  # [B, RING] the tokens of the last RING steps
    count: torch.Tensor  # [1] steps taken
    ROWS: ClassVar = ("tokens", "positions", "seeds", "history")  # per row (first_rows, move_rows)

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
    ROWS: ClassVar = ("tokens", "start", "logprobs", "argmax", "dists")

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


# ---- the busy rows: the step at a smaller batch, and the rows moved down to it -----------------------------
def batch_sizes(most: int) -> list[int]:
    """The batch sizes the step is made for, up to `most` (the engine's rows): 1, 2, 4, 8, every 8 rows to 64,
    every 16 above, and `most`. A step's cost grows with its rows, so rounding the busy rows up to the next size
    costs at most about a tenth of a step (docs/performance.md, "Measurements that code comments used to hold")."""
    ladder = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, most, 16))
    return [n for n in ladder if n < most] + [most]


def first_rows(x, n: int):
    """Rows 0..n-1 of x: a tensor, a list, tuple or dict of them, or an object whose per-row parts its ROWS names
    (State, Sampler, Forcing, KVCache and its Layers); views of the same memory, so the step at batch n reads
    and writes the engine's buffers. For n > 1 their batch dimension is marked dynamic: one compiled step
    serves every size."""
    if isinstance(x, torch.Tensor):
        return x if x.shape[0] == 1 else dynamic_batch(x[:n])  # one row whatever the batch: a stand-in
    if isinstance(x, (list, tuple)):
        return type(x)(first_rows(t, n) for t in x)
    if isinstance(x, dict):
        return {name: first_rows(t, n) for name, t in x.items()}
    view = copy.copy(x)
    for name in x.ROWS:
        setattr(view, name, first_rows(getattr(x, name), n))
    return view


def move_rows(x, src, dst):
    """Copy rows src [m] of x (whatever first_rows takes) into rows dst [m], which are not among src."""
    if isinstance(x, torch.Tensor):
        if x.shape[0] > 1:  # not a stand-in
            x[dst] = x[src]
        return
    parts = x if isinstance(x, (list, tuple)) else x.values() if isinstance(x, dict) else (getattr(x, n) for n in x.ROWS)
    for part in parts:
        move_rows(part, src, dst)


def own_code(fn):
    """A copy of fn with a code object of its own: torch.compile keeps compiled versions per code object, so the
    copy compiles apart from fn, and neither counts as a recompile of the other."""
    name = fn.__name__ + "_alone"
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__)


def dynamic_batch(x: torch.Tensor) -> torch.Tensor:
    """x, its first dimension (the batch) marked dynamic when it has more than one row: the compiler then makes
    code for every batch size from 2 up (it specialises 1, which is compiled on its own). Where the compiler was never
    loaded (an eager run: loading it is 1.3 s of a process's start), nothing is compiled and nothing needs marking."""
    if x.shape[0] > 1 and "torch._dynamo" in sys.modules:
        torch._dynamo.mark_dynamic(x, 0)
    return x


def for_any_batch(fn):
    """fn, its tensor arguments' batch dimension marked dynamic at every call (the activations are new
    tensors each step; the buffers it reads come marked from first_rows)."""
    return lambda *args: fn(*(dynamic_batch(a) if isinstance(a, torch.Tensor) else a for a in args))


def autotuned(model, on_cuda: bool) -> bool:
    """Whether the compiler autotunes the step at batch 1 (its matrix-vector products above all: faster there
    for more compile time, slower or no faster at larger batches; docs/performance.md): on CUDA, and not under
    tensor parallel (ranks tuned apart could pick kernels that round differently, and sample different tokens
    from the same logits)."""
    return on_cuda and model.tp.size == 1


def compiler(enabled: bool, tune: bool):
    """What the decode step's functions go through: torch.compile (fullgraph; static shapes but for the batch
    dimensions that first_rows marks; tune: autotuned too), or nothing when not enabled."""
    if enabled:  # (torch._dynamo's import is 1.3 s of a process's start that no eager run needs)
        keep_many_versions()
    options = dict(max_autotune=True, coordinate_descent_tuning=True) if tune else None
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, options=options) if enabled else fn


def keep_many_versions():
    """Every cache shape and policy compiles its own code (a full cache's shape is the longest prompt +
    max_new_tokens); dynamo keeps 8 versions of a function by default and, with fullgraph, fails on the ninth.
    Replays never check the versions, so a long-lived Engine keeps many."""
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, 1024)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4096)


# ---- the server's prefill: one layer compiled for groups of prompts of any size and length -----------------
def compiled_prefill():
    """The run_block that Transformer.forward runs a prefill's layers with, compiled (fullgraph). Eagerly a layer
    launches about a hundred small kernels, a 36-layer model's prefill some 3,700, and the host's time to launch
    them outweighs the GPU's work on a short prompt (docs/performance.md, "Measurements that code comments used
    to hold"); a server prefills such groups all day, between the decode's blocks. One compiled version serves
    every group of two or more prompts of any length from 2 tokens (for_any_prompts), another a lone prompt: the
    compiler specialises a dimension of size 1 (one-token prompts would get a third; the engine prefills them
    eagerly)."""
    keep_many_versions()
    return for_any_prompts(torch.compile(own_code(run_block), fullgraph=True, dynamic=False))


def for_any_prompts(fn):
    """fn, the first two dimensions (prompts, tokens) of its tensor arguments (the activations: x, cos, sin,
    positions, rows) marked dynamic at every call (a size of 1 is specialised all the same). The cache's tensors,
    in its Layer argument, keep their static shapes."""
    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                for dim in range(min(a.dim(), 2)):
                    torch._dynamo.maybe_mark_dynamic(a, dim)
        return fn(*args)
    return call


class PrefillGraphs:
    """The server's compiled prefill of small groups (1 to GROUPS prompts, padded up to one of LENGTHS tokens),
    captured as CUDA graphs at start-up, one per group size and length. Compiled, a prefill still launches
    about a thousand kernels (36 layers), and the GPU waits for them, several times as long as its work on a
    short prompt (docs/performance.md, "Measurements that code comments used to hold"). A replay is one launch.
    The graphs read static inputs (copied in before each replay) and share the decode step's memory pool: one
    graph runs at a time, and a replay's logits are copied out."""

    LENGTHS = (16, 32, 64, 128, 256, 512)
    GROUPS = 8

    def __init__(self, model, cache, rows: int, run_block, pool):
        """rows: the cache's; run_block: the compiled prefill's (compiled_prefill)."""
        self.model, self.cache, self.run_block, self.pool = model, cache, run_block, pool
        self.lengths = [T for T in self.LENGTHS if T < cache.slots]  # a prompt that fills the slots is compressed
        self.most = min(self.GROUPS, rows)
        self.inputs, self.logits, self.graphs = {}, {}, {}
        torch.cuda.empty_cache()  # (as each capture does: else its release of cached blocks hides what they take)
        stream, before = torch.cuda.Stream(), torch.cuda.memory_reserved()
        for n in range(self.most, 0, -1):  # the largest first: the others reuse its memory
            for T in reversed(self.lengths):
                self._capture(n, T, stream)
        self.bytes = torch.cuda.memory_reserved() - before  # what they added to the GPU memory held
        cache.reset()  # the warm-ups prefilled junk into rows 0..most-1

    def length(self, n: int, T: int) -> int | None:
        """The padded length a group of n prompts of at most T tokens replays at; None: no graph holds it."""
        return next((L for L in self.lengths if L >= T), None) if n <= self.most else None

    def _capture(self, n: int, T: int, stream):
        device = self.model.model.embed_tokens.weight.device
        tokens = torch.zeros(n, T, dtype=torch.int64, device=device)  # [n, T]
        positions = torch.arange(T, device=device).repeat(n, 1)  # [n, T]
        rows, last = torch.arange(n, device=device), torch.full((n,), T - 1, device=device)  # [n] each
        self.inputs[n, T] = (tokens, positions, rows, last)
        run = lambda: self.model.run(tokens, positions, self.cache, rows, last, self.run_block)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a warm-up off the capture stream, as capture needs
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[n, T] = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[n, T] = run()  # [n, V]

    def __call__(self, tokens, positions, rows, last):
        """The prefill of tokens, positions [n, T] (on the host, T one of the lengths) into cache rows [n] (on the
        device); last [n]: each prompt's last index. Returns the logits there, [n, V]."""
        inputs = self.inputs[tokens.shape]
        for static, x in zip(inputs, (tokens, positions, rows, last)):
            static.copy_(on_device(x, static.device))
        self.graphs[tokens.shape].replay()
        return self.logits[tokens.shape].clone()  # the next replay overwrites them


class Stepper:
    """Runs the decode step: its layers and its sampling compiled (fullgraph) and, on CUDA, the whole step
    captured as a CUDA graph and replayed, one graph per batch size of `sizes` (default batch_sizes(batch)),
    all in one memory pool. The step at size n decodes rows 0..n-1 (first_rows) and leaves the others as they
    are; `size` says which runs. Compilation and capture happen here, on the empty cache, which is then
    emptied again (the warm-up steps wrote junk tokens that are simply marked as empty slots). Generation
    has two versions of the step, both made here: greedy rows only (the argmax), and some rows sampling (a
    sort of the vocabulary per row); `hot` says which one runs."""

    def __init__(self, model, cache, state, mode, compile=True, sizes=None):
        """mode: a Sampler (generate) or a Forcing (score): what decides the next token."""
        self.model, self.cache, self.state, self.mode = model, cache, state, mode
        batch, cuda = state.tokens.shape[0], state.tokens.is_cuda
        self.sizes = sizes or batch_sizes(batch)
        compiled = compiler(compile, tune=False)
        # two functions, not one with a flag: each compiles once, so neither ever counts as a recompile
        advance_fns = {False: advance_forced} if isinstance(mode, Forcing) else {False: advance_greedy, True: advance}
        # every size from 2 up shares one compiled version of each function; batch 1 has its own (the compiler
        # specialises a dimension of size 1), autotuned on CUDA
        self.run_block = {"more": for_any_batch(compiled(run_block)),
                          1: compiler(compile, tune=autotuned(model, cuda))(own_code(run_block))}
        self.advance = {(hot, "more"): for_any_batch(compiled(fn)) for hot, fn in advance_fns.items()}
        self.advance |= {(hot, 1): compiled(own_code(fn)) for hot, fn in advance_fns.items()}
        self.views = {n: first_rows((cache, state, mode), n) for n in self.sizes}  # what the step at size n reads
        self.graphs, self.hot, self.size = {}, False, batch
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        # one side stream for every warm-up: the allocator caches freed memory per stream, so a stream per size
        # would keep each size's step temporaries apart instead of reusing the largest's
        self.stream = torch.cuda.Stream() if cuda else None
        for n in sorted(self.sizes, reverse=True):  # the largest first: the smaller graphs reuse its memory
            for hot in advance_fns:
                if cuda:
                    self._warm_up(hot, n)
                    self._capture(hot, n)
                else:
                    self.step(hot, n)  # compiles it now, not in the middle of a generation
        cache.reset()

    def fit(self, busy: int) -> int:
        """The smallest size that holds `busy` rows."""
        return min(n for n in self.sizes if n >= busy)

    def _warm_up(self, hot: bool, n: int):
        """Two steps (compile, autotune, allocate) off the capture stream, as CUDA graph capture needs."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self.step(hot, n)
        torch.cuda.current_stream().wait_stream(self.stream)

    def _capture(self, hot: bool, n: int):
        self.graphs[hot, n] = graph = torch.cuda.CUDAGraph()
        # one memory pool for every graph: nothing a step allocates outlives it (all it keeps goes into the
        # static buffers), and only one of them ever runs at a time
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(hot, n)

    def step(self, hot: bool = False, n: int | None = None):
        """One decode step at size n (default: size), eagerly or through the compiled functions."""
        n = n or self.size
        cache, st, mode = self.views[n]
        version = 1 if n == 1 else "more"
        logits = self.model(st.tokens[:, None], st.positions[:, None], cache, run_block=self.run_block[version])
        self.advance[hot, version](logits[:, 0], st, mode)  # logits: [n, 1, V]

    def move_rows(self, src: list[int], dst: list[int]):
        """Move rows src into the free rows dst: their cache, decode state and sampling (or teacher forcing)."""
        src, dst = (on_device(rows, self.state.tokens.device) for rows in (src, dst))
        move_rows((self.cache, self.state, self.mode), src, dst)

    def __call__(self):
        if self.graphs:
            self.graphs[self.hot, self.size].replay()
        else:
            self.step(self.hot)


# ---- the device's time -----------------------------------------------------------------------------------
def sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DeviceTimer:
    """The device's time for the work queued from its making to stop(), read after a later host sync without
    adding one: CUDA events on a GPU; on the CPU, which runs each op as it is called, the host's clock."""

    def __init__(self, device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.stream else None
        self.times = [time.perf_counter()] * 2
        if self.events:
            self.events[0].record(self.stream)

    def stop(self) -> "DeviceTimer":
        if self.events:
            self.events[1].record(self.stream)
        self.times[1] = time.perf_counter()
        return self

    def seconds(self) -> float:
        if not self.events:
            return self.times[1] - self.times[0]
        self.events[1].synchronize()  # done already after the host sync that reads the work's results
        return self.events[0].elapsed_time(self.events[1]) / 1e3
