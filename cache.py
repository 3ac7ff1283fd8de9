"""The static KV cache: `slots` places per layer and sequence, allocated once, and what each decode step
writes and evicts.

Each slot holds one token's key (after RoPE) and value, and its absolute position (-1 = empty). Attention
runs over "the slots that hold something", never over "a prefix of length n", so the order of slots does
not matter and a token can be written anywhere. Every decode step, every layer:
    1. the new token's K/V go into `next_slot`, chosen at the previous step;
    2. attention over all slots (kernel.decode_attention), which also scores every slot;
    3. `next_slot` = the lowest empty slot, else the slot the policy ranks lowest (policies.py).
With policy "full" the cache has room for every token and slots simply fill in order.
"""
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

import kernel
from parallel import SINGLE, Group
from policies import (POLICIES, Policy, check_prompt_rule, resolve_policy, snapkv_score, streaming_prompt_score,
                      top_tokens)


@dataclass
class Layer:
    """One layer's slots and what the policy keeps beside them. A plain object of tensors (the layer number
    is a tensor too), so the decode step compiles one layer and runs that code for every layer."""
    k: torch.Tensor  # [B, H_kv, S, D] keys after RoPE (FP8 cache: uint8 e4m3 bits, see kernel.quantize)
    v: torch.Tensor  # [B, H_kv, S, D]
    k_scale: torch.Tensor  # [B, H_kv, S] fp32 with an FP8 cache (a key is k * k_scale), else a stand-in
    v_scale: torch.Tensor  # [B, H_kv, S] fp32 likewise
    v_top: torch.Tensor  # [B, H_kv] fp32 with an FP8 cache: the largest value scale written since the row's prompt,
    # so never below a held one (kernel.decode_attention's v_top: a bound it would otherwise reduce every step)
    pos: torch.Tensor  # [B, H_kv, S] int32 position of the token in each slot, -1 = empty
    next_slot: torch.Tensor  # [B, H_kv] int64 where the next token goes
    kept: dict[str, torch.Tensor]  # what the policy keeps, by name (Policy.keeps)
    index: torch.Tensor  # [] int64 the layer number (the random policy hashes it)
    heads: torch.Tensor  # [H_kv] int64 the KV heads' numbers in the whole model (tensor parallel: this rank's)
    data: dict[str, torch.Tensor] = field(default_factory=dict)  # the policy's data of this model's layer, the same
    # for every row and never written (Policy.layer_data)
    ROWS: ClassVar = ("k", "v", "k_scale", "v_scale", "v_top", "pos", "next_slot", "kept")  # per row (step.first_rows)


KV_DTYPES = {"auto": None, "fp8": kernel.FP8}  # what the cache stores K and V in (auto: the model's dtype)


class KVCache:
    ROWS = ("layers",)  # what holds rows (step.first_rows)

    def __init__(self, cfg, batch: int, slots: int, device, dtype, policy: Policy | str = "full",
                 prompt_rule: str = "snapkv", kv_dtype: torch.dtype | None = None, tp: Group = SINGLE):
        """dtype: the model's; kv_dtype: what K and V are stored in, dtype (None) or kernel.FP8 (e4m3 with a
        scale per token and KV head). tp: the ranks of a tensor-parallel model, cfg this rank's part: its
        cache holds its own KV heads, and decisions per layer take the mean over the heads of every rank."""
        if isinstance(policy, str):  # a name: its protections sized for these slots
            policy = resolve_policy(policy, None if policy == "full" else slots)
        if kv_dtype not in (None, dtype, kernel.FP8):
            raise ValueError(f"a KV cache stores the model's dtype or FP8 (e4m3), not {kv_dtype}")
        check_prompt_rule(prompt_rule)
        self.policy, self.dtype, self.fp8 = policy, dtype, kv_dtype == kernel.FP8
        self.prompt_rule, self.slots, self.tp = prompt_rule, slots, tp
        self.layers = [self.new_layer(cfg, batch, slots, device, dtype, i) for i in range(cfg.n_layers)]

    def new_layer(self, cfg, batch: int, slots: int, device, dtype, index: int) -> Layer:
        # separate tensors per layer, not slices of [L, ...] tensors: the compiled step then updates each in
        # place, where a mutated slice of a larger input would be copied whole, every layer, every step
        shape = (batch, cfg.n_kv_heads, slots)
        scale = lambda *dims: torch.zeros(dims if self.fp8 else (1,) * len(dims), device=device)  # a stand-in if unused
        stored = torch.uint8 if self.fp8 else dtype
        return Layer(k=torch.zeros(*shape, cfg.head_dim, device=device, dtype=stored),
                     v=torch.zeros(*shape, cfg.head_dim, device=device, dtype=stored),
                     k_scale=scale(*shape), v_scale=scale(*shape), v_top=scale(*shape[:2]),
                     pos=torch.full(shape, -1, device=device, dtype=torch.int32),
                     next_slot=torch.zeros(shape[:2], device=device, dtype=torch.int64),
                     kept={name: kept.alloc(cfg, batch, slots, device, dtype)
                           for name, kept in self.policy.keeps.items()},
                     index=torch.tensor(index, device=device),
                     heads=torch.arange(cfg.n_kv_heads, device=device) + self.tp.rank * cfg.n_kv_heads,
                     data=self.policy.layer_data(index, device))

    @staticmethod
    def bytes_needed(cfg, batch: int, slots: int, dtype, policy: Policy | None = None,
                     kv_dtype: torch.dtype | None = None) -> int:
        """K and V (in kv_dtype, default dtype; FP8 with its two fp32 scales a slot and v_top a KV head), the int32
        position, what the policy keeps and its data of each layer (policy None: the most any policy keeps, for sizing
        a batch)."""
        fp8 = kv_dtype == kernel.FP8
        per_slot = 2 * cfg.head_dim * (kv_dtype or dtype).itemsize + 4 + 8 * fp8
        kept = lambda p: batch * sum(k.bytes_per_row(cfg, slots, dtype) for k in p.keeps.values()) + \
            p.layer_data_bytes(cfg)
        kept_bytes = kept(policy) if policy is not None else max(map(kept, POLICIES.values()))
        return cfg.n_layers * (batch * cfg.n_kv_heads * (slots * per_slot + 4 * fp8) + kept_bytes)

    def reset(self, rows=None):
        """Empty the cache, or only rows `rows` [n] (a server's free rows, which keep decoding junk). Rows are
        filled by index_fill_, here and wherever the engine may run while a block decodes: `x[rows] = -1` copies
        the -1 to the GPU first, and such a copy waits for the GPU's queue (sampling.on_device)."""
        pos = self.layers[0].pos
        rows = torch.arange(pos.shape[0], device=pos.device) if rows is None else rows
        for layer in self.layers:
            layer.pos.index_fill_(0, rows, -1)
            layer.next_slot.index_fill_(0, rows, 0)

    # ---- decode: one token per sequence -------------------------------------------------------------
    def decode(self, layer: Layer, q, k, v, positions):
        """q: [B, H_q, D]; k, v: [B, H_kv, D]; positions: [B]. Returns the attention output [B, H_q, D]."""
        p, c = self.policy, layer
        B, H, _ = k.shape
        # (row, head, slot) index triples: index_put_ is what the compiler turns into an in-place store
        at = (torch.arange(B, device=k.device)[:, None], torch.arange(H, device=k.device)[None, :], c.next_slot)
        stored, k, v = self.as_stored(k, v)  # from here on k and v are the values the cache holds
        for name, kept in p.keeps.items():  # before the store: a running sum takes out the token that leaves
            kept.write(c.kept[name], self, c, at, q, k, v, positions)
        for t, x in zip(self.stored_tensors(c), stored):
            t.index_put_(at, x)
        if self.fp8:  # the row's bound on its value scales: stored[-1], the new ones [B, H_kv]
            c.v_top.copy_(torch.maximum(c.v_top, stored[-1]))
        c.pos.index_put_(at, positions.int()[:, None].expand(B, H))
        out, evict = p.attend(self, c, q, positions)
        c.next_slot.copy_(evict)
        return out

    def attention(self, c: Layer, q, select=False, scoring=kernel.LONGFLOW, state=None, vnorm=None, limit=None,
                  partial=False, given=None):
        """kernel.decode_attention over layer c (its reference on the CPU) with the policy's protections; given:
        a given query's (given_query, pair_weight)."""
        p = self.policy
        attend = kernel.decode_attention if q.is_cuda else kernel.decode_attention_ref
        given_query, pair_weight = given or (None, None)
        return attend(q, c.k, c.v, c.pos, per_head=p.per_head, n_sink=p.n_sink, window=p.window, select=select,
                      scoring=scoring, state=state, limit=limit, vnorm=vnorm,
                      k_scale=c.k_scale if self.fp8 else None, v_scale=c.v_scale if self.fp8 else None,
                      partial=partial, v_top=c.v_top if self.fp8 else None, given_query=given_query,
                      pair_weight=pair_weight)

    def lowest(self, score, c: Layer):
        """The slot the policy's score [B, H_kv or 1, S] ranks lowest: per KV head, or per layer on the mean
        over every rank's heads (not for a score the same in every head). Returns [B, H_kv]."""
        p = self.policy
        layer_mean = (lambda s: s[:, :1]) if p.same_in_every_head else self.layer_mean
        return kernel.choose_slot(score, c.pos, p.n_sink, p.window, p.per_head, layer_mean)

    def layer_mean(self, score):
        """[B, H, ...] -> [B, 1, ...]: the mean over every head of the layer, this rank's and the others'."""
        return self.tp.mean(score.mean(1, keepdim=True))

    # ---- what the slots hold, as values (an FP8 cache stores e4m3 bits and scales) --------------------
    def as_stored(self, k, v):
        """K and V [..., D] as the cache writes them (FP8: bits and scales; see stored_tensors), and the
        values it then holds (FP8: dequantized to fp32; else k and v themselves)."""
        if not self.fp8:
            return (k, v), k, v
        (k_bits, k_scale), (v_bits, v_scale) = kernel.quantize(k), kernel.quantize(v)
        held = kernel.dequantize(k_bits, k_scale), kernel.dequantize(v_bits, v_scale)
        return (k_bits, v_bits, k_scale, v_scale), *held

    def stored_tensors(self, c: Layer) -> tuple:
        return (c.k, c.v, c.k_scale, c.v_scale) if self.fp8 else (c.k, c.v)

    def key_values(self, c: Layer, at):
        """The keys held in slots `at` (fp32 for an FP8 cache)."""
        return kernel.dequantize(c.k[at], c.k_scale[at]) if self.fp8 else c.k[at]

    def with_key_values(self, c: Layer) -> Layer:
        """The layer with its keys as values, for the policies that read them (an FP8 cache dequantizes one
        layer's keys; its values stay bits: no policy scored in PyTorch reads them)."""
        return replace(c, k=kernel.dequantize(c.k, c.k_scale, self.dtype)) if self.fp8 else c

    def with_values(self, c: Layer) -> Layer:
        """The layer with keys and values as values (bench.py fills, tests check what is kept)."""
        if not self.fp8:
            return c
        return replace(c, k=kernel.dequantize(c.k, c.k_scale), v=kernel.dequantize(c.v, c.v_scale))

    # ---- prefill: a batch of (right-padded) prompts ------------------------------------------------
    def prefill(self, layer: Layer, q, k, v, positions, rows):
        """The prompts' K/V into cache rows `rows` [R] (int64, on the cache's device: index_fill_ takes no
        other; the other rows are left as they are), compressed when they do not fit. q: [R, H_q, T, D];
        k, v: [R, H_kv, T, D]; positions: [R, T], -1 for padding after each prompt."""
        p, c, (R, H, T, D) = self.policy, layer, k.shape
        seed = p.prompt_seed(self, q, k, v, positions)  # [R, H_kv, T] or None
        pos = positions[:, None].expand(R, H, T)  # [R, H_kv, T]
        S = self.slots
        if T >= S:  # keep S - 1 tokens per row; the last slot stays empty for the first new token
            keep = self.prompt_keep(layer, q, k, v, pos, S - 1, seed)  # [R, H_kv, S-1], into T
            at = keep[..., None].expand(R, H, S - 1, D)
            k, v, pos = k.gather(2, at), v.gather(2, at), pos.gather(2, keep)
            seed = seed.gather(2, keep) if seed is not None else None
            T = S - 1
        c.pos.index_fill_(0, rows, -1)  # a reused row forgets its previous sequence
        # the prompt attended, and was compressed, at full precision; from here on the policy sees the values
        # the cache holds
        stored, k, v = self.as_stored(k, v)
        for t, x in zip(self.stored_tensors(c), stored):
            t[rows, :, :T] = x
        if self.fp8:  # the largest value scale of the prompt's tokens, not of its padding (nor of an earlier
            # sequence's, in the slots past T, which are never attended again)
            c.v_top[rows] = stored[-1].masked_fill(pos < 0, 0.0).amax(-1)  # [R, H_kv, T] -> [R, H_kv]
        c.pos[rows, :, :T] = pos.int()
        for name, kept in p.keeps.items():
            kept.start(c.kept[name], rows, q, k, v, pos, positions, seed)
        # prompts are right-padded, so the lowest empty slot is just past the tokens kept
        c.next_slot[rows] = (c.pos[rows] >= 0).sum(-1)

    def prompt_keep(self, layer: Layer, q, k, v, pos, n_keep: int, seed=None):
        """The prompt tokens that stay when a prompt does not fit: SnapKV (default), StreamingLLM's first
        4 + most recent, or the policy's own score over the prompt. The policy's sinks and recent window stay
        whatever the rule. pos: [R, H_kv, T]. Returns indices into T [R, H_kv, n_keep], sorted, real tokens
        before padding."""
        p, R, H, T = self.policy, *k.shape[:3]
        if self.prompt_rule == "streaming":
            score = streaming_prompt_score(pos, p.n_sink)
        elif self.prompt_rule == "snapkv":
            score = snapkv_score(q, k, pos[:, 0], p.per_head, self.tp)
        else:  # the policy's own eviction score: decoding evicts the lowest, so the highest are kept
            score = p.prompt_score(layer, q, k, v, pos, seed)
            score = score if p.per_head else self.layer_mean(score).expand(R, H, T)
        protected = kernel.protected_mask(pos, p.n_sink, p.window)
        return top_tokens(score.masked_fill(protected, float("inf")), pos, n_keep)
