"""decode_attention (Triton, through the interpreter on CPU) against decode_attention_ref, and the
reference against the LongFlow formula written out by hand."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BOTH = pytest.mark.parametrize("fn", [kernel.decode_attention, kernel.decode_attention_ref], ids=["triton", "ref"])
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA: the interpreter gets bf16 wrong and cannot compile")
SUM, EMA = kernel.Scoring(update="sum"), kernel.Scoring(value_norm=True, update="ema", decay=0.9)  # H2O; LongFlow-EMA
UPDATES = pytest.mark.parametrize("scoring", [SUM, EMA], ids=["sum", "ema"])


def make_inputs(B, H_q, H_kv, S, D, n_empty=0, seed=0, dtype=torch.float32):
    """Random q, k, v and a cache whose slots hold shuffled positions; n_empty slots per row are empty
    (pos -1, K and V zero as the cache leaves them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, D, generator=g)
    k = torch.randn(B, H_kv, S, D, generator=g)
    v = torch.randn(B, H_kv, S, D, generator=g)
    pos = torch.stack([torch.randperm(2 * S, generator=g)[:S] for _ in range(B * H_kv)]).view(B, H_kv, S)
    for row in range(B * H_kv):
        empty = torch.randperm(S, generator=g)[:n_empty]
        pos.view(-1, S)[row, empty] = -1
    k[pos < 0], v[pos < 0] = 0.0, 0.0
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), pos)]


def direct_scores(q, k, v, pos, per_head, value_norm=True):
    """The LongFlow formula head by head in float64: out, and score [B, H_kv or 1, S]."""
    B, H_q, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, H_q, D, dtype=torch.float64)
    score = torch.zeros(B, H_q, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            kv = h // (H_q // H_kv)
            keys, values = k[b, kv].cpu().double(), v[b, kv].cpu().double()
            logits = keys @ q[b, h].cpu().double() / math.sqrt(D)
            alpha = torch.softmax(logits.masked_fill(pos[b, kv].cpu() < 0, -math.inf), dim=0)
            out[b, h] = alpha @ values
            score[b, h] = alpha * values.abs().sum(-1) if value_norm else alpha
    score = score.view(B, H_kv, -1, S).mean(2) if per_head else score.mean(1, keepdim=True)
    return out, score


def assert_same(got, want, atol=1e-5):
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=1e-5)
    assert got[1].dtype == torch.int64
    assert torch.equal(got[1], want[1]), f"evict {got[1].tolist()} != {want[1].tolist()}"


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("value_norm", [True, False])
def test_reference_matches_the_longflow_formula(per_head, value_norm):
    q, k, v, pos = make_inputs(2, 4, 2, 13, 16, n_empty=3)
    scoring = kernel.Scoring(value_norm=value_norm)
    out, evict = kernel.decode_attention_ref(q, k, v, pos, per_head=per_head, scoring=scoring)
    want_out, score = direct_scores(q, k, v, pos, per_head, value_norm)
    torch.testing.assert_close(out.cpu().double(), want_out, atol=1e-5, rtol=1e-5)
    empty = (pos < 0).cpu() if per_head else (pos < 0).cpu().any(1, keepdim=True)
    want_evict = torch.where(empty.any(-1), empty.int().argmax(-1), score.argmin(-1))  # first empty, else argmin
    assert torch.equal(evict.cpu(), want_evict.expand(2, 2))


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
@pytest.mark.parametrize("B, H_q, H_kv, D, S, n_empty", [
    (2, 4, 4, 64, 37, 0),  # GQA 1:1, one partial block
    (2, 8, 2, 64, 100, 5),  # 4:1, two blocks, some empty slots
    (1, 8, 1, 128, 333, 20),  # 8:1, head_dim 128, six blocks split across programs
    (1, 6, 2, 128, 70, 69),  # 3:1 (group not a power of two), all slots empty but one
])
def test_kernel_matches_reference(B, H_q, H_kv, D, S, n_empty, per_head):
    args = make_inputs(B, H_q, H_kv, S, D, n_empty)
    assert_same(kernel.decode_attention(*args, per_head=per_head),
                kernel.decode_attention_ref(*args, per_head=per_head))


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
@pytest.mark.parametrize("options", [dict(n_sink=4, window=8), dict(scoring=kernel.Scoring()), dict(select=False)],
                         ids=["sink_window", "tova", "no_select"])
def test_kernel_matches_reference_with_options(options, per_head):
    args = make_inputs(2, 8, 2, 100, 64, n_empty=0, seed=1)  # every slot full: the scores decide
    assert_same(kernel.decode_attention(*args, per_head=per_head, **options),
                kernel.decode_attention_ref(*args, per_head=per_head, **options))


@UPDATES
@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_accumulated_scores_match_reference_over_steps(per_head, scoring):
    _, k, v, pos = make_inputs(2, 8, 2, 50, 64, n_empty=4)
    state_triton, state_ref = (torch.zeros(2, 2, 50, device=DEVICE) for _ in range(2))
    for step in range(3):
        q = make_inputs(2, 8, 2, 50, 64, seed=10 + step)[0]
        got = kernel.decode_attention(q, k, v, pos, per_head=per_head, n_sink=2, scoring=scoring, state=state_triton)
        want = kernel.decode_attention_ref(q, k, v, pos, per_head=per_head, n_sink=2, scoring=scoring, state=state_ref)
        assert_same(got, want)
        torch.testing.assert_close(state_triton, state_ref, atol=1e-6, rtol=1e-5)
    assert state_ref.sum() > 0


@pytest.mark.parametrize("value_norm", [True, False], ids=["longflow", "tova"])
@pytest.mark.parametrize("B, H_q, H_kv, D, S, n_empty", [(2, 8, 2, 64, 100, 5), (1, 8, 1, 128, 333, 20)])
def test_partial_scores_are_what_the_decision_is_taken_on(B, H_q, H_kv, D, S, n_empty, value_norm):
    """partial=True (tensor parallel, per layer) gives the score itself, the mean over these heads, before any
    mask: the kernel's equals the reference's, and masked as the kernel masks it, its argmin is the slot the
    kernel picks when it decides alone."""
    args = make_inputs(B, H_q, H_kv, S, D, n_empty)
    options = dict(scoring=kernel.Scoring(value_norm=value_norm), n_sink=4, window=8)
    out, part = kernel.decode_attention(*args, partial=True, **options)
    want_out, want_part = kernel.decode_attention_ref(*args, partial=True, **options)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(part, want_part, atol=1e-7, rtol=1e-5)  # the same sum, in another order
    pos = args[3]
    assert part.shape == (B, S) and (part[(pos < 0).all(1)] == 0).all()  # a slot empty in every head scores 0
    protected, empty = kernel.protected_mask(pos, 4, 8).any(1), (pos < 0).any(1)
    masked = want_part.masked_fill(protected, math.inf).masked_fill(empty, -math.inf)
    _, evict = kernel.decode_attention(*args, **options)
    assert torch.equal(evict, masked.argmin(-1)[:, None].expand(B, H_kv))


def test_partial_scores_are_refused_with_acc_or_without_select_and_by_the_kernel_per_head():
    args = make_inputs(1, 4, 2, 40, 64)
    state = torch.zeros(1, 2, 40, device=DEVICE)
    for fn in (kernel.decode_attention, kernel.decode_attention_ref):
        for options in (dict(scoring=SUM, state=state), dict(select=False)):
            with pytest.raises(ValueError, match="no state"):
                fn(*args, partial=True, **options)
    with pytest.raises(ValueError, match="per layer"):
        kernel.decode_attention(*args, per_head=True, partial=True)


def test_split_and_unsplit_launches_agree(monkeypatch):
    args = make_inputs(1, 8, 2, 333, 64, n_empty=7)
    assert kernel._split_count(2, 6, torch.device(DEVICE)) > 1  # 6 blocks over more than one program
    for per_head in (False, True):
        want = kernel.decode_attention_ref(*args, per_head=per_head)
        assert_same(kernel.decode_attention(*args, per_head=per_head), want)
        with monkeypatch.context() as m:
            m.setattr(kernel, "_split_count", lambda *_: 1)
            assert_same(kernel.decode_attention(*args, per_head=per_head), want)


def test_strided_views_and_int32_positions():
    q, k, v, pos = make_inputs(2, 8, 2, 60, 64, n_empty=3)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # batch not outermost in memory
    k, v = (torch.cat([t, torch.zeros_like(t[:, :, :9])], dim=2)[:, :, :60] for t in (k, v))  # spare capacity
    pos = pos.int()
    assert not q.is_contiguous() and not k.is_contiguous()
    for per_head in (False, True):
        assert_same(kernel.decode_attention(q, k, v, pos, per_head=per_head, window=5),
                    kernel.decode_attention_ref(q, k, v, pos, per_head=per_head, window=5))


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_stored_value_norms_are_the_ones_scored(per_head):
    """The cache passes each slot's ||v||_1 (kept since the token was written) instead of letting the kernel
    reduce V: given norms must be used as they are. Random norms: kernel == reference; then one slot's
    norm set to 0 must be the one evicted, though its V is as large as any."""
    args = make_inputs(2, 8, 2, 100, 64, seed=3)
    vnorm = torch.rand(2, 2, 100, generator=torch.Generator().manual_seed(4)).to(DEVICE) + 0.5
    assert_same(kernel.decode_attention(*args, per_head=per_head, vnorm=vnorm),
                kernel.decode_attention_ref(*args, per_head=per_head, vnorm=vnorm))
    vnorm[:, :, 37] = 0.0
    for fn in (kernel.decode_attention, kernel.decode_attention_ref):
        assert (fn(*args, per_head=per_head, vnorm=vnorm)[1] == 37).all()


def test_select_false_returns_minus_one_and_leaves_acc_alone():
    args = make_inputs(1, 4, 2, 40, 64)
    state = torch.ones(1, 2, 40, device=DEVICE)
    _, evict = kernel.decode_attention(*args, select=False, scoring=SUM, state=state)
    assert evict.dtype == torch.int64 and (evict == -1).all() and (state == 1).all()


@BOTH
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # masked lanes, discarded by tl.where
def test_all_slots_empty_gives_zero_output_not_nan(fn):
    q, k, v, pos = make_inputs(1, 4, 2, 40, 64)
    out, evict = fn(q, k, v, torch.full_like(pos, -1))
    assert (out == 0).all() and (evict == 0).all()


def hand_made(S=40, H_kv=2):
    """A zero query, so every head attends uniformly (bit-identical logits) and the score is ||v_i||_1 / S."""
    q = torch.zeros(1, 2 * H_kv, 64)
    k = torch.randn(1, H_kv, S, 64, generator=torch.Generator().manual_seed(0))
    v = torch.ones(1, H_kv, S, 64)
    pos = ((torch.arange(S) * 7 + 3) % S).repeat(1, H_kv, 1)  # slots in shuffled order; 7 is coprime to S
    return [t.to(DEVICE) for t in (q, k, v, pos)]


@BOTH
def test_empty_slot_is_filled_before_any_eviction(fn):
    q, k, v, pos = hand_made()
    v[:, :, 2] = 0  # the cheapest full slot
    pos[:, :, [30, 9, 17]] = -1
    _, evict = fn(q, k, v, pos)
    assert evict.tolist() == [[9, 9]]


@BOTH
@pytest.mark.parametrize("per_head", [False, True])
def test_full_cache_evicts_the_slot_with_zero_value(fn, per_head):
    q, k, v, pos = hand_made()
    v[:, 0, 21] = 0
    v[:, 1, 33] = 0
    _, evict = fn(q, k, v, pos, per_head=per_head)
    # per layer: both slots score half the others, the lower index wins the tie
    assert evict.tolist() == ([[21, 33]] if per_head else [[21, 21]])


@BOTH
@pytest.mark.parametrize("per_head", [False, True])
def test_ties_go_to_the_lowest_slot(fn, per_head):
    q, k, v, pos = hand_made(S=333)  # every slot scores the same, over 11 chunks of the selection (32 slots each
    # on the CPU, the last one partial) and 6 splits of the attention
    assert fn(q, k, v, pos, per_head=per_head)[1].tolist() == [[0, 0]]
    assert fn(q, k, v, pos, per_head=per_head, scoring=kernel.Scoring())[1].tolist() == [[0, 0]]


@BOTH
@pytest.mark.parametrize("per_head", [False, True])
def test_protected_sink_and_recent_tokens_are_never_chosen(fn, per_head):
    q, k, v, pos = hand_made()
    slot_of = {p: int((pos[0, 0] == p).nonzero()) for p in range(40)}
    protected = [slot_of[p] for p in (0, 1, 38, 39)]  # the first two and the last two positions
    v[:, :, protected] = 0  # the lowest scores
    assert fn(q, k, v, pos, per_head=per_head)[1].tolist() == [[min(protected)] * 2]
    v[:, :, slot_of[37]] = 0.5  # the lowest among the rest, just outside the window
    assert fn(q, k, v, pos, per_head=per_head, n_sink=2, window=2)[1].tolist() == [[slot_of[37]] * 2]
    v[:, :, slot_of[2]] = 0.25  # lower still, just after the sinks
    assert fn(q, k, v, pos, per_head=per_head, n_sink=2, window=2)[1].tolist() == [[slot_of[2]] * 2]


@BOTH
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("n_sink, window, guarded", [(2, 0, (0, 1)), (0, 2, (38, 39))],
                         ids=["sinks_alone", "window_alone"])
def test_sinks_alone_or_a_window_alone_are_protected(fn, per_head, n_sink, window, guarded):
    """H2O has a window and no sinks, a user may give sinks and no window: either alone protects."""
    q, k, v, pos = hand_made()
    slot_of = {p: int((pos[0, 0] == p).nonzero()) for p in range(40)}
    v[:, :, [slot_of[p] for p in guarded]] = 0  # the lowest scores, but protected
    v[:, :, slot_of[20]] = 0.5  # the lowest among the rest
    assert fn(q, k, v, pos, per_head=per_head, n_sink=n_sink, window=window)[1].tolist() == [[slot_of[20]] * 2]


@pytest.fixture(params=["split", "no_split"])
def chunked(request, monkeypatch):
    """Score 16 slots per program (so 100 slots make 7 chunks, the last one of 4), with the slots split
    across attention programs or not."""
    monkeypatch.setattr(kernel, "_chunk_size", lambda *_: 16)
    if request.param == "no_split":
        monkeypatch.setattr(kernel, "_split_count", lambda *_: 1)


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_winner_in_the_last_chunk(chunked, per_head):
    q, k, v, pos = hand_made(S=100)
    v[:, :, 98] = 0.5
    v[:, 1, 97] = 0.25  # KV head 1 alone prefers slot 97; over the layer, 98 (0.5) beats 97 (0.625)
    want = [[98, 97]] if per_head else [[98, 98]]
    assert kernel.decode_attention(q, k, v, pos, per_head=per_head)[1].tolist() == want
    assert kernel.decode_attention_ref(q, k, v, pos, per_head=per_head)[1].tolist() == want


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_tie_across_chunks_goes_to_the_lowest_slot(chunked, per_head):
    q, k, v, pos = hand_made(S=100)
    v[:, :, [83, 20, 50]] = 0.5  # chunks 5, 1 and 3 tie (bit for bit: the same values in every head)
    v[:, 1, [90, 40]] = 0.25  # KV head 1 only: chunks 5 and 2 tie; over the layer they score 0.625
    want = [[20, 40]] if per_head else [[20, 20]]
    assert kernel.decode_attention(q, k, v, pos, per_head=per_head)[1].tolist() == want
    assert kernel.decode_attention_ref(q, k, v, pos, per_head=per_head)[1].tolist() == want


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
@pytest.mark.parametrize("full", [99, 0])
def test_all_empty_but_one(chunked, per_head, full):
    q, k, v, pos = make_inputs(1, 8, 2, 100, 64, seed=3)
    pos[:] = -1
    pos[:, :, full] = 5
    got, want = kernel.decode_attention(q, k, v, pos, per_head=per_head), \
        kernel.decode_attention_ref(q, k, v, pos, per_head=per_head)
    assert_same(got, want)
    assert got[1].tolist() == [[1 if full == 0 else 0] * 2]  # the first empty slot
    torch.testing.assert_close(got[0], v[:, :, full].repeat_interleave(4, 1))  # attends to the one full slot


@UPDATES
@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_accumulated_scores_over_chunks(chunked, per_head, scoring):
    """Several chunks, 3 KV heads (padded to 4 rows), sink and window, and a state far below zero, so every
    score compared stays negative (negative floats must order correctly in the packed keys)."""
    _, k, v, pos = make_inputs(2, 6, 3, 100, 64, n_empty=3, seed=4)
    state_triton = -(1 + torch.rand(2, 3, 100, generator=torch.Generator().manual_seed(5)).to(DEVICE)) * 10
    state_ref = state_triton.clone()
    for step in range(2):
        q = make_inputs(2, 6, 3, 100, 64, seed=20 + step)[0]
        options = dict(per_head=per_head, n_sink=3, window=4)
        assert_same(kernel.decode_attention(q, k, v, pos, scoring=scoring, state=state_triton, **options),
                    kernel.decode_attention_ref(q, k, v, pos, scoring=scoring, state=state_ref, **options))
        torch.testing.assert_close(state_triton, state_ref, atol=1e-6, rtol=1e-5)
    assert state_ref.max() < 0  # still negative after both steps


# ---- a given query (TriAttention): each key scored against it, z-scored per head, the group's maximum ----
GIVEN = kernel.Scoring(query="given")


def given_inputs(B, H_q, D, seed=6):
    """A given query [B, H_q, D] and pair weights [H_q, D/2] (TriAttention's: a mean magnitude above the magnitude
    of the mean, so positive)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H_q, D, generator=g).to(DEVICE), torch.rand(H_q, D // 2, generator=g).to(DEVICE)


@pytest.mark.parametrize("B, H_q, H_kv, D, S, n_sink, window", [
    (2, 8, 2, 64, 100, 0, 8),  # a group of 4, a window
    (1, 8, 1, 128, 333, 4, 30),  # a group of 8, split across programs, sinks too
    (2, 6, 2, 128, 70, 0, 0),  # 3:1 (padded)
    (4, 16, 4, 32, 60, 2, 10),  # 16 decisions of groups of 4
    (2, 4, 2, 16, 50, 0, 4),  # head_dim 16 (the tests' tiny models): pairs padded to the 16 a product takes
])
def test_kernel_scores_by_a_given_query_as_the_reference(B, H_q, H_kv, D, S, n_sink, window, monkeypatch):
    """fp32 through the interpreter, every slot full (so the scores decide): the same slot in every row and KV
    head (the z-scores' mean and spread merged chunk by chunk in the kernel, here chunks of 16 slots, summed at
    once in the reference), the same attention output; with a zero given query, the magnitudes alone decide."""
    monkeypatch.setattr(kernel, "GIVEN_CHUNK", 16)
    args = make_inputs(B, H_q, H_kv, S, D)
    given_query, pair_weight = given_inputs(B, H_q, D)
    for given_query in (given_query, torch.zeros_like(given_query)):
        options = dict(per_head=True, n_sink=n_sink, window=window, scoring=GIVEN, given_query=given_query,
                       pair_weight=pair_weight)
        assert_same(kernel.decode_attention(*args, **options), kernel.decode_attention_ref(*args, **options))


def test_a_given_query_skips_what_empty_slots_hold(monkeypatch):
    """Empty slots holding an earlier sequence's keys, far out (not zeros): the held slots' mean and spread
    leave them out, before and after some of them are filled (with the newest position), as the reference."""
    monkeypatch.setattr(kernel, "GIVEN_CHUNK", 16)
    q, k, v, pos = make_inputs(2, 8, 2, 100, 64, n_empty=6, seed=12)
    k[pos < 0] = torch.randn_like(k[pos < 0]) * 30  # stale keys, far out
    given_query, pair_weight = given_inputs(2, 8, 64)
    options = dict(per_head=True, window=8, scoring=GIVEN, given_query=given_query, pair_weight=pair_weight)
    assert_same(kernel.decode_attention(q, k, v, pos, **options), kernel.decode_attention_ref(q, k, v, pos, **options))
    pos[..., :50][pos[..., :50] < 0] = 300  # some empty slots filled: the rest stay empty and stale
    assert_same(kernel.decode_attention(q, k, v, pos, **options), kernel.decode_attention_ref(q, k, v, pos, **options))


def test_a_given_query_scores_keys_not_attention(monkeypatch):
    """The slot evicted is given_score's lowest, whatever the current query: a key opposite the given query in
    every head of the group goes; a key along it stays even when the current query ignores it. Chunks of 16
    slots: the spread is merged across seven."""
    monkeypatch.setattr(kernel, "GIVEN_CHUNK", 16)
    q, k, v, pos = make_inputs(1, 4, 1, 100, 32, seed=8)
    given_query, pair_weight = given_inputs(1, 4, 32)
    k[0, 0, 61] = -given_query[0].sum(0) * 2  # opposite the group's given query
    options = dict(per_head=True, scoring=GIVEN, given_query=given_query, pair_weight=torch.zeros_like(pair_weight))
    for fn in (kernel.decode_attention, kernel.decode_attention_ref):
        assert fn(q, k, v, pos, **options)[1].tolist() == [[61]]
        assert fn(-q, k, v, pos, **options)[1].tolist() == [[61]]  # the current query does not enter


@pytest.mark.parametrize("B", [1, 4])
def test_the_z_scores_spread_is_the_rows_when_each_chunk_is_far_from_it(B, monkeypatch):
    """Two query heads, one scoring keys along a ramp over the slots (each chunk of 16 far from the row's mean
    and spread), the other at random: the group's maximum of z-scores weighs them evenly only with the row's
    mean and spread, which the kernel merges from its chunks'."""
    monkeypatch.setattr(kernel, "GIVEN_CHUNK", 16)
    q, k, v, pos = make_inputs(B, 2, 1, 100, 32, seed=11)
    k[:, 0, :, 0] = torch.linspace(-1, 1, 100, device=DEVICE)  # head 0's raw score: a ramp
    given_query = torch.zeros(B, 2, 32, device=DEVICE)
    given_query[:, 0, 0], given_query[:, 1, 1] = 1.0, 1.0
    options = dict(per_head=True, scoring=GIVEN, given_query=given_query, pair_weight=torch.zeros(2, 16, device=DEVICE))
    assert_same(kernel.decode_attention(q, k, v, pos, **options), kernel.decode_attention_ref(q, k, v, pos, **options))


def test_the_pair_weights_score_the_pairs_magnitudes():
    """With a zero given query only sum_f w_f |k_f| is left: the key of the smallest pairs (k[f], k[f + D/2])
    goes, here one made short in both halves of the pairs the weights count (w 0 elsewhere), not one short in
    their first halves alone, in the kernel and the reference alike."""
    q, k, v, pos = make_inputs(1, 4, 2, 50, 32, seed=9)
    pair_weight = torch.zeros(4, 16, device=DEVICE)
    pair_weight[:, :4] = 1.0
    k[0, 1, 12, [0, 1, 2, 3]], k[0, 1, 12, [16, 17, 18, 19]] = 1e-3, 3.0  # short first halves only
    k[0, 1, 17, [0, 1, 2, 3, 16, 17, 18, 19]] = 1e-3  # both halves of pairs 0-3
    options = dict(per_head=True, scoring=GIVEN, given_query=torch.zeros(1, 4, 32, device=DEVICE),
                   pair_weight=pair_weight)
    for fn in (kernel.decode_attention, kernel.decode_attention_ref):
        assert fn(q, k, v, pos, **options)[1][0, 1].item() == 17


def test_fp8_kernel_scores_by_a_given_query_as_the_reference():
    """An FP8 cache: the keys' e4m3 bits scored, then times their scales (both terms scale with the key)."""
    q, k, v, pos = make_inputs(2, 8, 2, 200, 64, seed=10)
    k = k * torch.linspace(0.1, 10, 200, device=DEVICE)[:, None]  # scales that differ from slot to slot
    (kb, ks), (vb, vs) = kernel.quantize(k), kernel.quantize(v)
    given_query, pair_weight = given_inputs(2, 8, 64)
    options = dict(per_head=True, n_sink=2, window=8, scoring=GIVEN, given_query=given_query,
                   pair_weight=pair_weight, k_scale=ks, v_scale=vs)
    assert_same(kernel.decode_attention(q, kb, vb, pos, **options),
                kernel.decode_attention_ref(q, kb, vb, pos, **options))


@BOTH
def test_a_given_query_is_for_its_scoring_alone_decides_per_head_and_is_the_query_heads(fn):
    q, k, v, pos = make_inputs(1, 4, 2, 40, 32)
    given_query, pair_weight = given_inputs(1, 4, 32)
    with pytest.raises(ValueError, match="takes given_query and pair_weight, and only it"):
        fn(q, k, v, pos, per_head=True, scoring=GIVEN)
    for stray in (dict(given_query=given_query, pair_weight=pair_weight), dict(given_query=given_query)):
        with pytest.raises(ValueError, match="takes given_query and pair_weight, and only it"):
            fn(q, k, v, pos, per_head=True, **stray)
    with pytest.raises(ValueError, match="decides per KV head"):
        fn(q, k, v, pos, scoring=GIVEN, given_query=given_query, pair_weight=pair_weight)
    whole_model = torch.cat([torch.rand_like(pair_weight), pair_weight])  # [8, 16]: another rank's heads too
    for query, weight in ((given_query, whole_model), (given_query[:, :2], pair_weight)):
        with pytest.raises(ValueError, match=r"a given query is \[B, H_q, D\] = \[1, 4, 32\] and its pair weights"):
            fn(q, k, v, pos, per_head=True, scoring=GIVEN, given_query=query, pair_weight=weight)
    with pytest.raises(ValueError, match="a given one takes no value norm and no update"):
        kernel.Scoring(value_norm=True, query="given")


@gpu_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("B, S", [(1, 3200), (64, 1000)])  # Qwen3-8B heads
def test_bf16_given_query_scores_within_tolerance(B, S, fp8):
    """bf16 keys meet the given query in bf16 (an FP8 cache's in fp16), as the logits do: near-tied z-scores may
    swap, so the chosen slot's fp32 z-score is the lowest to within 0.05 (z is in standard deviations)."""
    q, k, v, pos = make_inputs(B, 32, 8, S, 128, dtype=torch.bfloat16)
    given_query, pair_weight = given_inputs(B, 32, 128)
    options = dict(per_head=True, window=64, scoring=GIVEN, given_query=given_query, pair_weight=pair_weight)
    if fp8:
        (k, ks), (v, vs) = kernel.quantize(k), kernel.quantize(v)
        options |= dict(k_scale=ks, v_scale=vs)
    out, evict = kernel.decode_attention(q, k, v, pos, **options)
    want_out, _ = kernel.decode_attention_ref(q, k, v, pos, **options)
    torch.testing.assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    protected = kernel.protected_mask(pos, 0, 64)
    keys = kernel.dequantize(k, ks) if fp8 else k  # the values the cache holds
    z = kernel.given_score(keys, pos, given_query, pair_weight, protected).masked_fill(protected, math.inf)
    assert not protected.gather(-1, evict[..., None]).any()
    assert (z.gather(-1, evict[..., None])[..., 0] <= z.amin(-1) + 0.05).all()


# torch.compile hands a user kernel's float arguments to Triton as fp64 and its ints possibly as int64; the
# Triton frontend then rejects a loop whose carried values change type (fp32 * fp64 -> fp64). The frontend
# needs no GPU but cannot run under the interpreter, hence a fresh process.
FRONTEND = textwrap.dedent("""
    import torch
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    torch.cuda.is_available = lambda: True  # kernel registers its op where the kernels can launch: as on a GPU
    import kernel

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    POINTEE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}

    def inductor_type(x):
        if isinstance(x, torch.Tensor):
            return "*" + POINTEE[x.dtype]
        return "i1" if isinstance(x, bool) else "fp64" if isinstance(x, float) else "i64"

    class Frontend:  # stands in for wrap_triton: builds each launched kernel's IR instead of running it
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, num_warps=4, num_stages=3, **constexprs):
                names = self.fn.arg_names
                types = {n: inductor_type(a) for n, a in zip(names, args)}
                types.update(dict.fromkeys(constexprs, "constexpr"))
                consts = {(names.index(n),): c for n, c in constexprs.items()}
                codegen, modules = backend.get_codegen_implementation(options), backend.get_module_map()
                ASTSource(self.fn, types, consts).make_ir(target, options, codegen, modules, context)
                print(self.fn.__name__)
            return launch

    torch.library.wrap_triton = Frontend
    q, k, v = torch.zeros(1, 8, 64), torch.zeros(1, 2, 300, 64), torch.zeros(1, 2, 300, 64)
    pos, state = torch.zeros(1, 2, 300), torch.zeros(1, 2, 300)
    split_count = kernel._split_count
    SUM, EMA = kernel.Scoring(update="sum"), kernel.Scoring(value_norm=True, update="ema", decay=0.9)
    for kw in [{}, dict(per_head=True, n_sink=2, window=3, scoring=SUM, state=state),
               dict(n_sink=2, scoring=SUM, state=state), dict(per_head=True, scoring=EMA, state=state),
               dict(select=False), dict(per_head=True, scoring=kernel.Scoring()), dict(vnorm=state),
               dict(per_head=True, window=3, scoring=kernel.Scoring(query="given"), given_query=q,
                    pair_weight=torch.zeros(8, 32))]:
        for kernel._split_count in (split_count, lambda *_: 1):
            kernel.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos.int(), **kw)
    # head_dim 16 (the tests' tiny models) by a given query: pairs of 8, padded to the 16 a product takes
    kernel.decode_attention(q[..., :16].bfloat16(), k[..., :16].bfloat16(), v[..., :16].bfloat16(), pos.int(),
                            per_head=True, scoring=kernel.Scoring(query="given"), given_query=q[..., :16],
                            pair_weight=torch.zeros(8, 8))
""")


@pytest.mark.skipif(CUDA, reason="on a GPU test_compiles_with_fullgraph_and_updates_the_state compiles for real")
def test_kernels_pass_the_triton_frontend_with_torch_compile_argument_types():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.path.dirname(os.path.abspath(kernel.__file__)))
    run = subprocess.run([sys.executable, "-c", FRONTEND], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split().count("_attend_kernel") == 17 and run.stdout.split().count("_finish_kernel") == 16


@pytest.mark.skipif(CUDA, reason="where CUDA is, the kernels can launch")
def test_where_the_kernels_cannot_launch_importing_them_costs_no_compiler_and_a_call_names_the_reference():
    """Without CUDA or Triton's interpreter the op is not registered: registering imports torch's compiler,
    1.5 s of the start of every command line on a CPU. A call then says what to use instead."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, torch, kernel; assert 'torch._inductor' not in sys.modules, 'the compiler was imported'\n"
            "kernel.decode_attention(*[torch.zeros(1, 1, 1, 4)] * 3, torch.zeros(1, 1, 1, dtype=torch.int32))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(kernel.__file__)))
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        "RuntimeError: the Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before kernel is "
        "imported; on this machine call kernel.decode_attention_ref (same arguments)"), run.stderr[-2000:]


@gpu_only
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("B, S", [(1, 3200), (64, 1000), (256, 3200)])  # Qwen3-8B heads
def test_bf16_matches_reference_within_tolerance(B, S, per_head):
    q, k, v, pos = make_inputs(B, 32, 8, S, 128, n_empty=0, dtype=torch.bfloat16)
    out, evict = kernel.decode_attention(q, k, v, pos, per_head=per_head)
    want_out, _ = kernel.decode_attention_ref(q, k, v, pos, per_head=per_head)
    torch.testing.assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    # bf16 logits round differently, so near-tied slots may swap: the chosen slot's score must be minimal
    # within a tolerance, judged by the same formula in fp32 on the same inputs.
    logits = q.float().view(B, 8, 4, 128) @ k.float().transpose(-1, -2) / math.sqrt(128)
    score = logits.softmax(-1) * v.float().abs().sum(-1)[:, :, None]  # [B, H_kv, G, S]
    score = score.mean(2) if per_head else score.mean((1, 2))[:, None].expand(B, 8, S)
    chosen = score.gather(-1, evict[..., None])[..., 0]
    assert (chosen <= score.amin(-1) * 1.02 + 1e-6).all()


@gpu_only
@UPDATES
def test_compiles_with_fullgraph_and_updates_the_state(scoring):
    q, k, v, pos = make_inputs(2, 8, 2, 300, 128, n_empty=5)
    step = torch.compile(lambda q, state: kernel.decode_attention(q, k, v, pos, scoring=scoring, state=state),
                         fullgraph=True)
    state, state_ref = torch.ones(2, 2, 300, device=DEVICE), torch.ones(2, 2, 300, device=DEVICE)
    assert_same(step(q, state), kernel.decode_attention_ref(q, k, v, pos, scoring=scoring, state=state_ref))
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize("B, S", [(1, 300), (3, 70)])  # split and not split
def test_limit_reads_only_the_filled_prefix(B, S):
    """A cache that fills in order passes limit = filled slots: the result equals the same cache with
    everything from the limit on marked empty, even though those slots hold data (here: huge values)."""
    q, k, v, pos = make_inputs(B, 8, 2, S, 64)
    limit = torch.randint(1, S + 1, (B, 1), device=DEVICE).expand(B, 2).contiguous()
    beyond = torch.arange(S, device=DEVICE) >= limit[..., None]  # [B, H_kv, S]
    v = v.masked_fill(beyond[..., None], 1e4)
    want = kernel.decode_attention_ref(q, k, v, pos.masked_fill(beyond, -1), select=False)
    assert_same(kernel.decode_attention(q, k, v, pos, select=False, limit=limit), want)
    assert_same(kernel.decode_attention_ref(q, k, v, pos, select=False, limit=limit), want)


# ---- an FP8 cache: e4m3 bits and a scale per slot -----------------------------------------------------
def test_fp8_round_trip_is_within_e4m3_rounding():
    """e4m3 keeps 3 mantissa bits: a value rounds to within 2^-4 of itself, and below e4m3's smallest
    normal (2^-6 of the scale's 448) to within half its subnormal step (2^-10 of the scale)."""
    x = torch.randn(3, 5, 64) * torch.logspace(-4, 2, 64)  # magnitudes over six decades in each vector
    bits, scale = kernel.quantize(x)
    assert bits.dtype == torch.uint8 and scale.shape == (3, 5)
    err = (kernel.dequantize(bits, scale) - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    # the largest |value| of each vector maps to 448 exactly: no saturation, nothing wasted
    assert torch.equal(bits.view(kernel.FP8).float().abs().amax(-1), torch.full((3, 5), 448.0))


def fp8_inputs(*shape, n_empty=0, seed=0, dtype=torch.float32):
    """make_inputs with K and V quantized: (q, k bits, v bits, pos), and the scales."""
    q, k, v, pos = make_inputs(*shape, n_empty=n_empty, seed=seed, dtype=dtype)
    (k, k_scale), (v, v_scale) = kernel.quantize(k), kernel.quantize(v)
    return (q, k, v, pos), dict(k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
@pytest.mark.parametrize("B, H_q, H_kv, D, S, n_empty", [
    (2, 8, 2, 64, 100, 5), (1, 8, 1, 128, 333, 20), (1, 6, 2, 128, 70, 69)])
def test_fp8_kernel_matches_reference(B, H_q, H_kv, D, S, n_empty, per_head):
    args, scales = fp8_inputs(B, H_q, H_kv, S, D, n_empty=n_empty)
    vnorm = kernel.l1_norm(kernel.dequantize(args[2], scales["v_scale"]))
    for options in (dict(), dict(vnorm=vnorm), dict(n_sink=4, window=8), dict(scoring=kernel.Scoring()),
                    dict(select=False)):
        assert_same(kernel.decode_attention(*args, per_head=per_head, **scales, **options),
                    kernel.decode_attention_ref(*args, per_head=per_head, **scales, **options))


def test_fp8_reference_attends_the_values_the_cache_holds():
    (q, k, v, pos), scales = fp8_inputs(2, 8, 2, 50, 64, n_empty=3)
    held = kernel.dequantize(k, scales["k_scale"]), kernel.dequantize(v, scales["v_scale"])
    out, evict = kernel.decode_attention_ref(q, k, v, pos, **scales)
    want_out, score = direct_scores(q, *held, pos, per_head=False)
    torch.testing.assert_close(out.cpu().double(), want_out, atol=1e-5, rtol=1e-5)
    empty = (pos < 0).cpu().any(1, keepdim=True)
    assert torch.equal(evict.cpu(), torch.where(empty.any(-1), empty.int().argmax(-1), score.argmin(-1)).expand(2, 2))


def test_a_v_top_that_bounds_no_fp8_scales_of_its_shape_is_refused():
    args, scales = fp8_inputs(2, 8, 2, 40, 64)
    for v_top, given in ((torch.ones(2, 2, 1, device=DEVICE), scales), (torch.ones(2, 2, device=DEVICE), {})):
        with pytest.raises(ValueError, match=r"v_top bounds an FP8 cache's value scales: \[B, H_kv\]"):
            kernel.decode_attention(*(args if given else make_inputs(2, 8, 2, 40, 64)), **given, v_top=v_top)


@pytest.mark.parametrize("split", [True, False], ids=["split", "one_program_per_head"])
@pytest.mark.parametrize("size, spread, stale", [(1.0, 1, 1), (0.002, 1, 1), (1e8, 1, 1), (1.0, 1e6, 1),
                                                 (1.0, 1, 1e3), (1.0, 1e3, 1e3)])
# size, the largest |v|: small values make small weights, large ones weights past fp16's range (65504) unless
# the kernel scales them down; spread: the ratio between a row's largest and smallest value vectors; stale: how
# far above the row's largest scale its v_top is (the cache's, once the token that held it has left)
def test_fp8_kernel_with_16_bit_queries_keeps_its_precision_whatever_the_size_of_v(size, spread, stale, split,
                                                                                   monkeypatch):
    """With bf16 queries the kernel multiplies in fp16 (the GPU's path; the interpreter runs it too): its
    error against the reference stays that of bf16 outputs, also when V is small and every weight
    e_i * scale_i would be an fp16 subnormal, or past fp16's largest value, and when a row's value scales
    spread over six decades (the kernel divides the weights by each row's v_top), or its v_top is 1,000 times
    their largest. The two rows and two KV heads hold values 1e5 apart, so a row divided by another's largest
    scale overflows or underflows."""
    if not split:  # as at a large batch: one program per KV head, no partials to merge
        monkeypatch.setattr(kernel, "_split_count", lambda *_: 1)
    q, k, v, pos = make_inputs(2, 8, 2, 320, 64)  # 320 slots: several blocks per split, and a partial one
    g = torch.Generator().manual_seed(0)
    sizes = torch.logspace(-math.log10(spread), 0, 320)[torch.randperm(320, generator=g)]  # [S]
    apart = torch.tensor([[1.0, 1e5], [1e-5, 1.0]])[:, :, None, None]  # [B, H_kv, 1, 1]
    (k, k_scale), (v, v_scale) = kernel.quantize(k), kernel.quantize(v * (size * apart * sizes[:, None]).to(DEVICE))
    args, scales = (q.bfloat16(), k, v, pos), dict(k_scale=k_scale, v_scale=v_scale)
    out, evict = kernel.decode_attention(*args, **scales, v_top=v_scale.amax(-1) * stale)
    want, want_evict = kernel.decode_attention_ref(*args, **scales)
    # the reference's own bf16 output rounding is ~2.2e-3 (relative to fp32); the kernel's fp16 products
    # in the interpreter add up to ~2e-3 more. Each KV head's group apart: their sizes differ by 1e5
    err = (out.float() - want.float()).view(2, 2, 4, 64).norm(dim=(2, 3)) / want.float().view(2, 2, 4, 64).norm(dim=(2, 3))
    assert (err < 5e-3).all(), err
    assert torch.equal(evict, want_evict)


@gpu_only
@pytest.mark.parametrize("B, S", [(1, 3200), (64, 3200), (256, 3200)])  # Qwen3-8B heads
def test_fp8_kernel_with_bf16_queries_matches_reference_within_tolerance(B, S):
    (q, k, v, pos), scales = fp8_inputs(B, 32, 8, S, 128, dtype=torch.bfloat16)
    out, evict = kernel.decode_attention(q, k, v, pos, **scales)
    want, _ = kernel.decode_attention_ref(q, k, v, pos, **scales)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)  # bf16 logits and weights, as without FP8
    # near-tied slots may swap under bf16 rounding: the chosen slot's score must be minimal within a
    # tolerance, judged by the formula in fp32 on the values the cache holds
    keys, values = kernel.dequantize(k, scales["k_scale"]), kernel.dequantize(v, scales["v_scale"])
    logits = q.float().view(B, 8, 4, 128) @ keys.transpose(-1, -2) / math.sqrt(128)
    score = (logits.softmax(-1) * values.abs().sum(-1)[:, :, None]).mean((1, 2))  # [B, S]
    chosen = score.gather(-1, evict[:, :1])[:, 0]
    assert (chosen <= score.amin(-1) * 1.02 + 1e-6).all()


def test_what_the_kernels_cannot_run_is_refused_before_decoding(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match="needs a head_dim that is a power of two, and this model's is 96"):
        kernel.check_support(cuda, 96)
    with pytest.raises(ValueError, match="FP8 KV cache needs compute capability 8.9 or newer .* A100 is 8.0"):
        kernel.check_support(cuda, 128, kernel.FP8)
    kernel.check_support(cuda, 128)  # bf16 on an A100: fine
    kernel.check_support(torch.device("cpu"), 96, kernel.FP8)  # the CPU decodes without the kernels
    monkeypatch.setattr(kernel, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="Triton is not installed: pip install triton"):
        kernel.check_support(cuda, 128)
