"""LLM.score: teacher-forced log-probabilities through the decode step, on tiny random checkpoints.

With the full cache they are transformers' log_softmax on prompt + continuation (float32; both sides run
the same math in another order, so they agree to rounding, 1e-4 with margin). With a small budget they are
those of a LongFlow cache written out by hand below from the paper's rule."""
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

import tinyflow
from model import rotate

TEXTS = [("The quick brown fox", " jumps over the lazy dog. Hello world, hello tinyflow!"),
         ("Hello", " world, what is 2 + 3? The answer is 5."),
         ("Please reason step by step.", " The quick brown fox jumps over the lazy dog."),
         ("What is", " 2 + 3?")]


def transformers_logprobs(folder, prompt, continuation):
    """log p of each continuation token and the argmax there, from one causal forward pass."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([prompt + continuation])).logits[0].log_softmax(-1)[len(prompt) - 1:-1]
    return logp.gather(1, torch.tensor(continuation)[:, None])[:, 0], logp.argmax(-1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_full_cache_logprobs_are_transformers_log_softmax(checkpoints, arch):
    llm = tinyflow.LLM(str(checkpoints[arch]), device="cpu", compile=False)
    pairs = [(llm.tokenizer.encode(p), llm.tokenizer.encode(c)) for p, c in TEXTS]
    # two rows for four pairs of different lengths: rows are refilled as pairs finish
    scores = llm.score([p for p, _ in pairs], [c for _, c in pairs], batch_size=2)
    assert llm.stats.batch == 2
    for (prompt, cont), s in zip(pairs, scores):
        logprobs, argmax = transformers_logprobs(checkpoints[arch], prompt, cont)
        assert s.token_ids == cont and len(s.logprobs) == len(s.argmax) == len(cont)
        torch.testing.assert_close(torch.tensor(s.logprobs), logprobs, atol=1e-4, rtol=0)
        assert s.argmax == argmax.tolist()


def test_strings_and_token_ids_score_the_same(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    prompt, cont = TEXTS[0]
    by_text = llm.score([prompt], [cont])
    assert by_text == llm.score([llm.tokenizer.encode(prompt)], [llm.tokenizer.encode(cont)])


def test_a_budget_that_holds_everything_scores_exactly_as_the_full_cache(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    prompts, conts = [p for p, _ in TEXTS], [c for _, c in TEXTS]
    full = llm.score(prompts, conts)
    llm.set_policy(64, "longflow")
    assert llm.score(prompts, conts) == full


@pytest.mark.parametrize("prompt_rule", ["snapkv", "streaming"])
def test_scoring_a_greedy_generation_finds_each_token_was_the_argmax(checkpoints, prompt_rule):
    """Teacher forcing evicts exactly as generation does: fed its own greedy output under the same small
    budget, the step's argmax is that output at every position; also after a prompt longer than the
    budget, compressed by either rule."""
    llm = tinyflow.LLM(str(checkpoints["llama"]), budget=40, device="cpu", compile=False,
                       prompt_compression=prompt_rule)
    prompts = [llm.tokenizer.encode(p) for p, _ in TEXTS]
    prompts.append(llm.tokenizer.encode(" ".join(c for _, c in TEXTS)))  # longer than the 40 slots
    assert len(prompts[-1]) > 40
    outs = llm.generate(prompts, max_new_tokens=90)  # 90 > 40 slots: evicting for most of the run
    scores = llm.score(prompts, [o.token_ids for o in outs], batch_size=3)
    for o, s in zip(outs, scores):
        assert s.argmax == o.token_ids


def test_a_one_token_continuation_is_scored_from_the_prompt_alone(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False)
    prompt, cont = llm.tokenizer.encode(TEXTS[0][0]), llm.tokenizer.encode(TEXTS[0][1])
    one, many = llm.score([prompt, prompt], [cont[:1], cont])
    assert one.token_ids == cont[:1] and one.logprobs == many.logprobs[:1] and one.argmax == many.argmax[:1]


def longflow_by_hand(model, prompt: list[int], continuation: list[int], budget: int) -> list[float]:
    """Teacher-forced log p with a LongFlow cache in plain Python: per layer a list of `budget` slots; each
    token (the prompt fits, so it is fed one token at a time too) goes into the slot chosen at the step
    before; attention over the filled slots; score_i = mean over all query heads of alpha_i * ||v_i||_1;
    the next token goes into the lowest empty slot, else the lowest-scoring one (the new token included)."""
    cfg, layers = model.cfg, model.model.layers
    G, D = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    slots = [[None] * budget for _ in layers]  # per layer: (k [H_kv, D], v [H_kv, D]) or None
    target = [0] * len(layers)
    head = model.model.embed_tokens.weight
    tokens, logprobs = prompt + continuation, []
    for t, token in enumerate(tokens[:-1]):
        angle = t * model.inv_freq
        cos, sin = torch.cat((angle, angle)).cos(), torch.cat((angle, angle)).sin()
        x = model.model.embed_tokens.weight[token]  # [hidden]
        for i, block in enumerate(layers):
            attn = block.self_attn
            q, k, v = (y.view(-1, D) for y in attn.qkv_proj(block.input_layernorm(x)).split(attn.sizes))
            if cfg.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [H, D]
            slots[i][target[i]] = (k, v)
            filled = [j for j, s in enumerate(slots[i]) if s is not None]
            K = torch.stack([slots[i][j][0] for j in filled], 1)  # [H_kv, n, D]
            V = torch.stack([slots[i][j][1] for j in filled], 1)
            alpha = (q.view(cfg.n_kv_heads, G, D) @ K.transpose(1, 2) / math.sqrt(D)).softmax(-1)  # [H_kv, G, n]
            score = (alpha * V.abs().sum(-1)[:, None, :]).mean((0, 1))  # [n]
            empty = [j for j, s in enumerate(slots[i]) if s is None]
            target[i] = empty[0] if empty else filled[int(score.argmin())]
            x = x + attn.o_proj((alpha @ V).reshape(-1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        if t >= len(prompt) - 1:
            logits = F.linear(model.model.norm(x), head if cfg.tie_embeddings else model.lm_head.weight)
            logprobs.append(logits.log_softmax(-1)[tokens[t + 1]].item())
    return logprobs


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_small_budget_logprobs_equal_a_longflow_cache_written_by_hand(checkpoints, arch):
    llm = tinyflow.LLM(str(checkpoints[arch]), budget=36, device="cpu", compile=False)
    prompt, cont = llm.tokenizer.encode(TEXTS[1][0]), llm.tokenizer.encode(" ".join(c for _, c in TEXTS) * 2)
    assert len(prompt) < 36 < len(prompt) + len(cont) - 30  # the prompt fits; the continuation evicts
    with torch.no_grad():
        expected = longflow_by_hand(llm.model, prompt, cont, budget=36)
    full = tinyflow.LLM(str(checkpoints[arch]), device="cpu", compile=False).score([prompt], [cont])[0]
    got = llm.score([prompt], [cont])[0]
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    assert got.logprobs != full.logprobs  # eviction changed something


def test_bad_score_requests_are_clear_errors(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    with pytest.raises(ValueError, match="one continuation per prompt: 2 prompts, 1 continuation$"):
        llm.score(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="empty continuation"):
        llm.score(["a"], [[]])
    with pytest.raises(ValueError, match="continuation token ids must be integers in"):
        llm.score(["a"], [[1, 10**6]])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.score([[]], ["b"])
    with pytest.raises(TypeError, match="continuations must be a list"):
        llm.score(["a"], "b")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_compiled_scoring_step_matches_eager_and_never_recompiles(checkpoints, device):
    """The scoring step compiled (and on the GPU replayed as a CUDA graph): the same records as run eagerly
    (greedy argmax exactly; log-probabilities to float32 rounding, as the compiler fuses the log-softmax),
    and other continuations, of other lengths, reuse the compiled step."""
    from torch._dynamo.utils import counters
    # Qwen3 at budget 36 on two rows: the layer's shapes of test_generate's compiled step, whose code the compiler
    # then finds in its on-disk cache
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), budget=36, device=device, dtype="float32", compile=False)
    prompts = [llm.tokenizer.encode(p) for p, _ in TEXTS[:2]]
    conts = [llm.tokenizer.encode(TEXTS[2][1] * 3)[:60], llm.tokenizer.encode(TEXTS[0][1] * 3)[:60]]
    eager = llm.score(prompts, conts)
    torch._dynamo.reset()
    counters.clear()
    others = [conts[1][:45], conts[0][:50]]  # other tokens, other lengths: the same continuation buffer
    eager_others = llm.score(prompts[::-1], others)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = tinyflow.LLM(str(checkpoints["qwen3"]), budget=36, device=device, dtype="float32")
        first = compiled.score(prompts, conts)
        again = compiled.score(prompts[::-1], others)
    # one compiled layer for both layers, plus the forcing: each for batch 1 and for the larger sizes (here 2)
    assert counters["stats"]["unique_graphs"] == 4
    for got, want in zip(first + again, eager + eager_others):
        assert got.token_ids == want.token_ids and got.argmax == want.argmax
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def streaming_by_transformers(folder, prompt: list[int], continuation: list[int], budget: int, sinks: int = 4):
    """Teacher-forced log p under StreamingLLM, from transformers with its cache cut by hand: the prompt read
    whole, then each continuation token attending to the first `sinks` positions and the most recent ones, itself
    included, `budget` in all (the K/V of every token as it was computed when read, with the attention it had
    then)."""
    from transformers import DynamicCache
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logprobs = [out.logits[0, -1].log_softmax(-1)[continuation[0]].item()]
        cache, held = out.past_key_values, list(range(len(prompt)))  # the positions the cache holds
        for i, token in enumerate(continuation[:-1]):
            now = len(prompt) + i
            keep = [j for j, p in enumerate(held) if p < sinks or p > now - (budget - sinks)]
            cut = DynamicCache()
            for layer, kv in enumerate(cache.layers):
                cut.update(kv.keys[:, :, keep], kv.values[:, :, keep], layer)
            held = [held[j] for j in keep] + [now]
            out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[now]]), past_key_values=cut,
                     cache_position=torch.tensor([len(keep)]), use_cache=True)
            cache = out.past_key_values
            logprobs.append(out.logits[0, -1].log_softmax(-1)[continuation[i + 1]].item())
    return logprobs


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_streaming_scores_equal_transformers_with_its_cache_cut_to_sinks_and_recent_tokens(checkpoints, arch):
    """The streaming policy's choice, prompt compression included, against an independent reference: a prompt
    longer than the budget, compressed by StreamingLLM's own rule, then a continuation evicting the oldest
    token but the 4 sinks at every step. Any other choice of tokens changes the log-probabilities."""
    llm = tinyflow.LLM(str(checkpoints[arch]), budget=40, policy="streaming", prompt_compression="streaming",
                       device="cpu", compile=False)
    prompt = llm.tokenizer.encode(" ".join(c for _, c in TEXTS))
    cont = llm.tokenizer.encode(TEXTS[0][1] * 3)
    assert len(prompt) > 40 and len(cont) > 40  # the prompt is compressed; the continuation evicts all of it but the sinks
    got = llm.score([prompt], [cont])[0]
    expected = streaming_by_transformers(checkpoints[arch], prompt, cont, budget=40)
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    # a different cut (the sinks taken from the recent window) would be told apart
    other = streaming_by_transformers(checkpoints[arch], prompt, cont, budget=40, sinks=0)
    assert (torch.tensor(other) - torch.tensor(expected)).abs().max() > 1e-2
