"""Competition-math grading: what the grader ignores and what it compares, as a real run grades.

Each gold is a row of a MATH-layout .jsonl file read by gmts.load_rows("math", path) (so every gold
here must load: a refused one would stop a run with exit 2), and each answer is graded by
gmts.TASKS["math"]["reward"] on a completion that boxes it. Both directions: a wrong answer earns
0, the right one written another way earns 1.
"""
import json
import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
from hypothesis import given, settings, strategies as st

import gmts

reward = gmts.TASKS["math"]["reward"]

# (gold as a data file writes it, the boxed answer, the verdict)
CASES = [
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
    """Each gold of CASES, read by the loader a run uses (a refused gold raises here)."""
    golds = list(dict.fromkeys(g for g, _, _ in CASES))
    path = tmp_path_factory.mktemp("golds") / "golds.jsonl"
    path.write_text("".join(json.dumps({"problem": f"Problem {i}", "answer": g}) + "\n"
                            for i, g in enumerate(golds)))
    read = gmts.load_rows("math", str(path), 0)
    assert [r["answer"] for r in read] == golds
    return dict(zip(golds, read))


@pytest.mark.parametrize("gold,answer,want", CASES)
def test_grading_compares_the_value_and_the_unit_as_meant(rows, gold, answer, want):
    row = rows[gold]
    completion = f"Working it out step by step.\nSo the final answer is $\\boxed{{{answer}}}$."
    assert reward(completion, row) == want
    # the verdict is the grader's, not the except-net's
    bare = gmts.math_reward.__wrapped__(completion, row["answer"], row.get("latex", False),
                                        row.get("answer_line", False))
    assert bare == want


def test_every_gold_of_the_table_loads_as_latex_math_verify_reads(rows):
    """No gold is refused or left to the exact-match fallback; both verdicts are in the table."""
    assert all(r.get("latex") and gmts.latex_equal(gmts.normal_answer(r["answer"])) for r in rows.values())
    assert {w for _, _, w in CASES} == {0.0, 1.0}


NASTY = ["\\text{" * 300, "5" + "~" * 999 + "\\text{cm}", "5" + "\\," * 490 + "\\text{cm}",
         "5" + "\\ " * 490 + "\\text{cm}", "\\\\ " * 300 + "\\text{cm}", "1" + " " * 980 + "\\text{ a b}",
         "9" * 900 + "\\text{ trillion}", "x" + "\\text{ a}" * 120, "\\mathrm{i}" * 100,
         "5\\text{ " + "s" * 900 + "}^{2}", "5\\text{ " + "a " * 450 + "}"]


@pytest.mark.parametrize("s", NASTY, ids=range(len(NASTY)))
def test_splitting_a_unit_never_raises_and_takes_no_time(s):
    """Inputs as long as a gold may be (1,000 characters), built to make a scan or a regex
    backtrack: value_unit and same_unit answer in well under a second."""
    t = time.perf_counter()
    value, unit = gmts.value_unit(s)
    assert isinstance(value, str) and isinstance(unit, str)
    assert gmts.same_unit(unit, unit) or not unit
    gmts.normal_answer(s), gmts.bare_answer(s)
    assert time.perf_counter() - t < 0.5, s[:30]


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.sampled_from(["\\text{", "\\mathrm{", "\\mbox{", "{", "}", " ", "cm", "s", "i",
                                 "\\,", "\\", "~", "5", "thousand", "^2", "^{3}", "$", ".", "x"]),
                max_size=30))
def test_splitting_a_unit_never_raises(parts):
    s = "".join(parts)
    value, unit = gmts.value_unit(s)
    assert isinstance(value, str) and isinstance(unit, str)
    gmts.same_unit(unit, gmts.value_unit(s[::-1])[1])
