"""eval.py fidelity: teacher-forced comparison of runs with the full cache, in lock-step, on a tiny checkpoint."""
import json

import pytest
import torch

import eval as ev
import tinyflow
from generate import Engine


def fidelity(folder, out, *runs, extra=()):
    ev.main(["fidelity", "--model", str(folder), "--runs", *runs, "--texts", "rust", "--rust-texts", "2",
             "--prompt-tokens", "16", "--tokens", "48", "--measure-last", "32", "--free-tokens", "24",
             "--out", str(out), "--device", "cpu", "--no-compile", *extra])


def test_a_budget_that_holds_everything_measures_exactly_no_difference(checkpoints, tmp_path):
    out = tmp_path / "fid"
    fidelity(checkpoints["qwen3"], out, "longflow:100", "longflow:40", "streaming:40")
    roomy = json.loads((out / "fidelity_longflow_100.json").read_text())
    assert (roomy["nll_increase"], roomy["top1"], roomy["kl"]) == (0.0, 1.0, 0.0)  # 16 + 48 tokens fit in 100
    assert (roomy["first_divergence"], roomy["equal_share"]) == (24, 1.0)
    small = json.loads((out / "fidelity_longflow_40.json").read_text())
    assert small["kl"] > 0 and small["top1"] < 1 and len(small["per_text"]) == 2
    assert small["texts"] == ["rust/ch04-01-what-is-ownership", "rust/ch08-02-strings"]
    table = (out / "fidelity.md").read_text()
    assert "| longflow | 40 |" in table and "| streaming | 40 |" in table
    assert roomy["diverged"] == 0 and next(line for line in table.splitlines() if "| longflow | 100 |" in line
                                           ).endswith("| none in 24 | 100% |")  # not 24, which reads as a position

    # a second call finds every run finished with the same settings and scores nothing again
    before = {p.name: p.read_text() for p in out.glob("fidelity_*.json")}
    fidelity(checkpoints["qwen3"], out, "longflow:100", "longflow:40", "streaming:40")
    assert {p.name: p.read_text() for p in out.glob("fidelity_*.json")} == before


def summary(policy, budget, nll, first, diverged):
    return dict(policy=policy, budget=budget, prompt_compression="snapkv", nll_increase=nll, nll_increase_err=0.05,
                top1=0.9, top1_err=0.01, kl=0.1, kl_err=0.01, first_divergence=first, diverged=diverged,
                equal_share=0.5, texts=["a", "b"], settings={"free_tokens": 32})


def test_free_generation_says_none_diverged_or_that_its_mean_is_a_lower_bound(tmp_path):
    """A text whose greedy tokens never left the full cache's counts at the cap (--free-tokens 32)."""
    ev.write_fidelity_table([summary("h2o", 64, 0.3, 10, 2), summary("longflow", 64, 0.3, 32, 0),
                             summary("tova", 64, 0.3, 20, 1)], tmp_path)
    cells = [line.split(" | ")[-2] for line in (tmp_path / "fidelity.md").read_text().splitlines()[2:]]
    assert cells == ["10", "none in 32", "≥ 20 (1 of 2 texts: none in 32)"]


def test_the_policies_error_bars_at_one_budget_stand_side_by_side(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    ev.write_fidelity_table([summary(p, b, 0.3, 10, 2) for p in ("h2o", "longflow", "tova") for b in (64, 128)],
                            tmp_path)
    (fig,) = saved
    lines = {bars.get_label(): list(bars.lines[0].get_xdata()) for bars in fig.axes[0].containers}
    assert sorted(lines) == ["h2o", "longflow", "tova"]
    for at in zip(*lines.values()):  # each budget: three x positions, in the policies' order, around it
        assert at[0] < at[1] < at[2] and at[1] in (64, 128)


def test_one_text_and_one_run_are_counted_in_the_singular(checkpoints, tmp_path, monkeypatch, capsys):
    def ctrl_c(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(ev, "score_in_lock_step", ctrl_c)
    with pytest.raises(SystemExit) as stop:
        fidelity(checkpoints["qwen3"], tmp_path / "fid", "longflow:40", extra=["--rust-texts", "1"])
    out, err = capsys.readouterr()
    assert stop.value.code == 130
    assert "fidelity: budget 40: longflow:40 against the full cache, 1 text x 48 tokens\n" in out
    assert err.splitlines()[-1].startswith("interrupted: 0 runs of 1 measured and saved in ")


def test_lock_step_kl_equals_kl_of_the_kept_distributions(checkpoints):
    """KL(full || run) computed block by block as the runs advance together equals KL computed from every
    distribution of both runs kept whole (fine for a tiny model), with rows refilled on the way."""
    llm = tinyflow.LLM(str(checkpoints["llama"]), device="cpu", compile=False)
    texts = [{"prompt": llm.tokenizer.encode("Hello"), "continuation": llm.tokenizer.encode(" world" * 30)},
             {"prompt": llm.tokenizer.encode("The quick"), "continuation": llm.tokenizer.encode(" brown fox" * 12)}]
    full, [(scores, kl)] = ev.score_in_lock_step(llm, texts, [("tova", 36, "snapkv")], batch_size=1)

    def all_dists(budget, policy):
        kept = [dict() for _ in texts]
        Engine(llm.model, compile=False).score([t["prompt"] for t in texts], [t["continuation"] for t in texts],
                                               budget, policy, batch_size=1,
                                               on_dists=lambda p, i, d: kept[p].update({i: d}))
        return [torch.cat([k[i] for i in sorted(k)]) for k in kept]
    for f, r, k, s, text in zip(all_dists(None, "full"), all_dists(36, "tova"), kl, scores, texts):
        assert k == (f.exp() * (f - r)).sum(-1).tolist()  # the same rows in the same batch: bit for bit
        # and the distributions are those of the scored positions: they give the run's own log-probabilities
        assert r.gather(1, torch.tensor(text["continuation"])[:, None])[:, 0].tolist() == [x[1] for x in s]
    assert any(x > 0 for k in kl for x in k)


@pytest.mark.parametrize("runs, message", [(["full"], "at least one compressed run"),
                                           (["longflow"], "every compressed run needs a budget")])
def test_fidelity_without_a_run_to_compare_is_a_clear_error(checkpoints, tmp_path, capsys, runs, message):
    with pytest.raises(SystemExit) as stop:
        fidelity(checkpoints["qwen3"], tmp_path / "fid", *runs)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_fp8_runs_are_measured_against_the_full_precision_cache_the_full_one_included(checkpoints, tmp_path):
    out = tmp_path / "fid"
    fidelity(checkpoints["qwen3"], out, "full", "longflow:40", extra=["--kv-dtype", "fp8"])
    full, small = (json.loads((out / f"fidelity_{name}_fp8.json").read_text()) for name in ("full_all", "longflow_40"))
    assert full["kv_dtype"] == small["kv_dtype"] == "fp8" and full["budget"] is None
    assert 0 < full["kl"] < small["kl"]  # quantizing costs a little, evicting as well costs more
    table = (out / "fidelity.md").read_text()
    assert "| full fp8 | all |" in table and "| longflow fp8 | 40 |" in table


def test_fp8_weight_runs_are_measured_against_the_checkpoints_weights_the_full_one_included(checkpoints, tmp_path):
    """--weights fp8: the runs' model quantized at load, the reference the checkpoint's own."""
    out = tmp_path / "fid"
    fidelity(checkpoints["qwen3"], out, "full", "longflow:40", extra=["--weights", "fp8"])
    full, small = (json.loads((out / f"fidelity_{name}_fp8-weights.json").read_text())
                   for name in ("full_all", "longflow_40"))
    assert full["weights"] == small["weights"] == "fp8" and full["budget"] is None
    assert 0 < full["kl"] < small["kl"]  # quantizing the weights costs a little, evicting as well costs more
    assert "| full fp8-weights | all |" in (out / "fidelity.md").read_text()


def test_fp8_weights_of_a_checkpoint_stored_in_fp8_are_refused(checkpoints, tmp_path, capsys):
    """Its weights are FP8 blocks already: the runs would be the reference itself."""
    from conftest import write_fp8_checkpoint
    folder = write_fp8_checkpoint(checkpoints["qwen3"], tmp_path / "fp8", tmp_path / "values")
    with pytest.raises(SystemExit) as stop:
        fidelity(folder, tmp_path / "fid", "longflow:40", extra=["--weights", "fp8"])
    assert stop.value.code == 2 and "layers are FP8 blocks already" in capsys.readouterr().err
