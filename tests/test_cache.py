"""The static budget: slots never grow, one eviction per step and layer once full, SnapKV prompt
compression, and equality with the full cache when the budget holds everything."""
from dataclasses import replace

import pytest
import torch

from cache import POLICIES, SNAPKV_WINDOW, KVCache, hash32, resolve_policy, snapkv_score, top_tokens
from generate import Engine
from model import load


@pytest.fixture(scope="module")
def qwen3(checkpoints):
    return load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)


def prompts_of(tok):
    return [tok.encode("The quick brown fox jumps over the lazy dog."), tok.encode("Hello"),
            tok.encode("What is 2 + 3? Please reason step by step.")]


@pytest.mark.parametrize("policy", ["longflow", "longflow-head"])
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
            assert torch.equal(layer.vnorm, layer.v.abs().sum(-1))
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


def test_snapkv_compression_keeps_the_policys_sinks_and_recent_window(qwen3):
    """vatp protects its first 20 tokens and a recent window: SnapKV must not drop them from a long prompt."""
    model, _ = qwen3
    policy = resolve_policy("vatp", 64)
    cache = KVCache(model.cfg, 1, 64, "cpu", torch.float32, policy)
    model(torch.randint(0, 300, (1, 150)), torch.arange(150)[None], cache, rows=torch.tensor([0]),
          last=torch.tensor([149]))
    kept = set(cache.layers[0].pos[0, 0].tolist())
    assert set(range(20)) | set(range(150 - policy.window, 150)) <= kept and len(kept - {-1}) == 63


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
    resolve_policy("longflow", None)
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
    """3,000 graph-replayed steps through the Triton kernel with a 64-slot budget."""
    model, tok = load(str(checkpoints["llama"]), torch.device("cuda"), torch.bfloat16)
    engine = Engine(model)
    outs, _ = engine.generate([tok.encode("Hello world"), tok.encode("The quick brown fox")], 3000, [],
                              budget=64)
    assert [len(o) for o in outs] == [3000, 3000]
    pos = torch.stack([layer.pos for layer in engine.cache.layers])  # [L, B, H_kv, S]
    assert ((pos >= 0).sum(-1) == 64).all()
    assert all(torch.isfinite(t).all() for layer in engine.cache.layers for t in (layer.k, layer.v))
    held = pos[:, 0, 0]  # [L, S]: the newest token written (steps run in chunks, so a few past 3,000)
    assert (held.max(-1).values == engine.state.positions[0] - 1).all()


# ---- the policy family: each rule's choice on inputs where the right answer is obvious ---------------
class Tiny:  # the config fields a cache needs: one layer, 2 KV heads of 4 dims
    n_layers, n_kv_heads, head_dim = 1, 2, 4


def full_cache(policy, S=8, n_q=2):
    """A cache of S slots holding positions 0..S-1, and one decode step's inputs for position S. The
    new token goes into slot S-1 (its token is evicted), so slots 0..S-2 hold positions 0..S-2."""
    p = replace(POLICIES[policy], window=0) if isinstance(POLICIES[policy].window, float) else POLICIES[policy]
    cache = KVCache(Tiny, 1, S, "cpu", torch.float32, p)
    cache.layers[0].pos[:] = torch.arange(S, dtype=torch.int32)
    cache.layers[0].k[:] = 0.0
    cache.layers[0].v[:] = 1.0
    cache.layers[0].vnorm[:] = 4.0 if cache.policy.keeps_vnorm else 0.0  # ||v||_1 of those values
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


def test_knorm_evicts_the_largest_key_norm():
    cache, *args = full_cache("knorm")
    cache.layers[0].k[0, :, 2] = 3.0  # slot 2 has the largest key in both heads
    cache.layers[0].score[0] = cache.layers[0].k[0].norm(dim=-1)  # norms are recorded when keys are written
    assert step(cache, *args) == [2, 2]


def test_longflow_evicts_a_zero_value_that_tova_keeps():
    """Slot 3 gets most of the attention but carries a zero value vector: it contributes nothing, so
    LongFlow (alpha * ||v||_1) drops it, while TOVA (alpha alone) keeps it and drops a weakly attended one."""
    for policy, want in (("longflow", 3), ("tova", 0)):
        cache, q, k, v, positions = full_cache(policy)
        q[..., 0] = 4.0
        cache.layers[0].k[0, :, 3, 0] = 2.0  # q . k_3 is large
        cache.layers[0].v[0, :, 3] = 0.0
        if cache.policy.keeps_vnorm:  # norms are recorded when values are written
            cache.layers[0].vnorm[:] = cache.layers[0].v.abs().sum(-1)
        assert step(cache, q, k, v, positions) == [want, want], policy


def test_h2o_keeps_a_token_that_was_attended_before_even_when_not_now():
    cache, q, k, v, positions = full_cache("h2o")
    q[..., 0] = 4.0
    cache.layers[0].k[0, :, 5, 0] = 2.0  # slot 5 is the heavy hitter of the first step
    assert step(cache, q, k, v, positions) == [0, 0]  # slot 0 is among the least attended
    cache.layers[0].k[0, :, 5, 0] = -2.0  # now nobody attends slot 5 ...
    q2 = q.clone()
    assert 5 not in step(cache, q2, k, v, positions + 1)  # ... but its accumulated score keeps it
    assert cache.layers[0].score[0, :, 5].min() > cache.layers[0].score[0, :, 6].max()


def test_vatp_never_evicts_its_twenty_sinks():
    cache, q, k, v, positions = full_cache("vatp", S=24)
    cache.layers[0].v[0, :, 7] = 0.0  # the lowest score sits in a sink
    assert step(cache, q, k, v, positions) == [20, 20]  # the first non-sink of equal score


def test_random_is_a_seeded_hash_of_the_position():
    cache, *args = full_cache("random")
    pos = torch.arange(8)
    pos[7] = 8  # the new token took slot 7
    want = hash32(pos.long() * 0x9E3779B1 + 0).float().argmin().item()
    assert step(cache, *args) == [want, want]


@pytest.mark.parametrize("policy", ["longflow", "longflow-head", "tova", "h2o", "vatp", "streaming", "random",
                                    "knorm"])
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
    from cache import random_score
    model, _ = qwen3
    prompt = torch.randint(0, 300, (1, 90))
    for policy, rule, n_sink in (("random", "decode", 0), ("longflow", "streaming", 7)):
        cache = KVCache(model.cfg, 1, 40, "cpu", torch.float32, resolve_policy(policy, 40, n_sink=n_sink), rule)
        model(prompt, torch.arange(90)[None], cache, rows=torch.tensor([0]), last=torch.tensor([89]))
        kept = set(cache.layers[0].pos[0, 0, :39].tolist())
        if policy == "random":
            assert kept == set(random_score(torch.arange(90), 0).topk(39).indices.tolist())
        else:
            assert kept == set(range(7)) | set(range(90 - 32, 90))
