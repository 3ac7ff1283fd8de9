"""The model against the oracle: tiny random Qwen3, Qwen2 and Llama checkpoints saved by transformers,
loaded by tinyflow, compared logit by logit and token by token (float32 on CPU).

Tolerance: both sides run the same float32 math in a different order (fused SDPA vs einsum, another
summation order in the matmuls), so logits agree to rounding, about 1e-5, not bit for bit."""
import json
import math

import pytest
import torch
import transformers

from cache import KVCache
from generate import Engine
import model as model_module
from model import Config, load

ARCHS = ["qwen3", "qwen2", "llama"]
ATOL = 2e-5


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def ours(folder):
    model, tok = load(str(folder), torch.device("cpu"), torch.float32)
    return model, tok


def prefill_logits(model, tokens, slots):
    """All-position logits of a batch of equal-length prompts through our prefill path."""
    B, T = tokens.shape
    cache = KVCache(model.cfg, B, slots, "cpu", torch.float32)
    positions = torch.arange(T).expand(B, T)
    return model(tokens, positions, cache, rows=torch.arange(B)), cache


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(checkpoints, arch):
    model, _ = ours(checkpoints[arch])
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    logits, _ = prefill_logits(model, tokens, slots=64)
    expected = hf_model(checkpoints[arch])(tokens).logits
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_long_prefill_runs_the_mlp_in_chunks_with_the_same_logits(checkpoints, monkeypatch):
    """Past model.MLP_TOKENS tokens, prefill splits the MLP (here 80 tokens in chunks of 7, the last one
    short); the logits still match transformers."""
    monkeypatch.setattr(model_module, "MLP_TOKENS", 7)
    calls = []
    model, _ = ours(checkpoints["qwen3"])
    model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(3))
    logits, _ = prefill_logits(model, tokens, slots=64)
    assert calls == [7] * 11 + [3]
    torch.testing.assert_close(logits, hf_model(checkpoints["qwen3"])(tokens).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_decode_step_matches_transformers(checkpoints, arch):
    """Prefill 10 tokens, then feed 30 more one at a time through the decode path (writing slots)."""
    model, _ = ours(checkpoints[arch])
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    expected = hf_model(checkpoints[arch])(tokens).logits  # [B, T, V]
    _, cache = prefill_logits(model, tokens[:, :10], slots=48)
    for t in range(10, 40):
        positions = torch.full((2, 1), t)
        logits = model(tokens[:, t:t + 1], positions, cache)
        torch.testing.assert_close(logits[:, 0], expected[:, t], atol=ATOL, rtol=0, msg=f"step {t}")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_of_different_lengths_matches_transformers_generate(checkpoints, arch):
    model, tok = ours(checkpoints[arch])
    hf = hf_model(checkpoints[arch])
    prompts = [tok.encode(t) for t in ("Hello world", "The quick brown fox jumps over the lazy dog.", "2 + 3")]
    outs, _ = Engine(model, compile=False).generate(prompts, 24, tok.eos_ids, budget=None)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=tok.eos_ids, pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()


def test_the_tiny_llamas_wavelengths_fall_in_every_regime_of_llama3_scaling(checkpoints):
    """The logits tests above check the llama3 frequencies only where the checkpoint's wavelengths fall: kept
    (shorter than original_max / high_freq_factor), divided by the factor (longer than original_max /
    low_freq_factor), and the band between, where they are blended. Each regime holds one at least."""
    rope = json.loads((checkpoints["llama"] / "config.json").read_text())["rope_parameters"]
    cfg = Config.from_dict(json.loads((checkpoints["llama"] / "config.json").read_text()))
    wavelengths = [2 * math.pi * rope["rope_theta"] ** (i / cfg.head_dim) for i in range(0, cfg.head_dim, 2)]
    short = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    long = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    assert any(w < short for w in wavelengths) and any(w > long for w in wavelengths)
    assert any(short <= w <= long for w in wavelengths)


def test_hub_style_config_with_rope_scaling_key_loads_the_same(checkpoints, tmp_path):
    """Checkpoints on the Hub write rope_theta and rope_scaling; transformers 5 writes rope_parameters."""
    folder = checkpoints["llama"]
    c = json.loads((folder / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    assert Config.from_dict(c) == Config.from_dict(json.loads((folder / "config.json").read_text()))


def test_chat_template_renders_with_thinking_switch(checkpoints):
    _, tok = ours(checkpoints["qwen3"])
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.tok.decode(tok.chat(msgs), skip_special_tokens=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.tok.decode(tok.chat(msgs, enable_thinking=False), skip_special_tokens=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    assert tok.eos_ids == [tok.tok.token_to_id("<|im_end|>")]


def test_a_message_without_content_renders_as_transformers_renders_it(checkpoints):
    """An OpenAI assistant turn that only calls tools has content null: the key is left out, as transformers
    leaves it out (the template then renders nothing for it, not the text 'None')."""
    _, tok = ours(checkpoints["qwen3"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    want = transformers.AutoTokenizer.from_pretrained(checkpoints["qwen3"]).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert want == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render(messages) == want


def test_openai_text_content_parts_render_as_their_joined_text(checkpoints):
    _, tok = ours(checkpoints["qwen3"])
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]
    assert tok.render([{"role": "user", "content": parts}]) == tok.render([{"role": "user", "content": "Hi there"}])


def test_chat_template_has_the_helpers_transformers_gives_templates(checkpoints):
    """tojson without HTML escaping (tool schemas) and strftime_now (Llama 3.2's date line)."""
    import time
    _, tok = ours(checkpoints["qwen3"])
    tok.template = "{{ messages[0] | tojson }} {{ strftime_now('%Y') }}"
    text = tok.tok.decode(tok.chat([{"role": "user", "content": "<é>"}]), skip_special_tokens=False)
    assert text == '{"role": "user", "content": "<é>"} ' + time.strftime("%Y")
