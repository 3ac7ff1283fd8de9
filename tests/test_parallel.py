"""Several processes (torchrun, two CPU processes, gloo) against one process. Tensor parallel: the same
log-probabilities (within fp32 rounding: the all-reduce sums the layer's parts in another order), the same
greedy tokens, and for every policy the same tokens held in the same slots, each rank holding its own KV
heads; each rank reads only its part of the weights; generate.py prints once. Data parallel: eval.py --dp
writes one process's rows into one file, and bench.py throughput --dp sums the ranks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallel
import tinyflow
from conftest import free_port, write_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import tp_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def torchrun(*argv, n=2, timeout=600):
    # one thread each on a small CI machine; inductor compiles in the process (no pool of compile workers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                           "--master-port", str(free_port()), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tp_checkpoints(checkpoints, tmp_path_factory):
    """Qwen3 (2 KV heads, GQA 2:1, tied embeddings), Qwen2 (4 KV heads, 1:1, qkv bias), and a Llama of 2 KV
    heads (GQA 2:1, sharded files) with an odd vocabulary (321: the lm_head splits 161 / 160)."""
    llama = write_checkpoint(tmp_path_factory.mktemp("tp") / "llama", "llama", kv_heads=2, vocab=321,
                             max_shard_size="100KB")
    return {"qwen3": checkpoints["qwen3"], "qwen2": checkpoints["qwen2"], "llama": llama}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_two_ranks_compute_what_one_process_computes(tp_checkpoints, tmp_path, arch):
    r = torchrun("tests/tp_worker.py", str(tp_checkpoints[arch]), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"out.{i}") for i in range(2)]
    one = tinyflow.LLM(str(tp_checkpoints[arch]), device="cpu", compile=False)
    want = dict(params=sum(p.nbytes for p in one.model.parameters()), **tp_worker.full_cache(one),
                runs=tp_worker.runs(one))
    H = ranks[0]["kv_heads"]
    assert H * 2 == one.model.cfg.n_kv_heads
    for rank, got in enumerate(ranks):
        assert got["read"] == got["params"] < want["params"], "each rank reads its part of the weights, no more"
        for a, b in zip(got["logprobs"], want["logprobs"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
        assert got["tokens"] == want["tokens"], "full cache, greedy"
        for run, w in want["runs"].items():
            assert got["runs"][run]["tokens"] == w["tokens"], f"{run}: tokens"
            for layer, (p, q) in enumerate(zip(got["runs"][run]["pos"], w["pos"])):
                assert torch.equal(p, q[:, rank * H:(rank + 1) * H]), f"{run}, layer {layer}: rank {rank}'s slots"


def test_kv_heads_that_do_not_split_are_refused_in_one_line(checkpoints):
    r = torchrun("generate.py", "--model", str(checkpoints["llama"]), "--device", "cpu", "--no-compile",
                 "--max-new-tokens", "4")
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: the model's 1 KV heads do not split over 2 ranks; run with a tensor-parallel size "
                     "that divides 1"], r.stderr[-2000:]


def test_generate_py_under_torchrun_prints_once_what_one_process_prints(checkpoints):
    """The command line, compiled (the collectives traced into the step): rank 0 alone prints, the text of
    a single process."""
    argv = ["generate.py", "--model", str(checkpoints["qwen3"]), "--device", "cpu", "--budget", "40",
            "--max-new-tokens", "24", "--prompt", "Hello world, hello tinyflow! " * 4, "--no-chat"]
    one = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    two = torchrun(*argv)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    text = lambda out: out.split("\nprompt ")[0]  # the generated text, before the statistics line
    assert text(two.stdout) == text(one.stdout) and two.stdout.count("\nprompt ") == 1


def test_a_rank_shares_a_range_in_near_equal_parts():
    parts = [parallel.Group(rank, 3).part(10) for rank in range(3)]
    assert parts == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert parallel.SINGLE.part(10) == slice(0, 10)


def eval_rows(folder: Path, name: str) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / name).read_text().splitlines()]
    return sorted((r["index"], r["sample"], r["completion"], r["tokens"]) for r in rows)


def test_data_parallel_eval_writes_the_rows_of_one_process_into_one_file_and_resumes(checkpoints, tmp_path):
    """eval.py --dp: each rank generates every second (item, sample), rank 0 merges them into the run's one
    file, and rows a rank had written before an interruption are merged at the next start, never redone."""
    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps({"index": i, "question": q, "true_answer": "5"}) + "\n"
                            for i, q in enumerate(["What is 2 + 3?", "Hello?", "The quick brown fox?"])))
    argv = ["eval.py", "--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow:40",
            "--max-new-tokens", "12", "--samples", "2", "--device", "cpu", "--no-compile"]
    one = subprocess.run([sys.executable, *argv, "--out", str(tmp_path / "one")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    name = "mini_longflow_40.jsonl"
    want = eval_rows(tmp_path / "one", name)
    # an interrupted run left a row in rank 1's file, and one in the run's file
    out = tmp_path / "two"
    out.mkdir()
    lines = (tmp_path / "one" / name).read_text().splitlines()
    (out / name).write_text(lines[0] + "\n")
    (out / "mini_longflow_40.rank1.jsonl").write_text(lines[3] + "\n")
    two = torchrun(*argv, "--dp", "--out", str(out))
    assert two.returncode == 0, two.stderr[-3000:]
    assert eval_rows(out, name) == want
    assert not list(out.glob("*.rank*.jsonl")), "the ranks' files are merged and gone"
    summary = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert summary["rows"] == 6 and summary["tokens_per_s"] > 0


def test_dp_without_torchrun_is_refused(checkpoints, tmp_path):
    r = subprocess.run([sys.executable, "eval.py", "--model", str(checkpoints["qwen3"]), "--dp", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --dp shares the generations out"), r.stderr


def test_bench_throughput_under_torchrun_splits_the_model_or_with_dp_sums_the_ranks(tmp_path):
    argv = ["bench.py", "throughput", "--shape", "tiny", "--device", "cpu", "--no-compile", "--batch", "2",
            "--budget", "40", "--new-tokens", "24", "--prompt-len", "30", "--policy", "longflow"]
    for extra in ([], ["--dp"]):
        r = torchrun(*argv, *extra, "--json", str(tmp_path / "rows.json"))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
        assert r.stdout.count("workload=throughput") == 1 and len(rows) == 1, "rank 0 alone prints and writes"
        if extra:
            assert rows[0]["ranks"] == 2 and rows[0]["batch"] == 4
            assert rows[0]["tokens_per_s"] == pytest.approx(sum(rows[0]["tokens_per_s_per_rank"]))


def test_a_damaged_rank_file_is_named_once_before_the_model_loads(checkpoints, tmp_path):
    (tmp_path / "mini.jsonl").write_text(json.dumps({"index": 0, "question": "Hello?", "true_answer": "1"}) + "\n")
    (tmp_path / "mini_longflow_40.rank1.jsonl").write_text("not json\n")
    r = torchrun("eval.py", "--dp", "--model", str(checkpoints["qwen3"]), "--data", str(tmp_path / "mini.jsonl"),
                 "--runs", "longflow:40", "--device", "cpu", "--no-compile", "--out", str(tmp_path))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and len(errors) == 1 and "mini_longflow_40.rank1.jsonl:1" in errors[0], r.stderr[-2000:]


def test_a_prompt_file_rank_0_cannot_read_fails_every_rank_in_one_line(checkpoints, tmp_path):
    r = torchrun("generate.py", "--model", str(checkpoints["qwen3"]), "--device", "cpu", "--no-compile",
                 "--prompt-file", str(tmp_path / "missing.txt"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and errors == [f"error: cannot read prompt file {tmp_path / 'missing.txt'}: No such "
                                            f"file or directory"], r.stderr[-2000:]
    assert "Traceback" not in r.stderr.split("distributed/elastic")[0], "a rank died in a traceback"


def test_bad_input_found_after_the_ranks_joined_is_said_once(tmp_path):
    r = torchrun("generate.py", "--model", str(tmp_path / "no-such-model"), "--device", "cpu")
    errors = [line for line in r.stderr.splitlines() if "error" in line and "does not exist" in line]
    assert r.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: model path"), r.stderr[-2000:]


def test_data_parallel_eval_past_the_context_is_said_once_whichever_rank_holds_the_prompt(checkpoints, tmp_path):
    """Every rank checks every prompt before taking its share, so a rank whose share alone is too long does
    not fail silently while the others wait for it."""
    data = tmp_path / "mini.jsonl"
    rows = [{"index": 0, "question": "Hello?", "true_answer": "1"},  # rank 0's: fits
            {"index": 1, "question": "Hello world, hello tinyflow! " * 40, "true_answer": "1"}]  # rank 1's: does not
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = torchrun("eval.py", "--dp", "--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs",
                 "longflow:40", "--max-new-tokens", "200", "--device", "cpu", "--no-compile", "--out", str(tmp_path))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and len(errors) == 1 and "max_position_embeddings 512" in errors[0], r.stderr[-2000:]


def test_ctrl_c_under_torchrun_ends_every_rank_in_rank_0s_one_line(checkpoints):
    """Ctrl-C reaches every process (the terminal signals the whole group): rank 0 prints what it generated
    and "interrupted", the other ranks end without a word when their next collective finds rank 0 gone.
    (torchrun itself then prints its own SignalException traceback: its behaviour, not the ranks'.)"""
    import select
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "generate.py", "--model", str(checkpoints["qwen3"]), "--device", "cpu",
                          "--no-compile", "--budget", "40", "--max-new-tokens", "100000", "--allow-long-context",
                          "--no-chat", "--prompt", "hello"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready, _, _ = select.select([p.stdout], [], [], 300)  # rank 0 streams its first tokens
        assert ready, "no token in 300 s"
        time.sleep(1)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert "\nprompt " in out, "rank 0 printed the tokens generated so far and their statistics"
    assert "interrupted" in err.splitlines() and "[rank" not in err, err[-3000:]
