"""The generation loop, the compiled step, the public API and the command line, on tiny checkpoints."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from safetensors.torch import load_file, save_file

import generate
import memory
import tinyflow
from generate import Engine
from sampling import Sampling, apply_penalty, sample, uniform_noise
from policies import POLICIES, hash32
from model import Config, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(capsys, *argv):
    """Run the command line in-process; return (exit code, stdout, stderr)."""
    try:
        generate.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# the kernel's rule; the heaviest rule scored in PyTorch; the rule with data of the model's own (Layer.data)
@pytest.mark.parametrize("policy", ["longflow", "rkv", "triattention"])
def test_compiled_step_never_recompiles_and_matches_eager(checkpoints, policy):
    model, tok = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    prompts = [tok.encode("Hello world"), tok.encode("The quick brown fox jumps"), tok.encode("Hello")]
    # budget 36 < prompt + 40 new tokens: the eviction path runs inside the compiled step. Three prompts on two
    # rows: the third runs alone at the end, so the step runs at both sizes of its ladder, 2 and 1
    run = lambda engine: engine.generate(prompts, 40, [], budget=36, policy=policy, batch_size=2)[0]
    eager = run(Engine(model, compile=False))
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        engine = Engine(model, compile=True)
        compiled = run(engine)
        again = run(engine)  # reuses the step and the cache
    assert compiled == eager == again
    # one compiled layer runs both layers, plus the two samplings (greedy rows only, some rows sampling): each
    # once for batch 1 and once for every larger size of the ladder (here 2)
    assert counters["stats"]["unique_graphs"] == 6
    assert all(len(o) == 40 for o in compiled)


def rows(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def draw(logits, seed, position, temperature, top_k, top_p):
    """sample() with the same settings for every row."""
    B = logits.shape[0]
    full = lambda x, dtype=torch.float32: torch.full((B,), x, dtype=dtype)
    return sample(logits, full(seed, torch.int64), full(position, torch.int64), full(temperature),
                  full(top_k, torch.int64), full(top_p))


def test_sampling_is_reproducible_per_seed_and_respects_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([7, 7, 7])
    one, k0, k3 = rows(1.0, 1.0, 1.0), rows(0, 0, 0, dtype=torch.int64), rows(3, 3, 3, dtype=torch.int64)
    a = sample(logits, seeds, positions, one, k0, one)
    assert torch.equal(a, sample(logits, seeds, positions, one, k0, one))
    draws = torch.stack([sample(logits, seeds, positions + i, one, k3, one) for i in range(200)])  # [200, 3]
    top3 = logits.topk(3).indices  # [3, 3]
    assert all(set(draws[:, b].tolist()) == set(top3[b].tolist()) for b in range(3))
    assert torch.equal(sample(logits, seeds, positions, rows(0.0, 0.0, 0.0), k0, one), logits.argmax(-1))


def test_each_row_samples_with_its_own_settings():
    """Row 0 greedy, row 1 top-k 1 (the argmax too), row 2 free: settings are per row, and a greedy row is
    the exact argmax whatever the other rows do."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeds, argmax = torch.tensor([1, 2, 3]), logits.argmax(-1)
    draws = torch.stack([sample(logits, seeds, torch.tensor([i] * 3), rows(0.0, 1.0, 1.0),
                                rows(0, 1, 0, dtype=torch.int64), rows(1.0, 1.0, 1.0)) for i in range(100)])
    assert (draws[:, 0] == argmax[0]).all() and (draws[:, 1] == argmax[1]).all()
    assert len(set(draws[:, 2].tolist())) > 10


def test_sampling_follows_the_distribution():
    """The exponential-race draw matches softmax probabilities (4,000 draws: 3-sigma is about 0.02)."""
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    draws = torch.stack([draw(logits, 5, i, 1.0, 0, 1.0) for i in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.025)


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {draw(logits, 0, i, 1.0, 0, 0.7).item() for i in range(300)}
    assert draws == {0, 1}


def test_a_top_p_that_rounds_to_zero_in_fp32_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert {draw(logits, 0, i, 1.0, 0, 1e-50).item() for i in range(20)} == {1}


def test_every_bit_of_a_64_bit_seed_counts_and_seeds_below_2_32_draw_as_before():
    logits = torch.zeros(1, 1000)  # uniform: the draw is the noise's argmax
    draws = lambda seed: [draw(logits, seed, i, 1.0, 0, 1.0).item() for i in range(8)]
    assert draws(0) != draws(2**32) and draws(-1) != draws(2**32 - 1) and draws(5) != draws(5 + 2**40)
    seeds, positions = torch.tensor([5, 2**32 - 1]), torch.tensor([3, 3])
    before = hash32(hash32(seeds * 0x9E3779B1 + positions)[:, None] * 0x85EBCA77 + torch.arange(1000))  # 32-bit
    assert torch.equal(uniform_noise(seeds, positions, 1000), ((before >> 8).float() + 0.5) / 2**24)


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert {draw(logits, 0, i, 10.0, 2, 1.0).item() for i in range(300)} == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_ids():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_penalty(logits, seen, torch.tensor([2.0])).tolist() == [[1.0, -2.0, 3.0, 0.5]]


@pytest.mark.parametrize("arch, compile", [("qwen3", False), ("qwen2", False), ("llama", False), ("qwen3", True)])
def test_greedy_with_repetition_penalty_equals_transformers(checkpoints, arch, compile):
    """transformers' generate(repetition_penalty=1.5), greedy: the same tokens, eager and through the compiled
    step. The penalty remembers the prompt's ids and every generated one, in a refilled row as in a fresh one
    (batch 1, two prompts)."""
    from transformers import AutoModelForCausalLM
    model, tok = load(str(checkpoints[arch]), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], torch_dtype=torch.float32).eval()
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog"), tok.encode("Hello world")]
    ours, _ = Engine(model, compile=compile).generate(prompts, 30, [], batch_size=1,
                                                      sampling=Sampling(repetition_penalty=1.5))
    for prompt, out in zip(prompts, ours):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                           repetition_penalty=1.5, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == want
    plain, _ = Engine(model, compile=False).generate(prompts, 30, [])
    assert plain != ours  # the penalty changed something


def test_new_sampling_settings_and_mixed_rows_never_recompile(checkpoints):
    """Temperature, top-k, top-p and the penalty are per-row values of one compiled step: changing them, or
    mixing them in one batch, compiles nothing new, and each row gets what it gets alone."""
    model, tok = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    prompts = [tok.encode("Hello world"), tok.encode("The quick brown fox")]
    S = Sampling
    greedy, hot = S(), S(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3)
    engine = Engine(model, compile=True)
    torch._dynamo.reset()
    # the shapes of test_compiled_step_never_recompiles_and_matches_eager[longflow] (budget 36, two rows): the
    # compiler finds their code in its on-disk cache
    run = lambda sampling: engine.generate(prompts, 20, [], budget=36, sampling=sampling, seed=4)[0]
    alone = [run(s) for s in (greedy, hot)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        mixed = run([greedy, hot])
        again = [run(s) for s in (hot, greedy)]
    assert mixed == [alone[0][0], alone[1][1]]
    assert again == alone[::-1]


def test_api_generates_text_from_strings_or_ids_and_prompt_i_samples_with_seed_plus_i(checkpoints):
    """Text and ids alike; one seed gives prompt i the seed + i, whatever else is in the batch (each
    token's draw is checked against sample() in test_each_sampled_token_is_sample_at_its_own_position...)."""
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), compile=False)
    hot = dict(max_new_tokens=12, temperature=0.8, ignore_eos=True)
    outs = llm.generate(["Hello world", [5, 6, 7]], seed=3, **hot)
    assert [len(o.token_ids) for o in outs] == [12, 12] and llm.stats.prompt_tokens == len(llm.tokenizer.encode(
        "Hello world")) + 3
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids)
    assert llm.generate(["Hello world"], seed=3, **hot) == outs[:1]
    assert llm.generate([[5, 6, 7]], seed=4, **hot) == outs[1:]
    assert llm.generate([[5, 6, 7]], seed=3, **hot) != outs[1:]  # another seed, other tokens
    greedy = llm.generate(["Hello world", [5, 6, 7]], max_new_tokens=12, ignore_eos=True)
    assert all(g != o for g, o in zip(greedy, outs))  # the temperature reached the step
    chat = llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.chat([{"role": "user", "content": "Hi"}])
    assert chat == llm.generate([ids], max_new_tokens=4, ignore_eos=True)


def test_api_rejects_bad_arguments_with_clear_errors(checkpoints):
    with pytest.raises(ValueError, match="positive integer"):
        tinyflow.LLM(str(checkpoints["qwen2"]), budget=0)
    with pytest.raises(ValueError, match="unknown policy"):
        tinyflow.LLM(str(checkpoints["qwen2"]), budget=64, policy="nope")
    with pytest.raises(ValueError, match="prompt_compression='streaming' applies to a cache with a budget"):
        tinyflow.LLM(str(checkpoints["qwen2"]), prompt_compression="streaming")  # not silently ignored
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), compile=False)
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["caf\udcff"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate(["Hi"], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 99999]])
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([[1.9, 2.7]])  # never truncated to [1, 2]
    for sampling, says in ((dict(temperature=None), "temperature must be 0 (greedy) or a number from 1e-6 up, got None"),
                           (dict(temperature=1e-45), "temperature must be 0 (greedy) or a number from 1e-6 up"),
                           (dict(temperature=1.0, top_k=2.5), "top_k must be an integer from 0 (no limit)"),
                           (dict(top_p="0.9"), "top_p must be a number in (0, 1], got '0.9'")):
        with pytest.raises(ValueError, match=re.escape(says)):
            llm.generate(["Hi"], **sampling)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            llm.generate(["Hi"], batch_size=bad)
    with pytest.raises(TypeError, match="list"):
        llm.generate("Hi")


def test_batch_estimator_picks_the_largest_batch_that_fits(checkpoints):
    cfg, dtype = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)[0].cfg, torch.bfloat16
    fixed = memory.prefill_bytes(cfg, memory.PREFILL_TOKENS, dtype) + memory.SPARE
    row = memory.bytes_per_row(cfg, 3200, dtype)
    # 2 layers x 2 KV heads x 3200 slots x (K and V of 32 bf16, the int32 position, and the most any policy keeps
    # beside a slot: vatp's two fp32 values), + the step's share: 48 bytes per vocabulary id (measured)
    kv = 2 * 2 * 3200 * (2 * 32 * 2 + 4 + 8)
    assert row == kv + 48 * 320
    assert memory.batch_that_fits(cfg, 3200, 100, fixed + 10 * row + row // 2, dtype) == 10
    assert memory.batch_that_fits(cfg, 3200, 100, fixed + row - 1, dtype) == 0
    assert memory.batch_that_fits(cfg, 3200, 100, fixed // 2, dtype) == 0


def test_engine_refuses_a_batch_that_cannot_fit_before_allocating(checkpoints, monkeypatch):
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)
    engine.device = torch.device("cuda")  # pretend, with a GPU that has room for exactly 10 rows
    fixed = memory.prefill_bytes(model.cfg, memory.PREFILL_TOKENS, engine.dtype) + memory.SPARE
    free = fixed + 10 * memory.bytes_per_row(model.cfg, 64, engine.dtype)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})
    with pytest.raises(ValueError, match=r"11 sequences of 64 KV slots need .* GiB .* free \(10 would fit\)"):
        memory.pick_batch(engine, 11, 20, 64, 10)
    assert memory.pick_batch(engine, None, 20, 64, 10) == 10  # unasked: as many as fit, the rest wait
    assert memory.pick_batch(engine, None, 4, 64, 10) == 4
    assert engine.cache is None  # nothing was allocated


def test_memory_the_allocator_holds_for_no_tensor_counts_as_free(checkpoints, monkeypatch):
    """PyTorch's caching allocator keeps freed blocks (a probe's copies, an old cache's buffers) and gives them to
    the next allocation that needs them: the planner counts them as free, but for the free pieces of blocks that
    still hold a tensor."""
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)
    engine.device = torch.device("cuda")  # pretend: 5 GiB free on the device, 4 GiB cached of which 1 GiB in use
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * 2**30, 80 * 2**30))  # and 1 GiB in pieces
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"inactive_split_bytes.all.current": 2**30})
    assert memory.free_bytes(engine) == 7 * 2**30


def test_the_batch_an_engine_holds_can_be_asked_again_with_no_memory_left(checkpoints, monkeypatch):
    """What the engine's shape holds (measured as it is made: here 3 GiB, pretended) counts as free, since it is
    given back, or kept for the same shape: the same batch passes again on a device with nothing else free, one
    row more does not."""
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)
    held = iter([0, 3 * 2**30])  # the allocator's count before and after the engine makes its 6 rows
    monkeypatch.setattr(generate, "allocated", lambda device: next(held))
    engine.generate([[1, 2, 3]] * 6, 2, [], 64, "longflow", batch_size=6)
    # pretend: a GPU that had room for exactly these 6 rows as the planner charges them, less what they took
    engine.device = torch.device("cuda")
    fixed = memory.prefill_bytes(model.cfg, memory.PREFILL_TOKENS, engine.dtype) + memory.SPARE
    left = fixed + 6 * memory.bytes_per_row(model.cfg, 64, engine.dtype) - 3 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (left, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})
    assert memory.pick_batch(engine, 6, 6, 64, 3) == 6
    with pytest.raises(ValueError, match=r"7 sequences .* \(6 would fit\)"):
        memory.pick_batch(engine, 7, 7, 64, 3)


@pytest.mark.parametrize("budget", [None, 36])
def test_refilled_rows_give_each_prompt_the_tokens_it_gets_alone(checkpoints, budget):
    """Six prompts through two rows: as sequences end (at a chosen 'EOS' token or the length limit),
    waiting prompts are prefilled into the freed row while the other row keeps decoding."""
    model, tok = load(str(checkpoints["llama"]), torch.device("cpu"), torch.float32)
    texts = ["Hello world", "The quick brown fox", "2 + 3", "Please reason", "lazy dog", "What is"]
    prompts = [tok.encode(t) for t in texts]
    engine = Engine(model, compile=False, sync_every=4)
    eos = [engine.generate(prompts[:1], 30, [], budget)[0][0][5]]  # a token that ends some sequences early
    alone = [engine.generate([p], 30, eos, budget)[0][0] for p in prompts]
    assert len({len(a) for a in alone}) > 1  # the test needs sequences that end at different times
    batched, stats = engine.generate(prompts, 30, eos, budget, batch_size=2)
    assert stats.batch == 2 and batched == alone


def test_command_line_end_to_end_the_answer_alone_on_stdout_the_stats_on_stderr(checkpoints):
    """A real process: streams the answer on standard output, alone (`generate.py ... > answer.txt` holds just
    it), and prints the stats line on standard error."""
    r = subprocess.run([sys.executable, "generate.py", "--model", checkpoints["llama"], "--prompt", "Hello",
                        "--max-new-tokens", "8", "--budget", "40", "--device", "cpu", "--no-compile"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert "generated 8 tok" in r.stderr and "KV cache longflow, 40 slots/seq" in r.stderr
    llm = tinyflow.LLM(str(checkpoints["llama"]), device="cpu", compile=False, budget=40)
    answer = llm.chat([{"role": "user", "content": "Hello"}], max_new_tokens=8)[0].text
    assert r.stdout == answer + "\n"


def test_command_line_batch_prints_every_sequence(checkpoints, capsys):
    code, out, _ = cli(capsys, "--model", checkpoints["qwen3"], "--prompt", "Hi", "--batch-size", "3",
                       "--max-new-tokens", "4", "--temperature", "1.0", "--no-compile")
    assert code == 0 and out.count("--- sequence") == 3


def test_command_line_repetition_penalty_is_the_apis(checkpoints, capsys):
    """--repetition-penalty reaches the step: greedy, the text LLM.generate(repetition_penalty=) gives."""
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), compile=False)
    want, plain = (llm.generate(["Hello world"], max_new_tokens=16, temperature=0.0,
                                repetition_penalty=r)[0].text for r in (1.5, 1.0))
    assert want != plain  # the penalty changes these 16 tokens
    code, out, _ = cli(capsys, "--model", checkpoints["qwen3"], "--prompt", "Hello world", "--no-chat",
                       "--max-new-tokens", "16", "--temperature", "0", "--repetition-penalty", "1.5",
                       "--no-compile")
    assert code == 0 and out.startswith(want + "\n")


def broken_checkpoint(checkpoints, tmp_path, edit_config=None, edit_weights=None):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"], folder)
    if edit_config:
        c = json.loads((folder / "config.json").read_text())
        edit_config(c)
        (folder / "config.json").write_text(json.dumps(c))
    if edit_weights:
        w = load_file(folder / "model.safetensors")
        edit_weights(w)
        save_file(w, folder / "model.safetensors")
    return folder


def set_moe(c):
    c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")


def set_yarn(c):
    c["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("file, damage", [("tokenizer.json", "{not json"), ("model.safetensors", "\x00" * 5),
                                          ("config.json", "{")])
def test_unreadable_checkpoint_file_is_one_clear_line(checkpoints, tmp_path, capsys, file, damage):
    folder = broken_checkpoint(checkpoints, tmp_path)
    (folder / file).write_text(damage)
    code, _, err = cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")
    assert code == 2 and err.startswith("error:") and file in err and err.count("\n") == 1, err


@pytest.mark.parametrize("config, weights, message", [
    (set_moe, None, "unsupported model 'Qwen3MoeForCausalLM'"),
    (set_yarn, None, "unsupported rope scaling 'yarn'"),
    (None, lambda w: w.pop("model.norm.weight"), "missing 1 weight.*model.norm.weight"),
    (None, lambda w: w.update(extra=torch.zeros(2)), "unexpected weight 'extra'"),
    (None, lambda w: w.update({"model.norm.weight": torch.zeros(3)}), "'model.norm.weight' has shape \\[3\\]"),
    # parts of a fused projection (qkv_proj, gate_up_proj) are named and checked one by one
    (None, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"), "missing 1 weight.*layers.1.self_attn.k_proj"),
    (None, lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 63)}),
     "'model.layers.0.mlp.up_proj.weight' has shape \\[128, 63\\]"),
    (lambda c: c.pop("hidden_size"), None, "config.json lacks hidden_size"),
])
def test_bad_checkpoint_is_one_clear_line(checkpoints, tmp_path, capsys, config, weights, message):
    folder = broken_checkpoint(checkpoints, tmp_path, config, weights)
    code, _, err = cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/folder"], "does not exist"),
    (["--budget", "0"], "positive integer"),
    (["--budget", "1.5"], "positive integer"),
    (["--budget", "8"], "too small"),
    (["--policy", "magic"], "invalid choice: 'magic'"),
    (["--max-new-tokens", "0"], "positive integer"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt-file", "/no/such/prompt.txt"], "cannot read prompt file"),
    (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or a number from 1e-6 up, got nan"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a number from 1e-6 up, got -1.0"),
    (["--temperature", "1e-45"], "--temperature must be 0 (greedy) or a number from 1e-6 up, got 1e-45"),
    (["--top-k", "-3"], "--top-k must be an integer from 0 (no limit) to 2^63 - 1, got -3"),
    (["--device", "tpu9"], "unknown device"),
    (["--device", "mps"], "unsupported device 'mps'"),
    (["--device", "cpu:3"], "unsupported device 'cpu:3'"),
    (["--batch-size", "max", "--device", "cpu"], "give a number on the CPU"),
    (["--batch-size", "many"], "positive integer"),
])
def test_bad_command_line_input_is_one_clear_line(checkpoints, capsys, args, message):
    prompt = [] if {"--prompt", "--prompt-file"} & set(args) else ["--prompt", "Hi"]
    argv = ["--model", checkpoints["qwen2"], "--no-compile"] + prompt + args
    code, _, err = cli(capsys, *argv)
    assert code == 2 and message in err and err.startswith("error:") and err.count("\n") == 1, err


def test_without_a_prompt_the_command_line_says_which_it_asks(checkpoints, capsys):
    """`generate.py --model M` (the design's first command) answers a built-in question: its first line on
    stderr says which, and how to ask another, so nobody waits for the answer to a question they never asked."""
    code, out, err = cli(capsys, "--model", checkpoints["qwen2"], "--no-compile", "--max-new-tokens", 2)
    assert code == 0 and out, err
    assert err.splitlines()[0] == ("no --prompt given, so asking 'Briefly, why is the sky blue?' (give --prompt TEXT "
                                   "or --prompt-file FILE)"), err


def test_a_batch_too_large_for_memory_is_refused_before_its_prompts_are_checked(checkpoints, capsys, monkeypatch):
    """--batch-size 10**8 on the CPU: refused by its size at once, not after checking 10**8 copies of the prompt."""
    monkeypatch.setattr(generate, "check_request", lambda *a, **k: pytest.fail("the copies were checked first"))
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--no-compile", "--device", "cpu",
                       "--batch-size", 10**8)
    assert code == 2 and "100000000 sequences of" in err and "lower the batch size (100000000)" in err, err


def test_a_prompt_given_many_times_has_its_ids_checked_once():
    class Counted(list):
        reads = 0

        def __iter__(self):
            Counted.reads += 1
            return super().__iter__()

    generate.check_request([Counted([1, 2, 3])] * 1000, 4, vocab_size=10)
    assert Counted.reads == 1
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 10\)"):
        generate.check_request([[1, 2]] * 3 + [[1, 10]], 4, vocab_size=10)  # every distinct one is still checked


def test_the_stats_line_says_what_setup_timed_and_when_the_budget_held_everything(checkpoints, capsys):
    """Under --no-compile nothing compiles, so the setup time is not called compile; a budget longer than every
    sequence evicts nothing, and the line says so instead of comparing with a full cache."""
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--no-compile", "--budget", 64,
                       "--max-new-tokens", 4)
    assert code == 0 and ", setup " in err and "compile" not in err, err
    longest = int(re.search(r"prompt (\d+) tok", err)[1]) + 4  # the chat template's prompt and 4 new tokens
    assert f"(the budget holds every token: the longest sequence has {longest}, none was evicted)" in err
    model, tok = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    _, stats = Engine(model).generate([tok.encode("Hi")], 4, [], budget=36)  # compiled (code the compiler has cached)
    assert ", compile " in stats.line()


def test_a_run_interrupted_during_its_first_prefill_says_so_and_compares_with_no_full_cache(checkpoints, monkeypatch):
    """Ctrl-C during the first prefill: the line says what was cut (not "prompt 0 tok, generated 0 tok"); no
    token, so no sequence a full cache would hold (not "0.0 MiB")."""
    model, tok = load(str(checkpoints["qwen2"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(engine, "_admit", ctrl_c)  # the prefill that would give the first tokens
    prompts = [tok.encode("Hi"), tok.encode("Hello world")]
    with pytest.raises(generate.Interrupted) as stop:
        engine.generate(prompts, 4, [], 40)
    line = stop.value.stats.line()
    tokens = len(prompts[0]) + len(prompts[1])
    assert line.startswith(f"interrupted during prefill of {tokens} prompt tokens, nothing generated ("), line
    assert line.endswith(" MiB") and "full cache" not in line, line


def test_a_python_session_that_calls_main_keeps_its_ctrl_c_after_an_interrupted_run(checkpoints, capsys, monkeypatch):
    """generate.py ignores a second Ctrl-C while it writes what an interrupted run made, in its own process only:
    a notebook that called main() must still be able to interrupt what it runs next."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(Engine, "_admit", ctrl_c)
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--max-new-tokens", "4",
                       "--no-compile")
    assert code == 130 and err.strip().endswith("interrupted") and "nothing generated" in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_bad_sampling_flag_is_refused_before_the_model_loads(checkpoints, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--top-p", "1.5")
    assert code == 2 and err == "error: --top-p must be a number in (0, 1], got 1.5\n", err


def test_a_bad_default_sampling_setting_names_generation_config(checkpoints, tmp_path, capsys):
    """A setting out of range in generation_config.json is the model's, not the user's: the message says where
    it came from and which flag overrides it; given that flag, the run goes on."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 1.5}))
    code, _, err = cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")
    assert code == 2 and err == ("error: this model's generation_config.json sets top_p to 1.5, which must be a "
                                 "number in (0, 1]: give --top-p to override it\n"), err
    code, _, err = cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile", "--top-p", "0.9",
                       "--max-new-tokens", "2")
    assert code == 0 and "generated 2 tok" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(checkpoints, capsys):
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--device", "cuda", "--prompt", "Hi")
    assert code == 2 and "CUDA" in err and "not available" in err and err.count("\n") == 1


def test_hub_id_not_in_cache_while_offline_says_how_to_download(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "generate.py", "--model", "nobody/not-a-model", "--prompt", "Hi"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not in the local Hugging Face cache" in r.stderr and "hf download nobody/not-a-model" in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy, budget", [("full", None)] + [(p, 53) for p in POLICIES if p != "full"])
def test_cuda_graph_replay_matches_eager_and_never_recompiles(checkpoints, policy, budget, monkeypatch):
    """On the GPU: the compiled step, replayed as a CUDA graph, against the same step run eagerly (budget 53,
    vatp's smallest, and 80 new tokens: every rule evicts). Three prompts on two rows: the graphs of both
    sizes, 2 and then 1 for the last prompt alone. Knorm's key norms are rounded to 2^-12 here: a token's
    keys in the first layer are one vector rotated, so a repeated token's norms tie but for rounding, which
    the compiled and the eager code do differently (unrounded, their tokens part at the 71st-73rd, on the CPU
    too); rounded, such ties are exact and both give them to the lowest slot (unless two norms an ulp apart fall
    either side of a multiple of 2^-12: possible, far rarer)."""
    rounded = lambda self, c, q, now: -(c.kept["key_norm"] * 2**12).round()
    monkeypatch.setattr(type(POLICIES["knorm"]), "score", rounded)
    model, tok = load(str(checkpoints["llama"]), torch.device("cuda"), torch.float32)
    prompts = [tok.encode("Hello world"), tok.encode("The quick brown fox jumps"), tok.encode("Hello")]
    eager, _ = Engine(model, compile=False).generate(prompts, 80, [], budget, policy, batch_size=2)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphed, _ = Engine(model, compile=True).generate(prompts, 80, [], budget, policy, batch_size=2)
    assert graphed == eager


def test_tied_checkpoint_with_a_stored_lm_head_and_incomplete_llama3_config(checkpoints, tmp_path):
    """transformers loads a tied checkpoint that also stores lm_head.weight; so does tinyflow. A llama3
    rope scaling without its parameters is a clear error, not a KeyError."""
    folder = tmp_path / "tied"
    shutil.copytree(checkpoints["qwen3"], folder)
    w = load_file(folder / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, folder / "model.safetensors")
    tied = tinyflow.LLM(str(folder), device="cpu", compile=False).score(["Hello world"], [" hello tinyflow"])
    assert tied == tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False).score(
        ["Hello world"], [" hello tinyflow"])  # the same model
    c = json.loads((checkpoints["llama"] / "config.json").read_text())
    del c["rope_parameters"]["factor"]
    with pytest.raises(ValueError, match="lacks \\['factor'\\]"):
        Config.from_dict(c)


def test_one_seed_per_prompt_is_checked(checkpoints):
    model, tok = load(str(checkpoints["qwen2"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)
    for bad in ([1, 2], (1, 2, 3.5), "7"):
        with pytest.raises(ValueError, match="seed must be one int or one int per prompt"):
            engine.generate([[1], [2], [3]], 4, [], seed=bad)
    hot = Sampling(temperature=1.0)  # sampled, so the seeds matter
    as_tuple, as_int = (engine.generate([[1], [2], [3]], 8, [], sampling=hot, seed=s)[0] for s in ((5, 6, 7), 5))
    assert as_tuple == as_int != engine.generate([[1], [2], [3]], 8, [], sampling=hot, seed=6)[0]


def test_each_sampled_token_is_sample_at_its_own_position_with_its_seed(checkpoints):
    """Sampling (temperature 0.7, top-k 50): every generated token is what sampling.sample draws from the
    model's logits there, with the prompt's seed and the token's own position (the first, from prefill, at
    len(prompt); the others from the decode step). The logits are transformers', teacher-forced on the
    prompt and the output; each draw is won by a clear margin (the race's winner 1% above the runner-up, the
    50th logit 1e-4 above the 51st), beyond the 1e-5 the two implementations' logits differ by."""
    from transformers import AutoModelForCausalLM
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False)
    prompt, seed = llm.tokenizer.encode("The quick brown fox"), 11
    out = llm.generate([prompt], max_new_tokens=24, temperature=0.7, top_k=50, seed=seed, ignore_eos=True)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]  # [24, V]: predicting out[i]
    positions = torch.arange(len(out)) + len(prompt)
    n = len(out)
    at = lambda p: draw_rows(logits, seed, p, 0.7, 50)
    assert at(positions).tolist() == out
    assert at(positions - 1).tolist() != out  # the noise of the position before would draw other tokens
    ordered = (logits / 0.7).sort(-1, descending=True).values
    assert ((ordered[:, 49] - ordered[:, 50]) > 1e-4).all()
    probs = (logits / 0.7).masked_fill(logits / 0.7 < ordered[:, 49:50], float("-inf")).softmax(-1)
    race = (probs / -uniform_noise(torch.full((n,), seed), positions, logits.shape[1]).log()).topk(2).values
    assert (race[:, 0] > 1.01 * race[:, 1]).all()


def draw_rows(logits, seed, positions, temperature, top_k):
    """sample() for rows [n, V] of one sequence at positions [n], top-p 1."""
    n = logits.shape[0]
    return sample(logits, torch.full((n,), seed), positions, torch.full((n,), temperature),
                  torch.full((n,), top_k), torch.ones(n))


def test_generation_stops_at_eos_unless_told_to_ignore_it(checkpoints, tmp_path):
    """A copy of the tiny Qwen2 whose generation_config.json names a token of its greedy answer (its first
    appearance there, the fourth token or later) as EOS: generation ends with that token, EOS included;
    with ignore_eos it runs to max_new_tokens, the answer of the checkpoint with the real EOS."""
    free = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False).generate(
        ["Hello world"], max_new_tokens=16, ignore_eos=True)[0].token_ids
    k = next(i for i in range(3, 15) if free[i] not in free[:i])
    folder = tmp_path / "eos"
    shutil.copytree(checkpoints["qwen2"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": free[k]}))
    llm = tinyflow.LLM(str(folder), device="cpu", compile=False)
    assert llm.tokenizer.eos_ids == [free[k]]
    assert llm.generate(["Hello world"], max_new_tokens=16)[0].token_ids == free[:k + 1]
    assert llm.generate(["Hello world"], max_new_tokens=16, ignore_eos=True)[0].token_ids == free
    # batched, with the rows sampling: each stops at its own first EOS, or runs to the end when ignoring it
    hot = dict(max_new_tokens=16, temperature=1.0, seed=5)
    ignoring = llm.generate(["Hello world", "The quick brown fox"], ignore_eos=True, **hot)
    stopping = llm.generate(["Hello world", "The quick brown fox"], **hot)
    assert all(len(o.token_ids) == 16 for o in ignoring)
    for a, b in zip(ignoring, stopping):
        end = a.token_ids.index(free[k]) + 1 if free[k] in a.token_ids else 16
        assert b.token_ids == a.token_ids[:end]


def test_chat_without_thinking_renders_exactly_the_templates_empty_think_block(checkpoints):
    """LLM.chat(enable_thinking=False) prompts with the template's turn plus "<think>\\n\\n</think>\\n\\n" (the
    test template writes it when thinking is off), and by default without it."""
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    hi = [{"role": "user", "content": "Hi"}]
    plain, block = llm.tokenizer.chat(hi), llm.tokenizer.encode("<think>\n\n</think>\n\n", False)
    off = llm.chat(hi, enable_thinking=False, max_new_tokens=6, ignore_eos=True)
    assert llm.stats.prompt_tokens == len(plain) + len(block)
    assert off == llm.generate([plain + block], max_new_tokens=6, ignore_eos=True)
    on = llm.chat(hi, max_new_tokens=6, ignore_eos=True)
    assert llm.stats.prompt_tokens == len(plain)
    assert on == llm.generate([plain], max_new_tokens=6, ignore_eos=True) != off


def test_the_first_token_is_drawn_with_the_noise_of_its_own_position(checkpoints, monkeypatch):
    """The first token, sampled from the prefill's last logits, draws the noise of its own position, len(prompt)
    (sampling.uniform_noise hashes seed, position and token id), not that of the prompt's last token: for each
    seed it is sample() of exactly those logits at len(prompt), and for some seed the position before would have
    drawn another token. A temperature of 5 makes the distribution flat enough for the noise to decide."""
    from sampling import Sampler
    model, tok = load(str(checkpoints["qwen2"]), torch.device("cpu"), torch.float32)
    engine, prompt = Engine(model, compile=False), tok.encode("The quick brown fox")
    firsts, pick = [], Sampler.pick

    def keep_first_logits(self, logits, seeds, positions, rows=None, hot=True):
        if rows is not None:  # the prefill's pick (the decode step's takes every row)
            firsts.append(logits.clone())
        return pick(self, logits, seeds, positions, rows, hot)
    monkeypatch.setattr(Sampler, "pick", keep_first_logits)
    before = []
    for seed in range(8):
        first = engine.generate([prompt], 1, [], sampling=Sampling(temperature=5.0), seed=seed)[0][0][0]
        at = lambda position: draw_rows(firsts[-1], seed, torch.tensor([position]), 5.0, 0).item()
        assert first == at(len(prompt)), seed
        before.append(at(len(prompt) - 1) != first)
    assert any(before)  # the noise of the position before draws other tokens: the check above can tell


def test_the_memory_planner_counts_an_fp8_caches_keys_dequantized(checkpoints):
    """With an FP8 cache a row also costs one layer's keys in the model's dtype (the rules that read keys
    dequantize them each step): slots x KV heads x head_dim x 2 bytes in bf16, beyond the FP8 cache and the
    step's 48 bytes per vocabulary id."""
    import kernel
    from cache import KVCache
    cfg, bf16 = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)[0].cfg, torch.bfloat16
    fp8_cache = KVCache.bytes_needed(cfg, 1, 3200, bf16, kv_dtype=kernel.FP8)
    assert memory.bytes_per_row(cfg, 3200, bf16, kv_dtype=kernel.FP8) == fp8_cache + 3200 * 2 * 32 * 2 + 48 * 320
    assert memory.bytes_per_row(cfg, 3200, bf16) == KVCache.bytes_needed(cfg, 1, 3200, bf16) + 48 * 320


def test_a_bare_name_of_a_supported_family_is_its_hub_id_and_a_local_folder_wins(checkpoints, tmp_path, capsys,
                                                                                 monkeypatch):
    """`--model Qwen3-8B` (the design's command, without the owner): Qwen/Qwen3-8B, said on stderr; a folder of
    that name where the command runs is taken instead. No network: the download is replaced."""
    from model import hub_id, resolve
    assert [hub_id(n) for n in ("Qwen3-8B", "Qwen2.5-7B-Instruct", "QwQ-32B", "DeepSeek-R1-Distill-Qwen-7B",
                                "Llama-3.1-8B-Instruct")] == [
        "Qwen/Qwen3-8B", "Qwen/Qwen2.5-7B-Instruct", "Qwen/QwQ-32B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "meta-llama/Llama-3.1-8B-Instruct"]
    assert [hub_id(n) for n in ("Qwen/Qwen3-8B", "Mistral-7B", "qwen3-8b", "my-model")] == [None] * 4
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kw: f"/hub/{name}")
    assert resolve("Qwen3-8B") == "/hub/Qwen/Qwen3-8B"
    assert capsys.readouterr().err == "model 'Qwen3-8B': no such folder here, so the Hugging Face Hub's Qwen/Qwen3-8B\n"
    shutil.copytree(checkpoints["qwen2"], tmp_path / "Qwen3-8B")
    monkeypatch.chdir(tmp_path)
    assert resolve("Qwen3-8B") == "Qwen3-8B" and capsys.readouterr().err == ""
