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
import re
import threading
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Datasets: JSONL files with one {"question": ..., "true_answer": ...} object a line.

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASETS = {name: DATA_DIR / f"{name}.jsonl"
            for name in ("aime24", "aime25", "amc", "gsm8k", "math", "minerva", "olympiad")}


def load_dataset(name_or_path: str | Path) -> list[dict]:
    """The rows of a shipped dataset (a key of DATASETS) or of any JSONL file with those two fields."""
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
        rows.append(row)
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
    from math_verify import parse, verify  # imported late: loading sympy takes a second
    from math_verify.errors import TimeoutException

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
