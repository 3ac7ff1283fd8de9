"""eval.py end to end on a tiny random checkpoint: files written, resumable, the synthetic task."""
import json

import eval as ev


def write_data(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [{"question": q, "true_answer": a} for q, a in (("What is 2 + 3?", "5"), ("Hello?", "1"),
                                                          ("The quick brown fox?", "7"))]
    path.write_text("".join(json.dumps(dict(r, index=i)) + "\n" for i, r in enumerate(rows)))
    return path


def run_eval(checkpoints, data, out, *extra):
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "full", "longflow:40",
             "--max-new-tokens", "12", "--samples", "2", "--chunk", "4", "--out", str(out), "--device", "cpu",
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
    assert all(set(r) >= {"prompt", "completion", "answer", "correct", "tokens", "budget_full"} for r in rows)
    summary = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert summary["items"] == 3 and summary["accuracy"] == 0.0  # random weights write no boxed answers

    # an interrupted run: the last line was cut off mid-write; resuming redoes only that generation, identically
    (out / "mini_longflow_40.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    run_eval(checkpoints, data, out)
    again = (out / "mini_longflow_40.jsonl").read_text().splitlines()
    assert len(again) == len(lines) and json.loads(again[-1]) == rows[-1]


def test_a_run_resumed_with_nothing_left_reports_no_kv_bytes_of_another_run(checkpoints, tmp_path):
    """The summary's KV bytes belong to the generations of that run: a complete run that is resumed
    after another policy generated reports none (it once reported the other policy's cache)."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    common = ["--model", str(checkpoints["qwen3"]), "--data", str(data), "--max-new-tokens", "12", "--out",
              str(out), "--device", "cpu", "--no-compile"]
    ev.main([*common, "--runs", "longflow:40"])
    assert json.loads((out / "mini_longflow_40.summary.json").read_text())["kv_bytes"] > 0
    ev.main([*common, "--runs", "full", "longflow:40"])
    assert json.loads((out / "mini_longflow_40.summary.json").read_text())["kv_bytes"] is None


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
