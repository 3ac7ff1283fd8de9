"""eval.py end to end on a tiny random checkpoint: files written, resumable, the synthetic task."""
import json

import pytest

import eval as ev


def write_data(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [{"question": q, "true_answer": a} for q, a in (("What is 2 + 3?", "5"), ("Hello?", "1"),
                                                          ("The quick brown fox?", "7"))]
    path.write_text("".join(json.dumps(dict(r, index=i)) + "\n" for i, r in enumerate(rows)))
    return path


def run_eval(checkpoints, data, out, *extra):
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "full", "longflow:40",
             "--max-new-tokens", "12", "--samples", "2", "--batch-size", "4", "--out", str(out), "--device", "cpu",
             "--no-compile", *extra])


def test_eval_writes_items_summaries_and_table_then_resumes(checkpoints, tmp_path):
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    files = {p.name for p in out.iterdir()}
    assert {"mini_full_all.jsonl", "mini_longflow_40.jsonl", "mini_full_all.summary.json",
            "mini_longflow_40.summary.json", "compare.md"} <= files
    lines = (out / "mini_longflow_40.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert sorted((r["index"], r["sample"]) for r in rows) == [(i, s) for i in range(3) for s in range(2)]
    assert all(set(r) >= {"messages", "completion", "answer", "correct", "tokens", "budget_full"} for r in rows)
    summary = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert summary["items"] == 3 and summary["accuracy"] == 0.0  # random weights write no boxed answers

    # an interrupted run: the last line was cut off mid-write; resuming redoes only that generation, identically
    (out / "mini_longflow_40.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    run_eval(checkpoints, data, out)
    again = (out / "mini_longflow_40.jsonl").read_text().splitlines()
    assert len(again) == len(lines) and json.loads(again[-1]) == rows[-1]


def test_a_finished_run_run_again_keeps_its_measured_speed_and_kv_bytes(checkpoints, tmp_path):
    """The summary's tokens/s and KV bytes belong to the generations of that run: run again with nothing
    left to generate (after another policy generated), it keeps them, neither nulls nor the other's."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    common = ["--model", str(checkpoints["qwen3"]), "--data", str(data), "--max-new-tokens", "12", "--out",
              str(out), "--device", "cpu", "--no-compile"]
    ev.main([*common, "--runs", "longflow:40"])
    first = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert first["kv_bytes"] > 0 and first["tokens_per_s"] > 0
    ev.main([*common, "--runs", "full", "longflow:40"])
    again = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert (again["kv_bytes"], again["tokens_per_s"]) == (first["kv_bytes"], first["tokens_per_s"])


def test_each_generation_is_written_as_it_finishes_so_an_interrupted_run_keeps_them(checkpoints, tmp_path,
                                                                                  monkeypatch):
    """Ctrl-C while grading the third finished generation: the first two are already on disk, and the
    resumed run adds the others once each."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    real_grade, calls = ev.grade, []

    def grade_then_die(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_grade(*args)
    monkeypatch.setattr(ev, "grade", grade_then_die)
    with pytest.raises(SystemExit) as stop:  # Ctrl-C: one line and exit status 130
        run_eval(checkpoints, data, out)
    assert stop.value.code == 130
    assert len((out / "mini_full_all.jsonl").read_text().splitlines()) == 2
    monkeypatch.setattr(ev, "grade", real_grade)
    run_eval(checkpoints, data, out)
    for name in ("mini_full_all.jsonl", "mini_longflow_40.jsonl"):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert sorted((r["index"], r["sample"]) for r in rows) == [(i, s) for i in range(3) for s in range(2)]


def test_a_second_eval_on_the_same_run_is_refused(checkpoints, tmp_path):
    data, out = write_data(tmp_path), tmp_path / "runs"
    held = ev.lock_run(out / "mini_longflow_40.jsonl")  # another eval.py, still running
    with pytest.raises(SystemExit, match="another eval.py is writing .*mini_longflow_40.jsonl"):
        run_eval(checkpoints, data, out)
    held.close()
    run_eval(checkpoints, data, out)


def test_the_summary_counts_only_the_rows_of_the_current_limit_and_samples(checkpoints, tmp_path):
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)  # 3 items x 2 samples
    run_eval(checkpoints, data, out, "--samples", "1", "--limit", "2")
    summary = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert (summary["items"], summary["samples"], summary["rows"]) == (2, 1, 2)


def test_the_longflow_protocol_asks_decodes_and_grades_as_the_official_scripts(checkpoints, tmp_path):
    """A system message and the bare question, greedy with repetition penalty 1.2, the templated prompt cut
    to its first N tokens, a 2,048 budget for a run written without one, the first \\boxed{} graded; all of
    it in the run's settings."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow", "--protocol", "longflow",
             "--max-new-tokens", "6", "--prompt-tokens", "30", "--out", str(out), "--device", "cpu", "--no-compile"])
    settings = json.loads((out / "mini_longflow_2048.settings.json").read_text())
    assert settings["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.2}
    assert (settings["answer"], settings["prompt_tokens"], settings["max_new_tokens"]) == ("first", 30, 6)
    rows = [json.loads(line) for line in (out / "mini_longflow_2048.jsonl").read_text().splitlines()]
    assert rows[0]["messages"] == [{"role": "system", "content": ev.PROTOCOLS["longflow"].system},
                                   {"role": "user", "content": "What is 2 + 3?"}]
    assert all(r["prompt_cut"] for r in rows)  # the chat template alone is longer than 30 tokens here



def test_retrieval_items_hide_one_needle_in_real_prose_at_each_depth_in_turn():
    items = ev.retrieval_items(5, words=500, seed=1)
    assert items == ev.retrieval_items(5, words=500, seed=1)
    assert [it["depth"] for it in items] == list(ev.NEEDLE_DEPTHS)
    for it in items:
        assert it["question"].count(f"is {it['true_answer']}.") == 1 and it["needle"] in it["question"]
        assert 500 < len(it["question"].split()) < 550
        hay = it["question"].split("\n\n")[1]  # the haystack between the instruction and the question
        before = hay[:hay.index(it["needle"])].split()
        assert abs(len(before) - it["depth"] * 500) <= 1  # the needle sits at its depth, in words
        assert ev.grade(it, f"The number is {it['true_answer']}.")
        assert not ev.grade(it, f"The number is {it['true_answer'][:-1]}.")  # a cut-off value is wrong
    assert "Ownership" in " ".join(it["question"] for it in ev.retrieval_items(40, 500))  # the Rust book


def test_needle_kept_counts_the_rows_that_hold_every_digit_of_the_value(checkpoints):
    import tinyflow
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    it = ev.retrieval_items(1, words=60, seed=0)[0]
    conv = ev.build_messages(it["question"], None)
    assert ev.needle_kept(llm, conv, it) == 1.0  # the full cache keeps everything
    llm.set_policy(40, "streaming")  # 4 sinks and the last 35 prompt tokens: the needle, at 10%, is gone
    assert ev.needle_kept(llm, conv, it) == 0.0


def test_bad_run_spec_is_a_clear_error(checkpoints, tmp_path, capsys):
    import pytest
    for run in ("longflow:x", "full:64"):
        with pytest.raises(SystemExit, match=f"bad run '{run}'"):
            ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(write_data(tmp_path)), "--runs", run])


def test_resuming_with_other_settings_is_refused(checkpoints, tmp_path):
    import pytest
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    with pytest.raises(SystemExit, match="was written with other settings"):
        ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow:40",
                 "--max-new-tokens", "13", "--out", str(out), "--device", "cpu", "--no-compile"])


def test_needle_prompts_are_never_cut_and_a_run_named_twice_runs_once(checkpoints, tmp_path):
    """The longflow protocol cuts prompts to 1,000 tokens, which would cut the haystack and its question;
    needle items opt out. `longflow` and `longflow:2048` under that protocol are one run (one lock, one file)."""
    import tinyflow
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    item = ev.retrieval_items(1, words=1500, seed=0)[0]
    _, ids, cut = ev.prompt_ids(llm.tokenizer, item, ev.PROTOCOLS["longflow"])
    assert len(ids) > 1000 and not cut
    data, out = write_data(tmp_path), tmp_path / "runs"
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow", "longflow:2048",
             "--protocol", "longflow", "--max-new-tokens", "4", "--limit", "1", "--out", str(out), "--device", "cpu",
             "--no-compile"])
    assert len((out / "mini_longflow_2048.jsonl").read_text().splitlines()) == 1
