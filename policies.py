"""The eviction policies: which token a full cache drops, one class each, and how a long prompt is cut.

A policy is one argmin per decode step over a per-slot score: the token in the lowest-scoring slot is the
one the next token overwrites. Empty slots always go first, and the policy's protected slots (its first
`n_sink` positions and its `window` most recent) never. A policy declares, in one place:

    keeps    the tensors it keeps per layer beside the slots (a Kept each: per slot, per KV head, the last
             queries), from which the cache allocates them, the memory planner counts them, and bench.py
             fills them; each Kept also says how it changes when a token is written
    score    its eviction score of every slot, lowest goes: [B, H_kv, S], or [B, 1, S] for one score of
             the whole layer (policies decided per layer, over the mean of their heads, say per_head=False)
    attend   attention over the slots and the slot the next token overwrites; the base class attends,
             then takes the argmin of `score` (kernel.choose_slot decides, for every rule)

A rule the fused kernel scores (KernelPolicy) declares instead, as data, what the kernel scores it by
(`scoring`, a kernel.Scoring): the kernel attends and decides in one pass, and what it keeps follows from
that. The prompt's attention seeds a kept state (`prompt_seed`: H2O, VATP, LongFlow-EMA), and a prompt longer
than the budget is cut by SnapKV, StreamingLLM, or the policy's own score over the prompt (PROMPT_RULES). A rule that
needs data of the model's own (TriAttention: statistics of its queries) loads it in `for_model(model)` and gives
each layer its part in `layer_data` (the cache's Layer.data).

To add a policy: a class here and a line in POLICIES (README.md, "Add a rule").
"""
import numbers
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

import calibration
import kernel
from parallel import SINGLE, Group

SNAPKV_WINDOW = 32  # prompt compression keeps the last 32 prompt tokens and ranks the rest by their attention
SNAPKV_POOL = 5
PROMPT_RULES = ("snapkv", "streaming", "decode")


# ---- what a policy keeps beside the slots --------------------------------------------------------------
class Kept:
    """One tensor a policy keeps in every layer: its shape, and what happens to it when tokens come in.
    k, v are the values the cache holds (an FP8 cache's dequantized to fp32), after RoPE for keys."""

    def alloc(self, cfg, batch: int, slots: int, device, dtype) -> torch.Tensor:
        return torch.zeros(batch, cfg.n_kv_heads, slots, device=device)  # [B, H_kv, S] fp32

    def bytes_per_row(self, cfg, slots: int, dtype) -> int:  # one sequence, one layer
        return 4 * cfg.n_kv_heads * slots

    def of_prompt(self, q, k, v, pos, seed) -> torch.Tensor:
        """Its value over prompt tokens: q [R, H_q, T, D]; k, v [R, H_kv, T, D]; pos [R, H_kv, T];
        seed [R, H_kv, T] or None (Policy.prompt_seed)."""
        raise NotImplementedError

    def start(self, t, rows, q, k, v, pos, positions, seed):
        """Rows `rows` [R] start a sequence whose held prompt tokens are k, v, pos (the first T slots)."""
        t[rows, :, :k.shape[2]] = self.of_prompt(q, k, v, pos, seed)

    def write(self, t, cache, c, at, q, k, v, positions):
        """A decode step's token (k, v [B, H_kv, D], q [B, H_q, D], positions [B]) goes into slots
        `at`; called before it overwrites them, so c still holds the token that leaves."""
        raise NotImplementedError

    def recompute(self, c) -> torch.Tensor | None:
        """Its value from what the slots hold alone (c with K and V as values), or None for history."""
        return None


@dataclass(frozen=True)
class PerSlot(Kept):
    """A value of each held token, computed from its key and value when it is written: [B, H_kv, S] fp32."""
    of_token: Callable  # (k, v) [..., D] -> [...]

    def of_prompt(self, q, k, v, pos, seed):
        return self.of_token(k, v)

    def write(self, t, cache, c, at, q, k, v, positions):
        t.index_put_(at, self.of_token(k, v))

    def recompute(self, c):
        return self.of_token(c.k, c.v)


@dataclass(frozen=True)
class Accumulated(Kept):
    """A score each token gathers while it is held (the fused kernel adds each step's): 0 when written, the
    prompt's seed for prompt tokens. [B, H_kv, S] fp32."""

    def of_prompt(self, q, k, v, pos, seed):
        return seed

    def start(self, t, rows, q, k, v, pos, positions, seed):
        t.index_fill_(0, rows, 0.0)  # (index_fill_: KVCache.reset says why)
        super().start(t, rows, q, k, v, pos, positions, seed)

    def write(self, t, cache, c, at, q, k, v, positions):
        t.index_put_(at, k.new_zeros(k.shape[:2], dtype=torch.float32))


@dataclass(frozen=True)
class KeySum(Kept):
    """The sum over the held keys of of_key(key), per KV head: [B, H_kv, D] fp32, kept running (the key
    that leaves goes out, the new one comes in), so a step never sums over every slot."""
    of_key: Callable  # [..., D] -> [..., D] fp32

    def alloc(self, cfg, batch, slots, device, dtype):
        return torch.zeros(batch, cfg.n_kv_heads, cfg.head_dim, device=device)

    def bytes_per_row(self, cfg, slots, dtype):
        return 4 * cfg.n_kv_heads * cfg.head_dim

    def of_prompt(self, q, k, v, pos, seed):
        return (self.of_key(k) * (pos >= 0)[..., None]).sum(2)

    def start(self, t, rows, q, k, v, pos, positions, seed):
        t[rows] = self.of_prompt(q, k, v, pos, seed)

    def write(self, t, cache, c, at, q, k, v, positions):
        held = (c.pos[at] >= 0)[..., None]  # [B, H_kv, 1]: the slot holds a token, which now leaves
        t.add_(self.of_key(k) - self.of_key(cache.key_values(c, at)) * held)

    def recompute(self, c):
        return self.of_prompt(None, c.k, c.v, c.pos, None)


@dataclass(frozen=True)
class RecentQueries(Kept):
    """The last n queries (after RoPE, in the model's dtype), a ring at column position % n:
    [B, H_q, n, D]."""
    n: int

    def alloc(self, cfg, batch, slots, device, dtype):
        return torch.zeros(batch, cfg.n_heads, self.n, cfg.head_dim, device=device, dtype=dtype)

    def bytes_per_row(self, cfg, slots, dtype):
        return cfg.n_heads * self.n * cfg.head_dim * dtype.itemsize

    def of_prompt(self, q, k, v, pos, seed):
        return self.ring(q, pos[:, 0])

    def start(self, t, rows, q, k, v, pos, positions, seed):
        t[rows] = self.ring(q, positions)  # the prompt's queries, whether or not its tokens were compressed

    def ring(self, q, positions):
        """The last n real queries of prompts q [R, H_q, T, D] (positions [R, T]) at their ring columns, as
        decoding keeps them: [R, H_q, n, D] (a prompt shorter than n leaves columns zero)."""
        last, cols = last_queries(q, positions, self.n)  # [R, H_q, n, D], [R, n]
        ring = torch.zeros_like(last)
        ring[torch.arange(q.shape[0], device=q.device)[:, None], :, cols] = last.transpose(1, 2)
        return ring

    def write(self, t, cache, c, at, q, k, v, positions):
        B, H_q = q.shape[:2]
        t.index_put_((at[0], torch.arange(H_q, device=q.device)[None, :],
                      (positions % self.n)[:, None].expand(B, H_q)), q)


@dataclass(frozen=True)
class Steps(Kept):
    """A step number per slot that the policy updates itself as it attends (LazyEviction's last recurrence and
    longest recurrence interval), with positions as the clock: int32 [B, H_kv, S]. A token written at position
    p starts at p - 1 (since_written) or at 0; the prompt's tokens start as the first new token does."""
    since_written: bool

    def alloc(self, cfg, batch, slots, device, dtype):
        return torch.zeros(batch, cfg.n_kv_heads, slots, device=device, dtype=torch.int32)

    def born(self, positions):
        """What a token written at `positions` (an int tensor) starts with."""
        return (positions - 1 if self.since_written else torch.zeros_like(positions)).int()

    def of_prompt(self, q, k, v, pos, seed):
        return self.born(pos.amax((1, 2), keepdim=True) + 1).expand(pos.shape)  # the first new token's position

    def start(self, t, rows, q, k, v, pos, positions, seed):
        # from the whole prompt's positions [R, T]: a prompt rule may have dropped its last token
        t[rows, :, :pos.shape[2]] = self.born(positions.amax(1) + 1)[:, None, None]

    def write(self, t, cache, c, at, q, k, v, positions):
        t.index_put_(at, self.born(positions)[:, None].expand(c.pos.shape[:2]))


def last_queries(q, positions, n: int):
    """The queries of the last n real prompt tokens [R, H_q, n, D] and the ring columns they go to,
    position % n [R, n] (a prompt shorter than n gives its first query several times, into column 0).
    q: [R, H_q, T, D]; positions: [R, T]."""
    R, Hq, T, D = q.shape
    lengths = (positions >= 0).sum(1, keepdim=True)  # [R, 1]
    idx = (lengths - n + torch.arange(n, device=q.device)).clamp(min=0)  # [R, n] into T
    return q.gather(2, idx[:, None, :, None].expand(R, Hq, n, D)), positions.gather(1, idx) % n


def value_l1(k, v):
    """||v||_1 in fp32, the value norm LongFlow and VATP score with."""
    return kernel.l1_norm(v)


def key_norm(k, v):
    """||k||_2 in fp32."""
    return k.float().norm(dim=-1)


def unit(k):
    """Keys as fp32 unit vectors: [..., D] -> [..., D] (a zero key stays zero)."""
    return F.normalize(k.float(), dim=-1)


# ---- the contract ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """The base of every policy (module docstring: the contract). The fields are each instance's settings,
    checked against the budget by resolve_policy; the class attributes are what the policy is."""
    n_sink: int = 0  # the first n_sink positions are never evicted
    window: int = 0  # nor the `window` most recent tokens
    per_head: bool = False  # one decision per KV head (the mean over its query group), not one per layer
    name: str = ""  # its key in POLICIES, which the statistics name
    keeps: ClassVar[dict[str, Kept]] = {}
    window_share: ClassVar[float] = 0.0  # a default window of this share of the budget left after the sinks
    evicts: ClassVar[bool] = True  # False: a cache sized for every token (full)
    same_in_every_head: ClassVar[bool] = False  # its score: per layer, no mean over the heads is needed
    # its prefill runs no Python that depends on the prompt's length (a loop over its chunks), so the server's
    # compiled prefill serves every length with one version (step.compiled_prefill); False: prefilled eagerly
    prefill_compiles: ClassVar[bool] = True

    def score(self, c, q, now):
        """The eviction score of every slot of layer c, lowest goes. Its keys are values (KVCache.with_key_values;
        an FP8 cache dequantizes them), its values are not: with an FP8 cache c.v holds e4m3 bits, so a score
        that reads values keeps what it needs of them (a PerSlot, computed from each value as written).
        q: [B, H_q, D] this step's queries; now: [B] the newest position of each row. Returns [B, H_kv, S]
        or, one score for the whole layer, [B, 1, S]."""
        raise NotImplementedError

    def attend(self, cache, c, q, now):
        """Attention over the slots [B, H_q, D] and the slot the next token overwrites [B, H_kv]."""
        out, _ = cache.attention(c, q)
        return out, cache.lowest(self.score(cache.with_key_values(c), q, now), c)

    def prompt_seed(self, cache, q, k, v, positions):
        """What the prompt's own attention gives each of its tokens [R, H_kv, T] (Accumulated's start),
        or None."""
        return None

    # a rule that needs data of the model's own (TriAttention: statistics of its queries) gets it here
    def for_model(self, model) -> "Policy":
        """This policy ready to run with model (a model.Transformer): what it needs of the model's own is loaded
        and checked here (the engine does it once per policy); the others need nothing."""
        return self

    def layer_data(self, index: int, device) -> dict[str, torch.Tensor]:
        """Its data of layer `index`, the same for every row and never written (the cache's Layer.data)."""
        return {}

    def layer_data_bytes(self, cfg) -> int:
        """The bytes of layer_data, one layer's (the memory planner counts them)."""
        return 0

    def prompt_score(self, layer, q, k, v, pos, seed):
        """Its score over a prompt seen as the cache (prompt compression "decode"): what it keeps is
        computed over the prompt, and the last real query scores. Shapes as Kept.of_prompt."""
        view = replace(layer, k=k, v=v, pos=pos,
                       kept={name: kept.of_prompt(q, k, v, pos, seed) for name, kept in self.keeps.items()})
        last = q[torch.arange(q.shape[0]), :, (pos[:, 0] >= 0).sum(1) - 1]  # [R, H_q, D]
        return self.score(view, last, pos.amax((1, 2)))


# ---- the policies ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the cache has room for every token, and slots fill in order."""
    evicts = False

    def attend(self, cache, c, q, now):
        out, _ = cache.attention(c, q, limit=c.next_slot + 1)  # only the slots filled so far are read
        # a finished sequence that steps on until its row is reused just rewrites its last slot
        return out, (c.next_slot + 1).clamp(max=cache.slots - 1)


@dataclass(frozen=True)
class KernelPolicy(Policy):
    """Scored inside the fused attention kernel, in the same pass over K and V, by what `scoring` declares
    (kernel.Scoring: the current query's alpha, times ||v||_1 or not, kept in a per-slot state or not; or a
    query the policy gives each step, `given`). What it keeps follows from that declaration: each slot's
    ||v||_1, and the state."""
    scoring: ClassVar[kernel.Scoring] = kernel.Scoring()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.keeps = kernel_keeps(cls.scoring)

    @property
    def prefill_compiles(self) -> bool:
        return not self.scoring.keeps_state  # prompt_seed sums the prompt's attention a chunk of queries at a time

    def attend(self, cache, c, q, now):
        # tensor parallel, one decision per layer: the kernel gives this rank's part of the score, not a slot
        together = not self.per_head and cache.tp.size > 1
        out, evict = cache.attention(c, q, select=True, scoring=self.scoring, vnorm=c.kept.get("value_l1"),
                                     state=None if together else c.kept.get("state"), partial=together,
                                     given=self.given(c, now))
        return out, self.decide_together(cache, c, evict) if together else evict

    def given(self, c, now) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With Scoring(query="given"): the query [B, H_q, D] that scores layer c's keys this step (now [B]: each
        row's newest position) and the weights of their pairs' magnitudes [H_q, D/2]; None for the others."""
        return None

    def decide_together(self, cache, c, part):
        """This rank's score part [B, S] (the mean over its heads) becomes the layer's mean over every
        rank's heads, from which each rank takes the same slot (the kernel's rule). Returns [B, H_kv]."""
        score = cache.layer_mean(part[:, None])  # [B, 1, S]
        if self.scoring.keeps_state:  # every column of the state holds the layer's
            score = self.scoring.update_state(c.kept["state"], score)[:, :1]
        return kernel.choose_slot(score, c.pos, self.n_sink, self.window, per_head=False)

    def score(self, c, q, now):
        """The score the kernel ranks by, from its reference: the state, or this step's. Decoding takes the slot
        from the kernel; prompt compression by the policy's own rule and the tests read this."""
        if self.scoring.keeps_state:
            return c.kept["state"] if self.per_head else c.kept["state"][:, :1]
        given_query, pair_weight = self.given(c, now) or (None, None)
        part = kernel.decode_attention_ref(q, c.k, c.v, c.pos, per_head=self.per_head, n_sink=self.n_sink,
                                           window=self.window, scoring=self.scoring, vnorm=c.kept.get("value_l1"),
                                           partial=True, given_query=given_query, pair_weight=pair_weight)[1]
        return part if self.per_head else part[:, None]

    def prompt_seed(self, cache, q, k, v, positions):
        """The state after the prompt, as if each prompt query had been a decode step: the attention each query
        gave each token (the causal softmax), times ||v||_1 with value_norm, weighted by decay^(queries after
        it) and summed over the queries (H2O's column sums), then the mean over the query group or the layer."""
        if not self.scoring.keeps_state:
            return None
        R, H, T, _ = k.shape
        cols = attention_column_sums(q, k, positions, self.scoring.decay).view(R, H, -1, T)  # [R, H_kv, G, T]
        if self.scoring.value_norm:  # each query head's weights times its KV head's value norms, before any mean
            cols = cols * kernel.l1_norm(v)[:, :, None]
        return cols.mean(2) if self.per_head else cache.layer_mean(cols.view(R, -1, T)).expand(R, H, T)


def kernel_keeps(scoring) -> dict[str, Kept]:
    """What a KernelPolicy keeps for its scoring: ||v||_1 of every slot ("value_l1", which the kernel reads) and
    the per-slot state ("state", which it updates)."""
    keeps = {"value_l1": PerSlot(value_l1)} if scoring.value_norm else {}
    return keeps | ({"state": Accumulated()} if scoring.keeps_state else {})


@dataclass(frozen=True)
class LongFlow(KernelPolicy):
    """LongFlow (Sun et al. 2025): argmin_i mean_h alpha[h, i] * ||v_i||_1 for the current query, one
    decision per layer as in the paper (per_head=True: per KV head, over its query group)."""
    scoring = kernel.Scoring(value_norm=True)


@dataclass(frozen=True)
class TOVA(KernelPolicy):
    """TOVA (Oren et al. 2024): the current query's attention, averaged over the heads of the layer."""
    scoring = kernel.Scoring()


@dataclass(frozen=True)
class H2O(KernelPolicy):
    """H2O (Zhang et al. 2023): attention accumulated over every query so far, per head: from the column
    sums of the prompt's attention, then each step's; half the budget is the recent window."""
    per_head: bool = True
    scoring = kernel.Scoring(update="sum")
    window_share = 0.5


@dataclass(frozen=True)
class VATP(H2O):
    """VATP (Guo et al. 2024): H2O's accumulated attention, each query's alpha times ||v_i||_1; the first 20
    tokens are sinks, half of the rest recent."""
    n_sink: int = 20
    scoring = kernel.Scoring(value_norm=True, update="sum")


@dataclass(frozen=True)
class LongFlowEMA(KernelPolicy):
    """LongFlow's score as an exponential moving average over the steps a token is held: state = 0.9 * state
    + this step's mean_h alpha[h, i] * ||v_i||_1, from the prompt's attention as H2O's sum starts; one decision
    per layer."""
    scoring = kernel.Scoring(value_norm=True, update="ema", decay=0.9)


@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM (Xiao et al. 2024): 4 attention sinks and the most recent tokens: the oldest goes."""
    n_sink: int = 4
    same_in_every_head = True  # every head holds the same positions

    def score(self, c, q, now):
        return c.pos.float()


@dataclass(frozen=True)
class KeyDiff(Policy):
    """KeyDiff (Park et al. 2025, as kvpress implements it): per KV head, the key most cosine-similar to the
    mean of the held keys' unit vectors goes."""
    per_head: bool = True
    keeps = {"key_norm": PerSlot(key_norm), "key_sum": KeySum(unit)}

    def score(self, c, q, now):
        return -cosine_to(c, F.normalize(c.kept["key_sum"], dim=-1))


def cosine_to(c, direction):
    """k_i . direction / ||k_i|| for every slot [B, H_kv, S], direction [B, H_kv, D]: one pass over the keys in
    their own dtype (a matrix-vector product), divided by the key norms c keeps (an empty slot's zero key
    gives 0)."""
    dots = (c.k @ direction.to(c.k.dtype)[..., None])[..., 0].float()
    return dots / c.kept["key_norm"].clamp(min=1e-30)


@dataclass(frozen=True)
class SnapKVDecode(Policy):
    """Decode-time SnapKV (kvpress's DecodingPress around SnapKVPress; strongest with H2O on reasoning models in
    arXiv 2512.12008), one eviction per step, per KV head: the slot with the least attention summed over the last
    32 queries (recent_attention); those 32 tokens stay."""
    per_head: bool = True
    window: int = SNAPKV_WINDOW
    keeps = {"queries": RecentQueries(SNAPKV_WINDOW)}

    def score(self, c, q, now):
        return recent_attention(c, now)


def recent_attention(c, now):
    """The attention the last W queries (the current one included; c.kept["queries"], a ring at column position
    % W) gave each slot, summed over the queries, averaged over each KV head's query group: [B, H_kv, S] fp32. Each
    query's softmax runs over the held slots it could see (positions up to its own), its logits in the model's
    dtype as SnapKV's reference computes them. No pooling over neighbours: slots hold no order. now: [B]."""
    B, H, S, D = c.k.shape
    queries = c.kept["queries"]  # [B, H_q, W, D]
    W = queries.shape[2]
    col = torch.arange(W, device=now.device)
    asked = now[:, None] - (now[:, None] - col) % W  # [B, W] the position of each column's query (< 0: none yet)
    logits = (queries.view(B, H, -1, D) @ c.k.transpose(-1, -2)).view(B, H, -1, W, S).float() / D ** 0.5
    seen = (c.pos[:, :, None, None, :] >= 0) & (c.pos[:, :, None, None, :] <= asked[:, None, None, :, None])
    alpha = logits.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)  # [B, H_kv, G, W, S]
    return alpha.sum(3).mean(2)


# R-KV (Zefan-Cai/R-KV, rkv/compression/r1_kv.py and rkv/utils.py): importance from the last 8 queries,
# max-pooled over 7 neighbouring tokens; the paper's mixing weight lambda = 0.1 (the code defaults to 0.07)
RKV_QUERIES, RKV_POOL, RKV_LAMBDA = 8, 7, 0.1


@dataclass(frozen=True)
class RKV(Policy):
    """R-KV (Cai et al. 2025), one eviction per step: lambda * importance - (1 - lambda) * redundancy, per
    KV head (rkv_score); the last 8 tokens stay."""
    window: int = 8
    per_head: bool = True
    keeps = {"key_norm": PerSlot(key_norm), "key_sum": KeySum(unit), "queries": RecentQueries(RKV_QUERIES)}

    def score(self, c, q, now):
        return rkv_score(c, kernel.protected_mask(c.pos, self.n_sink, self.window))


def rkv_score(c, protected):
    """R-KV's score, lambda * importance - (1 - lambda) * redundancy, per KV head, over the slots that are
    held and not protected (the others get 0; the caller masks them):
      importance_i = mean over the last RKV_QUERIES queries of softmax_i(max over the KV head's query group
                     of q . k_i / sqrt(D)), then the maximum over RKV_POOL neighbours in position order;
      redundancy_i = softmax_i(mean over the other held keys j of cos(k_i, k_j)), the mean taken from the
                     running sum of unit keys: (k_i/|k_i| . sum_j k_j/|k_j| - 1) / (n - 1).
    The reference computes the whole n x n cosine matrix every 128 steps and, for each token, leaves out
    its most recent partner above 0.5 similarity; one eviction per step cannot afford the matrix, so that
    exemption is left out. c.kept["queries"]: [B, H_q, W, D]; protected: [B, H_kv, S]."""
    B, H, S, D = c.k.shape
    queries = c.kept["queries"]
    W = queries.shape[2]
    scored = (c.pos >= 0) & ~protected  # [B, H_kv, S]
    # the logits in the model's dtype, as the reference computes them, then the maximum over the query group
    q = queries.view(B, H, -1, D)  # [B, H_kv, G * W, D]
    logits = (q @ c.k.transpose(-1, -2)).view(B, H, -1, W, S).amax(2).float() / D ** 0.5  # [B, H_kv, W, S]
    alpha = logits.masked_fill(~scored[:, :, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    importance = pool_in_position_order(alpha.mean(2), c.pos, RKV_POOL)  # [B, H_kv, S]
    n = (c.pos >= 0).sum(-1, keepdim=True)  # [B, H_kv, 1]
    cos = cosine_to(c, c.kept["key_sum"])  # [B, H_kv, S]: k_i/|k_i| . sum of unit keys
    similarity = (cos - 1) / (n - 1).clamp(min=1)
    redundancy = similarity.masked_fill(~scored, float("-inf")).softmax(-1).nan_to_num(0.0)
    return RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * redundancy


def pool_in_position_order(x, pos, size: int):
    """The maximum of x over `size` neighbouring slots in the order of their positions (slots are not
    stored in order; empty slots sort first and should hold 0). x, pos: [B, H, S]."""
    order = pos.argsort(-1)
    pooled = F.max_pool1d(x.gather(-1, order), size, stride=1, padding=size // 2)
    return torch.empty_like(x).scatter_(-1, order, pooled)


@dataclass(frozen=True)
class Random(Policy):
    """A sanity baseline as kvpress publishes it, per KV head: a fresh pseudo-random draw every step."""
    per_head: bool = True

    def score(self, c, q, now):
        return random_score(c.pos, c.index, c.heads, now)


def random_score(pos, layer, heads, now):
    """A hash of (position, layer, KV head, step), so every step draws afresh (as kvpress draws new noise at
    every compression) and runs still repeat themselves. pos: [B, H_kv, S]; heads: [H_kv] the KV heads'
    numbers in the whole model (tensor parallel: this rank's); now: [B] the newest position of each row."""
    token = hash32(pos.long() * 0x9E3779B1 + layer * 0x85EBCA77 + heads[:, None])
    return (hash32(token + now.long()[:, None, None] * 0xC2B2AE3D) >> 8).float()  # 24 bits: exact in fp32


def hash32(x):
    """An integer hash (lowbias32) on int64 tensors holding 32-bit values; products are masked back to
    32 bits, so int64 wrap-around never matters."""
    x = x & 0xFFFFFFFF
    for mul in (0x7FEB352D, 0x846CA68B):
        x = ((x ^ (x >> 16)) * mul) & 0xFFFFFFFF
    return x ^ (x >> 16)


@dataclass(frozen=True)
class KNorm(Policy):
    """Knorm (Devoto et al. 2024 keep the keys of low norm), per KV head: the largest key norm goes."""
    per_head: bool = True
    keeps = {"key_norm": PerSlot(key_norm)}

    def score(self, c, q, now):
        return -c.kept["key_norm"]


# LazyEviction (arXiv 2506.15969; its code in WeianMao/triattention's history, folder LazyEviction/): a token
# recurs when attended at or above alpha = 1e-4, the authors' Qwen setting; their MATH runs protect the newest
# W = 175 tokens at a capacity of 1492, a share that gives every budget a window (docs/rules.md)
LAZY_ALPHA, LAZY_WINDOW_SHARE = 1e-4, 175 / 1492


@dataclass(frozen=True)
class Lazy(Policy):
    """LazyEviction, one eviction per step, per KV head: each token's last recurrence `last` and its longest
    recurrence interval `mp` (recorded by record_recurrence from each step's attention) give its importance
    (lazy_importance); the least important goes, the newest 11.7% of the budget stay."""
    per_head: bool = True
    window_share = LAZY_WINDOW_SHARE
    keeps = {"last": Steps(since_written=True), "mp": Steps(since_written=False)}

    def attend(self, cache, c, q, now):
        out, _ = cache.attention(c, q)
        c = cache.with_key_values(c)
        record_recurrence(c, q, now, LAZY_ALPHA)  # after the new token is written, before the choice
        return out, cache.lowest(self.score(c, q, now), c)

    def score(self, c, q, now):
        return lazy_importance(c.kept["last"], c.kept["mp"], now)


def record_recurrence(c, q, now, alpha: float):
    """LazyEviction's states after this step's attention, in place. A held token recurs when a query head of its
    KV head's group gives it a softmax weight of alpha or more (the authors keep a copy per query head; one
    slot per KV head recurs for any of them); then mp = max(mp, now - last) and last = now.
    c.k: keys as values [B, H_kv, S, D]; q: [B, H_q, D]; now: [B] this step's position."""
    B, H, S, D = c.k.shape
    # the logits in the model's dtype (the authors' in fp16), the softmax in fp32, as theirs
    logits = (q.view(B, H, -1, D) @ c.k.transpose(-1, -2)).float() / D ** 0.5  # [B, H_kv, G, S]
    weights = logits.masked_fill((c.pos < 0)[:, :, None], float("-inf")).softmax(-1)
    recurs = weights.amax(2) >= alpha  # [B, H_kv, S]; an empty slot's weight is 0
    now = now.int()[:, None, None]
    last, mp = c.kept["last"], c.kept["mp"]
    mp.copy_(torch.where(recurs, torch.maximum(mp, now - last), mp))
    last.copy_(torch.where(recurs, now, last))


def lazy_importance(last, mp, now):
    """LazyEviction's importance of each slot at position `now` [B] (kv_utils.py:72-73 of its code), in fp32:
        2 / (1 + exp(1 + (now - last) / (mp + 1e-5)))  +  [mp > 0] * 2 / (1 + exp(mp - 1))
    A token attended every step since it came (mp = 1) ranks highest; a long gap since its last recurrence,
    measured in its own longest interval, ranks it lower. last, mp: [B, H_kv, S] int32."""
    since = (now[:, None, None] - last).float()
    mp = mp.float()
    return 2 / (1 + torch.exp(1 + since / (mp + 1e-5))) + (mp > 0) * 2 / (1 + torch.exp(mp - 1))
# TriAttention (WeianMao/triattention): the query positions its score looks ahead to, t0 + 1, 2, 4, ..., 65536
# (pruning_utils.py's offsets), and the attention scaling its statistics are weighted by squared (HF's
# attention_scaling: 1 for plain and llama3 RoPE, the only ones tinyflow runs)
TRI_OFFSETS = tuple(2 ** i for i in range(17))
TRI_ATTENTION_SCALING = 1.0


@dataclass(frozen=True)
class TriAttention(KernelPolicy):
    """TriAttention (Mao et al. 2026), one eviction per step, per KV head: each slot's key is scored against
    the model's mean query (calibration.py's statistics of this model, `eval.py calibrate`) as if it came at the
    next position plus each of TRI_OFFSETS, averaged, plus how much the queries' magnitude strays from their
    mean; z-scored per query head over the slots that can go, then the maximum over the KV head's query group.
    That is linear in the key but for its pairs' magnitudes (tri_layer_data), so the fused kernel scores it as a
    given query (kernel.given_score). The most recent 6.25% of the budget stay (its vLLM plugin's 128 of 2,048)."""
    scoring = kernel.Scoring(query="given")
    per_head: bool = True
    stats: calibration.QueryStats | None = None  # this model's (for_model), under tensor parallel this rank's heads
    window_share = 0.0625

    def for_model(self, model):
        return self if self.stats is not None else replace(self, stats=calibration.load_for(model))

    def layer_data(self, index, device):
        if self.stats is None:
            raise ValueError("policy triattention has no statistics of the model's queries: make it ready for the "
                             "model first (Policy.for_model; the engine does)")
        return {name: t.to(device) for name, t in tri_layer_data(self.stats, index).items()}

    def layer_data_bytes(self, cfg):
        F = cfg.head_dim // 2
        return 4 * (cfg.n_heads * (cfg.head_dim + F) + F)  # tri_layer_data's fp32 tensors

    def given(self, c, now):
        """The mean query's vector u (tri_layer_data) turned by RoPE to each row's next position, now + 1."""
        u = c.data["tri_query"]  # [H_q, D]
        angle = (now + 1).double()[:, None, None] * c.data["tri_freq"].double()  # [B, 1, F]: fp64, t w runs to
        cos, sin = angle.cos().float(), angle.sin().float()  # thousands of radians
        ur, ui = u.chunk(2, -1)  # [H_q, F]
        return torch.cat((ur * cos - ui * sin, ur * sin + ui * cos), -1), c.data["tri_weight"]  # [B, H_q, D]


def tri_layer_data(stats: calibration.QueryStats, index: int) -> dict[str, torch.Tensor]:
    """TriAttention's score as one vector per query head, from layer `index`'s statistics (mean query qbar_hf,
    mean magnitude A_hf, frequencies w_f; s = TRI_ATTENTION_SCALING). The authors' score of a key k
    (pairs k_f = k[f] + i k[f + D/2], after RoPE) at next position t0,
        mean over d in TRI_OFFSETS of sum_f s^2 Re(qbar_hf conj(k_f) e^{i (t0 + d) w_f})
          + sum_f s^2 (A_hf - |qbar_hf|) |k_f|,
    is linear in k but for the magnitudes: <k, RoPE at t0 of u_h> + sum_f weight_hf |k_f|, where
    u_hf = s^2 qbar_hf mean_d e^{i d w_f}. Returns "tri_query" [H_q, D] (u before RoPE, real parts then
    imaginary as a query is laid out), "tri_weight" [H_q, F] and "tri_freq" [F] (w), fp32."""
    qbar = torch.view_as_complex(stats.q_mean[index].double().contiguous())  # [H_q, F]
    w = stats.inv_freq.double()  # [F]
    offsets_mean = torch.exp(1j * torch.tensor(TRI_OFFSETS, dtype=torch.float64)[:, None] * w).mean(0)  # [F]
    u = TRI_ATTENTION_SCALING ** 2 * qbar * offsets_mean
    weight = TRI_ATTENTION_SCALING ** 2 * (stats.q_abs_mean[index].double() - qbar.abs())
    return {"tri_query": torch.cat((u.real, u.imag), -1).float(), "tri_weight": weight.float(),
            "tri_freq": stats.inv_freq.float()}


POLICIES = {
    "full": Full(),
    "longflow": LongFlow(),
    "longflow-head": LongFlow(per_head=True),
    "tova": TOVA(),
    "h2o": H2O(),
    "vatp": VATP(),
    "longflow-ema": LongFlowEMA(),
    "streaming": Streaming(),
    "keydiff": KeyDiff(),
    "rkv": RKV(),
    "snapkv-decode": SnapKVDecode(),
    "random": Random(),
    "knorm": KNorm(),
    "lazy": Lazy(),
    "triattention": TriAttention(),
}
POLICIES = {name: replace(p, name=name) for name, p in POLICIES.items()}


# ---- prompts: H2O's seed, and cutting a prompt that does not fit ----------------------------------------
def attention_column_sums(q, k, positions, decay: float = 1.0, budget_bytes: int = 2**28):
    """The causal softmax attention of every real prompt query, summed over the queries, each weighted by
    decay^(the real queries after it): [B, H_q, T] fp32 (padding queries count for nothing, padding keys get
    nothing). The logits in the model's dtype, as H2O's reference computes them, the softmax in fp32. Queries
    go in chunks so that one chunk's fp32 scores (logits, then weights, in place) stay within budget_bytes.
    q: [B, H_q, T, D]; k: [B, H_kv, T, D]; positions: [B, T], right-padded."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    q = q.view(B, H, Hq // H, T, D)  # each KV head's query group, so K is never repeated per query head
    eff = padding_last(positions)
    after = (positions >= 0).sum(1, keepdim=True) - 1 - torch.arange(T, device=q.device)  # [B, T]
    weight = torch.where(positions >= 0, decay ** after.clamp(min=0).float(), 0.0)  # [B, T]
    chunk = max(1, budget_bytes // (2 * 4 * B * Hq * T))  # two fp32 [B, H_q, chunk, T] at a time
    cols = q.new_zeros(B, H, Hq // H, T, dtype=torch.float32)
    for start in range(0, T, chunk):
        part = slice(start, start + chunk)
        logits = (q[:, :, :, part] @ k[:, :, None].transpose(-1, -2)).float() / D ** 0.5  # [B, H_kv, G, C, T]
        visible = eff[:, None, None, None, :] <= eff[:, None, None, part, None]  # [B, 1, 1, C, T]
        alpha = logits.masked_fill_(~visible, float("-inf")).softmax(-1)
        cols += alpha.mul_(weight[:, None, None, part, None]).sum(3)
    return cols.view(B, Hq, T)


def padding_last(positions):
    """Positions for causal masks with padding (-1) at "infinity": real queries never see it, padding queries
    see everything, so their (discarded) outputs stay finite instead of a NaN that would leak through 0 * NaN."""
    return torch.where(positions < 0, torch.iinfo(positions.dtype).max, positions)


def snapkv_score(q, k, positions, per_head: bool, tp: Group = SINGLE):
    """SnapKV prompt compression (Li et al. 2024): the last SNAPKV_WINDOW prompt tokens stay (score +inf);
    the rest are ranked by the attention those queries give them (softmax weights summed over the
    window's queries and the heads, average-pooled over 5 neighbouring tokens). Returns [B, H_kv, T];
    q: [B, H_q, T, D]; k: [B, H_kv, T, D]; positions: [B, T]; tp: per layer, the heads of every rank count."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    lengths = (positions >= 0).sum(1)  # [B]
    idx = torch.arange(T, device=q.device)
    win = (lengths[:, None] - SNAPKV_WINDOW + torch.arange(SNAPKV_WINDOW, device=q.device)).clamp(min=0)
    q_win = q.gather(2, win[:, None, :, None].expand(B, Hq, SNAPKV_WINDOW, D))  # [B, H_q, W, D]
    k_all = k.repeat_interleave(Hq // H, 1)  # [B, H_q, T, D]
    logits = (q_win.float() @ k_all.float().transpose(2, 3)) / D ** 0.5  # [B, H_q, W, T]
    visible = (positions[:, None, None, :] >= 0) & (win[:, None, :, None] >= idx)
    attn = logits.masked_fill(~visible, float("-inf")).softmax(-1).sum(2)  # [B, H_q, T]
    attn = F.avg_pool1d(attn, SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2)
    score = attn.view(B, H, Hq // H, T).sum(2)  # [B, H_kv, T], per KV head: its query group
    if not per_head:
        score = tp.sum(score.sum(1, keepdim=True)).expand(B, H, T)  # one decision for the whole layer
    in_window = (idx >= lengths[:, None] - SNAPKV_WINDOW) & (positions >= 0)  # [B, T]
    return torch.where(in_window[:, None], float("inf"), score)


def streaming_prompt_score(pos, n_sink: int):
    """StreamingLLM's cut: its 4 first tokens (or the policy's sinks, when more), then the most recent."""
    return torch.where(pos < max(n_sink, 4), pos.max() + 1, pos).float()


def top_tokens(score, pos, n_keep: int):
    """Indices [R, H_kv, n_keep] of the highest-scoring real tokens (padding last), in prompt order."""
    score = score.masked_fill(pos < 0, float("-inf"))
    # a stable sort, not topk: of tied scores the earlier tokens stay, whatever padding the prompt's batch adds
    # (topk breaks ties in an order that changes with the padded length)
    return score.sort(stable=True, dim=-1, descending=True).indices[..., :n_keep].sort(-1).values


# ---- choosing a policy ----------------------------------------------------------------------------------
def is_int(x) -> bool:
    """An integer (a Python or numpy one), and not a bool (which Python counts as one)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def resolve_policy(name: str | None, budget: int | None, n_sink: int | None = None, window: int | None = None,
                   prompt_rule: str = "snapkv") -> Policy:
    """The named policy (None: longflow with a budget, full without) with its protections in slots (its
    defaults, or the caller's), checked against the budget (check_settings)."""
    name = name if name is not None else "longflow" if budget is not None else "full"
    check_settings(name, budget, n_sink, window, prompt_rule)
    p = POLICIES[name]
    n_sink = p.n_sink if n_sink is None else n_sink
    if window is None:
        window = int(p.window_share * (budget - n_sink)) if p.window_share else p.window
    # a compressed prompt keeps the sinks, and the last SNAPKV_WINDOW tokens which cover the recent window
    # when it is shorter; the new token needs one more slot
    need = n_sink + max(SNAPKV_WINDOW, window) + 1
    if p.evicts and budget < need:
        raise ValueError(f"budget {budget} is too small: {n_sink} sinks, the last {max(SNAPKV_WINDOW, window)} "
                         f"tokens (the {SNAPKV_WINDOW}-token prompt window or the {window}-token recent window) "
                         f"and the new token need at least {need} slots")
    return replace(p, n_sink=n_sink, window=window)


def check_prompt_rule(rule: str):
    if rule not in PROMPT_RULES:
        raise ValueError(f"unknown prompt compression {rule!r}; choose one of {', '.join(PROMPT_RULES)}")


def check_settings(name: str, budget, n_sink, window, prompt_rule: str):
    """A clear error for a policy, rule or budget that cannot work, and for settings that would be ignored:
    a budget for the full cache, or an evicting policy, sinks or a window without a budget."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    check_prompt_rule(prompt_rule)
    if budget is not None and (not is_int(budget) or budget <= 0):
        raise ValueError(f"budget must be a positive integer number of KV slots, got {budget!r}")
    for what, value in (("sinks", n_sink), ("window", window)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    evicts = POLICIES[name].evicts
    if not evicts and (budget is not None or n_sink is not None or window is not None):
        raise ValueError("the full policy keeps every token: it takes no budget, sinks or window (drop them, "
                         "or name a policy that evicts)")
    if evicts and budget is None:
        raise ValueError(f"policy {name!r} evicts tokens to stay within a budget: give the budget (KV slots "
                         f"per sequence), or use the full policy to keep every token")
