"""Are the teacher-forced log-probabilities of every policy bit-identical to those of another revision?

    python tests/compare_scores.py REV          # e.g. HEAD~3; exit status 1 when any logprob differs
    python tests/compare_scores.py REV --tiny   # the tiny checkpoints only (minutes instead of an hour)

For a refactoring that must not change numerics: this tree and git revision REV (exported to a temporary
folder) each score the same prompts and continuations through LLM.score with every policy of POLICIES
(each prompt longer than the budget, so prompt compression and eviction both run), with each prompt
compression, and with an FP8 cache, on the tiny random Qwen3 / Qwen2 / Llama checkpoints of the tests; on
the real SmolLM2-135M checkpoint, when tests/.models holds it, each policy with SnapKV and with its own rule
and shorter continuations. Both trees read the same checkpoint
folders, written once here. Only the public API is used, so any revision since LLM.score existed runs.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET = 64  # every policy's smallest budget fits (vatp: 20 sinks + the 32-token prompt window + 1)
SMOLLM2 = HERE / ".models" / "smollm2-135m-instruct"


def runs(policies: list[str], every_variant: bool):
    """(name, LLM settings) of every run: each policy with SnapKV and with its own rule for prompts and,
    with every_variant (the tiny checkpoints: fast), with the streaming rule and an FP8 cache too; sinks
    and a window given by hand; the full cache."""
    for policy in policies:
        if policy == "full":
            yield "full", dict(budget=None, policy="full")
            continue
        for rule in ("snapkv", "decode", "streaming")[:3 if every_variant else 2]:
            yield f"{policy}/{rule}", dict(budget=BUDGET, policy=policy, prompt_compression=rule)
        if every_variant:
            yield f"{policy}/fp8", dict(budget=BUDGET, policy=policy, kv_dtype="fp8")
    yield "longflow/sinks4-window16", dict(budget=BUDGET, policy="longflow", sinks=4, window=16)
    yield "longflow-head/window40", dict(budget=BUDGET, policy="longflow-head", window=40)


def emit(models: dict[str, str], out: str):
    """Score with the tinyflow found first on sys.path (this tree's or REV's) and write the results."""
    import tinyflow
    try:
        from policies import POLICIES
    except ImportError:  # a revision before policies.py
        from cache import POLICIES
    results = {"tinyflow": tinyflow.__file__}
    for arch, folder in models.items():
        llms = {dtype: tinyflow.LLM(folder, device="cpu", compile=False, kv_dtype=dtype) for dtype in ("auto", "fp8")}
        vocab = llms["auto"].model.cfg.vocab_size
        # three prompts for two rows: the third refills a row; lengths differ, so the batch is padded
        prompts = [[(7 * i + 3 * j) % vocab for i in range(n)] for j, n in enumerate((90, 75, 100))]
        lengths = (64, 48, 40) if arch != "smollm2" else (40, 32, 24)  # each evicts on every step but its first
        conts = [[(11 * i + 5 * j + 1) % vocab for i in range(n)] for j, n in enumerate(lengths)]
        for name, settings in runs(list(POLICIES), every_variant=arch != "smollm2"):
            llm = llms[settings.pop("kv_dtype", "auto")]
            llm.set_policy(**settings)
            scores = llm.score(prompts, conts, batch_size=2)
            results[f"{arch}/{name}"] = [[x.hex() for x in s.logprobs] for s in scores]
            print(f"{arch}/{name}", file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(results))


def checkpoints(root: Path, tiny_only: bool) -> dict[str, str]:
    sys.path[:0] = [str(HERE), str(HERE.parent)]  # conftest imports kernel
    from conftest import write_checkpoint
    root.mkdir()
    models = {arch: str(write_checkpoint(root / arch, arch)) for arch in ("qwen3", "qwen2", "llama")}
    if not tiny_only and (SMOLLM2 / "config.json").exists():
        models["smollm2"] = str(SMOLLM2)
    return models


def scores_of(tree: Path, models: dict, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(HERE / "compare_scores.py"), "--emit", json.dumps(models), str(out)],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(rev: str, tiny_only: bool) -> int:
    repo = HERE.parent
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "rev").mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp / "rev")], input=archive, check=True)
        models = checkpoints(tmp / "ckpt", tiny_only)
        new, old = scores_of(repo, models, tmp / "new.json"), scores_of(tmp / "rev", models, tmp / "old.json")
    assert Path(new.pop("tinyflow")).parent == repo and Path(old.pop("tinyflow")).parent != repo
    differ = [k for k in old if new.get(k) != old[k]]
    missing = sorted(set(old) ^ set(new))
    for k in differ:
        print(f"differs: {k}")
    for k in missing:
        print(f"only in one: {k}")
    print(f"{len(old) - len(differ)} of {len(old)} runs bit-identical to {rev} "
          f"({', '.join(models)}; {sum(len(s) for v in old.values() for s in v)} logprobs)")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--emit"]:
        emit(json.loads(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) in (2, 3) and sys.argv[2:] in ([], ["--tiny"]):
        sys.exit(main(sys.argv[1], tiny_only=sys.argv[2:] == ["--tiny"]))
    else:
        sys.exit(__doc__)
