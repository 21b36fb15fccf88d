"""Issue 36, the paper's own setting: competition-math answers through math-verify (bounded in time, in a worker
process), the published data layouts read through `datasets`, benchmark avg@k, the prompt styles and the paper-math
preset. Offline: every file is written here in its published layout and read by the real loading code; a hub id goes
through the same `datasets` call as a local dataset folder.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import contextlib
import csv
import json
import math
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import gmts
from gmts import math_reward
from test_gmts import MATH_CASES, SLOW, timed


def box(s):
    return f"So the final answer is $\\boxed{{{s}}}$."


@pytest.fixture(scope="module")
def verifier():
    """The worker started once (its first start, ~0.6 s, is not what the cases time)."""
    assert gmts.latex_equal("2", "2") is True


# ---- competition answers: (gold as MATH-500 writes it, completion, verdict) ------------------------------------------
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


def test_competition_table_is_the_issue_s():
    """At least 60 cases, both verdicts, and the forms the issue names."""
    assert len(COMPETITION) >= 60 and {w for _, _, w in COMPETITION} == {0.0, 1.0}
    golds = {g for g, _, _ in COMPETITION}
    assert {"\\dfrac{7}{20}", "0.5", "2", "[2,5)", "\\text{(C)}", "90^\\circ", "50\\%", "1011_2"} <= golds


def test_a_known_miss_of_math_verify(verifier):
    """math-verify 0.9.0 reads 8.7 \\times 10^{8} as 8.7 (a float) times 10^8 and misses that 870000000 is equal
    (dev/LOG.md, "The paper's setting"): pinned, so that a version that fixes it shows here."""
    assert math_reward(box("870000000"), "8.7 \\times 10^{8}", True) == 0.0


def test_gsm8k_rows_never_ask_math_verify(monkeypatch):
    """A GSM8K row (latex False, the default) is graded as before: every MATH_CASES verdict with the worker out."""
    calls = []
    monkeypatch.setattr(gmts, "latex_equal", lambda *a, **k: calls.append(a))
    for text, answer, want in MATH_CASES.values():
        assert math_reward(text, answer) == want
    assert calls == []


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
def test_competition_answers_are_bounded_in_time(verifier, monkeypatch, text):
    """Each is 0.0 within twice VERIFY_TIMEOUT_S (1 s here: the retry on a fresh worker) plus the
    kills and a start; the next verdicts are right (a new worker)."""
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1.0)
    t = time.perf_counter()
    assert math_reward(text, "\\frac{1}{2}", True) == 0.0
    assert time.perf_counter() - t < 2 * (1.0 + SLOW)
    assert math_reward(box("0.5"), "\\frac{1}{2}", True) == 1.0
    assert math_reward(box("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", True) == 1.0


def test_the_bound_holds_off_the_main_thread(verifier, monkeypatch):
    """math-verify's own timeout is signal.alarm, which only the main thread may set: here a thread hits a hang."""
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1.0)
    got = []
    worker = threading.Thread(target=lambda: got.append((math_reward(box("9^{9^{9^{9}}}"), "72", True),
                                                          math_reward(box("x = 2"), "2", True))))
    worker.start()
    worker.join(60)
    assert got == [(0.0, 1.0)]


@pytest.fixture
def pool_of(monkeypatch):
    """pool_of(n): grade_answers on n new workers and threads in this test; its threads and workers
    end after it."""
    made, pools = [], []

    def make(n):
        pools.append(gmts._verifier_pool(n))
        monkeypatch.setattr(gmts, "VERIFY_WORKERS", n)
        monkeypatch.setattr(gmts, "_VERIFIER", pools[-1])
        monkeypatch.setattr(gmts, "_GRADERS", made)
    yield make
    for pool in made:
        pool.shutdown()
    for slot in [s for p in pools for s in p["slots"] if s["proc"]]:
        gmts._kill(slot["proc"])


def test_parallel_grading_gives_the_serial_verdicts(pool_of):
    """grade_answers on 3 workers, 4 answers a row (answer j grades row j // 4), against the serial
    reward calls on a pool of their own (no verdict remembered) and the table's hand verdicts; more
    than one worker graded."""
    pool_of(3)
    task = gmts.TASKS["math"]
    rows = [{"question": "q", "answer": gold, "latex": True} for gold, _, _ in COMPETITION]
    texts = [text for _, text, _ in COMPETITION]
    parallel = gmts.grade_answers(task, [t for t in texts for _ in range(4)], rows, 4)
    assert len([s for s in gmts._VERIFIER["slots"] if s["proc"]]) >= 2
    pool_of(1)
    serial = [task["reward"](t, r) for t, r in zip(texts, rows)]
    assert serial == [want for _, _, want in COMPETITION]
    assert parallel == [v for v in serial for _ in range(4)]


def test_a_hanging_pool_worker_is_killed_after_the_timeout(pool_of, monkeypatch):
    """A power tower among right answers on 2 workers: its worker is killed after VERIFY_TIMEOUT_S
    (1 s), and so is the fresh one it is asked again on; the others' verdicts are right, the tower's
    is 0 and counted as no verdict, and the pass ends within twice the bound."""
    pool_of(2)
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1.0)
    killed = []
    real = gmts._kill
    monkeypatch.setattr(gmts, "_kill", lambda proc: (killed.append(proc.pid), real(proc)))
    task = gmts.TASKS["math"]
    texts = [box("0.5")] * 6 + [box("9^{9^{9^{9}}}")] + [box("0.5")] * 6
    rows = [{"question": "q", "answer": "\\frac{1}{2}", "latex": True}] * len(texts)
    t = time.perf_counter()
    got = gmts.grade_answers(task, texts, rows)
    assert time.perf_counter() - t < 2 * (1.0 + SLOW) + 2
    assert got == [1.0] * 6 + [0.0] + [1.0] * 6
    assert len(killed) == 2 and gmts._VERIFIER["unknown"] == 1
    for pid in killed:
        assert not os.path.exists(f"/proc/{pid}")  # reaped


def test_a_missing_math_verify_is_one_line(monkeypatch, tmp_path):
    """A worker that cannot import math_verify: RunError (exit 1 at the CLI: the machine's fault,
    issue 44) that says the worker did not start and why, not a hang or a traceback."""
    worker = gmts._VERIFY_WORKER.replace("from math_verify import", "from math_verify_no import")
    monkeypatch.setattr(gmts, "_VERIFY_WORKER", worker)
    monkeypatch.setattr(gmts, "_VERIFIER", gmts._verifier_pool(1))  # no worker started yet
    with pytest.raises(gmts.RunError, match="did not start: cannot import math_verify "
                       ".ModuleNotFoundError: No module named 'math_verify_no'.; pip install"):
        gmts.latex_equal("\\frac{1}{2}")


# ---- the published layouts, through the real loading code ------------------------------------------------------------
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_math500(tmp_path, bad=False):
    rows = [{"problem": "What is $\\frac{6}{8}$ in lowest terms?", "solution": "...", "answer": "\\frac{3}{4}",
             "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
            {"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "...",
             "answer": "x^" if bad else "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
             "unique_id": "test/precalculus/807.json"},
            {"problem": "How many vertical asymptotes does $y=\\frac{2}{x^2+x-6}$ have?", "solution": "...",
             "answer": "2", "subject": "Algebra", "level": 3, "unique_id": "test/algebra/1.json"}]
    return _jsonl(tmp_path / "math500.jsonl", rows)


def write_aime(tmp_path, bad=False):
    """Framework1's AIME_Dataset.csv header; datasets reads Answer as an integer."""
    path = tmp_path / "aime.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Year", "Problem Number", "Question", "Answer", "Part"])
        w.writerow(["2024-I-2", 2024, 2, "Find $xy$ if $\\log_x(y^x)=\\log_y(x^{4y})=10$.", 25, "I"])
        w.writerow(["2024-I-3", 2024, 3, "Count the $n \\le 2024$ for which Bob wins.", "x^" if bad else 809, "I"])
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
    assert gmts.load_rows("math", write_math500(tmp_path), 0) == rows(
        ("What is $\\frac{6}{8}$ in lowest terms?", "\\frac{3}{4}"),
        ("Convert $(0,3)$ to polar coordinates.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("How many vertical asymptotes does $y=\\frac{2}{x^2+x-6}$ have?", "2"))
    assert gmts.load_rows("math", write_aime(tmp_path), 0) == rows(
        ("Find $xy$ if $\\log_x(y^x)=\\log_y(x^{4y})=10$.", "25"),
        ("Count the $n \\le 2024$ for which Bob wins.", "809"))
    assert gmts.load_rows("math", write_minerva(tmp_path), 0) == rows(
        ("Give the wavelength in Angstroms, to two significant figures.", "9.6"),
        ("Compute the star's radius in centimeters.", "8.7 \\times 10^{8}"))
    assert gmts.load_rows("math", write_olympiad(tmp_path), 0) == rows(
        ("Determine the largest real number $\\mu$ ...", "$\\frac{1}{2 n+2}$"),
        ("Determine all primes $p$ and $x, y$ with $x^3+y^3=p(xy+p)$.", "$(1,8,19), (2,7,13), (4,5,7)$"))
    assert gmts.load_rows("math", write_dapo(tmp_path), 0) == rows(
        ("Find $a+b+c$ for $\\frac{a\\sqrt{b}}{c}$ ...", "34"), ("What is $\\sqrt{16}$?", "4"))
    rows_ = gmts.load_rows("math", write_olympiad(tmp_path), 0)
    assert math_reward(box("\\frac{1}{2(n+1)}"), rows_[0]["answer"], True) == 1.0  # the gold's $...$ is read


def test_our_own_layout_takes_latex_golds_and_keeps_gsm8k_rows(tmp_path, verifier):
    path = _jsonl(tmp_path / "own.jsonl", [{"question": "q1", "answer": "\\frac{\\sqrt{3}}{2}"},
                                           {"question": "q2", "answer": "He has 2<<1+1=2>> apples\n#### 1,450"},
                                           {"question": "q3", "answer": 72}])
    first, second, third = gmts.load_rows("math", path, 0)
    assert first == {"question": "q1", "answer": "\\frac{\\sqrt{3}}{2}", "latex": True}
    assert second == {"question": "q2", "answer": "1450", "steps": ["He has 2 apples"]}  # GSM8K's, as before
    assert third == {"question": "q3", "answer": "72", "latex": True}  # no '####': boxed
    assert gmts.TASKS["math"]["reward"](box("\\frac{\\sqrt3}{2}"), first) == 1.0
    assert gmts.TASKS["math"]["reward"]("\\boxed{x = 72}", third) == 1.0  # math-verify reads 'x = '
    assert gmts.TASKS["math"]["reward"]("so 72", third) == 0.0  # but not a bare last number
    assert gmts.TASKS["math"]["reward"]("\\boxed{x = 1450}", second) == 0.0  # GSM8K's: numbers


@pytest.mark.parametrize("write,where", [(write_math500, "math500.jsonl line 2"), (write_aime, "aime.csv row 2")])
def test_a_gold_math_verify_cannot_read_is_refused_by_file_and_row(tmp_path, verifier, write, where):
    with pytest.raises(ValueError) as e:
        gmts.load_rows("math", write(tmp_path, bad=True), 0)
    msg = str(e.value)
    assert where in msg and '"answer" must be' in msg and "'x^'" in msg and "\n" not in msg


def test_a_hub_id_and_a_dataset_folder_take_the_same_datasets_call(tmp_path, monkeypatch, verifier):
    """hf:ID[:CONFIG][:SPLIT] -> datasets.load_dataset(ID[, CONFIG], split=SPLIT): a local folder laid out as a hub
    repository (data/test-*.parquet) loads through it, in order, each row named; an id it cannot reach offline is
    one line naming it."""
    import datasets
    os.makedirs(tmp_path / "MATH-500" / "data")
    write_dapo(tmp_path / "MATH-500" / "data", "test-00000-of-00001.parquet")
    calls, real = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    folder = str(tmp_path / "MATH-500")
    rows, where, data_print = gmts.load_rows("math", f"hf:{folder}:test", 0, named=True)
    assert [r["answer"] for r in rows] == ["34", "4"]
    assert where == [f"hf:{folder}:test row 1", f"hf:{folder}:test row 2"]
    cache = calls[0][1]["cache_dir"]  # a fresh cache folder, deleted after
    assert calls == [((folder,), {"split": "test", "cache_dir": cache})]
    assert os.path.dirname(cache) == str(datasets.config.HF_DATASETS_CACHE)
    assert not os.path.exists(cache) and data_print == gmts.bytes_print(folder)
    with pytest.raises(ValueError, match=r"^could not load hf:someone/sets:main:test from the hub \(no network\?\)"):
        gmts.load_rows("math", "hf:someone/sets:main:test", 0)
    assert calls[-1] == (("someone/sets", "main"), {"split": "test"})


# ---- evaluation: avg@k per benchmark ---------------------------------------------------------------------------------
def test_avg_at_k_is_the_mean_over_k_sampled_answers(tiny_model):
    """evaluate(samples=k) against a slow reference: the same k answers per problem (one rollout, seeded alike), each
    scored by the task's reward, averaged; greedy (samples 0) is unchanged."""
    model, tok = tiny_model
    task = dict(gmts.get_task("countdown"), reward=lambda text, row: float(sum(map(ord, text)) % 2))
    rows = gmts.load_rows("countdown", "easy", 3, 0)
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
    """evaluate_run: eval_NAME per --eval-data set, eval_acc and eval_len their means (hand values)."""
    by_rows = {"a": dict(eval_acc=0.5, eval_len=10.0, eval_sample="x"), "b": dict(eval_acc=0.25, eval_len=4.0,
                                                                                  eval_sample="y")}
    monkeypatch.setattr(gmts, "evaluate", lambda model, tok, task, rows, *a, **k: dict(by_rows[rows[0]]))
    run = types.SimpleNamespace(tok=None, task=None, chat=True, eval_rows={"aime24": ["a"], "math500": ["b"]})
    cfg = gmts.Config(eval_samples=16)
    assert gmts.evaluate_run(None, run, cfg) == dict(eval_aime24=0.5, eval_math500=0.25, eval_acc=0.375, eval_len=7.0,
                                                     eval_sample="x")
    run.eval_rows = ["b"]  # held-out rows: as before
    assert gmts.evaluate_run(None, run, cfg) == dict(eval_acc=0.25, eval_len=4.0, eval_sample="y")


@pytest.fixture(scope="module")
def tiny_model():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


# ---- prompt styles ---------------------------------------------------------------------------------------------------
def test_the_prompt_styles(tiny_model):
    _, tok = tiny_model
    task = gmts.get_task("math")
    row = {"question": "What is $1+1$?", "answer": "2", "latex": True}
    qwen = gmts.build_prompts(tok, task, [row], True, style="qwen-math")[0]
    assert qwen == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                    "<|im_end|>\n<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n")
    suffix = gmts.build_prompts(tok, task, [row], True, style="boxed-suffix")[0]
    assert suffix == ("<|im_start|>user\nWhat is $1+1$? Let's think step by step and output the final answer within "
                      "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert gmts.build_prompts(tok, task, [row], False, style="qwen-math")[0] == (
        "Please reason step by step, and put your final answer within \\boxed{}.\nUser: What is $1+1$?\nAssistant:")
    ours = gmts.build_prompts(tok, gmts.get_task("math"), [row], True)[0]
    assert ours.endswith(gmts.ASSISTANT_PREFIX) and "<answer>" in ours  # the default, as before


# ---- the paper-math preset -------------------------------------------------------------------------------------------
def test_the_preset_takes_framework1_s_values():
    """GMTS-Framework1/example/Qwen2.5-math-1.5b-grpo-GMTS.yaml and test.py (shared/notes/gmts-official.md)."""
    cfg = gmts.parse_args(["--preset", "paper-math"])
    framework1 = dict(model="Qwen/Qwen2.5-Math-1.5B", task="math", prompt_style="qwen-math", prompts_per_step=64,
                      group_size=16, max_new_tokens=2048, lr=3e-5, warmup_steps=0, lr_decay=False, weight_decay=0.0,
                      max_grad_norm=1.0, kl_beta=0.001, clip_low=0.2, clip_high=0.28, micro_batch=4, seed=0,
                      filter_groups=False, overlong_filter=False, temperature=1.0, top_p=1.0, top_k=0,
                      inner_updates=1, select="gmts", rho=0.2, eval_samples=16, steps=188)
    assert {k: getattr(cfg, k) for k in framework1} == framework1
    # GRPO's per-answer mean, summed over the 64 prompts, the norm clipped at 1.0: their update
    assert cfg.loss_norm == "seq-sum" and gmts.selection_rule(cfg) == (0.2, 16)  # GMTS per group
    assert cfg.adam_eps == 1e-8 and cfg.data_order == "epoch"  # torch's eps; one pass over the rows
    assert cfg.data == "hf:hiyouga/math12k:train" and [n for n, _ in gmts.eval_sets(cfg.eval_data)] == [
        "aime24", "amc23", "math500", "minerva", "olympiadbench"]


def test_two_steps_on_the_preset_s_path_with_two_benchmarks(tmp_path, capsys):
    """--preset paper-math with --model tiny, MATH-500-style training rows and two benchmark files: the step lines
    carry eval_acc, metrics.jsonl each benchmark's avg@2 and their mean, at step 0 and at the last step."""
    out = tmp_path / "run"
    gmts.main(["--preset", "paper-math", "--model", "tiny", "--data", write_math500(tmp_path), "--eval-data",
               f"aime24={write_aime(tmp_path)},minerva={write_minerva(tmp_path)}", "--eval-samples", "2",
               "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
               "--out", str(out)])
    said = capsys.readouterr().out
    assert "| 2 held-out sets |" in said and "step 2 |" in said
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for rec in (recs[0], recs[-1]):
        assert rec["eval_acc"] == (rec["eval_aime24"] + rec["eval_minerva"]) / 2
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["prompt_style"] == "qwen-math" and cfg["kl_beta"] == 0.001 and cfg["eval_samples"] == 2


# ---- the preset's update is the authors' (issue 42 item 4) ---------------------------------------
def _preset_batch(tok, informative, B=64, G=16, seed=0):
    """A rollout batch as sample_groups returns it: B prompts x G answers of the byte-level tiny
    tokenizer, every answer 16 (an end token last) or 32 tokens (cut), rewards binary: half of each
    of the first `informative` groups right, the other groups all wrong."""
    g = torch.Generator().manual_seed(seed)
    N, P, T = B * G, 6, 32
    prompt_ids = torch.full((N, P), tok.pad_token_id)
    prompt_mask = torch.zeros(N, P, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(3, P + 1, (1,), generator=g))
        prompt_ids[b * G:(b + 1) * G, P - n:] = torch.randint(0, 256, (n,), generator=g)
        prompt_mask[b * G:(b + 1) * G, P - n:] = True
    comp = torch.randint(0, 256, (N, T), generator=g)
    short = torch.arange(N) % 3 == 0
    comp[short, 15] = tok.convert_tokens_to_ids("<|im_end|>")
    comp[short, 16:] = tok.pad_token_id
    resp_mask, truncated = gmts.completion_mask(comp, gmts.end_token_ids(tok))
    rewards = torch.zeros(N)
    for b in range(informative):
        rewards[b * G:b * G + G // 2] = 1.0
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, comp_ids=comp, resp_mask=resp_mask,
                 truncated=truncated, texts=[""] * N, sampler_logp=torch.zeros(N, T))
    return batch, rewards


def _authors_update(model, batch, rewards, kept, old_logp, ref_logp, G=16, micro=4, lr=3e-5,
                    beta=0.001, clip_low=0.2, clip_high=0.28, logp_of=gmts.head_logp, grads=None):
    """A literal reading of GMTS-Framework1's update_policy (grpo_tools/grpo.py), method grpo, one
    mini-batch of all the prompts: A' = (r - mean) / (population std + 1e-6) / (G |o_i|) in
    float64; micro answers at a time, the SUM over tokens of -min(r A', clip(r) A') on the kept
    tokens (A' = 0 elsewhere) plus beta k3 / (G |o_i|) on all, backward; the gradient norm clipped
    at 1.0; torch's AdamW(lr, (0.9, 0.999), eps 1e-8, weight decay 0). Given: the kept tokens
    (their GMTS(): pinned by test_gmts' test_select_tokens_per_group_matches_the_literal_reference),
    pi_old's and pi_ref's log-probs, and the forward (response_hidden, the head, the same rows per
    micro-batch): what is compared is the update, not two forwards' rounding. logp_of(h, head, y):
    the log-probs (gmts.head_logp's bits, or theirs: _cross_entropy_logp); grads: a list that gets
    each parameter's gradient before the clip. -> the norm."""
    import numpy as np
    mask = batch["resp_mask"]
    N = mask.shape[0]
    lengths = mask.sum(1).tolist()  # |o_i|
    adv = []
    for b in range(N // G):
        r = rewards[b * G:(b + 1) * G].double().numpy()
        for j in range(G):
            a = (r[j] - np.mean(r)) / (np.std(r) + 1e-6)
            adv.append(a / (lengths[b * G + j] * G))
    adv = torch.tensor(adv, dtype=torch.float32)  # A', (N,)
    head = model.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    for start in range(0, N, micro):
        rows = slice(start, start + micro)
        m = mask[rows]
        h = gmts.response_hidden(model, batch, rows)[m]
        logp = logp_of(h, head, batch["comp_ids"][rows][m])
        a = adv[rows][:, None].expand_as(m)[m] * kept[rows][m]
        ratio = (logp - old_logp[rows][m]).exp()
        surr = torch.min(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
        log_ratio = ref_logp[rows][m] - logp
        n = torch.tensor(lengths[start:start + micro], dtype=torch.float32)[:, None].expand_as(m)[m]
        kl = (log_ratio.exp() - log_ratio - 1) / (G * n)
        (-surr + beta * kl).sum().backward()
    if grads is not None:
        grads.extend(p.grad.clone() for p in model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
    opt.step()
    return norm


def _cross_entropy_logp(h, head, y):
    """log p_y as GMTS-Framework1 computes it: minus the cross-entropy of the float logits."""
    logits = torch.nn.functional.linear(h, head.weight, head.bias).float()
    return -torch.nn.functional.cross_entropy(logits, y, reduction="none")


def _our_first_step(tmp_path, monkeypatch, informative):
    """--preset paper-math's first step (gmts.main, the real loop) on a fixed rollout batch of 64 x
    16 -> (batch, rewards, what step 1 used: kept tokens, pi_old's and pi_ref's log-probs, the
    weights before it, after it, the checkpoint folder)."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    _, tok = gmts.build_tiny()
    batch, rewards = _preset_batch(tok, informative)
    adv = gmts.group_advantages(rewards, 16)
    seen = {}

    def recording(name):
        real = getattr(gmts, name)

        def call(*a, **k):
            seen.setdefault(name, real(*a, **k))  # the first call: step 1's
            return seen[name]
        return call
    for name in ("batch_token_stats", "response_logp", "step_selection"):
        monkeypatch.setattr(gmts, name, recording(name))
    fixed = (batch, rewards, adv, [(batch, rewards, adv)])
    monkeypatch.setattr(gmts, "sample_groups", lambda *a, **k: fixed)
    gmts.main(["--preset", "paper-math", "--model", "tiny", "--data", write_math500(tmp_path),
               "--eval-data", f"aime24={write_aime(tmp_path)}", "--eval-samples", "1",
               "--max-new-tokens", "8", "--steps", "1", "--out", str(out)])
    start = AutoModelForCausalLM.from_pretrained(out / "ckpt-000000", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(out / "ckpt-000001", dtype=torch.float32)
    used = (seen["step_selection"], seen["batch_token_stats"][0], seen["response_logp"])
    return batch, rewards, used, start, ours, out


@pytest.mark.parametrize("informative", [1, 64])
def test_one_step_equals_the_authors_update(tmp_path, monkeypatch, informative):
    """--preset paper-math's first step (gmts.main, the real loop, a fixed rollout batch of 64 x 16)
    against _authors_update on the same batch from the same weights and the same log-prob bits:
    the parameters after the step are EQUAL (torch.equal): --loss-norm seq-sum is their sum over
    prompts, clipped at 1. With 1 informative group the clip does not act (their norm < 1); with
    64 it does. Measured before seq-sum, with our mean clipped at 1/64 and eps / 64: 799 of 90,880
    parameters differed where the clip acts (clip_grad_norm_'s 1e-6 is not scaled); with eps 1e-8
    (e3741a4) both cases."""
    import copy
    batch, rewards, used, start, ours, out = _our_first_step(tmp_path, monkeypatch, informative)
    theirs = copy.deepcopy(start).train()
    norm = _authors_update(theirs, batch, rewards, *used)
    assert (norm > 1.0) == (informative == 64), norm
    state = torch.load(out / "ckpt-000001" / "state.pt", weights_only=False)
    assert state["opt"]["param_groups"][0]["eps"] == 1e-8  # start_run's AdamW: torch's eps
    moved = 0
    for (name, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start.parameters()):
        p, q = p.detach(), q.detach()
        assert torch.equal(p, q), (name, float((p - q).abs().max()))
        moved += int((p != p0).sum())
    n = sum(p.numel() for p in start.parameters())
    assert moved > 0.9 * n  # a real step, not a no-op


def _logp_table(model, batch, logp_of, micro=4):
    """(N, T) log-probs of the answers' tokens by logp_of, no gradient (pi_old's, pi_ref's)."""
    mask = batch["resp_mask"]
    table = torch.zeros(mask.shape)
    with torch.no_grad():
        for start in range(0, mask.shape[0], micro):
            rows = slice(start, start + micro)
            h = gmts.response_hidden(model, batch, rows)[mask[rows]]
            table[rows][mask[rows]] = logp_of(h, model.get_output_embeddings(),
                                              batch["comp_ids"][rows][mask[rows]])
    return table


@pytest.mark.parametrize("informative", [1, 64])
def test_one_step_is_the_authors_update_with_their_log_probs_up_to_rounding(tmp_path, monkeypatch,
                                                                              informative):
    """Framework1 takes log p_y as -cross_entropy(logits) (pi_theta's, and pi_old's and pi_ref's:
    at step 1 all from the start weights); gmts.py as z_y - logsumexp(z). The values are the same
    bits here, their backward is not, so the update is theirs up to float rounding only: the
    gradient within 5e-7 of ours relative to its norm (measured: 3.6e-7 with 1 informative group,
    4.3e-7 with 64), the weights after the step within 5e-7 (measured: ~690 of 90,880 differ, by
    <= 1.4e-7). Ours: _authors_update on our log-probs, whose step is torch.equal to gmts.main's."""
    import copy
    batch, rewards, used, start, ours, _ = _our_first_step(tmp_path, monkeypatch, informative)
    ce = _logp_table(start, batch, _cross_entropy_logp)
    mine, theirs, g_mine, g_theirs = copy.deepcopy(start).train(), copy.deepcopy(start).train(), [], []
    _authors_update(mine, batch, rewards, *used, grads=g_mine)
    _authors_update(theirs, batch, rewards, used[0], ce, ce, logp_of=_cross_entropy_logp,
                    grads=g_theirs)
    norm = math.sqrt(sum(float((a.double() ** 2).sum()) for a in g_mine))
    off = math.sqrt(sum(float(((b - a).double() ** 2).sum()) for a, b in zip(g_mine, g_theirs)))
    assert off <= 5e-7 * norm, off / norm
    for p, q, r in zip(ours.parameters(), mine.parameters(), theirs.parameters()):
        p, q, r = p.detach(), q.detach(), r.detach()
        assert torch.equal(p, q)  # _authors_update on our log-probs is gmts.main's step
        assert float((p - r).abs().max()) <= 5e-7


# ---- bad input: one line, exit 2 -------------------------------------------------------------------------------------
SMALL_MATH = ["--model", "tiny", "--task", "math", "--prompts-per-step", "2", "--group-size", "2",
              "--max-new-tokens", "8", "--steps", "1", "--eval-every", "0", "--save-every", "0"]


@pytest.mark.parametrize("flags,needle", [
    (["--data", "{math500_bad}"], 'math500.jsonl line 2: "answer" must be'),
    (["--data", "{math500}", "--eval-data", "aime24={aime_bad}"], 'aime.csv row 2: "answer" must be'),
    (["--data", "{math500}", "--eval-data", "x={broken_parquet}"], "broken.parquet: cannot read it"),
    (["--data", "{math500}", "--eval-data", "x={tmp}/missing.csv"], "missing.csv: cannot read it (not a regular file)"),
    (["--data", "{math500}", "--eval-data", "aime24"], "entries NAME=DATA"),
    (["--data", "{math500}", "--eval-data", "acc={math500}"], "entries NAME=DATA"),
    (["--task", "countdown", "--data", "easy", "--prompt-style", "qwen-math"], "--task math only"),
])
def test_bad_rows_and_benchmark_files_are_one_line_and_exit_2(tmp_path, capsys, verifier, flags, needle):
    files = {"math500": lambda: write_math500(tmp_path), "math500_bad": lambda: write_math500(tmp_path / "b", True),
             "aime_bad": lambda: write_aime(tmp_path, True), "tmp": lambda: str(tmp_path),
             "broken_parquet": lambda: (tmp_path / "broken.parquet").write_text("not parquet") and
             str(tmp_path / "broken.parquet")}
    os.makedirs(tmp_path / "b")
    argv = [*SMALL_MATH, "--out", str(tmp_path / "o")]
    for flag in flags:
        for key, make in files.items():
            if "{" + key + "}" in flag:
                flag = flag.replace("{" + key + "}", make())
        argv.append(flag)
    with pytest.raises(SystemExit) as e:
        gmts.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmts: error: ") and needle in lines[0], err
    assert not (tmp_path / "o" / "ckpt-000000").exists()  # refused before step 0


# ---- what the line budget of the first pass left out ----------------------------------------------------------------
def test_data_columns_read_a_layout_of_its_own(tmp_path, verifier, capsys):
    """--data-columns QUESTION,ANSWER (a.b: a key inside a) maps a file the published layouts do not cover; a value
    that is not two columns, or on another task, is one line, exit 2."""
    path = _jsonl(tmp_path / "own.jsonl", [{"query": "What is $2+2$?", "meta": {"gold": "4"}},
                                            {"query": "Simplify $\\frac{2}{4}$.", "meta": {"gold": "\\frac12"}}])
    cfg = gmts.parse_args(["--task", "math", "--data", path, "--data-columns", "query,meta.gold", "--eval-size", "1"])
    data = gmts.read_data(cfg)
    assert data.held == [{"question": "What is $2+2$?", "answer": "4", "latex": True}]
    assert data.draw(1, 0) == [{"question": "Simplify $\\frac{2}{4}$.", "answer": "\\frac12", "latex": True}]
    with pytest.raises(ValueError, match='missing key "question"'):  # without the flag: a layout it does not know
        gmts.load_rows("math", path, 0)
    for flags in (["--task", "math", "--data-columns", "query"], ["--data-columns", "a,b"]):
        with pytest.raises(SystemExit) as e:
            gmts.main([*flags, "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--data-columns" in err, err


def test_benchmark_files_and_dataset_folders_are_stored_absolute(tmp_path, monkeypatch):
    """As --data's file: a resume from another working folder finds --eval-data's files and hf: dataset folders."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sets").mkdir()
    (tmp_path / "a.jsonl").write_text("")
    cfg = gmts.parse_args(["--task", "math", "--data", "hf:./sets:train", "--eval-data",
                           "a=a.jsonl,b=hf:./sets,c=hf:x/y,d=hf:sets"])  # d: no slash, the task's own hub set
    assert cfg.data == f"hf:{tmp_path / 'sets'}:train"
    assert cfg.eval_data == f"a={tmp_path / 'a.jsonl'},b=hf:{tmp_path / 'sets'},c=hf:x/y,d=hf:sets"  # hub ids stay
    assert gmts.resolved_paths(cfg) == cfg


def test_the_verifier_worker_dies_with_its_parent(tmp_path):
    """A parent killed while its worker hangs in sympy (\\boxed{9^{9^{9^{9}}}}) leaves no worker running."""
    code = ("import threading, time, os, gmts\n"
            "threading.Thread(target=gmts.latex_equal, args=('1', '9^{9^{9^{9}}}', 60), daemon=True).start()\n"
            "while not [s for s in gmts._VERIFIER['slots'] if s['proc']]: time.sleep(0.05)\n"
            "print([s for s in gmts._VERIFIER['slots'] if s['proc']][0]['proc'].pid, flush=True)\n"
            "time.sleep(60)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=os.path.dirname(os.path.abspath(gmts.__file__)))
    pid = int(parent.stdout.readline())
    time.sleep(2)  # the worker is up and inside the hang
    os.kill(pid, 0)  # alive
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    raise AssertionError(f"the worker {pid} outlived its parent by 10 s")


def test_the_memory_plan_by_hand(tiny_model):
    """memory_plan's terms for the tiny model on a CPU (4-byte activations, no sampler copy), each
    phase written out and made the largest in turn: sampling (the KV cache of all B*G answers of one
    generate() call and the prefill of their prompts), the same with --rollout-rows, evaluation
    (--eval-samples k: max(64 // k, 1) * k answers a rollout) and the update (gradients, what the
    layers keep, the loss head's chunk, at most the micro-batch's tokens); a device too small gets
    the first fix that fits, or the flags to lower when none does."""
    model, _ = tiny_model
    n = sum(p.numel() for p in model.parameters())  # d 32, 2 layers, 4 heads of 8, 2 KV, d_ff 64
    cpu, P, T = torch.device("cpu"), 28, 100
    kv = 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, head size, fp32
    forward = 4 * (2 * 32 + 3 * 64 + 4 * P)  # a prefill per token (CPU: 4 heads x P scores)
    stay = {"weights": 4 * n, "AdamW": 8 * n, "KL reference": 4 * n}

    def gib(parts):
        return pytest.approx({k: v / 2**30 for k, v in parts.items()}, rel=1e-12)
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=T, kl_beta=0.1,
                      micro_batch=2)
    assert gmts.memory_plan(cfg, model, P, cpu) == gib(dict(stay, **{
        "KV cache": kv * 1024 * (P + T), "prefill": 1024 * forward * P}))
    rows = gmts.dataclasses.replace(cfg, rollout_rows=100, eval_samples=64)  # 6 prompts x 16
    assert gmts.memory_plan(rows, model, P, cpu) == gib(dict(stay, **{
        "KV cache": kv * 96 * (P + T), "prefill": 96 * forward * P}))
    ev = gmts.dataclasses.replace(cfg, prompts_per_step=1, group_size=2, eval_samples=80)
    assert gmts.memory_plan(ev, model, P, cpu) == gib(dict(stay, **{
        "eval KV cache": kv * 80 * (P + T), "eval prefill": 80 * forward * P}))
    up = gmts.Config(prompts_per_step=1, group_size=2, max_new_tokens=T, micro_batch=64)
    layer = 4 * (9 * 32 + 4 * 64 + 4 * (P + T))  # what one layer keeps per token, fp32
    kept = 2 * layer + 4 * (2 * 32 + 3 * 64 + 4 * (P + T))  # 2 layers, and backward's temporaries
    assert gmts.memory_plan(up, model, P, cpu) == gib({
        "weights": 4 * n, "AdamW": 8 * n, "gradients": 4 * n, "activations": kept * 64 * (P + T),
        "loss head": 16 * 1024 * 259})
    need = sum(gmts.memory_plan(up, model, P, cpu).values())
    with_ckpt = gmts.dataclasses.replace(up, grad_ckpt=True)
    ckpt = sum(gmts.memory_plan(with_ckpt, model, P, cpu).values())
    assert ckpt < need  # with 2 layers, checkpointing keeps one layer's activations at a time
    line = gmts.memory_line(up, model, P, cpu, have=ckpt)
    assert line.startswith("memory plan (GiB): weights"), line
    assert line.endswith("too much: --grad-ckpt fits"), line
    line = gmts.memory_line(up, model, P, cpu, have=ckpt * 0.99)
    assert line.endswith("too much: --grad-ckpt --micro-batch 1 fits"), line
    line = gmts.memory_line(up, model, P, cpu, have=1e-9)
    assert line.endswith("--eval-samples or --max-new-tokens"), line
    assert "too much" not in gmts.memory_line(up, model, P, cpu, have=need)
    big = sum(gmts.memory_plan(cfg, model, P, cpu).values())
    half = gmts.dataclasses.replace(cfg, rollout_rows=512)
    fits = sum(gmts.memory_plan(half, model, P, cpu).values())
    line = gmts.memory_line(cfg, model, P, cpu, have=fits)
    assert big > 1.5 * fits
    assert line.endswith("too much: --rollout-rows 512 fits"), line  # sampling's own fix, first


def test_the_memory_plan_reads_other_configs():
    """GPT-2 (n_embd, n_layer, n_head; n_inner None: 4 d) and GPT-NeoX (no num_key_value_heads) by
    hand; a config without the sizes: the plan is unknown, said in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
    cpu, P = torch.device("cpu"), 10
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=10)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300))
        neox = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=3,
                                                num_attention_heads=4, intermediate_size=48,
                                                vocab_size=300))
    for model, layers, d_ff in ((gpt2, 2, 128), (neox, 3, 48)):
        plan = gmts.memory_plan(cfg, model, P, cpu)
        assert plan["KV cache"] == 2 * layers * 4 * 8 * 4 * 1024 * (P + 10) / 2**30  # all 4 heads
        assert plan["prefill"] == 1024 * 4 * (2 * 32 + 3 * d_ff + 4 * P) * P / 2**30
    blank = types.SimpleNamespace(config=types.SimpleNamespace(), parameters=lambda: iter(()))
    assert gmts.memory_plan(cfg, blank, P, cpu) == {}
    line = gmts.memory_line(cfg, blank, P, cpu)
    assert line.startswith("memory plan: unknown for this architecture"), line


def test_rollout_rows_samples_whole_groups_per_call(tmp_path, monkeypatch):
    """--rollout-rows 4 with 2 prompts x 4 answers: two generate() calls of one group each, joined
    as one batch of 8 answers (each answer's rows padded as dynamic sampling joins batches), and the
    evaluation rolls out 4 answers at a time; the run trains as before (every step logged)."""
    real, calls = gmts.rollout, []

    def counting(model, tok, prompts, group_size, *a, **k):
        calls.append(len(prompts) * group_size)
        return real(model, tok, prompts, group_size, *a, **k)
    monkeypatch.setattr(gmts, "rollout", counting)
    out = tmp_path / "o"
    gmts.main(["--preset", "smoke", "--rollout-rows", "4", "--no-filter-groups", "--steps", "1",
               "--eval-every", "0", "--out", str(out)])
    assert calls == [4] * (1 + 2 + 1), calls  # evaluation (4 rows), the step's 2 calls, evaluation
    assert [r["step"] for r in gmts.read_metrics(str(out))] == [0, 1]
