"""What `pip install` gives a user: every file and command, on a machine with or without Triton, and a clear
error when a file of theirs shadows one of tinyflow's top-level modules."""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import tinyflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, cwd=ROOT, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))


def test_the_wheel_holds_every_module_the_datasets_and_the_commands(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without a network needs setuptools installed")
    source = tmp_path / "source"  # a copy: building writes build/ and egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".models", "build", "*.egg-info", "runs"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("tinyflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f for f in os.listdir(ROOT) if f.endswith(".py")}  # every flat file of the repository installs
    datasets = {f"tinyflow_data/{d}.jsonl" for d in ("aime24", "aime25", "amc", "gsm8k", "math", "minerva",
                                                     "olympiad", "rust_book")}
    assert modules | datasets <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for command in ("tinyflow-generate = generate:main", "tinyflow-eval = eval:main", "tinyflow-bench = bench:main",
                    "tinyflow-serve = server:main"):
        assert command in entry_points


def test_the_cpu_path_runs_without_triton(checkpoints):
    """Triton is a Linux/CUDA package: without it (macOS, say) tinyflow still imports and runs on the CPU."""
    r = python("import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
               "import tinyflow\n"
               f"llm = tinyflow.LLM({str(checkpoints['qwen3'])!r}, budget=40, device='cpu', compile=False)\n"
               "print(len(llm.generate(['Hello'], max_new_tokens=3)[0].token_ids))")
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr


def test_a_users_model_py_is_not_imported_in_place_of_tinyflows(tmp_path):
    (tmp_path / "model.py").write_text("raise SystemExit('the wrong model.py ran')\n")
    r = python("import tinyflow", cwd=tmp_path)  # `python -c` puts the current folder first on sys.path
    assert r.returncode != 0 and "the wrong model.py" not in r.stderr + r.stdout
    assert f"tinyflow needs its own model.py (in {ROOT}) but `import model` finds {tmp_path / 'model.py'}" in r.stderr


def test_an_install_older_than_a_module_says_to_reinstall(monkeypatch):
    """An editable install made before step.py existed does not map it: find_spec("step") is None."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "step" else find_spec(name))
    with pytest.raises(ImportError, match=r"install is out of date: `import step` finds no step.py; reinstall it "
                                          r"\(`pip install -e \.` from the clone, or `pip install \.`\)"):
        tinyflow.check_own_modules()
