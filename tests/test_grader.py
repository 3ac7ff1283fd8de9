"""The data and grading half of eval.py: datasets, prompt, \\boxed{} extraction and is_correct.

CPU only. The sweep over every reference of every shipped dataset is complete (all ~2,900 items:
most take the cheap exact path, so it costs well under a second); the false-positive check between
different references uses a fixed seeded sample because each pair may go through sympy.
"""

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import eval as ev

# the grader's symbolic half is the `eval`/`test` extra (CI installs it); a machine without it (the GPU
# box, which cannot download) skips this file rather than failing on the import
pytest.importorskip("math_verify")


def boxed(answer: str) -> str:
    return "Some reasoning first.\nSo the answer is \\boxed{" + answer + "}."


# ---------------------------------------------------------------------------------------------
# Datasets and prompt

def test_every_shipped_dataset_loads_with_question_and_answer():
    sizes = {name: len(ev.load_dataset(name)) for name in ev.DATASETS}
    assert sizes == {"aime24": 30, "aime25": 30, "amc": 40, "gsm8k": 1319, "math": 500,
                     "minerva": 272, "olympiad": 675}


def test_load_dataset_accepts_a_jsonl_path_and_numbers_rows_without_an_index(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "true_answer": "2"}) + "\n\n"
                    + json.dumps({"question": "2+2?", "true_answer": "4", "index": 7}) + "\n")
    assert ev.load_dataset(str(path)) == [{"index": 0, "question": "1+1?", "true_answer": "2"},
                                          {"index": 7, "question": "2+2?", "true_answer": "4"}]


def test_load_dataset_keeps_only_the_question_the_answer_and_the_index(tmp_path):
    """A row's own fields (a "system" or "suffix", say) must not change how the protocol asks it."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "true_answer": "2", "system": "You grade.", "prompt_tokens": 8}))
    assert ev.load_dataset(str(path)) == [{"index": 0, "question": "1+1?", "true_answer": "2"}]


@pytest.mark.parametrize("row, says", [({"question": "1+1?", "true_answer": ""}, '"true_answer" is empty'),
                                       ({"question": "1+1?", "true_answer": "  "}, '"true_answer" is empty'),
                                       ({"question": " ", "true_answer": "2"}, '"question" is empty')])
def test_load_dataset_refuses_an_empty_question_or_answer(tmp_path, row, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:1: {says}"):
        ev.load_dataset(path)


def test_load_dataset_names_an_unknown_dataset():
    with pytest.raises(ValueError, match="no_such_set"):
        ev.load_dataset("no_such_set")


def test_load_dataset_names_the_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*true_answer"):
        ev.load_dataset(path)


def test_prompt_is_question_newline_suffix():
    assert ev.build_messages("What is 1+1?") == [{
        "role": "user",
        "content": "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."}]


# ---------------------------------------------------------------------------------------------
# Every reference grades correct when boxed

@pytest.mark.parametrize("name", sorted(ev.DATASETS))
def test_every_reference_answer_grades_correct_when_boxed(name):
    failures = [row["true_answer"] for row in ev.load_dataset(name)
                if not ev.is_correct(boxed(row["true_answer"]), row["true_answer"])]
    assert failures == []


def test_the_sixteen_cut_math500_references_are_repaired():
    # MATH-500 answers cut from their solution between the first \boxed{ and the last }.
    repaired = {row["index"]: ev._reference(row["true_answer"]) for row in ev.load_dataset("math")
                if ev._reference(row["true_answer"]) != row["true_answer"].strip()}
    assert repaired == {35: "3", 52: "12", 130: "13", 137: "204_5", 172: "350",
                        217: "11,\\! 111,\\! 111,\\! 100", 222: "54", 240: "116", 292: "898",
                        358: "\\text{ellipse}", 415: "9", 436: "4", 448: "44",
                        451: "\\frac{639}{40}", 457: "0", 487: "2"}
    assert ev.is_correct(boxed("350"), "350}$.  We also ... $200 + 2d = \\boxed{350")
    assert ev.is_correct(boxed("11111111100"), "11,\\! 111,\\! 111,\\! 100}$. In fact")


def test_another_items_answer_grades_wrong_on_a_seeded_sample():
    rng = random.Random(0)
    wrongly_right = []
    for name in sorted(ev.DATASETS):
        references = [ev._reference(row["true_answer"]) for row in ev.load_dataset(name)]
        for _ in range(30):
            reference, other = rng.sample(references, 2)
            if ev._canon(reference) != ev._canon(other) and ev.is_correct(boxed(other), reference):
                wrongly_right.append((name, reference, other))
    assert wrongly_right == []


# ---------------------------------------------------------------------------------------------
# Equivalent spellings grade correct

EQUIVALENT = [  # (reference, answer in the box)
    ("\\dfrac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\tfrac{1}{2}", "1/2"),
    ("1,000", "1000"),
    ("14000", "14{,}000"),
    ("10,\\!080", "10080"),
    ("\\$32,\\!348", "32348"),
    ("27.0", "27"),
    ("+2", "2"),
    ("-1./3", "-\\frac{1}{3}"),
    ("30^\\circ", "30"),
    ("90^{\\circ}", "90"),
    ("45", "45^\\circ"),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
    ("5.4 \\text{ cents}", "5.4"),
    ("864 \\mbox{ inches}^2", "864"),
    ("54", "54 \\text{ cm}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/2)"),
    ("(15,-29)", "\\left(15, -29\\right)"),
    ("p - q", "-q+p"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}"),
    ("2 \\sqrt{5}", "\\sqrt{20}"),
    ("1\\frac{4}{5}", "\\frac{9}{5}"),
    ("6 - 5i", "-5i+6"),
    ("x=5", "5"),
    ("5", "x = 5"),
    ("y = 2x + 3", "y=3+2x"),
    ("\\text{(C)}", "C"),
    ("\\text{(C)}", "(C)"),
    ("\\text{(C)}", "\\textbf{(C) } 12"),
    ("\\text{Evelyn}", "Evelyn"),
    ("\\text{even}", "\\text{ even }"),
    ("1,-2", "-2, 1"),
    ("$69$,$84$", "84, 69"),
    ("1 \\pm \\sqrt{19}", "1-\\sqrt{19}, 1+\\sqrt{19}"),
    ("(3,4]", "\\left(3, 4\\right]"),
    ("(-\\infty, 0]", "(-\\infty,0]"),
    ("$(-\\infty, 0) \\cup\\{1\\}$.", "(-\\infty,0)\\cup\\{1\\}"),
    ("\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}",
     "\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\end{pmatrix}"),
    ("1.24e-8", "1.24 \\times 10^{-8}"),
    ("4.5e33", "4.5\\cdot10^{33}"),
    ("3.83e35", "3.8301\\times10^{35}"),  # a rounded reference in e-notation keeps its tolerance, whole or not
    ("6.5e-2", "0.065"),
    ("np.arcsin(10/13)", "\\arcsin\\left(\\frac{10}{13}\\right)"),
    ("E_{1},E_{2}", "E_1,E_2"),
    ("$\\frac{1}{2 n+2}$", "\\frac{1}{2(n+1)}"),
    ("50\\%", "50"),
    ("62.5%", "62.5\\%"),
]


@pytest.mark.parametrize("reference, answer", EQUIVALENT)
def test_equivalent_spelling_grades_correct(reference, answer):
    assert ev.is_correct(boxed(answer), reference)


# ---------------------------------------------------------------------------------------------
# Wrong answers grade wrong

WRONG = [  # (reference, answer in the box)
    ("204", "205"),
    ("14,000", "14"),
    ("27", "27.5"),
    ("27.0", "27.00001"),  # AMC's whole numbers written "27.0" are exact too, not within a tolerance
    ("1,450,000", "1450001"),
    ("\\frac{1}{3}", "0.33"),
    ("\\pi", "3.14"),
    ("0.554", "0.5537"),
    ("1.325e-27", "1.3 \\times 10^{-27}"),  # tiny numbers: a relative tolerance, not 6 decimals
    ("p - q", "q - p"),
    ("2 \\sqrt{5}", "\\sqrt{5}"),
    ("\\text{(C)}", "D"),
    ("\\text{Evelyn}", "Elveny"),  # \text words are not products of letters to be reordered
    ("\\text{east}", "\\text{west}"),
    ("x=5", "y=5"),
    ("3", "3, 4"),
    ("1,3", "1"),
    ("50\\%", "0.5"),  # percent: the number before the sign is the answer, see eval._clean
    ("[1,2)", "(1,2)"),  # interval brackets matter
    ("(3,4]", "(3,4)"),
    ("(-\\infty, 0]", "(-\\infty, 0)"),
    ("[-2,7]", "(-2,7]"),
    ("(6,31,-1)", "(31,6,-1)"),  # tuple order matters
    ("(15,-29)", "(-29,15)"),
    ("(2,4)", "(4,2)"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}"),
]


@pytest.mark.parametrize("reference, answer", WRONG)
def test_wrong_answer_grades_wrong(reference, answer):
    assert not ev.is_correct(boxed(answer), reference)


def test_completion_without_a_box_grades_wrong():
    assert not ev.is_correct("The answer is 42.", "42")
    assert not ev.is_correct("", "42")


def test_empty_box_grades_wrong():
    assert not ev.is_correct("so \\boxed{}", "42")
    assert not ev.is_correct("so \\boxed{  }", "42")


def test_an_empty_last_box_falls_back_to_the_one_before():
    assert ev.extract_boxed("so \\boxed{42}, and the template says \\boxed{}") == "42"


def test_the_last_box_counts():
    assert ev.is_correct("first \\boxed{41}, on reflection \\boxed{42}", "42")
    assert not ev.is_correct("first \\boxed{42}, on reflection \\boxed{41}", "42")


# ---------------------------------------------------------------------------------------------
# Extraction

def test_nested_braces_are_extracted_whole():
    assert ev.extract_boxed("x \\boxed{\\frac{\\sqrt{3}}{2}} y") == "\\frac{\\sqrt{3}}{2}"
    assert ev.extract_boxed("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}") == \
        "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"


def test_escaped_set_braces_are_not_groups():
    assert ev.extract_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert ev.extract_boxed("\\boxed{\\left\\{ 1 \\right.}") == "\\left\\{ 1 \\right."


def test_extract_boxed_returns_none_without_a_box():
    assert ev.extract_boxed("no box here, just {braces}") is None


def test_fbox_and_boxed_without_braces_are_read():
    assert ev.extract_boxed("so \\fbox{7}") == "7"
    assert ev.extract_boxed("so $\\boxed 7$.") == "7"
    assert ev.extract_boxed("so \\boxed {7}") == "7"


def test_an_unclosed_last_box_falls_back_to_the_last_closed_one():
    assert ev.extract_boxed("\\boxed{3} then \\boxed{\\frac{1}{") == "3"
    assert ev.extract_boxed("\\boxed{3} then \\boxed{4}", "first") == "3"  # the LongFlow scripts' rule
    two = "\\boxed{3} then \\boxed{4}"
    assert ev.is_correct(two, "3", "first") and not ev.is_correct(two, "3")
    assert ev.extract_boxed("\\boxed{3 then \\boxed{4}", "first") is None  # acc.py: a first box that never closes
    # acc.py looks for the first "\\boxed{" exactly: a mention without braces, or an \\fbox, is not it
    assert ev.extract_boxed("the answer goes in \\boxed at the end: \\boxed{5}", "first") == "5"
    assert ev.extract_boxed("\\fbox{4} then \\boxed{5}", "first") == "5"
    assert ev.extract_boxed("\\boxed{\\frac{1}{2}") is None


# ---------------------------------------------------------------------------------------------
# math-verify guarded: failures and timeouts grade False, threads work

def test_an_exception_inside_math_verify_grades_wrong(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(math_verify, "verify", broken)
    assert not ev.is_correct(boxed("-q+p"), "p - q")


def test_a_math_verify_timeout_grades_wrong(monkeypatch):
    """A comparison that would not end by itself (it waits for an event set only after the verdict) is cut off
    by the timeout and graded wrong: the verdict comes while it still runs, however slow the machine."""
    from math_verify import grader
    release, ended = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        release.wait(600)
        ended.set()
        return True
    monkeypatch.setattr(grader, "sympy_expr_eq", slow)
    monkeypatch.setattr(ev, "MATH_VERIFY_TIMEOUT_S", 1)
    assert not ev.is_correct(boxed("-q+p"), "p - q")
    assert not ended.is_set()
    release.set()


def test_grading_works_off_the_main_thread():
    cases = [("p - q", "-q+p", True), ("\\frac{\\sqrt2}{2}", "\\sqrt{2}/2", True),
             ("[1,2)", "(1,2)", False), ("(6,31,-1)", "(31,6,-1)", False)]
    with ThreadPoolExecutor(4) as pool:
        verdicts = list(pool.map(lambda case: ev.is_correct(boxed(case[1]), case[0]), cases))
    assert verdicts == [want for _, _, want in cases]


def test_slow_grading_off_the_main_thread_gives_up_as_wrong(monkeypatch):
    def slow(reference, answer, timeout):
        time.sleep(3)
        return True
    monkeypatch.setattr(ev, "_math_verify", slow)
    monkeypatch.setattr(ev, "MATH_VERIFY_TIMEOUT_S", 0.2)
    verdict = []
    worker = threading.Thread(target=lambda: verdict.append(ev.is_correct(boxed("-q+p"), "p - q")))
    worker.start()
    worker.join()
    assert verdict == [False]
