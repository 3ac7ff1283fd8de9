"""The real checkpoint, SmolLM2-135M-Instruct (the `smollm2` fixture: downloaded from the package index
and converted once), against transformers, in float32 on the CPU. Tolerances as in test_model.py: the same
math in another order agrees to rounding, here within 1e-4 on logits of magnitude ~30."""
import os
import shlex
import subprocess
import sys

import pytest
import torch
import transformers

import tinyflow
from cache import KVCache
from test_generate import ROOT, cli
from test_score import longflow_by_hand

PROMPT = "Ownership is a set of rules that govern how a Rust program manages memory."
TEXT = (" All programs have to manage the way they use a computer's memory while running. Some languages "
        "have garbage collection that regularly looks for no-longer-used memory as the program runs; in other "
        "languages, the programmer must explicitly allocate and free the memory. Rust uses a third approach.")


@pytest.fixture(scope="module")
def hf(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm2):
    return tinyflow.LLM(str(smollm2), device="cpu", compile=False)


@pytest.fixture(scope="module")
def full(llm):
    """The text scored with the full cache (every test below compares with it: scored once)."""
    llm.set_policy(None)
    return llm.score([PROMPT], [TEXT])[0]


def test_logits_and_greedy_generation_equal_transformers(llm, hf):
    ids = llm.tokenizer.encode(PROMPT + TEXT)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    cache = KVCache(llm.model.cfg, 1, len(ids), "cpu", torch.float32)
    logits = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, rows=torch.tensor([0]))[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

    prompt = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    ours = llm.generate([prompt], max_new_tokens=24)[0].token_ids
    assert ours == reference[0, len(prompt):].tolist()


def test_full_cache_scores_are_transformers_log_softmax(llm, hf, full):
    prompt, cont = llm.tokenizer.encode(PROMPT), llm.tokenizer.encode(TEXT)
    with torch.no_grad():
        logp = hf(torch.tensor([prompt + cont])).logits[0].log_softmax(-1)[len(prompt) - 1:-1]
    score = full
    assert score.token_ids == cont
    torch.testing.assert_close(torch.tensor(score.logprobs), logp.gather(1, torch.tensor(cont)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    assert score.argmax == logp.argmax(-1).tolist()


def test_a_budget_that_holds_everything_scores_exactly_as_the_full_cache(llm, full):
    """LongFlow on real weights (every policy: test_cache.py and test_score.py, on the tiny checkpoints)."""
    llm.set_policy(128, "longflow")
    assert llm.score([PROMPT], [TEXT]) == [full]
    llm.set_policy(None)


def test_small_budget_scores_equal_a_longflow_cache_written_by_hand(llm):
    prompt, cont = llm.tokenizer.encode(PROMPT), llm.tokenizer.encode(TEXT)[:45]  # (a step of each costs the most)
    assert len(prompt) < 40 < len(prompt) + len(cont) - 20  # the prompt fits, the text evicts (21 times)
    with torch.no_grad():
        expected = longflow_by_hand(llm.model, prompt, cont, budget=40)
    llm.set_policy(40, "longflow")
    got = llm.score([prompt], [cont])[0]
    llm.set_policy(None)
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_chat_template_renders_the_ids_transformers_renders(llm, smollm2):
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    for messages in ([{"role": "user", "content": "What is 17 * 23?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"}]):
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert llm.tokenizer.chat(messages) == list(expected)


FIDELITY = ["--runs", "longflow:40", "random:40", "--rust-texts", "1", "--self-texts", "1", "--prompt-tokens", "32",
            "--tokens", "32", "--measure-last", "16", "--free-tokens", "4", "--device", "cpu", "--no-compile"]


def fidelity_job(smollm2, out):
    """eval.py fidelity on the real weights, as a command: conftest's real_model_runs starts it beside the tests as
    soon as the checkpoint is there (at the lowest CPU priority, as test_parallel.py's jobs), and the test below
    reads what it wrote. (The process, and its --out.)"""
    return subprocess.run([sys.executable, "eval.py", "fidelity", "--model", str(smollm2), *FIDELITY, "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          preexec_fn=lambda: os.nice(19)), out


def test_fidelity_on_the_real_model_ranks_longflow_above_random_eviction(smollm2, real_model_runs):
    """eval.py fidelity end to end on real weights, both kinds of text: on a trained model LongFlow stays
    closer to the full cache than evicting at random does (random eviction drops the attention sinks). (That a
    budget holding everything measures exactly no difference is checked through eval.py fidelity on the tiny
    model, test_fidelity.py, and on these weights score by score above; here it would cost a lock-step pass
    more, the full cache scored again beside it.)"""
    import json

    r, out = real_model_runs["fidelity"].result()
    assert r.returncode == 0, r.stderr[-3000:]
    # the Rust text's measured predictions (of its tokens 48 to 63) all come after its 40 slots filled (at token 40).
    # Measured: NLL increase 0.019 for longflow:40 against 1.12 for random:40, KL 0.042 against 1.06 (with 64 tokens,
    # the last 32 measured, 2026-12-02: 0.020 against 1.22, KL 0.083 against 1.01)
    run = lambda name: json.loads((out / f"fidelity_{name}.json").read_text())
    assert run("longflow_40")["texts"] == ["rust/ch04-01-what-is-ownership", "self/math-0"]
    assert 0 < run("longflow_40")["nll_increase"] < run("random_40")["nll_increase"]
    assert run("longflow_40")["kl"] < run("random_40")["kl"]
    assert (out / "fidelity.md").exists() and (out / "self_texts.jsonl").exists()


def test_an_fp8_cache_scores_the_text_close_to_the_full_precision_cache(smollm2, full):
    """Teacher-forced on the real model, every token kept. Measured 2026-12-01: the FP8 cache changes the mean
    log-likelihood of the text's 57 tokens by -0.036 nats (slightly better, by chance) and agrees on the most
    likely next token at 56 of them. The bound, 0.05 nats, is that measurement with 0.014 to spare for other
    CPUs' rounding (the same float32 math in another order moves log-probabilities by ~1e-4, far less)."""
    fp8 = tinyflow.LLM(str(smollm2), device="cpu", compile=False, kv_dtype="fp8")
    want, got = full, fp8.score([PROMPT], [TEXT])[0]
    nll_change = (sum(want.logprobs) - sum(got.logprobs)) / len(want.logprobs)
    agree = sum(a == b for a, b in zip(want.argmax, got.argmax)) / len(want.argmax)
    assert abs(nll_change) < 0.05 and agree >= 0.95 and "in fp8" in fp8.stats.line()


def readme_commands(readme: str) -> list[list[str]]:
    """The README's indented shell commands, each as its words (a line ending in \\ continues)."""
    text = readme.replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("    python ")]


def test_the_readmes_first_generate_command_runs_with_no_model_on_the_one_it_converted(smollm2, capsys, tmp_path,
                                                                                      monkeypatch):
    """README's first example names no --model: it runs SmolLM2-135M-Instruct from tinyflow's cache folder, here
    one holding the fixture's conversion (a converter that fails if called: a finished folder is reused), with
    fewer tokens."""
    import default_model
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "convert", lambda dest: pytest.fail("converted although the cache held it"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "SmolLM2-135M-Instruct").symlink_to(smollm2, target_is_directory=True)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        first = next(c for c in readme_commands(f.read()) if c[1] == "generate.py")
    args = first[2:]
    assert "--model" not in args and "--device" not in args  # the GPU when there is one
    args[args.index("--max-new-tokens") + 1] = "8"
    code, out, err = cli(capsys, *args, "--device", "cpu", "--no-compile")  # compiling would add seconds only
    assert code == 0 and out and "generated 8 tok" in err and "KV cache longflow, 64 slots/seq" in err, err
    assert f"no model given: running SmolLM2-135M-Instruct ({tmp_path / 'models' / 'SmolLM2-135M-Instruct'})" in err
