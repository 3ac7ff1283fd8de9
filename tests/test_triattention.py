"""TriAttention's calibration and how a model finds its statistics: what `eval.py calibrate` measures equals the
means of the queries transformers computes, it writes where the policy looks (never into the model's folder),
and a model without statistics, or with another model's, is refused in one line that says what to run. (Its
score against the authors' formula: tests/test_rules.py; with every other rule through the engine:
test_cache.py, test_generate.py, test_ladder.py.)"""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import calibration
import eval as evaluate
import generate
import tinyflow
from conftest import CORPUS
from model import Tokenizer, Config, read_json

TEXT = " ".join(CORPUS)
ROOT = Path(__file__).resolve().parent.parent


def transformers_queries(folder, arch: str, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's queries before RoPE [T, H, D], as transformers computes them: Qwen3's after q_norm, the
    others' q_proj outputs (fp32)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seen = []
    for layer in model.model.layers:
        module = layer.self_attn.q_norm if arch == "qwen3" else layer.self_attn.q_proj
        module.register_forward_hook(lambda m, args, out: seen.append(out.reshape(len(ids), -1, head_dim)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_calibration_is_the_mean_of_the_pre_rope_queries_transformers_computes(checkpoints, arch, tmp_path):
    folder = checkpoints[arch]
    out = tmp_path / "stats.safetensors"
    path, n = evaluate.calibrate(str(folder), TEXT, 100, out, "cpu")
    assert path == out and n == 100
    ids = Tokenizer(str(folder), Config.from_dict(read_json(str(folder), "config.json"))).encode(TEXT)[:100]
    queries = torch.stack(transformers_queries(folder, arch, ids)).double()  # [L, T, H, D]
    re, im = queries.chunk(2, -1)  # RoPE's pairs (f, f + D/2)
    saved = load_file(out)
    # fp32 projections in two libraries, averaged in other orders: equal to rounding
    torch.testing.assert_close(saved["q_mean"], torch.stack((re, im), -1).mean(1).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved["q_abs_mean"], torch.hypot(re, im).mean(1).float(), rtol=1e-5, atol=1e-6)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["fingerprint"] == calibration.fingerprint(folder) and meta["tokens"] == "100"


def test_the_command_writes_into_the_cache_by_fingerprint_and_nothing_into_the_model_folder(checkpoints, tmp_path,
                                                                                          monkeypatch, capsys):
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3"], folder)
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path / "cache"))
    evaluate.main(["calibrate", "--model", str(folder), "--device", "cpu"])
    path = tmp_path / "cache" / "triattention" / f"{calibration.fingerprint(folder)}.safetensors"
    assert f"wrote {path}" in capsys.readouterr().out and path.exists()
    assert sorted(p.name for p in folder.iterdir()) == before


def test_the_default_text_is_the_rust_book_chapters_the_fidelity_protocol_does_not_score(checkpoints, tmp_path,
                                                                                        monkeypatch, capsys):
    """docs/quality.md's fidelity protocol scores the first 4 chapters (--rust-texts 4): the command reads chapters
    5 and 6, joined, cut to the model's 512 positions, and its file names them (eval.py fidelity reads it back)."""
    folder = str(checkpoints["qwen3"])
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path / "cache"))
    evaluate.main(["calibrate", "--model", folder, "--device", "cpu"])
    assert capsys.readouterr().out.endswith("over 512 tokens of data/rust_book.jsonl, chapters 5-6\n")
    chapters = [json.loads(line)["text"] for line in (ROOT / "data" / "rust_book.jsonl").read_text().splitlines()]
    chapters_5_6, _ = evaluate.calibrate(folder, "\n\n".join(chapters[4:]), 512, tmp_path / "5-6.safetensors", "cpu")
    path = calibration.default_path(calibration.fingerprint(folder))
    made, want = load_file(path), load_file(chapters_5_6)
    assert made.keys() == want.keys() and all(torch.equal(made[name], want[name]) for name in want)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["text"] == "data/rust_book.jsonl, chapters 5-6" and f.metadata()["tokens"] == "512"


def test_the_fingerprint_is_the_checkpoints_whatever_the_dtype_it_loads_in_and_differs_between_models(checkpoints):
    llms = [tinyflow.LLM(str(checkpoints["qwen3"]), budget=40, policy="triattention", device="cpu", dtype=dtype,
                         compile=False) for dtype in ("float32", "bfloat16")]
    assert all(llm.engine.for_model(llm.policy).stats is not None for llm in llms)
    assert len({calibration.fingerprint(folder) for folder in checkpoints.values()}) == 3


def test_a_model_without_statistics_is_refused_in_one_line_saying_what_to_run(checkpoints, tmp_path, monkeypatch,
                                                                               capsys):
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path))  # an empty cache
    folder = checkpoints["qwen3"]
    with pytest.raises(ValueError, match=f"needs this model's query statistics .*; run: python eval.py calibrate "
                                         f"--model {folder}$"):
        tinyflow.LLM(str(folder), budget=40, policy="triattention", device="cpu", compile=False)
    with pytest.raises(SystemExit) as stop:
        generate.main(["--model", str(folder), "--prompt", "Hi", "--no-chat", "--budget", "40", "--policy",
                       "triattention", "--device", "cpu", "--no-compile", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "run: python eval.py calibrate --model" in err


def test_statistics_made_for_another_model_are_refused(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path))
    for other, folder in (("qwen2", "qwen3"), ("llama", "qwen2")):  # other heads and sizes; other RoPE
        theirs = calibration.default_path(calibration.fingerprint(checkpoints[other]))
        ours = calibration.default_path(calibration.fingerprint(checkpoints[folder]))
        theirs.parent.mkdir(parents=True, exist_ok=True)
        evaluate.calibrate(str(checkpoints[other]), TEXT, 50, theirs, "cpu")
        shutil.copy(theirs, ours)  # put where this model's statistics belong
        with pytest.raises(ValueError, match="holds query statistics of another model .*; run: python eval.py "
                                             "calibrate --model"):
            tinyflow.LLM(str(checkpoints[folder]), budget=40, policy="triattention", device="cpu", compile=False)


def test_the_statistics_a_layer_reads_are_those_of_its_own_layer_and_heads(checkpoints):
    """The engine hands every layer its own statistics (Layer.data), made once at load from the file."""
    import policies
    llm = tinyflow.LLM(str(checkpoints["llama"]), budget=40, policy="triattention", device="cpu", compile=False)
    llm.generate(["Hello world"], max_new_tokens=4)
    stats = llm.engine.cache.policy.stats
    for i, layer in enumerate(llm.engine.cache.layers):
        want = policies.tri_layer_data(stats, i)
        assert set(layer.data) == set(want) and all(torch.equal(layer.data[k], want[k]) for k in want)
    saved = load_file(calibration.default_path(calibration.fingerprint(checkpoints["llama"])))
    assert torch.equal(stats.q_mean, saved["q_mean"]) and torch.equal(stats.inv_freq, llm.model.inv_freq)


@pytest.mark.parametrize("args, message", [
    (["--tokens", "600"], "--tokens 600: the text has .* tokens and the model reads at most 512 positions"),
    (["--text", "missing.txt"], "cannot read missing.txt"),
    (["--out", "{model}/stats.safetensors"], "is inside the model's folder"),
    (["--out", "{model}"], "is inside the model's folder"),
    (["--out", "{tmp}"], "is a folder: give the file to write"),
    (["--text", "{tmp}/empty.txt"], "holds no tokens"),
])
def test_bad_calibration_input_is_one_line(checkpoints, capsys, tmp_path, args, message):
    folder = str(checkpoints["qwen3"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["calibrate", "--model", folder, "--device", "cpu",
                       *(a.format(model=folder, tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err
