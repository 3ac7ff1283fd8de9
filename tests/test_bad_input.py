"""Bad or hostile input, as a new user's trial found it: one clear line and exit status 2 from the command
line (130 for Ctrl-C), a clear exception from the API, and never a silent no-op or a wrong number."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
import memory
import tinyflow
from cache import KVCache
from policies import POLICIES, resolve_policy
from generate import Engine
from model import load
from conftest import edit_json
from test_generate import ROOT, cli  # the command line run in-process: (exit code, stdout, stderr)


def one_line_error(code, err, message):
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and message in err, (code, err)


def copy_of(checkpoints, tmp_path, arch="qwen2"):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints[arch], folder)
    return folder


# ---- the checkpoint's files ---------------------------------------------------------------------------
def update(**values):
    return lambda c: {**c, **values}


@pytest.mark.parametrize("name, edit, message", [
    ("config.json", lambda c: [c], "config.json must hold a JSON object, not a list"),
    ("config.json", update(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
    ("config.json", update(num_hidden_layers=-2), "num_hidden_layers must be a positive integer, got -2"),
    ("config.json", update(rms_norm_eps="tiny"), "rms_norm_eps must be a positive number"),
    ("config.json", update(num_key_value_heads=3), "4 attention heads, 3 KV heads and head_dim 16 do not fit"),
    ("config.json", update(tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    ("config.json", lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_theta": "abc"}},
     "rope_theta must be a positive number, got 'abc'"),  # where transformers 5 writes it
    ("config.json", update(model_type=["qwen2"]), "model_type must be a string"),
    ("config.json", update(architectures="Qwen2ForCausalLM"), "architectures must be a list of strings"),
    ("config.json", update(layer_types=5), "layer_types must be a list of strings"),
    ("config.json", update(hidden_size=None), "config.json lacks hidden_size"),  # null: not set
    # transformers applies a window to the layers layer_types marks, whatever use_sliding_window says
    ("config.json", update(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
     "sliding-window attention is not supported"),
    ("generation_config.json", lambda c: 3, "generation_config.json must hold a JSON object"),
    ("generation_config.json", update(do_sample=True, temperature="hot"), "temperature has the wrong type ('hot')"),
    ("tokenizer_config.json", update(chat_template=5), "chat_template of"),
])
def test_a_config_file_of_the_wrong_shape_is_one_clear_line(checkpoints, tmp_path, capsys, name, edit, message):
    folder = copy_of(checkpoints, tmp_path)
    edit_json(folder, name, edit)
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")[::2], message)


def test_do_sample_without_settings_samples_with_transformers_defaults(checkpoints, tmp_path):
    """generation_config.json with do_sample and nothing else samples (temperature 1, top-k 50, top-p 1, as
    transformers does), instead of decoding greedily."""
    folder = copy_of(checkpoints, tmp_path)
    edit_json(folder, "generation_config.json", lambda c: {"do_sample": True, "top_p": 0.9})
    tok = load(str(folder), torch.device("cpu"), torch.float32)[1]
    assert tok.defaults == {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
    edit_json(folder, "generation_config.json", lambda c: {"temperature": 0.7})  # no do_sample: greedy
    assert load(str(folder), torch.device("cpu"), torch.float32)[1].defaults == {"temperature": 0.0}


def test_null_in_generation_config_and_config_means_not_set(checkpoints, tmp_path, capsys):
    folder = copy_of(checkpoints, tmp_path)
    edit_json(folder, "generation_config.json", update(do_sample=True, temperature=None, top_p=None))
    edit_json(folder, "config.json", update(rms_norm_eps=None, head_dim=None))
    code, _, err = cli(capsys, "--model", folder, "--prompt", "Hi", "--max-new-tokens", "3", "--no-compile")
    assert code == 0 and "generated" in err, err


@pytest.mark.parametrize("damage, message", [
    (lambda w: w["model.norm.weight"].__setitem__(3, float("nan")), "'model.norm.weight' of model.safetensors "
                                                                     "holds NaN or infinite values"),
    (lambda w: w["lm_head.weight"].__setitem__((0, 0), 1e30), "'lm_head.weight' of model.safetensors overflows "
                                                              "torch.float16"),
])
def test_weights_that_are_not_finite_are_named(checkpoints, tmp_path, capsys, damage, message):
    folder = copy_of(checkpoints, tmp_path)
    weights = load_file(folder / "model.safetensors")
    damage(weights)
    save_file(weights, folder / "model.safetensors")
    dtype = "float16" if "overflows" in message else "float32"
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--dtype", dtype, "--no-compile")[::2],
                   message)


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "the model's chat template fails (TemplateSyntaxError"),
    ("{{ nothing.here }}", "the model's chat template fails (UndefinedError"),
    ("{{ messages[0].content + 1 }}", "the model's chat template fails (TypeError"),
])
def test_a_broken_chat_template_is_one_clear_line(checkpoints, tmp_path, capsys, template, message):
    folder = copy_of(checkpoints, tmp_path)
    edit_json(folder, "tokenizer_config.json", update(chat_template=template))
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")[::2], message)
    llm = tinyflow.LLM(str(folder), device="cpu", compile=False)
    with pytest.raises(ValueError, match="chat template fails"):
        llm.chat([{"role": "user", "content": "Hi"}])
    # plain text needs no template: it generates what the undamaged checkpoint does
    want = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False).generate(["Hi"], max_new_tokens=2)
    assert llm.generate(["Hi"], max_new_tokens=2) == want


@pytest.mark.parametrize("message, error", [
    ({"role": "user"}, "message 0 (user) has no 'content': give its text as a string"),
    ({"role": "user", "content": None}, "message 0 (user) has no 'content': give its text as a string"),
    ({"role": "user", "content": 5}, "message 0 (user): 'content' must be a string or a list of text parts, got int"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
     "message 0 (user): content parts must be {\"type\": \"text\", \"text\": ...}: this model reads text only"),
    ({"content": "Hi"}, "message 0 has no 'role' (a string: system, developer, user, assistant, tool)"),
])
def test_a_malformed_chat_message_names_its_field_not_the_template(checkpoints, message, error):
    _, tok = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError) as refused:
        tok.render([message])
    assert str(refused.value) == error


def test_a_template_that_needs_a_missing_content_names_the_message(checkpoints, tmp_path):
    """SmolLM2's template adds each message's content to a string: an assistant turn with content null (which
    OpenAI's API and the server admit, for a turn that only calls tools) cannot be rendered by it. The message
    says which one, instead of blaming the template."""
    folder = copy_of(checkpoints, tmp_path, "qwen3")
    edit_json(folder, "tokenizer_config.json",
              update(chat_template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"))
    llm = tinyflow.LLM(str(folder), device="cpu", compile=False)
    with pytest.raises(ValueError, match=r"^message 1 \(assistant\) has no content, which this model's chat "
                                         r"template needs: give it one \(\"\" for none\)$"):
        llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}])
    with pytest.raises(ValueError, match=r"^message 0 has no 'role'"):
        llm.chat([{"content": "Hi"}])
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]  # as the server takes them
    assert llm.chat([{"role": "user", "content": parts}], max_new_tokens=3) == \
        llm.chat([{"role": "user", "content": "Hi there"}], max_new_tokens=3)


def test_chat_asked_of_a_model_without_a_template_says_to_drop_it(checkpoints, tmp_path, capsys):
    folder = copy_of(checkpoints, tmp_path)
    edit_json(folder, "tokenizer_config.json", lambda c: {k: v for k, v in c.items() if k != "chat_template"})
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--chat", "--no-compile")[::2], "drop --chat")


def test_a_model_path_that_is_a_file_says_it_is_a_file_not_a_model_folder(checkpoints, capsys):
    one_line_error(*cli(capsys, "--model", checkpoints["qwen2"] / "config.json", "--prompt", "Hi")[::2],
                   "config.json is a file, not a model folder: give the folder that holds config.json")


def add_tokens(folder, n):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(n)])
    tok.save(str(folder / "tokenizer.json"))


def store_as_int(folder, name):
    weights = load_file(folder / "model.safetensors")
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, folder / "model.safetensors")


@pytest.mark.parametrize("damage, message", [
    (lambda f: add_tokens(f, 30), "the tokenizer has ids up to 329 but the model's vocab_size is 320"),
    (lambda f: edit_json(f, "generation_config.json", update(eos_token_id=[7, 320])),
     "eos_token_id 320 (generation_config.json) is outside the model's vocabulary of 320 ids"),
    (lambda f: store_as_int(f, "model.layers.0.self_attn.q_proj.weight"),
     "weight 'model.layers.0.self_attn.q_proj.weight' of model.safetensors is stored as torch.int32"),
], ids=["tokenizer", "eos", "int-weight"])
def test_a_tokenizer_eos_id_or_weight_the_model_cannot_use_is_refused_at_load(checkpoints, tmp_path, capsys,
                                                                              damage, message):
    """Each loaded and generated before, so a prompt with a high id failed only later (or never)."""
    folder = copy_of(checkpoints, tmp_path)
    damage(folder)
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--max-new-tokens", "2", "--no-compile")[::2],
                   message)


# ---- the command line ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--policy", "tova"], "--policy only applies to a cache with a budget: add --budget N"),
    (["--sinks", "4", "--window", "8"], "--sinks and --window only apply to a cache with a budget"),
    (["--prompt-compression", "streaming"], "--prompt-compression only applies"),
    (["--policy", "full", "--budget", "64"], "--policy full keeps every token: drop --budget"),
    (["--policy", "full", "--sinks", "2"], "--policy full keeps every token: drop --sinks"),
    (["--seed", "99999999999999999999999", "--temperature", "1"], "seeds must fit in 64 bits"),
    (["-n", "2"], "-n 2: generate.py answers each copy of the prompt once; for 2 samples of it, give --batch-size 2 "
                  "--temperature T (> 0)"),
    (["--n", "3"], "for 3 samples of it, give --batch-size 3"),
    (["--top-p", "0.5"], "--top-p only applies when sampling, and this decodes greedily (temperature 0, the model"),
    (["--seed", "3", "--top-k", "5", "--temperature", "0"], "--top-k and --seed only apply when sampling"),
    (["--repetition-penalty", "1e-300"], "--repetition-penalty must be a number from 1e-30 to 1e30 (1: none), got 1e-300"),
    (["--temperature", "1", "--top-k", "100000000000000000000"],
     "--top-k must be an integer from 0 (no limit) to 2^63 - 1, got 100000000000000000000"),
    (["--prompt", "caf\udcff"], "the text is not valid Unicode (it holds a lone surrogate"),
    (["--max-new-tokens", "600"], "positions, past the model's max_position_embeddings 512"),
    (["--sinks", "-1", "--budget", "64"], "expected a non-negative integer"),
    (["--sinks", "\u00b2", "--budget", "64"], "--sinks: expected a non-negative integer, got '\u00b2'"),  # a digit to isdigit
])
def test_settings_that_would_be_ignored_or_overflow_are_refused(checkpoints, capsys, args, message):
    one_line_error(*cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--no-compile", *args)[::2],
                   message)


def test_the_stats_line_names_the_policy_and_compares_the_same_rows(checkpoints, capsys):
    """8 prompts through 2 rows: a full cache for the same 2 rows, each holding the longest sequence, is what
    the compressed cache is compared with (not one holding every prompt of the run at once)."""
    model, tok = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    prompts = [tok.encode(t) for t in ["Hello world", "The quick brown fox", "2 + 3", "lazy"] * 2]
    outs, stats = Engine(model, compile=False).generate(prompts, 50, [], 40, batch_size=2)
    longest = max(len(p) + len(o) for p, o in zip(prompts, outs))
    assert stats.full_kv_bytes == KVCache.bytes_needed(model.cfg, 2, longest, torch.float32, POLICIES["full"])
    assert "KV cache longflow, 40 slots/seq" in stats.line() and "a full cache would need" in stats.line()
    code, _, err = cli(capsys, "--model", checkpoints["qwen3"], "--prompt", "Hi", "--max-new-tokens", "4",
                       "--no-compile")
    assert code == 0 and "KV cache full," in err and "a full cache would need" not in err


def test_help_shows_the_defaults(capsys, monkeypatch):
    import bench
    import eval as ev
    monkeypatch.setattr(sys, "argv", ["bench.py", "--help"])  # bench.main reads its options from sys.argv
    for main, defaults in ((lambda: generate.main(["--help"]), ["(default: SmolLM2-135M-Instruct,", "(default: 512)",
                                                                 generate.DEFAULT_PROMPT]),
                           (lambda: ev.main(["--help"]), ["default: Qwen/Qwen3-8B", "default: 0"]),
                           (bench.main, ["default: Qwen3-8B", "default: 16384"])):
        with pytest.raises(SystemExit) as stop:
            main()
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert stop.value.code == 0 and all(d in out for d in defaults), out


def smallest_budget(name: str) -> int:
    """The smallest budget resolve_policy accepts for the policy with its own sinks and window."""
    def accepted(budget):
        try:
            return bool(resolve_policy(name, budget))
        except ValueError:
            return False
    return next(b for b in range(1, 1000) if accepted(b))


def test_the_smallest_budget_of_each_policy_is_in_help_and_the_readme(capsys):
    smallest = {name: smallest_budget(name) for name, p in POLICIES.items() if p.evicts}
    usual = max(set(smallest.values()), key=list(smallest.values()).count)
    others = ", ".join(f"{n} for {name}" for name, n in smallest.items() if n != usual)
    said = f"at least {usual} slots ({others}"
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for text in (capsys.readouterr().out, readme):
        assert said in " ".join(text.split()), said  # argparse and the README wrap lines


def test_prompt_file_dash_reads_standard_input_and_a_file_must_be_utf8(checkpoints, tmp_path, capsys, monkeypatch):
    """(The command line in this process, its standard input the bytes a pipe gives.)"""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello world"), encoding="utf-8"))
    piped_code, piped_out, piped_err = cli(capsys, "--model", checkpoints["qwen3"], "--prompt-file", "-", "--no-chat",
                                           "--max-new-tokens", "2", "--device", "cpu", "--no-compile")
    code, out, err = cli(capsys, "--model", checkpoints["qwen3"], "--prompt", "Hello world", "--no-chat",
                         "--max-new-tokens", "2", "--no-compile")
    assert piped_code == 0 and code == 0, piped_err
    assert piped_err.splitlines()[-1].split(" tok,")[0] == err.splitlines()[-1].split(" tok,")[0]  # same prompt
    assert piped_out == out  # and the same answer
    latin1 = tmp_path / "prompt.txt"
    latin1.write_bytes("café".encode("latin-1"))
    one_line_error(*cli(capsys, "--model", checkpoints["qwen3"], "--prompt-file", latin1)[::2],
                   f"prompt file {latin1} is not UTF-8 text (byte 3 is 0xe9)")


def test_a_model_path_with_a_tilde_is_the_home_folder(checkpoints, tmp_path, capsys, monkeypatch):
    shutil.copytree(checkpoints["qwen3"], tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _, err = cli(capsys, "--model=~/ckpt", "--prompt", "Hi", "--max-new-tokens", "2", "--no-compile")
    assert code == 0 and "generated" in err, err


def start(*args):
    return subprocess.Popen([sys.executable, "generate.py", *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_ctrl_c_prints_what_was_generated_and_its_stats_then_exits_130(checkpoints):
    run = start("--model", checkpoints["llama"], "--prompt", "Hello", "--no-chat", "--budget", "40",
                "--max-new-tokens", "100000", "--allow-long-context", "--device", "cpu", "--no-compile")
    first = run.stdout.read(1)  # the stream has begun: the model is generating
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130 and first, err
    assert "Traceback" not in err and err.strip().endswith("interrupted")
    assert "generated" in err and "KV cache longflow, 40 slots/seq" in err  # the stats of what was generated
    assert "KV cache" not in out  # standard output holds the answer alone


def test_a_second_ctrl_c_while_the_first_ones_output_is_written_is_ignored(checkpoints):
    """Two SIGINTs 20 ms apart (a double key press, or a wrapper signalling the process group too): the second
    one used to land in the output's writing or the interpreter's shutdown, a traceback."""
    run = start("--model", checkpoints["llama"], "--prompt", "Hello", "--no-chat", "--budget", "40",
                "--max-new-tokens", "100000", "--allow-long-context", "--device", "cpu", "--no-compile")
    run.stdout.read(1)
    run.send_signal(signal.SIGINT)
    time.sleep(0.02)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130 and "Traceback" not in err and err.strip().endswith("interrupted"), err
    assert "KV cache longflow, 40 slots/seq" in err


def test_a_reader_that_goes_away_ends_the_run_quietly(checkpoints):
    """`generate.py ... | head -c 1`: the pipe closes while text is still streaming."""
    run = start("--model", checkpoints["llama"], "--prompt", "Hello", "--no-chat", "--max-new-tokens", "200",
                "--device", "cpu", "--no-compile")
    run.stdout.read(1)
    run.stdout.close()
    err = run.stderr.read()
    assert run.wait(timeout=300) == 1 and err == "", err


# ---- the API -----------------------------------------------------------------------------------------------
def test_api_takes_id_sequences_of_any_kind_and_refuses_text_where_a_list_belongs(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    ids = [5, 6, 7]
    want = llm.generate([ids], max_new_tokens=4)
    for same in (np.array(ids), torch.tensor(ids), tuple(ids), [np.int64(i) for i in ids]):
        assert llm.generate([same], max_new_tokens=4) == want
    with pytest.raises(TypeError, match="chat takes a list of messages"):
        llm.chat("hello")  # not five conversations, one per character
    with pytest.raises(TypeError, match="not dict"):
        llm.generate({"a": "Hi"})  # not a generation for each key
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([np.array([1.5, 2.0])])
    with pytest.raises(ValueError, match="seeds must fit in 64 bits"):
        llm.generate(["Hi"], seed=2**63, temperature=1.0)
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([])
    # numpy integers are integers everywhere, and a message's content is the template's to read
    numpy_ints = llm.generate(["Hi"], max_new_tokens=np.int64(3), seed=np.int64(5), temperature=1.0, ignore_eos=True)
    assert numpy_ints == llm.generate(["Hi"], 3, seed=5, temperature=1.0, ignore_eos=True)
    assert numpy_ints != llm.generate(["Hi"], 3, seed=6, temperature=1.0, ignore_eos=True)  # the seed was used
    # not refused: the conversation as the template renders it (how it renders None: test_model.py)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert llm.chat(messages, max_new_tokens=2) == llm.generate([llm.tokenizer.chat(messages)], max_new_tokens=2)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(model=8), TypeError, "model must be a Hugging Face id or a folder path, not int"),  # None: the default
    (dict(kv_dtype=["fp8"]), ValueError, "kv_dtype must be one of auto, fp8, got ['fp8']"),
    (dict(dtype=torch.int8), ValueError, "dtype must be bfloat16, float16 or float32 (a name or a torch.dtype), "
                                         "got torch.int8"),
    (dict(dtype=torch.float64), ValueError, "dtype must be bfloat16, float16 or float32 (a name or a torch.dtype), "
                                            "got torch.float64"),  # as the command line's --dtype
    (dict(compile="no"), TypeError, "compile must be True or False, got 'no'"),
    (dict(allow_long_context=1), TypeError, "allow_long_context must be True or False, got 1"),
    (dict(data_parallel=True), ValueError, "data_parallel=True shares the prompts out among torchrun's processes: "
                                           "start under torchrun --nproc-per-node N, or drop it"),  # as --dp
])
def test_llm_arguments_of_the_wrong_kind_are_refused_before_the_model_loads(checkpoints, monkeypatch, kwargs, error,
                                                                           message):
    monkeypatch.setattr(tinyflow, "load", lambda *args: pytest.fail("the model was loaded"))
    model = kwargs.pop("model", str(checkpoints["qwen3"]))
    with pytest.raises(error) as refused:
        tinyflow.LLM(model, device="cpu", **kwargs)
    assert str(refused.value) == message


def test_generate_refuses_a_flag_that_is_not_a_bool_or_an_on_output_it_cannot_call_before_generating(checkpoints,
                                                                                                     monkeypatch):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    with monkeypatch.context() as m:
        m.setattr(llm.engine, "generate", lambda *args, **kwargs: pytest.fail("it generated"))
        with pytest.raises(TypeError, match=r"^ignore_eos must be True or False, got 'yes'$"):
            llm.generate(["Hi"], ignore_eos="yes")
        with pytest.raises(TypeError, match=r"^on_output must be a function of \(i, Output\), got int$"):
            llm.generate(["Hi"], on_output=5)
    # numpy numbers are taken as Python's: floats as integers are
    llm.set_policy(np.int64(40))
    sampled = llm.generate(["Hi"], 3, temperature=np.float32(1.0), top_p=np.float32(0.5), seed=1, ignore_eos=True)
    assert sampled == llm.generate(["Hi"], 3, temperature=1.0, top_p=0.5, seed=1, ignore_eos=True)


def test_api_policy_and_budget_must_go_together(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)  # no budget: the full cache
    assert llm.policy.name == "full"
    llm.set_policy(40)  # a budget alone: LongFlow
    assert llm.policy.name == "longflow"
    with pytest.raises(ValueError, match="policy 'tova' evicts tokens .* give the budget"):
        llm.set_policy(None, "tova")
    with pytest.raises(ValueError, match="the full policy keeps every token"):
        llm.set_policy(40, "full")
    with pytest.raises(ValueError, match="the full policy keeps every token"):
        llm.set_policy(None, sinks=4)


def test_context_past_max_position_embeddings_only_when_allowed(checkpoints, tmp_path):
    """A copy of the tiny Qwen3 trained (says its config) for 32 positions: a prompt of 20 and 12 new tokens
    fill them exactly and run; one more token is refused, unless allowed (and so is a budget, of at least 33 slots,
    past those 32: test_a_budget_past_the_models_context_is_refused_unless_long_context_is_allowed)."""
    folder = copy_of(checkpoints, tmp_path, "qwen3")
    edit_json(folder, "config.json", update(max_position_embeddings=32))
    model, _ = load(str(folder), torch.device("cpu"), torch.float32)
    outs, _ = Engine(model, compile=False).generate([[1] * 20], 12, [])
    assert len(outs[0]) == 12
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ new tokens \(13\) = 33 positions, past the "
                                         r"model's max_position_embeddings 32"):
        Engine(model, compile=False).generate([[1] * 20], 13, [])
    outs, _ = Engine(model, compile=False, allow_long_context=True).generate([[1] * 20], 50, [], 40)
    assert len(outs[0]) == 50
    assert len(Engine(model, compile=False).score([[1] * 20], [[2] * 12])[0][0]) == 12  # teacher forcing: the same
    with pytest.raises(ValueError, match="max_position_embeddings 32"):
        Engine(model, compile=False).score([[1] * 20], [[2] * 13])


def test_a_batch_too_large_for_memory_names_the_batch_size(checkpoints):
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"lower the batch size \(1000000\)"):
        memory.pick_batch(Engine(model, compile=False), 10**6, 10**6, 10**6, 10)


def importing_torch(pid: int) -> bool:
    """Whether process pid has begun `import torch`: torch's C++ library is mapped into it (Linux)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except FileNotFoundError:  # it has ended
        return False
    return "libtorch_cpu" in maps or "libtorch_cuda" in maps


@pytest.mark.parametrize("script", ["generate.py", "server.py", "bench.py"])
def test_ctrl_c_while_torch_still_imports_is_one_line(script):
    """A Ctrl-C inside `import torch`, before main() can catch anything: sent as soon as torch's library is
    mapped into the process (seen in /proc, however slow the machine), while the rest of torch, then the
    script's own modules, still import."""
    import time
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, script), "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    while p.poll() is None and not importing_torch(p.pid):
        time.sleep(0.001)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert (p.returncode, err, out) == (130, "interrupted\n", "")


@pytest.mark.parametrize("rank, world, printed", [("0", "2", True), ("1", "2", False), ("1", "1", True)])
def test_under_torchrun_an_argparse_error_is_printed_by_rank_0_alone(checkpoints, capsys, monkeypatch, rank, world,
                                                                     printed):
    """Every rank parses the same command line: rank 0 says what is wrong, the others exit as quietly; a RANK
    left in the environment without torchrun's WORLD_SIZE is no rank."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    code, _, err = cli(capsys, "--model", checkpoints["qwen2"], "--max-new-tokens", "0")
    says = "error: argument --max-new-tokens: expected a positive integer" if printed else ""
    assert code == 2 and err.startswith(says) and err.count("\n") == printed, err


# ---- settings that would be ignored, through the API as on the command line --------------------------------
def test_api_refuses_top_p_top_k_and_seed_when_greedy_as_the_command_line_does(checkpoints):
    """The README's promise, a setting that would be ignored is refused, holds for LLM.generate too; top_p 1 and
    top_k 0 ask for nothing, so nothing is ignored."""
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False)
    for given, named in ((dict(top_p=0.5), "top_p only applies"), (dict(top_k=5, seed=3), "top_k and seed only apply"),
                         (dict(temperature=0.0, seed=0), "seed only applies")):
        with pytest.raises(ValueError, match=re.escape(f"{named} when sampling, and this decodes greedily "
                                                       f"(temperature 0): give temperature= above 0 or drop")):
            llm.generate(["Hi"], max_new_tokens=2, **given)
    assert len(llm.generate(["Hi"], max_new_tokens=2, top_p=1.0, top_k=0, ignore_eos=True)[0].token_ids) == 2


def no_thinking_switch(checkpoints, tmp_path):
    """A copy of the tiny Qwen3 whose chat template never reads enable_thinking (as Qwen2.5's)."""
    folder = copy_of(checkpoints, tmp_path, "qwen3")
    edit_json(folder, "tokenizer_config.json", lambda c: {**c, "chat_template": c["chat_template"].split(
        "{% if enable_thinking")[0] + "{% endif %}"})
    return folder


@pytest.mark.parametrize("flag", ["--thinking", "--no-thinking"])
def test_a_thinking_switch_the_chat_template_never_reads_is_refused(checkpoints, tmp_path, capsys, flag):
    folder = no_thinking_switch(checkpoints, tmp_path)
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile", flag)[::2],
                   f"{flag} would be ignored: this model's chat template has no thinking switch (it never reads "
                   f"enable_thinking); drop it")
    llm = tinyflow.LLM(str(folder), device="cpu", compile=False)
    with pytest.raises(ValueError, match=re.escape("enable_thinking=False would be ignored: this model's chat "
                                                   "template has no thinking switch")):
        llm.chat([{"role": "user", "content": "Hi"}], enable_thinking=False, max_new_tokens=2)
    assert len(llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2


def test_a_thinking_switch_with_a_plain_text_prompt_is_refused(checkpoints, capsys):
    one_line_error(*cli(capsys, "--model", checkpoints["qwen3"], "--prompt", "Hi", "--no-compile", "--no-chat",
                        "--no-thinking")[::2],
                   "--no-thinking only applies to a prompt in the model's chat template: drop --no-chat or drop it")


def test_a_thinking_switch_for_a_model_without_a_chat_template_says_so(checkpoints, capsys, tmp_path):
    """No --no-chat was given: the refusal says the model has no template, not to drop a flag nobody gave."""
    folder = tmp_path / "base"
    shutil.copytree(checkpoints["qwen3"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile", "--thinking")[::2],
                   "--thinking would be ignored: this model has no chat template to switch thinking in; drop it")


def test_a_budget_past_the_models_context_is_refused_unless_long_context_is_allowed(checkpoints, capsys):
    """The tiny models' max_position_embeddings is 512: slots past it could never be filled."""
    says = ("budget 600 is more KV slots than a sequence can fill: the model's context (max_position_embeddings) is "
            "512 tokens; give a budget of at most 512")
    one_line_error(*cli(capsys, "--model", checkpoints["qwen2"], "--prompt", "Hi", "--no-compile", "--budget", 600,
                        "--max-new-tokens", 2)[::2], says)
    with pytest.raises(ValueError, match=re.escape(says)):
        tinyflow.LLM(str(checkpoints["qwen2"]), budget=600, device="cpu", compile=False)
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), budget=512, device="cpu", compile=False)
    llm.set_policy(600)
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.generate(["Hi"], max_new_tokens=2)
    long = tinyflow.LLM(str(checkpoints["qwen2"]), budget=600, device="cpu", compile=False, allow_long_context=True)
    assert len(long.generate(["Hi"], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2


# ---- messages: counts in words, and what to do -----------------------------------------------------------
def test_an_id_outside_the_vocabulary_names_its_prompt_and_the_id(checkpoints):
    """The README's example once held Qwen's ids, which fail on a smaller vocabulary: the message says which
    prompt and which id, and where right ids come from."""
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False)
    with pytest.raises(ValueError, match=re.escape("prompt token ids must be integers in [0, 320) for this model; "
                                                   "prompt 1 holds 151644 (ids from another model's tokenizer? "
                                                   "encode text with this one's)")):
        llm.generate(["Hi", [151644, 872], [5]], max_new_tokens=2)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "151644" not in readme and 'llm.generate(["What is 17 * 23?", llm.tokenizer.encode(' in readme


def test_n_other_than_1_says_how_to_get_several_samples(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen2"]), device="cpu", compile=False)
    with pytest.raises(ValueError, match=re.escape("n=3: generate returns one output per prompt; for 3 samples of a "
                                                   "prompt, give it 3 times in prompts with a temperature above 0")):
        llm.generate(["Hi"], n=3)


def test_counts_in_messages_are_singular_for_one(checkpoints):
    model, _ = load(str(checkpoints["qwen2"]), torch.device("cpu"), torch.float32)
    engine = Engine(model, compile=False)
    with pytest.raises(ValueError, match=re.escape("prompt (1 token) + new tokens (600) = 601 positions")):
        engine.generate([[5]], 600, [])
    with pytest.raises(ValueError, match=re.escape("give one continuation per prompt: 1 prompt, 2 continuations")):
        engine.score([[5]], [[6], [7]])
    assert memory.rows_need(1, 1) == "1 sequence of 1 KV slot needs"
    assert memory.rows_need(3, 64) == "3 sequences of 64 KV slots need"
