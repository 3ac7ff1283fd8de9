"""The static budget: slots never grow, one eviction per step and layer once full, SnapKV prompt
compression, and equality with the full cache when the budget holds everything."""
from dataclasses import replace

import pytest
import torch

import torch.nn.functional as F

import kernel

from cache import KVCache
from generate import Engine
from model import load, prefill_attention
from policies import (POLICIES, SNAPKV_WINDOW, attention_column_sums, random_score, resolve_policy, snapkv_score,
                      top_tokens, unit)


def unit_key_sum(k, pos):
    """The sum of the unit vectors of the keys held (pos >= 0): [B, H_kv, S, D] -> [B, H_kv, D] fp32."""
    return (unit(k) * (pos >= 0)[..., None]).sum(2)


@pytest.fixture(scope="module")
def qwen3(checkpoints):
    return load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)


def prompts_of(tok):
    return [tok.encode("The quick brown fox jumps over the lazy dog."), tok.encode("Hello"),
            tok.encode("What is 2 + 3? Please reason step by step.")]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
def test_budget_that_holds_everything_generates_exactly_the_full_cache_tokens(qwen3, policy):
    model, tok = qwen3
    engine = Engine(model, compile=False)
    full, _ = engine.generate(prompts_of(tok), 30, [], budget=None)
    roomy, _ = engine.generate(prompts_of(tok), 30, [], budget=64, policy=policy)
    assert roomy == full


def run_steps(model, cache, tokens, steps):
    """Prefill right-padded prompts, then feed `steps` greedy tokens; yield the cache after each step."""
    B = len(tokens)
    T = max(map(len, tokens))
    ids = torch.zeros(B, T, dtype=torch.int64)
    pos = torch.full((B, T), -1)
    for i, t in enumerate(tokens):
        ids[i, :len(t)], pos[i, :len(t)] = torch.tensor(t), torch.arange(len(t))
    lengths = (pos >= 0).sum(1)
    nxt = model(ids, pos, cache, rows=torch.arange(B), last=lengths - 1).argmax(-1)
    for _ in range(steps):
        nxt = model(nxt[:, None], lengths[:, None], cache)[:, 0].argmax(-1)
        lengths = lengths + 1
        yield cache


@pytest.mark.parametrize("policy", ["longflow", "longflow-head"])
def test_small_budget_keeps_slot_count_and_evicts_one_token_per_step_and_layer(qwen3, policy):
    model, tok = qwen3
    cache = KVCache(model.cfg, 3, 40, "cpu", torch.float32, policy)
    k_ptr = cache.layers[0].k.data_ptr()
    before = None
    evictions = 0
    for c in run_steps(model, cache, prompts_of(tok), 60):
        assert c.layers[0].k.shape[2] == 40 and c.layers[0].k.data_ptr() == k_ptr  # never grows, never reallocates
        pos = torch.stack([layer.pos for layer in c.layers])  # [L, B, H_kv, S]
        held = [[[set(pos[l, b, h][pos[l, b, h] >= 0].tolist()) for h in range(pos.shape[2])]
                 for b in range(3)] for l in range(pos.shape[0])]
        if before is not None:
            for l, rows in enumerate(held):
                for b, heads in enumerate(rows):
                    for h, now in enumerate(heads):
                        gone, new = before[l][b][h] - now, now - before[l][b][h]
                        assert len(new) == 1  # the new token always gets a slot
                        if len(before[l][b][h]) == 40:  # full: exactly one token leaves
                            assert len(gone) == 1 and len(now) == 40
                            evictions += 1
                        else:  # not yet full: the lowest empty slot fills, nothing leaves
                            assert not gone
        before = held
    assert evictions > 0
    if policy == "longflow":  # one decision per layer: every KV head holds the same tokens
        assert all((p == p[:, :1]).all() for p in (layer.pos for layer in cache.layers))


@pytest.mark.parametrize("policy", ["longflow", "longflow-head", "vatp"])
def test_each_slots_kept_value_norm_is_that_of_the_value_it_holds(qwen3, policy):
    """The kernel scores with the ||v||_1 the cache stored when each token was written (prefill, prompt
    compression, decode): after evictions it must still match the V in every slot, and empty slots hold 0."""
    model, _ = qwen3
    cache = KVCache(model.cfg, 2, 53, "cpu", torch.float32, policy)  # vatp needs 53 slots
    for c in run_steps(model, cache, [list(range(3, 70)), [5, 6, 7]], 25):
        for layer in c.layers:
            assert torch.equal(layer.kept["value_l1"], layer.v.abs().sum(-1))
    pos = torch.stack([layer.pos for layer in cache.layers])  # [L, B, H_kv, S]
    assert (pos[:, 1] == -1).any() and (pos[:, 0] >= 0).all()  # empty slots in the short row, none in the long


def test_small_budget_greedy_output_is_identical_across_runs(qwen3):
    model, tok = qwen3
    runs = [Engine(model, compile=False).generate(prompts_of(tok), 50, [], budget=36)[0] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("per_head", [False, True])
def test_long_prompt_is_compressed_to_budget_minus_one_keeping_the_last_32(qwen3, per_head):
    model, _ = qwen3
    budget = 50
    cache = KVCache(model.cfg, 2, budget, "cpu", torch.float32, "longflow-head" if per_head else "longflow")
    long, short = list(torch.randint(0, 300, (120,)).tolist()), [5, 6, 7]
    next(run_steps(model, cache, [long, short], 1))
    # after prefill + one step: row 0 held budget - 1 prompt tokens and then took the new token
    for pos in (layer.pos for layer in cache.layers):
        for h in range(pos.shape[1]):
            held = pos[0, h].tolist()
            assert len([p for p in held if p >= 0]) == budget
            assert set(range(120 - SNAPKV_WINDOW, 121)) <= set(held)  # the window and the new token
            assert sorted(p for p in pos[1, h].tolist() if p >= 0) == [0, 1, 2, 3]  # short row kept


@pytest.mark.parametrize("rule", ["snapkv", "streaming", "decode"])
@pytest.mark.parametrize("name, n_sink, window", [("vatp", None, None), ("longflow", 0, 99)])
def test_prompt_compression_keeps_the_policys_sinks_and_recent_window(qwen3, rule, name, n_sink, window):
    """vatp protects its first 20 tokens and a recent window, longflow here a window of 99 in 100 slots: no
    prompt rule may drop them from a long prompt (StreamingLLM's own 4 sinks give way to them)."""
    model, _ = qwen3
    budget = 64 if name == "vatp" else 100
    policy = resolve_policy(name, budget, n_sink, window, prompt_rule=rule)
    cache = KVCache(model.cfg, 1, budget, "cpu", torch.float32, policy, rule)
    model(torch.randint(0, 300, (1, 200)), torch.arange(200)[None], cache, rows=torch.tensor([0]),
          last=torch.tensor([199]))
    for pos in (layer.pos for layer in cache.layers):
        kept = set(pos[0, 0].tolist())
        assert set(range(policy.n_sink)) | set(range(200 - policy.window, 200)) <= kept
        assert len(kept - {-1}) == budget - 1


def test_prompt_compression_keeps_the_same_tokens_of_a_tie_whatever_the_padding():
    """Two tokens tie at the cut: the earlier one stays, alone or padded to a longer prompt of the batch
    (torch.topk picks between ties by an order that changes with the length)."""
    torch.manual_seed(0)
    score = torch.rand(1, 1, 61)
    score[0, 0, 41] = score[0, 0, 15]
    n_keep = int((score > score[0, 0, 15]).sum()) + 1  # room for one of the two
    pos = torch.arange(61)[None, None]
    alone = top_tokens(score, pos, n_keep)
    padded = top_tokens(torch.cat([score, torch.rand(1, 1, 100)], -1), torch.cat([pos, torch.full((1, 1, 100), -1)], -1),
                        n_keep)
    assert alone.tolist() == padded.tolist() and 15 in alone and 41 not in alone


@pytest.mark.parametrize("name, n_sink, budget", [("vatp", None, 53), ("longflow", 30, 63), ("h2o", None, 33)])
def test_the_smallest_budget_accepted_still_keeps_every_protected_prompt_token(qwen3, name, n_sink, budget):
    """Sinks, the recent window and SnapKV's last 32 prompt tokens all fit in the smallest budget that
    resolve_policy accepts (one less is refused), so compression never has to drop a protected token."""
    model, _ = qwen3
    with pytest.raises(ValueError, match="too small"):
        resolve_policy(name, budget - 1, n_sink)
    policy = resolve_policy(name, budget, n_sink)
    cache = KVCache(model.cfg, 1, budget, "cpu", torch.float32, policy)
    model(torch.randint(0, 300, (1, 150)), torch.arange(150)[None], cache, rows=torch.tensor([0]),
          last=torch.tensor([149]))
    last = max(SNAPKV_WINDOW, policy.window)
    for pos in (layer.pos for layer in cache.layers):
        for h in range(pos.shape[1]):
            assert set(range(policy.n_sink)) | set(range(150 - last, 150)) <= set(pos[0, h].tolist())


def test_snapkv_keeps_the_centre_of_what_the_window_attends_to():
    """Every window query attends strongly to tokens 10..14. Pooling over 5 neighbours ranks the centre
    12 first (5 of 5 strong neighbours), then 11 and 13 (4 of 5): those three stay, with the window."""
    T, D = 60, 8
    torch.manual_seed(0)
    k = torch.randn(1, 1, T, D) * 0.1
    q = torch.zeros(1, 2, T, D)
    q[..., 0] = 10.0
    k[0, 0, 10:15, 0] = 5.0  # large q.k for every window query
    positions = torch.arange(T)[None]
    keep = top_tokens(snapkv_score(q, k, positions, per_head=False), positions[:, None], SNAPKV_WINDOW + 3)
    assert keep[0, 0].tolist() == [11, 12, 13] + list(range(T - SNAPKV_WINDOW, T))


def test_budget_validation_names_the_problem():
    assert resolve_policy(None, None).name == "full" and resolve_policy(None, 33).name == "longflow"
    resolve_policy("longflow", 33)
    with pytest.raises(ValueError, match="too small"):
        resolve_policy("longflow", 32)
    with pytest.raises(ValueError, match="too small"):
        resolve_policy("longflow", 52, n_sink=20, window=20)  # 20 sinks + the last 32 + the new token: 53
    with pytest.raises(ValueError, match="positive integer"):
        resolve_policy("longflow", 3.5)
    with pytest.raises(ValueError, match="unknown policy"):
        resolve_policy("h3o", 100)
    with pytest.raises(ValueError, match="unknown prompt compression"):
        resolve_policy("longflow", 100, prompt_rule="zip")
    with pytest.raises(ValueError, match="sinks must be a non-negative integer"):
        resolve_policy("longflow", 100, n_sink=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_long_bf16_run_on_the_gpu_keeps_the_budget_and_stays_finite(checkpoints):
    """3,000 graph-replayed steps through the Triton kernel with a 64-slot budget (past the tiny model's
    512 positions: what is tested is the cache, not the text)."""
    model, tok = load(str(checkpoints["llama"]), torch.device("cuda"), torch.bfloat16)
    engine = Engine(model, allow_long_context=True)
    outs, _ = engine.generate([tok.encode("Hello world"), tok.encode("The quick brown fox")], 3000, [],
                              budget=64)
    assert [len(o) for o in outs] == [3000, 3000]
    pos = torch.stack([layer.pos for layer in engine.cache.layers])  # [L, B, H_kv, S]
    assert ((pos >= 0).sum(-1) == 64).all()
    assert all(torch.isfinite(t).all() for layer in engine.cache.layers for t in (layer.k, layer.v))
    held = pos[:, 0, 0]  # [L, S]: the newest token written (steps run in chunks, so a few past 3,000)
    assert (held.max(-1).values == engine.state.positions[0] - 1).all()


# ---- the policy family: each rule's choice on inputs where the right answer is obvious ---------------
class Tiny:  # the config fields a cache needs: one layer, 2 KV heads of 4 dims (and 2 query heads)
    n_layers, n_heads, n_kv_heads, head_dim = 1, 2, 2, 4


def full_cache(policy, S=8, n_q=2):
    """A cache of S slots holding positions 0..S-1, and one decode step's inputs for position S. The
    new token goes into slot S-1 (its token is evicted), so slots 0..S-2 hold positions 0..S-2."""
    p = replace(POLICIES[policy], window=0) if isinstance(POLICIES[policy].window, float) else POLICIES[policy]
    cache = KVCache(Tiny, 1, S, "cpu", torch.float32, p)
    cache.layers[0].pos[:] = torch.arange(S, dtype=torch.int32)
    cache.layers[0].k[:] = 0.0
    cache.layers[0].v[:] = 1.0
    if "value_l1" in cache.policy.keeps:
        cache.layers[0].kept["value_l1"][:] = 4.0  # ||v||_1 of those values
    cache.layers[0].next_slot[:] = S - 1
    q = torch.zeros(1, n_q, 4)
    k = torch.zeros(1, 2, 4)
    v = torch.ones(1, 2, 4)
    return cache, q, k, v, torch.tensor([S])


def step(cache, q, k, v, positions):
    cache.decode(cache.layers[0], q, k, v, positions)
    return cache.layers[0].next_slot[0].tolist()  # [H_kv]: both heads, one decision per layer or per head


def test_streaming_evicts_the_oldest_token_after_the_four_sinks():
    cache, *args = full_cache("streaming")
    assert step(cache, *args) == [4, 4]


def test_knorm_evicts_the_largest_key_norm_of_each_kv_head():
    cache, *args = full_cache("knorm")
    cache.layers[0].k[0, 0, 2] = 3.0  # the largest key of head 0 is in slot 2, of head 1 in slot 5
    cache.layers[0].k[0, 1, 5] = 3.0
    cache.layers[0].kept["key_norm"][0] = cache.layers[0].k[0].norm(dim=-1)  # norms are recorded when keys are written
    assert step(cache, *args) == [2, 5]


def test_keydiff_evicts_the_key_closest_to_the_mean_unit_key():
    """Keys along e0, e1, e2, e3, e0, e1 and one along (1, 1, 1, 1) in slot 6; the new token's key is e2.
    The mean of the unit keys points most nearly along (1, 1, 1, 1): slot 6 is the most redundant."""
    cache, q, k, v, positions = full_cache("keydiff")
    c = cache.layers[0]
    eye = torch.eye(4)
    for slot, key in enumerate([eye[0], eye[1], eye[2], eye[3], eye[0], eye[1], torch.ones(4)]):
        c.k[0, :, slot] = key
    c.kept["key_sum"][:] = F.normalize(c.k[0], dim=-1).sum(1)  # slot 7's key is zero: its unit vector counts for nothing
    c.kept["key_norm"][:] = c.k.norm(dim=-1)  # key norms are recorded when keys are written
    k[:] = eye[2]
    assert step(cache, q, k, v, positions) == [6, 6]
    assert torch.allclose(c.kept["key_sum"][0], F.normalize(c.k[0], dim=-1).sum(1))  # the new key in, slot 7's out


def test_longflow_evicts_a_zero_value_that_tova_keeps():
    """Slot 3 gets most of the attention but carries a zero value vector: it contributes nothing, so
    LongFlow (alpha * ||v||_1) drops it, while TOVA (alpha alone) keeps it and drops a weakly attended one."""
    for policy, want in (("longflow", 3), ("tova", 0)):
        cache, q, k, v, positions = full_cache(policy)
        q[..., 0] = 4.0
        cache.layers[0].k[0, :, 3, 0] = 2.0  # q . k_3 is large
        cache.layers[0].v[0, :, 3] = 0.0
        if "value_l1" in cache.policy.keeps:  # norms are recorded when values are written
            cache.layers[0].kept["value_l1"][:] = cache.layers[0].v.abs().sum(-1)
        assert step(cache, q, k, v, positions) == [want, want], policy


def test_h2o_keeps_a_token_that_was_attended_before_even_when_not_now():
    cache, q, k, v, positions = full_cache("h2o")
    q[..., 0] = 4.0
    cache.layers[0].k[0, :, 5, 0] = 2.0  # slot 5 is the heavy hitter of the first step
    assert step(cache, q, k, v, positions) == [0, 0]  # slot 0 is among the least attended
    cache.layers[0].k[0, :, 5, 0] = -2.0  # now nobody attends slot 5 ...
    q2 = q.clone()
    assert 5 not in step(cache, q2, k, v, positions + 1)  # ... but its accumulated score keeps it
    assert cache.layers[0].kept["state"][0, :, 5].min() > cache.layers[0].kept["state"][0, :, 6].max()


def test_vatp_never_evicts_its_twenty_sinks():
    cache, q, k, v, positions = full_cache("vatp", S=24)
    cache.layers[0].v[0, :, 7] = 0.0  # the lowest score sits in a sink
    assert step(cache, q, k, v, positions) == [20, 20]  # the first non-sink of equal score


def test_rkv_evicts_the_most_redundant_key_when_attention_is_even():
    """No query prefers any key (the queries are zero): importance is even, and of keys along e0, e1, e2,
    e3, e0, e1, e2, e3, e0 the three copies of e0 are the most redundant; the lowest of them goes. The 8
    newest positions (the window) are never evicted."""
    cache, q, k, v, positions = full_cache("rkv", S=16)
    c, eye = cache.layers[0], torch.eye(4)
    for slot in range(9):
        c.k[0, :, slot] = eye[slot % 4]
    c.k[0, :, 9:] = 0.0  # the window's keys count for nothing in the sum of unit keys
    c.kept["key_sum"][:] = F.normalize(c.k[0], dim=-1).sum(1)
    c.kept["key_norm"][:] = c.k.norm(dim=-1)
    assert step(cache, q, k, v, positions) == [0, 0]


def test_rkv_evicts_the_least_attended_neighbourhood_when_keys_are_alike():
    """Keys along one direction (all equally redundant) with lengths falling from slot 0 to slot 8: the
    last queries attend most to the longest. After max-pooling over 7 neighbours in position order, slot
    8's neighbourhood is the least attended."""
    cache, q, k, v, positions = full_cache("rkv", S=16)
    c = cache.layers[0]
    for slot in range(16):
        c.k[0, :, slot, 0] = 3.0 - 0.3 * slot
    c.kept["key_sum"][:] = F.normalize(c.k[0], dim=-1).sum(1)
    c.kept["key_norm"][:] = c.k.norm(dim=-1)
    c.kept["queries"][:] = 0.0
    c.kept["queries"][..., 0] = 1.0
    q[..., 0] = 1.0
    assert step(cache, q, k, v, positions) == [8, 8]
    assert (c.kept["queries"][0, :, 16 % 8] == q[0]).all()  # the new query went into the ring at position % 8


def test_rkv_score_matches_its_formula_with_the_whole_cosine_matrix():
    """rkv_score takes the mean similarity from the running sum of unit keys; here it is computed from the
    n x n cosine matrix (diagonal left out), and importance from the queries directly, with the paper's
    lambda = 0.1 and R-KV's pooling window of 7."""
    from policies import rkv_score
    torch.manual_seed(0)
    cache = KVCache(Tiny, 1, 20, "cpu", torch.float32, resolve_policy("rkv", 40))
    c = cache.layers[0]
    c.k.normal_()
    c.kept["queries"].normal_()
    c.pos[:] = torch.randperm(20, dtype=torch.int32)  # positions in no particular slot order
    c.pos[0, :, 4] = -1  # an empty slot
    held = c.pos[0, 0] >= 0
    c.kept["key_sum"][:] = (F.normalize(c.k[0], dim=-1) * held[:, None]).sum(1)
    c.kept["key_norm"][:] = c.k.norm(dim=-1)
    protected = (c.pos >= 12)  # some slots protected
    got = rkv_score(c, protected)[0]  # [H_kv, S]
    scored = held & ~protected[0, 0]
    for h in range(2):
        keys = c.k[0, h]
        unitk = F.normalize(keys, dim=-1)
        cos = unitk @ unitk.T
        cos.fill_diagonal_(0)
        similarity = (cos * held).sum(1) / (held.sum() - 1)
        redundancy = torch.zeros(20)
        redundancy[scored] = similarity[scored].softmax(0)
        logits = c.kept["queries"][0, h:h + 1] @ keys.T / 2  # [1 query head per KV head, W, S]; sqrt(4) = 2
        alpha = torch.zeros(8, 20)
        alpha[:, scored] = logits[0][:, scored].softmax(-1)
        attention = alpha.mean(0)
        order = c.pos[0, h].argsort()
        pooled = torch.zeros(20)
        pooled[order] = F.max_pool1d(attention[order][None], 7, 1, 3)[0]
        want = 0.1 * pooled - 0.9 * redundancy
        assert torch.allclose(got[h][scored], want[scored], atol=1e-6), h


@pytest.mark.parametrize("policy", ["keydiff", "rkv"])
def test_running_sum_of_unit_keys_stays_the_sum_over_the_held_keys(qwen3, policy):
    """Added when a key is written, subtracted when it is evicted, over prefill, compression, refilled rows and
    60 steps of eviction: it must still be the sum of the unit keys the slots hold (fp32 rounding only)."""
    model, tok = qwen3
    engine = Engine(model, compile=False)
    prompts = prompts_of(tok) + [list(range(1, 60))]  # the last one is compressed
    engine.generate(prompts, 60, [], budget=41, policy=policy, batch_size=2)
    for c in engine.cache.layers:
        held = (c.pos >= 0)[..., None]
        assert torch.allclose(c.kept["key_sum"], (F.normalize(c.k.float(), dim=-1) * held).sum(2), atol=1e-4)


def test_random_draws_afresh_every_step_and_per_kv_head():
    """kvpress draws new noise at every compression: a hash of (position, layer, head, step) does the same
    deterministically, so the survivors are not simply the tokens with the highest fixed hash."""
    cache, *args = full_cache("random")
    pos = torch.arange(8).expand(1, 2, 8).clone()
    pos[..., 7] = 8  # the new token took slot 7
    assert step(cache, *args) == random_score(pos, 0, torch.arange(2), torch.tensor([8])).argmin(-1)[0].tolist()
    picks = [tuple(random_score(pos, 0, torch.arange(2), torch.tensor([t])).argmin(-1)[0].tolist()) for t in range(8, 40)]
    assert len(set(picks)) > 8 and any(a != b for a, b in picks)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
def test_every_policy_keeps_the_budget_and_repeats_itself(qwen3, policy):
    model, tok = qwen3
    engine = Engine(model, compile=False)
    runs = [engine.generate(prompts_of(tok), 50, [], budget=53, policy=policy)[0] for _ in range(2)]  # vatp: >= 53
    assert runs[0] == runs[1]
    assert all(((p >= 0).sum(-1) == 53).all() for p in (layer.pos for layer in engine.cache.layers))


@pytest.mark.parametrize("rule", ["snapkv", "streaming", "decode"])
@pytest.mark.parametrize("policy", ["longflow", "streaming", "knorm"])
def test_every_prompt_compression_keeps_budget_minus_one_prompt_tokens(qwen3, rule, policy):
    model, _ = qwen3
    cache = KVCache(model.cfg, 1, 40, "cpu", torch.float32, resolve_policy(policy, 40, prompt_rule=rule), rule)
    prompt = torch.randint(0, 300, (1, 90))
    model(prompt, torch.arange(90)[None], cache, rows=torch.tensor([0]), last=torch.tensor([89]))
    held = torch.stack([layer.pos for layer in cache.layers])[:, 0] >= 0  # [L, H_kv, S]
    assert (held.sum(-1) == 39).all() and not held[..., 39].any()
    if rule == "streaming":
        assert sorted(cache.layers[0].pos[0, 0, :39].tolist()) == [0, 1, 2, 3] + list(range(55, 90))


def test_compiled_decode_writes_the_cache_in_place():
    """The compiled step must store the new token into the existing K/V tensors, never build a copy of
    a layer's cache (a copy would double the memory traffic of every step: seen once with scatter_)."""
    from torch._inductor.utils import run_and_get_code
    cache = KVCache(Tiny, 2, 1000, "cpu", torch.float32, "longflow")
    q, k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    step = torch.compile(lambda: cache.decode(cache.layers[0], q, k, v, torch.tensor([5, 6])), fullgraph=True)
    _, (code,) = run_and_get_code(step)
    copies = [line for line in code.splitlines() if "empty_strided" in line and "(2, 2, 1000, 4)" in line]
    assert not copies, copies
    assert cache.layers[0].k[:, :, 0].eq(k).all() and cache.layers[0].pos[:, :, 0].tolist() == [[5, 5], [6, 6]]


def test_prompt_compression_by_a_rule_keeps_what_decoding_with_it_would_keep(qwen3):
    """--prompt-compression decode with the random rule keeps the highest hashes (decoding evicts the
    lowest); --prompt-compression streaming keeps the policy's own sinks when it has more than 4."""
    model, _ = qwen3
    prompt = torch.randint(0, 300, (1, 90))
    for policy, rule, n_sink in (("random", "decode", 0), ("longflow", "streaming", 7)):
        cache = KVCache(model.cfg, 1, 40, "cpu", torch.float32, resolve_policy(policy, 40, n_sink=n_sink), rule)
        model(prompt, torch.arange(90)[None], cache, rows=torch.tensor([0]), last=torch.tensor([89]))
        kept = set(cache.layers[0].pos[0, 0, :39].tolist())
        if policy == "random":  # per KV head, the step of the last prompt token
            score = random_score(torch.arange(90).expand(1, model.cfg.n_kv_heads, 90), 0,
                                 torch.arange(model.cfg.n_kv_heads), torch.tensor([89]))
            for h in range(model.cfg.n_kv_heads):
                kept = set(cache.layers[0].pos[0, h, :39].tolist())
                assert kept == set(score[0, h].topk(39).indices.tolist())
        else:
            assert kept == set(range(7)) | set(range(90 - 32, 90))


def naive_column_sums(q, k, n):
    """The causal softmax of the first n queries over the first n keys, summed over the queries: [H_q, n]."""
    G = q.shape[0] // k.shape[0]
    logits = q[:, :n] @ k.repeat_interleave(G, 0)[:, :n].transpose(1, 2) / q.shape[-1] ** 0.5  # [H_q, n, n]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)


@pytest.mark.parametrize("policy", ["h2o", "vatp"])
def test_h2o_and_vatp_start_from_the_prompts_attention_column_sums(policy):
    """H2O's reference seeds each prompt token's score with the attention all prompt queries gave it
    (per head; here averaged over each KV head's query group, as a decode step averages alpha); VATP times
    ||v||_1. The second prompt is shorter: its padding must neither attend nor be attended."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 4), torch.randn(2, 2, 12, 4), torch.randn(2, 2, 12, 4)
    positions = torch.arange(12).repeat(2, 1)
    positions[1, 9:] = -1
    cache = KVCache(Tiny, 2, 64, "cpu", torch.float32, resolve_policy(policy, 64))
    cache.prefill(cache.layers[0], q, k, v, positions, torch.arange(2))
    for row, n in ((0, 12), (1, 9)):
        want = naive_column_sums(q[row], k[row], n).view(2, 2, n).mean(1)  # [H_kv, n]
        if policy == "vatp":
            want = want * v[row, :, :n].abs().sum(-1)
        # fp32 sums of the same terms in another order: equal to rounding
        assert torch.allclose(cache.layers[0].kept["state"][row, :, :n], want, atol=1e-6)
        assert (cache.layers[0].kept["state"][row, :, n:] == 0).all()


def test_column_sums_do_not_depend_on_the_query_chunk():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 50, 8), torch.randn(1, 2, 50, 8)
    positions = torch.arange(50)[None]
    whole = attention_column_sums(q, k, positions)
    assert torch.allclose(attention_column_sums(q, k, positions, budget_bytes=4 * 4 * 50 * 7), whole, atol=1e-5)
    assert torch.allclose(whole[0], naive_column_sums(q[0], k[0], 50), atol=1e-5)


def test_h2o_compresses_a_long_prompt_by_its_accumulated_score(qwen3):
    """With --prompt-compression decode, H2O keeps its recent window and, of the rest, the tokens the prompt
    attended most (the reference's prefill selection)."""
    model, _ = qwen3
    cache = KVCache(model.cfg, 1, 60, "cpu", torch.float32, resolve_policy("h2o", 60), "decode")
    prompt = torch.randint(0, 300, (1, 90))
    model(prompt, torch.arange(90)[None], cache, rows=torch.tensor([0]), last=torch.tensor([89]))
    c, window = cache.layers[0], cache.policy.window
    assert set(range(90 - window, 90)) <= set(c.pos[0, 0].tolist())
    kept = c.pos[0, 0, :59]
    assert kept.tolist() == sorted(kept.tolist())  # prompt order
    assert (c.kept["state"][0, :, :59] > 0).all()  # seeded, not zero


# ---- an FP8 cache ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
def test_every_policy_keeps_its_budget_with_an_fp8_cache(qwen3, policy):
    """The prompts and 60 new tokens overflow 53 slots (vatp's smallest budget): every rule evicts from a cache of
    e4m3 bits, and the norms it keeps are those of the values the cache holds."""
    model, tok = qwen3
    engine = Engine(model, compile=False, kv_dtype=kernel.FP8)
    outs, stats = engine.generate(prompts_of(tok), 60, [], budget=53, policy=policy)
    assert [len(o) for o in outs] == [60] * 3 and "in fp8" in stats.line()
    for layer in engine.cache.layers:
        held = layer.pos >= 0
        assert layer.k.dtype == torch.uint8 and (held.sum(-1) == 53).all()
        values = kernel.dequantize(layer.v, layer.v_scale)
        if "value_l1" in engine.cache.policy.keeps:
            assert torch.equal(layer.kept["value_l1"][held], kernel.l1_norm(values)[held])
        if "key_norm" in engine.cache.policy.keeps:
            torch.testing.assert_close(layer.kept["key_norm"][held], kernel.dequantize(layer.k, layer.k_scale).norm(dim=-1)[held])


@pytest.mark.parametrize("policy", ["keydiff", "rkv"])
def test_fp8_key_sum_stays_the_sum_of_the_stored_unit_keys_in_a_bf16_model(checkpoints, policy):
    """Written and evicted keys are counted from the same (fp32) values, so 200 evicting steps after a prompt
    longer than the budget leave no drift."""
    model = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.bfloat16)[0]
    engine = Engine(model, compile=False, kv_dtype=kernel.FP8)
    engine.generate([list(range(5, 75)), list(range(9, 40))], 200, [], budget=40, policy=policy)
    for layer in engine.cache.layers:
        stored = kernel.dequantize(layer.k, layer.k_scale)
        torch.testing.assert_close(layer.kept["key_sum"], unit_key_sum(stored, layer.pos), atol=1e-4, rtol=0)


def test_a_reused_fp8_row_bounds_its_value_scales_by_its_own_prompt(qwen3):
    """The kernel divides the softmax weights by the row's v_top: after a prompt it is the largest value scale of
    that prompt's tokens, not of a longer previous sequence's, whose scales stay in the slots past it, nor of
    the prompt's padding."""
    cfg = qwen3[0].cfg
    cache = KVCache(cfg, 2, 40, "cpu", torch.float32, "longflow", kv_dtype=kernel.FP8)
    layer, D = cache.layers[0], cfg.head_dim
    for T, size in ((30, 1e4), (10, 1.0)):  # a long prompt of large values, then a short one in the same row
        q = torch.randn(1, cfg.n_heads, T, D)
        k, v = torch.randn(1, cfg.n_kv_heads, T, D), torch.randn(1, cfg.n_kv_heads, T, D) * size
        cache.prefill(layer, q, k, v, torch.arange(T)[None], torch.tensor([1]))
    assert torch.equal(layer.v_top[1], layer.v_scale[1, :, :10].amax(-1))
    assert (layer.v_scale[1, :, 10:30] > 100 * layer.v_top[1, :, None]).all()  # the old sequence's, never attended
    # right-padded prompts: a padding token's scale is not the row's
    T = 12
    q, k, v = torch.randn(1, cfg.n_heads, T, D), *torch.randn(2, 1, cfg.n_kv_heads, T, D)
    v[:, :, 8:] *= 1e4
    cache.prefill(layer, q, k, v, torch.cat([torch.arange(8), torch.full((4,), -1)])[None], torch.tensor([0]))
    assert torch.equal(layer.v_top[0], layer.v_scale[0, :, :8].amax(-1))


@pytest.mark.parametrize("policy", ["longflow", "streaming"])
def test_an_fp8_rows_v_top_bounds_every_value_scale_it_holds_while_it_evicts(qwen3, policy):
    """v_top only grows while a row decodes (the largest scale written since its prompt): however many tokens
    leave, it stays at or above every scale the row holds, so the kernel's weights stay within [0, 1]."""
    model, tok = qwen3
    engine = Engine(model, compile=False, kv_dtype=kernel.FP8)
    engine.generate(prompts_of(tok), 60, [], budget=40, policy=policy)
    for layer in engine.cache.layers:
        held = layer.v_scale.masked_fill(layer.pos < 0, 0.0).amax(-1)  # [B, H_kv]
        assert (layer.v_top >= held).all() and (layer.v_top > 0).all()


def test_fp8_cache_bytes_count_one_byte_a_value_and_two_scales_a_slot(qwen3):
    cfg = qwen3[0].cfg
    for policy in ("longflow", "rkv", "full"):
        cache = KVCache(cfg, 2, 40, "cpu", torch.float32, policy, kv_dtype=kernel.FP8)
        kept = [t for layer in cache.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.v_top, layer.pos,
                                                       *layer.kept.values())]
        assert KVCache.bytes_needed(cfg, 2, 40, torch.float32, cache.policy, kernel.FP8) == \
            sum(t.numel() * t.element_size() for t in kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["longflow", "h2o", "rkv", "full"])
def test_fp8_cache_step_compiled_and_replayed_matches_eager_and_never_recompiles(checkpoints, policy):
    model, tok = load(str(checkpoints["llama"]), torch.device("cuda"), torch.float32)  # fp32: compiled == eager
    prompts = [tok.encode("Hello world"), tok.encode("The quick brown fox jumps")]
    budget = None if policy == "full" else 53
    eager, _ = Engine(model, compile=False, kv_dtype=kernel.FP8).generate(prompts, 80, [], budget, policy)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphed, _ = Engine(model, kv_dtype=kernel.FP8).generate(prompts, 80, [], budget, policy)
    assert graphed == eager


def test_prefill_attention_needs_no_mask_for_right_padded_prompts(checkpoints):
    """The causal kernel gives every real query what attention masked by position gives it; prefill with
    positions in another order is refused, not silently attended in the wrong order."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k, v = torch.randn(2, 2, 37, 16, generator=g), torch.randn(2, 2, 37, 16, generator=g)
    positions = torch.arange(37).repeat(2, 1)
    positions[0, 30:] = -1  # the first prompt is 30 tokens, padded
    visible = positions[:, None, None, :] <= torch.where(positions < 0, 10**9, positions)[:, None, :, None]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=visible & (positions >= 0)[:, None, None, :])
    got = prefill_attention(q, k, v)
    torch.testing.assert_close(got[0, :, :30], want[0, :, :30], atol=1e-6, rtol=1e-6)  # float32 kernels' rounding
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    model = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)[0]
    cache = KVCache(model.cfg, 1, 8, "cpu", torch.float32)
    for bad in ([[1, 2, 3]], [[0, -1, 2]]):
        with pytest.raises(ValueError, match="right-padded prompts"):
            model(torch.tensor([[5, 6, 7]]), torch.tensor(bad), cache, rows=torch.tensor([0]))


@pytest.mark.parametrize("policy", ["longflow", "h2o", "rkv"])
def test_a_prompt_exactly_as_long_as_the_budget_is_cut_to_leave_a_slot_for_the_first_new_token(policy):
    torch.manual_seed(0)
    S = 40
    cache = KVCache(Tiny, 1, S, "cpu", torch.float32, resolve_policy(policy, S))
    c = cache.layers[0]
    q, k, v = torch.randn(1, 2, S, 4), torch.randn(1, 2, S, 4), torch.randn(1, 2, S, 4)
    cache.prefill(c, q, k, v, torch.arange(S)[None], torch.arange(1))
    assert ((c.pos >= 0).sum(-1) == S - 1).all() and (c.next_slot == S - 1).all()
    cache.decode(c, torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.tensor([S]))
    assert (c.pos[..., S - 1] == S).all()  # the first new token took the slot left empty
