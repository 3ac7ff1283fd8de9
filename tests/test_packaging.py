"""What `pip install` gives a user: every file and command, on a machine with or without Triton, and a clear
error when a file of theirs shadows one of tinyflow's top-level modules."""
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tinyflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, cwd=ROOT, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))


def clone_copy(folder):
    """A copy of the repository's files, as a clone holds them (building writes build/ and egg-info beside them)."""
    shutil.copytree(ROOT, folder, ignore=shutil.ignore_patterns(".git", ".models", "build", "*.egg-info", "runs",
                                                                "__pycache__", ".pytest_cache"))
    return folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools", reason="building the wheel without a network needs setuptools installed")
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp), str(clone_copy(tmp / "source"))], capture_output=True, text=True,
                           timeout=1200)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp.glob("tinyflow-*.whl")
    return wheel


def test_the_wheel_holds_every_module_the_datasets_and_the_commands(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f for f in os.listdir(ROOT) if f.endswith(".py")}  # every flat file of the repository installs
    datasets = {f"tinyflow_data/{d}.jsonl" for d in ("aime24", "aime25", "amc", "gsm8k", "math", "minerva",
                                                     "olympiad", "rust_book")}
    assert modules | datasets <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for command in ("tinyflow-generate = generate:main", "tinyflow-eval = eval:main", "tinyflow-bench = bench:main",
                    "tinyflow-serve = server:main"):
        assert command in entry_points


def test_the_install_brings_numpy_without_which_torch_warns_at_every_import(wheel):
    """tinyflow does not use numpy, but after a `pip install .` without it every command printed torch's warning."""
    r = python("import sys; sys.modules['numpy'] = None\nimport torch")  # `import numpy` now raises ImportError
    assert "UserWarning: Failed to initialize NumPy" in r.stderr
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: numpy" in metadata.splitlines()


def test_a_script_beside_the_clone_imports_tinyflow_installed_as_the_readme_says(tmp_path):
    """The clone at ~/tinyflow, a script in ~: the script's folder comes first on sys.path and holds a folder named
    tinyflow, which Python's own search answers with as a namespace package unless a tinyflow.py is on the path.
    setuptools' default editable install puts a finder after that search, so the script got an empty module
    (`module 'tinyflow' has no attribute 'LLM'`); the README's install puts the files on the path."""
    pytest.importorskip("setuptools", reason="installing without a network needs setuptools installed")
    readme = (Path(ROOT) / "README.md").read_text()
    install = re.search(r"Then, from a clone:\n\n    (pip install -e .*)\n", readme).group(1)
    clone = clone_copy(tmp_path / "tinyflow")
    # a virtual environment of its own, over this one's packages (torch and the rest) and its pip
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "venv")],
                   check=True, timeout=600)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    pip, args = shlex.split(install)[:2], shlex.split(install)[2:]
    assert pip == ["pip", "install"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([venv_python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
                       cwd=clone, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr
    (tmp_path / "script.py").write_text("import tinyflow\nprint(tinyflow.LLM.__name__, tinyflow.__file__)\n")
    r = subprocess.run([venv_python, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                       env=env)
    assert r.returncode == 0 and r.stdout.split()[0] == "LLM", r.stderr
    assert os.path.realpath(r.stdout.split()[1]) == str(clone / "tinyflow.py")  # the clone's own file


def test_install_hints_name_packages_that_install_from_anywhere():
    """`pip install -e '.[eval]'` works only inside a clone, and `tinyflow[eval]` from the package index is another
    project of that name: a hint the code prints names the packages (or, to reinstall, the clone's path)."""
    scripts = [*Path(ROOT).glob("*.py"), *(f for f in Path(ROOT).glob("tests/*.py")  # smollm2.py, ...
                                           if not f.name.startswith(("test_", "conftest")))]
    hints = [(f, line.strip()) for f in sorted(scripts) for line in f.read_text().splitlines() if "pip install" in line]
    assert hints
    for f, line in hints:
        assert not re.search(r"pip install (-e )?['\"]?\.|tinyflow\[", line), f"{f.name}: {line}"


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
    with pytest.raises(ImportError) as refused:
        tinyflow.check_own_modules()
    assert str(refused.value) == ("tinyflow's install is out of date: `import step` finds no step.py; reinstall it: "
                                  f"pip install -e {ROOT} --config-settings editable_mode=strict")
