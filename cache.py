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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import kernel

SNAPKV_WINDOW = 32  # prompt compression keeps the last 32 prompt tokens and ranks the rest by their attention
SNAPKV_POOL = 5
PROMPT_RULES = ("snapkv", "streaming", "decode")


@dataclass(frozen=True)
class Policy:
    """How a full cache picks the slot the next token overwrites. Every rule is one argmin per step over
    a per-slot score; empty slots always come first and protected slots never."""
    rule: str  # "kernel": scored inside the attention kernel; "fill": never evicts (a full-size cache);
    #            "oldest", "random", "knorm": plain PyTorch over the slots' positions or key norms
    per_head: bool = False  # one decision per KV head (mean over its query group), not per layer
    value_norm: bool = True  # kernel rules: score alpha * ||v||_1 (LongFlow) or alpha alone (TOVA)
    accumulate: bool = False  # kernel rules: rank by the score summed over all steps so far (H2O, VATP)
    n_sink: int = 0  # the first n_sink positions are never evicted
    window: int = 0  # nor the `window` most recent tokens
    window_share: float = 0  # default window: this share of the budget left after the sinks

    @property
    def keeps_vnorm(self) -> bool:  # ||v||_1 per slot, stored with the token: for the rules scored with it
        return self.rule == "kernel" and self.value_norm

    @property
    def keeps_score(self) -> bool:  # a per-slot history: accumulated scores (h2o, vatp) or key norms (knorm)
        return self.accumulate or self.rule == "knorm"


POLICIES = {
    "full": Policy("fill"),
    # LongFlow (Sun et al. 2025): argmin_i mean_h alpha[h, i] * ||v_i||_1 for the current query, per layer
    "longflow": Policy("kernel"),
    "longflow-head": Policy("kernel", per_head=True),
    # TOVA (Oren et al. 2024): the current query's attention averaged over the heads of the layer
    "tova": Policy("kernel", value_norm=False),
    # H2O (Zhang et al. 2023): attention accumulated over every step, per head; half the budget recent
    "h2o": Policy("kernel", per_head=True, value_norm=False, accumulate=True, window_share=0.5),
    # VATP (Guo et al. 2024): H2O's accumulated attention times ||v_i||_1; the first 20 tokens are sinks,
    # half of the rest recent
    "vatp": Policy("kernel", per_head=True, accumulate=True, n_sink=20, window_share=0.5),
    # StreamingLLM (Xiao et al. 2024): 4 attention sinks and the most recent tokens
    "streaming": Policy("oldest", n_sink=4),
    # sanity baselines: a fixed pseudo-random slot (a hash of position and layer); the largest key norm
    # (Devoto et al. 2024 keep the keys of low norm)
    "random": Policy("random"),
    "knorm": Policy("knorm"),
}


def check_prompt_rule(rule: str):
    if rule not in PROMPT_RULES:
        raise ValueError(f"unknown prompt compression {rule!r}; choose one of {', '.join(PROMPT_RULES)}")


def is_int(x) -> bool:
    """An int, and not a bool (which Python counts as one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_policy(name: str, budget: int | None, n_sink: int | None = None, window: int | None = None,
                   prompt_rule: str = "snapkv") -> Policy:
    """The named policy with its protections in slots (its defaults, or the caller's), checked against
    the budget. Raises a clear error for a policy, rule or budget that cannot work."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    check_prompt_rule(prompt_rule)
    if budget is not None and (not is_int(budget) or budget <= 0):
        raise ValueError(f"budget must be a positive integer number of KV slots, got {budget!r}")
    for what, value in (("sinks", n_sink), ("window", window)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    p = POLICIES[name]
    n_sink = p.n_sink if n_sink is None else n_sink
    if window is None:
        window = int(p.window_share * (budget - n_sink)) if p.window_share and budget else p.window
    # a compressed prompt keeps the sinks, and the last SNAPKV_WINDOW tokens which cover the recent window
    # when it is shorter; the new token needs one more slot
    need = n_sink + max(SNAPKV_WINDOW, window) + 1
    if budget is not None and p.rule != "fill" and budget < need:
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


def random_score(pos, layer):
    """The `random` rule's eviction score: a hash of (position, layer), so runs repeat themselves."""
    return hash32(pos.long() * 0x9E3779B1 + layer).float()


def rule_score(rule: str, pos, key_norm, layer):
    """The eviction score (lowest goes) of the rules that need no attention: the oldest position
    (StreamingLLM), a fixed hash of (position, layer), or the largest key norm. pos, key_norm: [.., S]."""
    if rule == "oldest":
        return pos.float()
    return random_score(pos, layer) if rule == "random" else -key_norm


@dataclass
class Layer:
    """One layer's slots and what is kept beside them. A plain object of tensors (the layer number is a
    tensor too), so the decode step compiles one layer and runs that code for every layer."""
    k: torch.Tensor  # [B, H_kv, S, D] keys after RoPE
    v: torch.Tensor  # [B, H_kv, S, D]
    pos: torch.Tensor  # [B, H_kv, S] int32 position of the token in each slot, -1 = empty
    next_slot: torch.Tensor  # [B, H_kv] int64 where the next token goes
    score: torch.Tensor  # [B, H_kv, S] fp32 history: accumulated scores (h2o, vatp) or key norms (knorm)
    vnorm: torch.Tensor  # [B, H_kv, S] fp32 ||v||_1 of each slot, for the rules that score with it
    index: torch.Tensor  # [] int64 the layer number (the random rule hashes it)


class KVCache:
    def __init__(self, cfg, batch: int, slots: int, device, dtype, policy: Policy | str = "full",
                 prompt_rule: str = "snapkv"):
        self.policy = resolve_policy(policy, slots) if isinstance(policy, str) else policy
        check_prompt_rule(prompt_rule)
        self.prompt_rule, self.slots = prompt_rule, slots
        self.layers = [self.new_layer(cfg, batch, slots, device, dtype, i) for i in range(cfg.n_layers)]

    def new_layer(self, cfg, batch: int, slots: int, device, dtype, index: int) -> Layer:
        # separate tensors per layer, not slices of [L, ...] tensors: the compiled step then updates each in
        # place, where a mutated slice of a larger input would be copied whole, every layer, every step
        shape = (batch, cfg.n_kv_heads, slots)
        f32 = lambda used: torch.zeros(shape if used else (1, 1, 1), device=device)  # a stand-in when unused
        return Layer(k=torch.zeros(*shape, cfg.head_dim, device=device, dtype=dtype),
                     v=torch.zeros(*shape, cfg.head_dim, device=device, dtype=dtype),
                     pos=torch.full(shape, -1, device=device, dtype=torch.int32),
                     next_slot=torch.zeros(shape[:2], device=device, dtype=torch.int64),
                     score=f32(self.policy.keeps_score), vnorm=f32(self.policy.keeps_vnorm),
                     index=torch.tensor(index, device=device))

    @staticmethod
    def bytes_needed(cfg, batch: int, slots: int, dtype, policy: Policy | None = None) -> int:
        """K and V, the int32 position and the fp32 values the policy keeps beside each slot (policy None:
        the most any policy keeps, for sizing a batch)."""
        fp32_kept = 2 if policy is None else policy.keeps_vnorm + policy.keeps_score
        per_slot = 2 * cfg.head_dim * dtype.itemsize + 4 + 4 * fp32_kept
        return cfg.n_layers * batch * cfg.n_kv_heads * slots * per_slot

    def reset(self):
        for layer in self.layers:
            layer.pos.fill_(-1)
            layer.next_slot.zero_()

    # ---- decode: one token per sequence -------------------------------------------------------------
    def decode(self, layer: Layer, q, k, v, positions):
        """q: [B, H_q, D]; k, v: [B, H_kv, D]; positions: [B]. Returns the attention output [B, H_q, D]."""
        p, c = self.policy, layer
        B, H, D = k.shape
        # (row, head, slot) index triples: index_put_ is what the compiler turns into an in-place store
        at = (torch.arange(B, device=k.device)[:, None], torch.arange(H, device=k.device)[None, :], c.next_slot)
        c.k.index_put_(at, k)
        c.v.index_put_(at, v)
        c.pos.index_put_(at, positions.int()[:, None].expand(B, H))
        if p.keeps_vnorm:  # computed once, here, so the kernel never reduces V tiles for it
            c.vnorm.index_put_(at, kernel.l1_norm(v))
        if p.keeps_score:  # the new token's history starts now: its key norm (knorm), or nothing yet
            fresh = k.float().norm(dim=-1) if p.rule == "knorm" else k.new_zeros(B, H, dtype=torch.float32)
            c.score.index_put_(at, fresh)
        attend = kernel.decode_attention if q.is_cuda else kernel.decode_attention_ref
        # a cache that fills in order (full) reads only the slots filled so far
        out, evict = attend(q, c.k, c.v, c.pos, per_head=p.per_head, n_sink=p.n_sink, window=p.window,
                            select=p.rule == "kernel", value_norm=p.value_norm, acc=c.score if p.accumulate else None,
                            limit=c.next_slot + 1 if p.rule == "fill" else None,
                            vnorm=c.vnorm if p.keeps_vnorm else None)
        # a full cache is sized for every token, so slots fill in order; a finished sequence that steps on
        # until its row is reused just rewrites its last slot
        if p.rule == "fill":
            evict = (c.next_slot + 1).clamp(max=self.slots - 1)
        elif p.rule != "kernel":  # the rules that need no attention pick in PyTorch (c.score: knorm's key norms)
            evict = argmin_slot(rule_score(p.rule, c.pos, c.score, c.index), c.pos, p)
        c.next_slot.copy_(evict)
        return out

    # ---- prefill: a batch of (right-padded) prompts ------------------------------------------------
    def prefill(self, layer: Layer, q, k, v, positions, rows):
        """q: [R, H_q, T, D]; k, v: [R, H_kv, T, D]; positions: [R, T], -1 for padding after each prompt;
        rows: [R] the cache rows these prompts go to (the other rows are left as they are). Causal
        attention over the prompts, then their K/V into the slots, compressed if they do not fit."""
        out = prefill_attention(q, k, v, positions)
        c, (R, H, T, D) = layer, k.shape
        S = self.slots
        if T >= S:  # keep S - 1 tokens per row; the last slot stays empty for the first new token
            keep = self.prompt_keep(layer, q, k, v, positions, S - 1)  # [R, H_kv, S-1], into T
            at = keep[..., None].expand(R, H, S - 1, D)
            k, v = k.gather(2, at), v.gather(2, at)
            positions = positions[:, None].expand(R, H, T).gather(2, keep)  # [R, H_kv, S-1]
            T = S - 1
        c.pos[rows] = -1  # a reused row forgets its previous sequence
        c.k[rows, :, :T] = k
        c.v[rows, :, :T] = v
        c.pos[rows, :, :T] = positions.int().view(R, -1, T).expand(R, H, T)
        if self.policy.accumulate:  # scores accumulate from the first decode step on
            c.score[rows] = 0.0
        if self.policy.rule == "knorm":
            c.score[rows, :, :T] = k.float().norm(dim=-1)
        if self.policy.keeps_vnorm:
            c.vnorm[rows, :, :T] = kernel.l1_norm(v)
        # prompts are right-padded, so the lowest empty slot is just past the tokens kept
        c.next_slot[rows] = (c.pos[rows] >= 0).sum(-1)
        return out

    def prompt_keep(self, layer: Layer, q, k, v, positions, n_keep: int):
        """The prompt tokens that stay when a prompt does not fit: SnapKV (default), StreamingLLM's first
        4 + most recent, or the policy's own decode rule scored for the last prompt query. The policy's
        sinks and recent window stay whatever the rule. Returns indices into T [R, H_kv, n_keep], sorted,
        real tokens before padding."""
        p, R, H, T = self.policy, *k.shape[:3]
        pos = positions[:, None].expand(R, H, T)  # [R, H_kv, T]
        if self.prompt_rule == "streaming":
            sinks = max(p.n_sink, 4)
            return top_tokens(torch.where(pos < sinks, pos.max() + 1, pos).float(), pos, n_keep)
        if self.prompt_rule == "snapkv":
            score = snapkv_score(q, k, positions, p.per_head)
        elif p.rule == "kernel":  # the decode score of the last real query, which the reference adds into acc
            last = q[torch.arange(R), :, (positions >= 0).sum(1) - 1]  # [R, H_q, D]
            score = q.new_zeros(R, H, T, dtype=torch.float32)
            kernel.decode_attention_ref(last, k, v, pos, per_head=p.per_head, value_norm=p.value_norm, acc=score)
        else:
            # the rule's own eviction score: decoding evicts the lowest, so the highest are kept
            score = rule_score(p.rule, pos, k.float().norm(dim=-1), layer.index)
            score = score if p.per_head else score.mean(1, keepdim=True).expand(R, H, T)
        protected = kernel.protected_mask(pos, p.n_sink, p.window)
        return top_tokens(score.masked_fill(protected, float("inf")), pos, n_keep)


def prefill_attention(q, k, v, positions, chunk: int = 1024):
    """Causal attention by position, padding masked, a chunk of queries at a time so a long prompt never
    holds a T x T score matrix. q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]; positions: [B, T]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H_q, T, D]
    # padding sits at position "infinity": real queries never see it, padding queries see everything,
    # so their (discarded) outputs stay finite instead of a NaN that would leak through 0 * NaN
    eff = torch.where(positions < 0, torch.iinfo(positions.dtype).max, positions)  # [B, T]
    outs = []
    for start in range(0, q.shape[2], chunk):
        end = min(start + chunk, q.shape[2])
        # keys after `end` hold later positions or padding (prompts are right-padded): never visible
        mask = eff[:, None, None, :end] <= eff[:, None, start:end, None]  # [B, 1, C, end]
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                   attn_mask=mask))
    return torch.cat(outs, dim=2)


def snapkv_score(q, k, positions, per_head: bool):
    """SnapKV prompt compression (Li et al. 2024): the last SNAPKV_WINDOW prompt tokens stay (score +inf);
    the rest are ranked by the attention those queries give them (softmax weights summed over the
    window's queries and the heads, average-pooled over 5 neighbouring tokens). Returns [B, H_kv, T];
    q: [B, H_q, T, D]; k: [B, H_kv, T, D]; positions: [B, T]."""
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
        score = score.sum(1, keepdim=True).expand(B, H, T)  # one decision for the whole layer
    in_window = (idx >= lengths[:, None] - SNAPKV_WINDOW) & (positions >= 0)  # [B, T]
    return torch.where(in_window[:, None], float("inf"), score)


def top_tokens(score, pos, n_keep: int):
    """Indices [R, H_kv, n_keep] of the highest-scoring real tokens (padding last), in prompt order."""
    score = score.masked_fill(pos < 0, float("-inf"))
    return score.topk(n_keep, dim=-1).indices.sort(-1).values


def argmin_slot(score, pos, p: Policy):
    """The lowest-index empty slot, else the lowest score among unprotected slots; per KV head or, with
    one decision per layer, on the mean over heads. score, pos: [B, H_kv, S]. Returns [B, H_kv]."""
    protected = kernel.protected_mask(pos, p.n_sink, p.window)
    empty = pos < 0
    if not p.per_head:  # every KV head holds the same tokens
        score, protected, empty = score.mean(1, keepdim=True), protected[:, :1], empty[:, :1]
    score = score.masked_fill(protected, float("inf")).masked_fill(empty, float("-inf"))
    return score.argmin(-1).expand(pos.shape[:2])
