"""The static KV cache: `slots` places per layer and sequence, allocated once, and the rules that decide
which token each place holds.

Each slot holds one token's key (after RoPE) and value, and its absolute position (-1 = empty). Attention
runs over "the slots that hold something", never over "a prefix of length n", so the order of slots does
not matter and a token can be written anywhere. Every decode step, every layer:
    1. the new token's K/V go into `next_slot`, chosen at the previous step;
    2. attention over all slots (kernel.decode_attention), which also scores every slot;
    3. `next_slot` = the lowest empty slot, else the slot the policy ranks lowest.
With policy "full" the cache has room for every token and slots simply fill in order.
"""
import numbers
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import kernel
from parallel import SINGLE, Group

SNAPKV_WINDOW = 32  # prompt compression keeps the last 32 prompt tokens and ranks the rest by their attention
SNAPKV_POOL = 5
# R-KV (Zefan-Cai/R-KV, rkv/compression/r1_kv.py and rkv/utils.py): importance from the last 8 queries,
# max-pooled over 7 neighbouring tokens; the paper's mixing weight lambda = 0.1 (the code defaults to 0.07)
RKV_QUERIES, RKV_POOL, RKV_LAMBDA = 8, 7, 0.1
PROMPT_RULES = ("snapkv", "streaming", "decode")


@dataclass(frozen=True)
class Policy:
    """How a full cache picks the slot the next token overwrites. Every rule is one argmin per step over
    a per-slot score; empty slots always come first and protected slots never."""
    rule: str  # "kernel": scored inside the attention kernel; "fill": never evicts (a full-size cache);
    #            "oldest", "random", "knorm", "keydiff", "rkv": plain PyTorch over the slots (rule_score)
    per_head: bool = False  # one decision per KV head (mean over its query group), not per layer
    value_norm: bool = True  # kernel rules: score alpha * ||v||_1 (LongFlow) or alpha alone (TOVA)
    accumulate: bool = False  # kernel rules: rank by the score summed over all steps so far (H2O, VATP)
    n_sink: int = 0  # the first n_sink positions are never evicted
    window: int = 0  # nor the `window` most recent tokens
    window_share: float = 0  # default window: this share of the budget left after the sinks
    name: str = ""  # its key in POLICIES (set below), which the statistics name

    @property
    def keeps_vnorm(self) -> bool:  # ||v||_1 per slot, stored with the token: for the rules scored with it
        return self.rule == "kernel" and self.value_norm

    @property
    def keeps_key_norm(self) -> bool:  # ||k_i||_2 per slot, in `score` (knorm ranks by it; keydiff, rkv divide by it)
        return self.rule in ("knorm", "keydiff", "rkv")

    @property
    def keeps_score(self) -> bool:  # a per-slot value: accumulated scores (h2o, vatp) or key norms
        return self.accumulate or self.keeps_key_norm

    @property
    def keeps_key_sum(self) -> bool:  # the sum of the held keys' unit vectors, per KV head (keydiff, rkv)
        return self.rule in ("keydiff", "rkv")

    @property
    def keeps_queries(self) -> bool:  # the last RKV_QUERIES queries (rkv's importance)
        return self.rule == "rkv"


POLICIES = {
    "full": Policy("fill"),
    # LongFlow (Sun et al. 2025): argmin_i mean_h alpha[h, i] * ||v_i||_1 for the current query, per layer
    "longflow": Policy("kernel"),
    "longflow-head": Policy("kernel", per_head=True),
    # TOVA (Oren et al. 2024): the current query's attention averaged over the heads of the layer
    "tova": Policy("kernel", value_norm=False),
    # H2O (Zhang et al. 2023): attention accumulated over every query so far, per head: from the column sums
    # of the prompt's attention (prefill), then each step's; half the budget recent
    "h2o": Policy("kernel", per_head=True, value_norm=False, accumulate=True, window_share=0.5),
    # VATP (Guo et al. 2024): H2O's accumulated attention, each query's alpha times ||v_i||_1; the first 20
    # tokens are sinks, half of the rest recent
    "vatp": Policy("kernel", per_head=True, accumulate=True, n_sink=20, window_share=0.5),
    # StreamingLLM (Xiao et al. 2024): 4 attention sinks and the most recent tokens
    "streaming": Policy("oldest", n_sink=4),
    # KeyDiff (Park et al. 2025, as kvpress implements it): per KV head, the key most cosine-similar to the
    # mean of the held keys' unit vectors goes
    "keydiff": Policy("keydiff", per_head=True),
    # R-KV (Cai et al. 2025), one eviction per step (see rkv_score): lambda * importance - (1 - lambda) *
    # redundancy, per KV head; the last 8 tokens stay
    "rkv": Policy("rkv", per_head=True, window=8),
    # sanity baselines as kvpress publishes them, per KV head: a fresh pseudo-random draw every step (a hash
    # of position, layer, head and step); the largest key norm (Devoto et al. 2024 keep the keys of low norm)
    "random": Policy("random", per_head=True),
    "knorm": Policy("knorm", per_head=True),
}
POLICIES = {name: replace(p, name=name) for name, p in POLICIES.items()}


def check_prompt_rule(rule: str):
    if rule not in PROMPT_RULES:
        raise ValueError(f"unknown prompt compression {rule!r}; choose one of {', '.join(PROMPT_RULES)}")


def is_int(x) -> bool:
    """An integer (a Python or numpy one), and not a bool (which Python counts as one)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def resolve_policy(name: str | None, budget: int | None, n_sink: int | None = None, window: int | None = None,
                   prompt_rule: str = "snapkv") -> Policy:
    """The named policy (None: longflow with a budget, full without) with its protections in slots (its
    defaults, or the caller's), checked against the budget. Raises a clear error for a policy, rule or
    budget that cannot work, and for settings that would be ignored: a budget for the full cache, or an
    evicting policy, sinks or a window without a budget."""
    name = name if name is not None else "longflow" if budget is not None else "full"
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    check_prompt_rule(prompt_rule)
    if budget is not None and (not is_int(budget) or budget <= 0):
        raise ValueError(f"budget must be a positive integer number of KV slots, got {budget!r}")
    for what, value in (("sinks", n_sink), ("window", window)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    p = POLICIES[name]
    if p.rule == "fill" and (budget is not None or n_sink is not None or window is not None):
        raise ValueError("the full policy keeps every token: it takes no budget, sinks or window (drop them, "
                         "or name a policy that evicts)")
    if p.rule != "fill" and budget is None:
        raise ValueError(f"policy {name!r} evicts tokens to stay within a budget: give the budget (KV slots "
                         f"per sequence), or use the full policy to keep every token")
    n_sink = p.n_sink if n_sink is None else n_sink
    if window is None:
        window = int(p.window_share * (budget - n_sink)) if p.window_share else p.window
    # a compressed prompt keeps the sinks, and the last SNAPKV_WINDOW tokens which cover the recent window
    # when it is shorter; the new token needs one more slot
    need = n_sink + max(SNAPKV_WINDOW, window) + 1
    if p.rule != "fill" and budget < need:
        raise ValueError(f"budget {budget} is too small: {n_sink} sinks, the last {max(SNAPKV_WINDOW, window)} "
                         f"tokens (the {SNAPKV_WINDOW}-token prompt window or the {window}-token recent window) "
                         f"and the new token need at least {need} slots")
    return replace(p, n_sink=n_sink, window=window)


def hash32(x):
    """An integer hash (lowbias32) on int64 tensors holding 32-bit values; products are masked back to
    32 bits, so int64 wrap-around never matters."""
    x = x & 0xFFFFFFFF
    for mul in (0x7FEB352D, 0x846CA68B):
        x = ((x ^ (x >> 16)) * mul) & 0xFFFFFFFF
    return x ^ (x >> 16)


def random_score(pos, layer, heads, now):
    """The `random` rule's eviction score: a hash of (position, layer, KV head, step), so every step draws
    afresh (as kvpress draws new noise at every compression) and runs still repeat themselves. pos:
    [B, H_kv, S]; heads: [H_kv] the KV heads' numbers in the whole model (tensor parallel: this rank's);
    now: [B] the newest position of each row (the step)."""
    token = hash32(pos.long() * 0x9E3779B1 + layer * 0x85EBCA77 + heads[:, None])
    return (hash32(token + now.long()[:, None, None] * 0xC2B2AE3D) >> 8).float()  # 24 bits: exact in fp32


def unit(k):
    """Keys as fp32 unit vectors: [..., D] -> [..., D] (a zero key stays zero)."""
    return F.normalize(k.float(), dim=-1)


def unit_key_sum(k, pos):
    """The sum of the unit vectors of the keys held (pos >= 0): [B, H_kv, S, D] -> [B, H_kv, D] fp32."""
    return (unit(k) * (pos >= 0)[..., None]).sum(2)


def rule_score(p: "Policy", c: "Layer", now):
    """The eviction score (lowest goes) of the rules scored in PyTorch, over the slots of c (a cache layer,
    or a prompt seen as one): the oldest position (StreamingLLM); a fresh hash per step (random); the
    largest key norm (knorm, the norms kept in c.score); the key most cosine-similar to the mean unit key
    (keydiff: cos(k_i, sum_j k_j/|k_j|), c.key_sum holding that sum); R-KV's score. now: [B]. Returns
    [B, H_kv, S]."""
    if p.rule == "oldest":
        return c.pos.float()
    if p.rule == "random":
        return random_score(c.pos, c.index, c.heads, now)
    if p.rule == "knorm":
        return -c.score
    if p.rule == "rkv":
        return rkv_score(c, kernel.protected_mask(c.pos, p.n_sink, p.window))
    return -cosine_to(c, F.normalize(c.key_sum, dim=-1))  # keydiff: -cos(k_i, anchor)


def cosine_to(c: "Layer", direction):
    """k_i . direction / ||k_i|| for every slot [B, H_kv, S], direction [B, H_kv, D]: one pass over the keys in
    their own dtype (a matrix-vector product), divided by the key norms kept in c.score (an empty slot's
    zero key gives 0)."""
    dots = (c.k @ direction.to(c.k.dtype)[..., None])[..., 0].float()
    return dots / c.score.clamp(min=1e-30)


def rkv_score(c: "Layer", protected):
    """R-KV's score, lambda * importance - (1 - lambda) * redundancy, per KV head, over the slots that are
    held and not protected (the others get 0; the caller masks them):
      importance_i = mean over the last RKV_QUERIES queries of softmax_i(max over the KV head's query group
                     of q . k_i / sqrt(D)), then the maximum over RKV_POOL neighbours in position order;
      redundancy_i = softmax_i(mean over the other held keys j of cos(k_i, k_j)), the mean taken from the
                     running sum of unit keys (c.key_sum): (k_i/|k_i| . sum_j k_j/|k_j| - 1) / (n - 1).
    The reference computes the whole n x n cosine matrix every 128 steps and, for each token, leaves out
    its most recent partner above 0.5 similarity; one eviction per step cannot afford the matrix, so that
    exemption is left out. c.queries: [B, H_q, W, D]; protected: [B, H_kv, S]."""
    B, H, S, D = c.k.shape
    W = c.queries.shape[2]
    scored = (c.pos >= 0) & ~protected  # [B, H_kv, S]
    # the logits in the model's dtype, as the reference computes them, then the maximum over the query group
    q = c.queries.view(B, H, -1, D)  # [B, H_kv, G * W, D]
    logits = (q @ c.k.transpose(-1, -2)).view(B, H, -1, W, S).amax(2).float() / D ** 0.5  # [B, H_kv, W, S]
    alpha = logits.masked_fill(~scored[:, :, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    importance = pool_in_position_order(alpha.mean(2), c.pos, RKV_POOL)  # [B, H_kv, S]
    n = (c.pos >= 0).sum(-1, keepdim=True)  # [B, H_kv, 1]
    cos = cosine_to(c, c.key_sum)  # [B, H_kv, S]: k_i/|k_i| . sum of unit keys
    similarity = (cos - 1) / (n - 1).clamp(min=1)
    redundancy = similarity.masked_fill(~scored, float("-inf")).softmax(-1).nan_to_num(0.0)
    return RKV_LAMBDA * importance - (1 - RKV_LAMBDA) * redundancy


def pool_in_position_order(x, pos, size: int):
    """The maximum of x over `size` neighbouring slots in the order of their positions (slots are not
    stored in order; empty slots sort first and should hold 0). x, pos: [B, H, S]."""
    order = pos.argsort(-1)
    pooled = F.max_pool1d(x.gather(-1, order), size, stride=1, padding=size // 2)
    return torch.empty_like(x).scatter_(-1, order, pooled)


@dataclass
class Layer:
    """One layer's slots and what is kept beside them. A plain object of tensors (the layer number is a
    tensor too), so the decode step compiles one layer and runs that code for every layer."""
    k: torch.Tensor  # [B, H_kv, S, D] keys after RoPE (FP8 cache: uint8 e4m3 bits, see kernel.quantize)
    v: torch.Tensor  # [B, H_kv, S, D]
    k_scale: torch.Tensor  # [B, H_kv, S] fp32 with an FP8 cache (a key is k * k_scale), else a stand-in
    v_scale: torch.Tensor  # [B, H_kv, S] fp32 likewise
    pos: torch.Tensor  # [B, H_kv, S] int32 position of the token in each slot, -1 = empty
    next_slot: torch.Tensor  # [B, H_kv] int64 where the next token goes
    score: torch.Tensor  # [B, H_kv, S] fp32 accumulated scores (h2o, vatp) or key norms (knorm, keydiff, rkv)
    vnorm: torch.Tensor  # [B, H_kv, S] fp32 ||v||_1 of each slot, for the rules that score with it
    key_sum: torch.Tensor  # [B, H_kv, D] fp32 sum of the held keys' unit vectors (keydiff, rkv)
    queries: torch.Tensor  # [B, H_q, RKV_QUERIES, D] the last queries after RoPE, at column position % W (rkv)
    index: torch.Tensor  # [] int64 the layer number (the random rule hashes it)
    heads: torch.Tensor  # [H_kv] int64 the KV heads' numbers in the whole model (tensor parallel: this rank's)


KV_DTYPES = {"auto": None, "fp8": kernel.FP8}  # what the cache stores K and V in (auto: the model's dtype)


class KVCache:
    def __init__(self, cfg, batch: int, slots: int, device, dtype, policy: Policy | str = "full",
                 prompt_rule: str = "snapkv", kv_dtype: torch.dtype | None = None, tp: Group = SINGLE):
        """dtype: the model's; kv_dtype: what K and V are stored in, dtype (None) or kernel.FP8 (e4m3 with a
        scale per token and KV head). tp: the ranks of a tensor-parallel model, cfg this rank's part: its
        cache holds its own KV heads, and decisions per layer take the mean over the heads of every rank."""
        if isinstance(policy, str):  # a name: its protections sized for these slots
            policy = resolve_policy(policy, None if policy == "full" else slots)
        if kv_dtype not in (None, dtype, kernel.FP8):
            raise ValueError(f"a KV cache stores the model's dtype or FP8 (e4m3), not {kv_dtype}")
        self.policy, self.dtype, self.fp8 = policy, dtype, kv_dtype == kernel.FP8
        check_prompt_rule(prompt_rule)
        self.prompt_rule, self.slots, self.tp = prompt_rule, slots, tp
        self.layers = [self.new_layer(cfg, batch, slots, device, dtype, i) for i in range(cfg.n_layers)]

    def new_layer(self, cfg, batch: int, slots: int, device, dtype, index: int) -> Layer:
        # separate tensors per layer, not slices of [L, ...] tensors: the compiled step then updates each in
        # place, where a mutated slice of a larger input would be copied whole, every layer, every step
        shape = (batch, cfg.n_kv_heads, slots)
        f32 = lambda used, shape=shape: torch.zeros(shape if used else (1, 1, 1), device=device)  # stand-in if unused
        p, stored = self.policy, torch.uint8 if self.fp8 else dtype
        return Layer(k=torch.zeros(*shape, cfg.head_dim, device=device, dtype=stored),
                     v=torch.zeros(*shape, cfg.head_dim, device=device, dtype=stored),
                     k_scale=f32(self.fp8), v_scale=f32(self.fp8),
                     pos=torch.full(shape, -1, device=device, dtype=torch.int32),
                     next_slot=torch.zeros(shape[:2], device=device, dtype=torch.int64),
                     score=f32(p.keeps_score), vnorm=f32(p.keeps_vnorm),
                     key_sum=f32(p.keeps_key_sum, (batch, cfg.n_kv_heads, cfg.head_dim)),
                     queries=torch.zeros((batch, cfg.n_heads, RKV_QUERIES, cfg.head_dim) if p.keeps_queries
                                         else (1, 1, 1, 1), device=device, dtype=dtype),
                     index=torch.tensor(index, device=device),
                     heads=torch.arange(cfg.n_kv_heads, device=device) + self.tp.rank * cfg.n_kv_heads)

    @staticmethod
    def bytes_needed(cfg, batch: int, slots: int, dtype, policy: Policy | None = None,
                     kv_dtype: torch.dtype | None = None) -> int:
        """K and V (in kv_dtype, default dtype; FP8 with its two fp32 scales), the int32 position and the
        fp32 values the policy keeps beside each slot (policy None: the most any policy keeps, for sizing a
        batch)."""
        fp32_kept = (2 if policy is None else policy.keeps_vnorm + policy.keeps_score) + 2 * (kv_dtype == kernel.FP8)
        per_slot = 2 * cfg.head_dim * (kv_dtype or dtype).itemsize + 4 + 4 * fp32_kept
        per_row = 4 * cfg.head_dim if policy is None or policy.keeps_key_sum else 0  # key_sum, per KV head
        queries = cfg.n_heads * RKV_QUERIES * cfg.head_dim * dtype.itemsize \
            if policy is None or policy.keeps_queries else 0
        return cfg.n_layers * batch * (cfg.n_kv_heads * (slots * per_slot + per_row) + queries)

    def reset(self, rows=None):
        """Empty the cache, or only rows `rows` [n] (a server's free rows, which keep decoding junk)."""
        at = slice(None) if rows is None else rows
        for layer in self.layers:
            layer.pos[at] = -1
            layer.next_slot[at] = 0

    # ---- decode: one token per sequence -------------------------------------------------------------
    def decode(self, layer: Layer, q, k, v, positions):
        """q: [B, H_q, D]; k, v: [B, H_kv, D]; positions: [B]. Returns the attention output [B, H_q, D]."""
        p, c = self.policy, layer
        B, H, D = k.shape
        # (row, head, slot) index triples: index_put_ is what the compiler turns into an in-place store
        at = (torch.arange(B, device=k.device)[:, None], torch.arange(H, device=k.device)[None, :], c.next_slot)
        if self.fp8:  # from here on k and v are the values the cache holds (in fp32), which the rules score
            (k_bits, k_scale), (v_bits, v_scale) = kernel.quantize(k), kernel.quantize(v)
            k, v = kernel.dequantize(k_bits, k_scale), kernel.dequantize(v_bits, v_scale)
        if p.keeps_key_sum:  # the running sum of unit keys: the evicted key's leaves, the new one's comes
            held = (c.pos[at] >= 0)[..., None]  # [B, H_kv, 1]
            old = kernel.dequantize(c.k[at], c.k_scale[at]) if self.fp8 else c.k[at]  # fp32, as k
            c.key_sum.add_(unit(k) - unit(old) * held)
        if p.keeps_queries:  # the ring of the last W queries, at column position % W (q: the model's dtype)
            W = c.queries.shape[2]
            c.queries.index_put_((at[0], torch.arange(q.shape[1], device=q.device)[None, :],
                                  (positions % W)[:, None].expand(B, q.shape[1])), q)
        if self.fp8:
            c.k.index_put_(at, k_bits)
            c.v.index_put_(at, v_bits)
            c.k_scale.index_put_(at, k_scale)
            c.v_scale.index_put_(at, v_scale)
        else:
            c.k.index_put_(at, k)
            c.v.index_put_(at, v)
        c.pos.index_put_(at, positions.int()[:, None].expand(B, H))
        if p.keeps_vnorm:  # computed once, here, so the kernel never reduces V tiles for it
            c.vnorm.index_put_(at, kernel.l1_norm(v))
        if p.keeps_score:  # the new token's value starts now: its key norm, or nothing accumulated yet
            fresh = k.float().norm(dim=-1) if p.keeps_key_norm else k.new_zeros(B, H, dtype=torch.float32)
            c.score.index_put_(at, fresh)
        attend = kernel.decode_attention if q.is_cuda else kernel.decode_attention_ref
        # tensor parallel, one decision per layer: the kernel gives this rank's part of the score, not a slot
        together = p.rule == "kernel" and not p.per_head and self.tp.size > 1
        # a cache that fills in order (full) reads only the slots filled so far
        out, evict = attend(q, c.k, c.v, c.pos, per_head=p.per_head, n_sink=p.n_sink, window=p.window,
                            select=p.rule == "kernel", value_norm=p.value_norm,
                            acc=c.score if p.accumulate and not together else None,
                            limit=c.next_slot + 1 if p.rule == "fill" else None,
                            vnorm=c.vnorm if p.keeps_vnorm else None,
                            k_scale=c.k_scale if self.fp8 else None, v_scale=c.v_scale if self.fp8 else None,
                            partial=together)
        # a full cache is sized for every token, so slots fill in order; a finished sequence that steps on
        # until its row is reused just rewrites its last slot
        if p.rule == "fill":
            evict = (c.next_slot + 1).clamp(max=self.slots - 1)
        elif together:
            evict = self.decide_together(c, evict)
        elif p.rule != "kernel":  # the rules that need no attention pick in PyTorch
            score = rule_score(p, self.readable(c), positions)
            # per layer, the mean over every rank's heads; not for the oldest position, the same in every head
            evict = argmin_slot(score if p.per_head or p.rule == "oldest" else self.layer_mean(score), c.pos, p)
        c.next_slot.copy_(evict)
        return out

    def layer_mean(self, score):
        """[B, H, ...] -> [B, 1, ...]: the mean over every head of the layer, this rank's and the others'."""
        return self.tp.mean(score.mean(1, keepdim=True))

    def decide_together(self, c: Layer, part):
        """Tensor parallel, one decision per layer: this rank's score part [B, S] (the mean over its heads,
        from the kernel) becomes the layer's mean over every head, from which each rank takes the same slot
        (the kernel's rule: empty first, protected never, lowest slot on ties). Returns [B, H_kv]."""
        score = self.layer_mean(part[:, None])  # [B, 1, S]
        if self.policy.accumulate:  # every column of c.score holds the layer's accumulated score
            c.score.add_(score)
            score = c.score[:, :1]
        return argmin_slot(score, c.pos, self.policy)

    def readable(self, c: Layer) -> Layer:
        """The layer with its keys as values (dequantized, for an FP8 cache), for the rules that read them."""
        return replace(c, k=kernel.dequantize(c.k, c.k_scale, self.dtype)) if self.fp8 else c

    # ---- prefill: a batch of (right-padded) prompts ------------------------------------------------
    def prefill(self, layer: Layer, q, k, v, positions, rows):
        """q: [R, H_q, T, D]; k, v: [R, H_kv, T, D]; positions: [R, T], -1 for padding after each prompt;
        rows: [R] the cache rows these prompts go to (the other rows are left as they are). Causal
        attention over the prompts, then their K/V into the slots, compressed if they do not fit."""
        out = prefill_attention(q, k, v)
        p, c, (R, H, T, D) = self.policy, layer, k.shape
        if p.keeps_queries:  # the last prompt queries start the ring (at column position % W)
            last, cols = last_queries(q, positions, c.queries.shape[2])  # [R, H_q, W, D], [R, W]
            c.queries[rows] = 0  # a prompt shorter than W leaves columns empty; the last sequence's must go
            c.queries[rows[:, None], :, cols] = last.transpose(1, 2)
        S = self.slots
        # H2O / VATP: every prompt query's attention is already part of the accumulated score
        seed = self.prompt_seed(q, k, v, positions) if p.accumulate else None  # [R, H_kv, T]
        pos = positions[:, None].expand(R, H, T)  # [R, H_kv, T]
        if T >= S:  # keep S - 1 tokens per row; the last slot stays empty for the first new token
            keep = self.prompt_keep(layer, q, k, v, pos, S - 1, seed)  # [R, H_kv, S-1], into T
            at = keep[..., None].expand(R, H, S - 1, D)
            k, v, pos = k.gather(2, at), v.gather(2, at), pos.gather(2, keep)
            seed = seed.gather(2, keep) if seed is not None else None
            T = S - 1
        c.pos[rows] = -1  # a reused row forgets its previous sequence
        if self.fp8:  # the prompt attended, and was compressed, at full precision; from here on the rules see
            #           the values the cache holds
            c.v_scale[rows] = 0.0  # the kernel divides by the row's largest value scale: not an old sequence's
            (k_bits, k_scale), (v_bits, v_scale) = kernel.quantize(k), kernel.quantize(v)
            c.k[rows, :, :T], c.v[rows, :, :T] = k_bits, v_bits
            c.k_scale[rows, :, :T], c.v_scale[rows, :, :T] = k_scale, v_scale
            k, v = kernel.dequantize(k_bits, k_scale), kernel.dequantize(v_bits, v_scale)  # fp32, as in decode
        else:
            c.k[rows, :, :T] = k
            c.v[rows, :, :T] = v
        c.pos[rows, :, :T] = pos.int()
        if p.accumulate:
            c.score[rows] = 0.0
            c.score[rows, :, :T] = seed
        if p.keeps_key_norm:
            c.score[rows, :, :T] = k.float().norm(dim=-1)
        if p.keeps_vnorm:
            c.vnorm[rows, :, :T] = kernel.l1_norm(v)
        if p.keeps_key_sum:
            c.key_sum[rows] = unit_key_sum(k, pos)
        # prompts are right-padded, so the lowest empty slot is just past the tokens kept
        c.next_slot[rows] = (c.pos[rows] >= 0).sum(-1)
        return out

    def prompt_seed(self, q, k, v, positions):
        """The accumulated score of each prompt token after the prompt: the attention every prompt query
        gave it (column sums of the causal softmax, H2O's prefill score), per query head averaged as a decode
        step averages alpha (over the KV head's query group, or the whole layer), times ||v||_1 for VATP.
        Returns [R, H_kv, T] fp32."""
        p, (R, H, T, _) = self.policy, k.shape
        cols = attention_column_sums(q, k, positions)  # [R, H_q, T]
        cols = cols.view(R, H, -1, T).mean(2) if p.per_head else self.layer_mean(cols).expand(R, H, T)
        return cols * kernel.l1_norm(v) if p.value_norm else cols

    def prompt_keep(self, layer: Layer, q, k, v, pos, n_keep: int, seed=None):
        """The prompt tokens that stay when a prompt does not fit: SnapKV (default), StreamingLLM's first
        4 + most recent, or the policy's own decode rule (for the kernel rules: the last prompt query's score,
        or the accumulated seed of H2O / VATP; for the others, rule_score over the prompt as if it were the
        cache). The policy's sinks and recent window stay whatever the rule. pos: [R, H_kv, T]. Returns
        indices into T [R, H_kv, n_keep], sorted, real tokens before padding."""
        p, R, H, T = self.policy, *k.shape[:3]
        if self.prompt_rule == "streaming":  # its 4 first tokens (or the policy's sinks), then the most recent
            score = torch.where(pos < max(p.n_sink, 4), pos.max() + 1, pos).float()
        elif self.prompt_rule == "snapkv":
            score = snapkv_score(q, k, pos[:, 0], p.per_head, self.tp)
        elif seed is not None:
            score = seed
        elif p.rule == "kernel":  # the decode score of the last real query
            last = q[torch.arange(R), :, (pos[:, 0] >= 0).sum(1) - 1]  # [R, H_q, D]
            score = kernel.decode_attention_ref(last, k, v, pos, per_head=p.per_head, value_norm=p.value_norm,
                                                partial=True)[1]  # [R, H_kv, T], or per layer [R, T]
            score = score if p.per_head else self.layer_mean(score[:, None]).expand(R, H, T)
        else:  # the rule's own eviction score: decoding evicts the lowest, so the highest are kept
            prompt = replace(layer, k=k, v=v, pos=pos, score=k.float().norm(dim=-1))
            if p.keeps_key_sum:
                prompt.key_sum = unit_key_sum(k, pos)
            if p.keeps_queries:
                prompt.queries = last_queries(q, pos[:, 0])[0]
            score = rule_score(p, prompt, pos.amax((1, 2)))
            score = score if p.per_head else self.layer_mean(score).expand(R, H, T)
        protected = kernel.protected_mask(pos, p.n_sink, p.window)
        return top_tokens(score.masked_fill(protected, float("inf")), pos, n_keep)


def last_queries(q, positions, n: int = RKV_QUERIES):
    """The queries of the last n real prompt tokens [R, H_q, n, D] and the ring columns they go to,
    position % n [R, n] (a prompt shorter than n gives its first query several times, into column 0).
    q: [R, H_q, T, D]; positions: [R, T]."""
    R, Hq, T, D = q.shape
    lengths = (positions >= 0).sum(1, keepdim=True)  # [R, 1]
    idx = (lengths - n + torch.arange(n, device=q.device)).clamp(min=0)  # [R, n] into T
    return q.gather(2, idx[:, None, :, None].expand(R, Hq, n, D)), positions.gather(1, idx) % n


def in_order(positions) -> bool:
    """Each row of positions [B, T] is 0, 1, 2, ..., then only padding (-1). One host sync (prefill only)."""
    ramp = torch.arange(positions.shape[1], device=positions.device)
    return bool(((positions == ramp) | (positions < 0)).all() and (positions[:, 1:] < 0).ge(positions[:, :-1] < 0).all())


def padding_last(positions):
    """Positions for causal masks with padding (-1) at "infinity": real queries never see it, padding queries
    see everything, so their (discarded) outputs stay finite instead of a NaN that would leak through 0 * NaN."""
    return torch.where(positions < 0, torch.iinfo(positions.dtype).max, positions)


def prefill_attention(q, k, v):
    """Causal attention over right-padded prompts (each row of positions 0, 1, 2, ..., then padding -1, as
    the engine prefills them). q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]. No mask is needed: a real query's
    earlier keys are all real, so SDPA's causal kernel (a flash-attention kernel, never T x T scores)
    gives their outputs exactly; padding queries get finite outputs, which are discarded. (Transformer.forward
    checks the order, once for all layers: the check is a host sync.)"""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H_q, T, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_column_sums(q, k, positions, budget_bytes: int = 2**28):
    """The causal softmax attention of every real prompt query, summed over the queries: [B, H_q, T] fp32
    (padding queries count for nothing, padding keys get nothing). The logits in the model's dtype, as H2O's
    reference computes them, the softmax in fp32. Queries go in chunks so that one chunk's fp32 scores
    (logits, then weights, in place) stay within budget_bytes; the prompt's output comes from
    prefill_attention. q: [B, H_q, T, D]; k: [B, H_kv, T, D]; positions: [B, T]."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    q = q.view(B, H, Hq // H, T, D)  # each KV head's query group, so K is never repeated per query head
    eff = padding_last(positions)
    chunk = max(1, budget_bytes // (2 * 4 * B * Hq * T))  # two fp32 [B, H_q, chunk, T] at a time
    cols = q.new_zeros(B, H, Hq // H, T, dtype=torch.float32)
    for start in range(0, T, chunk):
        part = slice(start, start + chunk)
        logits = (q[:, :, :, part] @ k[:, :, None].transpose(-1, -2)).float() / D ** 0.5  # [B, H_kv, G, C, T]
        visible = eff[:, None, None, None, :] <= eff[:, None, None, part, None]  # [B, 1, 1, C, T]
        alpha = logits.masked_fill_(~visible, float("-inf")).softmax(-1)
        cols += alpha.mul_(positions[:, None, None, part, None] >= 0).sum(3)
    return cols.view(B, Hq, T)


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


def top_tokens(score, pos, n_keep: int):
    """Indices [R, H_kv, n_keep] of the highest-scoring real tokens (padding last), in prompt order."""
    score = score.masked_fill(pos < 0, float("-inf"))
    # a stable sort, not topk: of tied scores the earlier tokens stay, whatever padding the prompt's batch adds
    # (topk breaks ties in an order that changes with the padded length)
    return score.sort(stable=True, dim=-1, descending=True).indices[..., :n_keep].sort(-1).values


def argmin_slot(score, pos, p: Policy):
    """The lowest-index empty slot, else the lowest score among unprotected slots; per KV head or, with
    one decision per layer, on the mean over heads. score, pos: [B, H_kv, S]. Returns [B, H_kv]."""
    protected = kernel.protected_mask(pos, p.n_sink, p.window)
    empty = pos < 0
    if not p.per_head:  # every KV head holds the same tokens
        score, protected, empty = score.mean(1, keepdim=True), protected[:, :1], empty[:, :1]
    score = score.masked_fill(protected, float("inf")).masked_fill(empty, float("-inf"))
    return score.argmin(-1).expand(pos.shape[:2])
