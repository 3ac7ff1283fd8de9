"""Decode attention fused with LongFlow scoring and slot selection: Triton kernels and a PyTorch reference.

One decode step, one layer: attend the current query over a static cache of S slots and pick the slot
the next token will overwrite (the lowest-index empty slot, else the argmin of the eviction score).

    out, evict = decode_attention(q, k, v, pos)        # the Triton path (a torch.compile-able custom op)
    out, evict = decode_attention_ref(q, k, v, pos)    # the readable spec, same signature and results

Both take the same arguments and return out [B, H_q, D] in q's dtype and evict [B, H_kv] int64:

  argument          shape, dtype              what it is
  q                 [B, H_q, D]               this step's queries
  k, v              [B, H_kv, S, D]           the slots' keys (after RoPE) and values; finite in empty slots
                                              too (the cache's: zeros, or an earlier sequence's)
  pos               [B, H_kv, S] int          the position each slot holds, -1 when empty
  per_head          bool                      one decision per KV head (mean over its query group), else one
                                              per layer (mean over every query head; evict then holds the
                                              same slot in every column, and per-layer masks are OR-ed over
                                              the KV heads, which all hold the same positions)
  n_sink, window    int                       never evict positions < n_sink, or > newest - window (newest:
                                              the row's largest position)
  select            bool                      False: attention only, evict is -1
  scoring           Scoring                   what a slot is scored by (the class below): alpha, times
                                              ||v||_1 or not, kept in a per-slot state or not
  state             [B, H_kv, S] fp32 | None  the per-slot state a scoring with an update keeps (H2O's sum):
                                              updated in place by this step's score and its argmin taken
                                              instead; per layer every column gets the same state and column
                                              0 is compared
  limit             [B, H_kv] int64 | None    select=False only: slots from limit on count as empty (a cache
                                              filled in order)
  vnorm             [B, H_kv, S] fp32 | None  ||v||_1 of every slot, when the caller keeps it (else computed)
  k_scale, v_scale  [B, H_kv, S] fp32 | None  an FP8 cache: k, v are the uint8 bits of e4m3 values
                                              (quantize), attended and scored as the values they hold;
                                              finite in empty slots too
  v_top             [B, H_kv] fp32 | None     with FP8, an upper bound of each row's value scales (the cache
                                              keeps the largest written since the row's prompt); None: their
                                              maximum, computed. The Triton path divides its fp16 weights by it
                                              (_attend_slots): a bound up to 1,000x the largest scale keeps
                                              bf16's precision (tests/test_kernel.py), far above it fp16 loses it
  partial           bool                      return the score itself in place of evict, before protection
                                              and empty slots: [B, S] per layer (the mean over these heads,
                                              for tensor-parallel ranks that decide together), [B, H_kv, S]
                                              per head (the reference only); no state, and select
  given_query       [B, H_q, D] fp32 | None   with Scoring(query="given"): the query each slot's key is scored
  pair_weight       [H_q, D / 2] fp32 | None  against this step, and the weights of its pairs' magnitudes

The Triton path: _attend_kernel reads K/V once (flash-decoding splits when the batch is small) and stores
each head's logits; _finish_kernel merges the splits and, in parallel over chunks of slots, turns the
logits into scores and takes each chunk's minimum into one packed (score, slot) atomic minimum per row.
With a given query the attention pass stores each head's raw score of every key in place of its logits, and
the finish kernel z-scores them, one program per KV head (_score_given).
"""

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (macOS, Windows, some CPU-only installs): the CPU runs the PyTorch reference,
    from types import SimpleNamespace  # and the kernels below are defined but can never be launched
    triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=lambda x=None: x)
HAS_TRITON = hasattr(triton, "cdiv")
# where the kernels can run: on CUDA, or on the CPU through Triton's interpreter (the tests set TRITON_INTERPRET=1)
CAN_LAUNCH = HAS_TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())


@dataclass(frozen=True)
class Scoring:
    """What the fused kernel scores each slot by, declared as data (a KernelPolicy's `scoring`):

        step_i = mean over the query heads of alpha[h, i]      (value_norm: times ||v_i||_1)
        update "none":  score_i = step_i                         LongFlow, TOVA
               "sum":   state_i = state_i + step_i               H2O, VATP (a per-slot state the caller keeps)
               "ema":   state_i = decay * state_i + step_i       an exponential moving average (unnormalised)
        then score_i = state_i

    alpha[h, i] is the current query's softmax weight of slot i; the mean runs over the KV head's query group
    (per head) or over every head of the layer. With query "given" (TriAttention) a slot is scored by its key
    alone, against a query u [B, H_q, D] and pair weights w [H_q, D/2] the caller gives each step, per KV head:

        raw[h, i] = k_i . u_h + sum_f w_hf |k_i,f|            |k_i,f|: the magnitude of the pair (k[f], k[f + D/2])
        score_i = max over the group of (raw[h, i] - mean_h) / std_h    over the slots that can go (given_score)

    A new factor is a field here, a line in decode_attention_ref, its lines in _score_chunk (a flag of
    _finish_kernel's), and an argument of the op (decode_attention, _decode_attention_op, _result_shapes)."""
    value_norm: bool = False
    update: str = "none"
    decay: float = 1.0  # "ema" only: the weight of the state a step keeps
    query: str = "current"  # or "given": the caller's query and pair weights score the keys (above)

    def __post_init__(self):
        if self.update not in UPDATES:
            raise ValueError(f"unknown score update {self.update!r}; choose one of {', '.join(UPDATES)}")
        if (self.update == "ema") != (0 < self.decay < 1) or (self.update != "ema" and self.decay != 1):
            raise ValueError(f"an \"ema\" update takes a decay in (0, 1), the others none; got {self!r}")
        if self.query not in QUERIES or (self.query == "given" and (self.value_norm or self.keeps_state)):
            raise ValueError(f"a scoring's query is {' or '.join(QUERIES)}, and a given one takes no value norm "
                             f"and no update; got {self!r}")

    @property
    def keeps_state(self) -> bool:
        return self.update != "none"

    def update_state(self, state, step):
        """state <- decay * state + step, in place ("sum": decay 1): the kernel's update, in PyTorch."""
        return state.mul_(self.decay).add_(step) if self.decay != 1 else state.add_(step)


UPDATES = ("none", "sum", "ema")
QUERIES = ("current", "given")
LONGFLOW = Scoring(value_norm=True)  # decode_attention's default


def check_state(scoring: Scoring, state, partial: bool, select: bool):
    """A state only for a scoring that updates one, and partial scores only of this step, with selection."""
    if state is not None and not scoring.keeps_state:
        raise ValueError(f"a per-slot state is for a scoring with an update (sum, ema), not {scoring!r}")
    if partial and (state is not None or not select):
        raise ValueError("partial scores are this step's (no state) and need select")


def check_given(scoring: Scoring, given_query, pair_weight, per_head: bool, select: bool, q: Tensor):
    """A given query and its pair weights exactly for a scoring by a given query, which decides per KV head, each
    of the query's heads (the kernel reads them by pointer: a wrong shape would read other heads' rows)."""
    given = scoring.query == "given" and select
    if (given_query is not None, pair_weight is not None) != (given, given):
        raise ValueError(f"a scoring by a given query takes given_query and pair_weight, and only it: {scoring!r}")
    if select and scoring.query == "given" and not per_head:
        raise ValueError("a scoring by a given query decides per KV head (per_head=True): its z-scores are per head")
    B, H_q, D = q.shape
    if given_query is not None and (given_query.shape != (B, H_q, D) or pair_weight.shape != (H_q, D // 2)):
        raise ValueError(f"a given query is [B, H_q, D] = {[B, H_q, D]} and its pair weights [H_q, D/2] = "
                         f"{[H_q, D // 2]}, not {list(given_query.shape)} and {list(pair_weight.shape)}: give this "
                         f"rank's heads")


def protected_mask(pos, n_sink: int, window: int):
    """Slots never evicted: one of the first n_sink positions, or of the last `window` (counted back from
    the newest position of the row). pos: [..., S], -1 for empty (never protected)."""
    newest = pos.amax(-1, keepdim=True)
    return (pos >= 0) & ((pos < n_sink) | (pos > newest - window))


def choose_slot(score, pos, n_sink: int, window: int, per_head: bool, layer_mean=None):
    """The slot the next token overwrites, [B, H_kv]: the lowest-index empty slot, else the lowest score
    among the slots not protected (ties: the lowest slot). Per KV head, or with per_head False one slot for
    the whole layer, on the mean of the score over its heads: layer_mean(score) [B, H, S] -> [B, 1, S] (the
    mean over dim 1, or over every tensor-parallel rank's heads). score: [B, H_kv or 1, S]; pos: [B, H_kv, S].
    Everything that decides calls this (the Triton kernel does the same in _lower_key)."""
    protected, empty = protected_mask(pos, n_sink, window), pos < 0
    if not per_head:  # every KV head holds the same positions
        score = (layer_mean or (lambda s: s.mean(1, keepdim=True)))(score)
        protected, empty = protected.any(1, keepdim=True), empty.any(1, keepdim=True)
    score = score.masked_fill(protected, math.inf).masked_fill(empty, -math.inf)
    return score.argmin(-1).expand(pos.shape[:2]).contiguous()  # argmin: the first minimum, the lowest slot


def given_score(k, pos, query, pair_weight, protected):
    """The score by a given query (Scoring's query "given"), per KV head: raw_h = k . query_h + sum_f
    pair_weight_hf |k_f| for each query head h (k_f: the pair k[f], k[f + D/2]), z-scored over the slots held
    and not protected (the population std, at least 1e-6), then the maximum over the KV head's query group.
    k [B, H_kv, S, D] (values); pos, protected [B, H_kv, S]; query [B, H_q, D]; pair_weight [H_q, D/2].
    Returns [B, H_kv, S]."""
    B, H, S, D = k.shape
    G = query.shape[1] // H
    k = k.float()
    kr, ki = k.chunk(2, -1)  # [B, H_kv, S, D/2]
    raw = query.float().view(B, H, G, D) @ k.transpose(-1, -2) + \
        pair_weight.float().view(H, G, -1) @ torch.hypot(kr, ki).transpose(-1, -2)  # [B, H_kv, G, S]
    scored = ((pos >= 0) & ~protected)[:, :, None]  # [B, H_kv, 1, S]
    n = scored.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(scored, raw, 0.0).sum(-1, keepdim=True) / n
    std = (torch.where(scored, raw - mean, 0.0).square().sum(-1, keepdim=True) / n).sqrt().clamp(min=1e-6)
    return ((raw - mean) / std).amax(2)


def l1_norm(v):
    """||v||_1 in fp32 over the last dimension, the value norm LongFlow scores with: [..., D] -> [...]."""
    return v.float().abs().sum(-1)


# An FP8 cache stores each key and value vector as float8 e4m3 bits (in uint8 tensors: indexing, gathering
# and compiling work on those in every torch version, and the kernel reinterprets them) and one fp32 scale:
# the vector's largest |value| maps to e4m3's largest finite value, 448.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x):
    """x [..., D] -> (e4m3 bits [..., D] uint8, scale [...] fp32), x ~ bits * scale."""
    scale = x.float().abs().amax(-1).clamp(min=1e-30) / FP8_MAX
    return (x.float() / scale[..., None]).to(FP8).view(torch.uint8), scale


def dequantize(bits, scale, dtype=torch.float32):
    """The values an FP8 cache holds: bits [..., D] uint8, scale [...] -> [..., D] in dtype."""
    return (bits.view(FP8).float() * scale[..., None]).to(dtype)


def decode_attention_ref(q, k, v, pos, per_head=False, n_sink=0, window=0, select=True, scoring=LONGFLOW,
                         state=None, limit=None, vnorm=None, k_scale=None, v_scale=None, partial=False, v_top=None,
                         given_query=None, pair_weight=None):
    """Plain PyTorch: attention, then score_i = mean_h alpha[h, i] * ||v_i||_1 (the scoring's factors) and its
    argmin. The arguments: the table at the top of this file (v_top is the kernel's; exact arithmetic needs
    none)."""
    check_state(scoring, state, partial, select)
    check_given(scoring, given_query, pair_weight, per_head, select, q)
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    if k_scale is not None:
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    logits = q.float().view(B, H_kv, H_q // H_kv, D) @ k.float().transpose(-1, -2) / math.sqrt(D)
    empty = pos < 0  # [B, H_kv, S]
    if limit is not None:
        empty = empty | (torch.arange(k.shape[2], device=k.device) >= limit[..., None])
    alpha = logits.masked_fill(empty[:, :, None], -math.inf).softmax(-1).nan_to_num(0.0)  # [B, H_kv, G, S]
    out = (alpha @ v.float()).view(B, H_q, D).to(q.dtype)
    if not select:
        return out, torch.full((B, H_kv), -1, dtype=torch.int64, device=q.device)

    if scoring.value_norm:
        alpha = alpha * (l1_norm(v) if vnorm is None else vnorm)[:, :, None]  # [B, H_kv, G, S]
    if scoring.query == "given":  # per head
        score = given_score(k, pos, given_query, pair_weight, protected_mask(pos, n_sink, window))
    else:
        score = alpha.mean(2) if per_head else alpha.mean((1, 2))[:, None]  # [B, H_kv or 1, S]
    if partial:
        return out, score if per_head else score[:, 0]
    if state is not None:  # every column of a per-layer state holds the layer's score: column 0 is compared
        score = scoring.update_state(state, score)[:, :score.shape[1]]
    return out, choose_slot(score, pos, n_sink, window, per_head)


# Running softmax max starts at a large finite value rather than -inf, so a block or split with no
# valid slot gives exp2(-inf - NEG_BIG) = 0 and exp2(NEG_BIG - NEG_BIG) = 1, never exp2(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1e30)
LOG2E = tl.constexpr(1.4426950408889634)  # the kernels' logits are in base 2 (times log2(e)): exp2 is one instruction
KEY_MAX = tl.constexpr(2**63 - 1)  # above every packed (score, slot) key: the start of the atomic minimum
# Launch settings, each the fastest of sweeps on the H200 (measured: docs/performance.md, "Kernel launch
# settings"): attention by selection, attention over an FP8 cache, the finish kernel (_finish_warps)
ATTEND_LAUNCH = {True: dict(num_warps=2, num_stages=2), False: dict(num_warps=4, num_stages=2)}
FP8_ATTEND_LAUNCH = dict(num_warps=2, num_stages=3)
GIVEN_ATTEND_LAUNCH = dict(num_warps=2, num_stages=2)  # selection's, not swept yet (tests/gpu_given_sweep.py)


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr,  # q [B, H_q, D]; k, v [B, H_kv, S, D]; pos [B, H_kv, S]
    out_ptr,  # [B, H_q, D] final output (when not split)
    m_ptr, l_ptr, o_ptr,  # per-split softmax max, sum [B, H_q, n_split] and unnormalised out [.., D]
    logit_ptr, newest_ptr,  # for selection: logits [B, H_q, S] f32, newest position [B, H_kv, n_split] i32
    key_ptr,  # [B, H_kv] i64: set here to the start of the finish kernel's atomic minimum, or -1 (no selection)
    limit_ptr,  # [B, H_kv] i64, with HAS_LIMIT: slots from limit on are empty and not even read
    ks_ptr, vs_ptr,  # [B, H_kv, S] f32 per-slot scales, with FP8 (k, v then hold e4m3 bits as uint8)
    vtop_ptr,  # [B, H_kv] f32, with FP8: an upper bound of each row's value scales (v_top)
    S, chunk,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sp_b, sp_h, sp_s,
    ss_b, ss_h, ss_s,  # the strides of both scales
    given_ptr, weight_ptr,  # with GIVEN: the given query [B, H_q, D] and pair weights [H_q, D/2], f32, contiguous
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    SCALE: tl.constexpr,  # 1/sqrt(D); constexpr, as torch.compile would pass a float argument as fp64
    SPLIT: tl.constexpr, SELECT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    FP8_KV: tl.constexpr, FP16_PRODUCTS: tl.constexpr,  # FP8 K/V; their products with 16-bit queries in fp16
    GIVEN: tl.constexpr,  # Scoring(query="given"): each head's raw score of the keys stored in place of its logits
    HALF_PAD: tl.constexpr,  # D / 2, at least 16 (the smallest product tl.dot takes), for GIVEN's pair magnitudes
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
    q_in = q.to(tl.float16) if FP16_PRODUCTS else q  # in the dtype the keys meet it in
    given, weight = q_in, q_in  # with GIVEN: the group's given query and pair weights (_given_tiles)
    if GIVEN:
        given, weight = _given_tiles(given_ptr, weight_ptr, heads, kvh * G + rows, row_ok, dims, q_in.dtype, D,
                                     HALF_PAD)
    k_ptr += b * sk_b + kvh * sk_h
    v_ptr += b * sv_b + kvh * sv_h
    pos_ptr += b * sp_b + kvh * sp_h
    ks_ptr += b * ss_b + kvh * ss_h
    vs_ptr += b * ss_b + kvh * ss_h

    top = 1.0  # with FP8: the row's value scales' upper bound (the weights are divided by it, below)
    if FP8_KV:
        top = tl.maximum(tl.load(vtop_ptr + b * H_KV + kvh), 1e-30)
    end = tl.minimum(split * chunk + chunk, S)
    if HAS_LIMIT:  # a cache that fills in order: the slots past the last token cost nothing
        end = tl.minimum(end, tl.load(limit_ptr + b * H_KV + kvh))
    m, l, acc, newest = _attend_slots(q_in, given, weight, k_ptr, v_ptr, pos_ptr, ks_ptr, vs_ptr, top, logit_ptr,
                                      heads, row_ok, dims, split * chunk, end, S, sk_s, sk_d, sv_s, sv_d, sp_s, ss_s,
                                      G_PAD, D, BLOCK_S, SCALE, SELECT, FP8_KV, FP16_PRODUCTS, GIVEN, HALF_PAD)
    if FP8_KV:
        acc *= top
    tl.store(key_ptr + b * H_KV + kvh, KEY_MAX if SELECT else -1, mask=split == 0)
    if SELECT:
        tl.store(newest_ptr + (b * H_KV + kvh) * n_split + split, tl.max(newest, axis=0))
    _store_attention(acc, m, l, out_ptr, m_ptr, l_ptr, o_ptr, heads, row_ok, dims, split, n_split, D, SPLIT,
                     SELECT)


@triton.jit
def _attend_slots(q_in, given, weight, k_ptr, v_ptr, pos_ptr, ks_ptr, vs_ptr, top, logit_ptr, heads, row_ok, dims,
                  first, end, S, sk_s, sk_d, sv_s, sv_d, sp_s, ss_s,
                  G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, SCALE: tl.constexpr,
                  SELECT: tl.constexpr, FP8_KV: tl.constexpr, FP16_PRODUCTS: tl.constexpr, GIVEN: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    """The online softmax of the group's queries q_in [G_PAD, D] over slots first .. end - 1, BLOCK_S at a
    time: returns its max and sum [G_PAD], the unnormalised output [G_PAD, D], and the newest position
    seen [BLOCK_S]. When selecting, each block's logits are stored on the way (for the score pass), or with
    GIVEN the raw scores of its keys by the given query and pair weights (_given_raw)."""
    m = tl.full([G_PAD], NEG_BIG, tl.float32)  # running max, sum and output of the online softmax
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    newest = tl.full([BLOCK_S], -1, tl.int32)
    for start in range(first, end, BLOCK_S):
        slots = start + tl.arange(0, BLOCK_S)
        in_range = slots < end
        p = tl.load(pos_ptr + slots * sp_s, mask=in_range, other=-1).to(tl.int32)  # [BLOCK_S]
        kb = tl.load(k_ptr + slots[:, None] * sk_s + dims[None, :] * sk_d, mask=in_range[:, None], other=0.0)
        vb = tl.load(v_ptr + slots[:, None] * sv_s + dims[None, :] * sv_d, mask=in_range[:, None], other=0.0)
        if FP8_KV:  # each slot's key scale multiplies its logit, its value scale its weight (below)
            kb, vb = _from_fp8(kb, FP16_PRODUCTS), _from_fp8(vb, FP16_PRODUCTS)
            k_scale = tl.load(ks_ptr + slots * ss_s, mask=in_range, other=0.0)  # [BLOCK_S]
            v_scale = tl.load(vs_ptr + slots * ss_s, mask=in_range, other=0.0)
        # a logit is one multiply-add: by 1/sqrt(D) * log2(e) (times the key's scale with FP8), plus -inf for
        # an empty slot (also in the stored logits)
        factor = k_scale * (SCALE * LOG2E) if FP8_KV else tl.full([BLOCK_S], SCALE * LOG2E, tl.float32)
        bias = tl.where(p >= 0, 0.0, float("-inf"))  # [BLOCK_S]
        s = tl.dot(q_in, tl.trans(kb), input_precision="ieee") * factor[None, :] + bias[None, :]  # [G_PAD, BLOCK_S]
        if SELECT:  # the logits [B, H_q, S] for the score pass, stored while the block is in registers
            stored = s
            if GIVEN:
                stored = _given_raw(given, weight, kb, D, HALF_PAD)
                if FP8_KV:  # both terms scale with the key
                    stored *= k_scale[None, :]
                stored += bias[None, :]
            tl.store(logit_ptr + heads[:, None] * S + slots[None, :], stored,
                     mask=row_ok[:, None] & in_range[None, :])
            newest = tl.maximum(newest, p)
        m_new = tl.maximum(m, tl.max(s, axis=1))  # the online softmax
        e = tl.exp2(s - m_new[:, None])
        corr = tl.exp2(m - m_new)
        l = l * corr + tl.sum(e, axis=1)
        if FP8_KV:  # sum_i e_i (scale_i v8_i) = top * sum_i (e_i scale_i / top) v8_i, top >= every scale of the
            # row: the weights stay within [0, 1], where fp16 keeps its precision whatever the size of V
            e = e * (v_scale / top)[None, :]
        acc = acc * corr[:, None] + tl.dot(e.to(vb.dtype), vb, input_precision="ieee")
        m = m_new
    return m, l, acc, newest


@triton.jit
def _given_tiles(given_ptr, weight_ptr, heads, rows, row_ok, dims, dtype: tl.constexpr, D: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """The given query [G_PAD, D] of query heads `heads` (flat into [B, H_q]) and their pair weights [G_PAD,
    HALF_PAD] (rows: the heads' numbers in the layer; zero past D/2), in the dtype the keys meet them in."""
    given = tl.load(given_ptr + heads[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    half = tl.arange(0, HALF_PAD)[None, :]
    weight = tl.load(weight_ptr + rows[:, None] * (D // 2) + half, mask=row_ok[:, None] & (half < D // 2), other=0.0)
    return given.to(dtype), weight.to(dtype)


@triton.jit
def _given_raw(given, weight, kb, D: tl.constexpr, HALF_PAD: tl.constexpr):
    """given_score's raw scores of a block of keys kb [BLOCK_S, D] (as the block's logits are computed: in the
    keys' dtype, an FP8 cache's without its scales): [G_PAD, BLOCK_S] = given . k + weight . |k_f|, the pairs'
    magnitudes taken from the block in registers (pair f: dimensions f and f + D/2), zero past D/2."""
    BLOCK_S: tl.constexpr = kb.shape[0]
    kr, ki = tl.split(tl.permute(tl.reshape(kb, [BLOCK_S, 2, D // 2]), 0, 2, 1))  # [BLOCK_S, D/2] each
    kr, ki = kr.to(tl.float32), ki.to(tl.float32)
    magnitude = tl.sqrt(kr * kr + ki * ki).to(kb.dtype)
    if HALF_PAD > D // 2:  # head_dim 16: zeros after the 8 pairs, for tl.dot's 16 (HALF_PAD is then D)
        magnitude = tl.reshape(tl.permute(tl.join(magnitude, tl.zeros_like(magnitude)), 0, 2, 1), [BLOCK_S, HALF_PAD])
    return tl.dot(given, tl.trans(kb), input_precision="ieee") + \
        tl.dot(weight, tl.trans(magnitude), input_precision="ieee")


@triton.jit
def _store_attention(acc, m, l, out_ptr, m_ptr, l_ptr, o_ptr, heads, row_ok, dims, split, n_split,
                     D: tl.constexpr, SPLIT: tl.constexpr, SELECT: tl.constexpr):
    """The normalised output, or this split's partial (max, sum, unnormalised output) for _finish_kernel
    to merge; the softmax max and sum also when selecting (the score pass normalises with them)."""
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
def _from_fp8(bits, FP16_PRODUCTS: tl.constexpr):
    """e4m3 bits (uint8) as fp16, to meet 16-bit queries and weights in (e4m3 is exact in fp16, one hardware
    conversion, more mantissa than bf16: docs/performance.md, "An FP8 KV cache"), or as fp32 (the CPU's
    fp32 queries)."""
    x = bits.to(tl.float8e4nv, bitcast=True)
    if FP16_PRODUCTS:
        out = x.to(tl.float16)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _softmax_stats(m_ptr, l_ptr, heads, ok, n_split, NS_PAD: tl.constexpr):
    """Final softmax max and 1/sum of the heads in a 2D tile of flat indices into [B, H_q], from their
    per-split partials. A head with no valid slot (or a padding entry) gets 1/sum = 1: its terms are all 0."""
    sp = tl.arange(0, NS_PAD)[None, None, :]
    ptrs = heads[:, :, None] * n_split + sp  # [R, C, NS_PAD]
    mask = ok[:, :, None] & (sp < n_split)
    m_part = tl.load(m_ptr + ptrs, mask=mask, other=NEG_BIG)
    m = tl.max(m_part, axis=2)
    l = tl.sum(tl.load(l_ptr + ptrs, mask=mask, other=0.0) * tl.exp2(m_part - m[:, :, None]), axis=2)
    return m, 1.0 / tl.where(l > 0, l, 1.0)


@triton.jit
def _combine_splits(m_ptr, l_ptr, o_ptr, out_ptr, b, kvh, n_split, H_KV: tl.constexpr, G: tl.constexpr,
                    G_POW2: tl.constexpr, D: tl.constexpr, NS_PAD: tl.constexpr):
    """out = sum over splits of exp2(m_split - m) * o_split / l, for the G query heads of KV head kvh."""
    g = tl.arange(0, G_POW2)[:, None]
    heads = (b * H_KV + kvh) * G + g  # [G_POW2, 1] flat index into [B, H_q]
    m, inv_l = _softmax_stats(m_ptr, l_ptr, heads, g < G, n_split, NS_PAD)  # [G_POW2, 1]
    dims = tl.arange(0, D)[None, :]
    out = tl.zeros([G_POW2, D], tl.float32)
    for split in range(n_split):
        w = tl.exp2(tl.load(m_ptr + heads * n_split + split, mask=g < G, other=NEG_BIG) - m) * inv_l
        out += w * tl.load(o_ptr + (heads * n_split + split) * D + dims, mask=g < G, other=0.0)
    tl.store(out_ptr + heads * D + dims, out.to(out_ptr.dtype.element_ty), mask=g < G)


@triton.jit
def _score_chunk(m_ptr, l_ptr, logit_ptr, vnorm_ptr, newest_ptr, pos_ptr, state_ptr, key_ptr, part_ptr, b, chunk,
                 S, n_split, n_sink, window, sp_b, sp_h, sp_s, sn_b, sn_h, sn_s, st_b, st_h, st_s,
                 H_KV: tl.constexpr, G: tl.constexpr, KV_POW2: tl.constexpr, G_POW2: tl.constexpr,
                 NS_PAD: tl.constexpr, CHUNK: tl.constexpr, PER_HEAD: tl.constexpr, PROTECT: tl.constexpr,
                 PARTIAL: tl.constexpr, VALUE_NORM: tl.constexpr, HAS_STATE: tl.constexpr, DECAY: tl.constexpr):
    """Score slots chunk*CHUNK .. +CHUNK of row b as the Scoring says (VALUE_NORM, HAS_STATE, DECAY) and
    lower key[b, kv] to the chunk's best (score, slot); with PARTIAL (per layer), store the scores to part
    [B, S] instead, for the ranks to decide together."""
    kvs = tl.arange(0, KV_POW2)
    kv = kvs[:, None]  # [KV, 1]
    g = tl.arange(0, G_POW2)[None, :]  # [1, G]
    heads = (b * H_KV + kv) * G + g  # [KV, G] flat index into [B, H_q]
    m, inv_l = _softmax_stats(m_ptr, l_ptr, heads, (kv < H_KV) & (g < G), n_split, NS_PAD)  # [KV, G]
    slots = chunk * CHUNK + tl.arange(0, CHUNK)[None, :]  # [1, CHUNK]
    ok = (kv < H_KV) & (slots < S)  # [KV, CHUNK]
    logit = tl.load(logit_ptr + heads[:, :, None] * S + slots[:, None, :],
                    mask=(ok[:, None, :] & (g < G)[:, :, None]), other=float("-inf"))  # [KV, G, CHUNK]
    # alpha averaged over each KV head's query group (* ||v||_1: the same for the whole group)
    score = tl.sum(tl.exp2(logit - m[:, :, None]) * inv_l[:, :, None], axis=1) / G  # [KV, CHUNK]
    if VALUE_NORM:
        score *= tl.load(vnorm_ptr + b * sn_b + kv * sn_h + slots * sn_s, mask=ok, other=0.0)
    empty = ok & (tl.max(logit, axis=1) == float("-inf"))  # empty slots have -inf logits, valid ones never
    if not PER_HEAD:  # one decision per layer: a single row, which broadcasting hands to every KV head
        score = tl.sum(score, axis=0, keep_dims=True) / H_KV  # [1, CHUNK], the mean over all heads
        empty = tl.max(empty.to(tl.int32), axis=0, keep_dims=True) > 0
    if PARTIAL:
        tl.store(part_ptr + b * S + slots, score, mask=slots < S)
    else:
        if HAS_STATE:
            score = _update_state(score, state_ptr + b * st_b + kv * st_h + slots * st_s, ok, kv, PER_HEAD, DECAY)
        _lower_key(score, empty, ok, slots, kv, kvs, newest_ptr, pos_ptr, key_ptr, b, S, n_split, n_sink, window,
                   sp_b, sp_h, sp_s, H_KV, NS_PAD, PER_HEAD, PROTECT)


@triton.jit
def _update_state(score, state_ptrs, ok, kv, PER_HEAD: tl.constexpr, DECAY: tl.constexpr):
    """state = DECAY * state + score in every KV head's row of the chunk (state_ptrs [KV, CHUNK]); returns the
    state to compare: per KV head, or per layer its row 0 (every row holds the layer's)."""
    state = tl.load(state_ptrs, mask=ok, other=0.0)  # [KV, CHUNK]
    if DECAY != 1.0:
        state *= DECAY
    state += score
    tl.store(state_ptrs, state, mask=ok)
    if not PER_HEAD:
        state = tl.sum(tl.where(kv == 0, state, 0.0), axis=0, keep_dims=True)
    return state


@triton.jit
def _lower_key(score, empty, ok, slots, kv, kvs, newest_ptr, pos_ptr, key_ptr, b, S, n_split, n_sink, window,
               sp_b, sp_h, sp_s, H_KV: tl.constexpr, NS_PAD: tl.constexpr, PER_HEAD: tl.constexpr,
               PROTECT: tl.constexpr):
    """choose_slot's rule on the chunk's scores [KV or 1, CHUNK]: protection and empty slots applied, each score
    packed with its slot; key[b, kv] is lowered to the chunk's minimum."""
    if PROTECT:
        protected = _protected(newest_ptr, pos_ptr, b, kv, slots, ok, n_split, n_sink, window, sp_b, sp_h, sp_s,
                               H_KV, NS_PAD)
        if not PER_HEAD:
            protected = tl.max(protected.to(tl.int32), axis=0, keep_dims=True) > 0
        score = tl.where(protected, float("inf"), score)
    score = tl.where(empty, float("-inf"), score)
    # Pack (score, slot) into one int64 whose signed order is the lexicographic order: the fp32 bits, with
    # negative floats' magnitude bits flipped, on top; the slot below. The minimum key is then the lowest
    # score with ties to the lowest slot, whatever order the atomics land in: deterministic.
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(ok, (bits.to(tl.int64) << 32) | slots.to(tl.int64), KEY_MAX)  # [KV, CHUNK]
    tl.atomic_min(key_ptr + b * H_KV + kvs, tl.min(key, axis=1), mask=kvs < H_KV, sem="relaxed")


@triton.jit
def _protected(newest_ptr, pos_ptr, b, kv, slots, ok, n_split, n_sink, window, sp_b, sp_h, sp_s,
               H_KV: tl.constexpr, NS_PAD: tl.constexpr):
    """protected_mask of slots [1, CHUNK] in KV heads kv [KV, 1] of row b: the first n_sink positions and the last
    `window` (from the row's newest position, the maximum of the splits' in newest_ptr)."""
    sp = tl.arange(0, NS_PAD)[None, :]
    newest = tl.load(newest_ptr + (b * H_KV + kv) * n_split + sp, mask=(kv < H_KV) & (sp < n_split), other=-1)
    newest = tl.max(newest, axis=1)[:, None]  # [KV, 1]
    p = tl.load(pos_ptr + b * sp_b + kv * sp_h + slots * sp_s, mask=ok, other=-1)
    return (p >= 0) & ((p < n_sink) | (p > newest - window))


@triton.jit
def _score_given(logit_ptr, newest_ptr, pos_ptr, key_ptr, b, kvh, S, n_split, n_sink, window, sp_b, sp_h, sp_s,
                 H_KV: tl.constexpr, G: tl.constexpr, G_POW2: tl.constexpr, NS_PAD: tl.constexpr,
                 CHUNK: tl.constexpr):
    """given_score for KV head kvh of row b, one program over the whole row: its heads' raw scores [G, S] (the
    attention pass stored them in place of the logits, -inf in empty slots) z-scored per head over the slots that
    can go, the maximum over the group, lowest into key[b, kvh]. Two passes: the count, mean and sum of squared
    deviations of each chunk, merged as it comes (Chan et al.), then the z-scores."""
    g = tl.arange(0, G_POW2)[:, None]  # [G, 1]
    rows = (b * H_KV + kvh) * G + g  # flat index into [B, H_q]
    kv = tl.zeros([1, 1], tl.int64) + kvh  # this program's KV head, in _lower_key's [KV, 1] and [KV]
    kvs = tl.zeros([1], tl.int64) + kvh
    n = tl.zeros([G_POW2, 1], tl.float32)
    mean = tl.zeros([G_POW2, 1], tl.float32)
    m2 = tl.zeros([G_POW2, 1], tl.float32)
    for start in range(0, S, CHUNK):
        slots = start + tl.arange(0, CHUNK)[None, :]  # [1, CHUNK]
        raw = tl.load(logit_ptr + rows * S + slots, mask=(g < G) & (slots < S), other=0.0)  # [G, CHUNK]
        p = tl.load(pos_ptr + b * sp_b + kvh * sp_h + slots * sp_s, mask=slots < S, other=-1)
        protected = _protected(newest_ptr, pos_ptr, b, kv, slots, slots < S, n_split, n_sink, window, sp_b, sp_h,
                               sp_s, H_KV, NS_PAD)
        scored = (p >= 0) & ~protected  # [1, CHUNK]
        n_chunk = tl.sum(scored.to(tl.float32), axis=1, keep_dims=True)  # [1, 1]
        mean_chunk = tl.sum(tl.where(scored, raw, 0.0), axis=1, keep_dims=True) / tl.maximum(n_chunk, 1.0)
        m2_chunk = tl.sum(tl.where(scored, (raw - mean_chunk) * (raw - mean_chunk), 0.0), axis=1, keep_dims=True)
        total = n + n_chunk
        delta = mean_chunk - mean
        mean += delta * n_chunk / tl.maximum(total, 1.0)
        m2 += m2_chunk + delta * delta * n * n_chunk / tl.maximum(total, 1.0)
        n = total
    std = tl.maximum(tl.sqrt(m2 / tl.maximum(n, 1.0)), 1e-6)
    for start in range(0, S, CHUNK):
        slots = start + tl.arange(0, CHUNK)[None, :]
        raw = tl.load(logit_ptr + rows * S + slots, mask=(g < G) & (slots < S), other=float("-inf"))
        score = tl.max(tl.where(g < G, (raw - mean) / std, float("-inf")), axis=0, keep_dims=True)  # [1, CHUNK]
        empty = (slots < S) & (tl.max(raw, axis=0, keep_dims=True) == float("-inf"))
        _lower_key(score, empty, slots < S, slots, kv, kvs, newest_ptr, pos_ptr, key_ptr, b, S, n_split, n_sink,
                   window, sp_b, sp_h, sp_s, H_KV, NS_PAD, True, True)


@triton.jit
def _finish_kernel(
    m_ptr, l_ptr, o_ptr, out_ptr,  # split partials as in _attend_kernel; out [B, H_q, D]
    vnorm_ptr,  # [B, H_kv, S] f32 ||v||_1 per slot (with VALUE_NORM)
    logit_ptr, newest_ptr, pos_ptr, state_ptr, key_ptr,  # [B, H_q, S], [B, H_kv, n_split], pos, state [B, H_kv, S]
    part_ptr,  # [B, S] f32 with PARTIAL: the per-layer scores themselves
    S, n_split, n_chunks, n_sink, window, sp_b, sp_h, sp_s, sn_b, sn_h, sn_s, st_b, st_h, st_s,
    H_KV: tl.constexpr, G: tl.constexpr, KV_POW2: tl.constexpr, G_POW2: tl.constexpr, D: tl.constexpr,
    NS_PAD: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, PER_HEAD: tl.constexpr,
    PROTECT: tl.constexpr, PARTIAL: tl.constexpr,
    VALUE_NORM: tl.constexpr, HAS_STATE: tl.constexpr, DECAY: tl.constexpr,  # the Scoring's, and a state given
    GIVEN: tl.constexpr,  # the Scoring's query "given": n_chunks is H_kv, a program scores a KV head's whole row
):
    """Program (b, c): for c < n_chunks, score chunk c of row b's slots (all KV heads); for the H_kv programs
    after those (when split), merge the split partials of KV head c - n_chunks into out. One launch for both."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if GIVEN and c < n_chunks:
        _score_given(logit_ptr, newest_ptr, pos_ptr, key_ptr, b, c, S, n_split, n_sink, window, sp_b, sp_h, sp_s,
                     H_KV, G, G_POW2, NS_PAD, CHUNK)
    elif c < n_chunks:
        _score_chunk(m_ptr, l_ptr, logit_ptr, vnorm_ptr, newest_ptr, pos_ptr, state_ptr, key_ptr, part_ptr, b, c,
                     S, n_split, n_sink, window, sp_b, sp_h, sp_s, sn_b, sn_h, sn_s, st_b, st_h, st_s,
                     H_KV, G, KV_POW2, G_POW2, NS_PAD, CHUNK, PER_HEAD, PROTECT, PARTIAL,
                     VALUE_NORM, HAS_STATE, DECAY)
    elif SPLIT:
        _combine_splits(m_ptr, l_ptr, o_ptr, out_ptr, b, c - n_chunks, n_split, H_KV, G, G_POW2, D, NS_PAD)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (an H200's 132 when the kernels run on CPU in the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _split_count(n_programs: int, n_blocks: int, device: torch.device) -> int:
    """Flash-decoding: split the slots until the grid covers about two waves of SMs."""
    return max(1, min(n_blocks, triton.cdiv(2 * _sm_count(device), n_programs)))


def _slot_splits(B: int, H_kv: int, S: int, D: int, device: torch.device) -> tuple[int, int, int]:
    """The attention kernel's block of slots, the slots of a split (whole blocks) and the splits of a row."""
    BLOCK_S = 64 if D <= 128 else 32
    n_blocks = triton.cdiv(S, BLOCK_S)
    chunk = triton.cdiv(n_blocks, _split_count(B * H_kv, n_blocks, device)) * BLOCK_S
    return BLOCK_S, chunk, triton.cdiv(S, chunk)  # no split left without slots


def _finish_warps(split: bool, H_kv: int, G: int, chunk: int) -> int:
    """4 warps when the finish kernel also merges splits; scoring alone, a warp per 4,096 logits of a program's
    tile (Qwen3-8B's 8 x 4 x 128: one warp, the fastest), so that larger query groups get more warps, not spills."""
    tile = triton.next_power_of_2(H_kv) * triton.next_power_of_2(G) * chunk
    return 4 if split else max(1, tile // 4096)


# a given query's finish program reads its KV head's whole row, this many slots of each head at a time: few
# dependent rounds to memory at one row, where 8 programs are all there is
GIVEN_CHUNK = 1024


def _chunk_size(B: int, S: int, device: torch.device) -> int:
    """Slots per scoring program: 128, halved (down to 32) until the B x chunks grid covers two waves."""
    chunk = 128
    while chunk > 32 and B * triton.cdiv(S, chunk) < 2 * _sm_count(device):
        chunk //= 2
    return chunk


def _as_torch_op(fn):
    """fn as the torch op tinyflow::decode_attention, which torch.compile keeps whole (it knows only the shapes
    of its results, from _result_shapes) and a CUDA graph captures. Opaque, not traced into: its launch settings
    depend on the batch size, which the compiled step leaves dynamic. Only where the kernels can run: registering
    the op imports torch's compiler, 1.5 s of the start of every process (a command line on a CPU, its --help,
    each of its refusals) that would never use it."""
    if not CAN_LAUNCH:
        return fn
    op = torch.library.custom_op("tinyflow::decode_attention", mutates_args={"state"})(fn)
    op.register_fake(_result_shapes)
    return op


def _result_shapes(q, k, v, pos, per_head, n_sink, window, select, value_norm, decay, state, limit, vnorm, k_scale,
                   v_scale, partial, v_top, given_query, pair_weight):
    """The op's results as empty tensors of their shapes: out [B, H_q, D], and the partial scores [B, S] fp32 or
    the winning (score, slot) key [B, H_kv] int64."""
    B, H_kv, S = pos.shape
    second = q.new_empty(B, S, dtype=torch.float32) if partial else q.new_empty(B, H_kv, dtype=torch.int64)
    return q.new_empty(q.shape), second


def _unless_kept(v, v_scale, vnorm, v_top, value_norm: bool):
    """||v||_1 [B, H_kv, S] when the score needs it, and with FP8 the value scales' bound [B, H_kv]: each computed
    here (another pass over V, or over the scales) only where the caller, as the cache does, gives none."""
    fp8 = v_scale is not None
    if value_norm and vnorm is None:
        vnorm = l1_norm(dequantize(v, v_scale) if fp8 else v)
    if fp8 and v_top is None:
        v_top = v_scale.amax(-1)
    return vnorm, v_top


@_as_torch_op
def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, per_head: bool, n_sink: int,
                         window: int, select: bool, value_norm: bool, decay: float, state: Optional[Tensor],
                         limit: Optional[Tensor], vnorm: Optional[Tensor], k_scale: Optional[Tensor],
                         v_scale: Optional[Tensor], partial: bool, v_top: Optional[Tensor],
                         given_query: Optional[Tensor], pair_weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    # value_norm, decay: the Scoring's fields. state is an optional in-place argument (the inferred schema reads
    # `Tensor(a!)? state`, which torch.compile functionalises like any mutated input; None: nothing mutated).
    # Launches: _attend_kernel; _finish_kernel if there are split partials to merge or slots to score.
    # the bytes each launch moves, for checking GPU timings: docs/performance.md, "Kernel launch settings"
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    G = H_q // H_kv
    assert H_q % H_kv == 0 and D == triton.next_power_of_2(D) and pos.shape == (B, H_kv, S)
    assert limit is None or not select, "limit is for caches without selection (they fill in order)"
    assert not partial or (select and not per_head and state is None), "partial scores are per layer, no state"
    given = select and given_query is not None  # Scoring(query="given"): per head (check_given)
    BLOCK_S, chunk, n_split = _slot_splits(B, H_kv, S, D, q.device)
    split = n_split > 1
    f32 = dict(device=q.device, dtype=torch.float32)
    unused = torch.empty(1, **f32)  # stands in for the buffers a launch does not touch

    out = torch.empty(B, H_q, D, device=q.device, dtype=q.dtype)
    m = torch.empty(B, H_q, n_split, **f32) if split or select else unused
    l = torch.empty(B, H_q, n_split, **f32) if split or select else unused
    o = torch.empty(B, H_q, n_split, D, **f32) if split else unused
    logits = torch.empty(B, H_q, S, **f32) if select else unused  # base 2 (x log2(e)); -inf for empty slots
    newest = torch.empty(B, H_kv, n_split, device=q.device, dtype=torch.int32) if select else unused
    key = torch.empty(B, H_kv, device=q.device, dtype=torch.int64)  # packed (score, slot), or -1
    part = torch.empty(B, S, **f32) if partial else unused
    value_norm = select and value_norm
    fp8 = k_scale is not None
    vnorm, v_top = _unless_kept(v, v_scale, vnorm, v_top, value_norm)
    torch.library.wrap_triton(_attend_kernel)[(B * H_kv, n_split)](
        q, k, v, pos, out, m, l, o, logits, newest, key,
        unused if limit is None else limit, k_scale if fp8 else unused, v_scale if fp8 else unused,
        v_top.contiguous() if fp8 else unused, S, chunk,
        *q.stride(), *k.stride(), *v.stride(), *pos.stride(), *(k_scale.stride() if fp8 else (0,) * 3),
        given_query.contiguous() if given else unused, pair_weight.contiguous() if given else unused,
        H_KV=H_kv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_S=BLOCK_S,
        SCALE=1 / math.sqrt(D), SPLIT=split, SELECT=select, HAS_LIMIT=limit is not None,
        FP8_KV=fp8, FP16_PRODUCTS=fp8 and q.dtype in (torch.bfloat16, torch.float16), GIVEN=given,
        HALF_PAD=max(16, D // 2),
        **(FP8_ATTEND_LAUNCH if fp8 else GIVEN_ATTEND_LAUNCH if given else ATTEND_LAUNCH[select]))

    if split or select:
        CHUNK = GIVEN_CHUNK if given else _chunk_size(B, S, q.device)
        n_chunks = H_kv if given else triton.cdiv(S, CHUNK) if select else 0
        torch.library.wrap_triton(_finish_kernel)[(B, n_chunks + (H_kv if split else 0))](
            m, l, o, out, vnorm if value_norm else unused, logits, newest, pos, unused if state is None else state,
            key, part, S, n_split, n_chunks, n_sink, window, *pos.stride(),
            *(vnorm.stride() if value_norm else (0,) * 3), *(state.stride() if state is not None else (0,) * 3),
            H_KV=H_kv, G=G, KV_POW2=triton.next_power_of_2(H_kv), G_POW2=triton.next_power_of_2(G), D=D,
            NS_PAD=triton.next_power_of_2(n_split), CHUNK=CHUNK, SPLIT=split, PER_HEAD=per_head,
            PROTECT=n_sink > 0 or window > 0, PARTIAL=partial,
            VALUE_NORM=value_norm, HAS_STATE=state is not None, DECAY=decay, GIVEN=given,
            num_warps=4 if given else _finish_warps(split, H_kv, G, CHUNK))
    if partial:
        return out, part
    return out, key  # with selection, the winning (score, slot) key: decode_attention unpacks the slot


def check_support(device: torch.device, head_dim: int, kv_dtype=None):
    """Refuse, before anything is allocated, a decode these kernels cannot run on CUDA (the CPU decodes
    through decode_attention_ref instead)."""
    if device.type != "cuda":
        return
    if not HAS_TRITON:
        raise ValueError("decoding on CUDA runs Triton kernels and Triton is not installed: pip install triton "
                         "(on Windows: triton-windows), or run on the CPU")
    if head_dim & (head_dim - 1):  # tl.arange over the head needs a power of 2
        raise ValueError(f"the decode kernel needs a head_dim that is a power of two, and this model's is "
                         f"{head_dim}: run it on the CPU (--device cpu), which decodes without the kernel")
    capability = torch.cuda.get_device_capability(device)
    if kv_dtype == FP8 and capability < (8, 9):  # Triton's float8 e4m3 starts with Ada and Hopper
        raise ValueError(f"an FP8 KV cache needs compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                         f"use --kv-dtype auto")


def decode_attention(q, k, v, pos, per_head=False, n_sink=0, window=0, select=True, scoring=LONGFLOW,
                     state=None, limit=None, vnorm=None, k_scale=None, v_scale=None, partial=False, v_top=None,
                     given_query=None, pair_weight=None):
    """Triton version of decode_attention_ref (same arguments, same results); see that for the meaning."""
    if not HAS_TRITON:
        raise RuntimeError("decoding on CUDA runs Triton kernels, and Triton is not installed: pip install triton")
    if not CAN_LAUNCH:
        raise RuntimeError("the Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before kernel "
                           "is imported; on this machine call kernel.decode_attention_ref (same arguments)")
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and k.dtype != torch.uint8):
        raise ValueError("an FP8 cache gives k and v as uint8 e4m3 bits with both k_scale and v_scale")
    if v_top is not None and (v_scale is None or v_top.shape != v_scale.shape[:2]):
        raise ValueError("v_top bounds an FP8 cache's value scales: [B, H_kv], given with k_scale and v_scale")
    if partial and per_head:
        raise ValueError("the kernel's partial scores are per layer (per_head=False)")
    check_state(scoring, state, partial, select)
    check_given(scoring, given_query, pair_weight, per_head, select, q)
    out, second = torch.ops.tinyflow.decode_attention(q, k, v, pos, per_head, n_sink, window, select,
                                                      scoring.value_norm, scoring.decay, state, limit, vnorm, k_scale,
                                                      v_scale, partial, v_top, given_query, pair_weight)
    # the slot is the low half of the winning key, unpacked here, outside the op: inside it, it would be an eager
    # launch of its own; here the compiler fuses it into whatever reads the slot
    return out, second & 0xFFFFFFFF if select and not partial else second
