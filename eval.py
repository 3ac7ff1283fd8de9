"""Evaluate tinyflow on reasoning benchmarks: datasets, the prompt, and answer grading.

Grading follows the usual protocol of math benchmarks (LongFlow, DeepSeek-R1): the model is asked to put
its final answer in \\boxed{}, the content of the last box is taken, and it is compared with the
reference answer as mathematics, not as text. The symbolic part is left to the maintained
`math-verify` library; this file adds what it lacks: cheap exact matches first, plain numbers with a
relative tolerance, repair of a few broken references, and a guard so one slow sympy call can never
stop an evaluation run.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import threading
from dataclasses import asdict
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Datasets: JSONL files with one {"question": ..., "true_answer": ...} object a line.

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASETS = {name: DATA_DIR / f"{name}.jsonl"
            for name in ("aime24", "aime25", "amc", "gsm8k", "math", "minerva", "olympiad")}


def load_dataset(name_or_path: str | Path) -> list[dict]:
    """The rows of a shipped dataset (a key of DATASETS) or of any JSONL file with those two fields (and an
    optional "index"; the row number when absent)."""
    path = DATASETS.get(str(name_or_path), Path(name_or_path))
    if not path.is_file():
        raise ValueError(f"unknown dataset {str(name_or_path)!r}: not one of {sorted(DATASETS)} "
                         "and no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [key for key in ("question", "true_answer") if key not in row]
        if missing:
            raise ValueError(f"{path}:{number}: row lacks {', '.join(missing)}")
        rows.append({"index": len(rows), **row})
    return rows


# The prompt of the LongFlow and R1 papers: the question, a newline, then this instruction.
PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def build_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{question}\n{PROMPT_SUFFIX}"}]


# ---------------------------------------------------------------------------------------------
# Taking the answer out of a completion.

def _closing_brace(text: str, begin: int) -> int | None:
    """Index of the } that closes the { at text[begin], counting nested groups; escaped \\{ \\} (set
    braces) are not groups. None if it never closes."""
    depth, i = 0, begin
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} (or \\fbox{...}, or `\\boxed 5`); None if none.

    A box left open at the end (a truncated generation) is skipped for the last one that closes."""
    for start in reversed([m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]):
        rest = text[start:]
        if not rest.lstrip().startswith("{"):
            word = re.match(r"\s+([^\s${}]+)", rest)  # `\boxed 5`: the next word is the answer
            if word:
                return word.group(1)
            continue
        begin = start + rest.index("{")
        end = _closing_brace(text, begin)
        if end is not None:
            return text[begin + 1:end]
    return None


def _reference(true_answer) -> str:
    """The reference answer, repaired where a dataset cut it badly.

    16 MATH-500 answers were cut from their solution between the first \\boxed{ and the last }, e.g.
    `3} \\pmod{7` or `350}$. We also ... \\boxed{350`. Their braces don't balance; putting the cut
    back inside \\boxed{} and reading the last box gives the intended answer (3, 350)."""
    answer = str(true_answer).strip()
    if _closing_brace("{" + answer + "}", 0) != len(answer) + 1:
        answer = extract_boxed("\\boxed{" + answer + "}") or answer
    return answer


# ---------------------------------------------------------------------------------------------
# Normalising an answer string. Two levels: _clean keeps the LaTeX meaningful for math-verify;
# _canon goes further (no spaces, units and \text dropped) for a cheap exact comparison.

_SCI = r"([+-]?(?:\d+\.?\d*|\.\d+))"


def _clean(answer: str) -> str:
    s = answer.replace("\\$", "").replace("$", "")  # dollars (currency and math mode)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])|\\displaystyle|\\q?quad", "", s)
    s = re.sub(r"(?<!\\)\\!", "", s).replace("{,}", ",")  # thousands: `10,\!080`, `10{,}080`
    s = re.sub(r"(?<!\\)\\[,;: ]|~", " ", s)  # other LaTeX spacing (but not the row break \\)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)  # 30^\circ is 30: the question asks for degrees
    # Percent: 50\% means the number 50 (the question asks "what percent"); 0.5 is graded wrong.
    s = re.sub(r"\\?%", "", s)
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"^\+(?=\d)", "", s)  # a leading + on a number
    s = re.sub(r"(?<=\d)\.(?!\d)", "", s)  # Python floats of Minerva: -1./3
    s = re.sub(r"\bnp\.(?=[a-z])", r"\\", s)  # and numpy calls: np.arcsin(10/13)
    # Scientific e-notation of the Minerva references (4.5e33): math-verify would read e as Euler's.
    return re.sub(rf"^{_SCI}e([+-]?\d+)$", r"\1\\times10^{\2}", s)


def _canon(answer: str) -> str:
    s = _clean(answer)
    # A trailing unit (`54\text{ cm}`, `864 \mbox{ inches}^2`) after the value is dropped.
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?$", "", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)  # \text{Evelyn} is Evelyn
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)  # x_{0} is x_0
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 is 1000 (but 2500,7500 is a list)
        s = s.replace(",", "")
    return re.sub(rf"^{_SCI}(?:\\times|\\cdot)10\^\{{?([+-]?\d+)\}}?$", r"\1e\2", s)


def _number(s: str) -> float | None:
    return float(s) if re.fullmatch(rf"{_SCI}(e[+-]?\d+)?", s) else None


def _choice(s: str) -> str | None:
    """The letter of a multiple-choice answer: C, (C), \\text{(C)}, \\textbf{(C) }5 after _canon."""
    match = re.match(r"\(?([A-E])(\)|$)", s)
    return match.group(1) if match else None


# ---------------------------------------------------------------------------------------------
# Deciding equivalence.

MATH_VERIFY_TIMEOUT_S = 5  # per parse / comparison; signal.alarm takes whole seconds
NUMBER_REL_TOL = 1e-4  # for non-integer references, which are rounded (Minerva: "to 3 decimal places")


def _numbers_equal(reference: str, answer: str) -> bool | None:
    """Plain numbers compare by value: exactly if the reference is an integer (AIME, GSM8K), else
    within a relative tolerance. math-verify rounds to 6 decimals, which would equate 1.3e-27 with
    1.325e-27. None when either side is not a plain number."""
    ref, ans = _number(reference), _number(answer)
    if ref is None or ans is None:
        return None
    if re.fullmatch(r"[+-]?\d+", reference):
        return ans == ref
    return math.isclose(ans, ref, rel_tol=NUMBER_REL_TOL)


def _math_verify(reference: str, answer: str, timeout: int | None) -> bool:
    """math-verify's verdict; False on any failure inside the library (parse error, timeout)."""
    try:  # imported late: loading sympy takes a second
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        raise ImportError("grading answers needs math-verify: pip install -e '.[eval]'") from None

    try:  # wrapping in \boxed{} makes math-verify read exactly this string, units and all
        gold = parse("\\boxed{" + reference + "}", parsing_timeout=timeout)
        pred = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


def _symbolic_equal(reference: str, answer: str) -> bool:
    """math-verify under a time limit. Its own limit uses signal.alarm, which works only on the main
    thread; elsewhere (a grading thread pool) it runs untimed in a helper thread that we stop
    waiting for: a runaway sympy call then grades False and is left to finish in the background."""
    if threading.current_thread() is threading.main_thread():
        return _math_verify(reference, answer, MATH_VERIFY_TIMEOUT_S)
    verdict = []
    helper = threading.Thread(target=lambda: verdict.append(_math_verify(reference, answer, None)),
                              daemon=True)
    helper.start()
    helper.join(2 * MATH_VERIFY_TIMEOUT_S)
    return bool(verdict and verdict[0])


# math-verify warns on each timeout (already graded False) and on running untimed (our threads).
logging.getLogger("math_verify").setLevel(logging.ERROR)


def is_correct(completion_text: str, true_answer) -> bool:
    """Whether the last \\boxed{} answer of a completion equals the reference answer mathematically.

    Order matters for tuples and intervals, and so do an interval's brackets; a comma list without
    brackets is a set of answers (1,-2 equals -2,1). Units, degrees and percent signs are ignored."""
    boxed = extract_boxed(completion_text)
    if boxed is None:
        return False
    reference = _reference(true_answer)
    ref, ans = _canon(reference), _canon(boxed)
    if not ans:
        return False
    if ref == ans:
        return True
    if re.fullmatch(r"\(?[A-E]\)?", ref):  # a lone letter: the key of a multiple-choice question
        return _choice(ref) == _choice(ans.upper())
    numbers = _numbers_equal(ref, ans)
    if numbers is not None:
        return numbers
    return _symbolic_equal(_clean(reference), _clean(boxed))


# ---------------------------------------------------------------------------------------------
# A synthetic long-context check that needs no download: find the value hidden in a long haystack
# (RULER-style needle retrieval), generated from a seed at any length, so compression can be tested
# on prompts longer than the budget.

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A river runs through the valley, and the hills are quiet in the evening light. ")


def retrieval_items(n: int, words: int, seed: int = 0) -> list[dict]:
    """n questions, each a haystack of about `words` words with one key-value needle at a seeded depth."""
    rng = random.Random(seed)
    filler = FILLER.split()
    items = []
    for i in range(n):
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
        value = str(rng.randrange(10**6, 10**7))
        hay = [filler[j % len(filler)] for j in range(words)]
        hay.insert(rng.randrange(words), f"The special magic number for {key} is {value}.")
        question = (" ".join(hay) + f"\n\nWhat is the special magic number for {key} mentioned in the text "
                    "above? Answer with the number alone.")
        items.append({"index": i, "question": question, "true_answer": value})
    return items


# ---------------------------------------------------------------------------------------------
# Running a model: one JSONL line per (item, sample), resumable, then a summary.

def run_file(out_dir: Path, data: str, policy: str, budget: int | None) -> Path:
    return out_dir / f"{Path(data).stem}_{policy}_{budget or 'all'}.jsonl"


def read_rows(path: Path) -> list[dict]:
    """The rows an earlier, possibly interrupted run wrote; a last line cut off mid-write (every complete
    row ends with a newline) is removed from the file, so that generation is simply redone."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        path.write_text("".join(lines))
    return [json.loads(line) for line in lines]


def evaluate(llm, items: list[dict], path: Path, samples: int, max_new_tokens: int, sampling: dict,
             seed: int, chunk: int, progress=print) -> dict:
    """Generate for every (item, sample) not yet in `path`, appending a line as each chunk finishes;
    return the summary over the whole file."""
    done = {(r["index"], r["sample"]) for r in read_rows(path)}
    todo = [(it, s) for s in range(samples) for it in items if (it["index"], s) not in done]
    path.parent.mkdir(parents=True, exist_ok=True)
    generate_s, new_tokens, kv_bytes = 0.0, 0, None  # of the generations made now, not of earlier runs
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        convs = [build_messages(it["question"]) for it, _ in part]
        # a seed per (item, sample): a resumed or re-chunked run draws the same samples
        seeds = [seed + 1000003 * s + it["index"] for it, s in part]
        outs = llm.chat(convs, max_new_tokens=max_new_tokens, seed=seeds, **sampling)
        generate_s += llm.stats.decode_s + llm.stats.prefill_s
        new_tokens += llm.stats.generated_tokens
        kv_bytes = llm.stats.kv_bytes
        with path.open("a") as f:
            for (it, s), conv, out in zip(part, convs, outs):
                prompt_len = len(llm.tokenizer.chat(conv))
                f.write(json.dumps({
                    "index": it["index"], "sample": s, "prompt": conv[0]["content"], "completion": out.text,
                    "answer": extract_boxed(out.text), "true_answer": it["true_answer"],
                    "correct": is_correct(out.text, it["true_answer"]), "tokens": len(out.token_ids),
                    "budget_full": llm.budget is not None and prompt_len + len(out.token_ids) > llm.budget,
                }) + "\n")
        progress(f"{path.name}: {min(start + chunk, len(todo))}/{len(todo)} generations")
    rows = read_rows(path)
    return {"file": str(path), "items": len({r["index"] for r in rows}), "samples": samples,
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
            "budget_full_fraction": sum(r["budget_full"] for r in rows) / len(rows),
            "tokens_per_s": new_tokens / generate_s if generate_s else None,
            "kv_bytes": kv_bytes}


def check_settings(path: Path, settings: dict):
    """Resume a run only with the settings it was started with, so one file never mixes two runs."""
    saved = path.with_suffix(".settings.json")
    if path.exists() and saved.exists() and json.loads(saved.read_text()) != settings:
        raise ValueError(f"{path} was written with other settings ({saved.read_text().strip()}); "
                         f"use another --out or delete it")
    path.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(settings))


def parse_run(text: str) -> tuple[str, int | None]:
    """'longflow:3200' -> ("longflow", 3200); 'full' -> ("full", None)."""
    policy, _, budget = text.partition(":")
    if budget and not budget.isdigit():
        raise ValueError(f"bad run {text!r}: write POLICY or POLICY:BUDGET, e.g. longflow:3200")
    if policy == "full" and budget:
        raise ValueError(f"bad run {text!r}: the full cache keeps every token and takes no budget; write full")
    return policy, int(budget) if budget else None


def write_table(summaries: list[dict], out_dir: Path):
    """A markdown table of the runs, and a PNG of accuracy against budget when matplotlib is there."""
    lines = ["| policy | budget | accuracy | mean tokens | budget ever full | tokens/s | KV MiB |",
             "|---|---|---|---|---|---|---|"]
    for s in summaries:
        tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "-"
        kv = f"{s['kv_bytes'] / 2**20:.0f}" if s["kv_bytes"] else "-"
        lines.append(f"| {s['policy']} | {s['budget'] or 'all'} | {s['accuracy']:.3f} | {s['mean_tokens']:.0f} | "
                     f"{s['budget_full_fraction']:.2f} | {tps} | {kv} |")
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in sorted({s["policy"] for s in summaries if s["budget"]}):
        pts = sorted((s["budget"], s["accuracy"]) for s in summaries if s["policy"] == policy and s["budget"])
        ax.plot(*zip(*pts), marker="o", label=policy)
    for s in summaries:
        if not s["budget"]:
            ax.axhline(s["accuracy"], linestyle="--", color="gray", label=f"{s['policy']} (all tokens)")
    ax.set(xlabel="KV budget (slots)", ylabel="accuracy", title="accuracy against budget")
    ax.legend()
    fig.savefig(out_dir / "compare.png", dpi=120, bbox_inches="tight")


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Accuracy of KV-cache policies on reasoning benchmarks.")
    p.add_argument("--model", default="Qwen/Qwen3-8B")
    p.add_argument("--data", default="aime24", help=f"one of {', '.join(DATASETS)}, 'retrieval', or a JSONL file")
    p.add_argument("--runs", nargs="+", default=["longflow:3200"],
                   help="POLICY[:BUDGET] runs to compare, e.g. full longflow:3200 tova:3200")
    p.add_argument("--max-new-tokens", type=int, default=16384)
    p.add_argument("--samples", type=int, default=1, help="pass@1 averaged over this many samples")
    p.add_argument("--limit", type=int, default=None, help="only the first N items")
    p.add_argument("--temperature", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=256, help="generations per batch and per resume point")
    p.add_argument("--retrieval-words", type=int, default=4000, help="--data retrieval: haystack words")
    p.add_argument("--out", default="runs", help="folder for the JSONL, summary and table")
    p.add_argument("--device", default=None)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    try:
        import tinyflow
        from generate import Sampling
        runs = [parse_run(r) for r in args.runs]
        items = retrieval_items(30, args.retrieval_words, args.seed) if args.data == "retrieval" \
            else load_dataset(args.data)
        items = items[:args.limit]
        out_dir = Path(args.out)
        summaries, llm = [], None
        for policy, budget in runs:
            if llm is None:
                llm = tinyflow.LLM(args.model, budget, policy, device=args.device, compile=not args.no_compile)
            llm.set_policy(budget, policy)
            sampling = asdict(Sampling.with_defaults(llm.tokenizer.defaults, args.temperature, args.top_k,
                                                     args.top_p))
            path = run_file(out_dir, args.data, policy, budget)
            check_settings(path, dict(model=args.model, data=args.data, max_new_tokens=args.max_new_tokens,
                                      sampling=sampling, seed=args.seed, retrieval_words=args.retrieval_words))
            summary = evaluate(llm, items, path, args.samples, args.max_new_tokens, sampling, args.seed, args.chunk)
            summaries.append(dict(summary, policy=policy, budget=budget, data=args.data, model=args.model,
                                  sampling=sampling))
            path.with_suffix(".summary.json").write_text(json.dumps(summaries[-1], indent=1))
        write_table(summaries, out_dir)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
