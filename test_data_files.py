"""Issue 42 items 1-3, 8, 9 and issue 44's golds and --data-columns: math rows as published.

testdata/ holds small slices of Qwen2.5-Math's evaluation files (testdata/README.md names each
source) and two files written here by hand in published layouts (MATH's train split,
DAPO-Math-17k). Every row must load and grade its own gold as 1.0; the grading rule is the row's
(its gold, where its prompt puts the answer), never its file's layout.
"""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

import gmts

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "testdata")
SLICES = {"aime24.jsonl": 20, "amc23.jsonl": 40, "minerva_math.jsonl": 33, "math500.jsonl": 30,
          "olympiadbench.jsonl": 22, "math_train_layout.jsonl": 8, "dapo_layout.jsonl": 3}
reward = gmts.TASKS["math"]["reward"]


def box(s):
    return f"So the final answer is $\\boxed{{{s}}}$."


def answer_as_asked(row, gold):
    """A completion that puts gold where the row's prompt asks for it."""
    return f"Step by step.\nAnswer: {gold}" if row.get("answer_line") else box(gold)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def verifier():
    assert gmts.latex_equal("2", "2") is True


@pytest.mark.parametrize("name", sorted(SLICES))
def test_every_row_of_the_real_files_loads_and_grades_its_own_gold(name, verifier):
    """Every row loads (no --skip-bad-rows: a bad row would raise), its gold where its prompt asks
    earns 1.0, and another row's different gold earns 0 (no false positive)."""
    rows = gmts.load_rows("math", os.path.join(TESTDATA, name), 0)
    assert len(rows) == SLICES[name]
    for i, row in enumerate(rows):
        assert reward(answer_as_asked(row, row["answer"]), row) == 1.0, (name, i, row["answer"])
        other = rows[i - 1]["answer"]
        if gmts.bare_answer(other) != gmts.bare_answer(row["answer"]):
            assert reward(answer_as_asked(row, other), row) == 0.0, (name, i, row["answer"], other)


def test_solution_only_rows_take_the_solution_s_last_box(verifier):
    """Qwen2.5-Math's minerva_math (problem, solution, type, idx) and MATH's train layout
    (problem, level, type, solution): the gold is the solution's last \\boxed{}, as the field's
    harnesses take it."""
    minerva = gmts.load_rows("math", os.path.join(TESTDATA, "minerva_math.jsonl"), 0)
    with open(os.path.join(TESTDATA, "minerva_math.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    assert [r["question"] for r in minerva] == [r["problem"] for r in raw]
    assert minerva[0]["answer"] == "1.6"  # '... $\\boxed{1.6}$ cm.' in its solution
    hendrycks = gmts.load_rows("math", os.path.join(TESTDATA, "math_train_layout.jsonl"), 0)
    want = ["7\\text{ hours}.", "\\sin^2 t", "30^\\circ.", "a + b + c"]
    assert [r["answer"] for r in hendrycks[:4]] == want


def test_golds_math_verify_misreads_are_normalised_and_graded_as_meant(verifier):
    """MATH train's golds that math-verify 0.9 cannot read as written (the issue's four) are read
    after normal_answer: equivalent answers earn 1.0, wrong ones 0, none needs the fallback."""
    rows = gmts.load_rows("math", os.path.join(TESTDATA, "math_train_layout.jsonl"), 0)[:4]
    for row in rows:
        assert not gmts.latex_equal(row["answer"])  # as written: unreadable
        assert not row.get("fallback")
    cases = [(0, "7", "8"), (0, "7\\text{ hours}", "7\\text{ days}0"),
             (1, "\\sin^{2}(t)", "\\cos^2 t"),
             (1, "1 - \\cos^2 t", "\\sin t"), (2, "30", "60^\\circ"), (2, "30^{\\circ}", "31"),
             (3, "c+b+a", "a + b"), (3, "a+b+c", "a b c")]
    for i, right, wrong in cases:
        verdicts = (reward(box(right), rows[i]), reward(box(wrong), rows[i]))
        assert verdicts == (1.0, 0.0), (rows[i]["answer"], right)


def test_a_gold_math_verify_cannot_read_is_graded_by_exact_match_and_listed(tmp_path, verifier,
                                                                           capsys):
    """E_{1},E_{2} (Minerva) and m_{\\max }=n^{2}-n-1 (OlympiadBench): kept, graded by
    bare_answer's exact match; a run counts them at its start and lists them in
    OUT/fallback_rows.jsonl."""
    minerva = os.path.join(TESTDATA, "minerva_math.jsonl")
    read = gmts.load_rows("math", minerva, 0)
    read += gmts.load_rows("math", os.path.join(TESTDATA, "olympiadbench.jsonl"), 0)
    rows = {r["answer"]: r for r in read}
    e12, m = rows["E_{1},E_{2}"], rows["$m_{\\max }=n^{2}-n-1$"]
    assert e12["fallback"] and m["fallback"]
    assert reward(box("E_1, E_2"), e12) == 1.0 and reward(box("E_{1}"), e12) == 0.0
    assert reward(box("E_2, E_1"), e12) == 0.0  # exact: an order is not forgiven
    assert reward(box("m_{\\max} = n^2 - n - 1"), m) == 1.0
    assert reward(box("m_{\\max}=n^2-n"), m) == 0.0
    out = tmp_path / "run"
    gmts.main(["--model", "tiny", "--task", "math", "--data", minerva, "--prompts-per-step", "2",
               "--group-size", "2", "--max-new-tokens", "4", "--steps", "1", "--eval-size", "2",
               "--eval-every", "0", "--save-every", "0", "--prompt-style", "qwen-math",
               "--out", str(out)])
    listed = [json.loads(line) for line in (out / "fallback_rows.jsonl").read_text().splitlines()]
    dm = "\\frac{dM}{dt}=\\frac{10^{5} L_{\\odot}}{0.007 c^{2} M_{\\odot}^{6}} M^{6}"
    want = ["np.arcsin(10/13)", dm, "-1./3", "-3./2", "E_{1},E_{2}"]
    assert [r["answer"] for r in listed] == want
    assert listed[-1]["where"].endswith("minerva_math.jsonl line 33")
    assert "5 rows graded by exact match" in capsys.readouterr().out


def test_the_same_rows_in_two_layouts_get_the_same_verdicts(tmp_path, verifier):
    """AMC23 in question/answer (its hub copy), problem/answer (MATH-500's) and --data-columns'
    layout: the same rows, the same verdict on every completion; the boxed rule: a bare last
    number earns nothing."""
    with open(os.path.join(TESTDATA, "amc23.jsonl")) as f:
        raw = [json.loads(line) for line in f][:10]
    layouts = [[{"question": r["question"], "answer": r["answer"]} for r in raw],
               [{"problem": r["problem"], "answer": r["answer"]} for r in raw],
               [{"q": r["question"], "meta": {"gold": r["answer"]}} for r in raw]]
    read = []
    for i, rows in enumerate(layouts):
        path = _jsonl(tmp_path / f"l{i}.jsonl", rows)
        read.append(gmts.load_rows("math", path, 0, columns="q,meta.gold" * (i == 2)))
    verdicts = []
    for rows in read:
        verdicts.append([reward(c, r) for r in rows for c in (
            box(r["answer"]), f"The answer is {r['answer']}", f"#### {r['answer']}", box("1234567"),
            f"\\boxed{{{r['answer']}}} no, \\boxed{{1234567}}")])
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert verdicts[0][:5] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_gsm8k_rows_keep_their_rule():
    """A gold given as GSM8K's '... #### N' (the hub's gsm8k, a copy of it) and generated rows:
    the last \\boxed{}, else the number after ####, else the last number, as before."""
    row = gmts._check_row({"question": "q", "answer": "2 + 2 = 4\n#### 4"}, "math")
    assert row == {"question": "q", "answer": "4", "steps": ["2 + 2 = 4"]}
    for rows in ([row], gmts.load_rows("math", "gen", 3, 0)):
        for r in rows:
            assert reward(f"so {r['answer']}", r) == 1.0 and reward(f"#### {r['answer']}", r) == 1.0
            assert reward(box(r["answer"]), r) == 1.0 and reward("so 100000", r) == 0.0


def test_a_dapo_row_s_own_instruction_counts(verifier):
    """DAPO-Math-17k's prompt asks for a last line 'Answer: N': that line earns the reward, and no
    style adds a system line, prefill or suffix that contradicts it."""
    rows = gmts.load_rows("math", os.path.join(TESTDATA, "dapo_layout.jsonl"), 0)
    row = rows[0]
    assert row["answer_line"] and row["answer"] == "9"
    assert reward("36 = 2^2 3^2, so (2+1)(2+1).\nAnswer: 9", row) == 1.0
    assert reward("Answer: $9$", row) == 1.0 and reward("Answer: \\boxed{9}", row) == 1.0
    assert reward("Answer: 8", row) == 0.0
    assert reward(box("9"), row) == 0.0  # not where the row asks
    model, tok = gmts.build_tiny(hidden=16, layers=1)
    task = gmts.get_task("math")
    want = tok.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                   add_generation_prompt=True)
    for style in ("ours", "qwen-math", "boxed-suffix"):
        assert gmts.build_prompts(tok, task, [row], True, style=style) == [want]
    plain = {"question": "What is $1+1$?", "answer": "2", "latex": True}
    qwen = gmts.build_prompts(tok, task, [plain], True, False, "qwen-math")[0]
    assert gmts.QWEN_MATH_SYSTEM in qwen


def test_golds_must_be_finite(tmp_path, verifier):
    """JSONL NaN / Infinity and a parquet NaN cell are refused (sympy reads "nan" as n*a*n), and
    so is a gold longer than any boxed answer the grader reads."""
    import datasets
    path = tmp_path / "nan.jsonl"
    path.write_text('{"question": "q", "answer": NaN}\n{"question": "q", "answer": "-Infinity"}\n')
    with pytest.raises(ValueError) as e:
        gmts.load_rows("math", str(path), 0)
    assert "line 1: \"answer\" must be a finite number" in str(e.value)
    assert "nan.jsonl line 2: " in str(e.value)
    parquet = str(tmp_path / "nan.parquet")
    cells = [{"problem": "p", "answer": 1.5}, {"problem": "p", "answer": float("nan")}]
    datasets.Dataset.from_list(cells).to_parquet(parquet)
    with pytest.raises(ValueError, match=r"nan.parquet row 2: \"answer\" must be a finite number"):
        gmts.load_rows("math", parquet, 0)
    with pytest.raises(ValueError, match=r"<= 1,000 characters"):  # no boxed answer reaches it
        gmts._check_row({"question": "q", "answer": "x" * 1001}, "math")


def test_bad_rows_are_all_named_in_one_line(tmp_path, verifier):
    """Up to 20 bad rows named, then a count; the message names the answer columns looked for."""
    rows = [{"problem": f"p{i}", "level": "Level 1"} for i in range(25)]
    rows.append({"problem": "ok", "answer": "1"})
    with pytest.raises(ValueError) as e:
        gmts.load_rows("math", _jsonl(tmp_path / "d.jsonl", rows), 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.count("d.jsonl line ") == 20
    assert msg.endswith("; and 5 more bad rows")
    looked = "(looked for the answer in: answer, Answer, final_answer, "
    assert f"d.jsonl line 20: missing key \"answer\" {looked}" in msg
    assert "solution (its last \\boxed{})" in msg


def test_data_columns_name_columns_the_rows_have(tmp_path, verifier):
    """--data-columns is the layout: a column the rows lack is named, never another layout
    taken instead."""
    path = _jsonl(tmp_path / "d.jsonl", [{"problem": "What is 2+2?", "answer": "4"}])
    said = '--data-columns problme,answer: the row has no column "problme"'
    with pytest.raises(ValueError, match=said):
        gmts.load_rows("math", path, 0, columns="problme,answer")
    assert gmts.load_rows("math", path, 0, columns="problem,answer")[0]["answer"] == "4"


def test_skip_bad_rows_trains_without_them_and_lists_them(tmp_path, verifier, capsys):
    rows = [{"question": "What is 1+1?", "answer": "2"}, {"question": "no answer"},
            {"question": "What is 2+2?", "answer": "{4"},
            {"question": "What is 3+3?", "answer": "6"},
            {"question": "What is 4+4?", "answer": "8"}]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    argv = ["--model", "tiny", "--task", "math", "--data", data, "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--steps", "1", "--eval-size", "1",
            "--eval-every", "0", "--save-every", "0"]
    with pytest.raises(SystemExit) as e:
        gmts.main([*argv, "--out", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "d.jsonl line 2: missing key \"answer\"" in err and "d.jsonl line 3: " in err
    assert not (tmp_path / "refused" / "ckpt-000000").exists()
    out = tmp_path / "kept"
    gmts.main([*argv, "--skip-bad-rows", "--out", str(out)])
    listed = [json.loads(line) for line in (out / "skipped_rows.jsonl").read_text().splitlines()]
    assert [r["where"] for r in listed] == [f"{data} line 2", f"{data} line 3"]
    assert listed[1]["why"].startswith('"answer" must be')
    assert "2 rows of --data left out (--skip-bad-rows)" in capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]


def test_the_paper_math_preset_reaches_its_steps_on_a_math_file(tmp_path, capsys):
    """--preset paper-math, --model tiny, a MATH-layout training file and two benchmark slices,
    lengths capped."""
    out = tmp_path / "run"
    bench = f"amc23={TESTDATA}/amc23.jsonl,minerva={TESTDATA}/minerva_math.jsonl"
    gmts.main(["--preset", "paper-math", "--model", "tiny", "--data", gmts.MATH_EXAMPLE,
               "--eval-data", bench, "--eval-samples", "1", "--steps", "2",
               "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
               "--out", str(out)])
    said = capsys.readouterr().out
    assert "step 2 |" in said and "| 2 held-out sets |" in said
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]


def test_offline_the_math_hint_names_a_math_file():
    """The preset's hub set offline: the hint names a MATH-layout file, not the GSM8K-style
    generator."""
    with pytest.raises(ValueError) as e:
        gmts.load_rows("math", "hf:hiyouga/math12k:train", 0)
    assert gmts.MATH_EXAMPLE in str(e.value) and "--data gen" not in str(e.value)
    assert os.path.isfile(gmts.MATH_EXAMPLE)
