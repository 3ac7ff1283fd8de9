"""Decode attention fused with LongFlow scoring and slot selection: Triton kernels and a PyTorch reference.

One decode step, one layer: attend the current query over a static cache of S slots and pick the slot
the next token will overwrite (the lowest-index empty slot, else the argmin of the eviction score).

    out, evict = decode_attention(q, k, v, pos)        # the Triton path (a torch.compile-able custom op)
    out, evict = decode_attention_ref(q, k, v, pos)    # the readable spec, same signature and results

Both take q [B, H_q, D], k and v [B, H_kv, S, D] (keys after RoPE) and pos [B, H_kv, S] (the position
held by each slot, -1 when empty), and return out [B, H_q, D] in q's dtype and evict [B, H_kv] int64.
Empty slots must hold finite K/V (the cache zero-fills them): they are masked out of the softmax.
"""

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


def decode_attention_ref(q, k, v, pos, per_head=False, n_sink=0, window=0, select=True, value_norm=True,
                         acc=None):
    """Plain PyTorch: attention, then score_i = mean_h alpha[h, i] * ||v_i||_1 and its argmin.

    per_head: one decision per KV head (mean over its query group) instead of one per layer (mean over
    all query heads; evict then holds the same slot in every column, and per-layer masks are OR-ed over
    KV heads, which all hold the same positions in a per-layer cache).
    n_sink / window: never evict positions < n_sink, or > newest - window (newest = max pos of the row).
    select=False: attention only, evict is -1. value_norm=False: score is mean_h alpha (TOVA).
    acc [B, H_kv, S] fp32: the step's score is added into it in place and its argmin is taken instead
    (H2O / VATP); per layer every column gets the same score and column 0 is the one compared.
    """
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    logits = q.float().view(B, H_kv, H_q // H_kv, D) @ k.float().transpose(-1, -2) / math.sqrt(D)
    empty = pos < 0  # [B, H_kv, S]
    alpha = logits.masked_fill(empty[:, :, None], -math.inf).softmax(-1).nan_to_num(0.0)  # [B, H_kv, G, S]
    out = (alpha @ v.float()).view(B, H_q, D).to(q.dtype)
    if not select:
        return out, torch.full((B, H_kv), -1, dtype=torch.int64, device=q.device)

    score = alpha * v.float().abs().sum(-1)[:, :, None] if value_norm else alpha  # [B, H_kv, G, S]
    newest = pos.amax(-1, keepdim=True)
    protected = ~empty & ((pos < n_sink) | (pos > newest - window))  # [B, H_kv, S]
    if per_head:
        score = score.mean(2)  # [B, H_kv, S]
    else:
        score = score.mean((1, 2))[:, None]  # [B, 1, S]
        empty, protected = empty.any(1, keepdim=True), protected.any(1, keepdim=True)
    if acc is not None:
        acc += score
        score = acc if per_head else acc[:, :1]
    score = score.masked_fill(protected, math.inf).masked_fill(empty, -math.inf)
    return out, score.argmin(-1).expand(B, H_kv).contiguous()  # argmin: first minimum = lowest slot


# Running softmax max starts at a large finite value rather than -inf, so a block or split with no
# valid slot gives exp(-inf - NEG_BIG) = 0 and exp(NEG_BIG - NEG_BIG) = 1, never exp(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1e30)


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr,  # q [B, H_q, D]; k, v [B, H_kv, S, D]; pos [B, H_kv, S]
    out_ptr,  # [B, H_q, D] final output (when not split)
    m_ptr, l_ptr, o_ptr,  # per-split softmax max, sum [B, H_q, n_split] and unnormalised out [.., D]
    logit_ptr, vnorm_ptr, newest_ptr,  # scoring scratch: [B, H_q, S], [B, H_kv, S], [B, H_kv, n_split]
    S, chunk, scale,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sp_b, sp_h, sp_s,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr, SELECT: tl.constexpr, VALUE_NORM: tl.constexpr,
):
    """One program: all G query heads of one KV head over one split of the slots (K/V read once)."""
    b = (tl.program_id(0) // H_KV).to(tl.int64)
    kvh = tl.program_id(0) % H_KV
    split, n_split = tl.program_id(1), tl.num_programs(1)
    rows = tl.arange(0, G_PAD)  # the group padded to >= 16 rows, the smallest tile tl.dot takes
    row_ok = rows < G
    heads = b * G * H_KV + kvh * G + rows  # flat index into [B, H_q]
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (kvh * G + rows)[:, None] * sq_h + dims[None, :] * sq_d,
                mask=row_ok[:, None], other=0.0)  # [G_PAD, D]
    k_ptr += b * sk_b + kvh * sk_h
    v_ptr += b * sv_b + kvh * sv_h
    pos_ptr += b * sp_b + kvh * sp_h

    m = tl.full([G_PAD], NEG_BIG, tl.float32)  # running max, sum and output of the online softmax
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    newest = tl.full([BLOCK_S], -1, tl.int32)
    for start in range(split * chunk, tl.minimum(split * chunk + chunk, S), BLOCK_S):
        slots = start + tl.arange(0, BLOCK_S)
        in_range = slots < S
        p = tl.load(pos_ptr + slots * sp_s, mask=in_range, other=-1).to(tl.int32)  # [BLOCK_S]
        kb = tl.load(k_ptr + slots[:, None] * sk_s + dims[None, :] * sk_d, mask=in_range[:, None], other=0.0)
        vb = tl.load(v_ptr + slots[:, None] * sv_s + dims[None, :] * sv_d, mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale  # [G_PAD, BLOCK_S] fp32
        if SELECT:  # raw logits and ||v||_1 for the score pass, while the block is in registers
            tl.store(logit_ptr + heads[:, None] * S + slots[None, :], s, mask=row_ok[:, None] & in_range[None, :])
            if VALUE_NORM:
                tl.store(vnorm_ptr + (b * H_KV + kvh) * S + slots, tl.sum(tl.abs(vb.to(tl.float32)), axis=1),
                         mask=in_range)
            newest = tl.maximum(newest, p)
        s = tl.where(p[None, :] >= 0, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        e = tl.exp(s - m_new[:, None])
        corr = tl.exp(m - m_new)
        l = l * corr + tl.sum(e, axis=1)
        acc = acc * corr[:, None] + tl.dot(e.to(vb.dtype), vb, input_precision="ieee")
        m = m_new

    if SELECT:
        tl.store(newest_ptr + (b * H_KV + kvh) * n_split + split, tl.max(newest, axis=0))
    if SPLIT or SELECT:
        tl.store(m_ptr + heads * n_split + split, m, mask=row_ok)
        tl.store(l_ptr + heads * n_split + split, l, mask=row_ok)
    if SPLIT:
        tl.store(o_ptr + (heads[:, None] * n_split + split) * D + dims[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only when every slot is empty
        tl.store(out_ptr + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _softmax_stats(m_ptr, l_ptr, heads, head_ok, n_split, NS_PAD: tl.constexpr):
    """Final softmax max and 1/sum of each head ([R] flat head indices) from its per-split partials.
    A head with no valid slot (or a padding row) has sum 0 and gets 1/sum = 1: its terms are all masked."""
    sp = tl.arange(0, NS_PAD)
    ptrs = heads[:, None] * n_split + sp[None, :]  # [R, NS_PAD]
    mask = head_ok[:, None] & (sp < n_split)[None, :]
    m_part = tl.load(m_ptr + ptrs, mask=mask, other=NEG_BIG)
    m = tl.max(m_part, axis=1)
    l = tl.sum(tl.load(l_ptr + ptrs, mask=mask, other=0.0) * tl.exp(m_part - m[:, None]), axis=1)
    return m, 1.0 / tl.where(l > 0, l, 1.0)


@triton.jit
def _combine_splits(m_ptr, l_ptr, o_ptr, out_ptr, b, kvh, n_split,
                    H_KV: tl.constexpr, G: tl.constexpr, G_POW2: tl.constexpr, D: tl.constexpr,
                    NS_PAD: tl.constexpr):
    """out = sum over splits of exp(m_split - m) * o_split / l, for the G query heads of KV head kvh."""
    g = tl.arange(0, G_POW2)
    heads = b * G * H_KV + kvh * G + g  # flat index into [B, H_q]
    m, inv_l = _softmax_stats(m_ptr, l_ptr, heads, g < G, n_split, NS_PAD)
    dims = tl.arange(0, D)
    out = tl.zeros([G_POW2, D], tl.float32)
    for split in range(n_split):
        w = tl.exp(tl.load(m_ptr + heads * n_split + split, mask=g < G, other=NEG_BIG) - m) * inv_l
        out += w[:, None] * tl.load(o_ptr + (heads[:, None] * n_split + split) * D + dims[None, :],
                                    mask=(g < G)[:, None], other=0.0)
    tl.store(out_ptr + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


@triton.jit
def _select_slot(pos_ptr, m_ptr, l_ptr, logit_ptr, vnorm_ptr, newest_ptr, acc_ptr, evict_ptr,
                 b, kvh, S, n_split, n_sink, window, sp_b, sp_h, sp_s, sa_b, sa_h, sa_s,
                 H_KV: tl.constexpr, G: tl.constexpr, G_POW2: tl.constexpr, NS_PAD: tl.constexpr,
                 N_KV: tl.constexpr, N_KV_POW2: tl.constexpr, BLOCK: tl.constexpr,
                 VALUE_NORM: tl.constexpr, HAS_ACC: tl.constexpr):
    """Score every slot for the query heads of KV heads kvh .. kvh + N_KV - 1 and write the argmin."""
    # One row per query head: row r is head r % G_POW2 of KV head kvh + r // G_POW2.
    r = tl.arange(0, N_KV_POW2 * G_POW2)
    kv = kvh + r // G_POW2
    row_ok = (r // G_POW2 < N_KV) & (r % G_POW2 < G)
    heads = b * G * H_KV + kv * G + r % G_POW2  # flat index into [B, H_q]
    m, inv_l = _softmax_stats(m_ptr, l_ptr, heads, row_ok, n_split, NS_PAD)  # [R]
    sp = tl.arange(0, NS_PAD)
    newest = tl.max(tl.load(newest_ptr + (b * H_KV + kv[:, None]) * n_split + sp[None, :],
                            mask=row_ok[:, None] & (sp < n_split)[None, :], other=-1), axis=1)  # [R]
    best = tl.full([BLOCK], float("inf"), tl.float32)  # per-lane running minimum and its slot
    best_slot = tl.zeros([BLOCK], tl.int32)
    for start in range(0, S, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        in_range = slots < S
        mask = row_ok[:, None] & in_range[None, :]  # [R, BLOCK]
        p = tl.load(pos_ptr + b * sp_b + kv[:, None] * sp_h + slots[None, :] * sp_s, mask=mask, other=0)
        logit = tl.load(logit_ptr + heads[:, None] * S + slots[None, :], mask=mask, other=float("-inf"))
        alpha = tl.where(p >= 0, tl.exp(logit - m[:, None]) * inv_l[:, None], 0.0)  # [R, BLOCK]
        if VALUE_NORM:
            alpha *= tl.load(vnorm_ptr + (b * H_KV + kv[:, None]) * S + slots[None, :], mask=mask, other=0.0)
        score = tl.sum(alpha, axis=0) / (N_KV * G)  # [BLOCK] fp32, the mean over the group's heads
        if HAS_ACC:  # add into every KV head's column (from its first row); compare the first column
            a_ptrs = acc_ptr + b * sa_b + kv[:, None] * sa_h + slots[None, :] * sa_s
            a = tl.load(a_ptrs, mask=mask, other=0.0) + score[None, :]
            tl.store(a_ptrs, a, mask=mask & (r % G_POW2 == 0)[:, None])
            score = tl.sum(tl.where((r == 0)[:, None], a, 0.0), axis=0)
        empty = tl.max((mask & (p < 0)).to(tl.int32), axis=0) > 0
        protected = mask & (p >= 0) & ((p < n_sink) | (p > newest[:, None] - window))
        score = tl.where(tl.max(protected.to(tl.int32), axis=0) > 0, float("inf"), score)
        score = tl.where(empty, float("-inf"), score)
        score = tl.where(in_range, score, float("inf"))
        better = score < best  # strict: each lane keeps its earliest (lowest) slot on ties
        best_slot = tl.where(better, slots, best_slot)
        best = tl.minimum(best, score)
    slot = tl.min(tl.where(best == tl.min(best, axis=0), best_slot, S), axis=0).to(tl.int64)
    kv_out = kvh + tl.arange(0, N_KV_POW2)
    tl.store(evict_ptr + b * H_KV + kv_out, tl.zeros([N_KV_POW2], tl.int64) + slot, mask=kv_out < kvh + N_KV)


@triton.jit
def _combine_select_kernel(
    pos_ptr, m_ptr, l_ptr, o_ptr, out_ptr, logit_ptr, vnorm_ptr, newest_ptr, acc_ptr, evict_ptr,
    S, n_split, n_sink, window, sp_b, sp_h, sp_s, sa_b, sa_h, sa_s,
    H_KV: tl.constexpr, G: tl.constexpr, G_POW2: tl.constexpr, D: tl.constexpr, NS_PAD: tl.constexpr,
    N_KV: tl.constexpr, N_KV_POW2: tl.constexpr, BLOCK: tl.constexpr,
    COMBINE: tl.constexpr, SELECT: tl.constexpr, VALUE_NORM: tl.constexpr, HAS_ACC: tl.constexpr,
):
    """Program (b, kvh): merge the split partials of KV head kvh into the output; then, if kvh leads a
    selection group of N_KV KV heads (1 per head, H_KV per layer), pick that group's slot."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    if COMBINE:
        _combine_splits(m_ptr, l_ptr, o_ptr, out_ptr, b, kvh, n_split, H_KV, G, G_POW2, D, NS_PAD)
    if SELECT:
        if kvh % N_KV == 0:
            _select_slot(pos_ptr, m_ptr, l_ptr, logit_ptr, vnorm_ptr, newest_ptr, acc_ptr, evict_ptr,
                         b, kvh, S, n_split, n_sink, window, sp_b, sp_h, sp_s, sa_b, sa_h, sa_s,
                         H_KV, G, G_POW2, NS_PAD, N_KV, N_KV_POW2, BLOCK, VALUE_NORM, HAS_ACC)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (an H200's 132 when the kernels run on CPU in the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _split_count(n_programs: int, n_blocks: int, device: torch.device) -> int:
    """Flash-decoding: split the slots until the grid covers about two waves of SMs."""
    return max(1, min(n_blocks, triton.cdiv(2 * _sm_count(device), n_programs)))


@torch.library.triton_op("tinyflow::decode_attention", mutates_args={"acc"})
def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, per_head: bool, n_sink: int,
                         window: int, select: bool, value_norm: bool,
                         acc: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    # acc is an optional in-place argument: the inferred schema reads `Tensor(a!)? acc`, which
    # torch.compile functionalises like any mutated input; None simply means nothing is mutated.
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    G = H_q // H_kv
    assert H_q % H_kv == 0 and D == triton.next_power_of_2(D) and pos.shape == (B, H_kv, S)
    BLOCK_S = 64 if D <= 128 else 32
    n_blocks = triton.cdiv(S, BLOCK_S)
    n_split = _split_count(B * H_kv, n_blocks, q.device)
    chunk = triton.cdiv(n_blocks, n_split) * BLOCK_S  # whole blocks per split
    n_split = triton.cdiv(S, chunk)  # no split left without slots
    split = n_split > 1
    f32 = dict(device=q.device, dtype=torch.float32)
    unused = torch.empty(1, **f32)  # stands in for the buffers a launch does not touch

    out = torch.empty(B, H_q, D, device=q.device, dtype=q.dtype)
    m = torch.empty(B, H_q, n_split, **f32) if split or select else unused
    l = torch.empty(B, H_q, n_split, **f32) if split or select else unused
    o = torch.empty(B, H_q, n_split, D, **f32) if split else unused
    logits = torch.empty(B, H_q, S, **f32) if select else unused
    vnorm = torch.empty(B, H_kv, S, **f32) if select and value_norm else unused
    newest = torch.empty(B, H_kv, n_split, device=q.device, dtype=torch.int32) if select else unused
    torch.library.wrap_triton(_attend_kernel)[(B * H_kv, n_split)](
        q, k, v, pos, out, m, l, o, logits, vnorm, newest, S, chunk, 1.0 / math.sqrt(D),
        *q.stride(), *k.stride(), *v.stride(), *pos.stride(),
        H_KV=H_kv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_S=BLOCK_S,
        SPLIT=split, SELECT=select, VALUE_NORM=value_norm, num_warps=4, num_stages=3)

    evict = torch.empty(B, H_kv, device=q.device, dtype=torch.int64) if select else \
        torch.full((B, H_kv), -1, device=q.device, dtype=torch.int64)
    if split or select:
        n_kv = 1 if per_head else H_kv  # KV heads per selection group
        rows = triton.next_power_of_2(n_kv) * triton.next_power_of_2(G)
        torch.library.wrap_triton(_combine_select_kernel)[(B, H_kv)](
            pos, m, l, o, out, logits, vnorm, newest, unused if acc is None else acc, evict,
            S, n_split, n_sink, window, *pos.stride(), *(acc.stride() if acc is not None else (0, 0, 0)),
            H_KV=H_kv, G=G, G_POW2=triton.next_power_of_2(G), D=D, NS_PAD=triton.next_power_of_2(n_split),
            N_KV=n_kv, N_KV_POW2=triton.next_power_of_2(n_kv), BLOCK=max(16, min(1024, 4096 // rows)),
            COMBINE=split, SELECT=select, VALUE_NORM=value_norm, HAS_ACC=acc is not None, num_warps=8)
    return out, evict


def decode_attention(q, k, v, pos, per_head=False, n_sink=0, window=0, select=True, value_norm=True,
                     acc=None):
    """Triton version of decode_attention_ref (same arguments, same results); see that for the meaning."""
    return torch.ops.tinyflow.decode_attention(q, k, v, pos, per_head, n_sink, window, select, value_norm, acc)
