"""bench.py end to end on the CPU with the tiny shape: it runs in seconds and writes its JSON; bad options fail at
once, in one line; Ctrl-C keeps the rows measured."""
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--shape", "tiny", "--device", "cpu", "--no-compile"]


def bench(*argv):
    # the timeout only bounds a hang: far above what a loaded two-core machine takes
    return subprocess.run([sys.executable, "bench.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=1200)


def bench_in_process(monkeypatch, capsys, *argv):
    """bench.main() in this process (no second import of torch): (exit status, stdout, stderr)."""
    import bench as bench_module
    monkeypatch.setattr(sys, "argv", ["bench.py", *map(str, argv)])
    monkeypatch.setattr(bench_module, "ROWS", [])  # the rows a process measured: this call's alone, as in a process
    capsys.readouterr()
    try:
        bench_module.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(path):
    """The file parsed as strict JSON: NaN and Infinity, which Python writes by default, fail."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_bench_throughput_and_long_prompt_run_on_cpu_and_write_json(tmp_path, monkeypatch, capsys):
    only = {"throughput": ["--batch", "2", "--validate", "20"], "long-prompt": []}  # long-prompt runs batch 1
    for workload in ("throughput", "long-prompt"):
        out = tmp_path / f"{workload}.json"
        code, stdout, stderr = bench_in_process(monkeypatch, capsys, workload, *TINY, *only[workload], "--new-tokens",
                                                "24", "--budget", "40", "--prompt-len", "80", "--json", out)
        assert code == 0, stderr
        rows = json.loads(out.read_text())["rows"]
        assert rows and all(row["workload"] == workload for row in rows)
        if workload == "throughput":
            assert {row["policy"] for row in rows} == {"longflow", "full"}
            assert all(row["tokens_per_s"] > 0 and 0 < row["floor_fraction"] for row in rows)
            assert "longflow / full throughput" in stdout
            assert all(row["real_ms_per_step"] > 0 and row["predicted_ms_per_step"] > 0 for row in rows)
            # --validate's second run: rows ending at random steps, refilled, the step at both sizes of its ladder
            assert all(row["validate_step_sizes"] == [1, 2] and row["validate_batch"] == 2 for row in rows)
        else:
            assert [row["slots"] for row in rows] == [80 + 24, 40, 40]  # full, 50% of 80, the budget
            assert all(row["prefill_floor_fraction"] > 0 for row in rows)
            assert all(f"long-prompt, {cache}" in stderr for cache in ("full", "50%", "budget 40"))  # the bars


def test_a_throughput_row_is_kept_when_its_validation_fails(tmp_path, monkeypatch, capsys):
    """The step time is measured before the engine's run checks it: a refused validation ends the command in one
    line, and the row measured is still written (seen on the GPU: the engine refused the batch planned)."""
    import bench as bench_module

    def refused(*args):
        raise ValueError("508 sequences of 3200 KV slots need 129.51 GiB of GPU memory but 129.43 GiB is free")
    monkeypatch.setattr(bench_module, "validate", refused)
    out = tmp_path / "throughput.json"
    code, stdout, err = bench_in_process(monkeypatch, capsys, "throughput", *TINY, "--batch", "2", "--validate", "20",
                                         "--policy", "longflow", "--new-tokens", "24", "--budget", "40",
                                         "--prompt-len", "80", "--json", out)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: 508 sequences")
    [row] = json.loads(out.read_text())["rows"]
    assert row["tokens_per_s"] > 0 and "validate_batch" not in row and "tokens_per_s=" in stdout


@pytest.fixture
def forward_clock(monkeypatch):
    """bench.py's clock made the count of the transformers model's forward passes so far: one "second" a token,
    however loaded the machine is (no test may depend on timing). .stopped stops counting them."""
    import bench as bench_module

    class Clock:
        passes, reads, stopped = 0, 0, False

        def tick(self, module, args):
            if type(module).__name__.endswith("ForCausalLM") and not self.stopped:
                self.passes += 1

        def now(self, device):  # and 2^-20 s a reading, exact in a float: the bandwidth probe divides by it
            self.reads += 1
            return self.passes + self.reads * 2**-20
    clock = Clock()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(clock.tick)
    monkeypatch.setattr(bench_module, "sync_time", clock.now)
    yield clock
    hook.remove()


def test_bench_transformers_baseline_runs_on_cpu(tmp_path, monkeypatch, capsys, forward_clock):
    """n new tokens take n forward passes: runs of 16 and 4 differ by 12 passes, one a step."""
    out = tmp_path / "hf.json"
    code, _, err = bench_in_process(monkeypatch, capsys, "hf", "--shape", "tiny", "--device", "cpu", "--batch", "2",
                                    "--new-tokens", "16", "--prompt-len", "8", "--json", out)
    assert code == 0, err
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["batch"], row["prompt_len"], row["ms_per_step"], row["tokens_per_s"]) == (2, 8, 1000.0, 2.0)
    # with two new tokens its shorter run generates one token, not none (which transformers refuses)
    code, _, err = bench_in_process(monkeypatch, capsys, "hf", "--shape", "tiny", "--device", "cpu", "--batch", "1",
                                    "--new-tokens", "2", "--prompt-len", "8")
    assert code == 0, err


def test_the_hf_step_is_the_median_of_several_differences_so_one_slowed_run_does_not_count():
    """Under load one difference of two timings gave -1090.27 tokens/s. Runs of 16 and 4 new tokens, five pairs:
    differences of 12, -6 (the short run slowed), 24, 12 and 36 seconds: 1 s a step, their median."""
    import bench as bench_module
    durations = iter([14, 2, 3, 9, 26, 2, 15, 3, 40, 4])  # (16 tokens, 4 tokens) in turn
    assert bench_module.step_from_run_lengths(lambda n: next(durations), 16, "batch 1") == 1.0
    flat = iter([5.0] * 10)
    with pytest.raises(ValueError) as refused:
        bench_module.step_from_run_lengths(lambda n: next(flat), 16, "batch 1")
    assert str(refused.value) == ("the hf step at batch 1 could not be timed: 16 new tokens took no longer than 4 in "
                                  "5 of 5 tries (a machine too busy, or runs too short); give a larger --new-tokens, "
                                  "or run it on a quieter machine")


def test_an_hf_step_that_cannot_be_timed_is_refused_in_one_line_never_a_negative_rate(tmp_path, monkeypatch, capsys,
                                                                                      forward_clock):
    forward_clock.stopped = True  # every run takes no time: no step to measure
    out = tmp_path / "hf.json"
    code, stdout, err = bench_in_process(monkeypatch, capsys, "hf", "--shape", "tiny", "--device", "cpu", "--batch",
                                         "2", "--new-tokens", "16", "--prompt-len", "8", "--json", out)
    assert code == 2 and "tokens_per_s" not in stdout
    assert err.strip().splitlines()[-1].startswith("error: the hf step at batch 2 could not be timed: 16 new tokens "
                                                   "took no longer than 4 in 5 of 5 tries"), err


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep over two batches and two budgets (bench.main in this process): what it returned and printed, as a
    finished process's (returncode, stdout, stderr), and its JSON file."""
    import bench as bench_module
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    argv = ["bench.py", "throughput", *TINY, "--batch", "1", "3", "--budget", "40", "48", "--new-tokens", "24",
            "--prompt-len", "30", "--json", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setattr(sys, "argv", argv)
        patch.setattr(bench_module, "ROWS", [])
        try:
            bench_module.main()
            code = 0
        except SystemExit as e:
            code = e.code
    r = subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())
    assert r.returncode == 0, r.stderr
    return r, out


def test_bench_sweeps_batches_and_budgets_and_runs_the_full_cache_once(sweep, monkeypatch, capsys):
    _, out = sweep
    runs = sorted((row["policy"], row["slots"], row["batch"]) for row in json.loads(out.read_text())["rows"])
    assert runs == [("full", 54, 1), ("full", 54, 3), ("longflow", 40, 1), ("longflow", 40, 3),
                    ("longflow", 48, 1), ("longflow", 48, 3)]
    code, _, err = bench_in_process(monkeypatch, capsys, "long-prompt", "--shape", "tiny", "--device", "cpu", "--budget",
                                    "40", "48")
    assert code == 2 and err.startswith("error: the long-prompt workload takes one --budget"), err


def test_bench_json_is_strict_with_null_for_nan(sweep):
    record = strict_json(sweep[1])
    assert all(row["peak_gib"] is None for row in record["rows"])  # no peak GPU memory on the CPU


def test_bench_json_records_the_options_as_given(sweep):
    record = strict_json(sweep[1])
    assert record["complete"] is True
    given = record["args"]
    assert given["budget"] == [40, 48] and given["policy"] == ["longflow", "full"] and given["batch"] == [1, 3]


SMALL = "throughput --shape tiny --device cpu --no-compile --batch 1 --budget 40 --new-tokens 24 --prompt-len 30"
LONG = "long-prompt --shape tiny --device cpu --no-compile --new-tokens 4"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("argv, message", [
    pytest.param(f"{SMALL} --device cuda", "CUDA was asked for but is not available", marks=no_cuda, id="no-cuda"),
    pytest.param(f"{SMALL} --policy foo", "invalid choice: 'foo'", id="unknown-policy"),
    pytest.param(f"{SMALL} --budget 0", "--budget: expected a positive integer", id="zero-budget"),
    pytest.param(f"{SMALL} --batch 0", "--batch: expected a positive integer", id="zero-batch"),
    pytest.param(f"{SMALL} --new-tokens 1", "--new-tokens must be at least 2", id="one-new-token"),
    pytest.param(f"{SMALL} --budget 10", "--policy longflow with --budget 10: budget 10 is too small",
                 id="budget-too-small"),
    pytest.param("step --shape tiny --device cpu --no-compile --batch 1 --budget 40 --context 40 --profile",
                 "--profile lists the CUDA kernels", id="profile-on-cpu"),
    pytest.param("kernel --batch 1 --policy longflow streaming", "the kernel workload times the rules the fused "
                 "kernel scores, not streaming", id="kernel-with-a-rule-it-does-not-score"),
    pytest.param(f"{SMALL} --policy triattention", "only bench.py step and kernel time it", id="triattention-on-random-weights"),
    pytest.param(f"{SMALL} --validate 1", "--validate runs that many", id="validate-one-token"),
    pytest.param(f"{SMALL} --validate 25", "give 2 to 24", id="validate-past-the-run"),
    pytest.param(f"{SMALL} --policy full", "--policy full keeps every token and takes no --budget",
                 id="budget-for-the-full-cache"),
    pytest.param("step --shape tiny --device cpu --no-compile --batch 1 --budget 40 --context 40 --policy longflow",
                 "--context is the fill of the full cache", id="context-without-full"),
    pytest.param(f"{LONG} --prompt-len 80 --budget 40 --batch 2", "the long-prompt workload does not use --batch",
                 id="option-the-workload-ignores"),
    pytest.param(f"{LONG} --prompt-len 40 --budget 40", "holds the whole 40-token prompt", id="budget-holds-prompt"),
    pytest.param(f"{LONG} --budget 131072", "holds the whole 131072-token prompt", id="long-prompt-is-128k"),
    pytest.param(f"{SMALL} --json {{tmp}}/missing/rows.json", "missing does not exist", id="json-folder-missing"),
    pytest.param(f"{SMALL} --json {{tmp}}", "is a folder", id="json-is-a-folder"),
    pytest.param(f"{SMALL} --plot {{tmp}}/missing/plot.png", "missing does not exist", id="plot-folder-missing"),
    pytest.param(f"{SMALL} --plot {{tmp}}/plot.xyz", "matplotlib cannot write .xyz files", id="plot-format"),
    # a folder os.access calls writable for root, where no file can be created: tried now, not after the rows
    pytest.param(f"{SMALL} --plot /proc/tinyflow-plot.png", "--plot /proc/tinyflow-plot.png cannot be written",
                 id="plot-cannot-be-created"),
    pytest.param(f"{SMALL} --json /proc/tinyflow-rows.json", "--json /proc/tinyflow-rows.json cannot be written",
                 id="json-cannot-be-created"),
    pytest.param(f"{SMALL} --plot {{tmp}}/out --json {{tmp}}/out", "the plot would overwrite the rows",
                 id="plot-over-json"),
    pytest.param("throughput --device cpu --model {tmp}/no-such-model", "does not exist", id="model-missing"),
    pytest.param(f"{SMALL} --model {{tmp}}", "--model and --shape both", id="model-and-shape"),
    pytest.param("checkpoint --shape tiny --device cpu", "give it with --out DIR", id="checkpoint-without-out"),
    pytest.param(f"{SMALL} --dp", "--dp runs a whole model on each of torchrun's processes", id="dp-without-torchrun"),
    pytest.param("checkpoint --shape tiny --device cpu --out {tmp}", "is not an empty folder",
                 id="checkpoint-over-a-folder"),
])
def test_bench_refuses_bad_input_in_one_line_before_running(tmp_path, monkeypatch, capsys, argv, message):
    """In this process (bench.main, as the command runs it): one import of torch for all of them;
    test_bench_refuses_in_one_line_as_a_process checks the same as a process of its own."""
    (tmp_path / "something").write_text("")
    code, out, err = bench_in_process(monkeypatch, capsys, *argv.format(tmp=tmp_path).split())
    assert code == 2, err
    assert out == ""  # refused before the benchmark started (its first line names the device)
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err


def test_under_torchrun_rank_0_alone_tries_the_output_file_and_every_rank_refuses_with_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """Rank 0 alone writes --json and --plot, so it alone creates and removes a trial file (two ranks doing so
    raced: one removed the file the other had just made, and its os.remove failed), and its refusal is every
    rank's (a rank that went on alone was killed by torchrun, or waited for the others)."""
    import parallel
    tried = []

    def from_rank_0(fn):  # what any other rank gets from parallel.on_rank0: rank 0's refusal, not its own try
        tried.append(fn)
        raise ValueError("rank 0's refusal")
    monkeypatch.setattr(parallel, "on_rank0", from_rank_0)
    code, out, err = bench_in_process(monkeypatch, capsys, *SMALL.split(), "--json", tmp_path / "rows.json")
    assert (code, out, err) == (2, "", "error: rank 0's refusal\n") and len(tried) == 1
    assert not (tmp_path / "rows.json").exists()


@pytest.mark.parametrize("argv, message", [(f"{SMALL} --policy foo", "invalid choice: 'foo'"),  # argparse's
                                           (f"{SMALL} --budget 10", "budget 10 is too small")],  # bench's own
                         ids=["argparse", "check_args"])
def test_bench_refuses_in_one_line_as_a_process(argv, message):
    r = bench(*argv.split())
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr


def test_bench_ctrl_c_exits_130_in_one_line_and_writes_the_finished_rows(tmp_path):
    out = tmp_path / "rows.json"
    batches = [str(b) for b in range(1, 13)]
    proc = subprocess.Popen([sys.executable, "bench.py", *SMALL.split(), "--policy", "longflow", "--batch", *batches,
                             "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("workload="):  # the first row is measured
                proc.send_signal(signal.SIGINT)
                break
        _, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().startswith("interrupted:"), stderr
    record = strict_json(out)
    assert record["complete"] is False and 1 <= len(record["rows"]) < len(batches)
    assert all(row["tokens_per_s"] > 0 for row in record["rows"])


@pytest.mark.parametrize("with_json", [True, False], ids=["json-given", "no-json"])
def test_a_plot_that_fails_to_write_after_the_run_keeps_the_rows_and_says_where(tmp_path, monkeypatch, capsys,
                                                                                with_json):
    """The plot is drawn once every row is measured; if writing it fails then (a full disk), the rows are in
    --json, or in a file of their own, and the one error line says which."""
    import bench as bench_module

    def disk_full(rows, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bench_module, "plot", disk_full)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rows go without --json
    given = ["--json", tmp_path / "rows.json"] if with_json else []
    code, out, err = bench_in_process(monkeypatch, capsys, *SMALL.split(), "--policy", "longflow", "--plot",
                                      tmp_path / "plot.png", *given)
    assert code == 2 and out.count("workload=throughput") == 1, err
    (line,) = err.splitlines()
    assert line.startswith(f"error: --plot {tmp_path / 'plot.png'} could not be written (No space left on device)")
    saved = tmp_path / "rows.json" if with_json else next(tmp_path.glob("bench-rows-*.json"))
    assert line.endswith(f"what was measured (1 row) is in {saved}"), line
    record = strict_json(saved)
    assert record["complete"] is True and record["rows"][0]["tokens_per_s"] > 0
    assert not (tmp_path / "plot.png").exists()


def test_the_header_gives_bandwidth_and_matmul_rate_in_units_that_fit(sweep):
    """A CPU copies some GB/s, an H200 some TB/s: each in its own unit, three significant digits."""
    import bench
    assert bench.per_second(4.26e12, "B") == "4.26 TB/s" and bench.per_second(2.05e10, "B") == "20.5 GB/s"
    assert bench.per_second(7.85e14, "FLOP") == "785 TFLOP/s" and bench.per_second(999.7e9, "B") == "1 TB/s"
    assert bench.per_second(512, "B") == "512 B/s"
    header = sweep[0].stdout.splitlines()[0]
    assert re.search(r"copy bandwidth [1-9][0-9.]* [kMGT]?B/s, matmul [1-9][0-9.]* [kMGT]?FLOP/s", header), header


def test_bench_generate_rows_say_which_budget_they_measured(tmp_path, monkeypatch, capsys):
    out = tmp_path / "generate.json"
    code, _, err = bench_in_process(monkeypatch, capsys, "generate", "--shape", "tiny", "--device", "cpu", "--no-compile",
                                    "--batch", "1", "--budget", "40", "48", "--new-tokens", "8", "--prompt-len", "8",
                                    "--json", out)
    assert code == 0, err
    runs = sorted((row["policy"], row["slots"]) for row in json.loads(out.read_text())["rows"])
    assert runs == [("full", 16), ("longflow", 40), ("longflow", 48)]


def test_no_compile_rows_time_the_setup_not_a_compile(sweep, tmp_path, monkeypatch, capsys):
    """Under --no-compile nothing is compiled: the rows' time to make the step is setup_s, not compile_s."""
    out = tmp_path / "generate.json"
    code, _, err = bench_in_process(monkeypatch, capsys, "generate", *TINY, "--batch", "1", "--policy", "longflow",
                                    "--budget", "40", "--new-tokens", "4", "--prompt-len", "8", "--json", out)
    assert code == 0, err
    rows = strict_json(sweep[1])["rows"] + strict_json(out)["rows"]
    assert {row["workload"] for row in rows} == {"throughput", "generate"}
    assert all(row["setup_s"] >= 0 and "compile_s" not in row for row in rows), rows


def test_the_floor_is_a_roofline_of_bytes_and_flops():
    """Each part of the step costs the larger of its bytes / bandwidth and its FLOPs / matmul rate."""
    import bench
    from generate import pick_device
    device, dtype = pick_device("cpu", None)
    model = bench.random_model(bench.Config.from_dict(bench.SHAPES["tiny"]), device, dtype)
    timer = bench.StepTimer(model, "longflow", 4, 40, compile=False)
    n_bytes = bench.weight_bytes(model) + timer.kv_bytes_read(40)
    flops = 2 * 4 * bench.weight_bytes(model) / 4 + 4 * 4 * 2 * 4 * 40 * 32  # B 4, fp32; 2 layers, 4 heads, D 32
    memory_bound = bench.Machine(bandwidth=1e9, matmul_rate=1e30)
    assert bench.step_floor(timer, 40, memory_bound) == (pytest.approx(n_bytes / 1e9), [])
    compute_bound = bench.Machine(bandwidth=1e30, matmul_rate=1e9)
    assert bench.step_floor(timer, 40, compute_bound) == (pytest.approx(flops / 1e9), ["weights", "attention"])


def test_the_prefill_floor_counts_every_layer_weight_and_the_causal_attention():
    import bench
    from generate import pick_device
    device, dtype = pick_device("cpu", None)
    model = bench.random_model(bench.Config.from_dict(bench.SHAPES["tiny"]), device, dtype)
    # tiny: hidden 64, 4 query / 2 KV heads of 32, intermediate 128, 2 layers, Qwen3 (q/k norms of 32)
    per_layer = 64 * 4 * 32 + 2 * 64 * 2 * 32 + 4 * 32 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 32
    T = 100
    flops = 2 * T * 2 * per_layer + 4 * 2 * 4 * 32 * (T * (T + 1) // 2)  # causal: T (T + 1) / 2 pairs a head
    assert bench.prefill_floor(model, T, bench.Machine(bandwidth=1.0, matmul_rate=1e9)) == pytest.approx(flops / 1e9)


def test_bench_checkpoint_writes_the_random_weights_as_a_folder_that_loads_exactly(tmp_path, monkeypatch, capsys):
    """The folder server.py serves on a machine that cannot download: its weights are random_model's (stored
    in bf16, so compared after the same rounding) and its tokenizer reads "tK" as token id K."""
    import bench as bench_module  # the module; bench() runs it as a command
    import tinyflow
    code, _, err = bench_in_process(monkeypatch, capsys, "checkpoint", "--shape", "tiny", "--device", "cpu", "--out",
                                    tmp_path / "ckpt")
    assert code == 0, err
    llm = tinyflow.LLM(str(tmp_path / "ckpt"), device="cpu", compile=False)
    want = bench_module.random_model(bench_module.Config.from_dict(bench_module.SHAPES["tiny"]), torch.device("cpu"), torch.float32)
    got = dict(llm.model.named_parameters())
    for name, p in want.named_parameters():
        assert torch.equal(got[name], p.to(torch.bfloat16).float()), name
    assert llm.tokenizer.encode("t5 t17 t0") == [5, 17, 0]


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_filled_cache_keeps_what_each_policy_computes_from_its_slots(kv_dtype):
    """bench.py times steps on a cache it fills with random tokens: what each policy keeps beside the slots is
    recomputed from them (16 rows at a time, here 20 rows: two parts), history (accumulated scores, recent
    queries) is what a new token starts with."""
    import bench as bench_module
    from cache import KVCache
    from model import Config
    from policies import POLICIES, Accumulated, KeySum, PerSlot
    cfg = Config.from_dict(bench_module.SHAPES["tiny"])
    model = bench_module.random_model(cfg, "cpu", torch.bfloat16)  # (TriAttention: random statistics, bench.ready)
    for name, policy in POLICIES.items():
        policy = bench_module.ready(policy, model)
        cache = KVCache(cfg, 20, 48, "cpu", torch.bfloat16, policy, kv_dtype=kv_dtype)
        bench_module.fill_cache(cache, 40)
        for layer in cache.layers:
            assert layer.pos[..., :40].eq(torch.arange(40)).all() and layer.pos[..., 40:].eq(-1).all()
            for kept_name, kept in policy.keeps.items():
                if isinstance(kept, (PerSlot, KeySum)):
                    torch.testing.assert_close(layer.kept[kept_name], kept.recompute(cache.with_values(layer)),
                                               rtol=0, atol=0, msg=f"{name}: {kept_name}")
                elif isinstance(kept, Accumulated):
                    assert layer.kept[kept_name].eq(0).all(), f"{name}: {kept_name} starts at 0"
