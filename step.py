"""The decode step: one token for every row of the batch, as the host replays it.

The step (Stepper.step) reads and advances its own state in place (current tokens, positions, the output
history), so the host only replays it: one layer compiled with torch.compile and used for every layer,
the sampling compiled, the whole step captured once as a CUDA graph, never synchronised with inside the
step. What decides the next token is the step's mode: a Sampler (generation) or a Forcing (teacher
forcing: the next token of a given continuation, and how likely the model found it).
"""
from dataclasses import dataclass

import torch

from sampling import Sampler

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
