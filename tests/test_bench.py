"""bench.py end to end on the CPU with the tiny shape: it runs in seconds and writes its JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_throughput_and_long_prompt_run_on_cpu_and_write_json(tmp_path):
    for workload in ("throughput", "long-prompt"):
        out = tmp_path / f"{workload}.json"
        r = subprocess.run([sys.executable, "bench.py", workload, "--shape", "tiny", "--device", "cpu",
                            "--no-compile", "--batch", "2", "--new-tokens", "24", "--budget", "40",
                            "--prompt-len", "80", "--validate", "20", "--json", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        rows = json.loads(out.read_text())["rows"]
        assert rows and all(row["workload"] == workload for row in rows)
        if workload == "throughput":
            assert {row["policy"] for row in rows} == {"longflow", "full"}
            assert all(row["tokens_per_s"] > 0 and 0 < row["floor_fraction"] for row in rows)
            assert "longflow / full throughput" in r.stdout
            assert all(row["real_ms_per_step"] > 0 and row["predicted_ms_per_step"] > 0 for row in rows)
        else:
            assert [row["slots"] for row in rows] == [80 + 24, 40, 40]  # full, 50% of 80, the budget


def test_bench_transformers_baseline_runs_on_cpu(tmp_path):
    out = tmp_path / "hf.json"
    r = subprocess.run([sys.executable, "bench.py", "hf", "--shape", "tiny", "--device", "cpu", "--batch", "2",
                        "--new-tokens", "16", "--prompt-len", "8", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["tokens_per_s"] > 0


def test_bench_sweeps_batches_and_budgets_and_runs_the_full_cache_once(tmp_path):
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, "bench.py", "throughput", "--shape", "tiny", "--device", "cpu", "--no-compile",
                        "--batch", "1", "3", "--budget", "40", "48", "--new-tokens", "24", "--prompt-len", "30",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    runs = sorted((row["policy"], row["slots"], row["batch"]) for row in json.loads(out.read_text())["rows"])
    assert runs == [("full", 54, 1), ("full", 54, 3), ("longflow", 40, 1), ("longflow", 40, 3),
                    ("longflow", 48, 1), ("longflow", 48, 3)]
    bad = subprocess.run([sys.executable, "bench.py", "long-prompt", "--shape", "tiny", "--device", "cpu",
                          "--budget", "40", "48"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error: the long-prompt workload takes one --budget")
