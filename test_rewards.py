"""gmts.py's rewards, data layouts and grading: what each task's verifier pays, how a math answer is read and
compared (units, math-verify, the exact-match rule for golds it cannot read), how data files in the published
layouts load, and how generators and the two data orders draw rows.

Run it (offline, CPU; pytest.ini's default two workers):

    source /work/venv/bin/activate; python -m pytest -q -n 2 test_rewards.py

Sections: the verifiers (tables, never raise, never run away, prompts); math grading and units (the unit table,
competition answers, the time bound and the main-thread rule); data layouts and loading (testdata/'s slices of the
published files, each layout, bad files); generators and draws (generated problems, held-out rows, --data-order
epoch); prompt styles and benchmark scores. Math golds are graded through the reward a run uses
(gmts.TASKS["math"]["reward"] on a row as gmts.load_rows read it) wherever the row matters.
Hypothesis: a CI profile (500 examples per verifier); HYPOTHESIS_PROFILE=thorough runs 3400.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import ast
import collections
import csv
import dataclasses
import gc
import inspect
import itertools
import json
import math
import random
import re
import sys
import threading
import time
import types
from decimal import Decimal
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import gmts
from gmts import (TASKS, countdown_problem, countdown_reward, get_task, load_rows, logic_problem, logic_reward,
                  math_easy_problem, math_reward, _CD_CHARS, _DEC, _FRAC, _NUM_TOKEN)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "testdata")

settings.register_profile("ci", max_examples=500, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("thorough", max_examples=3400, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
PROPS = settings(settings.get_profile("thorough" if THOROUGH else "ci"))

reward = TASKS["math"]["reward"]  # (completion, row) -> float, as a run grades

SLOW = 2.0  # seconds: no single verifier call may take this long (a runaway, not a speed test)


def timed(fn, *args):
    """Call a verifier past its last-resort except-net (functools.wraps' __wrapped__), so "never raises" is checked
    on the verifier's own code; check it returns a float well within SLOW seconds; return the score."""
    fn = getattr(fn, "__wrapped__", fn)
    t = time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t
    assert isinstance(out, float), out
    assert dt < SLOW, f"{fn.__name__} took {dt:.1f} s"
    return out


def A(s):
    return f"<answer>{s}</answer>"


def box(s):
    return f"So the final answer is $\\boxed{{{s}}}$."


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def verifier():
    """math-verify imported and answering (its first call imports sympy: not what a case times)."""
    assert gmts.latex_equal("2", "2") is True


BIG = "x" * 1_000_000  # 1 MB of filler


# ==== the verifiers: tables, never raise, never run away, prompts ====================================================

# ---- countdown: (completion, nums, target, expected) ----
N, T = [3, 5, 2], 16
CD_CASES = {
    "correct": (A("(3 + 5) * 2"), N, T, 1.0),
    "correct, other order": (A("2 * (5 + 3)"), N, T, 1.0),
    "after think": ("I try 3+5=8, 8*2=16</think>\n" + A(" (3+5)*2 "), N, T, 1.0),
    "whitespace and newlines": ("<answer>\n ( 3 +\n5 ) *\t2 \n</answer>", N, T, 1.0),
    "redundant parentheses": (A("(" * 80 + "(3 + 5) * 2" + ")" * 80), N, T, 1.0),
    "exact fractions": (A("8 / (3 - 8 / 3)"), [8, 3, 8, 3], 24, 1.0),
    "duplicate numbers": (A("2 + 2 + 4"), [2, 4, 2], 8, 1.0),
    "last tag counts": (A("3 + 5 + 2") + A("(3 + 5) * 2"), N, T, 1.0),
    "last tag wrong": (A("(3 + 5) * 2") + A("3 + 5 + 2"), N, T, 0.1),
    "unclosed last tag ignored": (A("(3 + 5) * 2") + "<answer>3 +", N, T, 1.0),
    "1 MB completion": (BIG + A("(3 + 5) * 2"), N, T, 1.0),
    "wrong value": (A("3 + 5 + 2"), N, T, 0.1),
    "number reused": (A("(3 + 5) * 2 + 2 - 2"), N, T, 0.1),
    "number reused instead of another": (A("4 + 4"), [2, 4, 2], 8, 0.1),
    "number missing": (A("3 * 5"), [3, 5, 2], 15, 0.1),
    "number not given": (A("8 * 2"), N, T, 0.1),
    "target only": (A("16"), N, T, 0.1),
    "target = target": (A("16 = 16"), N, T, 0.1),
    "equation = target": (A("(3 + 5) * 2 = 16"), N, T, 0.1),
    "decimal is not two numbers": (A("2.5 * 4"), [2, 5, 4], 10, 0.1),
    "float literal": (A("(3 + 5) * 2.0"), N, T, 0.1),
    "arabic-indic digit": (A("(\u0663 + 5) * 2"), N, T, 0.1),
    "fullwidth digit": (A("(\uff13 + 5) * 2"), N, T, 0.1),
    "division by zero": (A("4 / (3 - 3)"), [4, 3, 3], 4, 0.1),
    "power": (A("2 ** 3 ** 4"), [2, 3, 4], 2 ** 81, 0.1),
    "power tower": (A("9 ** 9 ** 9 ** 9"), [9, 9, 9, 9], 1, 0.1),
    "floor division": (A("8 // 2 * 4"), [8, 2, 4], 16, 0.1),
    "modulo": (A("(3 + 5) * 2 % 99"), N + [99], T, 0.1),
    "unary minus": (A("-3 + 5 + 2"), N, 4, 0.1),
    "unary plus": (A("+3 + 5 * 2"), N, 13, 0.1),
    "leading zero": (A("(03 + 5) * 2"), N, T, 0.1),
    "names and calls": (A("__import__('os').system('echo hi')"), N, T, 0.1),
    "syntax error": (A("(3 + 5 * 2"), N, T, 0.1),
    "empty answer": (A("  \n "), N, T, 0.1),
    "nested tags": ("<answer><answer>(3 + 5) * 2</answer></answer>", N, T, 0.1),
    "100k nested parentheses": (A("(" * 100_000 + "3 + 5" + ")" * 100_000), N, T, 0.1),
    "deep chain": (A("+".join(["1"] * 100)), [1] * 100, 100, 0.1),
    "1 MB answer": (A("1+" * 500_000 + "1"), N, T, 0.1),
    "10,000-digit number": (A("9" * 10_000), N, T, 0.1),
    "big numbers within the cap": (A("9" * 90 + " * " + "9" * 90), [int("9" * 90)] * 2, 1, 0.1),
    "no tags": ("(3 + 5) * 2", N, T, 0.0),
    "only an opening tag": ("<answer>(3 + 5) * 2", N, T, 0.0),
    "only closing tags": ("</answer>" * 1000, N, T, 0.0),
    "many opening tags": ("<answer>" * 100_000, N, T, 0.0),
    "empty completion": ("", N, T, 0.0),
}


@pytest.mark.parametrize("text,nums,target,want", CD_CASES.values(), ids=CD_CASES.keys())
def test_countdown_reward(text, nums, target, want):
    assert timed(countdown_reward, text, nums, target) == want


def cd_value(text, nums):
    """countdown_value without its except-net, as a float for timed(): 1.0 well-formed, 0.0 not."""
    return timed(lambda t, n: float(gmts.countdown_value.__wrapped__(t, n) is not None), text, nums)


@pytest.mark.parametrize("text,nums,target,want", CD_CASES.values(), ids=CD_CASES.keys())
def test_countdown_value_agrees_with_the_reward(text, nums, target, want):
    value = gmts.countdown_value.__wrapped__(text, nums)
    assert (value == target) == (want == 1.0) and cd_value(text, nums) in (0.0, 1.0)


def test_countdown_value_hand_computed():
    assert gmts.countdown_value(A("5 - 5"), [5, 5]) == 0 and countdown_reward(A("5 - 5"), [5, 5], 0) == 1.0
    assert gmts.countdown_value(A("8 / 3 + 1"), [1, 3, 8]) == Fraction(11, 3)
    assert gmts.countdown_value(A("8 + 3"), [1, 3, 8]) is None  # a number left out: not well-formed
    assert gmts.countdown_value(A("8 + 3 + 1") + " <answer>8 + 3</answer>", [1, 3, 8]) is None  # the LAST answer
    assert gmts.countdown_value("8 + 3 + 1", [1, 3, 8]) is None


# ---- math, GSM8K's rule (latex False): (completion, reference answer, expected) ----
MATH_CASES = {
    "boxed": ("so \\boxed{72}", "72", 1.0),
    "boxed in answer tags": ("<think>6*12</think><answer>\\boxed{72}</answer>", "72", 1.0),
    "thousands separators": ("\\boxed{1,450,000}", "1450000", 1.0),
    "reference with commas": ("\\boxed{1450000}", "1,450,000", 1.0),
    "latex thousands": ("\\boxed{1{,}450}", "1450", 1.0),
    "dollar": ("The answer is $18", "18", 1.0),
    "escaped dollar boxed": ("\\boxed{\\$18}", "18", 1.0),
    "trailing zeros": ("\\boxed{72.00}", "72", 1.0),
    "trailing period": ("The answer is 72.", "72", 1.0),
    "percent": ("\\boxed{50\\%}", "50", 1.0),
    "frac": ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    "dfrac": ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    "slash fraction": ("\\boxed{1/2}", "0.5", 1.0),
    "reference fraction": ("\\boxed{0.5}", "1/2", 1.0),
    "gsm8k marker": ("6 * 12 = 72\n#### 72", "72", 1.0),
    "gsm8k marker with commas": ("#### $1,450", "1450", 1.0),
    "marker beats later numbers": ("#### 72\nchecked with 5 and 6", "72", 1.0),
    "last bare number": ("5 apples, 3 pears, so 72 in total", "72", 1.0),
    "negative": ("\\boxed{-5}", "-5", 1.0),
    "negative bare": ("the change is -5", "-5", 1.0),
    "negative frac": ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    "negative numerator": ("\\boxed{\\frac{-20}{2}}", "-10", 1.0),
    "negative outside": ("\\boxed{-\\frac{20}{2}}", "-10", 1.0),
    "negative denominator": ("\\boxed{\\frac{20}{-2}}", "-10", 1.0),
    "two negatives": ("\\boxed{\\frac{-20}{-2}}", "10", 1.0),
    "signed numerator, wrong sign": ("\\boxed{\\frac{-20}{2}}", "10", 0.0),
    "slash, negative denominator": ("\\boxed{3/-4}", "-0.75", 1.0),
    "last boxed counts": ("\\boxed{5} no wait \\boxed{72}", "72", 1.0),
    "boxed beats bare numbers": ("\\boxed{72}, from 6 and 12", "72", 1.0),
    "list of numbers": ("the values are 3,4,72", "72", 1.0),
    "100k nested boxed": ("\\boxed{" * 100_000 + "72" + "}" * 100_000, "72", 1.0),
    "1 MB completion": (BIG + "\\boxed{72}", "72", 1.0),
    "wrong boxed": ("\\boxed{71}", "72", 0.0),
    "last boxed wrong": ("\\boxed{72} no wait \\boxed{5}", "72", 0.0),
    "sign matters": ("\\boxed{5}", "-5", 0.0),
    "no number": ("I do not know", "72", 0.0),
    "empty": ("", "72", 0.0),
    "unicode digits": ("\\boxed{\u0667\u0662}", "72", 0.0),
    "bad separators": ("\\boxed{7,2}", "72", 0.0),
    "words in box": ("\\boxed{x = 72}", "72", 0.0),
    "division by zero": ("\\boxed{1/0}", "0", 0.0),
    "frac by zero": ("\\boxed{\\frac{1}{0}}", "0", 0.0),
    "exponent form": ("\\boxed{1e5}", "100000", 0.0),
    "100k unclosed boxed": ("\\boxed{" * 100_000, "72", 0.0),
    "1 MB of ones": ("1 " * 500_000, "72", 0.0),
    "1 MB of commas": ("1," * 500_000, "72", 0.0),
    "10,000-digit boxed": ("\\boxed{" + "9" * 10_000 + "}", "72", 0.0),
    "10,000-digit reference": ("\\boxed{72}", "9" * 10_000, 0.0),
    "bad reference": ("\\boxed{72}", "seventy-two", 0.0),
}


@pytest.mark.parametrize("text,answer,want", MATH_CASES.values(), ids=MATH_CASES.keys())
def test_math_reward(text, answer, want):
    assert timed(math_reward, text, answer) == want


def test_parse_number_reads_its_docstring_examples():
    """parse_number's docstring, example by example (exact values, as Fractions), and what it must refuse: a second
    slash is not a fraction, a doubled point, an exponent, a bad separator, a zero denominator, words. '18.' and
    '1/2/3' reach no other test: in a completion the last-number and #### paths strip a trailing point first."""
    read = {"-$1,450": -1450, "72.00": 72, "18.": 18, "50%": 50, "\\frac{1}{2}": Fraction(1, 2),
            "\\frac{-20}{2}": -10, "3/4": Fraction(3, 4), " 18. ": 18, "\\$18": 18, "50\\%": 50, ".5": Fraction(1, 2),
            "-\\frac{1}{2}": Fraction(-1, 2), "3/-4": Fraction(-3, 4), "1{,}450": 1450, "1\\,000": 1000}
    for text, want in read.items():
        got = gmts.parse_number(text)
        assert got == want and isinstance(got, Fraction), (text, got)
    for text in ["1/2/3", "18..", "1e5", "7,2", "1/0", "\\frac{1}{0}", "", "abc", "1/", "/2", "--5"]:
        assert gmts.parse_number(text) is None, text
    assert math_reward("\\boxed{18.}", "18") == 1.0 and math_reward("\\boxed{1/2/3}", "0.5") == 0.0


# ---- logic: (completion, expected) against one solution ----
SOL = {"Alice": True, "Bob": False, "Carol": True}
GOOD = "Alice: knight, Bob: knave, Carol: knight"
LOGIC_CASES = {
    "correct": (A(GOOD), 1.0),
    "after think": ("</think>\n" + A(" " + GOOD + " "), 1.0),
    "newlines, case, spaces": (A("\n  ALICE :Knight\nbob:   KNAVE\n carol : knight.\n"), 1.0),
    "any order, semicolons": (A("Carol: knight; Bob: knave; Alice: knight"), 1.0),
    "trailing comma": (A(GOOD + ","), 1.0),
    "last tag counts": (A("Alice: knave") + A(GOOD), 1.0),
    "1 MB completion": (BIG + A(GOOD), 1.0),
    "last tag wrong": (A(GOOD) + A("Alice: knave"), 0.1),
    "wrong role": (A("Alice: knight, Bob: knight, Carol: knight"), 0.1),
    "missing person": (A("Alice: knight, Bob: knave"), 0.1),
    "named twice, same role": (A(GOOD + ", Alice: knight"), 0.1),
    "named twice, both roles": (A(GOOD + ", Bob: knight"), 0.1),
    "unknown person": (A(GOOD + ", Dave: knave"), 0.1),
    "prose instead of format": (A("Alice is a knight, Bob is a knave, Carol is a knight"), 0.1),
    "two roles in one entry": (A("Alice: knight knave, Bob: knave, Carol: knight"), 0.1),
    "entries run together": (A("Alice: knightBob: knave, Carol: knight"), 0.1),  # split by , ; or whitespace only
    "all knights hedge": (A("Alice: knight/knave, Bob: knight/knave, Carol: knight/knave"), 0.1),
    "empty answer": (A(""), 0.1),
    "1 MB answer": (A(GOOD + ", " + "Alice: knight, " * 70_000), 0.1),
    "no tags": (GOOD, 0.0),
    "unclosed tag": ("<answer>" + GOOD, 0.0),
}


@pytest.mark.parametrize("text,want", LOGIC_CASES.values(), ids=LOGIC_CASES.keys())
def test_logic_reward(text, want):
    assert timed(logic_reward, text, SOL) == want


# ---- property tests: never raise, never run away ----
VERIFIERS = {
    "countdown": lambda s: timed(countdown_reward, s, N, T),
    "math": lambda s: timed(math_reward, s, "72"),
    "logic": lambda s: timed(logic_reward, s, SOL),
    "countdown_value": lambda s: cd_value(s, N),
}
FRAGMENTS = ["<answer>", "</answer>", "<think>", "</think>", "\\boxed{", "\\frac{", "{", "}", "(", ")", "####", "**",
             "//", ",", ".", "$", "-", "+", "*", "/", "=", ":", ";", " ", "\n", "\t", "0", "3", "5", "2", "16", "72",
             "99999999999", "knight", "knave", "Alice:", "Bob:", "Carol:", "\u0663", "1e9", "_", "'", "x"]
FRAGMENTS += ["\\fbox{", "\\text{ cm}", "\\overline{", "\\%"]  # the answer forms grading reads too
adversarial = st.builds(lambda parts, k: "".join(parts) * k,
                        st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=40), st.integers(1, 2000))


@PROPS
@given(st.text(max_size=300))
def test_random_text_never_raises(s):
    for check in VERIFIERS.values():
        assert check(s) in (0.0, 0.1, 1.0)


@pytest.mark.parametrize("task", VERIFIERS)
@PROPS
@given(s=adversarial)
def test_adversarial_never_raises(task, s):
    assert VERIFIERS[task](s) in (0.0, 0.1, 1.0)


@settings(PROPS, max_examples=500 if THOROUGH else 200)
@given(seed=st.integers(0, 10 ** 9), gaps=st.lists(st.text(alphabet=" \n\t", max_size=3), min_size=64, max_size=64),
       sep=st.sampled_from([",", "\n", ";", " , ", ",\n"]))
def test_whitespace_inside_answers_is_ignored(seed, gaps, sep):
    rng, gap = random.Random(seed), itertools.cycle(gaps)
    cd = countdown_problem(rng)
    expr = "".join(next(gap) + t for t in re.findall(r"\d+|\S", cd["expr"])) + next(gap)
    assert timed(countdown_reward, A(expr), cd["nums"], cd["target"]) == 1.0
    m = math_easy_problem(rng)
    boxed = "\\boxed{" + next(gap) + m["answer"] + next(gap) + "}"
    assert timed(math_reward, A(next(gap) + boxed + next(gap)), m["answer"]) == 1.0
    lg = logic_problem(rng)
    entries = [next(gap) + k + next(gap) + ":" + next(gap) + ("knight" if v else "knave") + next(gap)
               for k, v in lg["solution"].items()]
    assert timed(logic_reward, A(sep.join(entries)), lg["solution"]) == 1.0


def test_regexes_do_not_backtrack():
    """Each module regex that reads an answer or a question, used the way the module uses it, on 40k-character
    inputs built to make it backtrack (_UNIT, on golds only, has its own tests in the next section)."""
    nasty = ["1," * 20_000 + "x", "1" * 40_000 + ".", "\\frac{" * 5000 + "}", "(" * 40_000 + "x", "1.1" * 10_000 + "x",
             "$" + "9," * 20_000 + ".", "-$" * 20_000, "1" * 40_000 + "\u0663", "\\text{" * 6000 + " a",
             "\\sin^2 " * 6000, " + " * 13_000 + "x", 'form "' * 6000 + "Answer", "a" * 40_000 + "Answer"]
    for s in nasty:
        t = time.perf_counter()
        _CD_CHARS.fullmatch(s), _DEC.fullmatch(s), _FRAC.fullmatch(s), _NUM_TOKEN.search(s)
        gmts._LETTER.sub(r"\1", s), gmts._POWER_ARG.sub("", s), gmts._SPACED_OP.sub(r"\1", s)
        gmts._OWN_ANSWER.search(s)
        assert time.perf_counter() - t < SLOW, s[:20]  # backtracking on 40k characters would take minutes


def test_prompts():
    row = {"nums": [3, 5, 2], "target": 16, "expr": "(3 + 5) * 2"}
    assert get_task("countdown")["prompt"](row, short=True) == "Make 16 from 3 5 2."
    assert "[3, 5, 2]" in get_task("countdown")["prompt"](row) and "16" in get_task("countdown")["prompt"](row)
    m = math_easy_problem(random.Random(0))
    assert get_task("math")["prompt"](m, short=True) == m["question"] and "\\boxed{}" in get_task("math")["prompt"](m)
    lg = logic_problem(random.Random(0))
    assert get_task("logic")["prompt"](lg, short=True) == "\n".join(lg["statements"])
    dapo = {"question": 'Solve it. The last line ... of the form Answer: $Answer', "answer": "9", "latex": True,
            "answer_line": True}
    assert get_task("math")["prompt"](dapo) == dapo["question"]  # a row that asks for its answer itself: as it is


def test_tasks_and_get_task():
    """Each task: a prompt, a verifier, the keys its rows must have, and the generated rows have
    them; code also grades a batch at once and frames its prompt its own way; commonsense shows
    its options to the boxed styles."""
    assert sorted(TASKS) == ["code", "commonsense", "countdown", "logic", "math"]
    assert {name: t["keys"] for name, t in TASKS.items()} == {
        "countdown": ("nums", "target"), "math": ("question", "answer"),
        "logic": ("names", "statements", "solution"), "code": ("question",),
        "commonsense": ("question", "choices", "answerKey")}
    extra = {"code": {"rewards", "frame"}, "commonsense": {"question"}}
    for name, t in TASKS.items():
        assert set(t) == {"prompt", "keys", "reward"} | extra.get(name, set())
        assert callable(t["prompt"]) and callable(t["reward"])
        for row in load_rows(name, "gen", 5, 0):
            assert all(row.get(k) is not None for k in t["keys"]) and gmts._check_row(row, name) is not None
    choose = "choose one of: code, commonsense, countdown, logic, math"
    with pytest.raises(ValueError, match=f"unknown task 'x'; {choose}"):
        get_task("x")
    with pytest.raises(ValueError, match="choose one of"):
        load_rows("chess", "gen", 1, 0)


def test_no_eval_or_exec():
    tree = ast.parse(inspect.getsource(sys.modules[countdown_reward.__module__]))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"eval", "exec", "compile", "__import__"}


# ==== math grading and units: value_unit / same_unit, latex_equal (math-verify), the time bound ======================

# ---- units: (gold as a data file writes it, the boxed answer, the verdict) ----
UNIT_CASES = [
    # \mathrm{i}, \mathrm{e}, a one-letter \text{}: the letter, part of the value, never dropped
    ("1+2\\mathrm{i}", "3", 0.0),
    ("1+2\\mathrm{i}", "1+2i", 1.0),
    ("1+2\\mathrm{i}", "1+2\\mathrm{i}", 1.0),
    ("1+2i", "1+2\\mathrm{i}", 1.0),
    ("1+2i", "1+2\\text{i}", 1.0),
    ("1+2i", "3", 0.0),
    ("1-\\text{i}", "1", 0.0),
    ("1-\\text{i}", "1-i", 1.0),
    ("2\\mathrm{e}", "2", 0.0),
    ("2\\mathrm{e}", "2e", 1.0),
    ("e^{2}", "\\mathrm{e}^{2}", 1.0),
    ("e^{2}", "2", 0.0),
    # a magnitude word is part of the value
    ("10\\text{ thousand}", "10", 0.0),
    ("10\\text{ thousand}", "10000", 1.0),
    ("10\\text{ thousand}", "10{,}000", 1.0),
    ("10\\text{ thousand}", "10\\text{ thousand}", 1.0),
    ("10000", "10\\text{ thousand}", 1.0),
    ("10000", "10\\text{ million}", 0.0),
    ("2.5\\text{ million}", "2500000", 1.0),
    ("2.5\\text{ million}", "2.5", 0.0),
    # a unit on both sides is compared; on one side only, the value alone is
    ("5\\text{ cm}", "5\\text{ m}", 0.0),
    ("5\\text{ cm}", "5\\text{ mm}", 0.0),
    ("5\\text{ cm}", "6\\text{ cm}", 0.0),
    ("5\\text{ cm}", "5\\text{ cm}", 1.0),
    ("5\\text{ cm}", "5\\text{ centimeters}", 1.0),
    ("5\\text{ cm}", "5\\text{ centimetre}", 1.0),
    ("5\\text{ cm}", "5", 1.0),
    ("5\\text{ cm}", "6", 0.0),
    ("5", "5\\text{ cm}", 1.0),
    ("5", "6\\text{ cm}", 0.0),
    ("5\\text{ cm}^2", "5\\text{ cm}^3", 0.0),
    ("5\\text{ cm}^2", "5\\text{ cm}^{2}", 1.0),
    ("3\\text{ hours}", "3\\text{ minutes}", 0.0),
    ("3\\text{ hours}", "3\\text{ days}", 0.0),
    ("3\\text{ hours}", "3\\text{ hour}", 1.0),
    ("3\\text{ hours}", "3\\mbox{ hrs}", 1.0),
    ("3\\text{ hours}", "3", 1.0),
    ("7\\text{ hours}.", "7\\text{ days}", 0.0),
    ("7\\text{ hours}.", "7.", 1.0),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}\\text{ radians}", 0.0),  # MATH-500's row
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}\\text{ degree}", 1.0),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}^\\circ", 1.0),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}", 1.0),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{8}", 0.0),
    # a spacing command before a unit goes with the unit
    ("5\\,\\text{cm}", "5", 1.0),
    ("5\\,\\text{cm}", "5\\text{ centimeters}", 1.0),
    ("5\\,\\text{cm}", "5\\,\\text{m}", 0.0),
    ("5\\,\\text{cm}", "4", 0.0),
    ("7\\,\\mathrm{cm}", "7", 1.0),
    ("7\\,\\mathrm{cm}", "7\\text{ cm}", 1.0),
    ("7\\,\\mathrm{cm}", "8\\,\\mathrm{cm}", 0.0),
    ("7\\,\\mathrm{cm}", "7\\,\\text{inches}", 0.0),
    ("5\\ \\text{cm}", "5", 1.0),
    ("5\\ \\text{cm}", "5\\text{ km}", 0.0),
    ("5\\;\\text{ cm}", "5\\,\\text{cm}", 1.0),
    ("5\\;\\text{ cm}", "50", 0.0),
    ("10\\,\\text{inches}", "10\\text{ inch}", 1.0),
    ("10\\,\\text{inches}", "10", 1.0),
    ("10\\,\\text{inches}", "10\\text{ feet}", 0.0),
    ("\\$5\\,\\text{million}", "5000000", 1.0),
    ("\\$5\\,\\text{million}", "\\$5\\text{ million}", 1.0),
    ("\\$5\\,\\text{million}", "5", 0.0),
    ("5", "5\\,\\text{cm}", 1.0),
    ("5", "5~\\text{cm}", 1.0),
    ("5", "5\\!\\text{ cm}", 1.0),
    ("5", "4\\,\\text{cm}", 0.0),
    # what math-verify already gets right stays right
    ("30^\\circ", "30", 1.0),
    ("30^\\circ", "30^{\\circ}", 1.0),
    ("30^\\circ", "60", 0.0),
    ("30", "30^\\circ", 1.0),
    ("\\pm 3", "3, -3", 1.0),
    ("\\pm 3", "-3, 3", 1.0),
    ("\\pm 3", "3", 0.0),
    ("\\frac{1}{2}.", "0.5", 1.0),
    ("\\frac{1}{2}.", "\\frac{1}{3}", 0.0),
    ("12.", "12", 1.0),
    ("1,000", "1000", 1.0),
    ("1,000", "1{,}000", 1.0),
    ("1,000", "100", 0.0),
    ("1\\,000", "1000", 1.0),
    ("1\\,000", "1,000", 1.0),
    ("1\\,000", "100", 0.0),
    ("\\text{(C)}", "C", 1.0),
    ("\\text{(C)}", "\\text{(D)}", 0.0),
    ("\\text{east}", "\\text{east}", 1.0),
    ("\\text{east}", "\\text{west}", 0.0),
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Each gold of UNIT_CASES, read by the loader a run uses (a refused gold raises here)."""
    golds = list(dict.fromkeys(g for g, _, _ in UNIT_CASES))
    path = tmp_path_factory.mktemp("golds") / "golds.jsonl"
    path.write_text("".join(json.dumps({"problem": f"Problem {i}", "answer": g}) + "\n"
                            for i, g in enumerate(golds)))
    read = load_rows("math", str(path), 0)
    assert [r["answer"] for r in read] == golds
    return dict(zip(golds, read))


@pytest.mark.parametrize("gold,answer,want", UNIT_CASES)
def test_grading_compares_the_value_and_the_unit_as_meant(rows, gold, answer, want):
    row = rows[gold]
    completion = f"Working it out step by step.\nSo the final answer is $\\boxed{{{answer}}}$."
    assert reward(completion, row) == want
    # the verdict is the grader's, not the except-net's
    bare = gmts.math_reward.__wrapped__(completion, row["answer"], row.get("latex", False),
                                        row.get("answer_line", False))
    assert bare == want


def test_every_gold_of_the_table_loads_as_latex_math_verify_reads(rows):
    """No gold is refused or left to the exact-match rule; both verdicts are in the table."""
    assert all(r.get("latex") and gmts.latex_equal(gmts.normal_answer(r["answer"])) for r in rows.values())
    assert {w for _, _, w in UNIT_CASES} == {0.0, 1.0}


def test_value_unit_and_same_unit_by_hand():
    """The split itself, so that a verdict above is right for the reason its comment gives."""
    assert gmts.value_unit("$5\\,\\text{cm}^2$") == ("5", "cm^2")
    assert gmts.value_unit("7\\text{ hours}.") == ("7", "h")  # a unit: its symbol, its power
    assert gmts.value_unit("10\\text{ thousand}") == ("10000", "")
    assert gmts.value_unit("2.5\\text{ million}") == ("2500000", "")
    assert gmts.value_unit("1+2\\mathrm{i}") == ("1+2i", "")  # a letter, no unit: the value's
    assert gmts.value_unit("30^\\circ.") == ("30", "deg")
    assert gmts.value_unit("\\text{east}") == ("\\text{east}", "")  # no value before it: all of it is text
    assert gmts.same_unit("cm", "centimeters") and gmts.same_unit("h", "hrs") and gmts.same_unit("hours", "hour")
    assert not gmts.same_unit("cm", "m") and not gmts.same_unit("cm^2", "cm^3") and not gmts.same_unit("cm^2", "cm")


def test_a_gold_in_dollars_with_a_trailing_period_keeps_its_unit(verifier):
    """value_unit's docstring: no $...$ around it and no trailing '.': both at once, the unit is still compared."""
    row = {"question": "q", "answer": "$5\\,\\text{cm}$.", "latex": True}
    assert reward(box("5\\text{ cm}"), row) == 1.0
    assert gmts.value_unit(row["answer"]) == ("5", "cm")
    assert reward(box("5\\text{ m}"), row) == 0.0


NASTY = ["\\text{" * 300, "5" + "~" * 999 + "\\text{cm}", "5" + "\\," * 490 + "\\text{cm}",
         "5" + "\\ " * 490 + "\\text{cm}", "\\\\ " * 300 + "\\text{cm}", "1" + " " * 980 + "\\text{ a b}",
         "9" * 900 + "\\text{ trillion}", "x" + "\\text{ a}" * 120, "\\mathrm{i}" * 100,
         "5\\text{ " + "s" * 900 + "}^{2}", "5\\text{ " + "a " * 450 + "}"]


@pytest.mark.parametrize("s", NASTY, ids=range(len(NASTY)))
def test_splitting_a_unit_never_raises_and_takes_no_time(s):
    """Inputs of 1,000 characters built to make a scan or a regex backtrack: value_unit and same_unit answer in
    well under a second."""
    t = time.perf_counter()
    value, unit = gmts.value_unit(s)
    assert isinstance(value, str) and isinstance(unit, str)
    assert gmts.same_unit(unit, unit) or not unit
    gmts.normal_answer(s), gmts.bare_answer(s)
    assert time.perf_counter() - t < 0.5, s[:30]


def test_splitting_a_unit_takes_no_time_on_a_gold_of_any_length():
    """A data file's gold is no longer refused for its length, and same_latex splits it (value_unit) on every
    answer graded: a run of 8,000 spaces inside it must not cost seconds per answer."""
    s = "5" + " " * 8000 + "x"
    t = time.perf_counter()
    assert gmts.value_unit(s) == (s, "")
    assert time.perf_counter() - t < 0.5


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.sampled_from(["\\text{", "\\mathrm{", "\\mbox{", "{", "}", " ", "cm", "s", "i",
                                 "\\,", "\\", "~", "5", "thousand", "^2", "^{3}", "$", ".", "x",
                                 "\\frac{", "/", "per", "square", "\\%", "\\$", "^\\circ", "\\mu",
                                 "e5", "\\times 10^{", "\\overline{", "four", "-", "hundredths",
                                 "m"]),
                max_size=30))
def test_splitting_a_unit_never_raises(parts):
    s = "".join(parts)
    for letters in (False, True):
        value, unit = gmts.value_unit(s, letters)
        assert isinstance(value, str) and isinstance(unit, str)
        assert isinstance(gmts.same_unit(unit, gmts.value_unit(s[::-1])[1]), bool)
        assert isinstance(gmts.unit_kind(unit), str)
    assert gmts._brackets(s) in ("set", "tuple", "") and len(gmts._pair_units(s, s[::-1])) == 2
    assert gmts.read_number(s) is None or isinstance(gmts.read_number(s), Fraction)


# ---- competition answers: (gold as MATH-500 writes it, completion, verdict), latex rows ----
COMPETITION = [
    ("\\frac{\\sqrt{3}}{2}", box("\\frac{\\sqrt{3}}{2}"), 1.0),
    ("\\frac{\\sqrt{3}}{2}", box("\\frac{\\sqrt3}{2}"), 1.0),
    ("\\frac{\\sqrt{3}}{2}", box("\\frac{1}{2}\\sqrt{3}"), 1.0),
    ("\\frac{\\sqrt{3}}{2}", box("\\frac{\\sqrt{2}}{2}"), 0.0),
    ("\\dfrac{7}{20}", box("\\frac{7}{20}"), 1.0),
    ("\\dfrac{7}{20}", box("0.35"), 1.0),
    ("\\dfrac{7}{20}", box("\\frac{7}{21}"), 0.0),
    ("\\frac{1}{2}", box("0.5"), 1.0),
    ("0.5", box("\\frac12"), 1.0),
    ("0.5", box("\\frac{1}{3}"), 0.0),
    ("2", box("x = 2"), 1.0),
    ("2", box("x=3"), 0.0),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", box("\\left( 3, \\frac{\\pi}{2} \\right)"), 1.0),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", box("(3, \\pi/2)"), 1.0),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", box("\\left( \\frac{\\pi}{2}, 3 \\right)"), 0.0),  # reordered: wrong
    ("(1,-2)", box("(1, -2)"), 1.0),
    ("(1,-2)", box("(-2, 1)"), 0.0),
    ("(-\\infty, 3]", box("(-\\infty, 3]"), 1.0),
    ("(-\\infty, 3]", box("(-\\infty, 3)"), 0.0),
    ("[2,5)", box("[2,5)"), 1.0),
    ("[2,5)", box("(2,5]"), 0.0),
    ("(-\\infty,-2)\\cup(3,\\infty)", box("(-\\infty,-2) \\cup (3,\\infty)"), 1.0),
    ("(-\\infty,-2)\\cup(3,\\infty)", box("(3,\\infty)"), 0.0),
    ("\\text{(C)}", box("\\text{(C)}"), 1.0),
    ("\\text{(C)}", box("C"), 1.0),
    ("\\text{(C)}", box("\\text{(D)}"), 0.0),
    ("\\text{Devon}", box("\\text{Devon}"), 1.0),
    ("\\text{Devon}", box("\\text{Evan}"), 0.0),
    ("\\text{June 20}", box("\\text{June 20}"), 1.0),
    ("\\text{June 20}", box("\\text{June 21}"), 0.0),
    ("3\\sqrt{3}", box("\\sqrt{27}"), 1.0),
    ("3\\sqrt{3}", box("3\\sqrt{2}"), 0.0),
    ("10\\sqrt{2}", box("10 \\sqrt 2"), 1.0),
    ("\\frac{2 \\sqrt{149}}{3}", box("\\frac{2\\sqrt{149}}{3}"), 1.0),
    ("\\sqrt{2}", box("1.41421356"), 1.0),
    ("\\sqrt{2}", box("1.41"), 0.0),
    ("2\\pi", box("2 \\pi"), 1.0),
    ("2\\pi", box("\\pi"), 0.0),
    ("\\frac{\\pi}{4}", box("\\pi/4"), 1.0),
    ("90^\\circ", box("90"), 1.0),
    ("90^\\circ", box("90^{\\circ}"), 1.0),
    ("90^\\circ", box("45^\\circ"), 0.0),
    ("50\\%", box("50\\%"), 1.0),
    ("50\\%", box("40\\%"), 0.0),
    ("\\$18.90", box("18.90"), 1.0),
    ("\\$18.90", box("\\$19.80"), 0.0),
    ("1.36", box("1.36"), 1.0),
    ("1.36", box("1.37"), 0.0),
    ("27.0", box("27"), 1.0),  # AMC23 stores floats
    ("204", box("204"), 1.0),
    ("204", "The answer is 204.", 0.0),  # a competition answer is read from \boxed{} only (Framework1)
    ("\\frac{3}{4}", "no box here: 3/4", 0.0),
    ("-\\frac{1}{3}", box("-\\frac13"), 1.0),
    ("-\\frac{1}{3}", box("\\frac{1}{3}"), 0.0),
    ("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}", box("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}"), 1.0),
    ("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}", box("\\begin{pmatrix} 2 \\\\ -1 \\end{pmatrix}"), 0.0),
    ("\\{1, 2, 3\\}", box("\\{3, 2, 1\\}"), 1.0),  # a set: any order
    ("\\{1, 2, 3\\}", box("\\{1, 2\\}"), 0.0),
    ("2,3", box("3, 2"), 1.0),  # a list of all solutions: any order
    ("x^2+7x+10", box("x^2 + 7x + 10"), 1.0),
    ("x^2+7x+10", box("(x+2)(x+5)"), 1.0),
    ("x^2+7x+10", box("x^2+7x+12"), 0.0),
    ("y = 2x + 3", box("y=2x+3"), 1.0),
    ("y = 2x + 3", box("y = 3x + 2"), 0.0),
    ("1011_2", box("1011_2"), 1.0),
    ("1011_2", box("1101_2"), 0.0),
    ("\\infty", box("\\infty"), 1.0),
    ("e^{2}", box("e^2"), 1.0),
    ("\\log_2 3", box("\\log_{2} 3"), 1.0),
    ("8.7 \\times 10^{8}", box("8.7\\times10^8"), 1.0),
    ("8.7 \\times 10^{8}", box("8.7\\times10^9"), 0.0),
    ("\\frac{1}{2 n+2}", box("\\frac{1}{2(n+1)}"), 1.0),
    ("\\frac{1}{2 n+2}", box("\\frac{1}{2n}"), 0.0),
]


@pytest.mark.parametrize("gold,text,want", COMPETITION)
def test_competition_answers(verifier, gold, text, want):
    assert timed(math_reward, text, gold, True) == want


def test_competition_table_holds_both_verdicts_and_the_named_forms():
    """At least 60 cases, both verdicts, and the forms a competition gold takes."""
    assert len(COMPETITION) >= 60 and {w for _, _, w in COMPETITION} == {0.0, 1.0}
    golds = {g for g, _, _ in COMPETITION}
    assert {"\\dfrac{7}{20}", "0.5", "2", "[2,5)", "\\text{(C)}", "90^\\circ", "50\\%", "1011_2"} <= golds


def test_a_power_of_ten_is_a_number_where_math_verify_misses_it(verifier):
    """math-verify 0.9.0 reads 8.7 \\times 10^{8} as 8.7 (a float) times 10^8 and misses that
    870000000 is equal, and reads Minerva's 4.5e33 as 4.5 * e * 33 (Euler's e): pinned, so that a
    version that fixes it shows here. gmts reads both as exact numbers (read_number) first."""
    gmts.latex_equal.cache_clear()
    assert not gmts.latex_equal("8.7 \\times 10^{8}", "870000000")
    assert gmts.latex_equal("3e8", "8e3")  # both 24e to it
    assert math_reward(box("870000000"), "8.7 \\times 10^{8}", True) == 1.0
    assert math_reward(box("8e3"), "3e8", True) == 0.0
    read = {"4.5e33": 45 * 10 ** 32, "1.2E-5": Fraction(12, 10 ** 6), "10^{-5}": Fraction(1, 10**5),
            "6.02 \\times 10^{23}": 602 * 10 ** 21, "0.1\\overline{6}": Fraction(1, 6),
            "-1.\\overline{27}": Fraction(-14, 11), "+2": 2, "4\\frac{2}{3}": Fraction(14, 3)}
    assert {s: gmts.read_number(s) for s in read} == read


def test_gsm8k_rows_never_ask_math_verify(monkeypatch):
    """A GSM8K row (latex False, the default) is graded by its own rule: every MATH_CASES verdict with
    math-verify out of reach."""
    calls = []
    monkeypatch.setattr(gmts, "latex_equal", lambda *a, **k: calls.append(a))
    for text, answer, want in MATH_CASES.values():
        assert math_reward(text, answer) == want
    assert calls == []


@pytest.fixture
def no_gc_callbacks():
    """None of the gc callbacks hypothesis registers after its first test: math-verify's alarm
    raises its timeout in whatever Python code runs, and one raised inside a gc callback is
    swallowed (the computation runs on). A run has none: gc.callbacks is empty with gmts, torch,
    transformers and datasets imported."""
    kept = gc.callbacks[:]
    gc.callbacks.clear()
    yield
    gc.callbacks[:] = kept


@pytest.fixture
def one_second(monkeypatch, no_gc_callbacks):
    """math-verify's bound at 1 s, and no verdict remembered from before (latex_equal's lru_cache) or kept after."""
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1)
    gmts.latex_equal.cache_clear()
    yield 1
    gmts.latex_equal.cache_clear()


ADVERSARIAL = {  # what makes sympy run for minutes, recurse or read a whole line, and what never reaches it
    "power tower 9^9^9^9": box("9^{9^{9^{9}}}"),
    "10^10^10": box("10^{10^{10}}"),
    "(10^10)!": box("(10^{10})!"),
    "2^2^2^2^2^2": box("2^{2^{2^{2^{2^{2}}}}}"),
    "20 nested fractions": box("\\frac{1}{" * 20 + "2" + "}" * 20),
    "140 nested braces": box("{" * 140 + "1" + "}" * 140),
    "100,000 nested boxed": "\\boxed{" * 100_000 + "1" + "}" * 100_000,
    "1,000,000 digits boxed": box("9" * 1_000_000),
    "1,000,000 digits bare": "9" * 1_000_000,
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_competition_answers_are_bounded_in_time(verifier, one_second, text):
    """Each is 0.0 within math-verify's own timeouts (the gold's parse, the answer's, the comparison: here 1 s
    each, well under 2 x VERIFY_TIMEOUT_S in practice) plus SLOW; the next verdicts are right."""
    t = time.perf_counter()
    assert math_reward(text, "\\frac{1}{2}", True) == 0.0
    assert time.perf_counter() - t < 2 * gmts.VERIFY_TIMEOUT_S + SLOW
    assert math_reward(box("0.5"), "\\frac{1}{2}", True) == 1.0
    assert math_reward(box("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", True) == 1.0


def test_the_power_tower_is_bounded_by_the_default_timeout(verifier, no_gc_callbacks):
    """The same with the VERIFY_TIMEOUT_S a run uses: \\boxed{9^{9^{9^{9}}}} is a 0 well under twice it."""
    gmts.latex_equal.cache_clear()  # a verdict remembered from another test would take no time
    t = time.perf_counter()
    assert reward(box("9^{9^{9^{9}}}"), {"question": "q", "answer": "72", "latex": True}) == 0.0
    assert time.perf_counter() - t < 2 * gmts.VERIFY_TIMEOUT_S
    gmts.latex_equal.cache_clear()


def _in_a_thread(fn):
    got = []

    def call():
        try:
            got.append(fn())
        except Exception as e:  # what the thread raised, for the test to see
            got.append(e)
    worker = threading.Thread(target=call)
    worker.start()
    worker.join(60)
    return got[0]


def test_grading_off_the_main_thread_raises_rather_than_scoring_0(verifier):
    """math-verify's timeouts are signal.alarm, which only the main thread may set: a LaTeX answer graded from a
    thread is gmts.RunError through the reward's except-net (a silent 0 would train on wrong rewards); a GSM8K row,
    which never asks math-verify, grades there as anywhere."""
    gmts.latex_equal.cache_clear()  # a remembered verdict is returned without asking math-verify
    latex = {"question": "q", "answer": "2", "latex": True}
    for fn in (lambda: reward(box("x = 2"), latex), lambda: math_reward(box("\\sqrt 2"), "\\sqrt{2}", True),
               lambda: gmts.latex_equal("\\frac{1}{2}", "0.5")):
        err = _in_a_thread(fn)
        assert isinstance(err, gmts.RunError) and "main thread" in str(err), err
    assert _in_a_thread(lambda: math_reward("6 * 12 = 72\n#### 72", "72")) == 1.0
    assert reward(box("x = 2"), latex) == 1.0  # the same answer in the main thread


# ---- the regression table, testdata/grading_pairs.tsv: gold, answer, right grade (real golds) ----
def read_pairs():
    """The table's rows as (source, gold, answer, grade); its header checked, comments skipped."""
    with open(os.path.join(TESTDATA, "grading_pairs.tsv")) as f:
        lines = [line.rstrip("\n").split("\t") for line in f if not line.startswith("#")]
    assert lines[0] == ["source", "gold", "answer", "grade", "why"]
    assert all(len(line) == 5 for line in lines)
    return [(src, gold, answer, float(grade)) for src, gold, answer, grade, _ in lines[1:]]


PAIRS = read_pairs()
FORMATS = {"boxed in prose": box,
           "boxed in answer tags": lambda a: f"<think>Work.</think>\n{A(box(a))}"}


@pytest.fixture(scope="module")
def pair_rows(tmp_path_factory):
    """Each gold of PAIRS read by the loader a run uses, in two MATH layouts: problem/answer
    (MATH-500's) and problem/solution, the gold the solution's last box (MATH's train split)."""
    golds = list(dict.fromkeys(gold for _, gold, _, _ in PAIRS))
    folder = tmp_path_factory.mktemp("pairs")
    answer = [{"problem": f"Problem {i}", "answer": g} for i, g in enumerate(golds)]
    solution = [{"problem": f"Problem {i}", "level": "Level 3", "type": "Algebra",
                 "solution": f"Work. So it is $\\boxed{{{g}}}$."} for i, g in enumerate(golds)]
    paths = [_jsonl(folder / "answer.jsonl", answer), _jsonl(folder / "solution.jsonl", solution)]
    layouts = [load_rows("math", path, 0) for path in paths]
    assert all([r["answer"] for r in rows] == golds for rows in layouts)
    return [dict(zip(golds, rows)) for rows in layouts]


@pytest.mark.parametrize("src,gold,answer,want", PAIRS,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(PAIRS)])
def test_the_regression_table_is_graded_as_a_careful_grader_would(verifier, pair_rows, src, gold,
                                                                   answer, want):
    """Each pair through a run's path: both layouts, both completion formats, the table's grade."""
    for rows in pair_rows:
        for name, fmt in FORMATS.items():
            assert reward(fmt(answer), rows[gold]) == want, (name, gold, answer)


def test_the_regression_table_covers_each_source_both_ways():
    """A few hundred pairs; every set the golds are modelled on, with right and wrong answers."""
    by_source = collections.defaultdict(set)
    for src, _, _, grade in PAIRS:
        by_source[src].add(grade)
    assert len(PAIRS) >= 300 and len(set(PAIRS)) == len(PAIRS)
    sources = {"MATH", "MATH-500", "AIME", "AMC", "Minerva", "OlympiadBench", "GSM8K"}
    assert set(by_source) == sources
    assert all(grades == {0.0, 1.0} for grades in by_source.values()), by_source


def test_minerva_e_notation_golds_equal_their_power_of_ten_and_decimal_forms(verifier):
    """Every e-notation gold of the Minerva slice (4.5e33: math-verify's 4.5 * e * 33) against its
    a \\times 10^{n} form and its decimal (Decimal, not gmts, writes it): 1.0; another exponent,
    the mantissa alone, the two swapped: 0."""
    rows = [r for r in load_rows("math", os.path.join(TESTDATA, "minerva_math.jsonl"), 0)
            if re.fullmatch(r"[0-9.]+e-?[0-9]+", r["answer"])]
    golds = ["4.5e33", "3.83e35", "8.7e8", "4e33", "3.3e12", "3e6", "7e37", "7.5e7"]
    assert [r["answer"] for r in rows] == golds
    for row in rows:
        mantissa, exponent = row["answer"].split("e")
        right = [f"{mantissa} \\times 10^{{{exponent}}}", f"{mantissa}\\cdot10^{{{exponent}}}",
                 format(Decimal(mantissa).scaleb(int(exponent)), "f")]
        wrong = [f"{mantissa} \\times 10^{{{int(exponent) + 1}}}", mantissa,
                 f"{exponent}e{mantissa}"]
        for fmt in FORMATS.values():
            grades = [reward(fmt(a), row) for a in right + wrong]
            assert grades == [1.0] * 3 + [0.0] * 3, row["answer"]


EXTRACTION = {  # (completion, verdict) against the gold \frac{1}{2}: which box is the answer
    "the last box": ("\\boxed{3}, no: \\boxed{\\frac{1}{2}}", 1.0),
    "an unclosed last box is no answer": (
        "\\boxed{\\frac{1}{2}} is a guess. Checking: \\boxed{\\frac{1}{", 0.0),
    "a long last box is read": ("\\boxed{3}, no: \\boxed{\\frac{1}{2}" + "+0" * 250 + "}", 1.0),
    "a box longer than BOX_CAP is no answer": (
        "\\boxed{\\frac{1}{2}}, or \\boxed{" + "0+" * 600 + "\\frac12}", 0.0),
    "a space before the brace": ("So \\boxed {\\frac{1}{2}}.", 1.0),
    "fbox": ("So \\fbox{\\frac{1}{2}}.", 1.0),
    "a bare mention of \\boxed after the box": (
        "\\boxed{\\frac{1}{2}}, put in \\boxed as asked", 1.0),
}


@pytest.mark.parametrize("text,want", EXTRACTION.values(), ids=EXTRACTION.keys())
def test_the_answer_is_the_last_box_closed_within_the_cap(verifier, text, want):
    row = {"question": "q", "answer": "\\frac{1}{2}", "latex": True}
    assert timed(math_reward, text, row["answer"], True) == want
    assert reward(text, row) == want


def test_a_gsm8k_row_takes_the_same_last_box():
    """GSM8K's rule reads the last box the same way: an unclosed last box is no answer (no #### or
    last number stands in for it); \\fbox and '\\boxed {' are boxes."""
    assert math_reward("#### 72, then \\boxed{7", "72") == 0.0
    assert math_reward("72. \\boxed{72", "72") == 0.0
    assert math_reward("\\fbox{72}", "72") == 1.0
    assert math_reward("\\boxed {72} apples", "72") == 1.0
    assert math_reward("\\boxed{" + "7" * 2000 + "}, or 72", "72") == 0.0


UNIT_TABLE = {  # unit: (its spellings, another unit), value_unit's canonical unit, by hand
    "cm": (["5\\text{ cm}", "5\\mathrm{~cm}", "5\\textnormal{ centimeters}",
            "5\\textrm{ centimetre}", "5 cm"], "5\\text{ m}"),
    "mi": (["5\\text{ mi}", "5\\text{ miles}", "5 miles", "5\\mbox{ mile}"], "5\\text{ km}"),
    "lb": (["5\\text{ lb}", "5\\text{ lbs}", "5\\text{ pounds}", "5 pounds"], "5\\text{ kg}"),
    "ft^2": (["5\\text{ ft}^2", "5\\text{ square feet}", "5\\text{ sq ft}", "5\\text{ feet}^{2}"],
             "5\\text{ ft}"),
    "unit^2": (["5\\text{ units}^2", "5\\text{ square units}"], "5\\text{ cubic units}"),
    "cm^3": (["5\\text{ cm}^3", "5\\text{ cubic centimeters}", "5\\text{ cc}"], "5\\text{ cm}^2"),
    "h^-1 mi": (["5\\text{ mph}", "5\\text{ miles per hour}", "5\\text{ mi/h}", "5 mph"],
                "5\\text{ km/h}"),
    "m s^-1": (["5\\text{ m/s}", "5\\mathrm{~m} / \\mathrm{s}", "5 \\mathrm{m\\,s^{-1}}",
                "5\\text{ meters per second}"], "5\\text{ m}"),
    "$": (["\\$5", "$5", "5\\text{ dollars}"], "5\\text{ cents}"),
    "%": (["5\\%", "5\\,\\%", "5\\text{ percent}", "5 \\%"], "\\$5"),
    "deg": (["5^\\circ", "5^{\\circ}", "5\\text{ degrees}"], "5\\text{ radians}"),
    "um": (["5 \\mu \\mathrm{m}", "5\\,\\mu\\text{m}", "5\\text{ micrometers}"], "5\\text{ mm}"),
}


@pytest.mark.parametrize("unit", UNIT_TABLE)
def test_one_alias_table_reads_every_spelling_of_a_unit(unit):
    """Each spelling splits to the value 5 and the same unit; the other unit differs."""
    spellings, other = UNIT_TABLE[unit]
    assert {gmts.value_unit(s) for s in spellings} == {("5", unit)}, unit
    assert gmts.value_unit(other)[0] == "5" and gmts.value_unit(other)[1] not in ("", unit)


def test_same_unit_reads_words():
    assert gmts.same_unit("miles per hour", "mph") and gmts.same_unit("boxes", "box")
    assert gmts.same_unit("square units", "units^2") and gmts.same_unit("pennies", "penny")
    assert not gmts.same_unit("square feet", "feet") and not gmts.same_unit("cents", "dollars")


def test_magnitude_and_fraction_words_multiply_the_value_and_number_words_read():
    """2 hundred thousand is 200000 (composed), 5 million bare too, 5 hundredths 0.05; four is 4."""
    split = {"2\\text{ hundred thousand}": ("200000", ""), "5 million": ("5000000", ""),
             "\\$1.2\\text{ million}": ("1200000", "$"),
             "5\\text{ hundredths}": ("\\frac{1}{20}", ""),
             "3 tenths": ("\\frac{3}{10}", ""), "\\mbox{four}": ("4", ""), "twenty-one": ("21", ""),
             "\\text{two hundred}": ("200", ""), "x\\text{ thousand}": ("x\\times10^{3}", "")}
    assert {s: gmts.value_unit(s) for s in split} == split


def test_a_bare_letter_after_a_value_is_a_unit_only_of_the_other_side_s_kind():
    """5 m against 5 cm: both lengths, so m is meters and differs; against a gold with no unit it
    is a variable where the gold's own letter is one (Minerva's k = 37/4 m), a unit added where
    the gold has none."""
    pair = gmts._pair_units
    assert pair("5\\text{ cm}", "5 m") == (("5", "cm"), ("5", "m"))
    assert pair("5\\text{ cm}", "5 s") == (("5", "cm"), ("5 s", ""))  # time is not a length
    k = "\\frac{37}{4}"
    assert pair(k + " m", k) == ((k + " m", ""), (k, ""))
    assert pair(k + " m", k + " m")[1] == (k + " m", "")
    assert pair("5", "5 m") == (("5", ""), ("5", "m"))
    assert gmts.value_unit("5  m^2") == ("5  m^2", "")
    assert gmts.value_unit("5  m^2", True) == ("5", "m^2")
    assert gmts.unit_kind("h^-1 km") == "length time^-1" and gmts.unit_kind("erg") == "energy"


def test_sets_tuples_and_intervals_are_told_apart():
    forms = ["\\{1,2\\}", "\\left\\{ 1, 2 \\right\\}", "(1,2)", "[1,2)", "(1,2)\\cup(3,4)",
             "\\{(1,2), (3,4)\\}", "(x+1)", "1, 2"]
    kinds = ["set", "set", "tuple", "tuple", "", "", "", ""]
    assert [gmts._brackets(s) for s in forms] == kinds


def test_grading_counts_math_verify_timeouts_per_answer(verifier, one_second):
    """grade_answers: each answer's reward, its seconds and whether its grading hit a timeout
    (math-verify's, read through raise_on_error and counted in gmts.TIMEOUTS); a timed-out answer
    scores 0 and the next is graded."""
    row = {"question": "q", "answer": "\\frac{1}{2}", "latex": True}
    before = sum(gmts.TIMEOUTS.values())
    texts = [box("9^{9^{9^{9}}}"), box("0.5"), "no box"]
    rewards, seconds, timed_out = gmts.grade_answers({"reward": reward}, texts, [row] * 3)
    assert rewards.tolist() == [0.0, 1.0, 0.0] and timed_out.tolist() == [True, False, False]
    assert sum(gmts.TIMEOUTS.values()) > before
    assert len(seconds) == 3 and seconds[0] >= 1.0 > seconds[1]


def test_a_batch_verifier_grades_the_batch_in_one_call_and_shares_its_time():
    """A task with "rewards" (code's programs in parallel) is called once on the whole batch, its
    answers paired with their rows in order, each answer taking an equal share of the time."""
    calls = []

    def rewards(texts, rows):
        calls.append((list(texts), list(rows)))
        time.sleep(0.3)
        return [float(t == r["answer"]) for t, r in zip(texts, rows)]

    rows = [{"answer": "a"}, {"answer": "b"}, {"answer": "c"}]
    task = {"reward": lambda t, r: 1 / 0, "rewards": rewards}
    got, seconds, timed_out = gmts.grade_answers(task, ["a", "x", "c"], rows)
    assert got.tolist() == [1.0, 0.0, 1.0] and calls == [(["a", "x", "c"], rows)]
    assert seconds.tolist() == [seconds[0].item()] * 3 and 0.3 / 3 <= seconds[0] < 0.3
    assert timed_out.tolist() == [False] * 3


def test_a_step_logs_its_grading_time_and_timeouts(tmp_path, monkeypatch, capsys):
    """A real step (the tiny model, countdown) whose verifier takes 50 ms an answer and counts a
    timeout on every other call: metrics.jsonl's grade_time_s holds every rollout batch's 8
    answers (all groups dead here, so --filter-groups draws more), at least 0.4 s and 4 timeouts a
    batch, and the step line says so; a step line with fast grading and no timeouts leaves it
    out."""
    calls = []

    def slow(text, row):
        time.sleep(0.05)
        calls.append(1)
        gmts.TIMEOUTS["verify"] += len(calls) % 2  # as a timed-out comparison counts itself
        return 0.0
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", slow)
    out = tmp_path / "run"
    gmts.main(["--model", "tiny", "--task", "countdown", "--data", "easy", "--short-prompt",
               "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8",
               "--eval-size", "2", "--eval-every", "0", "--steps", "1", "--threads", "1",
               "--out", str(out)])
    rec = gmts.read_metrics(str(out))[1]
    batches = rec["rollout_batches"]
    assert rec["grade_timeouts"] == 4 * batches
    assert 0.4 * batches <= rec["grade_time_s"] <= rec["rollout_time_s"]
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 1/1 ")][0]
    assert f"grading {rec['grade_time_s']:.2f} s ({4 * batches} timed out)" in line, line
    quiet = dict(rec, grade_time_s=0.1 * rec["step_time_s"], grade_timeouts=0)
    assert "grading" not in gmts.step_line(quiet)
    assert "grading 5.00 s |" in gmts.step_line(dict(quiet, grade_time_s=5.0, step_time_s=10.0))


# ==== data layouts and loading: testdata/'s published files, each layout, bad files ==================================
SLICES = {"aime24.jsonl": 20, "amc23.jsonl": 40, "minerva_math.jsonl": 33, "math500.jsonl": 30,
          "olympiadbench.jsonl": 22, "math_train_layout.jsonl": 8, "dapo_layout.jsonl": 3}


def answer_as_asked(row, gold):
    """A completion that puts gold where the row's prompt asks for it."""
    return f"Step by step.\nAnswer: {gold}" if row.get("answer_line") else box(gold)


@pytest.mark.parametrize("name", sorted(SLICES))
def test_every_row_of_the_real_files_loads_and_grades_its_own_gold(name, verifier):
    """Every row loads through gmts.load_rows without flags, its gold where its prompt asks earns 1.0, and another
    row's different gold earns 0 (no false positive)."""
    rows = load_rows("math", os.path.join(TESTDATA, name), 0)
    assert len(rows) == SLICES[name]
    for i, row in enumerate(rows):
        assert reward(answer_as_asked(row, row["answer"]), row) == 1.0, (name, i, row["answer"])
        other = rows[i - 1]["answer"]
        if gmts.bare_answer(other) != gmts.bare_answer(row["answer"]):
            assert reward(answer_as_asked(row, other), row) == 0.0, (name, i, row["answer"], other)


def test_solution_only_rows_take_the_solution_s_last_box():
    """Qwen2.5-Math's minerva_math (problem, solution, type, idx) and MATH's train layout (problem, level, type,
    solution): the gold is the solution's last \\boxed{}, as the field's harnesses take it."""
    minerva = load_rows("math", os.path.join(TESTDATA, "minerva_math.jsonl"), 0)
    with open(os.path.join(TESTDATA, "minerva_math.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    assert [r["question"] for r in minerva] == [r["problem"] for r in raw]
    assert minerva[0]["answer"] == "1.6"  # '... $\\boxed{1.6}$ cm.' in its solution
    hendrycks = load_rows("math", os.path.join(TESTDATA, "math_train_layout.jsonl"), 0)
    want = ["7\\text{ hours}.", "\\sin^2 t", "30^\\circ.", "a + b + c"]
    assert [r["answer"] for r in hendrycks[:4]] == want
    two = {"problem": "p", "solution": "First $\\boxed{1}$, then $\\boxed{\\frac{1}{2}}$."}
    assert gmts._check_row(two, "math")["answer"] == "\\frac{1}{2}"  # the last box, braces kept


def test_golds_math_verify_misreads_are_normalised_and_graded_as_meant(verifier):
    """MATH train's golds that math-verify 0.9 cannot read as written are read after normal_answer: equivalent
    answers earn 1.0, wrong ones 0, none is left to the exact-match rule."""
    rows = load_rows("math", os.path.join(TESTDATA, "math_train_layout.jsonl"), 0)[:4]
    for row in rows:
        assert not gmts.latex_equal(row["answer"])  # as written: unreadable
        assert gmts.latex_equal(gmts.normal_answer(row["answer"]))  # normalised: read
    cases = [(0, "7", "8"), (0, "7\\text{ hours}", "7\\text{ days}0"),
             (1, "\\sin^{2}(t)", "\\cos^2 t"),
             (1, "1 - \\cos^2 t", "\\sin t"), (2, "30", "60^\\circ"), (2, "30^{\\circ}", "31"),
             (3, "c+b+a", "a + b"), (3, "a+b+c", "a b c")]
    for i, right, wrong in cases:
        verdicts = (reward(box(right), rows[i]), reward(box(wrong), rows[i]))
        assert verdicts == (1.0, 0.0), (rows[i]["answer"], right)


def test_a_gold_math_verify_cannot_read_is_graded_by_exact_bare_match(tmp_path, verifier):
    """E_{1},E_{2} (Minerva), m_{\\max }=n^{2}-n-1 (OlympiadBench) and a malformed 'x^': kept as latex rows (no
    row flag), graded by bare_answer's exact match at grade time: spacing and braces forgiven, nothing else. The
    slices hold the seven such golds testdata/README.md lists."""
    read = load_rows("math", os.path.join(TESTDATA, "minerva_math.jsonl"), 0)
    read += load_rows("math", os.path.join(TESTDATA, "olympiadbench.jsonl"), 0)
    unreadable = [r["answer"] for r in read if not gmts.latex_equal(gmts.normal_answer(r["answer"]))]
    dm = "\\frac{dM}{dt}=\\frac{10^{5} L_{\\odot}}{0.007 c^{2} M_{\\odot}^{6}} M^{6}"
    assert unreadable == ["np.arcsin(10/13)", dm, "-1./3", "-3./2", "E_{1},E_{2}", "$m_{\\max }=n^{2}-n-1$", "$t(0,4]$"]
    rows = {r["answer"]: r for r in read}
    e12, m = rows["E_{1},E_{2}"], rows["$m_{\\max }=n^{2}-n-1$"]
    assert e12 == {"question": e12["question"], "answer": "E_{1},E_{2}", "latex": True}
    assert reward(box("E_1, E_2"), e12) == 1.0 and reward(box("E_{1}"), e12) == 0.0
    assert reward(box("E_2, E_1"), e12) == 0.0  # exact: an order is not forgiven
    assert reward(box("m_{\\max} = n^2 - n - 1"), m) == 1.0
    assert reward(box("m_{\\max}=n^2-n"), m) == 0.0
    bad = load_rows("math", _jsonl(tmp_path / "bad.jsonl", [{"problem": "p", "answer": "x^"}]), 0)[0]
    assert bad["answer"] == "x^" and reward(box("x^"), bad) == 1.0 and reward(box("x^2"), bad) == 0.0


def test_the_same_rows_in_two_layouts_get_the_same_verdicts(tmp_path, verifier):
    """AMC23 as its hub copy (question/answer, .jsonl), as MATH-500 (problem/answer, .jsonl), as AIME's CSV
    (Question/Answer) and as OlympiadBench (question/final_answer, a list, .parquet): the same rows, the same verdict
    on every completion; the boxed rule: a bare last number earns nothing."""
    import datasets
    with open(os.path.join(TESTDATA, "amc23.jsonl")) as f:
        raw = [json.loads(line) for line in f][:10]
    paths = [_jsonl(tmp_path / "q.jsonl", [{"question": r["question"], "answer": r["answer"]} for r in raw]),
             _jsonl(tmp_path / "p.jsonl", [{"problem": r["problem"], "answer": r["answer"]} for r in raw])]
    with open(tmp_path / "aime.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Question", "Answer"])
        w.writerows([i, r["question"], r["answer"]] for i, r in enumerate(raw))
    paths.append(str(tmp_path / "aime.csv"))
    datasets.Dataset.from_list([{"question": r["question"], "final_answer": [str(r["answer"])]}
                                for r in raw]).to_parquet(str(tmp_path / "o.parquet"))
    paths.append(str(tmp_path / "o.parquet"))
    verdicts = []
    for path in paths:
        rows = load_rows("math", path, 0)
        assert [r["question"] for r in rows] == [r["question"] for r in raw]
        verdicts.append([reward(c, r) for r in rows for c in (
            box(r["answer"]), f"The answer is {r['answer']}", f"#### {r['answer']}", box("1234567"),
            f"\\boxed{{{r['answer']}}} no, \\boxed{{1234567}}")])
    assert verdicts[0] == verdicts[1] == verdicts[2] == verdicts[3]
    assert verdicts[0] == [1.0, 0.0, 0.0, 0.0, 0.0] * 10


def test_gsm8k_rows_keep_their_rule():
    """A gold given as GSM8K's '... #### N' (the hub's gsm8k, a copy of it) and generated rows: the last \\boxed{},
    else the number after ####, else the last number."""
    row = gmts._check_row({"question": "q", "answer": "2 + 2 = 4\n#### 4"}, "math")
    assert row == {"question": "q", "answer": "4", "steps": ["2 + 2 = 4"]}
    for rows in ([row], load_rows("math", "gen", 3, 0)):
        for r in rows:
            assert reward(f"so {r['answer']}", r) == 1.0 and reward(f"#### {r['answer']}", r) == 1.0
            assert reward(box(r["answer"]), r) == 1.0 and reward("so 100000", r) == 0.0


def test_a_dapo_row_s_own_instruction_counts(verifier):
    """DAPO-Math-17k's prompt asks for a last line 'Answer: N': that line earns the reward, and no style adds a
    system line, prefill or suffix that contradicts it."""
    rows = load_rows("math", os.path.join(TESTDATA, "dapo_layout.jsonl"), 0)
    row = rows[0]
    assert row["answer_line"] and row["answer"] == "9"
    assert reward("36 = 2^2 3^2, so (2+1)(2+1).\nAnswer: 9", row) == 1.0
    assert reward("Answer: $9$", row) == 1.0 and reward("Answer: \\boxed{9}", row) == 1.0
    assert reward("Answer: 8", row) == 0.0
    assert reward(box("9"), row) == 0.0  # not where the row asks
    _, tok = gmts.build_tiny(hidden=16, layers=1)
    task = get_task("math")
    want = tok.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                   add_generation_prompt=True)
    for style in ("ours", "qwen-math"):
        assert gmts.build_prompts(tok, task, [row], True, style=style) == [want]
    plain = {"question": "What is $1+1$?", "answer": "2", "latex": True}
    assert gmts.QWEN_MATH_SYSTEM in gmts.build_prompts(tok, task, [plain], True, False, "qwen-math")[0]


def write_math500(tmp_path, bad=False):
    rows = [{"problem": "What is $\\frac{6}{8}$ in lowest terms?", "solution": "...", "answer": "\\frac{3}{4}",
             "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
            {"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "...",
             "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
             "unique_id": "test/precalculus/807.json"},
            {"problem": "How many vertical asymptotes does $y=\\frac{2}{x^2+x-6}$ have?", "solution": "...",
             "answer": "2", "subject": "Algebra", "level": 3, "unique_id": "test/algebra/1.json"}]
    return _jsonl(tmp_path / "math500.jsonl", rows)


def write_aime(tmp_path):
    """Framework1's AIME_Dataset.csv header; datasets reads Answer as an integer."""
    path = tmp_path / "aime.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Year", "Problem Number", "Question", "Answer", "Part"])
        w.writerow(["2024-I-2", 2024, 2, "Find $xy$ if $\\log_x(y^x)=\\log_y(x^{4y})=10$.", 25, "I"])
        w.writerow(["2024-I-3", 2024, 3, "Count the $n \\le 2024$ for which Bob wins.", 809, "I"])
    return str(path)


def write_minerva(tmp_path):
    """A JSON array, answers as lists that end in a newline."""
    rows = [{"problem": "Give the wavelength in Angstroms, to two significant figures.", "solution": "\\boxed{9.6}",
             "type": "Introduction to Astronomy", "idx": 9, "answer": ["9.6\n"]},
            {"problem": "Compute the star's radius in centimeters.", "solution": "...", "type": "Astronomy",
             "idx": 13, "answer": ["8.7 \\times 10^{8}"]}]
    (tmp_path / "minerva.json").write_text(json.dumps(rows))
    return str(tmp_path / "minerva.json")


def write_olympiad(tmp_path):
    rows = [{"question": "Determine the largest real number $\\mu$ ...", "final_answer": ["$\\frac{1}{2 n+2}$"],
             "is_multiple_answer": False, "unit": None, "answer_type": "Expression"},
            {"question": "Determine all primes $p$ and $x, y$ with $x^3+y^3=p(xy+p)$.",
             "final_answer": ["$(1,8,19), (2,7,13), (4,5,7)$"], "is_multiple_answer": True, "unit": None,
             "answer_type": "Tuple"}]
    return _jsonl(tmp_path / "olympiad.jsonl", rows)


def write_dapo(tmp_path, name="dapo.parquet"):
    """DAPO-Math-17k's layout: a chat prompt list, the gold in reward_model.ground_truth."""
    import datasets
    rows = [{"data_source": "math", "prompt": [{"content": "Find $a+b+c$ for $\\frac{a\\sqrt{b}}{c}$ ...",
                                                "role": "user"}],
             "ability": "math", "reward_model": {"ground_truth": "34", "style": "rule"}, "extra_info": {"index": 0}},
            {"data_source": "math", "prompt": [{"content": "What is $\\sqrt{16}$?", "role": "user"}],
             "ability": "math", "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": 1}}]
    path = tmp_path / name
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_each_published_layout_is_read_without_flags(tmp_path, verifier):
    """Rows as the task trains on them: the question, the gold (an answer list's first item, stripped), latex."""
    def rows(*pairs):
        return [{"question": q, "answer": a, "latex": True} for q, a in pairs]
    assert load_rows("math", write_math500(tmp_path), 0) == rows(
        ("What is $\\frac{6}{8}$ in lowest terms?", "\\frac{3}{4}"),
        ("Convert $(0,3)$ to polar coordinates.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("How many vertical asymptotes does $y=\\frac{2}{x^2+x-6}$ have?", "2"))
    assert load_rows("math", write_aime(tmp_path), 0) == rows(
        ("Find $xy$ if $\\log_x(y^x)=\\log_y(x^{4y})=10$.", "25"),
        ("Count the $n \\le 2024$ for which Bob wins.", "809"))
    assert load_rows("math", write_minerva(tmp_path), 0) == rows(
        ("Give the wavelength in Angstroms, to two significant figures.", "9.6"),
        ("Compute the star's radius in centimeters.", "8.7 \\times 10^{8}"))
    assert load_rows("math", write_olympiad(tmp_path), 0) == rows(
        ("Determine the largest real number $\\mu$ ...", "$\\frac{1}{2 n+2}$"),
        ("Determine all primes $p$ and $x, y$ with $x^3+y^3=p(xy+p)$.", "$(1,8,19), (2,7,13), (4,5,7)$"))
    assert load_rows("math", write_dapo(tmp_path), 0) == rows(
        ("Find $a+b+c$ for $\\frac{a\\sqrt{b}}{c}$ ...", "34"), ("What is $\\sqrt{16}$?", "4"))
    olympiad = load_rows("math", write_olympiad(tmp_path), 0)
    assert reward(box("\\frac{1}{2(n+1)}"), olympiad[0]) == 1.0  # the gold's $...$ is read


def test_our_own_layout_takes_latex_golds_and_keeps_gsm8k_rows(tmp_path, verifier):
    path = _jsonl(tmp_path / "own.jsonl", [{"question": "q1", "answer": "\\frac{\\sqrt{3}}{2}"},
                                           {"question": "q2", "answer": "He has 2<<1+1=2>> apples\n#### 1,450"},
                                           {"question": "q3", "answer": 72}])
    first, second, third = load_rows("math", path, 0)
    assert first == {"question": "q1", "answer": "\\frac{\\sqrt{3}}{2}", "latex": True}
    assert second == {"question": "q2", "answer": "1450", "steps": ["He has 2 apples"]}  # GSM8K's rule
    assert third == {"question": "q3", "answer": "72", "latex": True}  # no '####': boxed
    assert reward(box("\\frac{\\sqrt3}{2}"), first) == 1.0
    assert reward("\\boxed{x = 72}", third) == 1.0  # math-verify reads 'x = '
    assert reward("so 72", third) == 0.0  # but not a bare last number
    assert reward("\\boxed{x = 1450}", second) == 0.0  # GSM8K's: numbers


def test_a_hub_id_and_a_dataset_folder_take_the_same_datasets_call(tmp_path, monkeypatch):
    """hf:ID[:CONFIG]:SPLIT -> datasets.load_dataset(ID[, CONFIG], split=SPLIT; train without one):
    a local folder laid out as a hub repository (data/test-*.parquet) loads through it, in order;
    an id it cannot reach offline is one line naming it."""
    import datasets
    os.makedirs(tmp_path / "MATH-500" / "data")
    write_dapo(tmp_path / "MATH-500" / "data", "test-00000-of-00001.parquet")
    calls, real = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    folder = str(tmp_path / "MATH-500")
    assert [r["answer"] for r in load_rows("math", f"hf:{folder}:test", 0)] == ["34", "4"]
    assert calls == [((folder,), {"split": "test"})]
    with pytest.raises(ValueError) as e:
        load_rows("math", "hf:someone/sets:main:test", 0)
    assert str(e.value).startswith("hf:someone/sets:main:test: cannot read it (") and "\n" not in str(e.value)
    assert calls[-1] == (("someone/sets", "main"), {"split": "test"})
    with pytest.raises(ValueError):
        load_rows("math", "hf:someone/sets", 0)
    assert calls[-1] == (("someone/sets",), {"split": "train"})


def test_hf_specs_read_as_the_help_says(tmp_path, monkeypatch, capsys):
    """--data's help: hf:ID (split train), hf:ID:SPLIT, hf:ID:CONFIG:SPLIT. Two parts name a split,
    never a config (hf:openai/gsm8k:main asks for split "main", and its error line shows the
    three-part form); other forms are bad input before any work. A folder saved by save_to_disk
    reads through load_from_disk: a DatasetDict by its split, a single Dataset whole."""
    import datasets
    assert gmts.hf_spec("hf:openai/gsm8k") == ("openai/gsm8k", None, None)
    assert gmts.hf_spec("hf:H4/MATH-500:test") == ("H4/MATH-500", None, "test")
    assert gmts.hf_spec("hf:openai/gsm8k:main:train") == ("openai/gsm8k", "main", "train")
    for bad in ("hf:", "hf:a::b", "hf:a:b:", "hf:a:b:c:d"):
        with pytest.raises(gmts.BadInput, match="hf:ID, hf:ID:SPLIT or hf:ID:CONFIG:SPLIT"):
            gmts.hf_spec(bad)
    calls = []

    def fake(*a, **k):  # the hub as load_dataset sees it: one set with two configs
        calls.append((a, k))
        if a[1:] != ("main",):
            raise ValueError("Config name is missing. Please pick one among the configs: ['main']")
        return datasets.Dataset.from_list([{"question": "q", "answer": "1 #### 5"}])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_rows("math", "hf:openai/gsm8k:main:test", 0)[0]["answer"] == "5"
    assert calls[-1] == (("openai/gsm8k", "main"), {"split": "test"})
    with pytest.raises(ValueError) as e:
        load_rows("math", "hf:openai/gsm8k:main", 0)
    assert calls[-1] == (("openai/gsm8k",), {"split": "main"})
    assert "a config: hf:openai/gsm8k:main:train" in str(e.value) and "\n" not in str(e.value)
    # bad forms are refused by check_config, with the one line and exit 2, before any work
    for argv in (["--task", "math", "--data", "hf:a:b:c:d"], ["--eval-data", "x=hf:a::b"]):
        with pytest.raises(SystemExit) as e:
            gmts.main(argv + ["--out", str(tmp_path / "never")])
        assert e.value.code == 2 and "hf:ID:CONFIG:SPLIT" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    # folders saved by save_to_disk (load_from_disk, not the fake load_dataset)
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    whole, splits = str(tmp_path / "whole"), str(tmp_path / "splits")
    datasets.Dataset.from_list(rows).save_to_disk(whole)
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows),
                         test=datasets.Dataset.from_list(rows[:1])).save_to_disk(splits)
    n = len(calls)
    assert [r["answer"] for r in load_rows("math", f"hf:{whole}", 0)] == ["0", "1", "2"]
    assert [r["answer"] for r in load_rows("math", f"hf:{splits}", 0)] == ["0", "1", "2"]
    assert [r["answer"] for r in load_rows("math", f"hf:{splits}:test", 0)] == ["0"]
    assert len(calls) == n
    for spec, words in ((f"hf:{whole}:test", "no splits"),
                        (f"hf:{splits}:dev", "holds the splits train, test")):
        with pytest.raises(gmts.BadInput, match=words):
            load_rows("math", spec, 0)


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_good_files(tmp_path):
    """Each task's rows read back as written (a blank line is no row); math golds as GSM8K or latex rows; logic
    puzzles of different people each keep their own solution (datasets reads them into one column)."""
    p = write(tmp_path, "cd.jsonl", ['{"nums": [3, 5, 2], "target": 16}', "", '{"nums": [1, 2], "target": 3}'])
    assert load_rows("countdown", p, 0, 0) == [{"nums": [3, 5, 2], "target": 16}, {"nums": [1, 2], "target": 3}]
    assert len(load_rows("countdown", p, 1, 0)) == 1
    p = write(tmp_path, "m.jsonl", [json.dumps({"question": "q1", "answer": "He has 2<<1+1=2>> apples\n#### 1,450"}),
                                     json.dumps({"question": "q2", "answer": 72})])
    rows = load_rows("math", p, 0, 0)
    assert [r["answer"] for r in rows] == ["1450", "72"] and rows[0]["steps"] == ["He has 2 apples"]
    assert get_task("math")["reward"]("<answer>\\boxed{1,450}</answer>", rows[0]) == 1.0
    puzzles = [logic_problem(random.Random(s)) for s in range(20)]
    assert len({tuple(p["names"]) for p in puzzles}) > 5
    p = write(tmp_path, "l.jsonl", [json.dumps(lg) for lg in puzzles])
    read = load_rows("logic", p, 0, 0)
    assert read == puzzles
    for row in read:
        said = ", ".join(f"{k}: {'knight' if v else 'knave'}" for k, v in row["solution"].items())
        assert get_task("logic")["reward"](A(said), row) == 1.0


@pytest.mark.parametrize("task,lines,where,what", [
    ("countdown", ['{"nums": [1, 2], "target": 3}', '{"nums": [1, 2]}'], "row 2", '"target"'),
    ("countdown", ["[1, 2, 3]"], "row 1", '"nums"'),
    ("math", ['{"question": "q", "answer": "1"}', '{"answer": "3"}'], "row 2", "question"),
    ("math", ['{"question": "q"}'], "row 1", "answer"),
    ("math", ['{"problem": "p", "level": "Level 1"}'], "row 1", "answer"),
    ("math", ['{"question": "q", "answer": "1"}', '{"question": "q2", "answer": null}'], "row 2", "answer"),
    ("logic", ['{"names": ["A"], "statements": []}'], "row 1", '"solution"'),
], ids=["countdown target", "countdown not an object", "math question", "math answer", "math solution without a box",
        "math null answer", "logic solution"])
def test_jsonl_bad_files(tmp_path, task, lines, where, what):
    """A row missing its task's keys is refused in one ValueError line naming the file, the row and the key."""
    p = write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(ValueError) as e:
        load_rows(task, p, 10, 0)
    msg = str(e.value)
    assert f"{p} {where} has no " in msg and what in msg and "\n" not in msg, msg


def test_a_row_without_an_answer_names_where_it_looked(tmp_path):
    p = write(tmp_path, "bad.jsonl", ['{"question": "q"}'])
    with pytest.raises(ValueError) as e:
        load_rows("math", p, 0)
    looked = "looked for answer, Answer, final_answer, reward_model.ground_truth, solution's last \\boxed{}"
    assert looked in str(e.value)
    p = write(tmp_path, "bad2.jsonl", ['{"answer": "q"}'])
    with pytest.raises(ValueError, match=r"\(looked for question, problem, Question, prompt\)"):
        load_rows("math", p, 0)


def test_missing_file():
    with pytest.raises(ValueError, match="nope.jsonl: cannot read"):
        load_rows("countdown", "nope.jsonl", 10, 0)


def test_a_file_that_is_not_data_is_one_line(tmp_path):
    """Not a data file by its name, a line that is not JSON, an empty file: one ValueError line naming the file."""
    cases = [write(tmp_path, "rows.txt", ['{"nums": [1, 2], "target": 3}']),
             write(tmp_path, "broken.jsonl", ['{"nums": [1, 2], "target": 3}', "", "{not json"]),
             write(tmp_path, "empty.jsonl", [""])]
    for path in cases:
        with pytest.raises(ValueError) as e:
            load_rows("countdown", path, 0)
        assert path in str(e.value) and "\n" not in str(e.value), str(e.value)


# ==== code: the last ```python block, the layouts, the generator (test_sandbox.py: the sandbox) ===

def py(code):
    return f"My solution:\n```python\n{code}\n```\nDone."


CODE_BLOCKS = {  # completion -> the code graded (None: no closed ```python block, reward 0)
    "```python\nx = 1\n```": "x = 1\n",
    "```py\nx = 1\n```": "x = 1\n",
    "``` Python3 \nx = 1\n```": "x = 1\n",
    "a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```\nc": "x = 2\n",  # the last one
    "```python\nx = 1\n```\n```text\nnot code\n```": "x = 1\n",  # the last python one
    "```python\nx = 1\n```\n```python\nx = 2": "x = 1\n",  # an unclosed block is not one
    "```python\ns = '```'\n```": "s = '```'\n",  # a fence closes at a line's start only
    "```python\n```": "",
    "```python x = 1 ```": None,
    "```\nx = 1\n```": None,
    "```python\nx = 1": None,
    "x = 1": None,
    BIG + "```python\nx = 1\n```": "x = 1\n",
}


@pytest.mark.parametrize("text", CODE_BLOCKS, ids=range(len(CODE_BLOCKS)))
def test_the_last_closed_python_block_is_the_program(text):
    assert gmts.last_code_block(text) == CODE_BLOCKS[text]


def test_finding_the_block_is_linear_in_the_text():
    for text in ("```python\n" * 300_000, "```" * 1_000_000, "\n```" * 1_000_000,
                 "```python\nx\n```\n" * 200_000):
        t = time.perf_counter()
        gmts.last_code_block(text)
        assert time.perf_counter() - t < SLOW


def _drop_last_line(code: str) -> str:
    lines = code.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]) + "\n"


CODE_FILES = {  # testdata file -> its published reference solution of a row
    "humaneval_layout.jsonl": lambda r: r["prompt"] + r["canonical_solution"],
    "mbpp_layout.jsonl": lambda r: r["code"].replace("\r\n", "\n"),
    "apps_layout.jsonl": lambda r: json.loads(r["solutions"])[0],
    "code_contests_layout.jsonl": lambda r: r["solutions"]["solution"][0],
}


@pytest.mark.parametrize("name", CODE_FILES)
def test_each_code_layout_loads_and_its_references_earn_1_and_altered_ones_0(name):
    """Each published layout reads without flags; every row's reference solution earns 1.0 through
    the reward a run uses; the same solution without its last line earns 0 (APPS row 1 then prints
    two of its three lines: the zip trap), and so does the next row's solution."""
    path = os.path.join(TESTDATA, name)
    raw = [json.loads(line) for line in open(path)]
    rows = load_rows("code", path, 0)
    refs = [CODE_FILES[name](r) for r in raw]
    rewards = TASKS["code"]["rewards"]
    assert rewards([py(c) for c in refs], rows) == [1.0] * len(rows)
    assert rewards([py(_drop_last_line(c)) for c in refs], rows) == [0.0] * len(rows)
    assert rewards([py(c) for c in refs[1:] + refs[:1]], rows) == [0.0] * len(rows)
    for row in rows:
        shown = TASKS["code"]["prompt"](row).count("```python")
        assert row["question"] and shown == 1 + bool(row["starter"])


def test_the_layouts_read_what_their_graders_read():
    """HumanEval: its prompt is the setup and the starter, check(entry_point) the test; MBPP: the
    first assert in the question (the function's name is only there), setup code before, challenge
    tests not graded; APPS: a call-based row's arguments and value through _check_call, lists of
    lines joined, its import prelude; CodeContests: public and private tests, not generated ones."""
    he = load_rows("code", os.path.join(TESTDATA, "humaneval_layout.jsonl"), 1)[0]
    assert he["setup"].startswith("def count_vowels")
    assert he["tests"].endswith("check(count_vowels)\n")
    assert he["starter"] == he["setup"].strip("\n") and "count_vowels" in he["question"]
    mb = load_rows("code", os.path.join(TESTDATA, "mbpp_layout.jsonl"), 0)
    assert mb[0]["question"].endswith("assert second_largest([1, 5, 3, 5]) == 3")
    assert mb[2]["setup"] == "import math"
    assert "Spaced" not in mb[1]["tests"] and mb[1]["tests"].count("assert") == 3
    apps = load_rows("code", os.path.join(TESTDATA, "apps_layout.jsonl"), 0)
    assert apps[2]["inputs"] == ["4\n", "1\n"]
    assert apps[2]["outputs"][0] == "1\n1 1\n1 2 1\n1 3 3 1\n"
    assert apps[3]["inputs"] is None
    assert apps[3]["tests"].startswith("_check_call('maxProfit', [[7, 1, 5")
    assert all(r["prelude"] == gmts.APPS_PRELUDE for r in apps)
    assert apps[3]["starter"].startswith("class Solution")
    cc = load_rows("code", os.path.join(TESTDATA, "code_contests_layout.jsonl"), 0)
    assert cc[0]["inputs"] == ["8\n", "2\n", "3\n", "100\n"] and cc[0]["prelude"] == ""
    assert cc[0]["question"].startswith("Given n, print YES")
    incorrect = [json.loads(line)["incorrect_solutions"]["solution"][0]
                 for line in open(os.path.join(TESTDATA, "code_contests_layout.jsonl"))]
    assert TASKS["code"]["rewards"]([py(c) for c in incorrect], cc) == [0.0, 0.0]


def test_our_code_layout_round_trips_generated_rows(tmp_path):
    rows = load_rows("code", "gen", 20, 3)
    read = load_rows("code", _jsonl(tmp_path / "ours.jsonl", rows), 0)
    assert [{k: r[k] for k in rows[0]} for r in read] == rows
    assert TASKS["code"]["rewards"]([py(r["solution"]) for r in read], read) == [1.0] * 20


ONE_OUTPUT_SHORT = json.dumps({"inputs": ["1"], "outputs": []})
BAD_CODE_ROWS = {  # a row -> what the one line says of it
    "no tests": ({"question": "q"}, "has no tests in a layout we read (ours (generated): "),
    "tests not python": ({"question": "q", "tests": "assert f(1) =="},
                         "its tests are not Python (SyntaxError)"),
    "no question": ({"tests": "assert f(1) == 1"}, "has no question"),
    "empty input_output": ({"question": "q", "input_output": ""},
                           "its tests need as many outputs as inputs, at least one"),
    "input_output not json": ({"question": "q", "input_output": "{not json"},
                              "its input_output is not JSON"),
    "an input without its output": ({"question": "q", "input_output": ONE_OUTPUT_SHORT},
                                    "as many outputs as inputs"),
    "humaneval test not python": ({"prompt": "def f():", "test": "def check(c):\n  assert",
                                   "entry_point": "f"}, "not Python"),
}


@pytest.mark.parametrize("case", BAD_CODE_ROWS)
def test_a_code_row_that_cannot_be_graded_is_bad_input(tmp_path, case):
    row, what = BAD_CODE_ROWS[case]
    p = write(tmp_path, "bad.jsonl", [json.dumps(row)])
    with pytest.raises(gmts.BadInput) as e:
        load_rows("code", p, 0)
    msg = str(e.value)
    assert f"{p} row 1" in msg and what in msg and "\n" not in msg, msg


def test_code_prompts_are_the_paper_s_and_have_no_frame_of_ours(tiny_model):
    """The paper's words, the starter code where a row has one; no system line and no <think>
    prefill whatever --prompt-style says (the model's default system prompt, as the paper);
    short: the question alone."""
    row = load_rows("code", "easy", 1, 0)[0]
    text = TASKS["code"]["prompt"](row)
    paper = "Please provide a self-contained Python script that solves the following problem:\n"
    assert text.startswith(paper) and row["question"] in text
    assert "markdown code block" in text and "starter" not in text
    assert TASKS["code"]["prompt"](row, short=True) == row["question"]
    starter = TASKS["code"]["prompt"](dict(row, starter="class Solution:\n    def f(self):"))
    assert "You will use the following starter code" in starter
    assert "```python\nclass Solution:" in starter
    _, tok = tiny_model
    for style in ("ours", "qwen-math"):
        for chat in (True, False):
            p = gmts.build_prompts(tok, TASKS["code"], [row], chat, False, style)[0]
            assert "<think>" not in p and text in p
            assert gmts.SYSTEM_PROMPT not in p and gmts.QWEN_MATH_SYSTEM not in p


def test_code_problems_say_their_operation_in_a_word_and_their_asserts_tell_every_one_apart():
    """Each problem's word before its constant names one operation and no other word of it does;
    the asserts' arguments give every operation another value, so a solution passes iff its
    operation is the row's; easy draws + - * only, gen all four."""
    for data, ops in (("easy", {"+", "-", "*"}), ("gen", set(gmts._CODE_WORDS))):
        rows = load_rows("code", data, 300, 0)
        assert {r["op"] for r in rows} == ops
        for r in rows:
            said = [o for o, word in gmts._CODE_WORDS.items() if word in r["question"]]
            assert said == [r["op"]] and f" {r['word']} {r['k']}." in r["question"], r
            cases = re.findall(r"assert \w+\((\d+)\) == (-?\d+)", r["tests"])
            assert len(cases) == 3 and len({a for a, _ in cases}) == 3
            for a, v in cases:
                values = [gmts.eval_op(o, int(a), r["k"]) for o in gmts._CODE_WORDS]
                assert gmts.eval_op(r["op"], int(a), r["k"]) == int(v)
                assert values.count(int(v)) == 1
    rows = load_rows("code", "gen", 40, 1)
    wrong = [dict(r, solution=r["solution"].replace(f" {r['op']} ", f" {o} "))
             for r in rows for o in gmts._CODE_WORDS if o != r["op"]]
    got = TASKS["code"]["rewards"]([py(r["solution"]) for r in rows + wrong], rows + wrong)
    assert got == [1.0] * len(rows) + [0.0] * len(wrong)


# ==== generators and draws: generated problems, held-out rows, --data-order epoch ====================================


def test_countdown_problems_are_solvable():
    rng = random.Random(0)
    for _ in range(200):
        p = countdown_problem(rng)
        assert len(p["nums"]) in (3, 4) and all(1 <= x <= 99 for x in p["nums"]) and 1 <= p["target"] <= 1000
        assert countdown_reward(A(p["expr"]), p["nums"], p["target"]) == 1.0
    rows = load_rows("countdown", "easy", 2000, seed=0)  # the CPU demo's variant
    for p in rows:
        assert len(p["nums"]) == 3 and all(1 <= x <= 9 for x in p["nums"]) and 0 <= p["target"] <= 27
        assert re.fullmatch(r"\d [+-] \d [+-] \d", p["expr"])
        assert [int(x) for x in re.findall(r"[0-9]+", p["expr"])] == p["nums"]  # listed in the reference's order
        assert countdown_reward(A(p["expr"]), p["nums"], p["target"]) == 1.0
    patterns = collections.Counter(re.sub(r"[\d ]", "", p["expr"]) for p in rows)
    assert all(abs(patterns[s] / len(rows) - 0.25) < 0.03 for s in ("++", "+-", "-+", "--")), patterns
    for s in ("++", "+-", "-+", "--"):  # a fixed guess of the signs is right for about 1 problem in 4
        guess = [countdown_reward(A(f"{a} {s[0]} {b} {s[1]} {c}"), p["nums"], p["target"])
                 for p in rows for a, b, c in [p["nums"]]]
        assert 0.2 < guess.count(1.0) / len(rows) < 0.32


def _claim(body, names, me):
    """Independent reading of a rendered statement: English -> function(world) -> bool."""
    atom = r"(I am|[A-Z][a-z]+ is) a (knight|knave)"

    def at(subject, role):
        who = me if subject == "I am" else names.index(subject[:-3])
        return lambda w: w[who] == (role == "knight")
    subjects = re.findall(atom, body)
    assert len({s for s, _ in subjects}) == len(subjects), body  # a claim never names one person twice
    assert subjects != [("I am", "knight")] and subjects != [("I am", "knave")], body
    if m := re.fullmatch(rf"It is not the case that {atom}", body):
        f = at(*m.groups())
        return lambda w: not f(w)
    if m := re.fullmatch(rf"If {atom} then {atom}", body):
        f, g = at(*m.groups()[:2]), at(*m.groups()[2:])
        return lambda w: not f(w) or g(w)
    if m := re.fullmatch(rf"{atom} (and|or) {atom}", body):
        f, g = at(*m.groups()[:2]), at(*m.groups()[3:])
        return (lambda w: f(w) and g(w)) if m[3] == "and" else (lambda w: f(w) or g(w))
    m = re.fullmatch(atom, body)
    assert m, body
    return at(*m.groups())


def test_logic_puzzles_have_exactly_one_solution():
    rng = random.Random(0)
    sizes = set()
    for _ in range(200):
        p = logic_problem(rng)
        names = p["names"]
        sizes.add(len(names))
        claims = []
        for i, s in enumerate(p["statements"]):
            m = re.fullmatch(r'(\w+) says: "(.*)\."', s)
            assert m and m[1] == names[i], s
            claims.append(_claim(m[2], names, i))
        worlds = [w for w in itertools.product([True, False], repeat=len(names))
                  if all(c(w) == w[i] for i, c in enumerate(claims))]
        assert worlds == [tuple(p["solution"][n] for n in names)]
    assert sizes == {2, 3, 4, 5, 6}
    assert {len(p["names"]) for p in load_rows("logic", "easy", 50, 0)} == {2}


def test_math_problems():
    """math gen and easy are both math_easy_problem: one step a op b on 2..9 with a >= b, worked right, the words
    alone telling the operation (each of + - * drawn), both numbers shown, a first."""
    ops = collections.Counter()
    rows = load_rows("math", "gen", 300, seed=0)
    assert rows == load_rows("math", "easy", 300, seed=0)
    rng = random.Random(0)
    assert rows == [math_easy_problem(rng) for _ in range(300)]
    for p in rows:
        assert len(p["steps"]) == 1
        a, op, b, eq, c = p["steps"][0].split()
        a, b, c = int(a), int(b), int(c)
        assert eq == "=" and 9 >= a >= b >= 2 and {"+": a + b, "-": a - b, "*": a * b}[op] == c
        assert p["answer"] == str(c) and c >= 0
        assert op == ("-" if " left?" in p["question"] else "*" if " in all?" in p["question"] else "+")
        assert re.search(rf" {a} .* {b}\b", p["question"])
        ops[op] += 1
    assert set(ops) == {"+", "-", "*"}


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("data", ["gen", "easy"])
def test_generators_are_deterministic_and_prompts_ask_for_the_format(task, data):
    t = get_task(task)
    rows = load_rows(task, data, 200, 1)
    assert rows == load_rows(task, data, 200, 1)
    assert rows != load_rows(task, data, 200, 2)
    for row in rows:
        assert t["reward"]("no answer here", row) == 0.0
        for short in (False, True):
            assert isinstance(t["prompt"](row, short=short), str)
        if task == "code":
            assert "```python" in t["prompt"](row)
        else:
            assert "<answer>" in t["prompt"](row) and "<think>" in t["prompt"](row)


def test_held_out_rows_and_lazy_draws(tmp_path, monkeypatch):
    """The first eval_size rows are held out whatever --steps is; training rows are drawn lazily per (seed, step,
    resample) and never repeat a held-out prompt; nothing is built up front, even for --steps 10**20. From a file:
    distinct rows per draw, none a duplicate of a held-out prompt."""
    task = get_task("countdown")
    made, gen = [], gmts._GEN["countdown"]
    monkeypatch.setitem(gmts._GEN, "countdown", lambda r, easy: made.append(1) or gen(r, easy))
    splits = [gmts.read_data(gmts.Config(data="easy", steps=n, prompts_per_step=32, eval_size=256))
              for n in (1, 60, 10 ** 20)]
    assert len(made) == 3 * 256  # only the held-out rows
    held = splits[0].held
    assert len(held) == 256 and all(s.held == held for s in splits)
    seen = {task["prompt"](r) for r in held}
    draw = splits[0].draw
    for d in (s.draw for s in splits):
        for key in [(1, 0), (2, 0), (2, 1), (59, 0)]:
            rows = d(32, *key)
            assert len(rows) == 32 and not seen & {task["prompt"](r) for r in rows}
            assert rows == draw(32, *key)  # a function of (seed, step, resample), not of --steps
    assert draw(32, 1, 0) != draw(32, 1, 1) and draw(32, 1, 0) != draw(32, 2, 0)
    assert gmts.read_data(gmts.Config(data="easy", eval_size=256, seed=1)).draw(32, 1, 0) != draw(32, 1, 0)
    rows = [{"nums": [i, 1], "target": i + 1} for i in range(6)]
    rows[3] = dict(rows[0])  # a duplicate of a held-out prompt
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = gmts.read_data(gmts.Config(data=str(path), eval_size=2, prompts_per_step=3))
    draw, held = data.draw, data.held
    assert held == rows[:2]
    assert all(sorted(r["nums"][0] for r in draw(3, step, 0)) == [2, 4, 5] for step in range(20))  # no repeats
    assert [draw(2, step, 0) for step in range(5)] == [draw(2, step, 0) for step in range(5)]


def _math_file(path, n):
    """n trivial math rows, each its own question and gold."""
    path.write_text("".join(json.dumps({"problem": f"What is {i} + 0?", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def test_data_order_epoch_draws_each_row_once_per_pass(tmp_path):
    """--preset paper-math's numbers: 12,000 training rows (a benchmark evaluated instead of held-out rows, as the
    preset's), 64 a step. One pass is 188 draws, 187 of 64 and a last one of the 32 left; together every row exactly
    once, in a shuffled order. The next pass is a new shuffle, again every row once; the rows drawn so far
    (Data.order, what a checkpoint stores) continue a fresh read exactly."""
    bench = os.path.join(TESTDATA, "math500.jsonl")
    cfg = gmts.Config(**dict(gmts.PRESETS["paper-math"], data=_math_file(tmp_path / "rows.jsonl", 12_000),
                             eval_data=f"math500={bench}"))
    gmts.check_config(cfg)
    assert (cfg.data_order, cfg.prompts_per_step, cfg.steps) == ("epoch", 64, 188)
    data = gmts.read_data(cfg)
    assert list(data.held) == ["math500"] and data.order == {"drawn": 0}
    passes = []
    for first in (1, 189):
        drawn = [data.draw(64, step, 0) for step in range(first, first + 188)]
        assert [len(d) for d in drawn] == [64] * 187 + [32]
        order = [int(r["answer"]) for d in drawn for r in d]
        assert sorted(order) == list(range(12_000))  # each row exactly once
        passes.append(order)
    assert data.order == {"drawn": 24_000}
    assert passes[0] != list(range(12_000)) and passes[1] != passes[0]  # shuffled, and anew each pass
    again = gmts.read_data(cfg)
    again.order["drawn"] = 6_400  # as a resume from step 100's checkpoint sets it
    assert [int(r["answer"]) for r in again.draw(64, 101, 0)] == passes[0][6_400:6_464]


def test_data_order_epoch_by_hand(tmp_path):
    """10 rows, 4 a draw: 4, 4, the 2 left, then the next pass: 4, 4, 2; no draw crosses a pass."""
    cfg = gmts.Config(task="math", data=_math_file(tmp_path / "r.jsonl", 10), data_order="epoch", eval_size=0,
                      prompts_per_step=4)
    data = gmts.read_data(cfg)
    drawn = [[int(r["answer"]) for r in data.draw(4, step, 0)] for step in range(1, 7)]
    assert [len(d) for d in drawn] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(drawn[:3], [])) == sorted(sum(drawn[3:], [])) == list(range(10))
    assert data.order == {"drawn": 20}


@pytest.mark.parametrize("order", ["draw", "epoch"])
def test_fewer_training_rows_than_prompts_per_step_are_refused(tmp_path, order):
    """5 rows, 2 held out: 3 training rows cannot fill a step of 4 prompts: one ValueError line that says so."""
    path = _math_file(tmp_path / "few.jsonl", 5)
    cfg = gmts.Config(task="math", data=path, data_order=order, eval_size=2, prompts_per_step=4)
    with pytest.raises(ValueError) as e:
        gmts.read_data(cfg)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and "3 training rows" in msg and "--prompts-per-step 4" in msg, msg
    assert len(gmts.read_data(dataclasses.replace(cfg, prompts_per_step=3)).draw(3, 1, 0)) == 3


# ==== prompt styles and benchmark scores =============================================================================
@pytest.fixture(scope="module")
def tiny_model():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


def test_the_prompt_styles(tiny_model):
    """ours (the default: system line, the task's <think>/<answer> format, the prefill) and qwen-math (the GMTS
    authors' system line, the bare question, an empty assistant turn), in the chat template and without it."""
    _, tok = tiny_model
    task = get_task("math")
    row = {"question": "What is $1+1$?", "answer": "2", "latex": True}
    qwen = gmts.build_prompts(tok, task, [row], True, style="qwen-math")[0]
    assert qwen == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                    "<|im_end|>\n<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n")
    assert gmts.build_prompts(tok, task, [row], False, style="qwen-math")[0] == (
        "Please reason step by step, and put your final answer within \\boxed{}.\nUser: What is $1+1$?\nAssistant:")
    ours = gmts.build_prompts(tok, task, [row], True)[0]
    assert ours.endswith(gmts.ASSISTANT_PREFIX) and "<answer>" in ours and gmts.SYSTEM_PROMPT in ours
    assert ours == gmts.build_prompts(tok, task, [row], True, style="ours")[0]
    assert set(gmts.PROMPT_STYLES) - {"own"} == {"ours", "qwen-math"}


def test_avg_at_k_is_the_mean_over_k_sampled_answers(tiny_model):
    """evaluate(samples=k) against a slow reference: the same k answers per problem (one rollout, seeded alike), each
    scored by the task's reward, averaged; greedy (samples 0) is one greedy answer a problem."""
    model, tok = tiny_model
    task = dict(get_task("countdown"), reward=lambda text, row: float(sum(map(ord, text)) % 2))
    rows = load_rows("countdown", "easy", 3, 0)
    torch.manual_seed(0)
    got = gmts.evaluate(model, tok, task, rows, True, True, 6, samples=4, temperature=1.0, top_p=1.0)
    torch.manual_seed(0)
    b = gmts.rollout(model, tok, gmts.build_prompts(tok, task, rows, True, True), 4, 6, 1.0, 1.0)
    want = [task["reward"](t, rows[i // 4]) for i, t in enumerate(b["texts"])]
    assert got["eval_acc"] == sum(want) / 12 and got["eval_len"] == float(b["resp_mask"].sum()) / 12
    assert 0 < sum(want) < 12  # the reference is not degenerate
    greedy = gmts.rollout(model, tok, gmts.build_prompts(tok, task, rows, True, True), 1, 6, greedy=True)
    assert gmts.evaluate(model, tok, task, rows, True, True, 6)["eval_acc"] == \
        sum(task["reward"](t, r) for t, r in zip(greedy["texts"], rows)) / 3


def test_a_run_logs_each_benchmark_and_their_mean(monkeypatch):
    """evaluate_run: eval_NAME per --eval-data set, eval_acc and eval_len their means (hand values); held-out rows:
    eval_acc alone."""
    by_rows = {"a": dict(eval_acc=0.5, eval_len=10.0, eval_sample="x"),
               "b": dict(eval_acc=0.25, eval_len=4.0, eval_sample="y")}
    monkeypatch.setattr(gmts, "evaluate", lambda model, tok, task, rows, *a, **k: dict(by_rows[rows[0]]))
    run = types.SimpleNamespace(model=None, tok=None, task=None, chat=True,
                                data=types.SimpleNamespace(held={"aime24": ["a"], "math500": ["b"]}))
    cfg = gmts.Config(eval_samples=16)
    assert gmts.evaluate_run(run, cfg) == dict(eval_aime24=0.5, eval_math500=0.25, eval_acc=0.375, eval_len=7.0,
                                               eval_sample="x")
    run.data.held = ["b"]  # held-out rows
    assert gmts.evaluate_run(run, cfg) == dict(eval_acc=0.25, eval_len=4.0, eval_sample="y")



# ==== commonsense: the option the last \boxed{} names, the three layouts, the generator ========
CS_ROW = {"question": "Which of these is an animal?",
          "choices": {"label": ["A", "B", "C"], "text": ["chair", "dog", "cup"]},
          "answerKey": "B"}
CS_CASES = {  # (completion, expected) against CS_ROW: key B, "dog"
    "the letter": (box("B"), 1.0),
    "the letter in our format": (A("\\boxed{B}"), 1.0),
    "the letter, lower case": (box("b"), 1.0),
    "(B)": (box("(B)"), 1.0),
    "B.": (box("B."), 1.0),
    "B)": (box("B)"), 1.0),
    "B:": (box("B:"), 1.0),
    "the letter in \\text{}": (box("\\text{B}"), 1.0),
    "the letter with its text": (box("B. dog"), 1.0),
    "(B) with its text": (box("(B) Dog"), 1.0),
    "the text alone": (box("dog"), 1.0),
    "the text alone, spaced and capitalised": (box(" \\text{ Dog. } "), 1.0),
    "reasoning before the box": ("A chair is furniture and a cup a dish, so \\boxed{B}", 1.0),
    "an earlier wrong box, the last right": (box("A") + " no, wait: " + box("B"), 1.0),
    "a box in a box: the inner one is the last": ("\\boxed{\\boxed{B}}", 1.0),
    "a wrong letter": (box("A"), 0.0),
    "a wrong text": (box("cup"), 0.0),
    "no box": ("The answer is B.", 0.0),
    "our tags without a box": (A("B"), 0.0),
    "an empty box": (box(""), 0.0),
    "two letters": (box("A, B"), 0.0),
    "two letters, the key first": (box("B, C"), 0.0),
    "all letters": (box("ABC"), 0.0),
    "B or C": (box("B or C"), 0.0),
    "two options with their texts": (box("B. dog C. cup"), 0.0),
    "every option's text": (box("chair, dog, cup"), 0.0),
    "the key's label with another option's text": (box("B. cup"), 0.0),
    "another label with the key's text": (box("A. dog"), 0.0),
    "the key in a sentence": (box("I think B"), 0.0),
    "an unclosed box": ("so \\boxed{B", 0.0),
    "a right box, then an unclosed last one": (box("B") + " or \\boxed{B", 0.0),
    "a right box, then a wrong last one": (box("B") + box("C"), 0.0),
}
CS_REWARD = TASKS["commonsense"]["reward"]  # (completion, row) -> float, as a run grades


@pytest.mark.parametrize("text,want", CS_CASES.values(), ids=CS_CASES)
def test_commonsense_pays_1_iff_the_last_box_names_the_key_alone(text, want):
    assert timed(gmts.commonsense_reward, text, CS_ROW["choices"], "B") == want
    assert CS_REWARD(text, CS_ROW) == want


def test_a_text_two_options_share_names_neither():
    row = {"question": "q", "answerKey": "A",
           "choices": {"label": ["A", "B", "C"], "text": ["bank", "Bank", "shop"]}}
    assert CS_REWARD(box("bank"), row) == 0.0
    assert CS_REWARD(box("A"), row) == CS_REWARD(box("A. bank"), row) == 1.0


CS_FRAGMENTS = ["\\boxed{", "{", "}", "\\text{", "(", ")", ".", ":", ",", " ", "\n", "$", "A", "B",
                "C", "b", "dog", "cup", "chair", " or ", "<answer>", "</answer>", "\\", "\u0663"]
cs_adversarial = st.builds(lambda parts, k: "".join(parts) * k,
                           st.lists(st.sampled_from(CS_FRAGMENTS) | st.text(max_size=4),
                                    max_size=40),
                           st.integers(1, 2000))
CS_KEY_FORMS = ({"b", "(b)", "b.", "b)", "b:", "dog"}
                | {f"{f} dog" for f in ("b", "(b)", "b.", "b)", "b:")})


@PROPS
@given(s=st.text(max_size=300) | cs_adversarial)
def test_commonsense_reward_never_raises_and_pays_only_the_key_s_forms(s):
    """On any text: 0.0 or 1.0 within SLOW seconds; 1.0 only where the last box, closed, is one of
    the key's forms."""
    got = timed(gmts.commonsense_reward, s, CS_ROW["choices"], "B")
    assert got in (0.0, 1.0)
    if got == 1.0:
        assert gmts._plain(gmts._last_boxed(s)) in CS_KEY_FORMS


def test_commonsense_reward_is_bounded_on_a_megabyte():
    for text in (BIG + box("B"), "\\boxed{" * 200_000, box("B" * 1_000_000),
                 "{" * 1_000_000 + box("B")):
        timed(gmts.commonsense_reward, text, CS_ROW["choices"], "B")
    assert timed(gmts.commonsense_reward, BIG + box("B"), CS_ROW["choices"], "B") == 1.0


def _testdata_rows(name):
    with open(os.path.join(TESTDATA, name)) as f:
        return [json.loads(line) for line in f]


def test_each_commonsense_layout_loads_from_its_published_shape():
    """testdata/'s three files, read by the path a run takes (load_rows): CommonsenseQA's published
    rows and its flat copy read alike; CSQA2's yes/no becomes options A. yes, B. no; each row's key
    earns 1.0 (as a letter, and as its text), every other label 0; the prompt lists the options."""
    names = ("commonsenseqa_layout.jsonl", "commonsenseqa_flat.jsonl", "csqa2_layout.jsonl")
    rows = {name: load_rows("commonsense", os.path.join(TESTDATA, name), 0) for name in names}
    published = [{"question": r["question"]["stem"], "answerKey": r["answerKey"],
                  "choices": {"label": [c["label"] for c in r["question"]["choices"]],
                              "text": [c["text"] for c in r["question"]["choices"]]}}
                 for r in _testdata_rows(names[0])]
    assert rows[names[0]] == rows[names[1]] == published
    assert {r["answerKey"] for r in published} == set("ABCDE")
    csqa2 = _testdata_rows(names[2])
    assert {r["answer"] for r in csqa2} == {"yes", "no"}
    assert [r["answerKey"] for r in rows[names[2]]] == ["AB"[r["answer"] == "no"] for r in csqa2]
    assert all(r["choices"] == {"label": ["A", "B"], "text": ["yes", "no"]} for r in rows[names[2]])
    for name, read in rows.items():
        assert len(read) == 6, name
        for row in read:
            labels, texts, key = row["choices"]["label"], row["choices"]["text"], row["answerKey"]
            assert CS_REWARD(A(f"\\boxed{{{key}}}"), row) == 1.0
            assert CS_REWARD(box(texts[labels.index(key)]), row) == 1.0
            others = [CS_REWARD(box(x), row) for x in labels if x != key]
            assert others == [0.0] * (len(labels) - 1)
            prompt = TASKS["commonsense"]["prompt"](row)
            assert all(f"\n{x}. {t}" in prompt for x, t in zip(labels, texts))


def test_a_csqa2_row_is_paid_for_yes_or_no_as_written():
    row = load_rows("commonsense", os.path.join(TESTDATA, "csqa2_layout.jsonl"), 1)[0]  # yes
    said = ("yes", "Yes.", "A", "A. yes", "no", "B", "yes or no", "A, B")
    assert [CS_REWARD(box(x), row) for x in said] == [1.0] * 4 + [0.0] * 4


PUBLISHED_CHOICES = [{"label": "A", "text": "x"}, {"label": "B", "text": "y"}]
FLAT_CHOICES = {"label": ["A", "B"], "text": ["x", "y"]}
BAD_CS_ROWS = {  # (row 2 of a file whose row 1 is good, what the line says)
    "published without a key": ({"question": {"stem": "q", "choices": PUBLISHED_CHOICES}},
                                '"answerKey" among its labels A, B'),
    "published choices not a list": ({"question": {"stem": "q", "choices": "A x B y"},
                                      "answerKey": "A"}, '"choices" of two or more'),
    "published without a stem": ({"question": {"choices": PUBLISHED_CHOICES}, "answerKey": "A"},
                                 '"question"'),
    "flat: fewer texts than labels": ({"question": "q", "answerKey": "A",
                                       "choices": {"label": ["A", "B"], "text": ["x"]}},
                                      '"choices"'),
    "flat: a label twice": ({"question": "q", "answerKey": "A",
                             "choices": {"label": ["A", "A"], "text": ["x", "y"]}}, '"choices"'),
    "flat: a key not a label": ({"question": "q", "choices": FLAT_CHOICES, "answerKey": "C"},
                                '"answerKey" among its labels A, B'),
    "csqa2: not yes or no": ({"question": "q", "answer": "maybe"},
                             '"answer" is \'maybe\', not "yes" or "no"'),
    "csqa2: an empty question": ({"question": "", "answer": "yes"}, '"question"'),
    "no question": ({"stem": "q", "answerKey": "A"}, '"question"'),
}


@pytest.mark.parametrize("row,what", BAD_CS_ROWS.values(), ids=BAD_CS_ROWS)
def test_a_commonsense_row_of_the_wrong_shape_is_refused_naming_file_and_row(tmp_path, row, what):
    """One BadInput line naming the file, the row and what it lacks; the row before it was fine."""
    layout = ("csqa2_layout.jsonl" if "answer" in row else "commonsenseqa_layout.jsonl"
              if isinstance(row.get("question"), dict) else "commonsenseqa_flat.jsonl")
    p = _jsonl(tmp_path / "bad.jsonl", [_testdata_rows(layout)[0], row])
    with pytest.raises(gmts.BadInput) as e:
        load_rows("commonsense", p, 0)
    msg = str(e.value)
    assert msg.startswith(f"{p} row 2 has no ") or msg.startswith(f"{p} row 2: "), msg
    assert what in msg and "\n" not in msg, msg


@pytest.mark.parametrize("data,n", [("easy", 3), ("gen", 5)])
def test_generated_commonsense_rows_are_well_formed_and_the_key_is_uniform(data, n):
    """Each row: n options of n different kinds, exactly one of the asked kind, and it is the key;
    the key's label is uniform (3000 rows: each count within 5 SD of 3000 / n); reading the options
    without the question (always the option of one preferred kind) is right about 1 time in n, as a
    guess."""
    rows = load_rows("commonsense", data, 3000, seed=0)
    assert rows == load_rows("commonsense", data, 3000, seed=0)
    assert rows != load_rows("commonsense", data, 3000, seed=1)
    kind_of = {w: k for k, words in gmts.KINDS.items() for w in words}
    assert len(kind_of) == sum(map(len, gmts.KINDS.values()))  # no word in two kinds
    assert len({w[0] for w in kind_of}) == len(kind_of)  # a word's first letter names it
    keys, preferred, order = collections.Counter(), 0, sorted(gmts.KINDS)
    for row in rows:
        labels, texts = row["choices"]["label"], row["choices"]["text"]
        assert labels == list("ABCDE"[:n]) and len({kind_of[t] for t in texts}) == n
        asked = [t for t in texts if row["question"] == f"Which of these is {kind_of[t]}?"]
        assert len(asked) == 1 and labels[texts.index(asked[0])] == row["answerKey"]
        assert gmts._check_row(row, "commonsense") == row  # a generated row is in the flat layout
        keys[row["answerKey"]] += 1
        preferred += min(texts, key=lambda t: order.index(kind_of[t])) == asked[0]
    sd = math.sqrt(3000 * (1 / n) * (1 - 1 / n))
    assert set(keys) == set(labels) and all(abs(c - 3000 / n) < 5 * sd for c in keys.values())
    assert abs(preferred - 3000 / n) < 5 * sd, preferred


def test_commonsense_prompts_in_both_styles(tiny_model):
    """ours (the default): the options, then our <think>/<answer> format asking for the letter in
    a \\boxed{}; qwen-math (the paper's template): its system line, the question, its options."""
    _, tok = tiny_model
    task = get_task("commonsense")
    question = "Which of these is an animal?\nA. chair\nB. dog\nC. cup"
    assert gmts.commonsense_question(CS_ROW) == task["prompt"](CS_ROW, short=True) == question
    assert gmts.build_prompts(tok, task, [CS_ROW], True, style="qwen-math")[0] == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        f"\\boxed{{}}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    ours = gmts.build_prompts(tok, task, [CS_ROW], True)[0]
    assert f"{question}\n{gmts._FORMAT}, with the letter of your choice inside \\boxed{{}}." in ours
    assert ours.endswith(gmts.ASSISTANT_PREFIX) and gmts.Config().prompt_style == "ours"
    gmts.check_config(gmts.Config(task="commonsense", prompt_style="qwen-math"))
    with pytest.raises(ValueError, match="--task math or commonsense only"):
        gmts.check_config(gmts.Config(task="logic", prompt_style="qwen-math"))
