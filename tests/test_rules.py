"""Every registered policy, checked by what it declares and by what its paper defines.

A new policy gets these tests by registering in policies.POLICIES and adding its formula to SPECS below:
  - the slot it evicts is the argmin of the score it declares (empty slots first, protected ones never);
  - what it keeps beside the slots matches a recomputation from scratch (running sums, the query ring) or,
    for what accumulates, the sum of its formula over the steps each token was held;
  - its score is the formula of its paper, written out here apart from policies.py, and it decides (per
    KV head or per layer) and protects (sinks, recent window) as its paper does;
  - with prompt compression "decode" it keeps the top of its own score over the prompt;
  - the memory planner counts exactly the tensors it keeps.
The cache is driven directly (one layer, no model), on the CPU through the kernel's PyTorch reference.
"""
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from calibration import QueryStats
from cache import KVCache
from policies import POLICIES, RecentQueries, hash32, resolve_policy

B, H_Q, H_KV, D, S = 2, 4, 2, 8, 64  # S: every policy's smallest budget fits (vatp: 20 sinks + 32 + 1)
CFG = SimpleNamespace(n_layers=1, n_heads=H_Q, n_kv_heads=H_KV, head_dim=D)
EVICTING = [name for name, p in POLICIES.items() if p.evicts]


# ---- the papers' formulas, written out apart from policies.py ------------------------------------------
@dataclass
class Spec:
    """A policy as its paper defines it. score(k, v, pos, q, now, recent, layer) takes the layer's keys and
    values [B, H_kv, S, D], positions [B, H_kv, S] (-1: empty), this step's queries [B, H_q, D], the newest
    position [B], the last 32 queries [B, H_q, 32, D] and the layer, and returns this step's score of every
    slot: [B, H_kv, S], or [B, 1, S] for one score of the layer. With an update the slot goes by a state
    instead (lowest goes), which starts at 0 for a new token and, for the prompt's tokens, as if each prompt
    query had been a step (prompt_state):
        "sum"  state = state + score            "ema"  state = decay * state + score
    The protections are at S slots."""
    score: Callable
    per_head: bool = False  # one decision per KV head, else one per layer
    n_sink: int = 0
    window: int = 0
    update: str = "none"
    decay: float = 1.0


def alpha(q, k, pos):
    """The current query's softmax weights over the held slots: [B, H_kv, group, S]."""
    logits = torch.einsum("bhgd,bhsd->bhgs", q.view(B, H_KV, -1, D), k) / math.sqrt(D)
    return logits.masked_fill((pos < 0)[:, :, None], -math.inf).softmax(-1)


def l1(v):
    return v.abs().sum(-1)[:, :, None]  # [B, H_kv, 1, S]


def rkv_formula(k, v, pos, q, now, recent, layer):
    """R-KV: 0.1 * importance - 0.9 * redundancy over the held, unprotected slots (the last 8 are
    protected); importance from the whole query group's max logit, pooled over 7 neighbours in position
    order; redundancy from the full cosine matrix, each key's mean similarity to the other held keys."""
    scored = (pos >= 0) & (pos <= now[:, None, None] - 8)
    recent = recent[:, :, -8:]
    logits = torch.einsum("bhgwd,bhsd->bhgws", recent.view(B, H_KV, -1, 8, D), k).amax(2) / math.sqrt(D)
    importance = logits.masked_fill(~scored[:, :, None], -math.inf).softmax(-1).nan_to_num(0).mean(2)
    order = pos.argsort(-1)
    pooled = F.max_pool1d(importance.gather(-1, order), 7, stride=1, padding=3)
    importance = torch.zeros_like(importance).scatter(-1, order, pooled)
    unit = F.normalize(k, dim=-1)
    cos = (unit @ unit.transpose(-1, -2)) * (pos >= 0)[:, :, None, :]  # [B, H_kv, S, S] over held partners
    mean_cos = (cos.sum(-1) - 1) / ((pos >= 0).sum(-1, keepdim=True) - 1)
    redundancy = mean_cos.masked_fill(~scored, -math.inf).softmax(-1).nan_to_num(0)
    return 0.1 * importance - 0.9 * redundancy


def snapkv_decode_formula(k, v, pos, q, now, recent, layer):
    """Decode-time SnapKV: per KV head, the softmax attention each of the last 32 queries (the current one
    the newest) gives the held slots it could see (positions up to its own), summed over the queries, the mean
    over the query group; the last 32 tokens are protected."""
    W = recent.shape[2]
    asked = now[:, None] - W + 1 + torch.arange(W)  # [B, W] the queries' positions, oldest first
    logits = torch.einsum("bhgwd,bhsd->bhgws", recent.view(B, H_KV, -1, W, D), k) / math.sqrt(D)
    seen = (pos[:, :, None, None, :] >= 0) & (pos[:, :, None, None, :] <= asked[:, None, None, :, None])
    return logits.masked_fill(~seen, -math.inf).softmax(-1).nan_to_num(0).sum(3).mean(2)
# TriAttention scores with statistics of the model's queries (calibration.py): random ones here, each pair's mean
# magnitude above the magnitude of its mean (as a mean of magnitudes is), RoPE's frequencies for theta 10^4
_gen = torch.Generator().manual_seed(7)
_q_mean = torch.randn(1, H_Q, D // 2, 2, generator=_gen)
TRI_STATS = QueryStats(_q_mean, _q_mean.norm(dim=-1) + torch.rand(1, H_Q, D // 2, generator=_gen),
                       1e4 ** -(torch.arange(0, D, 2) / D))


@pytest.fixture(autouse=True)
def triattention_with_statistics(monkeypatch):
    """The registered triattention, ready for a model: with TRI_STATS (an engine loads a model's own)."""
    monkeypatch.setitem(POLICIES, "triattention", replace(POLICIES["triattention"], stats=TRI_STATS))


def triattention_formula(k, v, pos, q, now, recent, layer):
    """TriAttention: per query head h, with key pairs k_f = k[f] + i k[f + D/2], the statistics' mean query qbar_hf,
    mean magnitude A_hf, frequencies w_f, and t0 = now + 1 (the next token's position),
      raw_h = 1/17 sum over d in 1, 2, 4, ..., 65536 of sum_f Re(qbar_hf conj(k_f) e^{i (t0 + d) w_f})
              + sum_f (A_hf - |qbar_hf|) |k_f|,
    in fp64; z-scored over the held slots outside the recent window (4 = 6.25% of 64), population std; then the
    maximum over the KV head's query group."""
    F = D // 2
    qbar = torch.view_as_complex(TRI_STATS.q_mean[0].double()).view(1, H_KV, -1, 1, F)  # [1, H_kv, G, 1, F]
    A = TRI_STATS.q_abs_mean[0].double().view(1, H_KV, -1, 1, F)
    w = TRI_STATS.inv_freq.double()
    kf = torch.complex(k[..., :F].double(), k[..., F:].double())[:, :, None]  # [B, H_kv, 1, S, F]
    t0 = (now + 1).double()[:, None, None, None, None]
    offsets = [2 ** i for i in range(17)]
    trig = sum((qbar * kf.conj() * torch.exp(1j * (t0 + d) * w)).real.sum(-1) for d in offsets) / len(offsets)
    raw = trig + ((A - qbar.abs()) * kf.abs()).sum(-1)  # [B, H_kv, G, S]
    scored = ((pos >= 0) & (pos <= now[:, None, None] - 4))[:, :, None]
    n = scored.sum(-1, keepdim=True)
    mean = (raw * scored).sum(-1, keepdim=True) / n
    std = (((raw - mean) * scored) ** 2).sum(-1, keepdim=True).div(n).sqrt()
    return ((raw - mean) / std).amax(2).float()


class Specs(dict):
    """The specs by rule name; a registered rule without one fails its test naming what to add."""
    def __missing__(self, name):
        pytest.fail(f"policy {name!r} has no Spec: add its line to SPECS in tests/test_rules.py (its score as its "
                    f"paper defines it, its update and decay)")


SPECS = Specs({
    # LongFlow: mean over every query head of alpha_i * ||v_i||_1, one decision per layer
    "longflow": Spec(lambda k, v, pos, q, *_: (alpha(q, k, pos) * l1(v)).mean((1, 2))[:, None]),
    "longflow-head": Spec(lambda k, v, pos, q, *_: (alpha(q, k, pos) * l1(v)).mean(2), per_head=True),
    # TOVA: mean over every query head of alpha_i
    "tova": Spec(lambda k, v, pos, q, *_: alpha(q, k, pos).mean((1, 2))[:, None]),
    # H2O and VATP sum this step's score over every step a token is held; H2O keeps half the budget recent,
    # VATP 20 sinks and half of the rest recent
    "h2o": Spec(lambda k, v, pos, q, *_: alpha(q, k, pos).mean(2), per_head=True, window=S // 2, update="sum"),
    "vatp": Spec(lambda k, v, pos, q, *_: (alpha(q, k, pos) * l1(v)).mean(2), per_head=True, n_sink=20,
                 window=(S - 20) // 2, update="sum"),
    # LongFlow's score as an exponential moving average over the steps a token is held
    "longflow-ema": Spec(lambda k, v, pos, q, *_: (alpha(q, k, pos) * l1(v)).mean((1, 2))[:, None], update="ema",
                         decay=0.9),
    # StreamingLLM: 4 sinks, then the oldest goes
    "streaming": Spec(lambda k, v, pos, *_: pos.float(), n_sink=4),
    # KeyDiff: the key most cosine-similar to the mean of the held keys' unit vectors goes
    "keydiff": Spec(lambda k, v, pos, *_: -F.cosine_similarity(
        k, (F.normalize(k, dim=-1) * (pos >= 0)[..., None]).sum(2, keepdim=True), dim=-1), per_head=True),
    "rkv": Spec(rkv_formula, per_head=True, window=8),
    "snapkv-decode": Spec(snapkv_decode_formula, per_head=True, window=32),
    # random: a hash of (position, layer, KV head) and of the step, so every step draws afresh
    "random": Spec(lambda k, v, pos, q, now, recent, layer: (hash32(
        hash32(pos.long() * 0x9E3779B1 + layer.index * 0x85EBCA77 + layer.heads[:, None])
        + now.long()[:, None, None] * 0xC2B2AE3D) >> 8).float(), per_head=True),
    # Knorm: the largest key norm goes
    "knorm": Spec(lambda k, v, pos, *_: -k.norm(dim=-1), per_head=True),
    # LazyEviction: the importance from each slot's last recurrence and longest recurrence interval, which the
    # layer keeps (test_lazy_evictions_follow_the_recurrences_step_by_step checks those); the newest W / C of
    # the budget stay, the authors' W = 175 at C = 1492
    "lazy": Spec(lambda k, v, pos, q, now, recent, layer: lazy_formula(pos, now, layer), per_head=True,
                 window=int(S * 175 / 1492)),
    # TriAttention: the calibrated mean query's attention at offsets ahead, z-scored, max over the group
    "triattention": Spec(triattention_formula, per_head=True, window=4),
})


def lazy_importance(last, mp, now):
    """LazyEviction's importance (its kv_utils.py:72-73), lowest goes: last, mp [B, H_kv, S] in steps, now [B]."""
    since = now[:, None, None] - last
    return 2 / (1 + torch.exp(1 + since / (mp + 1e-5))) + (mp > 0) * 2 / (1 + torch.exp(mp - 1))


def lazy_formula(pos, now, layer):
    """LazyEviction's importance from the states the layer keeps; over a prompt seen as the cache (prompt
    compression), the states every prompt token starts with: last = the prompt's last position, mp = 0."""
    if layer.kept["last"].shape == pos.shape:
        return lazy_importance(layer.kept["last"].float(), layer.kept["mp"].float(), now)
    return lazy_importance(now[:, None, None].float().expand(pos.shape), torch.zeros(pos.shape), now)


def updated(spec, state, score):
    return state + score if spec.update == "sum" else spec.decay * state + score


def prompt_state(spec, q, k, v, layer):
    """The state of each prompt token after a prompt q [B, H_q, T, D], k, v [B, H_kv, T, D]: each prompt query
    t in turn as a step, over the tokens up to t (H2O's column sums of the prompt's causal attention)."""
    T = k.shape[2]
    state = torch.zeros(B, H_KV, T)
    for t in range(T):
        pos = torch.where(torch.arange(T) <= t, torch.arange(T), -1).expand(B, H_KV, T)
        recent = q[:, :, max(0, t - 31):t + 1]
        state = updated(spec, state, spec.score(k, v, pos, q[:, :, t], torch.full((B,), t), recent, layer))
    return state


# ---- a run: a prompt that fills the cache, then decode steps that evict -------------------------------
def run(name, steps=12, seed=0):
    """Prefill S - 1 random tokens, then decode `steps` more; yields after each step (cache, layer, the
    step's queries, its position, the last 32 queries [B, H_q, 32, D], the spec's state by slot)."""
    torch.manual_seed(seed)
    cache = KVCache(CFG, B, S, "cpu", torch.float32, resolve_policy(name, S))
    c, T = cache.layers[0], S - 1
    q, k, v = torch.randn(B, H_Q, T, D) * 2, torch.randn(B, H_KV, T, D), torch.randn(B, H_KV, T, D)
    cache.prefill(c, q, k, v, torch.arange(T).expand(B, T), torch.arange(B))
    queries = [q[:, :, t] for t in range(T)]
    spec, state = SPECS[name], torch.zeros(B, H_KV, S)
    if spec.update != "none":
        state[:, :, :T] = prompt_state(spec, q, k, v, c)
    for t in range(T, T + steps):
        qt, kt, vt = torch.randn(B, H_Q, D) * 2, torch.randn(B, H_KV, D), torch.randn(B, H_KV, D)
        slot = c.next_slot.clone()
        cache.decode(c, qt, kt, vt, torch.full((B,), t))
        queries.append(qt)
        recent = torch.stack(queries[-32:], 2)
        if spec.update != "none":
            state.scatter_(2, slot[..., None], 0.0)  # the new token starts from nothing
            state = updated(spec, state, spec.score(c.k, c.v, c.pos, qt, None, recent, c))
        yield cache, c, qt, t, recent, state


def protected(pos, p):
    newest = pos.amax(-1, keepdim=True)
    return (pos >= 0) & ((pos < p.n_sink) | (pos > newest - p.window))


def expected_slot(score, pos, p):
    """The lowest-index empty slot, else the lowest score among the unprotected: per KV head, or on the
    mean over the heads (every head then holds the same positions). Returns [B, H_kv]."""
    guarded, empty = protected(pos, p), pos < 0
    if not p.per_head:
        score, guarded, empty = score.mean(1, keepdim=True), guarded[:, :1], empty[:, :1]
    score = score.masked_fill(guarded, math.inf).masked_fill(empty, -math.inf)
    return score.argmin(-1).expand(B, H_KV)


# ---- the tests ------------------------------------------------------------------------------------------
def test_every_registered_policy_has_its_formula_here():
    assert set(EVICTING) == set(SPECS), "add the paper's formula of each new policy to SPECS"


@pytest.mark.parametrize("name", EVICTING)
def test_each_policy_decides_and_protects_as_its_paper_says(name):
    p, spec = resolve_policy(name, S), SPECS[name]
    assert (p.per_head, p.n_sink, p.window) == (spec.per_head, spec.n_sink, spec.window)
    scoring = getattr(p, "scoring", None)  # a rule the fused kernel scores declares its update there
    assert (scoring.update, scoring.decay) == (spec.update, spec.decay) if scoring else spec.update == "none"


@pytest.mark.parametrize("name", EVICTING)
def test_each_evicted_slot_is_the_argmin_of_the_declared_score(name):
    for cache, c, q, t, *_ in run(name):
        p = cache.policy
        score = p.score(cache.with_values(c), q, torch.full((B,), t))
        assert torch.equal(c.next_slot, expected_slot(score, c.pos, cache.policy)), f"step at position {t}"


@pytest.mark.parametrize("name", EVICTING)
def test_the_declared_score_is_the_papers_formula(name):
    """fp32 on both sides, summed in other orders: equal to rounding."""
    for cache, c, q, t, recent, state in run(name):
        p = cache.policy
        now = torch.full((B,), t)
        got = p.score(cache.with_values(c), q, now)
        want = state[:, :got.shape[1]] if SPECS[name].update != "none" else \
            SPECS[name].score(c.k, c.v, c.pos, q, now, recent, c)
        ranked = ((c.pos >= 0) & ~protected(c.pos, cache.policy))[:, :got.shape[1]]  # what the argmin compares
        torch.testing.assert_close(got.expand_as(want)[ranked], want.expand_as(got)[ranked], rtol=1e-5, atol=1e-6,
                                   msg=f"{name} at position {t}")


@pytest.mark.parametrize("name", EVICTING)
def test_what_a_policy_keeps_matches_a_recomputation_from_the_slots(name):
    for cache, c, q, t, recent, state in run(name):
        held = c.pos >= 0
        for what, kept in cache.policy.keeps.items():
            value, kept_now = kept.recompute(cache.with_values(c)), c.kept[what]
            if isinstance(kept, RecentQueries):  # the last n queries, at column position % n
                for back in range(kept.n):
                    assert torch.equal(kept_now[:, :, (t - back) % kept.n], recent[:, :, -1 - back]), what
            elif what == "state":
                torch.testing.assert_close(kept_now[held], state[held], rtol=1e-5, atol=1e-6)  # fp32, other order
            elif value is None:  # other history, which its rule's own test follows step by step (lazy's steps)
                continue
            elif value.shape == held.shape:  # a value per slot, written with the token: exact
                assert torch.equal(kept_now[held], value[held]), what
            else:  # a running sum, one key in and one out per step: fp32 rounding accumulates
                torch.testing.assert_close(kept_now, value, rtol=0, atol=1e-5, msg=what)


@pytest.mark.parametrize("name", EVICTING)
def test_prompt_compression_by_the_policy_keeps_the_top_of_its_prompt_score(name):
    torch.manual_seed(1)
    p = resolve_policy(name, S, prompt_rule="decode")
    cache = KVCache(CFG, B, S, "cpu", torch.float32, p, "decode")
    c, T = cache.layers[0], 100
    q, k, v = torch.randn(B, H_Q, T, D) * 2, torch.randn(B, H_KV, T, D), torch.randn(B, H_KV, T, D)
    positions = torch.arange(T).expand(B, T)
    pos = positions[:, None].expand(B, H_KV, T)
    score = p.prompt_score(c, q, k, v, pos, p.prompt_seed(cache, q, k, v, positions))
    # its score over the prompt is the paper's, with the last prompt query (with an update: the prompt's state)
    spec = prompt_state(SPECS[name], q, k, v, c)[:, :score.shape[1]] if SPECS[name].update != "none" else \
        SPECS[name].score(k, v, pos, q[:, :, -1], torch.full((B,), T - 1), q[:, :, -32:], c)
    ranked = ~protected(pos, p)[:, :score.shape[1]]
    torch.testing.assert_close(score.expand_as(spec)[ranked], spec.expand_as(score)[ranked], rtol=1e-5, atol=1e-6)
    score = score.expand(B, H_KV, T) if p.per_head else score.mean(1, keepdim=True).expand(B, H_KV, T)
    ranked = score.masked_fill(protected(pos, p), math.inf).sort(dim=-1, descending=True, stable=True).indices
    cache.prefill(c, q, k, v, positions, torch.arange(B))
    assert torch.equal(c.pos[..., :S - 1].sort(-1).values, ranked[..., :S - 1].sort(-1).values.int())
    assert (c.pos[..., S - 1] == -1).all()  # the last slot waits for the first new token


@pytest.mark.parametrize("name", EVICTING)
def test_what_an_empty_slot_holds_changes_no_held_slots_score(name):
    """A slot not written yet (pos -1) holds whatever was there (zeros, or a finished row's token when a row
    is refilled): a score that reads it (a softmax over every slot, its empty ones unmasked) ranks the held
    slots by garbage. The held slots' scores are exactly those with other garbage in the empty slots."""
    torch.manual_seed(2)
    cache = KVCache(CFG, B, S, "cpu", torch.float32, resolve_policy(name, S))
    c, T = cache.layers[0], S // 2
    q, k, v = torch.randn(B, H_Q, T, D) * 2, torch.randn(B, H_KV, T, D), torch.randn(B, H_KV, T, D)
    cache.prefill(c, q, k, v, torch.arange(T).expand(B, T), torch.arange(B))
    qt, now = torch.randn(B, H_Q, D) * 2, torch.full((B,), T - 1)
    before = cache.policy.score(cache.with_values(c), qt, now).expand(B, H_KV, S).clone()
    empty = c.pos < 0  # [B, H_kv, S]
    c.k[empty], c.v[empty] = torch.randn_like(c.k[empty]) * 5, torch.randn_like(c.v[empty]) * 5
    for kept in c.kept.values():
        if kept.shape == empty.shape:  # a value per slot
            kept[empty] = (torch.randn(kept[empty].shape) * 5).to(kept.dtype)  # (lazy's steps are int32)
    after = cache.policy.score(cache.with_values(c), qt, now).expand(B, H_KV, S)
    assert torch.equal(after[~empty], before[~empty])


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_memory_planner_counts_exactly_what_the_cache_allocates(name):
    p = POLICIES[name] if name == "full" else resolve_policy(name, S)
    for kv_dtype in (None, torch.float8_e4m3fn):
        cache = KVCache(CFG, B, S, "cpu", torch.float32, p, kv_dtype=kv_dtype)
        c = cache.layers[0]
        scales = (c.k_scale, c.v_scale, c.v_top) if kv_dtype else ()
        tensors = (c.k, c.v, c.pos, *scales, *c.kept.values(), *c.data.values())
        assert KVCache.bytes_needed(CFG, B, S, torch.float32, p, kv_dtype) == \
            sum(t.numel() * t.element_size() for t in tensors)


def test_a_per_layer_value_weighted_state_starts_from_every_heads_alpha_times_its_own_value_norm():
    """A rule deciding per layer that sums alpha * ||v||_1 (VATP per layer) seeds each prompt token with the
    mean over every query head of its column sum times the value norm of that head's KV head: the layer mean
    comes after the product, as in each decode step (KV heads hold different values)."""
    torch.manual_seed(3)
    p = replace(resolve_policy("vatp", S), per_head=False)
    cache = KVCache(CFG, B, S, "cpu", torch.float32, p)
    T = 20
    q, k, v = torch.randn(B, H_Q, T, D) * 2, torch.randn(B, H_KV, T, D), torch.randn(B, H_KV, T, D)
    spec = Spec(lambda k, v, pos, q, *_: (alpha(q, k, pos) * l1(v)).mean((1, 2))[:, None], update="sum")
    want = prompt_state(spec, q, k, v, cache.layers[0])  # [B, 1, T]
    got = p.prompt_seed(cache, q, k, v, torch.arange(T).expand(B, T))  # [B, H_kv, T], every column the layer's
    torch.testing.assert_close(got, want.expand(B, H_KV, T), rtol=1e-5, atol=1e-6)  # fp32, summed in other orders


# ---- LazyEviction's states, simulated step by step -------------------------------------------------------
LAZY_ALPHA = 1e-4  # the authors' Qwen setting (their evaluation.py, eval_qwen.sh)


def lazy_simulation(c, k):
    """LazyEviction's tokens after a prompt, per row and KV head: slot -> [position, key, last, mp], from the
    slots the cache's prompt rule kept (its business, not the rule's); at the first decode step every token
    present starts with last = 0 and mp = 0 (the authors' temp_cacheobs.py)."""
    return [[{j: [int(c.pos[b, h, j]), k[b, h, c.pos[b, h, j]], 0, 0] for j in range(S) if c.pos[b, h, j] >= 0}
             for h in range(H_KV)] for b in range(B)]


def lazy_step(tokens, q, s, window):
    """One decode step s (1, 2, ...) of one row and KV head, as the authors' code takes it: a token recurs when
    a query head of the group (q [G, D]) gives it a softmax weight >= alpha over the held tokens, new one
    included; then mp = max(mp, s - last), last = s. Returns the slot the next token takes: the lowest empty
    one, else the least important of those not among the newest `window` (the lowest slot of ties)."""
    slots = sorted(tokens)
    keys = torch.stack([tokens[j][1] for j in slots]).double()  # [n, D]
    weights = (q.double() @ keys.T / math.sqrt(D)).softmax(-1)  # [G, n]
    for j, recurs in zip(slots, (weights.amax(0) >= LAZY_ALPHA).tolist()):
        if recurs:
            tokens[j][3] = max(tokens[j][3], s - tokens[j][2])
            tokens[j][2] = s
    if len(slots) < S:
        return min(set(range(S)) - set(slots))
    newest = max(t[0] for t in tokens.values())
    unprotected = [j for j in slots if tokens[j][0] <= newest - window]
    last, mp = (torch.tensor([[[float(tokens[j][i]) for j in unprotected]]]) for i in (2, 3))
    return unprotected[lazy_importance(last, mp, torch.tensor([float(s)])).argmin()]


@pytest.mark.parametrize("lengths", [(40, 30), (100, 70)], ids=["prompts-that-fit", "prompts-compressed"])
def test_lazy_evictions_follow_the_recurrences_step_by_step(lengths):
    """LazyEviction's two states and its choice, simulated per row and KV head with the authors' own step
    counter (s = 1 at the first decode step), one eviction per step: the cache keeps the same states on its
    clock of positions (last + the prompt's length - 1; mp as is) and evicts the same slot, at every step."""
    torch.manual_seed(4)
    cache = KVCache(CFG, B, S, "cpu", torch.float32, resolve_policy("lazy", S))
    c, T = cache.layers[0], max(lengths)
    q, k, v = torch.randn(B, H_Q, T, D) * 3, torch.randn(B, H_KV, T, D), torch.randn(B, H_KV, T, D)
    positions = torch.stack([torch.where(torch.arange(T) < n, torch.arange(T), -1) for n in lengths])
    cache.prefill(c, q, k, v, positions, torch.arange(B))
    tokens = lazy_simulation(c, k)
    slot = c.next_slot.tolist()
    intervals, evicted = set(), []
    for s in range(1, 101):
        qt, kt, vt = torch.randn(B, H_Q, D) * 3, torch.randn(B, H_KV, D), torch.randn(B, H_KV, D)
        now = torch.tensor(lengths) + s - 1  # the new token's position
        cache.decode(c, qt, kt, vt, now)
        kept = c.kept["last"].tolist(), c.kept["mp"].tolist()
        for b in range(B):
            for h in range(H_KV):
                here = tokens[b][h]
                evicted += [here[slot[b][h]][3]] if slot[b][h] in here else []
                here[slot[b][h]] = [int(now[b]), kt[b, h], s - 1, 0]
                slot[b][h] = lazy_step(here, qt[b].view(H_KV, -1, D)[h], s, SPECS["lazy"].window)
                for j, (_, _, last, mp) in here.items():
                    got = kept[0][b][h][j], kept[1][b][h][j]
                    assert got == (last + lengths[b] - 1, mp), f"row {b}, KV head {h}, slot {j}, step {s}"
                    intervals.add(mp)
            assert c.next_slot[b].tolist() == slot[b], f"the slot evicted in row {b} at step {s}"
    # the run tells something: tokens skipped steps before recurring, and those evicted had several intervals
    assert max(intervals) >= 3 and len(set(evicted)) >= 3


def test_lazy_a_weight_of_exactly_alpha_is_a_recurrence():
    """The authors' test is a_j >= alpha: 10,000 equal keys share the attention, 1e-4 each (alpha in fp32),
    and every one recurs, one step after the prompt (last = now, mp = 1)."""
    slots = 10_000
    cache = KVCache(CFG, 1, slots, "cpu", torch.float32, resolve_policy("lazy", slots))
    c, T = cache.layers[0], slots - 1
    cache.prefill(c, torch.randn(1, H_Q, T, D), torch.zeros(1, H_KV, T, D), torch.randn(1, H_KV, T, D),
                  torch.arange(T)[None], torch.tensor([0]))
    cache.decode(c, torch.randn(1, H_Q, D), torch.zeros(1, H_KV, D), torch.randn(1, H_KV, D), torch.tensor([T]))
    assert (c.kept["last"] == T).all() and (c.kept["mp"] == 1).all()
