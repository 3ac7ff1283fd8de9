"""Several processes (torchrun, two CPU processes, gloo) against one process. Tensor parallel: the same
log-probabilities (within fp32 rounding: the all-reduce sums the layer's parts in another order), the same
greedy tokens, and for every policy the same tokens held in the same slots, each rank holding its own KV
heads; each rank reads only its part of the weights; generate.py prints once. Data parallel: eval.py --dp
writes one process's rows into one file, and bench.py throughput --dp sums the ranks."""
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallel
import tinyflow
import fp8
from model import Config, load
from conftest import free_port

sys.path.insert(0, os.path.dirname(__file__))
import tp_worker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the environment as the session starts, taken when the jobs start (started): the jobs run in the background, while
# other tests may patch os.environ (RANK and WORLD_SIZE in test_bad_input.py, HOME, TINYFLOW_CACHE) for their own
# processes; and it holds the session's cache folder (conftest's tinyflow_cache), where the checkpoints fixture
# calibrated the statistics that policy triattention reads, in every rank as in this process
ENV = {}


def torchrun(*argv, n=2, timeout=1800):
    # one thread each on a small CI machine; inductor compiles in the process (no pool of compile workers).
    # The timeout only bounds a hang: far above what a loaded two-core machine takes.
    env = {**ENV, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                           "--master-port", str(free_port()), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=in_the_background)


def python(*argv, timeout=1800):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV, preexec_fn=in_the_background)


def in_the_background():
    """The jobs run beside the rest of the suite at the lowest CPU priority: they take what it leaves idle."""
    os.nice(19)


ARCHS = ["qwen3", "qwen2", "llama", "qwen3-fp8", "qwen3-fp8-stored"]  # FP8 blocks: quantized at load, or stored


@contextlib.contextmanager
def started(selected: set[str], folders, tmp_path_factory):
    """The multi-process runs of the selected tests of this module (by name), started in the background one at a
    time, each in a folder of its own: job name -> a future of what its function returns. conftest starts them
    with the session (the background_runs fixture), so that they run while the other test files do: a torchrun
    is mostly one core's work (importing torch, two ranks taking turns), and the rest of the suite leaves one
    of two cores idle much of the time."""
    names = [name for name, (job, test) in JOBS.items() if test in selected]
    try:
        tp_checkpoints, checkpoints = folders()
    except Exception as e:  # the parallel tests fail with it, not every test of the session
        yield {name: failed(e) for name in names}
        return
    ENV.update(os.environ)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        yield {name: pool.submit(JOBS[name][0], tp_checkpoints, checkpoints, tmp_path_factory.mktemp(name))
               for name in names}
    finally:  # a session cut short (-x, Ctrl-C) waits for the job that runs, not for those still queued
        pool.shutdown(cancel_futures=True)


def failed(error: Exception) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_exception(error)
    return future


@pytest.fixture
def runs(background_runs):
    """Each test waits for its own job."""
    return background_runs


def tp_job(tp, checkpoints, folder):
    """All three checkpoints in one torchrun (tp_worker.py): the ranks' records, per architecture."""
    r = torchrun("tests/tp_worker.py", str(folder / "out"), *(f"{tp[arch]}@{weights(arch)}" for arch in ARCHS))
    assert r.returncode == 0, r.stderr[-3000:]
    return {arch: [torch.load(folder / f"out.{i}.{rank}") for rank in range(2)] for i, arch in enumerate(ARCHS)}


def weights(arch: str) -> str:
    # -fp8-stored: the checkpoint's own FP8 blocks. The LM head stays as stored (an FP8 one, fp8-all, makes near
    # ties of this tiny model's logits that the ranks' order of sums tips; its split: test_each_ranks_fp8_lm_head...)
    return "fp8" if arch.endswith("-fp8") else "auto"


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_compute_what_one_process_computes(runs, tp_checkpoints, arch):
    ranks = runs["tp"].result()[arch]
    one = tinyflow.LLM(str(tp_checkpoints[arch]), device="cpu", compile=False, weights=weights(arch))
    want = dict(params=sum(p.nbytes for p in one.model.parameters()), **tp_worker.full_cache(one),
                runs=tp_worker.runs(one, every_policy=arch == ARCHS[0]))
    H = ranks[0]["kv_heads"]
    assert H * 2 == one.model.cfg.n_kv_heads
    for rank, got in enumerate(ranks):
        # each rank reads its part of the weights, no more (16-bit ones quantized into FP8 blocks at load: fewer
        # bytes held than read)
        assert got["read"] == got["params"] < want["params"] or weights(arch) == "fp8" and got["params"] < want["params"]
        for a, b in zip(got["logprobs"], want["logprobs"]):
            # float32 rounding: the ranks add their halves of each product after an all-reduce, one process in
            # another order (measured: under 2e-6). FP8 weights also quantize the activations to e4m3 (as the
            # tensor cores read them), where a rounding difference can tip a value into the next e4m3 step: up
            # to 3.2e-5 on one machine, which its CPU's matmul order decides
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4 if "fp8" in arch else 1e-5,
                                       rtol=0)
        assert got["tokens"] == want["tokens"], "full cache, greedy"
        for run, w in want["runs"].items():
            assert got["runs"][run]["tokens"] == w["tokens"], f"{run}: tokens"
            for layer, (p, q) in enumerate(zip(got["runs"][run]["pos"], w["pos"])):
                assert torch.equal(p, q[:, rank * H:(rank + 1) * H]), f"{run}, layer {layer}: rank {rank}'s slots"


def test_kv_heads_that_do_not_split_are_refused(checkpoints):
    """Loading splits the heads as the ranks join, so the refusal reaches the command line as any input found
    bad after joining does: once, from rank 0 (test_bad_input_found_after_the_ranks_joined_is_said_once)."""
    model_cfg = Config.from_dict(json.loads((checkpoints["llama"] / "config.json").read_text()))
    with pytest.raises(ValueError) as refused:
        parallel.Group(0, 2).shard(model_cfg)
    assert str(refused.value) == ("the model's 1 KV heads do not split over 2 ranks; run with a tensor-parallel "
                                  "size that divides 1")


GENERATE = ["--device", "cpu", "--budget", "40", "--max-new-tokens", "24", "--prompt",
            "Hello world, hello tinyflow! " * 4, "--no-chat"]


def generate_py_job(tp, checkpoints, folder):
    return torchrun("generate.py", "--model", str(checkpoints["qwen3"]), *GENERATE)


def test_generate_py_under_torchrun_prints_once_what_one_process_prints(runs, checkpoints, capsys):
    """The command line, compiled (the collectives traced into the step): rank 0 alone prints, the text of
    a single process (run here, in this process, uncompiled: test_generate.py checks compiled == eager)."""
    from test_generate import cli
    code, one, err = cli(capsys, "--model", checkpoints["qwen3"], *GENERATE, "--no-compile")
    two = runs["generate_py"].result()
    assert code == 0 and two.returncode == 0, (err, two.stderr[-3000:])
    stats = [line for line in two.stderr.splitlines() if line.startswith("prompt ")]
    assert two.stdout == one and len(stats) == 1  # the same text; the stats line (on stderr), once


def test_a_rank_shares_a_range_in_near_equal_parts():
    parts = [parallel.Group(rank, 3).part(10) for rank in range(3)]
    assert parts == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert parallel.SINGLE.part(10) == slice(0, 10)


def test_each_ranks_fp8_lm_head_is_its_rows_of_the_one_processs_head(tp_checkpoints):
    """--weights fp8-all under tensor parallel: each rank's e4m3 head rows and block factors are those one process
    quantizes (its rows start at a block: VOCAB_ROWS), so the gathered logits are one process's. (A head tied to
    the embedding, of 320 rows: split in halves, rank 1's would start inside a block.)"""
    folder = str(tp_checkpoints["qwen3-fp8"])
    one, _ = load(folder, torch.device("cpu"), torch.float32, weights="fp8-all")
    for rank in range(2):
        part, _ = load(folder, torch.device("cpu"), torch.float32, tp=parallel.Group(rank, 2), weights="fp8-all")
        rows = part.vocab_part
        assert rows.start % fp8.BLOCK == 0 and part.lm_head.weight.shape[0] == rows.stop - rows.start
        assert torch.equal(part.lm_head.weight.view(torch.uint8), one.lm_head.weight[rows].view(torch.uint8))
        blocks = slice(rows.start // fp8.BLOCK, -(-rows.stop // fp8.BLOCK))
        assert torch.equal(part.lm_head.weight_scale_inv, one.lm_head.weight_scale_inv[blocks])


def test_a_ranks_vocabulary_rows_start_at_a_multiple_of_128_the_fp8_heads_blocks():
    """So that each rank quantizes its rows of an FP8 LM head into the blocks one process would (fp8.quantize_head)."""
    assert [parallel.Group(rank, 2).vocab_part(321) for rank in range(2)] == [slice(0, 256), slice(256, 321)]
    assert [parallel.Group(rank, 2).vocab_part(151936) for rank in range(2)] == [slice(0, 76032), slice(76032, 151936)]


def eval_rows(folder: Path, name: str) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / name).read_text().splitlines()]
    return sorted((r["index"], r["sample"], r["completion"], r["tokens"]) for r in rows)


def dp_eval_job(tp, checkpoints, tmp_path):
    """One process, then two (--dp) resuming from a row in the run's file and one in rank 1's."""
    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps({"index": i, "question": q, "true_answer": "5"}) + "\n"
                            for i, q in enumerate(["What is 2 + 3?", "Hello?", "The quick brown fox?"])))
    argv = ["eval.py", "--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs", "longflow:40",
            "--max-new-tokens", "12", "--samples", "2", "--device", "cpu", "--no-compile"]
    one = python(*argv, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    name = "mini_longflow_40.jsonl"
    # an interrupted run left a row in rank 1's file, and one in the run's file
    out = tmp_path / "two"
    out.mkdir()
    lines = (tmp_path / "one" / name).read_text().splitlines()
    (out / name).write_text(lines[0] + "\n")
    (out / "mini_longflow_40.rank1.jsonl").write_text(lines[3] + "\n")
    two = torchrun(*argv, "--dp", "--out", str(out))
    assert two.returncode == 0, two.stderr[-3000:]
    return tmp_path / "one", out


def test_data_parallel_eval_writes_the_rows_of_one_process_into_one_file_and_resumes(runs):
    """eval.py --dp: each rank generates every second (item, sample), rank 0 merges them into the run's one
    file, and rows a rank had written before an interruption are merged at the next start, never redone."""
    one, out = runs["dp_eval"].result()
    name = "mini_longflow_40.jsonl"
    assert eval_rows(out, name) == eval_rows(one, name)
    assert not list(out.glob("*.rank*.jsonl")), "the ranks' files are merged and gone"
    summary = json.loads((out / "mini_longflow_40.summary.json").read_text())
    assert summary["rows"] == 6 and summary["tokens_per_s"] > 0


def dp_alone_job(tp, checkpoints, folder):
    return python("eval.py", "--model", str(checkpoints["qwen3"]), "--dp", "--out", str(folder))


def test_dp_without_torchrun_is_refused(runs):
    r = runs["dp_alone"].result()
    assert r.returncode == 2 and r.stderr.startswith("error: --dp shares the generations out"), r.stderr


BENCH = ["bench.py", "throughput", "--shape", "tiny", "--device", "cpu", "--no-compile", "--batch", "2",
         "--budget", "40", "--new-tokens", "24", "--prompt-len", "30", "--policy", "longflow"]


def bench_tp_job(tp, checkpoints, folder):
    return torchrun(*BENCH, "--json", str(folder / "rows.json")), folder / "rows.json"


def bench_dp_job(tp, checkpoints, folder):
    return torchrun(*BENCH, "--dp", "--json", str(folder / "rows.json")), folder / "rows.json"


def test_bench_throughput_under_torchrun_splits_the_model_or_with_dp_sums_the_ranks(runs):
    for extra, job in (([], "bench_tp"), (["--dp"], "bench_dp")):
        r, rows_json = runs[job].result()
        assert r.returncode == 0, r.stderr[-3000:]
        rows = json.loads(rows_json.read_text())["rows"]
        assert r.stdout.count("workload=throughput") == 1 and len(rows) == 1, "rank 0 alone prints and writes"
        if extra:
            assert rows[0]["ranks"] == 2 and rows[0]["batch"] == 4
            assert rows[0]["tokens_per_s"] == pytest.approx(sum(rows[0]["tokens_per_s_per_rank"]))


def damaged_rank_job(tp, checkpoints, tmp_path):
    (tmp_path / "mini.jsonl").write_text(json.dumps({"index": 0, "question": "Hello?", "true_answer": "1"}) + "\n")
    (tmp_path / "mini_longflow_40.rank1.jsonl").write_text("not json\n")
    return torchrun("eval.py", "--dp", "--model", str(checkpoints["qwen3"]), "--data", str(tmp_path / "mini.jsonl"),
                    "--runs", "longflow:40", "--device", "cpu", "--no-compile", "--out", str(tmp_path))


def test_a_damaged_rank_file_is_named_once_before_the_model_loads(runs):
    r = runs["damaged_rank"].result()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and len(errors) == 1 and "mini_longflow_40.rank1.jsonl:1" in errors[0], r.stderr[-2000:]


def prompt_file_job(tp, checkpoints, tmp_path):
    return torchrun("generate.py", "--model", str(checkpoints["qwen3"]), "--device", "cpu", "--no-compile",
                    "--prompt-file", str(tmp_path / "missing.txt")), tmp_path / "missing.txt"


def test_a_prompt_file_rank_0_cannot_read_fails_every_rank_in_one_line(runs):
    r, missing = runs["prompt_file"].result()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and errors == [f"error: cannot read prompt file {missing}: No such file or "
                                            f"directory"], r.stderr[-2000:]
    assert "Traceback" not in r.stderr.split("distributed/elastic")[0], "a rank died in a traceback"


def bad_model_job(tp, checkpoints, tmp_path):
    return torchrun("generate.py", "--model", str(tmp_path / "no-such-model"), "--device", "cpu")


def test_bad_input_found_after_the_ranks_joined_is_said_once(runs):
    r = runs["bad_model"].result()
    errors = [line for line in r.stderr.splitlines() if "error" in line and "does not exist" in line]
    assert r.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: model path"), r.stderr[-2000:]


def dp_context_job(tp, checkpoints, tmp_path):
    data = tmp_path / "mini.jsonl"
    rows = [{"index": 0, "question": "Hello?", "true_answer": "1"},  # rank 0's: fits
            {"index": 1, "question": "Hello world, hello tinyflow! " * 40, "true_answer": "1"}]  # rank 1's: does not
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return torchrun("eval.py", "--dp", "--model", str(checkpoints["qwen3"]), "--data", str(data), "--runs",
                    "longflow:40", "--max-new-tokens", "200", "--device", "cpu", "--no-compile", "--out", str(tmp_path))


def test_data_parallel_eval_past_the_context_is_said_once_whichever_rank_holds_the_prompt(runs):
    """Every rank checks every prompt before taking its share, so a rank whose share alone is too long does
    not fail silently while the others wait for it."""
    r = runs["dp_context"].result()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and len(errors) == 1 and "max_position_embeddings 512" in errors[0], r.stderr[-2000:]


def server_py_job(tp, checkpoints, folder):
    return torchrun("server.py", "--model", str(checkpoints["qwen3"]), "--device", "cpu")


def test_server_py_under_torchrun_is_refused_once_then_torchrun_adds_its_own_report(runs):
    """Rank 0 alone says it and exits with status 2 (the other ranks end quietly, with 0, so that torchrun
    does not stop rank 0 before its line). What torchrun prints after that line is its own, whatever the
    ranks do (any non-zero exit is a failed worker to it), as docs/parallel.md says: a log line, its own
    traceback ending in ChildFailedError, the failed rank's exit code, and exit status 1."""
    r = runs["server_py"].result()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: server.py serves from one process on one GPU; start it without torchrun"], r.stderr
    before, added = r.stderr.split(errors[0])
    assert "Traceback" not in before, "a rank died in a traceback"
    assert "failed (exitcode: 2) local_rank: 0" in added and "ChildFailedError" in added, added
    assert added.count("exitcode  : 2") == 1 and r.returncode == 1, (r.returncode, added)


# name: (the job, the test that reads it), in the order the tests above wait for them
JOBS = {"tp": (tp_job, "test_two_ranks_compute_what_one_process_computes"),
        "generate_py": (generate_py_job, "test_generate_py_under_torchrun_prints_once_what_one_process_prints"),
        "dp_eval": (dp_eval_job, "test_data_parallel_eval_writes_the_rows_of_one_process_into_one_file_and_resumes"),
        "dp_alone": (dp_alone_job, "test_dp_without_torchrun_is_refused"),
        "bench_tp": (bench_tp_job, "test_bench_throughput_under_torchrun_splits_the_model_or_with_dp_sums_the_ranks"),
        "bench_dp": (bench_dp_job, "test_bench_throughput_under_torchrun_splits_the_model_or_with_dp_sums_the_ranks"),
        "damaged_rank": (damaged_rank_job, "test_a_damaged_rank_file_is_named_once_before_the_model_loads"),
        "prompt_file": (prompt_file_job, "test_a_prompt_file_rank_0_cannot_read_fails_every_rank_in_one_line"),
        "bad_model": (bad_model_job, "test_bad_input_found_after_the_ranks_joined_is_said_once"),
        "dp_context": (dp_context_job,
                       "test_data_parallel_eval_past_the_context_is_said_once_whichever_rank_holds_the_prompt"),
        "server_py": (server_py_job, "test_server_py_under_torchrun_is_refused_once_then_torchrun_adds_its_own_report")}


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
        ready, _, _ = select.select([p.stdout], [], [], 1200)  # rank 0 streams its first tokens
        assert ready, "no token in 1200 s"
        time.sleep(1)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=600)
    finally:
        p.kill()
    assert out and "\nprompt " in err, "rank 0 printed the tokens generated so far and their statistics"
    assert "interrupted" in err.splitlines() and "[rank" not in err, err[-3000:]
