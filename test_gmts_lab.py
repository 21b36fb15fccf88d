"""Tests for gmts_lab.py, in the order of its sections. Offline, CPU:  python -m pytest -q test_gmts_lab.py

test_warm_start_rebuilds_bit_identical retrains the committed warm starts (countdown, math, logic,
commonsense: 3-10 minutes each on one thread), so it runs only with GMTS_SLOW=1:
GMTS_SLOW=1 python -m pytest -q test_gmts_lab.py -k rebuild. The rest take seconds, but
test_compare_workers_stop_with_the_parent (a second process: 15-40 s).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import collections
import importlib.util
import json
import math
import multiprocessing
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import gmts
import gmts_lab as lab

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok
TWO_STEPS = {"question": "Eve has 2 bags of 3 apples and buys 1 more. How many apples now?", "answer": "7",
             "steps": ["2 * 3 = 6", "6 + 1 = 7"]}  # a math row of two steps



def _batch_from(model, tok, seed=0, n_prompts=3, G=4, new=10):
    torch.manual_seed(seed)
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "x", "Use 9 9 to make 81.",
                                                          "Make 5 from 1 2 2."]]
    b = gmts.rollout(model, tok, prompts[:n_prompts], G, new)
    adv = gmts.group_advantages(torch.tensor([float(i % 3 == 0) for i in range(n_prompts * G)]), G)
    return b, adv


# ---- warm start --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(gmts.TASKS))
@pytest.mark.parametrize("data", ["gen", "easy"])
def test_references_score_one_and_generators_are_deterministic(task, data):
    t = gmts.get_task(task)
    rows = gmts.load_rows(task, data, 200, 1)
    assert rows == gmts.load_rows(task, data, 200, 1)
    assert rows != gmts.load_rows(task, data, 200, 2)
    refs = [lab.REFERENCES[task](row) for row in rows]
    assert gmts.grade_answers(t, refs, rows)[0].tolist() == [1.0] * len(rows)  # code: a batch
    for row, ref in zip(rows, refs):
        if task == "code":  # a ```python block, no tags
            assert ref.startswith("```python\n") and ref.endswith("```") and "<" not in ref
        else:
            assert "**" not in ref and ref.count("</think>") == 1 and "<think>" not in ref
            assert "<answer>" in t["prompt"](row) and "<think>" in t["prompt"](row)
        assert t["reward"]("no answer here", row) == 0.0
        for short in (False, True):
            assert isinstance(t["prompt"](row, short=short), str)


def test_blind_warm_up_shows_the_real_prompts_and_imitates_random_answers(monkeypatch):
    """blind: every warm-up prompt is the row's own, and the answer it is trained on is a random well-formed one over
    the same numbers (with its true value), not the solution; without blind it is the solution."""
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    task = gmts.get_task("countdown")
    rows = gmts.load_rows("countdown", "easy", 40, seed=0)
    draw = lambda n, *key: random.Random(str(key)).choices(rows, k=n)  # noqa: E731
    seen = {"prompts": [], "answers": []}
    build, ref = gmts.build_prompts, lab.REFERENCES["countdown"]

    def spy_build(*a, **k):
        prompts = build(*a, **k)
        seen["prompts"] += prompts
        return prompts

    def spy_ref(row):
        seen["answers"].append(row)
        return ref(row)
    monkeypatch.setattr(gmts, "build_prompts", spy_build)
    monkeypatch.setitem(lab.REFERENCES, "countdown", spy_ref)
    for blind in (True, False):
        seen["prompts"].clear(), seen["answers"].clear()
        lab.sft_warmup(model, tok, "countdown", draw, chat=True, short=True, steps=4, lr=1e-3, batch_size=8, seed=0,
                       blind=blind, log=None)
        assert len(seen["prompts"]) == len(seen["answers"]) == 32
        same = 0
        for prompt, ans in zip(seen["prompts"], seen["answers"]):
            m = re.search(r"Make (\d+) from (\d) (\d) (\d)\.", prompt)
            row = next(r for r in rows if task["prompt"](r, short=True) == m.group(0))  # the prompt is a row's own
            assert ans["nums"] == row["nums"]
            value = gmts.countdown_value(f"<answer>{ans['expr']}</answer>", row["nums"])
            assert value == ans["target"] >= 0 and re.fullmatch(r"\d [+-] \d [+-] \d", ans["expr"]), ans
            assert lab.well_formed(ref(ans), row)
            same += ans == row
        assert same == 32 if not blind else same < 24  # blind: mostly not the solution (3 or 4 patterns allowed)
    with pytest.raises(gmts.BadInput, match="one-step rows"):  # math's blind answers need easy math rows
        lab.sft_warmup(model, tok, "math", lambda n, *key: [TWO_STEPS] * n, True, True, 1, 1e-3,
                       2, 0, blind=True, log=None)


def test_countdown_blind_draws_each_nonnegative_sign_pattern_equally_often():
    def draws(nums, n=3000):
        rng = random.Random(0)
        return collections.Counter(lab.countdown_blind({"nums": nums, "target": 0}, rng)["expr"] for _ in range(n))
    c = draws([4, 3, 2])  # 4 - 3 - 2 = -1 is never drawn; the other three patterns a third each
    assert set(c) == {"4 + 3 + 2", "4 + 3 - 2", "4 - 3 + 2"} and all(900 < v < 1100 for v in c.values())
    c = draws([50, 25, 3, 1], 4000)  # four numbers: all 8 patterns are >= 0, an eighth each
    assert len(c) == 8 and all(400 < v < 600 for v in c.values())
    for row in ({"nums": [7, 1, 5], "target": 3}, {"nums": [7, 1, 5], "target": 13}):  # the target is not read
        assert lab.countdown_blind(row, random.Random(5))["expr"] == lab.countdown_blind(
            {"nums": [7, 1, 5], "target": 1}, random.Random(5))["expr"]
    got = lab.countdown_blind({"nums": [9, 8, 7], "target": 24}, random.Random(1))  # a .jsonl row: no 'expr'
    assert lab.countdown_reference(got).endswith(f"<answer>{got['expr']}</answer>")
    assert lab.countdown_blind({"nums": [], "target": 1}, random.Random(0)) == {"nums": [], "target": 1}
    with pytest.raises(gmts.BadInput, match="generated row"):
        lab.countdown_reference({"nums": [9, 8, 7], "target": 24})


def test_math_blind_keeps_the_numbers_and_draws_each_operation_equally_often():
    rows = gmts.load_rows("math", "easy", 300, seed=0)
    rng, ops = random.Random(0), collections.Counter()
    for row in rows:
        got = lab.math_blind(row, rng)
        cue, step = got["steps"][0].split(": ")
        a, op, b, eq, z = step.split()
        assert (a, b, eq) == tuple(row["steps"][0].split()[i] for i in (0, 2, 3)) and got["question"] == row["question"]
        assert f" {cue}" in row['question'] and cue.split()[-1] == b  # the word before b, copied with b
        assert int(z) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] >= 0
        assert got["answer"] == z and gmts.get_task("math")["reward"](lab.math_reference(got), got) == 1.0
        ops[op] += 1
    assert set(ops) == {"+", "-", "*"} and all(70 < v < 130 for v in ops.values())  # 100 each expected
    for bad in ({"question": "q", "answer": "3"}, TWO_STEPS):
        with pytest.raises(gmts.BadInput, match="one-step rows"):
            lab.math_blind(bad, rng)


def test_logic_blind_names_everyone_in_order_with_fair_coins():
    rows = gmts.load_rows("logic", "easy", 400, seed=0)
    rng, knights, same = random.Random(0), 0, 0
    for row in rows:
        got = lab.logic_blind(row, rng)
        assert list(got["solution"]) == row["names"] and got["statements"] == row["statements"]
        assert gmts.get_task("logic")["reward"](lab.logic_reference(got), got) == 1.0
        knights += sum(got["solution"].values())
        same += got["solution"] == row["solution"]
    assert 340 < knights < 460 and 70 < same < 130  # 400 of 800 roles, 100 of 400 rows (a quarter) expected


def test_commonsense_blind_copies_a_uniform_option_and_never_reads_the_question():
    """A blind key is uniform over the labels, whatever the row's own key; the question and the
    options stay; its reference boxes that option's text and earns 1.0 on the blind row; against
    the row's own key it is right about 1 time in 3."""
    rows = gmts.load_rows("commonsense", "easy", 600, seed=0)
    rng, keys, same = random.Random(0), collections.Counter(), 0
    reward = gmts.get_task("commonsense")["reward"]
    for row in rows:
        got = lab.commonsense_blind(row, rng)
        assert {k: v for k, v in got.items() if k != "answerKey"} == {
            k: v for k, v in row.items() if k != "answerKey"}
        ref = lab.commonsense_reference(got)
        text = got["choices"]["text"][got["choices"]["label"].index(got["answerKey"])]
        assert ref == f"</think>\n<answer>\\boxed{{{text}}}</answer>"
        assert reward(ref, got) == 1.0 and reward(ref, row) == float(got == row)
        keys[got["answerKey"]] += 1
        same += got == row
    assert set(keys) == {"A", "B", "C"} and all(150 < v < 250 for v in keys.values())  # 200 each
    assert 150 < same < 250  # a third of 600
    for row in ({**rows[0], "question": "Which of these is a tool?"}, rows[0]):  # not read
        assert lab.commonsense_blind(row, random.Random(3))["answerKey"] == lab.commonsense_blind(
            rows[0], random.Random(3))["answerKey"]


def test_random_content_accuracy_against_hand_values_and_sampling():
    assert lab.random_content_acc("countdown", [{"nums": [4, 3, 2], "target": 5}]) == pytest.approx(1 / 3)  # 9 5 3
    assert lab.random_content_acc("countdown", [{"nums": [4, 3, 2], "target": 6}]) == 0.0
    two = {"question": "", "answer": "4", "steps": ["2 * 2 = 4"]}  # 2 + 2 = 2 * 2 = 4, 2 - 2 = 0
    assert lab.random_content_acc("math", [two, {"question": "", "answer": "1", "steps": ["3 - 2 = 1"]}]) == 0.5
    assert lab.random_content_acc("logic", gmts.load_rows("logic", "easy", 5, seed=0)) == 0.25
    logic = [{"names": ["A", "B"], "solution": {"A": k, "B": n}} for k, n in ((True, False), (True, False), (0, 0))]
    assert lab.best_fixed_guess_acc("logic", logic) == pytest.approx(2 / 3)
    four = {"question": "", "answer": "6", "steps": ["4 + 2 = 6"]}
    assert lab.best_fixed_guess_acc("math", [two, four, {"question": "", "answer": "1", "steps": ["3 - 2 = 1"]}]) == (
        pytest.approx(2 / 3))  # + hits 2 + 2 and 4 + 2
    assert lab.best_fixed_guess_acc("countdown", [{"nums": [4, 3, 2], "target": 5}, {"nums": [1, 1, 1], "target": 1},
                                                  {"nums": [4, 3, 2], "target": 9}]) == pytest.approx(2 / 3)  # + -
    assert lab.random_content_acc("code", [{"op": "*"}, {"op": "%"}]) == pytest.approx(1 / 6)
    code_ops = [{"op": "*"}, {"op": "*"}, {"op": "+"}, {"op": "%"}]
    assert lab.best_fixed_guess_acc("code", code_ops) == 0.5
    five = gmts.load_rows("commonsense", "gen", 7, seed=0)  # five options: 1/5 a row
    assert lab.random_content_acc("commonsense", five) == pytest.approx(0.2)
    keys = collections.Counter(r["answerKey"] for r in five)
    words = collections.Counter(r["choices"]["text"][ord(r["answerKey"]) - 65] for r in five)
    best = max(max(keys.values()), max(words.values())) / 7  # one label, or one word, for all
    assert lab.best_fixed_guess_acc("commonsense", five) == best > 1 / 7
    dog = [{"question": "q", "choices": {"label": ["A", "B"], "text": texts}, "answerKey": key}
           for texts, key in ((["x", "dog"], "B"), (["dog", "y"], "A"), (["z", "dog"], "B"))]
    assert lab.best_fixed_guess_acc("commonsense", dog) == 1.0  # "dog" for all (B: 2 of 3)
    for task in ("countdown", "math", "logic", "code", "commonsense"):  # blind answers, on average
        rows, rng = gmts.load_rows(task, "easy", 300, seed=1), random.Random(1)
        t = gmts.get_task(task)
        blind = [(lab.REFERENCES[task](lab.BLIND[task](r, rng)), r) for r in rows for _ in range(4)]
        rewards = gmts.grade_answers(t, [b for b, _ in blind], [r for _, r in blind])[0].tolist()
        hits = sum(x == 1.0 for x in rewards)
        assert hits / 1200 == pytest.approx(lab.random_content_acc(task, rows), abs=0.05), task


@pytest.mark.parametrize("task", ["math", "logic", "code"])
def test_warm_up_at_a_tiny_size_is_deterministic_and_trains_on_blind_answers(task, tmp_path, monkeypatch):
    """Two tiny warm-ups give the same bits; the answers taught are BLIND[task]'s (their value or roles are true for
    the blind row, rarely the row's own), on the cpu preset's training rows, never its held-out ones."""
    taught = []
    blind = lab.BLIND[task]
    monkeypatch.setitem(lab.BLIND, task, lambda row, rng: taught.append((row, blind(row, rng))) or taught[-1][1])
    tiny = dict(hidden=16, layers=1, steps=3, batch_size=8, lr=1e-3)
    a, _ = lab.warm_start(str(tmp_path / "a"), task, log=None, **tiny)
    b, tok = lab.warm_start(str(tmp_path / "b"), task, log=None, **tiny)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert len(taught) == 48 and taught[:24] == taught[24:]
    held = gmts.read_data(lab.warm_config(task)).held
    assert lab.warm_config(task).task == task and not any(r in held for r, _ in taught)
    key = {"math": "answer", "logic": "solution", "code": "op"}[task]
    assert sum(r[key] != x[key] for r, x in taught) >= 6  # of 24: 3 in 4 (logic), 2 in 3 expected
    loaded, _ = gmts.load_model(str(tmp_path / "a"), torch.device("cpu"))
    assert loaded.config.hidden_size == 16 and torch.equal(loaded.lm_head.weight, a.lm_head.weight)


@pytest.mark.parametrize("task", ["math", "logic", "code", "commonsense"])
def test_committed_warm_start_is_small_and_trains_two_steps(task, tmp_path):
    """warm/math, warm/logic, warm/code, warm/commonsense: <= 2 MB, the recipe's size; gmts.train
    runs 2 steps from each with the flags docs/results.md gives (--preset cpu --task T --model
    warm/T), its first eval_acc from the committed weights."""
    path = lab.WARM[task]["out"]
    assert path == os.path.join(os.path.dirname(gmts.WARM_CPU), task)
    assert sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) <= 2_000_000
    model, _ = gmts.load_model(path, torch.device("cpu"))
    assert model.config.hidden_size == lab.WARM[task]["hidden"] and model.config.num_hidden_layers == 3
    cfg = gmts.parse_args(["--preset", "cpu", "--task", task, "--model", path, "--steps", "2", "--prompts-per-step",
                           "2", "--group-size", "4", "--eval-size", "4", "--eval-every", "1", "--out",
                           str(tmp_path / "run")])
    gmts.train(cfg, log=lambda *a: None)
    recs = gmts.read_metrics(cfg.out)
    assert [r["step"] for r in recs] == [0, 1, 2] and all("eval_acc" in r for r in recs)
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["model"] == path


def test_committed_warm_start_is_small_and_is_the_cpu_preset_model():
    files = os.listdir(gmts.WARM_CPU)
    assert "model.safetensors" in files and "config.json" in files
    assert sum(os.path.getsize(os.path.join(gmts.WARM_CPU, f)) for f in files) <= 2_000_000
    assert gmts.PRESETS["cpu"]["model"] == gmts.WARM_CPU
    model, tok = gmts.load_model(gmts.WARM_CPU, torch.device("cpu"))
    assert model.config.hidden_size == 96 and model.config.num_hidden_layers == 3
    assert sum(p.numel() for p in model.parameters()) == 274_944


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GMTS_SLOW") != "1",
                    reason="minutes long: GMTS_SLOW=1 python -m pytest -q -k rebuild")
@pytest.mark.parametrize("task", ["countdown", "math", "logic", "code", "commonsense"])
def test_warm_start_rebuilds_bit_identical(task, tmp_path):
    """gmts_lab.py warm --task T reproduces the committed warm start tensor for tensor, bit for bit (one thread)."""
    from safetensors.torch import load_file

    lab.warm_start(str(tmp_path), task, log=None)
    committed = lab.WARM[task]["out"]
    new, old = load_file(tmp_path / "model.safetensors"), load_file(os.path.join(committed, "model.safetensors"))
    assert new.keys() == old.keys()
    for k in old:
        assert torch.equal(new[k], old[k]), k
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_text() == open(os.path.join(committed, name)).read()


def test_decoy_separates_reading_the_target_from_guessing(monkeypatch):
    """An oracle that solves the prompt it is shown scores 1.0 on the real targets and falls on the decoys; a model
    that ignores the target (always +, +) scores the same on both; both write well-formed answers."""
    rows = gmts.load_rows("countdown", "easy", 64, seed=3)

    def oracle(model, tok, task, shown, *a):
        out = []
        for r in shown:
            signs = next((s for s in ("++", "+-", "-+", "--") if gmts._sign_chain(r["nums"], s)[0] == r["target"]),
                         "++")
            out.append(f"<answer>{gmts._sign_chain(r['nums'], signs)[1]}</answer>")
        return out
    monkeypatch.setattr(lab, "greedy_texts", oracle)
    ev = lab.decoy_eval(None, None, rows, True, True, 64)
    assert ev["real_acc"] == 1.0 and ev["decoy_acc"] < 0.5 and ev["real_valid"] == ev["decoy_valid"] == 1.0
    monkeypatch.setattr(lab, "greedy_texts", lambda m, t, task, shown, *a: [
        f"<answer>{gmts._sign_chain(r['nums'], '++')[1]}</answer>" for r in shown])
    ev = lab.decoy_eval(None, None, rows, True, True, 64)
    assert ev["real_acc"] == ev["decoy_acc"] > 0


# ---- comparison --------------------------------------------------------------------------------------------------


def test_compare_writes_a_table_and_a_plot(tmp_path, capsys):
    out, lines = tmp_path / "cmp", []
    cfg = gmts.parse_args(["--preset", "smoke", "--out", str(out)])
    table = lab.compare(cfg, ["all", "gmts@batch"], seeds=2, workers=2, log=lines.append)
    assert lines[0].startswith("4 runs (2 seed(s) x 2 method(s)) in 2 process(es), 1 thread(s) each")
    assert set(table) == {"all", "gmts@batch"} and all(len(v) == 2 for v in table.values())
    table = (out / "compare.md").read_text().splitlines()
    assert table[0].startswith("| method") and "standard error" in table[0]
    assert [x.split("|")[1].strip() for x in table[2:]] == ["all", "gmts@batch"]
    for row in table[2:]:  # mean +- std, and sqrt(p (1 - p) / eval_size) of that mean
        p = float(row.split("|")[3].split("+-")[0])
        assert float(row.split("|")[4]) == pytest.approx(math.sqrt(p * (1 - p) / 4), abs=1e-3)
    assert (out / "compare.png").stat().st_size > 1000
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["all-s0", "all-s1", "gmts@batch-s0",
                                                                    "gmts@batch-s1"]
    assert (out / ".gmts_lab_compare.run").is_file()  # the folder rule's mark: a compare lives here
    for run in ("all-s0", "gmts@batch-s1"):  # every run starts from the same model
        assert json.loads((out / run / "run_config.json").read_text())["model"] == gmts.WARM_CPU
    saved = json.loads((out / "gmts@batch-s1" / "run_config.json").read_text())
    assert (saved["select"], saved["scope"]) == ("gmts", "batch")  # the arm's scope reached the run
    for args, needle in ((["--methods", "all,best", "--out", str(tmp_path / "x")], "--methods"),
                         (["--methods", "gmts@everywhere", "--out", str(tmp_path / "x")], "METHOD@SCOPE"),
                         (["--methods", "all,gmts", "--seeds", "2", "--out", str(out)],
                          "holds a gmts_lab_compare run: replace it with --overwrite")):
        with pytest.raises(SystemExit) as e:  # 3rd: finished runs stay
            lab.main(["compare", "--preset", "smoke", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1
    ev = lab.main(["decoy", "--model", str(out / "gmts@batch-s1")])  # the run's own held-out rows (seed 1, 4 problems)
    assert "seed 1, 4 problems" in capsys.readouterr().out and set(ev) == {"real_acc", "decoy_acc", "real_valid",
                                                                          "decoy_valid"}


def test_ci95_by_hand():
    """Four paired differences 0.1, 0.2, 0.3, 0.4: mean 0.25, SE 0.1291/2, t(3) = 3.182 -> [0.0446, 0.4554]; an
    interval that excludes 0."""
    lo, hi = lab.ci95([0.1, 0.2, 0.3, 0.4])
    assert lo == pytest.approx(0.25 - 3.182 * 0.0645497, abs=1e-6) and hi == pytest.approx(0.25 + 3.182 * 0.0645497,
                                                                                              abs=1e-6)
    assert lab.ci95([0.1] * 40)[0] == pytest.approx(0.1)  # beyond the table: 1.960, SE 0


def test_report_pairs_runs_by_seed_against_hand_values(tmp_path, capsys):
    """Hand-made compare folders: the table's means, SEs and paired differences are the hand-computed ones; a run
    that has not reached its last step is left out; the figure is written."""
    finals = {"all": [0.5, 0.6, 0.7], "entropy": [0.4, 0.6, 0.5], "gmts": [0.6, 0.6, 0.5], "gradnorm": [0.7, 0.5],
              "gmts@batch": [0.5, 0.7, 0.5]}
    for m, fin in finals.items():
        for s, acc in enumerate(fin):
            run = tmp_path / "cmp" / f"{m}-s{s}"
            run.mkdir(parents=True)
            (run / "run_config.json").write_text(json.dumps({"steps": 20}))
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
                {"step": 0, "eval_acc": 0.3}, {"step": 10, "eval_acc": 0.35, "reward_mean": 0.2},
                {"step": 20, "eval_acc": acc})))
    stopped = tmp_path / "cmp" / "gradnorm-s2"  # stopped at step 10: not finished
    stopped.mkdir()
    (stopped / "run_config.json").write_text(json.dumps({"steps": 20}))
    (stopped / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_acc": 0.3}) + "\n")
    runs = lab.main(["report", f"math={tmp_path / 'cmp'}", "--png", str(tmp_path / "d" / "r.png")])
    out = capsys.readouterr().out
    assert set(runs["math"]["gradnorm"]) == {0, 1} and (tmp_path / "d" / "r.png").stat().st_size > 1000
    assert "best fixed content on the held-out rows (mean over seeds): nan" in out  # --data gen: no such line
    (tmp_path / "cmp" / "all-s1" / "run_config.json").write_text(json.dumps(  # easy logic: 1 seed's line only
        {"steps": 20, "task": "logic", "data": "easy", "seed": 1, "eval_size": 16}))
    for run in (tmp_path / "cmp").iterdir():
        if run.name != "all-s1":
            shutil.rmtree(run)
    fixed = lab.best_fixed_guess_acc("logic", gmts.read_data(gmts.Config(task="logic", data="easy", seed=1,
                                                                         eval_size=16)).held)
    lab.main(["report", f"math={tmp_path / 'cmp'}", "--png", str(tmp_path / "d" / "r.png"), "--overwrite"])
    assert f"(mean over seeds): {fixed:.3f}" in capsys.readouterr().out and fixed > 0
    row = lambda first: next(x for x in out.splitlines() if x.startswith(f"| {first} |")).split("|")  # noqa: E731
    assert row("all")[4].strip() == "0.600 +- 0.082" and row("all")[5].strip() == "0.058"  # 0.1 / sqrt(3)
    assert row("gmts - entropy")[3].strip() == "+0.067 +- 0.067" and row("gmts - entropy")[6].strip() == (
        "+0.200, +0.000, +0.000")  # differences 0.2, 0, 0: mean 1/15, SE sqrt(0.04/3/3)
    # the 95% t interval, 2 degrees of freedom: 1/15 -+ 4.303 / 15; it holds 0
    assert row("gmts - entropy")[4].strip() == "[-0.220, +0.354]" and row("gmts - entropy")[5].strip() == "no"
    assert row("gmts - gradnorm")[2].strip() == "2" and row("gmts - gradnorm")[6].strip() == "-0.100, +0.100"
    assert row("gmts - gmts@batch")[3].strip() == "+0.000 +- 0.058"  # the two scopes: 0.1, -0.1, 0; SE 0.1 / sqrt(3)
    assert row("gmts@batch - entropy")[6].strip() == "+0.100, +0.100, +0.000"
    assert "(trunc nan)" in row("all")[6]  # these hand-made runs log no truncated_frac
    for bad, needle in ((["math"], "TITLE=FOLDER"), ([f"x={tmp_path}"], "no finished compare runs"),
                        ([f"a={tmp_path}", f"a={tmp_path}"], "a title of its own")):  # one panel drawn twice
        with pytest.raises(SystemExit) as e:
            lab.main(["report", *bad, "--png", str(tmp_path / "x.png")])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def _reviewer_runs():
    spec = importlib.util.spec_from_file_location("reviewer_runs", os.path.join(HERE, "dev", "reviewer_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_queued_job_runs_the_arm_and_seed_its_name_says():
    """Every line of dev/reviewer_jobs.txt: the arm and seed its name gives the tables (arm_of) are the ones its flags
    run (gmts.parse_args over the cpu preset): method, rho (none for all and rsi), --kl-beta 0.001 for -kl, 240 steps
    with a 30-step warm-up (3x the preset's) for -long, 80 steps else. Five seeds per arm, each once; rsi only from
    2598d00, the first commit that has it."""
    runs = _reviewer_runs()
    seen = collections.Counter()
    with open(os.path.join(HERE, "dev", "reviewer_jobs.txt")) as f:
        lines = [ln.split() for ln in f if ln.strip() and not ln.startswith("#")]
    for sha, job, *args in lines:
        (method, rho, kind), seed = runs.arm_of(job)
        flags = dict(zip(args[::2], args[1::2]))  # every job's arguments are --flag value pairs
        lab_flags = ("--methods", "--seeds")  # compare's own; the rest go to gmts.parse_args
        cfg = gmts.parse_args([x for k, v in flags.items() if k not in lab_flags for x in (k, v)])
        assert (flags["--methods"], seed) == (method, cfg.seed), job
        assert rho == (None if method in ("all", "rsi") else cfg.rho), job
        assert (cfg.kl_beta > 0) == (kind == "kl") and cfg.kl_beta in (0.0, 0.001), job
        assert (cfg.steps, cfg.warmup_steps) == ((240, 30) if kind == "long" else (80, 10)), job
        assert (method == "rsi") == (sha == "2598d00") and sha in ("b0ca3b6", "2598d00"), job
        seen[(method, rho, kind)] += 1
        assert seen[(method, rho, kind)] == seed + 1, job  # seeds 0..4 in order, none twice
    assert set(seen.values()) == {5} and len(seen) == 2 * 5 + 2 + 2 + 3  # the sweep, all, rsi, KL, long
    queued = {job: sha for sha, job, *_ in lines}
    with open(os.path.join(HERE, "dev", "reviewer_runs.jsonl")) as f:
        records = [json.loads(ln) for ln in f if ln.strip()]
    for r in records:  # each record: a queued job, run from its line's commit, on named kernels and torch
        assert queued[r["job"]] == r["commit"] and r["kernels"] and r["torch"], r["job"]


def test_result_tables_pair_by_seed_against_hand_values():
    """Two arms over five seeds: the paired row's mean, SE, t interval (t(4) = 2.776) and verdict are the hand
    values; four seeds are shown and not counted; the area is the mean of the curve."""
    runs_of = _reviewer_runs()
    a, b = ("gmts", 0.2, ""), ("entropy", 0.2, "")
    runs = {a: {}, b: {}}
    for s, (x, y) in enumerate(((0.6, 0.5), (0.6, 0.5), (0.6, 0.5), (0.6, 0.5), (0.7, 0.5))):
        runs[a][s] = {"curve": [[0, 0.3], [10, x]], "trunc": 0.0, "kept": 0.1}
        runs[b][s] = {"curve": [[0, 0.3], [10, y]], "trunc": 0.0, "kept": 0.2}
    # differences 0.1 x 4, 0.2: mean 0.12, sample std sqrt(0.008 / 4), SE 0.02, half-width 2.776 * 0.02
    row = runs_of.pair_rows(runs, [(a, b)])[2].split("|")
    assert row[3].strip() == "+0.120 +- 0.020" and row[4].strip() == "[+0.064, +0.176]" and row[5].strip() == "yes"
    del runs[a][4]
    row = runs_of.pair_rows(runs, [(a, b)])[2].split("|")
    assert row[2].strip() == "4" and row[5].strip() == "not counted (4 < 5 seeds)"
    assert runs_of.area(runs[a][0]) == pytest.approx(0.45) and runs_of.final(runs[a][0]) == 0.6


# ---- analysis ----------------------------------------------------------------------------------------------------


def test_spearman_against_hand_values():
    spearman = lab.spearman
    assert spearman(torch.tensor([1., 2., 3., 4.]), torch.tensor([10., 20., 30., 40.])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1., 2., 3., 4.]), torch.tensor([4., 3., 2., 1.])) == pytest.approx(-1.0)
    # ties get average ranks: x ranks [1, 2.5, 2.5, 4], y ranks [1, 2, 3, 4] -> r = 4.5 / sqrt(4.5 * 5)
    assert spearman(torch.tensor([1., 2., 2., 3.]), torch.tensor([1., 2., 3., 4.])) == pytest.approx(
        4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.)))


def test_gmts_orders_like_entropy_within_an_answer():
    torch.manual_seed(0)
    H = torch.rand(4, 30)
    om = gmts.omega(torch.tensor([2.0, -0.4, 1.0, -1.0]), torch.ones(4, 30), 0.2, 0.28)
    g = gmts.token_scores("gmts", H, H, om)
    for i in range(4):
        assert lab.spearman(g[i], H[i]) == pytest.approx(1.0)


def test_param_grad_norms_match_brute_force(tiny):
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=5)
    rows = torch.tensor([0, 0, 4, 8])
    cols = torch.tensor([0, 3, 1, 2])
    ours = lab.param_grad_norms(model, b, adv, rows, cols, 1.0)
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    P = b["prompt_ids"].shape[1]
    for k, (i, t) in enumerate(zip(rows.tolist(), cols.tolist())):
        model.zero_grad()
        out = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1],
                    position_ids=(attn[i:i + 1].cumsum(-1) - 1).clamp_min(0)).logits
        lp = torch.log_softmax(out[0, P - 1 + t].float(), -1)[b["comp_ids"][i, t]]
        (-adv[i] * lp).backward()
        assert ours[k].item() == pytest.approx(float(lab.flat_grad(model).norm()), rel=1e-4, abs=1e-7)
    model.zero_grad()


def test_full_gradient_equals_brute_force_autograd(tiny):
    """g_all as analyze computes it (gmts.loss_backward over every valid token, then flat_grad) is the gradient of
    -sum_t A * logp_t / n_valid written the plain way: one full forward, full log_softmax (on-policy, ratio 1)."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=2, n_prompts=4)
    mask = b["resp_mask"]
    logp = gmts.batch_token_stats(model, b, 1.0, 3, 7)[0]
    model.zero_grad(set_to_none=True)
    objective = gmts.Objective(0.2, 0.28, 0.0, 1.0, **gmts.loss_weights("all", mask, 0))
    gmts.loss_backward(model, b, adv, mask, logp, objective, micro_batch=3, chunk=7)
    ours = lab.flat_grad(model)
    model.zero_grad(set_to_none=True)
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    P = b["prompt_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    lp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, b["comp_ids"][..., None]).squeeze(-1)
    (-(adv[:, None] * lp * mask).sum() / mask.sum()).backward()
    brute = lab.flat_grad(model)
    model.zero_grad(set_to_none=True)
    assert brute.norm() > 0 and torch.allclose(ours, brute, rtol=1e-4, atol=1e-7)


def test_all_tokens_retain_the_whole_gradient(tiny):
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=3, n_prompts=4)
    cfg = gmts.Config(micro_batch=5, stats_chunk=11)
    res = lab.gradient_retention(model, b, adv, cfg, methods=("all",))
    assert res["all"][:2] == (pytest.approx(1.0, abs=1e-9), pytest.approx(1.0, abs=1e-9))
    low = lab.low_adv_rows(adv, cfg.group_size)[:, None] & b["resp_mask"]  # every token kept: the low share is theirs
    assert res["all"][2] == pytest.approx(float(low.sum() / b["resp_mask"].sum()), abs=1e-12)
    res = lab.gradient_retention(model, b, torch.zeros_like(adv), cfg, methods=("all", "gmts"))
    assert all(math.isnan(x) for v in res.values() for x in v)  # every A = 0: there is no gradient to retain
    assert all(p.grad is None for p in model.parameters())


def test_gmts_retains_more_of_the_gradient_than_random(tiny):
    """Half the groups have all-equal rewards (A = 0, no gradient) and the other half one clear right answer each:
    random spends about half its budget on dead tokens, gmts none, and its kept gradient points closer to g_all."""
    model, tok = tiny
    torch.manual_seed(7)
    prompts = [gmts.render_prompt(tok, f"Make {t} from 1 2 3.", True) for t in (0, 2, 4, 6)]
    b = gmts.rollout(model, tok, prompts, 4, 12)
    adv = gmts.group_advantages(torch.tensor([0., 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]), 4)  # (16,)
    cfg = gmts.Config(rho=0.2)
    cos = {m: [] for m in ("random", "gmts")}
    for seed in range(4):
        for m, (c, *_) in lab.gradient_retention(model, b, adv, cfg, methods=tuple(cos), seed=seed).items():
            cos[m].append(c)
    assert min(cos["gmts"]) >= max(cos["random"]), cos


def test_analyze_cli_prints_the_table(tmp_path, capsys):
    # the smoke preset's answers end and earn rewards that split groups: the verifier's own advantages
    lab.main(["analyze", "--preset", "smoke", "--batches", "1", "--out", str(tmp_path / "a")])
    table = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert "cos(g_S, g_all) filter off" in table[0] and "filter on" in table[0] and "Spearman" in table[0]
    assert [x.split("|")[1].strip() for x in table[2:]] == ["random", "entropy", "gmts", "gradnorm"]
    assert table[-1].count("1 (identity)") == 2  # gradnorm's score is the logit-gradient norm itself
    res = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert set(res) == {f"{m}/{c}" for m in ("entropy", "gmts", "gradnorm", "random")
                        for c in ("logit_within", "logit_batch", "param_within", "param_batch", "cos_off", "cos_on",
                                  "ratio_off", "ratio_on")}
    assert len(res["gmts/cos_on"]) == 1


def test_the_kept_gradient_curve_matches_one_rho_at_a_time(tiny):
    """retention_at computes the statistics and g_all once for all rhos: each rho's entry equals gradient_retention run
    alone at that rho (random included: the same draw at every rho). At rho = 1 every batch-scope method keeps every
    token with a gradient (gradnorm drops only A = 0 tokens, whose gradient is 0): cos 1 and ratio 1; gmts, per
    group, still drops each group's lowest token (its authors' rule). Fewer tokens keep
    no more of the norm (the kept sets are nested) for entropy, which adds only tokens of one sign of A here."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=4, n_prompts=4)
    cfg = gmts.Config(micro_batch=5, stats_chunk=11)
    rhos = (0.05, 0.3, 1.0)
    curve = lab.retention_at(model, b, adv, cfg, rhos, seed=3)
    assert list(curve) == list(rhos)
    for r in rhos:
        alone = lab.gradient_retention(model, b, adv, gmts.Config(micro_batch=5, stats_chunk=11, rho=r), seed=3)
        assert curve[r] == alone, r  # the same operations on the same tensors: the same bits
    for m, (cos, ratio, _) in curve[1.0].items():
        if lab.arm_group_size(m, cfg):  # the authors' rule drops each group's lowest token even at rho = 1
            assert 0.99 < cos < 1 - 1e-9, m
            continue
        assert cos == pytest.approx(1.0, abs=1e-9) and ratio == pytest.approx(1.0, abs=1e-9), m
    assert curve[0.05]["gmts"] != curve[0.3]["gmts"]  # the rho reaches the selection


def test_low_adv_share_and_scope_arms_by_hand(tiny):
    """Groups of 4 with k = 2, 1, 0 (dead) and 3 right answers: mean |A| 1, 0.866, 0, 0.866; the informative groups'
    median is 0.866, so only the dead group is below it; with k = 2, 2, 1, 3 the median is 0.933. An arm's scope
    reaches its selection: gmts@batch and gmts@group keep different tokens at a small rho, and gmts alone is
    gmts@group."""
    adv = gmts.group_advantages(torch.tensor([1., 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]), 4)
    assert adv.abs().view(4, 4).mean(1).tolist() == pytest.approx([1.0, 0.866, 0.0, 0.866], abs=1e-3)
    assert lab.low_adv_rows(adv, 4).tolist() == [False] * 8 + [True] * 4 + [False] * 4
    adv4 = gmts.group_advantages(torch.tensor([1., 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0]), 4)  # 1, 1, .87, .87
    assert lab.low_adv_rows(adv4, 4).tolist() == [False] * 8 + [True] * 8  # below the median 0.933
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=4, n_prompts=4)
    cfg = gmts.Config(micro_batch=5, stats_chunk=11, rho=0.1, group_size=4)
    res = lab.gradient_retention(model, b, adv, cfg, methods=("gmts", "gmts@group", "gmts@batch", "all"), seed=0)
    assert res["gmts"] == res["gmts@group"] and res["gmts"] != res["gmts@batch"]
    assert res["gmts@batch"][2] == 0.0 == res["gmts"][2]  # gmts keeps nothing of the dead group either way


def test_retention_cli_writes_the_curve_and_its_figure(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda text, row: float(sum(map(ord, text)) % 2))
    out = tmp_path / "ret"
    lab.main(["analyze", "--preset", "smoke", "--batches", "2", "--rhos", "0.5,0.1,0.5", "--out", str(out)])
    table = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| 0")]
    assert [x.split("|")[1].strip() for x in table] == ["0.1", "0.5"] * 3  # sorted, each once: cos, ratio, low-|A|
    res = json.loads((out / "retention.json").read_text())
    assert set(res) == {"0.1", "0.5"} and set(res["0.1"]) == set(lab.ANALYZED)
    assert all(len(v["cos"]) == len(v["ratio"]) == len(v["low"]) >= 1 for v in res["0.5"].values())
    lab.main(["retention", f"countdown={out}", f"again={out}", "--png", str(tmp_path / "r.png")])
    assert (tmp_path / "r.png").stat().st_size > 0 and capsys.readouterr().out.count("## ") == 2
    for argv, code, words in ((["analyze", "--preset", "smoke", "--rhos", "0.1,2", "--out", str(tmp_path / "x")], 2,
                               "--rhos"),
                              (["retention", f"a={out}", "--png", str(tmp_path)], 2, "must name a .png file"),
                              (["retention", f"a={tmp_path}", "--png", str(tmp_path / "y.png")], 2, "retention.json")):
        with pytest.raises(SystemExit) as e:
            lab.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == code and len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y.png").exists()


def test_out_of_memory_in_the_warm_up_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(lab, "sft_warmup", oom)
    with pytest.raises(SystemExit) as e:
        lab.main(["warm", "--out", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1 and "out of GPU memory" in err, err


def test_warm_cli_takes_a_task_and_refuses_others_in_one_line(tmp_path, monkeypatch, capsys):
    """warm --task logic trains warm/logic's recipe on logic rows into --out, then prints its held-out accuracy beside
    the random-content and fixed-content lines; an unknown task is one line, exit 2."""
    seen = []
    monkeypatch.setattr(lab, "sft_warmup", lambda model, tok, task, *a, **k: seen.append((task, *a[3:6])))
    monkeypatch.setattr(lab, "greedy_texts", lambda model, tok, task, rows, *a: ["<answer>x</answer>"] * len(rows))
    lab.main(["warm", "--task", "logic", "--out", str(tmp_path / "w")])
    r = lab.WARM["logic"]
    assert seen == [("logic", r["steps"], r["lr"], r["batch_size"])] and (tmp_path / "w" / "config.json").exists()
    out = capsys.readouterr().out
    assert "acc 0.000 (random content gets 0.250, the best fixed content" in out
    with pytest.raises(SystemExit) as e:
        lab.main(["warm", "--task", "chess"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "chess" in err


def test_a_flag_the_command_does_not_read_is_one_line_exit_2(capsys):
    """Each command has its own flags: another command's (analyze --seeds, report --methods) is refused by the parser
    that reads the rest (gmts.py's, or the lab's), in one line, before any work."""
    for argv, needle in ((["analyze", "--seeds", "3"], "--seeds"), (["report", "a=b", "--png", "x.png",
                                                                        "--methods", "gmts"], "--methods"),
                         (["warm", "--preset", "cpu"], "--preset")):
        line = _one_line_exit(capsys, argv)
        assert "unrecognized arguments" in line and needle in line, line


# ---- the reviewers' scatter -------------------------------------------------------------------------------------------


def test_scatter_points_are_the_gmts_score_and_the_autograd_logit_gradient(tiny):
    """scatter_points under --loss-norm all, on-policy: "gmts" is H * |A| / n_valid, and "grad" is the norm of the
    logit gradient of L = -sum_t A_i logp_t / n_valid, taken by autograd from one full forward of the model."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=4, n_prompts=3)
    cfg = gmts.Config(micro_batch=2, stats_chunk=5)
    pts = lab.scatter_points(model, b, adv, cfg)
    mask = b["resp_mask"]
    n = int(mask.sum())
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    P = b["prompt_ids"].shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0))
    z = out.logits[:, P - 1:-1].float().detach().requires_grad_(True)  # (N, T, V)
    logp_all = torch.log_softmax(z, -1)
    lp = logp_all.gather(-1, b["comp_ids"][..., None]).squeeze(-1)
    (-(adv[:, None] * lp * mask).sum() / n).backward()
    H = -(logp_all.exp() * logp_all).sum(-1).detach()
    assert len(pts["H"]) == n and torch.allclose(pts["H"], H[mask], atol=1e-5)
    assert torch.equal(pts["abs_adv"], adv.abs()[:, None].expand_as(mask)[mask])
    assert torch.allclose(pts["gmts"], H[mask] * adv.abs()[:, None].expand_as(mask)[mask] / n, rtol=1e-4,
                          atol=1e-9)
    assert pts["grad"].max() > 0 and torch.allclose(pts["grad"], z.grad.norm(dim=-1)[mask], rtol=1e-4, atol=1e-9)


def test_scatter_cli_refuses_a_png_that_is_not_one(tmp_path, capsys):
    for png in (str(tmp_path), str(tmp_path / "s.jpg")):
        with pytest.raises(SystemExit) as e:
            lab.main(["scatter", "--png", png])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "must name a .png file" in err, err


def test_analyze_refuses_an_interval_method(tmp_path, capsys):
    """rsi keeps an interval, not a top rho: the kept-gradient curve (a curve over rho) refuses it in one line."""
    with pytest.raises(SystemExit) as e:
        lab.main(["analyze", "--preset", "smoke", "--rhos", "0.1", "--arms", "entropy,rsi", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "keeps an interval" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a").exists()


# ---- the command line: malformed inputs, what each command writes, Ctrl-C ---------------------------------------

def _one_line_exit(capsys, argv, code=2):
    """lab.main(argv) ends with `code` and exactly one stderr line 'gmts_lab: error: ...', no traceback -> that line."""
    with pytest.raises(SystemExit) as e:
        lab.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == code and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("gmts_lab: error: "), err
    return lines[0]


CURVE = {"cos": [0.5, 0.6], "ratio": [0.4, 0.5], "low": [0.1, 0.2]}
MALFORMED_CURVES = [("{}", {}), ("a list", [1, 2]), ("no cos", {"0.1": {"gmts": {"ratio": [0.4]}}}),
                    ("no arms", {"0.1": {}}), ("a rho that is no number", {"x": {"gmts": CURVE}}),
                    ("a null in cos", {"0.1": {"gmts": dict(CURVE, cos=[None])}}),
                    ("an arm of one rho only", {"0.1": {"gmts": CURVE}, "0.2": {"all": CURVE}}),
                    ("an arm that is no method", {"0.1": {"best": CURVE}}),
                    ("a key of one arm only", {"0.1": {"gmts": CURVE, "all": dict(ratio=[1.0], cos=[1.0])}})]


@pytest.mark.parametrize("curve", [c for _, c in MALFORMED_CURVES], ids=[i for i, _ in MALFORMED_CURVES])
def test_retention_refuses_a_malformed_curve_in_one_line(tmp_path, capsys, curve):
    """retention over a retention.json that is not {rho: {arm: {cos: [...], ratio: [...], ...}}} alike for every rho:
    exit 2, one line naming the file (each case was a traceback, or a line about --methods, before). The well-formed
    curve beside them draws."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "retention.json").write_text(json.dumps({"0.1": {"gmts": CURVE, "all": CURVE}}))
    lab.main(["retention", f"a={tmp_path / 'ok'}", "--png", str(tmp_path / "ok.png")])
    assert (tmp_path / "ok.png").stat().st_size > 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "retention.json").write_text(json.dumps(curve))
    line = _one_line_exit(capsys, ["retention", f"a={tmp_path / 'bad'}", "--png", str(tmp_path / "r.png")])
    assert f"{tmp_path / 'bad' / 'retention.json'}: not a retention curve" in line
    assert not (tmp_path / "r.png").exists()


def _compare_run(folder, config, metrics, name="all-s0"):
    """A hand-made compare run folder: run_config.json (an object, or raw text) and metrics.jsonl."""
    run = folder / name
    run.mkdir(parents=True)
    (run / "run_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


FINISHED = [{"step": 0, "eval_acc": 0.3}, {"step": 2, "eval_acc": 0.5, "truncated_frac": 0.25}]
MALFORMED_RUNS = [  # (id, run_config.json, metrics.jsonl records, what the line says)
    ("run_config.json {}", {}, FINISHED, "run_config.json: not a gmts run's config"),
    ("run_config.json a list", [], FINISHED, "run_config.json: not a gmts run's config"),
    ("run_config.json not JSON", "{", FINISHED, "run_config.json: not readable as JSON"),
    ("steps a string", {"steps": "2"}, FINISHED, "run_config.json: not a gmts run's config"),
    ("eval_size a string", {"steps": 2, "data": "easy", "eval_size": "x"}, FINISHED, "not a gmts run's config"),
    ("eval_acc null", {"steps": 2}, [FINISHED[0], dict(FINISHED[1], eval_acc=None)], "eval_acc: None is not a"),
    ("truncated_frac null", {"steps": 2}, [FINISHED[0], dict(FINISHED[1], truncated_frac=None)],
     "truncated_frac: None is not a number"),
    ("the folder missing", None, None, "no finished compare runs"),
    ("the arm folder gone (a dangling link)", "link", None, "no finished compare runs"),
]


@pytest.mark.parametrize("config, metrics, needle", [c[1:] for c in MALFORMED_RUNS], ids=[c[0] for c in MALFORMED_RUNS])
def test_report_refuses_malformed_runs_in_one_line(tmp_path, capsys, config, metrics, needle):
    """report over a compare folder whose run has a malformed run_config.json or a non-number where a number is
    read, or over a folder or arm that is not there: exit 2, one line naming what is wrong, no figure (on the code
    before, {} left the run out in silence, null was a traceback). The same run well-formed is reported."""
    _compare_run(tmp_path / "ok", {"steps": 2}, FINISHED)
    lab.main(["report", f"a={tmp_path / 'ok'}", "--png", str(tmp_path / "ok.png")])
    assert "| all | 1 | 0.300 | 0.500 +- 0.000 | nan | s0 0.500 (trunc 0.25) |" in capsys.readouterr().out
    if config == "link":
        (tmp_path / "cmp").mkdir()
        os.symlink(tmp_path / "nowhere", tmp_path / "cmp" / "all-s0")
    elif config is not None:
        _compare_run(tmp_path / "cmp", config, metrics)
    line = _one_line_exit(capsys, ["report", f"a={tmp_path / 'cmp'}", "--png", str(tmp_path / "r.png")])
    assert needle in line and str(tmp_path / "cmp") in line, line
    assert not (tmp_path / "r.png").exists()


def test_decoy_refuses_a_run_config_of_the_wrong_types_in_one_line(tmp_path, capsys):
    """decoy --model RUN reads RUN's run_config.json: eval_size "4" is refused in one line naming the file (on the
    code before, a TypeError's traceback from the range checks)."""
    model = shutil.copytree(gmts.WARM_CPU, tmp_path / "run")
    (model / "run_config.json").write_text(json.dumps({"steps": 1, "eval_size": "4"}))
    line = _one_line_exit(capsys, ["decoy", "--model", str(model)])
    assert f"{model / 'run_config.json'}: not a gmts run's config" in line


class Began(Exception):
    """Raised by the patched expensive work: the command got past its output checks."""


def _work_begins(*a, **k):
    raise Began


def _outputs(tmp):
    """What the output cases meet under tmp: a file f, a user's old.png, an analyze --out with its analysis.json, a
    compare --out with compare.md (both marked by the lab), a user's folder with an analysis.json, one with an arm
    folder, a model folder m, a gmts run folder, a copy of a committed warm start (with its mark)."""
    (tmp / "f").write_text("the user's file\n")
    (tmp / "old.png").write_bytes(b"the user's picture")
    for d in ("ana", "user", "cmp", "cmp2/all-s0", "run"):
        (tmp / d).mkdir(parents=True)
    (tmp / "ana" / "analysis.json").write_text("{}")
    (tmp / "ana" / ".gmts_lab_analyze.run").write_text("")
    (tmp / "user" / "analysis.json").write_text("{}")
    (tmp / "cmp" / "compare.md").write_text("| the table |\n")
    (tmp / "cmp" / ".gmts_lab_compare.run").write_text("")
    (tmp / "cmp2" / "all-s0" / "notes.txt").write_text("the user's notes\n")
    (tmp / "run" / "run_config.json").write_text(json.dumps({"steps": 1}))
    (tmp / "run" / "config.json").write_text("{}")
    shutil.copytree(gmts.WARM_CPU, tmp / "m")
    shutil.copytree(gmts.WARM_CPU, tmp / "w")


SMOKE_CMP = ["compare", "--preset", "smoke", "--methods", "all", "--seeds", "1"]
OUTPUTS = [  # (id, argv, the refusal's words; None: the command may write there, and its work begins)
    ("scatter --png in a file's place", ["scatter", "--png", "{tmp}/f/x.png"], "f is a file, not a folder"),
    ("scatter --png over a user's file", ["scatter", "--png", "{tmp}/old.png"], "exists: replace it with --overwrite"),
    ("scatter --png over it with --overwrite", ["scatter", "--png", "{tmp}/old.png", "--overwrite"], None),
    ("scatter --png in folders to make", ["scatter", "--png", "{tmp}/new/deeper/s.png"], None),
    ("report --png over a user's file", ["report", "a={tmp}", "--png", "{tmp}/old.png"], "--overwrite"),
    ("retention --png in a file's place", ["retention", "a={tmp}", "--png", "{tmp}/f/r.png"], "f is a file, not a"),
    ("analyze over an analysis", ["analyze", "--preset", "smoke", "--out", "{tmp}/ana"],
     "holds a gmts_lab_analyze run: replace it with --overwrite"),
    ("analyze over it with --overwrite", ["analyze", "--preset", "smoke", "--out", "{tmp}/ana", "--overwrite"], None),
    ("analyze over a user's folder", ["analyze", "--preset", "smoke", "--out", "{tmp}/user", "--overwrite"],
     "holds files that are not a gmts_lab_analyze run"),
    ("analyze --out a file", ["analyze", "--preset", "smoke", "--out", "{tmp}/f"], "f is a file, not a folder"),
    ("analyze --out the --model folder", ["analyze", "--preset", "smoke", "--model", "{tmp}/m", "--out", "{tmp}/m"],
     "is or holds the --model folder"),
    ("analyze --out holding --model", ["analyze", "--preset", "smoke", "--model", "{tmp}/m", "--out", "{tmp}"],
     "is or holds the --model folder"),
    ("compare over a compare", [*SMOKE_CMP, "--out", "{tmp}/cmp"],
     "holds a gmts_lab_compare run: replace it with --overwrite"),
    ("compare over it with --overwrite", [*SMOKE_CMP, "--out", "{tmp}/cmp", "--overwrite"], None),
    ("compare --out the --model folder", [*SMOKE_CMP, "--model", "{tmp}/m", "--out", "{tmp}/m"], "--model folder"),
    ("compare over a folder that is not a compare's", [*SMOKE_CMP, "--out", "{tmp}/cmp2", "--overwrite"],
     "holds files that are not a gmts_lab_compare run (all-s0 ...)"),
    ("compare over a gmts run", [*SMOKE_CMP, "--out", "{tmp}/run", "--overwrite"], "not a gmts_lab_compare run"),
    ("warm --out a gmts run", ["warm", "--out", "{tmp}/run"], "holds files that are not a gmts_lab_warm run"),
    ("warm --out a file", ["warm", "--out", "{tmp}/f"], "f is a file, not a folder"),
    ("warm --out a warm start it rewrites", ["warm", "--out", "{tmp}/w"], None),
    ("warm --out a new folder", ["warm", "--out", "{tmp}/new/w"], None),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in OUTPUTS], ids=[c[0] for c in OUTPUTS])
def test_each_command_checks_what_it_writes_before_any_work(tmp_path, capsys, monkeypatch, argv, needle):
    """Each command that writes checks its output by gmts.py's folder rule before any model loads, any worker starts,
    any run is read: a folder holds one run of the command (its mark), replaced only with --overwrite, or nothing of
    anyone's; never the --model folder or one holding it; warm replaces a warm start (the same bits), nothing else;
    a figure is one file, replaced only with --overwrite, never under a file. A refusal is one line, exit 2, and
    leaves every file as it was; where it may write, the work begins (here: the patched work raises Began)."""
    _outputs(tmp_path)
    for obj, name in ((gmts, "load_model"), (lab, "sft_warmup"), (multiprocessing, "get_context"),
                      (lab, "finished_runs"), (lab, "read_retention")):
        monkeypatch.setattr(obj, name, _work_begins)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    if needle is None:
        with pytest.raises(Began):
            lab.main(argv)
        return
    line = _one_line_exit(capsys, argv)
    assert needle in line, line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_scatter_makes_the_folder_of_its_png(tmp_path, monkeypatch):
    """scatter --png NEW/DEEPER/s.png: the folders are made and the figure written (on the code before, savefig failed
    on the missing folder after every warm start's batch was scored). The batches are stand-ins: this is about the
    file, test_scatter_points_... about the points."""
    monkeypatch.setattr(lab, "sample_parts", lambda *a, **k: [(None, None, None)])
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(lab, "scatter_points", lambda *a: dict(H=torch.rand(30, generator=g),
                                                               gmts=torch.rand(30, generator=g),
                                                               grad=torch.rand(30, generator=g),
                                                               abs_adv=torch.rand(30, generator=g)))
    lab.main(["scatter", "--png", str(tmp_path / "new" / "deeper" / "s.png")])
    assert (tmp_path / "new" / "deeper" / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decoy_checks_no_output(tmp_path, monkeypatch, capsys):
    """decoy writes nothing, so it checks no --out: it runs from a working folder it may not write, with the output
    rule made to refuse everything, prints its table and leaves the folder empty (a read-only working folder refused
    it on 09cce72)."""
    def refuse(*a, **k):
        raise gmts.BadInput("decoy checked an output")
    for rule in ("check_folder", "claim_folder", "check_file"):
        monkeypatch.setattr(gmts, rule, refuse)
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o555)
    monkeypatch.chdir(tmp_path / "ro")
    ev = lab.main(["decoy", "--model", gmts.WARM_CPU, "--eval-size", "2", "--max-new-tokens", "4"])
    assert "| model | held-out greedy acc" in capsys.readouterr().out and set(ev) >= {"real_acc", "decoy_acc"}
    assert os.listdir(tmp_path / "ro") == []


def test_analyze_rolls_out_the_prompt_style_asked(tmp_path, monkeypatch, capsys):
    """analyze --prompt-style qwen-math rolls out qwen-math prompts (e3741a4: ours, in silence); the Ctrl-C raised at
    the rollout is one line, exit 130."""
    seen = []

    def rollout(model, tok, prompts, *a, **k):
        seen.extend(prompts)
        raise KeyboardInterrupt
    monkeypatch.setattr(gmts, "rollout", rollout)
    line = _one_line_exit(capsys, ["analyze", "--model", "tiny", "--task", "math", "--data", "easy", "--prompt-style",
                                   "qwen-math", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                                   "--out", str(tmp_path / "a")], code=130)
    assert line == "gmts_lab: error: interrupted"
    assert seen and all(gmts.QWEN_MATH_SYSTEM in p for p in seen), seen[:1]


def test_compare_starts_no_more_workers_than_runs(tmp_path, monkeypatch, capsys):
    """--workers 8 for one run: one process, and the line says so (on 47c0a22: 8 processes, 7 of them idle)."""
    asked = []

    class Context:
        def Pool(self, n, *a, **k):
            asked.append(n)
            raise KeyboardInterrupt
    monkeypatch.setattr(multiprocessing, "get_context", lambda kind: Context())
    with pytest.raises(SystemExit) as e:
        lab.main([*SMOKE_CMP, "--workers", "8", "--out", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert asked == [1] and "in 1 process(es)" in out and (e.value.code, err) == (130, "gmts_lab: error: interrupted\n")


def test_compare_workers_stop_with_the_parent(tmp_path):
    """SIGINT to compare's parent alone (a second process; 15-40 s): exactly the line 'gmts_lab: error: interrupted',
    exit 130, and no worker goes on training (the workers ignore SIGINT; the pool ends them)."""
    argv = [sys.executable, os.path.join(HERE, "gmts_lab.py"), "compare", "--preset", "smoke", "--steps", "500",
            "--eval-every", "0", "--methods", "all,gmts", "--seeds", "1", "--workers", "2", "--out", str(tmp_path / "c")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    t0 = time.time()
    while not (tmp_path / "c" / "gmts-s0" / "ckpt-000000").exists() and time.time() - t0 < 240:
        time.sleep(0.5)
    children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert children
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "gmts_lab: error: interrupted\n", err
    time.sleep(1)
    alive = [c for c in children if os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z"]
    assert not alive
