"""eval.py end to end on a tiny random checkpoint: files written, resumable, the synthetic task."""
import hashlib
import json
import os

import pytest
import torch

import calibration
import eval as ev
import kernel
from cache import KVCache
from policies import resolve_policy
from model import load


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


def refused(capsys, argv) -> str:
    """eval.py's answer to bad input: exit status 2 and one line on stderr, "error: ...", no traceback."""
    capsys.readouterr()  # what came before (an earlier run's progress bars)
    with pytest.raises(SystemExit) as stop:
        ev.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Bad input is refused before the model loads: loading it fails the test."""
    import tinyflow

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the bad input was refused")
    monkeypatch.setattr(tinyflow, "LLM", load)


def eval_args(checkpoints, data, out):
    return ["--model", checkpoints["qwen3"], "--data", data, "--runs", "full", "--max-new-tokens", "4",
            "--out", out, "--device", "cpu", "--no-compile"]


def fidelity_args(checkpoints, out):
    return ["fidelity", "--model", checkpoints["qwen3"], "--runs", "longflow:40", "--texts", "rust", "--rust-texts",
            "1", "--prompt-tokens", "16", "--tokens", "32", "--measure-last", "16", "--free-tokens", "8",
            "--out", out, "--device", "cpu", "--no-compile"]


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


def test_the_table_has_mean_tokens_beside_accuracy_and_the_plot_shows_a_lone_budget_and_0(checkpoints, tmp_path,
                                                                                          monkeypatch):
    from matplotlib.figure import Figure
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append((fig, path)))
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    rows = [json.loads(line) for line in (out / "mini_longflow_40.jsonl").read_text().splitlines()]
    mean_tokens = sum(r["tokens"] for r in rows) / len(rows)
    table = (out / "compare.md").read_text()
    assert "| policy | budget | accuracy | mean tokens |" in table
    assert f"| longflow | 40 | 0.000 | {mean_tokens:.0f} |" in table
    ((fig, path),) = saved
    assert path == out / "compare.png"
    [full] = [line for line in fig.axes[0].get_lines() if line.get_label() == "full (all tokens)"]
    assert list(full.get_ydata()) == [0, 0]  # the tiny model answers nothing right: the full cache's line at 0
    assert fig.axes[0].get_ylim() == (-0.05, 1.05)  # inside the frame, not on it
    # the one budget with half a doubling either side (matplotlib's own axis was 40 +- 5%: 38 to 42)
    assert fig.axes[0].get_xlim() == (40 / 2**0.5, 40 * 2**0.5)


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
                                                                                  monkeypatch, capsys):
    """Ctrl-C inside the engine, after two generations have finished and while the others still decode: those
    two are already on disk, one line says so and how to resume, and the resumed run adds the others once each."""
    import tinyflow
    data, out = write_data(tmp_path), tmp_path / "runs"
    real_generate = tinyflow.LLM.generate

    def generate_then_interrupt(self, prompts, on_output=None, **kwargs):
        finished = []

        def on_output_then_ctrl_c(i, output):  # the engine calls this as each prompt ends
            if on_output:
                on_output(i, output)
            finished.append(i)
            if len(finished) == 2:
                raise KeyboardInterrupt
        return real_generate(self, prompts, on_output=on_output_then_ctrl_c, **kwargs)
    monkeypatch.setattr(tinyflow.LLM, "generate", generate_then_interrupt)
    with pytest.raises(SystemExit) as stop:  # Ctrl-C: one line and exit status 130
        run_eval(checkpoints, data, out)
    assert stop.value.code == 130
    assert len((out / "mini_full_all.jsonl").read_text().splitlines()) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"interrupted: 2 generations of 12 saved in {out}; run the same command "
                                    "to resume with the rest")
    monkeypatch.setattr(tinyflow.LLM, "generate", real_generate)
    run_eval(checkpoints, data, out)
    for name in ("mini_full_all.jsonl", "mini_longflow_40.jsonl"):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert sorted((r["index"], r["sample"]) for r in rows) == [(i, s) for i in range(3) for s in range(2)]


def test_a_second_eval_on_the_same_run_is_refused(checkpoints, tmp_path, capsys):
    data, out = write_data(tmp_path), tmp_path / "runs"
    held = ev.RunLock(out / "mini_longflow_40.jsonl")  # another eval.py, still running
    assert "another eval.py is writing" in refused(capsys, [*eval_args(checkpoints, data, out), "--runs", "full",
                                                            "longflow:40"])
    held.release()
    run_eval(checkpoints, data, out)


def test_an_eval_that_ends_leaves_no_lock_files_in_out(checkpoints, tmp_path, capsys):
    """The lock of a run is a file beside it while eval.py runs, gone once it ends (refused or not): --out holds
    results only."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    refused(capsys, [*eval_args(checkpoints, data, out), "--runs", "full", "longflow:40", "--max-new-tokens", "5"])
    assert not list(out.glob("*.lock")), sorted(p.name for p in out.iterdir())


def test_a_lock_file_removed_by_the_eval_that_held_it_is_locked_anew(tmp_path, monkeypatch):
    """A second eval.py may open the lock file just before the first removes it at its end: a lock on that
    removed file would keep nobody out, so it locks the file the name now holds."""
    import fcntl
    run = tmp_path / "mini_full_all.jsonl"
    first = ev.RunLock(run)
    real_flock = fcntl.flock

    def first_ends_in_between(handle, how):  # the second opened the file; the first releases before its flock
        monkeypatch.setattr(fcntl, "flock", real_flock)
        first.release()
        return real_flock(handle, how)
    monkeypatch.setattr(fcntl, "flock", first_ends_in_between)
    second = ev.RunLock(run)
    lock = run.with_suffix(".lock")
    assert lock.exists() and lock.stat().st_ino == os.fstat(second.handle.fileno()).st_ino
    with pytest.raises(ValueError, match="another eval.py is writing"):
        ev.RunLock(run)  # a third is kept out
    second.release()
    assert not lock.exists()


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
             "--max-new-tokens", "6", "--prompt-tokens", "30", "--out", str(out), "--device", "cpu", "--no-compile",
             "--allow-long-context"])  # the protocol's 2,048 slots are past the tiny model's 512 positions
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


def test_bad_run_spec_is_a_clear_error(checkpoints, tmp_path, capsys, no_model):
    for run in ("longflow:x", "full:64", "longflow:\u00b2"):  # a superscript two is a digit to str.isdigit
        err = refused(capsys, [*eval_args(checkpoints, write_data(tmp_path), tmp_path / "runs"), "--runs", run])
        assert f"bad run '{run}'" in err


def test_resuming_with_other_settings_is_refused(checkpoints, tmp_path, capsys):
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    again = ["--model", checkpoints["qwen3"], "--data", data, "--runs", "longflow:40", "--out", out, "--device",
             "cpu", "--no-compile"]
    err = refused(capsys, [*again, "--max-new-tokens", "13", "--temperature", "0.5"])
    # the settings that differ, old and new (the sampling settings by name), not the whole settings file
    assert "was written with other settings: max_new_tokens was 12, now 13; sampling.temperature was " in err
    assert ", now 0.5; use another --out" in err and '"model":' not in err, err
    (out / "mini_longflow_40.settings.json").write_text('{"model": ')  # damaged: cannot be the same settings
    err = refused(capsys, [*again, "--max-new-tokens", "12"])
    assert "mini_longflow_40.settings.json, the settings it was written with, cannot be read" in err, err


def test_resuming_after_the_dataset_changed_is_refused_before_any_run_generates(checkpoints, tmp_path, capsys,
                                                                             monkeypatch):
    """The rows would mix answers to the old questions (or graded against old answers) with new ones. The check
    covers every run before the first generates: `full` is not redone for hours before `longflow:40` fails."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    run_eval(checkpoints, data, out)
    settings = out / "mini_longflow_40.settings.json"  # a run from before the data's digest was kept resumes
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "data_sha256"}))
    run_eval(checkpoints, data, out)
    assert "data_sha256" in json.loads(settings.read_text())
    data.write_text(data.read_text().replace('"true_answer": "7"', '"true_answer": "8"'))
    (out / "mini_full_all.jsonl").unlink()  # full would have to generate again
    generated = []
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: generated.append(a) or {})
    err = refused(capsys, ["--model", checkpoints["qwen3"], "--data", data, "--runs", "full", "longflow:40",
                           "--max-new-tokens", "12", "--samples", "2", "--out", out, "--device", "cpu", "--no-compile"])
    assert "mini_longflow_40.jsonl was written with other settings" in err and not generated


def test_a_cut_off_run_file_is_repaired_in_place_even_when_the_disk_is_full(tmp_path):
    """A last line cut off mid-write is removed by shortening the file, never by writing it again, which a
    full disk (here: a file-size limit below the file's size) would stop halfway, losing finished rows."""
    import subprocess
    import sys
    path = tmp_path / "run.jsonl"
    rows = [{"index": i, "sample": 0, "correct": True, "tokens": 5, "budget_full": False, "completion": "x" * 900}
            for i in range(20)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(whole + '{"index": 20, "sam')
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY)); "
              f"import eval; print(len(eval.read_rows(eval.Path({str(path)!r}))))")
    run = subprocess.run([sys.executable, "-c", script], cwd=ev.Path(ev.__file__).parent, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "20", run.stderr[-2000:]
    assert path.read_text() == whole
    # a file edited on Windows: its complete rows end in \r\n, and none of them is cut
    path.write_bytes(whole.replace("\n", "\r\n").encode() + b'{"index": 20, "sam')
    assert len(ev.read_rows(path)) == 20 and len(ev.read_rows(path)) == 20


def test_tokens_per_s_leaves_out_the_time_spent_grading_and_writing_rows(checkpoints, tmp_path, monkeypatch):
    import time
    from dataclasses import asdict, replace

    import tinyflow
    from sampling import Sampling
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    slow = lambda text, which="last": time.sleep(0.3)  # grading that takes a while, inside the engine's loop
    monkeypatch.setattr(ev, "extract_boxed", slow)
    proto = replace(ev.PROTOCOLS["default"], max_new_tokens=6, samples=1)
    items = ev.load_dataset(write_data(tmp_path))
    summary = ev.evaluate(llm, items, tmp_path / "run.jsonl", proto, asdict(Sampling()), 0)
    st = llm.stats
    assert summary["tokens_per_s"] >= st.generated_tokens / (st.decode_s + st.prefill_s - 3 * 0.3)

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
             "--no-compile", "--allow-long-context"])  # 2,048 slots: past the tiny model's 512 positions
    assert len((out / "mini_longflow_2048.jsonl").read_text().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, no traceback, and before the model loads wherever it can be seen there.

@pytest.mark.parametrize("line, says", [("not json", "not JSON"), ("[1, 2]", "an array, not a JSON object"),
                                        ("5", "a number, not a JSON object"),
                                        ('"question true_answer"', "a string, not a JSON object")])
def test_a_data_line_that_is_not_a_json_object_is_refused_with_its_file_and_line(checkpoints, tmp_path, capsys,
                                                                                no_model, line, says):
    data = tmp_path / "mini.jsonl"
    data.write_text('{"question": "What is 2 + 3?", "true_answer": "5"}\n' + line + "\n")
    err = refused(capsys, eval_args(checkpoints, data, tmp_path / "runs"))
    assert f"{data}:2: {says}" in err


@pytest.mark.parametrize("line, says", [("garbage", "not JSON"), ("[1]", "an array, not a JSON object"),
                                        ('{"index": 0, "sample": 0}', "a row without correct, tokens, budget_full")])
def test_a_damaged_run_file_is_refused_with_its_file_and_line_before_the_model_loads(checkpoints, tmp_path, capsys,
                                                                                   no_model, line, says):
    data, out = write_data(tmp_path), tmp_path / "runs"
    out.mkdir()
    row = {"index": 0, "sample": 0, "correct": False, "tokens": 4, "budget_full": False}
    (out / "mini_full_all.jsonl").write_text(json.dumps(row) + "\n" + line + "\n" + json.dumps(row)[:9])
    err = refused(capsys, eval_args(checkpoints, data, out))
    assert f"{out / 'mini_full_all.jsonl'}:2: {says}" in err and "delete that line" in err


def test_an_unreadable_run_file_is_refused_before_the_model_loads(checkpoints, tmp_path, capsys, no_model):
    data, out = write_data(tmp_path), tmp_path / "runs"
    (out / "mini_full_all.jsonl").mkdir(parents=True)  # a folder where the rows should be
    assert f"cannot read {out / 'mini_full_all.jsonl'}" in refused(capsys, eval_args(checkpoints, data, out))


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_an_empty_data_file_is_refused_before_the_model_loads(checkpoints, tmp_path, capsys, no_model, text):
    data = tmp_path / "mini.jsonl"
    data.write_text(text)
    assert f"{data} has no rows" in refused(capsys, eval_args(checkpoints, data, tmp_path / "runs"))


@pytest.mark.parametrize("row, says", [
    ({"question": "Q?"}, "row lacks true_answer"),
    ({"question": "Q?", "true_answer": ["1", "2"]}, '"true_answer" is an array; it must be a string or a number'),
    ({"question": "Q?", "true_answer": None}, '"true_answer" is null'),
    ({"question": "Q?", "true_answer": True}, '"true_answer" is true or false'),
    ({"question": 7, "true_answer": "7"}, '"question" is a number; it must be a string'),
    ({"question": "Q?", "true_answer": "7", "index": "3"}, '"index" is "3"; it must be a whole number'),
])
def test_rows_that_cannot_be_asked_or_graded_are_refused_with_their_line(checkpoints, tmp_path, capsys, no_model,
                                                                         row, says):
    data = tmp_path / "mini.jsonl"
    data.write_text(json.dumps({"question": "Q?", "true_answer": 1.5}) + "\n" + json.dumps(row) + "\n")
    assert f"{data}:2: {says}" in refused(capsys, eval_args(checkpoints, data, tmp_path / "runs"))


def test_two_rows_with_one_index_are_refused(checkpoints, tmp_path, capsys, no_model):
    """A run file knows generations by index: the second row would silently take the first one's."""
    data = tmp_path / "mini.jsonl"
    data.write_text('{"question": "A?", "true_answer": "1", "index": 1}\n{"question": "B?", "true_answer": "2"}\n')
    assert "two rows have index 1" in refused(capsys, eval_args(checkpoints, data, tmp_path / "runs"))


def test_a_question_may_hold_a_unicode_line_separator(tmp_path):
    """JSON strings may hold U+2028 unescaped, which str.splitlines would take for the end of a line."""
    data = tmp_path / "mini.jsonl"
    data.write_text('{"question": "one\u2028two", "true_answer": 1}\n', encoding="utf-8")
    assert ev.load_dataset(data) == [{"index": 0, "question": "one\u2028two", "true_answer": 1}]


def test_installed_beside_tinyflow_data_the_shipped_datasets_are_found(tmp_path, monkeypatch):
    """pip puts eval.py in site-packages and data/ there as the tinyflow_data package (pyproject.toml)."""
    import importlib.util
    import shutil
    import sys
    shutil.copy(ev.__file__, tmp_path / "eval.py")
    shutil.copytree(ev.DATA_DIR, tmp_path / "tinyflow_data")
    spec = importlib.util.spec_from_file_location("installed_eval", tmp_path / "eval.py")
    installed = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "installed_eval", installed)  # its dataclasses look their module up
    spec.loader.exec_module(installed)
    assert installed.RUST_BOOK == tmp_path / "tinyflow_data" / "rust_book.jsonl"
    assert len(installed.load_dataset("aime24")) == 30


def test_a_data_file_that_is_not_utf8_or_is_a_folder_is_named(checkpoints, tmp_path, capsys, no_model):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"question": "Caf\u00e9?", "true_answer": "1"}\n'.encode("latin-1"))
    assert f"{data} is not UTF-8 text" in refused(capsys, eval_args(checkpoints, data, tmp_path / "runs"))
    assert f"dataset {tmp_path} is a folder" in refused(capsys, eval_args(checkpoints, tmp_path, tmp_path / "runs"))


@pytest.mark.parametrize("option, says", [
    (["--samples", "0"], "--samples: expected a positive integer"),
    (["--limit", "0"], "--limit: expected a positive integer"),
    (["--limit", "-1"], "--limit: expected a positive integer"),
    (["--data", "retrieval", "--retrieval-words", "0"], "--retrieval-words: expected a positive integer"),
    (["--data", "retrieval", "--retrieval-words", "100000000"], "--retrieval-words must be in 1.."),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["--prompt-tokens", "-1"], "--prompt-tokens: expected a non-negative integer"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a number from 1e-6 up, got -1.0"),
    (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
    (["--top-k", "-1"], "--top-k must be an integer from 0 (no limit) to 2^63 - 1, got -1"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a number from 1e-30 to 1e30 (1: none), got 0.0"),
    (["--seed", str(2**70)], "--seed 1180591620717411303424 is too large"),
])
def test_numbers_that_cannot_work_are_refused_before_the_model_loads(checkpoints, tmp_path, capsys, no_model,
                                                                     option, says):
    assert says in refused(capsys, [*eval_args(checkpoints, write_data(tmp_path), tmp_path / "runs"), *option])


@pytest.mark.parametrize("option, says", [
    (["--rust-texts", "0"], "--rust-texts: expected a positive integer"),
    (["--rust-texts", "7"], "--rust-texts 7: data/rust_book.jsonl has 6 chapters"),
    (["--texts", "self", "--self-texts", "0"], "--self-texts: expected a positive integer"),
    (["--texts", "self", "--self-texts", "501"], "--self-texts 501: data/math.jsonl has 500 questions"),
    (["--prompt-tokens", "0"], "--prompt-tokens: expected a positive integer"),
    (["--tokens", "0"], "--tokens: expected a positive integer"),
    (["--measure-last", "-3"], "--measure-last: expected a positive integer"),
    (["--measure-last", "33"], "--measure-last 33 is more than --tokens 32"),
    (["--free-tokens", "0"], "--free-tokens: expected a positive integer"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["--seed", str(-2**70)], "is too large"),
    (["--runs", "longflow:0"], "budget must be a positive integer"),
])
def test_fidelity_numbers_that_cannot_work_are_refused_before_the_model_loads(checkpoints, tmp_path, capsys,
                                                                              no_model, option, says):
    assert says in refused(capsys, [*fidelity_args(checkpoints, tmp_path / "fid"), *option])


def test_fidelity_refuses_to_score_triattention_on_the_chapters_its_statistics_were_calibrated_on(
        checkpoints, tmp_path, monkeypatch, capsys):
    """calibrate's default statistics (chapters 5-6) may score chapters 1-4, the protocol's, but not 5; a file the
    earlier default made of the whole book, none. Said once the model has loaded (its fingerprint finds the file),
    before anything is scored. A saved result is kept while the statistics are the same, measured again once the
    model is calibrated again."""
    monkeypatch.setenv("TINYFLOW_CACHE", str(tmp_path / "cache"))
    folder = str(checkpoints["qwen3"])
    ev.main(["calibrate", "--model", folder, "--device", "cpu"])
    path = calibration.default_path(calibration.fingerprint(folder))
    fidelity = [*fidelity_args(checkpoints, tmp_path / "fid"), "--runs", "triattention:40", "--rust-texts"]
    assert refused(capsys, [*fidelity, "5"]) == (
        f"error: --rust-texts 5 scores Rust book chapters 1-5, and triattention's statistics of this model ({path}) "
        f"were calibrated on chapters 5-6: give --rust-texts 4 or fewer, or calibrate on a text the run does not "
        f"score (--text FILE)\n")
    assert not (tmp_path / "fid" / "fidelity_triattention_40.json").exists()
    ev.main([str(a) for a in [*fidelity, "4"]])
    assert json.loads((tmp_path / "fid" / "fidelity_triattention_40.json").read_text())["texts"] == [
        "rust/ch04-01-what-is-ownership", "rust/ch08-02-strings", "rust/ch10-02-traits",
        "rust/ch15-05-interior-mutability"]
    measured = (tmp_path / "fid" / "fidelity_triattention_40.json").read_text()
    ev.main([str(a) for a in [*fidelity, "4"]])  # the same statistics: the saved result is kept
    assert (tmp_path / "fid" / "fidelity_triattention_40.json").read_text() == measured
    ev.calibrate(folder, "Hello world", out=path, device="cpu", text_name="my text")
    ev.main([str(a) for a in [*fidelity, "4"]])  # other statistics: measured again, with them
    again = json.loads((tmp_path / "fid" / "fidelity_triattention_40.json").read_text())
    assert again["settings"]["statistics_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert again["settings"] != json.loads(measured)["settings"]
    ev.calibrate(folder, "Hello world", out=path, device="cpu", text_name="data/rust_book.jsonl")
    assert refused(capsys, [*fidelity, "1"]) == (
        f"error: --rust-texts 1 scores Rust book chapter 1, and triattention's statistics of this model ({path}) "
        f"were calibrated on chapters 1-6: calibrate them again (python eval.py calibrate --model {folder}: "
        f"chapters 5-6) and give --rust-texts 4 or fewer\n")


@pytest.mark.parametrize("fidelity", [False, True])
def test_an_out_that_is_a_file_is_refused(checkpoints, tmp_path, capsys, no_model, fidelity):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for out, says in ((taken, f"--out {taken} is a file"), (taken / "runs", f"is inside {taken}, which is a file")):
        args = fidelity_args(checkpoints, out) if fidelity else eval_args(checkpoints, write_data(tmp_path), out)
        assert says in refused(capsys, args)


@pytest.mark.parametrize("argv, says", [
    (["--model", "m", "--bogus"], "unrecognized arguments: --bogus"),
    (["--model", "m", "--protocol", "r2"], "argument --protocol: invalid choice"),
    (["--model", "m", "--limit", "two"], "argument --limit: expected a positive integer"),
    (["--model", "m", "--temperature", "hot"], "argument --temperature: invalid float value"),
    (["fidelity", "--model", "m", "--runs", "longflow:64", "--bogus"], "unrecognized arguments: --bogus"),
    (["fidelity", "--model", "m", "--runs", "longflow:64", "--texts", "poems"], "argument --texts: invalid choice"),
    (["fidelity", "--model", "m", "--runs", "longflow:64", "--tokens", "many"],
     "argument --tokens: expected a positive integer"),
    (["fidelity", "--runs", "longflow:64"], "the following arguments are required: --model"),
])
def test_bad_options_are_one_line_in_both_subcommands(capsys, argv, says):
    assert says in refused(capsys, argv)


def test_grading_without_math_verify_is_refused_before_the_model_loads(checkpoints, tmp_path, capsys, no_model,
                                                                       monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    err = refused(capsys, eval_args(checkpoints, write_data(tmp_path), tmp_path / "runs"))
    assert "grading answers needs math-verify: pip install" in err


def test_a_bad_default_sampling_setting_names_generation_config_and_the_flag(checkpoints, tmp_path, capsys):
    """A setting out of range in generation_config.json is refused as generate.py refuses it: where it came from
    and the flag that overrides it."""
    import shutil
    model = tmp_path / "bad-top-p"
    shutil.copytree(checkpoints["qwen3"], model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    err = refused(capsys, eval_args({"qwen3": model}, write_data(tmp_path), tmp_path / "runs"))
    assert err == ("error: this model's generation_config.json sets top_p to 1.5, which must be a number in (0, 1]: "
                   "give --top-p to override it\n"), err


def test_a_model_without_a_chat_template_is_refused_as_it_loads(checkpoints, tmp_path, capsys):
    """eval.py asks every question through the chat template; so does fidelity's `self` texts."""
    import shutil
    model = tmp_path / "no-template"
    shutil.copytree(checkpoints["qwen3"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "runs"
    err = refused(capsys, eval_args({"qwen3": model}, write_data(tmp_path), out))
    assert f"{model} has no chat template" in err and "eval.py renders every question through it" in err
    assert not (out / "mini_full_all.jsonl").exists()  # nothing generated
    err = refused(capsys, [*fidelity_args({"qwen3": model}, tmp_path / "fid"), "--texts", "self"])
    assert f"{model} has no chat template" in err


def test_an_interrupted_fidelity_sweep_keeps_the_finished_budgets_and_says_so(checkpoints, tmp_path, capsys,
                                                                             monkeypatch):
    out, real, calls = tmp_path / "fid", ev.score_in_lock_step, []

    def die_at_the_second_budget(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(ev, "score_in_lock_step", die_at_the_second_budget)
    with pytest.raises(SystemExit) as stop:
        ev.main([str(a) for a in fidelity_args(checkpoints, out)] + ["--runs", "longflow:40", "longflow:48"])
    err = capsys.readouterr().err
    assert stop.value.code == 130
    assert err.splitlines()[-1] == (f"interrupted: 1 run of 2 measured and saved in {out}; run the same "
                                    "command to resume with the rest")
    assert (out / "fidelity_longflow_40.json").exists() and not (out / "fidelity_longflow_48.json").exists()


def test_an_fp8_weights_run_has_its_own_files_and_label(checkpoints, tmp_path):
    data, out = write_data(tmp_path), tmp_path / "runs"
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow:40", "--max-new-tokens",
             "8", "--out", str(out), "--device", "cpu", "--no-compile", "--weights", "fp8"])
    summary = json.loads((out / "mini_longflow_40_fp8-weights.summary.json").read_text())
    assert summary["weights"] == "fp8" and summary["rows"] == 3
    assert "| longflow fp8-weights | 40 |" in (out / "compare.md").read_text()


def test_an_fp8_run_has_its_own_files_and_label(checkpoints, tmp_path):
    data, out = write_data(tmp_path), tmp_path / "runs"
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow:40", "--max-new-tokens",
             "8", "--out", str(out), "--device", "cpu", "--no-compile", "--kv-dtype", "fp8"])
    summary = json.loads((out / "mini_longflow_40_fp8.summary.json").read_text())
    cfg = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)[0].cfg
    fp8_bytes = KVCache.bytes_needed(cfg, 3, 40, torch.float32, resolve_policy("longflow", 40), kernel.FP8)
    assert summary["kv_dtype"] == "fp8" and summary["rows"] == 3 and summary["kv_bytes"] == fp8_bytes
    assert "| longflow fp8 | 40 |" in (out / "compare.md").read_text()


def test_a_greedy_run_of_a_sampling_protocol_decodes_without_its_top_p(checkpoints, tmp_path):
    """--temperature 0 with the r1 protocol (top-p 0.95): greedy, and the top-p that would choose nothing is left
    out of the run rather than refused after the model has loaded."""
    data, out = write_data(tmp_path), tmp_path / "runs"
    ev.main(["--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "full", "--protocol", "r1",
             "--temperature", "0", "--max-new-tokens", "4", "--limit", "1", "--out", str(out), "--device", "cpu",
             "--no-compile"])
    settings = json.loads(next(out.glob("*.settings.json")).read_text())
    assert settings["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
