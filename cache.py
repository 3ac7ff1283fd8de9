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
import torch
import torch.nn.functional as F

import kernel

POLICIES = ("full", "longflow", "longflow-head")
SNAPKV_WINDOW = 32  # prompt compression keeps the last 32 prompt tokens and ranks the rest by their attention
SNAPKV_POOL = 5


def check_budget(budget, policy: str, n_sink: int = 0, window: int = 0):
    """Raise a clear error for a policy or budget that cannot work."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive integer number of KV slots, got {budget!r}")
    need = max(SNAPKV_WINDOW, n_sink + window) + 1
    if policy != "full" and budget < need:
        raise ValueError(f"budget {budget} is too small: the {n_sink} sink + {window} recent protected "
                         f"tokens, the {SNAPKV_WINDOW}-token prompt window and the new token need at "
                         f"least {need} slots")


class KVCache:
    def __init__(self, cfg, batch: int, slots: int, device, dtype, policy="full",
                 n_sink: int = 0, window: int = 0):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, slots)
        self.k = torch.zeros(*shape, cfg.head_dim, device=device, dtype=dtype)  # [L, B, H_kv, S, D]
        self.v = torch.zeros(*shape, cfg.head_dim, device=device, dtype=dtype)  # [L, B, H_kv, S, D]
        self.pos = torch.full(shape, -1, device=device, dtype=torch.int32)  # [L, B, H_kv, S]
        self.next_slot = torch.zeros(shape[:3], device=device, dtype=torch.int64)  # [L, B, H_kv]
        self.policy, self.n_sink, self.window = policy, n_sink, window
        self.per_head = policy == "longflow-head"
        self.slots = slots

    @staticmethod
    def bytes_needed(cfg, batch: int, slots: int, dtype) -> int:
        per_slot = 2 * cfg.head_dim * dtype.itemsize + 4  # K and V, and the int32 position
        return cfg.n_layers * batch * cfg.n_kv_heads * slots * per_slot

    def reset(self):
        self.pos.fill_(-1)
        self.next_slot.zero_()

    # ---- decode: one token per sequence -------------------------------------------------------------
    def decode(self, layer: int, q, k, v, positions):
        """q: [B, H_q, D]; k, v: [B, H_kv, D]; positions: [B]. Returns the attention output [B, H_q, D]."""
        slot = self.next_slot[layer]  # [B, H_kv]
        B, H, D = k.shape
        at = slot[:, :, None, None].expand(B, H, 1, D)
        self.k[layer].scatter_(2, at, k[:, :, None])
        self.v[layer].scatter_(2, at, v[:, :, None])
        self.pos[layer].scatter_(2, slot[:, :, None], positions.int()[:, None, None].expand(B, H, 1))
        attend = kernel.decode_attention if q.is_cuda else kernel.decode_attention_ref
        select = self.policy != "full"
        out, evict = attend(q, self.k[layer], self.v[layer], self.pos[layer], per_head=self.per_head,
                            n_sink=self.n_sink, window=self.window, select=select)
        # a full cache is sized to hold every token, so its slots just fill in order (a finished
        # sequence that keeps stepping until its row is reused just rewrites its last slot)
        self.next_slot[layer].copy_(evict if select else (slot + 1).clamp(max=self.slots - 1))
        return out

    # ---- prefill: a batch of (right-padded) prompts ------------------------------------------------
    def prefill(self, layer: int, q, k, v, positions, rows):
        """q: [R, H_q, T, D]; k, v: [R, H_kv, T, D]; positions: [R, T], -1 for padding after each prompt;
        rows: [R] the cache rows these prompts go to (the other rows are left as they are). Causal
        attention over the prompts, then their K/V into the slots, compressed if they do not fit."""
        out = prefill_attention(q, k, v, positions)
        R, H, T, D = k.shape
        S = self.slots
        if T >= S:  # keep S - 1 tokens per row; the last slot stays empty for the first new token
            keep = snapkv_keep(q, k, positions, S - 1, self.per_head)  # [R, H_kv, S-1], into T
            at = keep[..., None].expand(R, H, S - 1, D)
            k, v = k.gather(2, at), v.gather(2, at)
            positions = positions[:, None].expand(R, H, T).gather(2, keep)  # [R, H_kv, S-1]
            T = S - 1
        self.pos[layer, rows] = -1  # a reused row forgets its previous sequence
        self.k[layer, rows, :, :T] = k
        self.v[layer, rows, :, :T] = v
        self.pos[layer, rows, :, :T] = positions.int().view(R, -1, T).expand(R, H, T)
        # prompts are right-padded, so the lowest empty slot is just past the tokens kept
        self.next_slot[layer, rows] = (self.pos[layer, rows] >= 0).sum(-1)
        return out


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


def snapkv_keep(q, k, positions, n_keep: int, per_head: bool):
    """SnapKV prompt compression (Li et al. 2024): keep the last SNAPKV_WINDOW prompt tokens, and of the
    rest the ones those queries attend to most (softmax weights summed over the window's queries and the
    heads, average-pooled over 5 neighbouring tokens). Returns slot indices into T [B, H_kv, n_keep],
    sorted, real tokens before padding. q: [B, H_q, T, D]; k: [B, H_kv, T, D]; positions: [B, T]."""
    B, Hq, T, D = q.shape
    H = k.shape[1]
    lengths = (positions >= 0).sum(1)  # [B]
    win = (lengths[:, None] - SNAPKV_WINDOW + torch.arange(SNAPKV_WINDOW, device=q.device)).clamp(min=0)
    q_win = q.gather(2, win[:, None, :, None].expand(B, Hq, SNAPKV_WINDOW, D))  # [B, H_q, W, D]
    k_all = k.repeat_interleave(Hq // H, 1)  # [B, H_q, T, D]
    logits = (q_win.float() @ k_all.float().transpose(2, 3)) / D ** 0.5  # [B, H_q, W, T]
    visible = (positions[:, None, None, :] >= 0) & (win[:, None, :, None] >= torch.arange(T, device=q.device))
    attn = logits.masked_fill(~visible, float("-inf")).softmax(-1).sum(2)  # [B, H_q, T]
    attn = F.avg_pool1d(attn, SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2)
    score = attn.view(B, H, Hq // H, T).sum(2)  # [B, H_kv, T], per KV head: its query group
    if not per_head:
        score = score.sum(1, keepdim=True).expand(B, H, T)  # one decision for the whole layer
    idx = torch.arange(T, device=q.device)
    in_window = (idx >= lengths[:, None] - SNAPKV_WINDOW) & (positions >= 0)  # [B, T]
    score = torch.where(in_window[:, None], float("inf"), score)
    score = torch.where(positions[:, None] < 0, float("-inf"), score)
    return score.topk(n_keep, dim=-1).indices.sort(-1).values
