"""Tests for gmts.py, in the order of its sections. Offline, CPU:  python -m pytest -q

Every hand-derived formula is checked against autograd or a slow reference loop (micrograd style).
"""
import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="gmts-hf-"))

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import ast
import collections
import gc
import importlib.util
import inspect
import itertools
import random
import re
import time
from fractions import Fraction

from hypothesis import HealthCheck, given, settings, strategies as st

from gmts import (TASKS, countdown_problem, countdown_reward, get_task, load_rows, logic_problem, logic_reward,
                  math_problem, math_reward, _CD_CHARS, _DEC, _FRAC, _NUM_TOKEN)

import gmts
from gmts import (completion_mask, group_advantages, omega, select_tokens, spearman, token_scores, token_stats)

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- tasks and verifiers ---------------------------------------------------------------------------------------
# Verifiers must be right on the table cases, never raise and stay under 100 ms per call on anything
# (hypothesis feeds them > 10,000 adversarial inputs).

FAST = 0.1  # seconds: the bound on every verifier call
PROPS = settings(max_examples=3400, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def timed(fn, *args):
    """Call a verifier, check it returns a float within FAST seconds (one retry, GC off: a stray pause of the
    interpreter is not the verifier's doing), return the score. Calls past the last-resort except-net
    (functools.wraps' __wrapped__), so "never raises" is checked on the verifier's own code."""
    fn = getattr(fn, "__wrapped__", fn)
    for _ in range(2):
        gc.disable()
        try:
            t = time.perf_counter()
            out = fn(*args)
            dt = time.perf_counter() - t
        finally:
            gc.enable()
        assert isinstance(out, float), out
        if dt < FAST:
            return out
    raise AssertionError(f"{fn.__name__} took {dt * 1e3:.0f} ms")


def A(s):
    return f"<answer>{s}</answer>"


BIG = "x" * 1_000_000  # 1 MB of filler

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
    valid = TASKS["countdown"]["valid"]
    assert valid(A("9 - 3 - 1"), {"nums": [9, 3, 1]}) and not valid(A("9 - 3 - 2"), {"nums": [9, 3, 1]})


# ---- math: (completion, reference answer, expected) ----
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
    "all knights hedge": (A("Alice: knight/knave, Bob: knight/knave, Carol: knight/knave"), 0.1),
    "empty answer": (A(""), 0.1),
    "1 MB answer": (A(GOOD + ", " + "Alice: knight, " * 70_000), 0.1),
    "no tags": (GOOD, 0.0),
    "unclosed tag": ("<answer>" + GOOD, 0.0),
}


@pytest.mark.parametrize("text,want", LOGIC_CASES.values(), ids=LOGIC_CASES.keys())
def test_logic_reward(text, want):
    assert timed(logic_reward, text, SOL) == want


# ---- property tests: never raise, always fast ----
VERIFIERS = {
    "countdown": lambda s: timed(countdown_reward, s, N, T),
    "math": lambda s: timed(math_reward, s, "72"),
    "logic": lambda s: timed(logic_reward, s, SOL),
    "countdown_value": lambda s: cd_value(s, N),
}
FRAGMENTS = ["<answer>", "</answer>", "<think>", "</think>", "\\boxed{", "\\frac{", "{", "}", "(", ")", "####", "**",
             "//", ",", ".", "$", "-", "+", "*", "/", "=", ":", ";", " ", "\n", "\t", "0", "3", "5", "2", "16", "72",
             "99999999999", "knight", "knave", "Alice:", "Bob:", "Carol:", "\u0663", "1e9", "_", "'", "x"]
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


@settings(max_examples=500, deadline=None, database=None)
@given(seed=st.integers(0, 10 ** 9), gaps=st.lists(st.text(alphabet=" \n\t", max_size=3), min_size=64, max_size=64),
       sep=st.sampled_from([",", "\n", ";", " , ", ",\n"]))
def test_whitespace_inside_answers_is_ignored(seed, gaps, sep):
    rng, gap = random.Random(seed), itertools.cycle(gaps)
    cd = countdown_problem(rng)
    expr = "".join(next(gap) + t for t in re.findall(r"\d+|\S", cd["expr"])) + next(gap)
    assert timed(countdown_reward, A(expr), cd["nums"], cd["target"]) == 1.0
    m = math_problem(rng)
    boxed = "\\boxed{" + next(gap) + m["answer"] + next(gap) + "}"
    assert timed(math_reward, A(next(gap) + boxed + next(gap)), m["answer"]) == 1.0
    lg = logic_problem(rng)
    entries = [next(gap) + k + next(gap) + ":" + next(gap) + ("knight" if v else "knave") + next(gap)
               for k, v in lg["solution"].items()]
    assert timed(logic_reward, A(sep.join(entries)), lg["solution"]) == 1.0


def test_regexes_do_not_backtrack():
    """Each module regex, used the way the module uses it, on 40k-character inputs built to make it backtrack."""
    nasty = ["1," * 20_000 + "x", "1" * 40_000 + ".", "\\frac{" * 5000 + "}", "(" * 40_000 + "x", "1.1" * 10_000 + "x",
             "$" + "9," * 20_000 + ".", "-$" * 20_000, "1" * 40_000 + "\u0663"]
    for s in nasty:
        t = time.perf_counter()
        _CD_CHARS.fullmatch(s), _DEC.fullmatch(s), _FRAC.fullmatch(s), _NUM_TOKEN.search(s)
        assert time.perf_counter() - t < FAST, s[:20]


# ---- generators ----
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


def test_math_problems():
    rng = random.Random(0)
    for _ in range(200):
        p = math_problem(rng)
        assert 2 <= len(p["steps"]) <= 4 and int(p["answer"]) >= 0 and p["steps"][-1].endswith("= " + p["answer"])
        for step in p["steps"]:  # each worked step is right
            a, op, b, _, c = step.split()
            a, b, c = int(a), int(b), int(c)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c
    assert all(len(p["steps"]) == 2 for p in load_rows("math", "easy", 50, seed=0))


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("data", ["gen", "easy"])
def test_references_score_one_and_generators_are_deterministic(task, data):
    t = get_task(task)
    rows = t["load"](data, 200, 1)
    assert rows == t["load"](data, 200, 1)
    assert rows != t["load"](data, 200, 2)
    for row in rows:
        ref = t["reference"](row)
        assert "**" not in ref and ref.count("</think>") == 1 and "<think>" not in ref
        assert t["reward"](ref, row) == 1.0, (row, ref)
        assert t["reward"]("no answer here", row) == 0.0
        for short in (False, True):
            assert isinstance(t["prompt"](row, short=short), str)
        assert "<answer>" in t["prompt"](row) and "<think>" in t["prompt"](row)


def test_prompts():
    row = {"nums": [3, 5, 2], "target": 16, "expr": "(3 + 5) * 2"}
    assert get_task("countdown")["prompt"](row, short=True) == "Make 16 from 3 5 2."
    assert "[3, 5, 2]" in get_task("countdown")["prompt"](row) and "16" in get_task("countdown")["prompt"](row)
    m = math_problem(random.Random(0))
    assert get_task("math")["prompt"](m, short=True) == m["question"] and "\\boxed{}" in get_task("math")["prompt"](m)
    lg = logic_problem(random.Random(0))
    assert get_task("logic")["prompt"](lg, short=True) == "\n".join(lg["statements"])


def test_tasks_and_get_task():
    assert sorted(TASKS) == ["countdown", "logic", "math"]
    for t in TASKS.values():
        assert {"load", "prompt", "reward", "reference"} <= set(t) and all(callable(t[k]) for k in t)
    with pytest.raises(ValueError, match="unknown task 'x'; choose one of: countdown, logic, math"):
        get_task("x")
    with pytest.raises(ValueError, match="choose one of"):
        load_rows("chess", "gen", 1, 0)


def test_no_eval_or_exec():
    tree = ast.parse(inspect.getsource(sys.modules[countdown_reward.__module__]))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"eval", "exec", "compile", "__import__"}


# ---- loaders ----
def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_good_files(tmp_path):
    p = write(tmp_path, "cd.jsonl", ['{"nums": [3, 5, 2], "target": 16}', "", '{"nums": [1, 2], "target": 3}'])
    assert load_rows("countdown", p, 0, 0) == [{"nums": [3, 5, 2], "target": 16}, {"nums": [1, 2], "target": 3}]
    assert len(load_rows("countdown", p, 1, 0)) == 1
    p = write(tmp_path, "m.jsonl", [json.dumps({"question": "q1", "answer": "He has 2<<1+1=2>> apples\n#### 1,450"}),
                                     json.dumps({"question": "q2", "answer": 72})])
    rows = load_rows("math", p, 0, 0)
    assert [r["answer"] for r in rows] == ["1450", "72"] and rows[0]["steps"] == ["He has 2 apples"]
    assert get_task("math")["reward"](get_task("math")["reference"](rows[0]), rows[0]) == 1.0
    lg = logic_problem(random.Random(3))
    p = write(tmp_path, "l.jsonl", [json.dumps(lg)])
    assert load_rows("logic", p, 0, 0) == [lg]


@pytest.mark.parametrize("task,lines,msg", [
    ("countdown", ['{"nums": [1, 2], "target": 3}', "", "{not json"], "line 3: invalid JSON"),
    ("countdown", ['{"nums": [1, 2], "target": 3}', '{"nums": [1, 2]}'], 'line 2: missing key "target"'),
    ("countdown", ['{"nums": [1, "2"], "target": 3}'], 'line 1: "nums" must be'),
    ("countdown", ['{"nums": [1, 2], "target": 3.5}'], 'line 1: "target" must be'),
    ("countdown", ["[1, 2, 3]"], "line 1: expected a JSON object"),
    ("math", ['{"question": "q", "answer": "many"}'], 'line 1: "answer" must be'),
    ("math", ['{"answer": "3"}'], 'line 1: missing key "question"'),
    ("logic", ['{"names": ["A"], "statements": [], "solution": {"A": "yes"}}'], 'line 1: "solution" must be'),
    ("countdown", [""], "no rows"),
])
def test_jsonl_bad_files(tmp_path, task, lines, msg):
    p = write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(ValueError) as e:
        load_rows(task, p, 10, 0)
    assert msg in str(e.value) and p in str(e.value) and "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ValueError, match="nope.jsonl: cannot read"):
        load_rows("countdown", "nope.jsonl", 10, 0)


def test_logic_has_no_hub_set_and_splits_are_checked():
    with pytest.raises(ValueError, match="logic has no hub data set"):
        load_rows("logic", "hf", 10, 0)
    with pytest.raises(ValueError, match="hf:train or hf:test"):
        load_rows("math", "hf:dev", 10, 0)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
@pytest.mark.parametrize("task", ["countdown", "math"])
def test_hub_offline_gives_a_clean_error(task):
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"could not load .* from the hub \(no network\?\): .*; use --data gen"):
        load_rows(task, "hf", 10, 0)
    assert time.perf_counter() - t < 20


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(HERE, "gmts.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE)


@pytest.fixture(scope="module")
def tiny():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


# ---- tiny model and tokenizer ----------------------------------------------------------------------------------


def test_tiny_tokenizer_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = gmts.build_tiny()
    text = "Use 7 1 5 to make 35.\n<|im_start|>assistant\né <answer>(1 + 2) / 3</answer><|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids  # the v5 reload trap (env.md)
    assert tok.decode(ids) == text
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "Qwen2ForCausalLM"


def test_model_name_resolution():
    assert gmts.resolve_model_name("Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert gmts.resolve_model_name("Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert gmts.resolve_model_name("someone/model") == "someone/model"


def test_chat_decision(tiny):
    _, tok = tiny
    assert gmts.use_chat(tok) is True  # eos <|im_end|> + a template: instruct-style
    assert gmts.use_chat(tok, "no") is False
    prompt = gmts.render_prompt(tok, "Q?", chat=True)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith(gmts.ASSISTANT_PREFIX)
    assert gmts.render_prompt(tok, "Q?", chat=False).endswith("Assistant: " + gmts.ASSISTANT_PREFIX)


# ---- rollouts --------------------------------------------------------------------------------------------------


def test_completion_mask_by_position():
    end = [7, 9]  # 9 doubles as the pad id, as <|endoftext|> does for Qwen
    comp = torch.tensor([[1, 2, 7, 9, 9],   # ends at 2: the end token is kept, pads after it dropped
                         [9, 3, 3, 3, 3],   # ends at once: only the end token
                         [1, 2, 3, 4, 5],   # never ends: truncated, all valid
                         [1, 7, 2, 7, 9]])  # only the FIRST end counts
    mask, trunc = completion_mask(comp, end)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert trunc.tolist() == [False, False, True, False]


def test_recomputed_logp_equals_generate_scores(tiny):
    """Left-padded prompts, position ids from the mask: a forward pass reproduces the sampler's distribution."""
    model, tok = tiny
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "Hi"]]  # different lengths
    T = 0.7
    torch.manual_seed(0)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"].repeat_interleave(3, 0), enc["attention_mask"].repeat_interleave(3, 0)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=True, temperature=T,
                         top_k=0, top_p=1.0, repetition_penalty=1.0, eos_token_id=gmts.end_token_ids(tok),
                         pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
    comp = out.sequences[:, ids.shape[1]:]
    mask, _ = completion_mask(comp, gmts.end_token_ids(tok))
    batch = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=mask)
    logp, ent, _ = gmts.batch_token_stats(model, batch, T, micro_batch=4, chunk=5)
    scores = torch.stack(out.scores, 1).float()  # (N, T, V), temperature already applied, nothing filtered
    assert torch.isfinite(scores).all()  # top_k = 0 / top_p = 1: the full distribution
    ref = torch.log_softmax(scores, -1).gather(-1, comp[..., None]).squeeze(-1)
    assert torch.allclose(logp[mask], ref[mask], atol=1e-5)
    p = torch.softmax(scores, -1)
    assert torch.allclose(ent[mask], -(p * torch.log_softmax(scores, -1)).sum(-1)[mask], atol=1e-4)


def test_rollout_shapes_and_flags(tiny):
    model, tok = tiny
    torch.manual_seed(1)
    b = gmts.rollout(model, tok, ["a", "bbb"], group_size=3, max_new_tokens=6)
    assert b["comp_ids"].shape[0] == 6 and b["resp_mask"].shape == b["comp_ids"].shape
    assert len(b["texts"]) == 6 and b["truncated"].dtype == torch.bool
    assert (b["resp_mask"][:, 0]).all()  # every answer has at least one token


# ---- group advantages ------------------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0] + [0.0] * 7 + [0.0] * 8 + [1.0] * 8)  # one of 8 correct, none, all
    a = group_advantages(r, 8)
    assert a[0].item() == pytest.approx(math.sqrt(7), abs=1e-5)  # +sqrt((G-k)/k)
    assert a[1].item() == pytest.approx(-math.sqrt(1 / 7), abs=1e-5)  # -sqrt(k/(G-k))
    assert (a[8:] == 0).all()  # all-equal groups: exactly 0, not NaN
    assert group_advantages(r, 8, std_normalize=False)[:2].tolist() == pytest.approx([0.875, -0.125])
    same = group_advantages(torch.tensor([0.1] * 6), 3)  # 0.1 has no exact float: r - mean would be ~1e-17
    assert (same == 0).all() and not torch.isnan(same).any()
    mixed = group_advantages(torch.tensor([1.0, 0.1, 0.0, 0.1]), 4)
    assert mixed.sum().abs() < 1e-6 and (mixed.std(unbiased=False) - 1).abs() < 1e-4


# ---- token statistics: the derivation, pinned --------------------------------------------------------------------


@pytest.mark.parametrize("V", [2, 17, 1000])
@pytest.mark.parametrize("T", [1.0, 0.7, 1.3])
def test_token_stats_against_autograd_and_loop(V, T):
    torch.manual_seed(V)
    z = (torch.randn(6, V) * 3).requires_grad_(True)
    y = torch.randint(0, V, (6,))
    logp, ent, gn = token_stats(z, y, T)
    (-logp.sum()).backward()  # each row's gradient only touches its own logits
    assert torch.allclose(gn, z.grad.norm(dim=-1), atol=1e-5)  # (1/T) sqrt(1 - 2 p_y + sum p^2)
    for i in range(6):  # slow loop over the definitions
        p = [math.exp(v / T) for v in z[i].tolist()]
        s = sum(p)
        p = [v / s for v in p]
        assert logp[i].item() == pytest.approx(math.log(p[y[i]]), abs=1e-5)
        assert ent[i].item() == pytest.approx(-sum(v * math.log(v) for v in p if v > 0), abs=1e-4)


def test_derivation_logit_gradient_of_clipped_loss():
    """dl/dz = -(omega/T) (onehot(y) - p), and 0 exactly where the clip is active (derivation steps 1-3)."""
    torch.manual_seed(0)
    V, T = 11, 0.7
    z = torch.randn(8, V, requires_grad=True)
    y = torch.randint(0, V, (8,))
    old = torch.log_softmax(z.detach() / T, -1).gather(-1, y[:, None]).squeeze(-1) + torch.tensor(
        [0.0, 0.5, -0.5, 0.1, 0.0, 0.5, -0.5, -0.1])  # ratios 1, e^-.5, e^.5, ...
    adv = torch.tensor([1.5, 1.5, 1.5, -0.7, -0.7, -0.7, -0.7, 0.0])
    logp, _, gn = token_stats(z, y, T)
    loss, clipped = gmts.grpo_token_loss(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    ratio = torch.exp(logp.detach() - old)
    om = omega(adv, ratio[:, None], 0.2, 0.28).squeeze(1)
    p = torch.softmax(z.detach() / T, -1)
    expect = -(om / T)[:, None] * (torch.nn.functional.one_hot(y, V) - p)
    assert torch.allclose(z.grad, expect, atol=1e-5)
    assert torch.allclose(z.grad.norm(dim=-1), om.abs() * gn.detach(), atol=1e-5)  # = |omega| * grad_norm
    assert clipped.tolist() == (om == 0).tolist()[:7] + [False]  # A = 0 is not "clipped", just zero
    assert clipped.tolist() == [False, False, True, False, False, True, False, False]


def test_derivation_bounds_and_entropy_link():
    torch.manual_seed(0)
    z = torch.randn(4000, 50) * torch.rand(4000, 1) * 6
    p = torch.softmax(z, -1)
    y = torch.multinomial(p, 1).squeeze(1)
    _, H, G = token_stats(z, y)
    py = p.gather(-1, y[:, None]).squeeze(1)
    assert ((1 - py) ** 2 <= G ** 2 + 1e-6).all() and (G ** 2 <= 2 * (1 - py) ** 2 + 1e-6).all()
    # E_y[G^2] = 1 - sum p^2 <= 1 - exp(-H): checked exactly per row by summing over all y
    EG2 = (p * ((1 - 2 * p) + (p * p).sum(-1, keepdim=True))).sum(-1)
    assert torch.allclose(EG2, 1 - (p * p).sum(-1), atol=1e-5)
    assert (EG2 <= 1 - torch.exp(-H) + 1e-6).all()
    assert spearman(H, G) > 0.5  # within one "answer" (a fixed omega), entropy tracks the gradient norm


def test_head_stats_chunked_equals_full():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    h, y = torch.randn(50, 16), torch.randint(0, 300, (50,))
    full = token_stats(head(h), y, 0.9)
    for chunk in (1, 7, 50, 64):
        for a, b in zip(gmts.head_stats(h, head, y, 0.9, chunk), full):
            assert torch.allclose(a, b, atol=1e-6)
    lp = gmts.head_logp(h.requires_grad_(True), head, y, 0.9, chunk=7)
    assert torch.allclose(lp, full[0].detach(), atol=1e-6)
    lp.sum().backward()
    g_chunked = head.weight.grad.clone()
    head.weight.grad = None
    token_stats(head(h), y, 0.9)[0].sum().backward()
    assert torch.allclose(g_chunked, head.weight.grad, atol=1e-5)


# ---- scores and selection --------------------------------------------------------------------------------------


def slow_select(scores, mask, rho):
    """Reference: sort valid tokens by (-score, flat index) and keep the first ceil(rho * n)."""
    flat = [(-float(s), i) for i, (s, m) in enumerate(zip(scores.reshape(-1), mask.reshape(-1))) if m]
    k = math.ceil(rho * len(flat) - 1e-9)
    keep = {i for _, i in sorted(flat)[:k]}
    return torch.tensor([i in keep for i in range(mask.numel())]).view_as(mask)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0, 0.01])
def test_select_tokens_matches_slow_reference(seed, rho):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (7, 9), generator=g).float()  # many ties
    mask = torch.rand(7, 9, generator=g) > 0.3
    sel = select_tokens(scores, mask, rho)
    assert sel.tolist() == slow_select(scores, mask, rho).tolist()
    assert int(sel.sum()) == math.ceil(rho * int(mask.sum()) - 1e-9)
    assert not (sel & ~mask).any()


def test_select_tokens_edges():
    s = torch.tensor([[3.0, float("nan"), 1.0], [2.0, 5.0, 0.0]])
    m = torch.ones(2, 3, dtype=torch.bool)
    assert select_tokens(s, m, 1.0).all()
    assert not select_tokens(s, torch.zeros_like(m), 0.5).any()  # empty mask
    assert select_tokens(s, m, 0.5).tolist() == [[True, False, False], [True, True, False]]  # NaN ranks last
    assert select_tokens(s, m, 0.2).sum() == 2  # ceil(0.2 * 6) = 2
    big = torch.rand(3_000_000)  # torch.quantile refuses > 2^24 elements; this path has no such limit
    assert select_tokens(big, torch.ones_like(big, dtype=torch.bool), 0.2).sum() == 600_000


def test_scores_definitions():
    H = torch.tensor([[0.5, 2.0], [1.0, 0.1]])
    G = torch.tensor([[0.3, 0.9], [0.6, 0.2]])
    om = omega(torch.tensor([-2.0, 0.5]), torch.ones(2, 2), 0.2, 0.28)
    assert token_scores("entropy", H, G, om).tolist() == H.tolist()
    assert torch.allclose(token_scores("gmts", H, G, om), torch.tensor([[1.0, 4.0], [0.5, 0.05]]))
    assert torch.allclose(token_scores("gradnorm", H, G, om), torch.tensor([[0.6, 1.8], [0.3, 0.1]]))
    with pytest.raises(ValueError, match="choose one of"):
        token_scores("nope", H, G, om)


def _constructed_batch():
    """3 groups of 2 answers x 4 tokens: group 0 all-equal rewards (A = 0) with the HIGHEST entropies."""
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0]), 2)  # (6,)
    H = torch.tensor([[3.0, 2.9, 2.8, 2.7], [2.6, 2.5, 2.4, 2.3]] + [[1.0, 0.5, 0.2, 0.1]] * 4)  # (6, 4)
    mask = torch.ones(6, 4, dtype=torch.bool)
    return adv, H, mask


def test_gmts_spends_nothing_on_zero_advantage_groups():
    adv, H, mask = _constructed_batch()
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    zero = (adv == 0)[:, None] & mask
    ent = select_tokens(token_scores("entropy", H, H, om), mask, 0.25)
    g_scores = token_scores("gmts", H, H, om)
    g = gmts.select_tokens(g_scores, mask, 0.25, nonzero=True)
    assert (ent & zero).sum() == 6  # entropy spends all 6 of its tokens on the A = 0 group
    assert (g & zero).sum() == 0 and g.sum() == 6
    g_big = gmts.select_tokens(g_scores, mask, 0.9, nonzero=True)  # budget 22 > the 16 live tokens: keeps just those
    assert g_big.sum() == 16 and (g_big & zero).sum() == 0
    assert gmts.select_tokens(g_scores, mask, 1.0).all()
    assert gmts.select_tokens(H, mask, 0.9).sum() == 22
    # (c) no token with A != 0 left out while one with A = 0 is kept, whatever the entropies
    for seed in range(20):
        Hr = torch.rand(6, 4, generator=torch.Generator().manual_seed(seed)) + 0.01
        s = token_scores("gmts", Hr, Hr, om)
        sel = select_tokens(s, mask, 0.5)
        assert not ((sel & zero).any() and (~sel & ~zero).any())


def test_gmts_orders_like_entropy_within_an_answer():
    torch.manual_seed(0)
    H = torch.rand(4, 30)
    om = omega(torch.tensor([2.0, -0.4, 1.0, -1.0]), torch.ones(4, 30), 0.2, 0.28)
    g = token_scores("gmts", H, H, om)
    for i in range(4):
        assert g[i].argsort().tolist() == H[i].argsort().tolist()
        assert spearman(g[i], H[i]) == pytest.approx(1.0)


# ---- loss and update -------------------------------------------------------------------------------------------


def test_k3_kl():
    a = torch.randn(100)
    assert (gmts.k3_kl(a, a) == 0).all()
    assert (gmts.k3_kl(a, a + torch.randn(100)) >= 0).all()


def _batch_from(model, tok, seed=0, n_prompts=3, G=4, new=10):
    torch.manual_seed(seed)
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "x", "Use 9 9 to make 81."]]
    b = gmts.rollout(model, tok, prompts[:n_prompts], G, new)
    adv = group_advantages(torch.tensor([float(i % 3 == 0) for i in range(n_prompts * G)]), G)
    return b, adv


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


@pytest.mark.parametrize("loss_norm", ["all", "selected"])
def test_update_equals_full_reinforce_gradient(tiny, loss_norm):
    """policy_update (hidden-state gather, chunked head, micro-batches, ratio = 1) gives exactly the gradient of
    -sum_{selected} A * logp / denom computed the plain way: full logits, full log_softmax."""
    model, tok = tiny
    model.train()
    b, adv = _batch_from(model, tok)
    T = 0.9
    logp, H, gn = gmts.batch_token_stats(model, b, T, micro_batch=5, chunk=7)
    sel = select_tokens(token_scores("gmts", H, gn, omega(adv, torch.ones_like(H), .2, .28)), b["resp_mask"], 0.3)
    denom = float(b["resp_mask"].sum()) if loss_norm == "all" else float(sel.sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # step() is a no-op: the gradients stay for inspection
    stats = gmts.policy_update(model, opt, b, adv, sel, logp, denom, temperature=T, clip_low=.2, clip_high=.28,
                               micro_batch=2, chunk=3, max_grad_norm=1e9)
    g_ours = _grads(model)
    model.zero_grad()
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    P = b["prompt_ids"].shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1].float() / T, -1).gather(-1, b["comp_ids"][..., None]).squeeze(-1)
    (-(adv[:, None] * lp * sel).sum() / denom).backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0
    assert torch.allclose(g_ours, g_ref, atol=1e-5), (g_ours - g_ref).abs().max()
    assert stats["grad_norm"] == pytest.approx(float(g_ref.norm()), rel=1e-4)
    model.zero_grad()


def test_unselected_tokens_get_zero_logit_gradient():
    torch.manual_seed(0)
    z = torch.randn(3, 5, 13, requires_grad=True)
    y = torch.randint(0, 13, (3, 5))
    sel = torch.rand(3, 5) > 0.5
    logp, _, _ = token_stats(z, y)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 5)
    loss, _ = gmts.grpo_token_loss(logp, logp.detach(), adv, 0.2, 0.28)
    (loss * sel).sum().backward()
    assert (z.grad[~sel] == 0).all() and (z.grad[sel].abs().sum(-1) > 0).all()


def test_nonfinite_gradient_skips_the_step(tiny):
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bad_old = torch.full(b["resp_mask"].shape, float("nan"))  # NaN ratios -> NaN loss and gradients
    stats = gmts.policy_update(model, opt, b, adv, b["resp_mask"], bad_old, 10.0, temperature=1.0, clip_low=.2,
                               clip_high=.28, micro_batch=4, chunk=64, max_grad_norm=1.0)
    assert stats["skipped"] == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # Adam moments untouched too


# ---- analysis ----------------------------------------------------------------------------------------------------


def test_spearman_against_hand_values():
    assert spearman(torch.tensor([1., 2., 3., 4.]), torch.tensor([10., 20., 30., 40.])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1., 2., 3., 4.]), torch.tensor([4., 3., 2., 1.])) == pytest.approx(-1.0)
    # ties get average ranks: x ranks [1, 2.5, 2.5, 4], y ranks [1, 2, 3, 4] -> r = 4.5 / sqrt(4.5 * 5)
    assert spearman(torch.tensor([1., 2., 2., 3.]), torch.tensor([1., 2., 3., 4.])) == pytest.approx(
        4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.)))


def test_param_grad_norms_match_brute_force(tiny):
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=5)
    rows = torch.tensor([0, 0, 4, 8])
    cols = torch.tensor([0, 3, 1, 2])
    ours = gmts.param_grad_norms(model, b, adv, rows, cols, 1.0)
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    P = b["prompt_ids"].shape[1]
    for k, (i, t) in enumerate(zip(rows.tolist(), cols.tolist())):
        model.zero_grad()
        out = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1],
                    position_ids=(attn[i:i + 1].cumsum(-1) - 1).clamp_min(0)).logits
        lp = torch.log_softmax(out[0, P - 1 + t].float(), -1)[b["comp_ids"][i, t]]
        (-adv[i] * lp).backward()
        assert ours[k].item() == pytest.approx(float(_grads(model).norm()), rel=1e-4, abs=1e-7)
    model.zero_grad()


# ---- CLI and end-to-end ------------------------------------------------------------------------------------------

SMALL = ["--model", "tiny", "--task", "countdown", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
         "--max-new-tokens", "24", "--eval-size", "4", "--short-prompt"]


@pytest.mark.parametrize("method", ["all", "random", "entropy", "gmts", "gradnorm"])
def test_cli_two_steps_every_method(tmp_path, method):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    r = run_cli(*SMALL, "--select", method, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["step"] > 0]
    assert [x["step"] for x in steps] == [1, 2]
    for key in ("reward_mean", "selected_frac", "entropy_mean", "grad_norm", "completion_len", "step_time_s",
                "tokens_per_s", "zero_adv_selected_frac", "entropy_gmts_overlap", "selected_abs_adv_mean"):
        assert key in steps[0], key
    assert "eval_acc" in steps[-1]
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"


@pytest.mark.parametrize("args, needle", [
    (["--task", "poetry"], "unknown task"),
    (["--select", "best"], "invalid choice"),
    (["--device", "tpu"], "invalid choice"),
    (["--rho", "0"], "--rho"),
    (["--rho", "1.5"], "--rho"),
    (["--steps", "0"], "--steps"),
    (["--group-size", "1"], "--group-size"),
    (["--steps", "two"], "invalid int"),
    (["--preset", "gpu9000"], "unknown --preset"),
    (["--task", "math", "--sft-blind"], "--sft-blind"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_exit_2():
    r = run_cli("--device", "cuda")
    assert r.returncode == 2 and "CUDA" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unloadable_model_is_one_line_exit_1(tmp_path):
    r = run_cli("--model", "Qwen2.5-0.5B-Instrukt", "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--model tiny" in r.stderr and "Qwen/Qwen2.5-0.5B-Instrukt" in r.stderr


def test_preset_then_explicit_flag_wins():
    cfg = gmts.parse_args(["--preset", "cpu", "--lr", "1e-5"])
    assert cfg.lr == 1e-5 and cfg.model == "tiny" and cfg.data == "easy"
    assert gmts.parse_args([]).rho == 0.2 and gmts.parse_args(["--no-std-normalize"]).std_normalize is False


# ---- reliability: kill, resume, bad input -------------------------------------------------------------------------

RUN = ["--preset", "smoke", "--steps", "6", "--save-every", "1", "--eval-every", "3"]
VOLATILE = ("step_time_s", "tokens_per_s", "rollout_time_s")


def _metrics(path):
    lines = path.read_text().splitlines()
    recs = [json.loads(x) for x in lines]  # a torn line would raise here
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in recs]


def _start(out):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "gmts.py"), *RUN, "--out", str(out)], cwd=HERE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_when(proc, cond, timeout=120):
    import time as _t
    t0 = _t.time()
    while _t.time() - t0 < timeout and proc.poll() is None:
        if cond():
            proc.kill()  # SIGKILL: no handler, no cleanup
            proc.wait()
            return True
        _t.sleep(0.0005)
    proc.wait()
    return False


def _weights(out):
    from safetensors.torch import load_file
    return load_file(str(out / "model.safetensors"))


def test_sigkill_mid_training_and_mid_checkpoint_then_resume(tmp_path):
    import glob as _glob
    ref = tmp_path / "ref"
    assert run_cli(*RUN, "--out", str(ref)).returncode == 0
    want = _metrics(ref / "metrics.jsonl")
    # 1) killed in the middle of training (after step 3 was logged)
    a = tmp_path / "a"
    assert _kill_when(_start(a), lambda: (a / "metrics.jsonl").exists() and
                      (a / "metrics.jsonl").read_text().count('"step": 3') > 0)
    # 2) killed while a checkpoint is being written (a ckpt-*.tmp folder exists), tried a few times
    b, caught = tmp_path / "b", False
    for _ in range(5):
        shutil.rmtree(b, ignore_errors=True)
        p = _start(b)
        if _kill_when(p, lambda: any(not x.endswith("000000.tmp") for x in _glob.glob(str(b / "ckpt-*.tmp")))):
            caught = bool(_glob.glob(str(b / "ckpt-*.tmp")))
            if caught:
                break
    assert caught, "never caught the process inside a checkpoint write"
    for out in (a, b):
        ck = gmts.last_checkpoint(str(out))
        assert ck is not None and os.path.exists(os.path.join(ck, "state.pt"))  # only complete ones count
        r = run_cli("--resume", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        got = _metrics(out / "metrics.jsonl")
        assert [x["step"] for x in got] == list(range(0, 7))  # no duplicated, missing or torn lines
        assert got == want  # the resumed run computes exactly what the uninterrupted one did
        w, w_ref = _weights(out), _weights(ref)
        assert all(torch.equal(w[k], w_ref[k]) for k in w_ref)


def test_resume_ignores_partial_checkpoint_and_torn_line(tmp_path):
    out = tmp_path / "run"
    assert run_cli(*RUN, "--steps", "2", "--out", str(out)).returncode == 0
    os.makedirs(out / "ckpt-000003.tmp")  # a write that died half way
    (out / "ckpt-000003.tmp" / "config.json").write_text("{")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mea')  # a torn line
    assert gmts.last_checkpoint(str(out)).endswith("ckpt-000002")
    r = run_cli("--resume", str(out), "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in _metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ('{"nums": [1, 2, 3], "target": 6}\n{"nums": [1, 2], "target": }\n', "line 2: invalid JSON"),
    ('{"nums": [1, 2, 3], "target": 6}\n{"nums": [1, 2, 3]}\n', 'line 2: missing key "target"'),
])
def test_bad_data_file_exit_2(tmp_path, content, needle):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    r = run_cli("--data", str(path), "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_out_is_a_file_and_resume_without_checkpoint_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = run_cli("--out", str(f))
    assert r.returncode == 2 and "existing file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    os.makedirs(tmp_path / "empty")
    r = run_cli("--resume", str(tmp_path / "empty"))
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_all_zero_advantage_batch_makes_no_update(tiny):
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=7)
    adv = torch.zeros(b["comp_ids"].shape[0])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    H = torch.rand(b["resp_mask"].shape)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    s = token_scores("gmts", H, H, om)
    sel = gmts.select_tokens(s, b["resp_mask"], 0.2, nonzero=True)
    assert not sel.any()
    stats = gmts.policy_update(model, opt, b, adv, sel, torch.zeros_like(H), 10.0, temperature=1.0, clip_low=.2,
                               clip_high=.28, micro_batch=4, chunk=64, max_grad_norm=1.0)
    assert stats["stepped"] == 0 and stats["skipped"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_out_of_memory_is_one_line_with_the_flags_to_lower(tmp_path, monkeypatch, capsys):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(gmts, "rollout", oom)
    with pytest.raises(SystemExit) as e:
        gmts.main(["--preset", "smoke", "--sft-steps", "0", "--eval-every", "0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert "--micro-batch" in err and "--group-size" in err and "--max-new-tokens" in err
    assert gmts.last_checkpoint(str(tmp_path / "o")) is not None  # the last checkpoint is kept


def test_analyze_cli_prints_the_spearman_table(tmp_path):
    r = run_cli("--analyze", "--preset", "smoke", "--batches", "1", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "spearman" in r.stdout and all(m in r.stdout for m in ("entropy", "gmts", "gradnorm", "random"))
    res = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert set(res) == {f"{m}/{c}_{w}" for m in ("entropy", "gmts", "gradnorm", "random")
                        for c in ("logit", "param") for w in ("within", "batch")}


def test_cpu_preset_with_a_tiny_budget(tmp_path):
    out = tmp_path / "cpu"
    r = run_cli("--preset", "cpu", "--steps", "2", "--sft-steps", "3", "--prompts-per-step", "2", "--eval-size", "4",
                "--eval-every", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["step"] == 0 and "eval_acc" in recs[0]  # the warm-up's accuracy is the first eval_acc
    assert [x["step"] for x in recs] == [0, 1, 2] and (out / "metrics.png").stat().st_size > 1000


def test_blind_warm_up_shows_the_real_prompts_and_imitates_random_answers(monkeypatch):
    """--sft-blind: every warm-up prompt is the row's own, and the answer it is trained on is a random well-formed
    one over the same numbers (with its true value), not the solution; without --sft-blind it is the solution."""
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    task = gmts.get_task("countdown")
    rows = gmts.load_rows("countdown", "easy", 40, seed=0)
    seen = {"prompts": [], "answers": []}
    build, ref = gmts.build_prompts, task["reference"]

    def spy_build(*a, **k):
        prompts = build(*a, **k)
        seen["prompts"] += prompts
        return prompts

    def spy_ref(row):
        seen["answers"].append(row)
        return ref(row)
    monkeypatch.setattr(gmts, "build_prompts", spy_build)
    monkeypatch.setitem(task, "reference", spy_ref)
    monkeypatch.setattr(gmts, "evaluate", lambda *a, **k: {"eval_acc": 0.0})  # its prompts are not the warm-up's
    for blind in (True, False):
        seen["prompts"].clear(), seen["answers"].clear()
        gmts.sft_warmup(model, tok, task, rows, chat=True, short=True, steps=4, lr=1e-3, batch_size=8, seed=0,
                        log=lambda *a: None, blind=blind)
        assert len(seen["prompts"]) == len(seen["answers"]) == 32
        same = 0
        for prompt, ans in zip(seen["prompts"], seen["answers"]):
            m = re.search(r"Make (\d+) from (\d) (\d) (\d)\.", prompt)
            row = next(r for r in rows if task["prompt"](r, short=True) == m.group(0))  # the prompt is a row's own
            assert ans["nums"] == row["nums"]
            value = gmts.countdown_value(f"<answer>{ans['expr']}</answer>", row["nums"])
            assert value == ans["target"] >= 0 and re.fullmatch(r"\d [+-] \d [+-] \d", ans["expr"]), ans
            same += ans == row
        assert same == 32 if not blind else same < 24  # blind: mostly not the solution (3 or 4 patterns allowed)


def test_countdown_blind_draws_each_nonnegative_sign_pattern_equally_often():
    def draws(nums, n=3000):
        rng = random.Random(0)
        return collections.Counter(gmts.countdown_blind({"nums": nums, "target": 0}, rng)["expr"] for _ in range(n))
    c = draws([4, 3, 2])  # 4 - 3 - 2 = -1 is never drawn; the other three patterns a third each
    assert set(c) == {"4 + 3 + 2", "4 + 3 - 2", "4 - 3 + 2"} and all(900 < v < 1100 for v in c.values())
    c = draws([50, 25, 3, 1], 4000)  # four numbers: all 8 patterns are >= 0, an eighth each
    assert len(c) == 8 and all(400 < v < 600 for v in c.values())
    for row in ({"nums": [7, 1, 5], "target": 3}, {"nums": [7, 1, 5], "target": 13}):  # the target is not read
        assert gmts.countdown_blind(row, random.Random(5))["expr"] == gmts.countdown_blind(
            {"nums": [7, 1, 5], "target": 1}, random.Random(5))["expr"]
    got = gmts.countdown_blind({"nums": [9, 8, 7], "target": 24}, random.Random(1))  # a .jsonl row: no 'expr'
    assert gmts.countdown_reference(got).endswith(f"<answer>{got['expr']}</answer>")
    assert gmts.countdown_blind({"nums": [], "target": 1}, random.Random(0)) == {"nums": [], "target": 1}


def test_lr_schedule_hand_computed():
    f = [gmts.lr_factor(i, total=6, warmup=2) for i in range(6)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])  # up over 2 steps, then (6 - i) / 4
    assert [gmts.lr_factor(i, 6, 2, decay=False) for i in range(6)] == [0.5] + [1.0] * 5
    assert gmts.lr_factor(0, 1, 10) == 0.1 and gmts.lr_factor(99, 100, 0) == pytest.approx(0.01)


def test_held_out_rows_do_not_depend_on_steps_and_never_repeat_in_train():
    task = get_task("countdown")
    cfgs = [gmts.Config(data="easy", steps=n, prompts_per_step=32, eval_size=256) for n in (1, 60, 200)]
    splits = [gmts.split_rows(task, c) for c in cfgs]
    assert splits[0][1] == splits[1][1] == splits[2][1] and len(splits[0][1]) == 256
    for train, held in splits:
        assert not {task["prompt"](r) for r in held} & {task["prompt"](r) for r in train}
    assert len(splits[2][0]) > len(splits[0][0])  # more steps, more training rows


def test_warm_up_stop_rule(monkeypatch):
    """--sft-target stops at the first check (every 50 steps) that reaches it: on accuracy, or when blind on the
    share of well-formed answers (a blind warm-up cannot learn the signs from the target, so accuracy is no goal)."""
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    rows = load_rows("countdown", "easy", 20, seed=0)
    calls = []
    monkeypatch.setattr(gmts, "evaluate", lambda *a, **k: calls.append(1) or {"eval_acc": 0.1, "eval_valid": 0.95})
    run = lambda blind, target, log=lambda *a: None: gmts.sft_warmup(  # noqa: E731
        model, tok, get_task("countdown"), rows, True, True, 100, 1e-4, 2, 0, log=log, target_acc=target, blind=blind)
    assert run(True, 0.9) == 50 and run(True, 0.99) == 100 and run(False, 0.9) == 100 and run(False, 0.1) == 50
    calls.clear()
    assert run(True, 0.0, log=None) == 100 and not calls  # nothing to log and no target: no greedy checks at all
    assert run(True, 0.9, log=None) == 50 and len(calls) == 1  # the stop rule still checks


def test_compare_writes_a_table_and_a_plot(tmp_path):
    out = tmp_path / "cmp"
    r = run_cli("--preset", "smoke", "--compare", "all,gmts", "--seeds", "2", "--workers", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 runs (2 seed(s) x 2 method(s)) in 2 process(es)" in r.stdout
    table = (out / "compare.md").read_text().splitlines()
    assert table[0].startswith("| method") and [x.split("|")[1].strip() for x in table[2:]] == ["all", "gmts"]
    assert (out / "compare.png").stat().st_size > 1000
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["all-s0", "all-s1", "gmts-s0", "gmts-s1",
                                                                      "warm-s0", "warm-s1"]
    r = run_cli("--preset", "smoke", "--compare", "all,best", "--out", str(out))
    assert r.returncode == 2 and "--compare" in r.stderr


def test_every_config_field_is_a_flag_with_help(capsys):
    with pytest.raises(SystemExit):
        gmts.parse_args(["--help"])
    out = capsys.readouterr().out
    opts = out[out.index("options:"):]
    for f in gmts.dataclasses.fields(gmts.Config):
        flag = "--" + f.name.replace("_", "-")
        m = re.search(rf"^  {flag}[ ,](.*?)\(default:", opts, re.M | re.S)  # its entry, up to the default
        assert m, flag
        words = [w for w in m.group(1).split() if not w.isupper() and not w.startswith("--")]
        assert len(words) >= 2, f"{flag} has no help text"
