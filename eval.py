"""Evaluate tinyflow on reasoning benchmarks: datasets, the protocols (how each paper's code asks, decodes
and grades), answer grading, needle retrieval, and teacher-forced fidelity to the full cache.

Grading follows the usual protocol of math benchmarks (LongFlow, DeepSeek-R1): the model is asked to put
its final answer in \\boxed{}, the content of the last box (the first, for the LongFlow scripts) is taken,
and it is compared with the reference answer as mathematics, not as text. The symbolic part is left to the maintained
`math-verify` library; this file adds what it lacks: cheap exact matches first, plain numbers with a
relative tolerance, repair of a few broken references, and a guard so one slow sympy call can never
stop an evaluation run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Datasets: JSONL files with one {"question": ..., "true_answer": ...} object a line.

HERE = Path(__file__).resolve().parent
# the repository's data/ folder; pip installs the same files as the tinyflow_data package (pyproject.toml)
DATA_DIR = HERE / "tinyflow_data" if (HERE / "tinyflow_data").is_dir() else HERE / "data"
DATASETS = {name: DATA_DIR / f"{name}.jsonl"
            for name in ("aime24", "aime25", "amc", "gsm8k", "math", "minerva", "olympiad")}


def load_dataset(name_or_path: str | Path) -> list[dict]:
    """The rows of a shipped dataset (a key of DATASETS) or of any JSONL file with those two fields (and an
    optional "index"; the row number when absent), checked: a row that cannot be asked or graded is an
    error naming its file and line, before any model loads."""
    path = DATASETS.get(str(name_or_path), Path(name_or_path))
    if path.is_dir():
        raise ValueError(f"dataset {path} is a folder; give a JSONL file or one of {sorted(DATASETS)}")
    if not path.is_file():
        raise ValueError(f"unknown dataset {str(name_or_path)!r}: not one of {sorted(DATASETS)} "
                         "and no such file")
    rows = []
    fix = 'write one JSON object a line, like {"question": "What is 2 + 3?", "true_answer": "5"}'
    for number, row in json_lines(path, read_text(path), fix):
        problem = row_problem(row)
        if problem:
            raise ValueError(f"{path}:{number}: {problem}")
        # the two fields and the index only: a row's own "system" or "suffix" must not override the protocol
        rows.append({"index": row.get("index", len(rows)), "question": row["question"],
                     "true_answer": row["true_answer"]})
    if not rows:
        raise ValueError(f"{path} has no rows; {fix}")
    check_unique_indices(path, rows)
    return rows


def read_text(path: Path) -> str:
    """A file's UTF-8 text, or an error that names the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}; give a readable file") from None


def json_lines(path: Path, text: str, fix: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of the JSONL text of `path`; a line that is not a JSON
    object is an error naming the file and line, and saying how to `fix` it."""
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg}, column {e.colno}); {fix}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: {json_type(row)}, not a JSON object; {fix}")
        rows.append((number, row))
    return rows


def json_type(value) -> str:
    """What a parsed JSON value is, in JSON's words (for messages about files that people write)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")


def row_problem(row: dict) -> str | None:
    """Why eval.py cannot ask or grade a dataset row, or None: the question is rendered as text, the
    answer compared as text or a number, and the index names the row's generations in the run file."""
    missing = [key for key in ("question", "true_answer") if key not in row]
    if missing:
        return f"row lacks {', '.join(missing)}; every row needs a question and a true_answer"
    if not isinstance(row["question"], str):
        return f'"question" is {json_type(row["question"])}; it must be a string'
    if json_type(row["true_answer"]) not in ("a string", "a number"):
        return f'"true_answer" is {json_type(row["true_answer"])}; it must be a string or a number'
    for key in ("question", "true_answer"):
        if not str(row[key]).strip():
            return f'"{key}" is empty; every row needs a question and the answer to grade against'
    if "index" in row and (isinstance(row["index"], bool) or not isinstance(row["index"], int)):
        return f'"index" is {json.dumps(row["index"])}; it must be a whole number, or left out'
    return None


def check_unique_indices(path: Path, rows: list[dict]):
    """A run file knows a generation by its row's index: two rows with one index would share generations."""
    seen = set()
    for row in rows:
        if row["index"] in seen:
            raise ValueError(f'{path}: two rows have index {row["index"]}; give each row its own "index", or none')
        seen.add(row["index"])


# DeepSeek-R1's recommended prompt: the question, a newline, then this instruction, as the user's message.
PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Protocol:
    """How a benchmark is asked, decoded and graded, as the code whose numbers it is compared with does."""
    system: str | None  # a system message, or none
    suffix: str | None  # appended to the question, after a newline, in the user message
    sampling: dict  # Sampling fields; those not given come from the model's generation_config.json
    max_new_tokens: int
    prompt_tokens: int | None  # the templated prompt is cut to its first N tokens (None: never cut)
    budget: int | None  # the KV budget of runs written without one (None: every token)
    answer: str  # which \boxed{} is the answer: "first" or "last"
    samples: int  # generations per question, pass@1 averaged over them


PROTOCOLS = {
    # the official LongFlow scripts (yisunlp/LongFLow: generate_*.py, acc.py): this system message and the bare
    # question, Qwen3's chat template with thinking on, greedy with repetition_penalty 1.2, 8,192 new tokens,
    # the templated prompt cut to 1,000 tokens (tokenizer truncation, which keeps the first 1,000), a budget of
    # 2,048 and the first \boxed{} graded
    "longflow": Protocol("Please reason step by step, and must put your final answer within \\boxed{}", None,
                         dict(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.2), 8192, 1000, 2048,
                         "first", 1),
    # DeepSeek-R1 (its paper's evaluation, which R-KV reports too): the instruction in the user message, no
    # system message, temperature 0.6 and top-p 0.95, 32,768 new tokens, pass@1 over k samples (the paper:
    # k between 4 and 64 by test-set size; 64 here, for AIME-sized sets)
    "r1": Protocol(None, PROMPT_SUFFIX, dict(temperature=0.6, top_k=0, top_p=0.95, repetition_penalty=1.0), 32768,
                   None, None, "last", 64),
    # this project's default: R1's prompt, the model's own generation_config.json sampling, 16,384 new tokens
    "default": Protocol(None, PROMPT_SUFFIX, {}, 16384, None, None, "last", 1),
}


def build_messages(question: str, suffix: str | None = PROMPT_SUFFIX, system: str | None = None) -> list[dict]:
    user = {"role": "user", "content": f"{question}\n{suffix}" if suffix else question}
    return ([{"role": "system", "content": system}] if system else []) + [user]


def item_messages(item: dict, protocol: Protocol) -> list[dict]:
    """The conversation that asks an item: the protocol's, unless the item brings its own instruction
    (needle retrieval asks for the number alone, with no system message)."""
    return build_messages(item["question"], item.get("suffix", protocol.suffix), item.get("system", protocol.system))


def grade(item: dict, completion: str, answer: str = "last") -> bool:
    if item.get("grade") == "needle":
        return needle_found(completion, item["true_answer"])
    return is_correct(completion, item["true_answer"], answer)


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


def extract_boxed(text: str, which: str = "last") -> str | None:
    """The content of the last complete, non-empty \\boxed{...} (or \\fbox{...}, or `\\boxed 5`), or of the
    first box; None if none.

    A last box left open (a truncated generation) or left empty is skipped for the last one before it. The
    first box is read as LongFlow's acc.py reads it: the first `\\boxed{` exactly, no answer if it never closes."""
    if which == "first":
        match = re.search(r"\\boxed\{", text)
        end = _closing_brace(text, match.end() - 1) if match else None
        return text[match.end():end] if end is not None else None
    for start in reversed([m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]):
        rest = text[start:]
        if not rest.lstrip().startswith("{"):
            word = re.match(r"\s+([^\s${}]+)", rest)  # `\boxed 5`: the next word is the answer
            if word:
                return word.group(1)
            continue
        begin = start + rest.index("{")
        end = _closing_brace(text, begin)
        if end is not None and text[begin + 1:end].strip():
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
    """Plain numbers compare by value: exactly if the reference is a whole number (AIME, GSM8K, AMC's "27.0"), else
    within a relative tolerance. math-verify rounds to 6 decimals, which would equate 1.3e-27 with
    1.325e-27. None when either side is not a plain number."""
    ref, ans = _number(reference), _number(answer)
    if ref is None or ans is None:
        return None
    if re.fullmatch(r"[+-]?\d+(\.0+)?", reference):  # "27" or AMC's "27.0"; not a rounded "3.83e35"
        return ans == ref
    return math.isclose(ans, ref, rel_tol=NUMBER_REL_TOL)


def _math_verify(reference: str, answer: str, timeout: int | None) -> bool:
    """math-verify's verdict; False on any failure inside the library (parse error, timeout)."""
    try:  # imported late: loading sympy takes a second
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        raise ImportError("grading answers needs math-verify: pip install 'math-verify>=0.9'") from None

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


def is_correct(completion_text: str, true_answer, which: str = "last") -> bool:
    """Whether the last (or first) \\boxed{} answer of a completion equals the reference answer mathematically.

    Order matters for tuples and intervals, and so do an interval's brackets; a comma list without
    brackets is a set of answers (1,-2 equals -2,1). Units, degrees and percent signs are ignored."""
    boxed = extract_boxed(completion_text, which)
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
# Needle retrieval (RULER-style) that needs no download: a key-value "needle" hidden at a known depth in
# real prose, generated from a seed at any length, so compression can be tested on prompts longer than
# the budget. Graded by string match, as RULER does, a little stricter: the value must appear in the answer
# as a whole number (a cut-off 608 does not count for 6088743).

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the needle sits, as a share of the haystack, in turn


def retrieval_items(n: int, words: int, seed: int = 0) -> list[dict]:
    """n questions, each `words` words of the shipped Rust book prose (from a seeded place) with one needle
    "The special magic number for KEY is VALUE." at the next of NEEDLE_DEPTHS."""
    rng = random.Random(seed)
    prose = " ".join(json.loads(line)["text"] for line in RUST_BOOK.read_text(encoding="utf-8").splitlines()).split()
    if not 0 < words < len(prose):
        raise ValueError(f"--retrieval-words must be in 1..{len(prose) - 1} (the shipped prose has {len(prose)} words)")
    items = []
    for i in range(n):
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
        value = str(rng.randrange(10**6, 10**7))
        start = rng.randrange(len(prose) - words)
        hay, depth = prose[start:start + words], NEEDLE_DEPTHS[i % len(NEEDLE_DEPTHS)]
        needle = f"The special magic number for {key} is {value}."
        hay.insert(round(depth * words), needle)
        question = ("A special magic number is hidden in the following text. Remember it; I will ask you about "
                    f"it afterwards.\n\n{' '.join(hay)}\n\nWhat is the special magic number for {key} mentioned "
                    "in the text above? Answer with the number alone.")
        items.append({"index": i, "question": question, "true_answer": value, "depth": depth,
                      "needle": needle, "suffix": None, "system": None, "prompt_tokens": None, "grade": "needle"})
    return items


def needle_found(completion: str, value: str) -> bool:
    return value in re.findall(r"\d+", completion)


def needle_kept(llm, conv: list[dict], item: dict, ids: list[int] | None = None) -> float:
    """The share of (layer, KV head) rows of the cache that still hold every token of the needle's value
    right after the prompt was prefilled and compressed with the LLM's budget and rules. ids: the prompt
    as it was generated from, if not simply the rendered conversation (they must agree on its tokens)."""
    import torch

    from cache import KVCache
    text = llm.tokenizer.render(conv)
    at = text.index(item["needle"]) + item["needle"].index(item["true_answer"])
    enc = llm.tokenizer.tok.encode(text, add_special_tokens=False)
    wanted = {i for i, (a, b) in enumerate(enc.offsets) if a < at + len(item["true_answer"]) and b > at}
    assert wanted, "the needle's value must be somewhere in the tokens"
    if ids is not None and ids != enc.ids:
        raise ValueError("needle_kept: the prompt's ids are not those of its rendered conversation")
    T, tensor = len(enc.ids), lambda data: torch.tensor(data, device=llm.device)
    full = llm.budget is None or not llm.policy.evicts  # as generation does: room for every token
    cache = KVCache(llm.model.cfg, 1, T + 1 if full else llm.budget, llm.device, llm.dtype,
                    llm.engine.for_model(llm.policy), llm.prompt_rule, llm.engine.kv_dtype, llm.model.tp)
    llm.model(tensor([enc.ids]), tensor([list(range(T))]), cache, rows=tensor([0]), last=tensor([T - 1]))
    rows = [set(row) for layer in cache.layers for row in layer.pos[0].tolist()]  # L x H_kv sets of positions
    share = sum(wanted <= row for row in rows) / len(rows)
    # tensor parallel: each rank holds as many of the (layer, KV head) rows, so the share is their mean
    return share if llm.model.tp.size == 1 else llm.model.tp.mean(tensor([share])).item()


# ---------------------------------------------------------------------------------------------
# Running a model: one JSONL line per (item, sample), resumable, then a summary.

def run_file(out_dir: Path, data: str, policy: str, budget: int | None, rule: str = "snapkv",
             kv_dtype: str = "auto", weights: str = "auto") -> Path:
    return out_dir / f"{Path(data).stem}_{run_name(policy, budget, rule, '_', kv_dtype, weights)}.jsonl"


def run_name(policy: str, budget: int | None, rule: str, sep=":", kv_dtype: str = "auto", weights: str = "auto") -> str:
    """longflow:3200, or longflow:3200:streaming for a prompt compression other than SnapKV; then :fp8 for an FP8
    cache and :fp8-weights (:fp8-all-weights) for FP8 weights."""
    return sep.join([policy, str(budget or "all")] + ([rule] if rule != "snapkv" else []) +
                    (["fp8"] if kv_dtype == "fp8" else []) + ([f"{weights}-weights"] if weights != "auto" else []))


ROW_KEYS = ("index", "sample", "correct", "tokens", "budget_full")  # what resuming and summaries read of a row


def read_rows(path: Path) -> list[dict]:
    """The rows an earlier, possibly interrupted run wrote; a last line cut off mid-write (every complete
    row ends with a newline) is removed from the file, so that generation is simply redone. Any other
    damaged line is an error naming the file and line."""
    if not path.exists():
        return []
    text = read_text(path)  # (newlines translated: \r\n reads as \n)
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        data = path.read_bytes()
        os.truncate(path, data.rfind(b"\n") + 1)  # cut in place, by bytes: complete rows are never rewritten
    fix = "delete that line (or the file) and run again to redo its generation"
    rows = []
    for number, row in json_lines(path, text, fix):
        missing = [key for key in ROW_KEYS if key not in row]
        if missing:
            raise ValueError(f"{path}:{number}: a row without {', '.join(missing)}; {fix}")
        rows.append(row)
    return rows


def saved_rows(path: Path, items: list[dict], samples: int) -> list[dict]:
    """The rows of `path` for these items and samples (a file may hold more, from a run with a larger
    --limit or --samples)."""
    wanted = {it["index"] for it in items}
    return [r for r in read_rows(path) if r["index"] in wanted and r["sample"] < samples]


def prompt_ids(tokenizer, item: dict, protocol: Protocol) -> tuple[list[dict], list[int], bool]:
    """The item's conversation, its token ids through the chat template (thinking on), and whether the
    protocol cut them to its prompt_tokens (keeping the first ones, as the LongFlow scripts' tokenizer call
    does; 0 or None: never)."""
    conv = item_messages(item, protocol)
    ids = tokenizer.chat(conv)
    limit = item.get("prompt_tokens", protocol.prompt_tokens)  # needle retrieval: never cut
    cut = bool(limit) and len(ids) > limit
    return conv, ids[:limit] if cut else ids, cut


def evaluate(llm, items: list[dict], path: Path, protocol: Protocol, sampling: dict, seed: int,
             batch_size: int | None = None, dp: bool = False) -> dict:
    """Generate for every (item, sample) not yet in `path`, appending its line the moment it finishes (an
    interrupted run keeps every finished generation); return the summary over the rows of these items and
    samples. dp: under torchrun, each rank generates its share (every world-th generation) into its own file
    (own_file), which rank 0 merges into `path` at the end (or, after an interruption, at the next start)."""
    import parallel
    share = (parallel.rank(), parallel.world()) if dp else (0, 1)
    if parallel.rank() == 0:
        merge_rank_files(path)
    parallel.barrier()  # rank 0's merge is done before anyone reads what is done
    done = {(r["index"], r["sample"]) for r in read_rows(path)}
    todo = [(it, s) for s in range(protocol.samples) for it in items if (it["index"], s) not in done]
    asked = [prompt_ids(llm.tokenizer, it, protocol) for it, _ in todo]
    if dp and todo:  # every rank checks every prompt: one too long fails all ranks alike, and rank 0 says so
        llm.engine.check_context([ids for _, ids, _ in asked], [protocol.max_new_tokens] * len(asked))
    todo, asked = todo[share[0]::share[1]], asked[share[0]::share[1]]
    # a seed per (item, sample): a resumed run draws the same samples
    seeds = [seed + 1000003 * s + it["index"] for it, s in todo]
    stats, own = None, own_file(path, dp)
    writing = [0.0]  # seconds spent grading and writing rows, inside the engine's timed loop: not generation
    if todo:
        with open(own or os.devnull, "a") as f, ProgressBar(len(todo), path.name) as bar:
            def write(i, out):
                start = time.perf_counter()
                (it, s), (conv, ids, cut) = todo[i], asked[i]
                extra = {"depth": it["depth"], "needle_kept": needle_kept(llm, conv, it, ids)} \
                    if it.get("grade") == "needle" else {}
                f.write(json.dumps({
                    "index": it["index"], "sample": s, "messages": conv, "prompt_cut": cut, "completion": out.text,
                    "answer": extract_boxed(out.text, protocol.answer), "true_answer": it["true_answer"],
                    "correct": grade(it, out.text, protocol.answer), "tokens": len(out.token_ids),
                    "budget_full": llm.budget is not None and len(ids) + len(out.token_ids) > llm.budget, **extra,
                }) + "\n")
                f.flush()
                bar.update(1, len(out.token_ids))
                writing[0] += time.perf_counter() - start

            llm.generate([ids for _, ids, _ in asked], max_new_tokens=protocol.max_new_tokens,
                         seed=seeds if sampling["temperature"] > 0 else None,  # greedy: no seed to give
                         batch_size=batch_size, on_output=write, **sampling)
        stats = llm.stats
    generating = stats.decode_s + stats.prefill_s - writing[0] if stats else 0.0
    tokens, seconds = zip(*parallel.gather((stats.generated_tokens if stats else 0, generating))) if dp else ((), ())
    parallel.barrier()  # every rank's rows are written
    if parallel.rank() == 0:
        merge_rank_files(path)
    parallel.barrier()  # and merged, before anyone reads the run's file
    rows = saved_rows(path, items, protocol.samples)
    return {"file": str(path), "items": len(items), "samples": protocol.samples, "rows": len(rows),
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
            "budget_full_fraction": sum(r["budget_full"] for r in rows) / len(rows),
            "prompts_cut": sum(r.get("prompt_cut", False) for r in rows) / len(rows),
            # of the generations made now; None when nothing was left to generate (the caller keeps the last);
            # data parallel: every rank's tokens over the slowest rank's time
            "tokens_per_s": (sum(tokens) / max(seconds) if max(seconds) else None) if dp else
            stats.generated_tokens / generating if stats else None,
            "kv_bytes": stats.kv_bytes if stats else None, **needle_summary(rows)}


def own_file(path: Path, dp: bool) -> Path | None:
    """Where this process appends its rows: rank 0 (and a single process) to the run's file; under data
    parallel rank r > 0 to one of its own beside it; under tensor parallel the other ranks nowhere (they
    generate what rank 0 generates)."""
    import parallel
    if parallel.rank() == 0:
        return path
    return path.with_name(f"{path.stem}.rank{parallel.rank()}.jsonl") if dp else None


def merge_rank_files(path: Path):
    """The rows the other ranks of a data-parallel run wrote go into the run's file (each row once), and
    their files away: at the end of the run, or at the start of the next one after an interruption."""
    done = {(r["index"], r["sample"]) for r in read_rows(path)}
    for part in rank_files(path):
        new = [row for row in read_rows(part) if (row["index"], row["sample"]) not in done]
        with path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in new)
        done |= {(row["index"], row["sample"]) for row in new}
        part.unlink()


def rank_files(path: Path) -> list[Path]:
    """The files of the other ranks of a data-parallel run beside the run's file."""
    import glob
    return sorted(path.parent.glob(f"{glob.escape(path.stem)}.rank*.jsonl"))


class ProgressBar:
    """A live bar (tqdm: done of total, rate, time left, and generated tokens/s when given), or a printed line
    every twentieth of the way when tqdm is not installed; nothing on the ranks after the first under torchrun."""

    def __init__(self, total: int, name: str, unit: str = "gen"):
        self.bar = None
        quiet = not rank0()
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=name, unit=unit, dynamic_ncols=True)
            except ImportError:
                pass
        self.quiet, self.tokens, self.done, self.total, self.name, self.unit = quiet, 0, 0, total, name, unit

    def update(self, n: int, tokens: int = 0):
        self.tokens += tokens
        self.done += n
        if self.quiet:
            return
        if self.bar is None:  # a line at every twentieth of the way instead
            step = max(1, self.total // 20)
            if self.done // step != (self.done - n) // step or self.done >= self.total:
                print(f"{self.name}: {self.done}/{self.total} {self.unit}", flush=True)
        else:
            if self.tokens:
                elapsed = self.bar.format_dict["elapsed"]
                self.bar.set_postfix_str(f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s", refresh=False)
            self.bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class RunLock:
    """An exclusive lock on a run for the life of this eval.py: a second eval.py writing the same run would
    write every row twice. flock on a file beside the run's (the lock goes with the process, however it ends),
    removed on release, so that --out holds results only (a process killed outright leaves its empty .lock,
    which keeps nobody out)."""

    def __init__(self, path: Path):
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path.with_suffix(".lock")
        while True:
            self.handle = open(self.path, "w")
            try:
                fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.handle.close()
                raise ValueError(f"another eval.py is writing {path}; wait for it to finish or use another "
                                 f"--out") from None
            if self._names_our_file():
                return
            # the eval.py that held it removed the file between our open and our flock: a lock on a removed
            # file keeps nobody out (the next one creates a new file), so lock the file the name holds now
            self.handle.close()

    def _names_our_file(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self.handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def release(self):
        self.path.unlink(missing_ok=True)  # while still locked: nobody locks the file between the two
        self.handle.close()


def needle_summary(rows: list[dict]) -> dict:
    """Needle retrieval: accuracy at each depth, and how often the needle survived prompt compression."""
    if not rows or "needle_kept" not in rows[0]:
        return {}
    depths = sorted({r["depth"] for r in rows})
    at = {d: [r["correct"] for r in rows if r["depth"] == d] for d in depths}
    return {"needle_kept": sum(r["needle_kept"] for r in rows) / len(rows),
            "accuracy_by_depth": {str(d): sum(c) / len(c) for d, c in at.items()}}


def check_settings(path: Path, settings: dict):
    """Resume a run only with the settings it was started with, so one file never mixes two runs."""
    saved = path.with_suffix(".settings.json")
    before = read_json(saved) if path.exists() and saved.exists() else settings
    if isinstance(before, dict):  # a file from before the data's digest was kept: the other settings decide
        before.setdefault("data_sha256", settings["data_sha256"])
    if not isinstance(before, dict):
        raise ValueError(f"{saved}, the settings it was written with, cannot be read; use another --out, or "
                         f"delete it and {path} to start the run again")
    changed = changed_settings(before, settings)
    if changed:
        raise ValueError(f"{path} was written with other settings: {'; '.join(changed)}; use another --out, the "
                         f"settings it was written with, or delete it")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(saved, json.dumps(settings))


def changed_settings(before: dict, now: dict, prefix: str = "") -> list[str]:
    """'NAME was OLD, now NEW' for each setting that differs, those inside a group (sampling) by their dotted
    name; long values (a system prompt, a digest) cut short."""
    changed = []
    for key in [*now, *(k for k in before if k not in now)]:
        old, new = before.get(key, MISSING), now.get(key, MISSING)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key} was {shown(old)}, now {shown(new)}")
    return changed


MISSING = object()  # a setting one of the two settings files lacks


def shown(value) -> str:
    text = "unset" if value is MISSING else json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def parse_run(text: str) -> tuple[str, int | None, str]:
    """'longflow:3200' -> ("longflow", 3200, "snapkv"); 'full' -> ("full", None, "snapkv");
    'longflow:512:streaming' -> ("longflow", 512, "streaming"): the third part compresses long prompts."""
    policy, budget, rule = (text.split(":") + ["", ""])[:3]
    if (budget and not budget.isdecimal()) or text.count(":") > 2 or (rule and not budget):
        raise ValueError(f"bad run {text!r}: write POLICY, POLICY:BUDGET or POLICY:BUDGET:PROMPT_RULE, "
                         "e.g. longflow:3200 or longflow:512:streaming")
    if policy == "full" and budget:
        raise ValueError(f"bad run {text!r}: the full cache keeps every token and takes no budget; write full")
    return policy, int(budget) if budget else None, rule or "snapkv"


def write_table_and_pyplot(lines: list[str], path: Path):
    """Write and print a markdown table; return matplotlib's pyplot for the plot beside it (drawing to
    files), or None when matplotlib is not installed."""
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_table(summaries: list[dict], out_dir: Path):
    """A markdown table of the runs, and a PNG of accuracy against budget when matplotlib is there."""
    lines = ["| policy | budget | accuracy | mean tokens | budget ever full | tokens/s | KV MiB |",
             "|---|---|---|---|---|---|---|"]
    for s in summaries:
        tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "-"
        kv = f"{s['kv_bytes'] / 2**20:.0f}" if s["kv_bytes"] else "-"
        lines.append(f"| {policy_label(s)} | {s['budget'] or 'all'} | {s['accuracy']:.3f} | {s['mean_tokens']:.0f} | "
                     f"{s['budget_full_fraction']:.2f} | {tps} | {kv} |")
    plt = write_table_and_pyplot(lines, out_dir / "compare.md")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in sorted({policy_label(s) for s in summaries if s["budget"]}):
        pts = sorted((s["budget"], s["accuracy"]) for s in summaries if policy_label(s) == policy and s["budget"])
        ax.plot(*zip(*pts), marker="o", label=policy)
    for s in summaries:
        if not s["budget"]:
            ax.axhline(s["accuracy"], linestyle="--", color="gray", label=f"{s['policy']} (all tokens)")
    budgets = sorted({s["budget"] for s in summaries if s["budget"]})
    if budgets:  # half a doubling beyond the outer budgets: one budget alone would get an axis of +-5% around it
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.xaxis.set_minor_locator(plt.NullLocator())  # unlabelled, or labelled 2^5.8 on a short axis
        ax.set_xlim(budgets[0] / 2**0.5, budgets[-1] * 2**0.5)
    # a little beyond 0 and 1: a line at accuracy 0 or 1 (the full cache's, say) would lie on the frame
    ax.set(xlabel="KV budget (slots)", ylabel="accuracy", title="accuracy against budget", ylim=(-0.05, 1.05))
    ax.legend()
    fig.savefig(out_dir / "compare.png", dpi=120, bbox_inches="tight")


# ---------------------------------------------------------------------------------------------
# Fidelity to the full cache, teacher-forced (`python eval.py fidelity ...`): every run reads the same
# token streams through Engine.score_steps; the full cache's log-probabilities, argmax and distributions are the
# reference. Per predicted token: the NLL increase over the full cache, whether the argmax agrees, and
# KL(full || run). The runs of one budget are scored in lock-step with the full cache, so each position's
# two distributions meet once and are dropped: nothing of size tokens x vocabulary is ever kept.

RUST_BOOK = DATA_DIR / "rust_book.jsonl"
# the fidelity protocol (docs/quality.md) scores the Rust book's first 4 chapters; `eval.py calibrate` reads the
# others by default, so that TriAttention's statistics made by default never saw a text they are scored on
PROTOCOL_RUST_TEXTS = 4
SELF_SAMPLING = dict(temperature=0.6, top_p=0.95)  # DeepSeek-R1's recommended sampling
BOOTSTRAP_BLOCK = 64  # tokens per block of the bootstrap error bars


def rust_texts(tokenizer, n: int, prompt_tokens: int, tokens: int) -> list[dict]:
    """The first n shipped chapters of the Rust book (data/rust_book.jsonl), each cut into a prompt and a
    continuation of the given lengths in tokens."""
    from model import plural
    texts = []
    for line in RUST_BOOK.read_text(encoding="utf-8").splitlines()[:n]:
        row = json.loads(line)
        ids = tokenizer.encode(row["text"])
        if len(ids) < prompt_tokens + tokens:
            raise ValueError(f"{row['title']} has {plural(len(ids), 'token')}, fewer than --prompt-tokens + --tokens "
                             f"({prompt_tokens + tokens})")
        texts.append({"name": f"rust/{row['title']}", "prompt": ids[:prompt_tokens],
                      "continuation": ids[prompt_tokens:prompt_tokens + tokens]})
    return texts


def self_texts(llm, model: str, n: int, tokens: int, seed: int, path: Path) -> list[dict]:
    """The model reading its own chain of thought: its full-cache answers, sampled at a fixed seed, to the
    first n MATH-500 questions asked as eval.py asks them, `tokens` long (an end-of-turn token does not
    stop it, so every text has the same length and goes on with turns the model makes up). Generated once
    and kept in `path` (for this model, n, tokens and seed)."""
    settings = {"model": model, "n": n, "tokens": tokens, "seed": seed, "sampling": SELF_SAMPLING}
    if path.exists():
        rows = [row for _, row in json_lines(path, read_text(path), "delete the file to sample the texts again")]
        if rows and rows[0] == settings:
            return rows[1:]
    items = load_dataset("math")[:n]
    prompts = [llm.tokenizer.chat(build_messages(it["question"])) for it in items]
    llm.set_policy(None, "full")
    outs = llm.generate(prompts, max_new_tokens=tokens, seed=seed, **SELF_SAMPLING, ignore_eos=True)
    texts = [{"name": f"self/math-{it['index']}", "prompt": p, "continuation": o.token_ids}
             for it, p, o in zip(items, prompts, outs)]
    write_atomically(path, "".join(json.dumps(x) + "\n" for x in [settings, *texts]))
    return texts


def score_in_lock_step(llm, texts: list[dict], runs: list[tuple[str, int, str]],
                       batch_size: int | None, kv_dtype: str = "auto", runs_model=None) -> tuple[list, list[list]]:
    """Score every text with the full cache and with each (policy, budget, prompt rule) run, advancing them in turn
    one host sync at a time. Returns the full cache's scores and, per run, its scores with a "kl" list
    per text (KL(full || run) at every position). runs_model: the runs' model (default llm's; the reference's is
    llm's, in every case)."""
    from cache import KV_DTYPES
    from policies import resolve_policy
    from generate import Engine
    prompts, conts = [t["prompt"] for t in texts], [t["continuation"] for t in texts]
    # one batch size for all: rows refill at the same steps, so the blocks of every run line up
    batch_size = batch_size or len(texts)
    reference = {}  # (text, index) -> [logp [n, V], runs still to compare]: one host sync's worth at most
    kl = [[[math.nan] * len(c) for c in conts] for _ in runs]

    def keep(p, index, logp):
        reference[p, index] = [logp, len(runs)]

    def compare(r):
        def on_dists(p, index, logp):
            entry = reference.get((p, index))
            if entry is None or len(entry[0]) != len(logp):
                raise RuntimeError("fidelity runs fell out of step with the full cache")
            kl[r][p][index:index + len(logp)] = (entry[0].exp() * (entry[0] - logp)).sum(-1).tolist()
            entry[1] -= 1
            if entry[1] == 0:
                del reference[p, index]
        return on_dists

    # the reference keeps the checkpoint's weights and the model's dtype; the runs run runs_model and store their
    # cache in kv_dtype
    engines = [Engine(runs_model or llm.model if i else llm.model, compile=llm.engine.compile,
                      kv_dtype=KV_DTYPES[kv_dtype] if i else None, allow_long_context=llm.engine.allow_long_context)
               for i in range(len(runs) + 1)]
    steps = [engines[0].score_steps(prompts, conts, None, "full", batch_size, on_dists=keep)]
    for r, (engine, (policy, budget, rule)) in enumerate(zip(engines[1:], runs)):
        steps.append(engine.score_steps(prompts, conts, budget, resolve_policy(policy, budget, prompt_rule=rule),
                                        batch_size, rule, on_dists=compare(r)))
    results = [None] * len(steps)
    total = math.ceil(len(texts) / batch_size) * max(map(len, conts))  # decode steps, about
    with ProgressBar(total, f"{len(runs) + 1} caches in lock-step", unit="step") as bar:
        while any(r is None for r in results):
            for i, s in enumerate(steps):  # the full cache first: its block is there when the runs compare theirs
                if results[i] is None:
                    try:
                        next(s)
                    except StopIteration as stop:
                        results[i] = stop.value[0]
            bar.update(min(engines[0].sync_every, total - bar.done))  # the estimate is never overshot
    if reference or any(math.isnan(x) for k in kl for text in k for x in text):
        raise RuntimeError("fidelity runs fell out of step with the full cache")
    return results[0], [(scores, kl[r]) for r, scores in enumerate(results[1:])]


def compare_scores(full, run, kl, measure_from: int, seed: int = 0) -> dict:
    """Means over every prediction from index measure_from on, with bootstrap standard errors: blocks of
    BOOTSTRAP_BLOCK consecutive tokens (neighbouring tokens are not independent) resampled 1,000 times. The
    same tokens for every run, so runs compare paired."""
    blocks = []  # per block of tokens: [sum of NLL increases, of top-1 agreements, of KL, tokens]
    per_text = []
    for f, r, k in zip(full, run, kl):
        nll = [a[1] - b[1] for a, b in zip(f[measure_from:], r[measure_from:])]
        top1 = [float(a[2] == b[2]) for a, b in zip(f[measure_from:], r[measure_from:])]
        k = k[measure_from:]
        per_text.append({"nll_increase": sum(nll) / len(nll), "top1": sum(top1) / len(top1), "kl": sum(k) / len(k)})
        for s in range(0, len(nll), BOOTSTRAP_BLOCK):
            part = slice(s, s + BOOTSTRAP_BLOCK)
            blocks.append([sum(nll[part]), sum(top1[part]), sum(k[part]), len(nll[part])])
    mean = lambda bs: [sum(b[i] for b in bs) / sum(b[3] for b in bs) for i in range(3)]
    rng = random.Random(seed)
    means = mean(blocks)
    resampled = [mean([rng.choice(blocks) for _ in blocks]) for _ in range(1000)]
    errors = [math.sqrt(sum((m[i] - means[i]) ** 2 for m in resampled) / len(resampled)) for i in range(3)]
    out = {}
    for i, name in enumerate(("nll_increase", "top1", "kl")):
        out[name], out[name + "_err"] = means[i], errors[i]
    return dict(out, per_text=per_text)


def free_generation(llm, texts: list[dict], run: tuple[str, int, str], tokens: int, full_outs,
                    kv_dtype: str = "auto", runs_model=None) -> dict:
    """Greedy generation of `tokens` tokens from each text's prompt against the full cache's: the first
    position where they differ (tokens if none), averaged over texts, how many texts differ at all, and the share
    of equal positions."""
    from cache import KV_DTYPES
    from generate import Engine
    policy, budget, rule = run
    engine = Engine(runs_model or llm.model, compile=llm.engine.compile, kv_dtype=KV_DTYPES[kv_dtype],
                    allow_long_context=llm.engine.allow_long_context)
    outs, _ = engine.generate([t["prompt"] for t in texts], tokens, [], budget, policy, prompt_rule=rule)
    first = [next((i for i, (a, b) in enumerate(zip(o, f)) if a != b), tokens) for o, f in zip(outs, full_outs)]
    equal = [sum(a == b for a, b in zip(o, f)) / tokens for o, f in zip(outs, full_outs)]
    return {"first_divergence": sum(first) / len(first), "diverged": sum(f < tokens for f in first),
            "equal_share": sum(equal) / len(equal)}


def policy_label(summary: dict) -> str:
    rule = summary["prompt_compression"]
    weights = summary.get("weights", "auto")
    fp8 = (" fp8" if summary.get("kv_dtype") == "fp8" else "") + (f" {weights}-weights" if weights != "auto" else "")
    return summary["policy"] + fp8 + ("" if rule == "snapkv" else f" ({rule} prompts)")


def first_divergence(summary: dict) -> str:
    """The mean first divergence, as the table shows it: a text whose tokens never differed counts at the cap
    (--free-tokens), so with any such text the mean is a lower bound, and with all of them there is none."""
    tokens, texts = summary["settings"]["free_tokens"], len(summary["texts"])
    diverged = summary.get("diverged", texts)  # summaries written before it was counted
    if summary["first_divergence"] == tokens:
        return f"none in {tokens}"
    if diverged < texts:
        return f"≥ {summary['first_divergence']:.0f} ({texts - diverged} of {texts} texts: none in {tokens})"
    return f"{summary['first_divergence']:.0f}"


def write_fidelity_table(summaries: list[dict], out_dir: Path):
    """fidelity.md (one row per run) and fidelity.png (NLL increase against budget, a line per policy)."""
    lines = ["| policy | budget | NLL increase (nats/token) | top-1 agreement | KL(full ‖ run) | "
             "free generation: first divergence | equal tokens |", "|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (policy_label(s), s["budget"] or 0)):
        lines.append(f"| {policy_label(s)} | {s['budget'] or 'all'} | {s['nll_increase']:+.3f} ± "
                     f"{s['nll_increase_err']:.3f} | "
                     f"{100 * s['top1']:.1f}% ± {100 * s['top1_err']:.1f} | {s['kl']:.3f} ± {s['kl_err']:.3f} | "
                     f"{first_divergence(s)} | {100 * s['equal_share']:.0f}% |")
    plt = write_table_and_pyplot(lines, out_dir / "fidelity.md")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    summaries = [s for s in summaries if s["budget"]]  # a full FP8 cache has no budget to plot against
    policies = sorted({policy_label(s) for s in summaries})
    for i, policy in enumerate(policies):
        pts = sorted((s["budget"], s["nll_increase"], s["nll_increase_err"]) for s in summaries
                     if policy_label(s) == policy)
        budgets, nll, err = zip(*pts)
        # side by side at each budget (a few hundredths of a doubling apart), or the error bars hide each other
        shift = 2 ** (0.04 * (i - (len(policies) - 1) / 2))
        # past the 10 colours of the cycle, dashed lines and squares: 14 rules are not 14 colours apart
        ax.errorbar([b * shift for b in budgets], nll, yerr=err, marker="os"[i // 10 % 2],
                    linestyle="-" if i // 10 % 2 == 0 else "--", capsize=3, label=policy)
    budgets = sorted({s["budget"] for s in summaries})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_yscale("symlog", linthresh=0.01)  # linear near 0, logarithmic above: +0.002 and +6 on one axis
    ax.set_ylim(bottom=0)
    ax.set(xlabel="KV budget (slots)", ylabel="NLL increase over the full cache (nats/token)",
           title="fidelity to the full cache, teacher-forced")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(out_dir / "fidelity.png", dpi=120, bbox_inches="tight")


def fidelity_main(argv):
    args = parse_fidelity_args(argv)
    if launched():
        raise ValueError("eval.py fidelity runs in one process; start it without torchrun")
    check_fidelity_args(args)
    run_fidelity(args)


def parse_fidelity_args(argv):
    from cli import Parser, positive_int
    from model import WEIGHTS
    p = Parser(prog="eval.py fidelity", description="Teacher-forced fidelity of KV-cache policies to the full "
               "cache: NLL increase, top-1 agreement, KL, free generation.")
    p.add_argument("--model", required=True, help="Hugging Face id or local folder")
    p.add_argument("--runs", nargs="+", required=True, help="POLICY:BUDGET[:PROMPT_RULE] runs, e.g. longflow:64 "
                   "tova:64 (the full cache always runs: it is the reference)")
    p.add_argument("--texts", nargs="+", default=["rust", "self"], choices=["rust", "self"],
                   help="rust: the shipped Rust book chapters; self: the model's own sampled answers to MATH-500")
    p.add_argument("--rust-texts", type=positive_int, default=6, help="how many Rust book chapters, from the first "
                   f"(at most 6; the protocol, docs/quality.md: {PROTOCOL_RUST_TEXTS}, those calibrate's default text "
                   "leaves out)")
    p.add_argument("--self-texts", type=positive_int, default=4, help="how many of the model's own answers")
    p.add_argument("--prompt-tokens", type=positive_int, default=64, help="rust texts: tokens read before scoring")
    p.add_argument("--tokens", type=positive_int, default=1536, help="predictions per text")
    p.add_argument("--measure-last", type=positive_int, default=512, help="average over the last N predictions")
    p.add_argument("--free-tokens", type=positive_int, default=256, help="greedy tokens for the free-generation check")
    p.add_argument("--batch-size", type=positive_int, default=None, help="texts scored together (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"],
                   help="the compared runs' KV cache (the reference stays in the model's dtype); with fp8, "
                        "`full` is a run too: every token kept, in FP8")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="the compared runs' linear weights (the reference keeps the checkpoint's): fp8 quantizes the "
                        "layers' at load into FP8 blocks (fp8.py), fp8-all the LM head's too; then `full` is a run too")
    p.add_argument("--device", default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let prompt + new tokens run past the model's max_position_embeddings")
    return p.parse_args(argv)


def check_fidelity_args(args):
    """Refuse, before anything loads, options that cannot work together (argparse checked each alone)."""
    chapters = book_chapters()
    if "rust" in args.texts and args.rust_texts > chapters:
        raise ValueError(f"--rust-texts {args.rust_texts}: data/rust_book.jsonl has {chapters} chapters")
    questions = len(load_dataset("math"))
    if "self" in args.texts and args.self_texts > questions:
        raise ValueError(f"--self-texts {args.self_texts}: data/math.jsonl has {questions} questions")
    if args.measure_last > args.tokens:
        raise ValueError(f"--measure-last {args.measure_last} is more than --tokens {args.tokens}")
    check_out(Path(args.out))
    check_seed(args.seed)


def run_fidelity(args):
    """Score the runs against the full cache a budget at a time, each result written as it is measured (one
    already measured with these settings is kept)."""
    from model import plural
    runs = fidelity_runs(args.runs, args.kv_dtype != "auto" or args.weights != "auto")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = []  # the runs whose results are on disk: what an interrupted sweep reports
    try:
        llm, runs_model = fidelity_models(args, runs)
        if "self" in args.texts:  # the model's answers are asked through its chat template
            check_chat_template(llm, args.model)
        texts = rust_texts(llm.tokenizer, args.rust_texts, args.prompt_tokens, args.tokens) \
            if "rust" in args.texts else []
        if "self" in args.texts:
            texts += self_texts(llm, args.model, args.self_texts, args.tokens, args.seed, out_dir / "self_texts.jsonl")
        settings = {k: getattr(args, k) for k in ("model", "texts", "rust_texts", "self_texts", "prompt_tokens",
                                                   "tokens", "measure_last", "free_tokens", "seed")}
        # the numbers depend on the dtype and, to rounding, the device; and on the very tokens read
        settings.update(device=llm.device.type, dtype=str(llm.dtype), texts_sha256=hashlib.sha256(
            json.dumps([[t["prompt"], t["continuation"]] for t in texts]).encode()).hexdigest())
        name = lambda run, sep=":": run_name(*run, sep, args.kv_dtype, args.weights)
        path = lambda *run: out_dir / f"fidelity_{name(run, '_')}.json"
        statistics = statistics_digest(llm.model.folder) if any(r[0] == "triattention" for r in runs) else None
        # a triattention run's settings also name its statistics: one measured before the model was calibrated
        # again is measured again
        of_run = lambda run: {**settings, "statistics_sha256": statistics} if run[0] == "triattention" else settings
        todo = [r for r in runs if (read_json(path(*r)) or {}).get("settings") != of_run(r)]
        saved += [r for r in runs if r not in todo]
        llm.set_policy(None, "full")
        full_free = [o.token_ids for o in llm.generate([t["prompt"] for t in texts], args.free_tokens,
                                                       ignore_eos=True)] if todo else None
        # one lock-step pass per budget, so each budget's results land (and survive an interruption)
        # together; the price is scoring the full cache once per budget
        for budget in sorted({r[1] for r in todo}, key=lambda b: b or 0):
            group = [r for r in todo if r[1] == budget]
            print(f"fidelity: budget {budget or 'all'}: {', '.join(map(name, group))} against the full cache, "
                  f"{plural(len(texts), 'text')} x {plural(args.tokens, 'token')}")
            start = time.perf_counter()
            full, scored = score_in_lock_step(llm, texts, group, args.batch_size, args.kv_dtype, runs_model)
            group_seconds = time.perf_counter() - start
            measure_from = args.tokens - args.measure_last
            full_nll = -sum(x[1] for f in full for x in f[measure_from:]) / (len(full) * args.measure_last)
            for run, (scores, kl) in zip(group, scored):
                summary = dict(policy=run[0], budget=budget, prompt_compression=run[2], kv_dtype=args.kv_dtype,
                               weights=args.weights, **compare_scores(full, scores, kl, measure_from),
                               **free_generation(llm, texts, run, args.free_tokens, full_free, args.kv_dtype,
                                                 runs_model),
                               full_nll=full_nll, texts=[t["name"] for t in texts], group_seconds=group_seconds,
                               settings=of_run(run))
                write_atomically(path(*run), json.dumps(summary, indent=1))
                saved.append(run)
        write_fidelity_table([read_json(path(*r)) for r in runs], out_dir)
    except KeyboardInterrupt:
        interrupted(f"{plural(len(saved), 'run')} of {len(runs)} measured and saved in {out_dir}; run the same command "
                    "to resume with the rest")


def statistics_digest(folder) -> str | None:
    """The SHA-256 of TriAttention's statistics of the checkpoint in `folder`, None where there are none."""
    import calibration
    path = calibration.path_for(folder)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def fidelity_models(args, runs: list[tuple[str, int, str]]):
    """The reference LLM (the checkpoint's weights) and the compared runs' model (args.weights), once the loaded
    checkpoint shows the runs can be measured."""
    import tinyflow
    load = lambda weights: tinyflow.LLM(args.model, device=args.device, compile=not args.no_compile,
                                        allow_long_context=args.allow_long_context, weights=weights)
    llm = load("auto")
    if args.weights == "fp8" and llm.model.cfg.fp8_blocks:
        raise ValueError("--weights fp8: this checkpoint's layers are FP8 blocks already, so the runs would be "
                         "the reference; drop --weights or quantize the LM head too (--weights fp8-all)")
    if "rust" in args.texts and any(policy == "triattention" for policy, _, _ in runs):
        check_calibration_unscored(llm.model.folder, args.model, args.rust_texts)
    return llm, llm.model if args.weights == "auto" else load(args.weights).model


def check_calibration_unscored(folder, model: str, rust_texts: int):
    """Refuse to score the first rust_texts Rust book chapters with TriAttention's statistics of this model (the
    cache folder's, where the policy finds them) when their file says they were calibrated on one of them: the
    rule would be measured on its own calibration text, flattered against the rules that read none. A refusal,
    not a warning: the results live on in files and tables that a warning does not reach."""
    import calibration
    path = calibration.path_for(folder)
    if not path.exists():
        return  # the policy refuses on its own, saying what to run
    chapters = calibrated_chapters(calibration.read(path)[1].get("text", ""))
    if not chapters or chapters.start > rust_texts:
        return
    if chapters.start > 1:
        fix = (f"give --rust-texts {chapters.start - 1} or fewer, or calibrate on a text the run does not score "
               f"(--text FILE)")
    else:  # made of the whole book
        default = spelled(range(PROTOCOL_RUST_TEXTS + 1, book_chapters() + 1))
        fix = (f"calibrate them again (python eval.py calibrate --model {model}: {default}) and give --rust-texts "
               f"{PROTOCOL_RUST_TEXTS} or fewer")
    raise ValueError(f"--rust-texts {rust_texts} scores Rust book {spelled(range(1, rust_texts + 1))}, and "
                     f"triattention's statistics of this model ({path}) were calibrated on {spelled(chapters)}: {fix}")


def calibrated_chapters(text: str) -> range:
    """The Rust book chapters (numbered from 1) that statistics were calibrated on, from the text their file
    names: calibrate's default names its chapters ("data/rust_book.jsonl, chapters 5-6"); the earlier default
    named the whole book ("data/rust_book.jsonl": every chapter, joined); any other text, none that is known."""
    named = re.fullmatch(r"data/rust_book\.jsonl(?:, chapters? (\d+)(?:-(\d+))?)?", text)
    if named is None:
        return range(0)
    first, last = named.groups()
    return range(int(first), int(last or first) + 1) if first else range(1, book_chapters() + 1)


def spelled(chapters: range) -> str:
    return f"chapter {chapters.start}" if len(chapters) == 1 else f"chapters {chapters.start}-{chapters[-1]}"


def book_chapters() -> int:
    return len(read_text(RUST_BOOK).splitlines())


def fidelity_runs(specs: list[str], full_runs: bool = False) -> list[tuple[str, int, str]]:
    """The runs to compare, checked before anything loads: a policy or budget that cannot work fails now,
    not after an hour. The full cache is the reference, so a `full` run is dropped, unless full_runs (its cache or
    its weights in FP8: not the reference)."""
    from policies import resolve_policy
    runs = [parse_run(r) for r in specs]
    if any(r[1] is None for r in runs if r[0] != "full"):
        raise ValueError("every compressed run needs a budget: write POLICY:BUDGET, e.g. longflow:64")
    runs = list(dict.fromkeys(r for r in runs if r[0] != "full" or full_runs))
    if not runs:
        raise ValueError("give at least one compressed run to compare with the full cache, e.g. longflow:64")
    for policy, budget, rule in runs:
        resolve_policy(policy, budget, prompt_rule=rule)
    return runs


# ---------------------------------------------------------------------------------------------
# TriAttention's calibration: the statistics of a model's queries (calibration.py).

def calibrate_main(argv):
    from cli import Parser, positive_int
    from model import plural
    p = Parser(prog="eval.py calibrate", description="Measure the statistics of a model's queries that policy "
               "triattention scores with (one prefill over a plain text) and write them where it finds them.")
    p.add_argument("--model", required=True, help="Hugging Face id or local folder")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the shipped Rust book's chapters "
                   f"{PROTOCOL_RUST_TEXTS + 1}-{book_chapters()}, data/rust_book.jsonl, joined: those the fidelity "
                   f"protocol, --rust-texts {PROTOCOL_RUST_TEXTS}, does not score)")
    p.add_argument("--tokens", type=positive_int, default=None, help="how many tokens of the text to read "
                   "(default: all, at most 32768 and the model's max_position_embeddings)")
    p.add_argument("--out", default=None, help="the file to write (default: the cache folder, "
                   "$TINYFLOW_CACHE or ~/.cache/tinyflow, under triattention/ by the model's fingerprint: where the "
                   "policy looks)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    args = p.parse_args(argv)
    if launched():
        raise ValueError("eval.py calibrate runs in one process; start it without torchrun")
    if args.text is None:
        name, text = unscored_chapters()
    else:
        name, text = args.text, read_text(Path(args.text))
    path, n = calibrate(args.model, text, args.tokens, args.out, args.device, args.dtype, name)
    print(f"calibrate: wrote {path}, the query statistics of {args.model} over {plural(n, 'token')} of {name}")


def unscored_chapters() -> tuple[str, str]:
    """calibrate's default text: the Rust book chapters after the fidelity protocol's first PROTOCOL_RUST_TEXTS,
    joined, and the name its statistics record (which fidelity reads back: calibrated_chapters)."""
    rows = [row for _, row in json_lines(RUST_BOOK, read_text(RUST_BOOK), "restore the file")]
    name = f"data/rust_book.jsonl, {spelled(range(PROTOCOL_RUST_TEXTS + 1, len(rows) + 1))}"
    return name, "\n\n".join(row["text"] for row in rows[PROTOCOL_RUST_TEXTS:])


# ---- measuring them (TriAttention's statistics; calibration.py keeps their file) ------------------------------------
def check_calibration_out(out, folder):
    """--out: a file, not a folder, and outside the model's folder, which stays as it came."""
    if out is None:
        return
    target, model_folder = Path(out).resolve(), Path(folder).resolve()
    if target == model_folder or model_folder in target.parents:
        raise ValueError(f"--out {out} is inside the model's folder, which stays as it came: write elsewhere, or "
                         f"leave --out out (the cache folder, where the policy looks)")
    if target.is_dir():
        raise ValueError(f"--out {out} is a folder: give the file to write (e.g. {Path(out) / 'stats.safetensors'})")


def query_statistics(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of `ids` through model (a model.Transformer), the queries of every layer taken before RoPE by a
    hook that recomputes them from the attention's input (the decode step is left as it is). Returns q_mean
    [L, H, F, 2] and q_abs_mean [L, H, F], fp32 (summed in fp64)."""
    import torch

    from cache import KVCache
    cfg, T = model.cfg, len(ids)
    sums = torch.zeros(cfg.n_layers, cfg.n_heads, cfg.head_dim // 2, 3, dtype=torch.float64)  # re, im, |q|

    def add(i, attn, args):  # a forward pre-hook: returns None, so the layer runs on its own arguments
        sums[i].add_(pair_sums(pre_rope_queries(attn, args[0])))
    hooks = [block.self_attn.register_forward_pre_hook(lambda attn, args, i=i: add(i, attn, args))
             for i, block in enumerate(model.model.layers)]
    device = model.inv_freq.device
    on_device = lambda *x: torch.tensor(x, device=device)
    try:
        with torch.no_grad():
            cache = KVCache(cfg, 1, T + 1, device, model.model.norm.weight.dtype)  # the full cache: a plain prefill
            model(on_device(ids), torch.arange(T)[None], cache, rows=on_device(0), last=on_device(T - 1))
    finally:
        for hook in hooks:
            hook.remove()
    means = (sums / T).float()
    return means[..., :2].contiguous(), means[..., 2].contiguous()


def pre_rope_queries(attn, x) -> torch.Tensor:
    """The queries model.Attention makes of its input x [B, T, hidden], before RoPE: [B, T, H, D]."""
    B, T, _ = x.shape
    q = attn.qkv_proj(x)[..., :attn.sizes[0]].view(B, T, -1, attn.cfg.head_dim)
    return attn.q_norm(q) if attn.cfg.qk_norm else q


def pair_sums(q) -> torch.Tensor:
    """Sums over the tokens of each frequency pair's real part, imaginary part and magnitude: q [1, T, H, D] ->
    [H, F, 3] fp64."""
    import torch

    re, im = q[0].double().chunk(2, -1)  # [T, H, F]
    return torch.stack((re, im, torch.hypot(re, im)), -1).sum(0)


def calibrate(model_name: str, text: str, tokens: int | None = None, out=None, device=None, dtype=None,
              text_name: str = "") -> tuple[Path, int]:
    """Measure the statistics of model_name (a folder or Hub id) over the first `tokens` tokens of text (None: as
    many as it has, at most 32,768 as the authors read, and the model's max_position_embeddings) and write them to
    out (default: the cache folder, by the model's fingerprint). Returns the path and the tokens read."""
    import calibration
    from model import plural
    from model import load, pick_device, resolve
    folder = resolve(model_name)
    check_calibration_out(out, folder)
    device, dtype = pick_device(device, dtype)
    model, tokenizer = load(folder, device, dtype)
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"{text_name or 'the text'} holds no tokens: give a text file with content")
    limit = model.cfg.max_position_embeddings or 32768
    if tokens is not None and tokens > min(len(ids), limit):
        raise ValueError(f"--tokens {tokens}: the text has {plural(len(ids), 'token')} and the model reads at most "
                         f"{limit} positions; give fewer tokens or a longer text")
    ids = ids[:tokens or min(32768, limit)]
    q_mean, q_abs_mean = query_statistics(model, ids)
    meta = calibration.identity(model.full_cfg, folder) | {"tokens": str(len(ids)), "text": text_name,
                                                            "queries": "after q_norm (Qwen3), before RoPE"}
    path = Path(out) if out is not None else calibration.default_path(meta["fingerprint"])
    return calibration.save(path, q_mean, q_abs_mean, meta), len(ids)


def read_json(path: Path) -> dict | None:
    """A result file's content, or None if it is missing or was cut off (then it is simply redone)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_atomically(path: Path, text: str):
    """Write a file so that it is either complete or absent, never half-written (an interrupted run)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None):
    """`eval.py [options]`: accuracy on a benchmark; `eval.py fidelity [options]`: fidelity to the full cache;
    `eval.py calibrate [options]`: TriAttention's statistics of a model's queries.
    Bad input is one line on stderr and exit status 2, as argparse reports a bad option."""
    argv = sys.argv[1:] if argv is None else argv
    if not rank0():  # under torchrun rank 0 alone prints (and writes the results)
        sys.stdout = open(os.devnull, "w")
    try:
        if argv[:1] == ["fidelity"]:
            fidelity_main(argv[1:])
        elif argv[:1] == ["calibrate"]:
            calibrate_main(argv[1:])
        else:
            run_main(parse_args(argv))
    except (ValueError, OSError, ImportError) as e:
        fail(e)
    except KeyboardInterrupt:  # while starting up: the runs themselves report what they saved
        interrupted("before generating anything; run the same command again (it keeps what earlier runs saved)")
    except RuntimeError as e:  # under torchrun: rank 0 stopped at Ctrl-C while this rank was in a collective
        import parallel
        if not parallel.peer_gone(e):
            raise
        sys.exit(130)


def rank0() -> bool:
    """This process prints: it is rank 0 under torchrun, or alone. (Read from torchrun's variables, as
    parallel.py does, without importing torch for it.)"""
    return int(os.environ.get("RANK", "0")) == 0


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def fail(e: Exception):
    """One line, whatever raised it (bad input, which every rank under torchrun meets alike: rank 0 says it)."""
    if rank0():
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
    sys.exit(2)


def interrupted(what: str):
    """Ctrl-C: one line on stderr and exit status 130, as a shell reports an interrupted command."""
    from cli import ignore_further_interrupts
    ignore_further_interrupts()
    if rank0():
        print(f"\ninterrupted: {what}", file=sys.stderr)
    sys.exit(130)


def parse_args(argv):
    from cli import Parser, non_negative_int, positive_int
    from model import WEIGHTS
    p = Parser(prog="eval.py", description="Accuracy of KV-cache policies on reasoning benchmarks "
               "(and `eval.py fidelity --help`: fidelity to the full cache).")
    p.add_argument("--model", default="Qwen/Qwen3-8B")
    p.add_argument("--data", default="aime24", help=f"one of {', '.join(DATASETS)}, 'retrieval', or a JSONL file")
    p.add_argument("--runs", nargs="+", default=["longflow:3200"],
                   help="POLICY[:BUDGET[:PROMPT_RULE]] runs to compare, e.g. full longflow:3200 tova:3200 (POLICY "
                        "alone: the protocol's budget, or every token)")
    p.add_argument("--protocol", default="default", choices=sorted(PROTOCOLS),
                   help="longflow: the official LongFlow scripts; r1: DeepSeek-R1's evaluation; default: R1's prompt "
                        "with generation_config.json sampling. The options below override it")
    p.add_argument("--max-new-tokens", type=positive_int, default=None)
    p.add_argument("--samples", type=positive_int, default=None, help="pass@1 averaged over this many samples")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N items")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--answer", choices=["first", "last"], default=None, help="which \\boxed{} is graded")
    p.add_argument("--prompt-tokens", type=non_negative_int, default=None,
                   help="cut templated prompts to their first N tokens (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences decoded together (default: as many as fit)")
    p.add_argument("--retrieval-words", type=positive_int, default=4000, help="--data retrieval: haystack words")
    p.add_argument("--out", default="runs", help="folder for the JSONL, summary and table")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's storage: auto (the model's dtype) or fp8 (its runs' files end in _fp8)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="the linear weights: auto (as the checkpoint stores them), fp8 (the layers' quantized at load "
                        "into FP8 blocks; its runs' files end in _fp8-weights) or fp8-all (the LM head's too; "
                        "_fp8-all-weights)")
    p.add_argument("--device", default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let prompt + new tokens run past the model's max_position_embeddings")
    p.add_argument("--dp", action="store_true",
                   help="under torchrun: a whole model per process (GPU), each with its share of the generations "
                        "(without it, the model is split over the processes: tensor parallel)")
    return p.parse_args(argv)


def check_args(args):
    """Refuse, before anything loads, what cannot work (argparse checked each number alone)."""
    from cli import sampling_from_flags
    check_out(Path(args.out))
    sampling_from_flags(chosen_protocol(args).sampling, {})  # those from the model are checked once it loads
    check_seed(args.seed)
    if args.dp and not launched():
        raise ValueError("--dp shares the generations out among torchrun's processes: start eval.py with "
                         "torchrun --nproc-per-node N, or drop --dp")
    # grading imports math-verify at the first finished generation: too late to say it is missing
    if args.data != "retrieval" and importlib.util.find_spec("math_verify") is None:
        raise ValueError("grading answers needs math-verify: pip install 'math-verify>=0.9'")


def check_out(out: Path):
    """--out must be a folder, or a path where one can be made: not a file, nor inside one."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"is inside {existing}, which is a file"
        raise ValueError(f"--out {out} {where}; give a folder")


def check_seed(seed: int):
    # each generation's seed is --seed plus multiples of its sample and item numbers, kept in 64 bits
    if not -2**62 <= seed < 2**62:
        raise ValueError(f"--seed {seed} is too large; give one between -2**62 and 2**62")


def check_chat_template(llm, model: str):
    """The protocols ask every question through the model's chat template: a model without one is refused
    as soon as it loads, not at the first question."""
    if llm.tokenizer.template is None:
        raise ValueError(f"{model} has no chat template (no chat_template.jinja, none in tokenizer_config.json), "
                         "and eval.py renders every question through it; give a chat (instruct) model")


def chosen_protocol(args) -> Protocol:
    """The named protocol with the options given on the command line in place of its own."""
    proto = PROTOCOLS[args.protocol]
    given = {name: getattr(args, arg) for name, arg in (("max_new_tokens", "max_new_tokens"), ("samples", "samples"),
                                                        ("answer", "answer"), ("prompt_tokens", "prompt_tokens"))}
    sampling = dict(proto.sampling, **{name: getattr(args, name) for name in
                                       ("temperature", "top_p", "top_k", "repetition_penalty")
                                       if getattr(args, name) is not None})
    return replace(proto, sampling=sampling, **{k: v for k, v in given.items() if v is not None})


def run_main(args):
    """Evaluate every run with one loaded model: a JSONL file of rows and a summary per run, then the table
    (under torchrun, written by rank 0)."""
    check_args(args)
    import parallel
    proto = chosen_protocol(args)
    runs = eval_runs(args.runs, proto)
    items = retrieval_items(30, args.retrieval_words, args.seed) if args.data == "retrieval" \
        else load_dataset(args.data)
    digest = dataset_digest(items)  # of every row, so that a larger --limit resumes the same run
    items = items[:args.limit]
    out_dir = Path(args.out)
    paths = [run_file(out_dir, args.data, *run, kv_dtype=args.kv_dtype, weights=args.weights) for run in runs]
    locks = []
    try:
        # every run locked, and its earlier rows read, before the model loads: by rank 0 under torchrun, which
        # alone writes the run's file (and merges the files of data-parallel ranks, read here too)
        for path in paths if parallel.rank() == 0 else []:
            locks.append(RunLock(path))
            for rows_file in [path, *rank_files(path)]:
                read_rows(rows_file)
        summaries = evaluate_runs(args, proto, runs, items, paths, digest)
        if parallel.rank() == 0:
            write_table(summaries, out_dir)
        parallel.barrier()
    except KeyboardInterrupt:
        from cli import ignore_further_interrupts
        from model import plural
        ignore_further_interrupts()
        if parallel.rank() > 0:  # rank 0 counts (and says) what every rank saved
            sys.exit(130)
        saved = sum(len(saved_rows(p, items, proto.samples)) for path in paths for p in [path, *rank_files(path)])
        interrupted(f"{plural(saved, 'generation')} of {len(paths) * len(items) * proto.samples} saved in {out_dir}; "
                    "run the same command to resume with the rest")
    finally:  # also when interrupted: an eval.py inside a longer Python session must not keep them
        for lock in locks:
            lock.release()
        parallel.stop()


def eval_runs(specs: list[str], proto: Protocol) -> list[tuple[str, int | None, str]]:
    """The runs to evaluate, a run without a budget taking the protocol's; checked before anything loads, so
    that a run that cannot work fails now, not after the others ran."""
    from policies import resolve_policy
    runs = [parse_run(r) for r in specs]
    runs = list(dict.fromkeys((policy, proto.budget if budget is None and policy != "full" else budget, rule)
                              for policy, budget, rule in runs))  # longflow and longflow:2048 may be one run
    for policy, budget, rule in runs:
        resolve_policy(policy, budget, prompt_rule=rule)
    return runs


def dataset_digest(items: list[dict]) -> str:
    """sha256 of what a dataset asks and grades against: a run resumed after its file changed would mix
    answers to two datasets."""
    rows = [[i["index"], i["question"], i["true_answer"]] for i in items]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def evaluate_runs(args, proto: Protocol, runs: list, items: list[dict], paths: list[Path], digest: str) -> list[dict]:
    """Load the model once, check every run's settings against its files, then evaluate each run in turn;
    its summary is written as it ends."""
    import tinyflow
    from cli import sampling_from_flags
    policy, budget, _ = runs[0]
    import parallel
    llm = tinyflow.LLM(args.model, budget, policy, device=args.device, compile=not args.no_compile,
                       allow_long_context=args.allow_long_context, kv_dtype=args.kv_dtype, weights=args.weights,
                       data_parallel=args.dp)
    check_chat_template(llm, args.model)
    sampling = asdict(sampling_from_flags(proto.sampling, llm.tokenizer.defaults))
    if sampling["temperature"] == 0:  # greedy: a protocol's (or the model's) top-p and top-k would choose nothing
        sampling.update(top_p=1.0, top_k=0)
    settings = dict(model=args.model, data=args.data, data_sha256=digest, protocol=args.protocol, system=proto.system,
                    suffix=proto.suffix, max_new_tokens=proto.max_new_tokens, prompt_tokens=proto.prompt_tokens,
                    answer=proto.answer, sampling=sampling, seed=args.seed, retrieval_words=args.retrieval_words)
    for path in paths:  # all of them before the first run: a refused one must not wait for the others to end
        parallel.on_rank0(lambda: check_settings(path, settings))  # one writer of the settings file
    summaries = []
    for (policy, budget, rule), path in zip(runs, paths):
        llm.set_policy(budget, policy, prompt_compression=rule)
        summary = evaluate(llm, items, path, proto, sampling, args.seed, args.batch_size, args.dp)
        summary_path = path.with_suffix(".summary.json")
        if summary["tokens_per_s"] is None:  # nothing generated now: keep what the run that generated measured
            before = read_json(summary_path) or {}
            summary.update({k: before.get(k) for k in ("tokens_per_s", "kv_bytes")})
        summaries.append(dict(summary, policy=policy, budget=budget, prompt_compression=rule, kv_dtype=args.kv_dtype,
                              weights=args.weights,
                              data=args.data,
                              model=args.model, protocol=args.protocol, sampling=sampling))
        if parallel.rank() == 0:
            write_atomically(summary_path, json.dumps(summaries[-1], indent=1))
    return summaries


if __name__ == "__main__":
    from cli import run_as_command
    run_as_command(main)
