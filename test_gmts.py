"""Tests for gmts.py, in the order of its sections. Offline, CPU:  python -m pytest -q test_gmts.py

The reading part first: Config and presets, rollouts, rewards (the verifiers and prompts), group advantages and
dynamic sampling, token statistics, scores and selection, loss and update, the training loop (the lr schedule and
short runs); then the supporting code: problem generators and data loaders, model and tokenizer, evaluation, the
run folder (kill, resume, checkpoints), step lines and trackers, config checks (the bad-input table), the CLI.

Every hand-derived formula is checked against autograd or a slow reference loop (micrograd style). Runs go through
gmts.main(argv) in this process (no torch import per run); the real CLI and SIGKILL run in subprocesses.
Hypothesis: a CI profile (500 examples per verifier); HYPOTHESIS_PROFILE=thorough runs the old 3400.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import ast
import collections
import gc
import importlib.util
import inspect
import itertools
import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import gmts
from gmts import (TASKS, countdown_problem, countdown_reward, get_task, load_rows, logic_problem, logic_reward,
                  math_problem, math_reward, _CD_CHARS, _DEC, _FRAC, _NUM_TOKEN)
from gmts import completion_mask, group_advantages, omega, select_tokens, token_scores, token_stats

HERE = os.path.dirname(os.path.abspath(__file__))
ENV1 = dict(os.environ, OMP_NUM_THREADS="1")  # every subprocess runs on one thread

settings.register_profile("ci", max_examples=500, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("thorough", max_examples=3400, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
PROPS = settings(settings.get_profile("thorough" if THOROUGH else "ci"))


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(HERE, "gmts.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE, env=ENV1)


@pytest.fixture(scope="module")
def tiny():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


# ---- Config and presets (Config, PRESETS: every field a --flag, --preset first) --------------------------------------


def test_preset_then_explicit_flag_wins():
    cfg = gmts.parse_args(["--preset", "cpu", "--lr", "1e-5"])
    assert cfg.lr == 1e-5 and cfg.model == gmts.WARM_CPU and cfg.data == "easy" and cfg.steps == 80
    assert gmts.WARM_CPU == os.path.join(HERE, "warm", "cpu")
    assert gmts.parse_args([]).rho == 0.2 and gmts.parse_args(["--no-std-normalize"]).std_normalize is False
    assert gmts.parse_args(["--preset", "smoke"]).model == gmts.WARM_CPU


def test_every_config_field_is_a_flag_with_help(capsys):
    with pytest.raises(SystemExit):
        gmts.parse_args(["--help"])
    out = capsys.readouterr().out
    opts = out[out.index("options:"):]
    for f in gmts.dataclasses.fields(gmts.Config):
        flag = "--" + f.name.replace("_", "-")
        m = re.search(rf"^  {flag}[ ,](.*?)\(default:", opts, re.M | re.S)  # its entry, up to the default
        assert m, flag
        help_ = f.metadata["help"]  # compared without whitespace: argparse wraps lines, also after a hyphen
        assert len(help_.split()) >= 2 and re.sub(r"\s", "", help_) in re.sub(r"\s", "", m.group(1)), flag


# ---- rollouts --------------------------------------------------------------------------------------------------------


def test_chat_decision(tiny):
    _, tok = tiny
    assert gmts.use_chat(tok) is True and gmts.use_chat(tok, "auto") is True  # eos <|im_end|> + a template
    assert gmts.use_chat(tok, "no") is False and gmts.use_chat(tok, "yes") is True
    prompt = gmts.render_prompt(tok, "Q?", chat=True)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith(gmts.ASSISTANT_PREFIX)
    assert gmts.render_prompt(tok, "Q?", chat=False).endswith("Assistant: " + gmts.ASSISTANT_PREFIX)
    assert gmts.parse_args(["--chat-template", "no"]).chat_template == "no"
    assert gmts.Config().chat_template == "auto"


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


def test_rollout_passes_no_logits_processor_whatever_the_checkpoint_sets(tmp_path, monkeypatch):
    """A checkpoint's generation_config (Qwen instruct: top_k 20, top_p 0.8, repetition_penalty 1.1, ...) must not
    reach rollout's sampling: at T = 1 generate() builds an EMPTY logits-processor list, so answers are drawn from
    the policy whose log-probs are trained on. Spied on generate's own processor builder, through rollout."""
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    model, tok = gmts.build_tiny(hidden=32, layers=1, seed=0)
    knobs = dict(top_k=20, top_p=0.8, repetition_penalty=1.1, min_p=0.05, typical_p=0.9, no_repeat_ngram_size=3,
                 temperature=0.7)
    model.generation_config = GenerationConfig(do_sample=True, **knobs)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok = gmts.load_model(str(tmp_path), torch.device("cpu"))
    assert all(getattr(model.generation_config, k) == v for k, v in knobs.items())  # the checkpoint sets them all
    seen, real = [], GenerationMixin._get_logits_processor

    def spy(self, *a, **k):
        procs = real(self, *a, **k)
        seen.append(sorted(type(p).__name__ for p in procs))
        return procs
    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    model.generate(**tok(["a"], return_tensors="pt"), max_new_tokens=2)  # the knobs do act when left to leak
    assert len(seen[-1]) >= 6, seen[-1]
    for kw, want in [({}, []), (dict(greedy=True), []), (dict(temperature=0.7), ["TemperatureLogitsWarper"]),
                     (dict(top_k=5), ["TopKLogitsWarper"]), (dict(top_p=0.9), ["TopPLogitsWarper"])]:
        seen.clear()
        b = gmts.rollout(model, tok, ["a", "bb"], 2, 4, **kw)
        assert seen == [want], (kw, seen)
        assert len(b["texts"]) == 4
    assert all(getattr(model.generation_config, k) == v for k, v in knobs.items())  # restored afterwards


# ---- rewards: the tasks' prompts and verifiers -----------------------------------------------------------------------
# Verifiers must be right on the table cases, never raise and return a float on anything (hypothesis feeds them
# adversarial inputs). Timing: a generous bound that only catches a runaway (the benchmark measures speed).

SLOW = 2.0  # seconds: no single verifier call may take this long


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
    "negative numerator": ("\\boxed{\\frac{-20}{2}}", "-10", 1.0),  # GSM8K forms math-verify reads
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
            "-\\frac{1}{2}": Fraction(-1, 2), "3/-4": Fraction(-3, 4), "1{,}450": 1450}
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
        assert time.perf_counter() - t < SLOW, s[:20]  # backtracking on 40k characters would take minutes


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
        assert set(t) == {"load", "prompt", "reward"} and all(callable(t[k]) for k in t)
    with pytest.raises(ValueError, match="unknown task 'x'; choose one of: countdown, logic, math"):
        get_task("x")
    with pytest.raises(ValueError, match="choose one of"):
        load_rows("chess", "gen", 1, 0)


def test_no_eval_or_exec():
    tree = ast.parse(inspect.getsource(sys.modules[countdown_reward.__module__]))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"eval", "exec", "compile", "__import__"}


# ---- group advantages and dynamic sampling ---------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0] + [0.0] * 7 + [0.0] * 8 + [1.0] * 8)  # one of 8 correct, none, all
    a = group_advantages(r, 8)
    assert a[0].item() == pytest.approx(math.sqrt(7), abs=1e-5)  # +sqrt((G-k)/k)
    assert a[1].item() == pytest.approx(-math.sqrt(1 / 7), abs=1e-5)  # -sqrt(k/(G-k))
    assert (a[8:] == 0).all()  # all-equal groups: exactly 0, not NaN
    assert group_advantages(r, 8, std_normalize=False)[:2].tolist() == pytest.approx([0.875, -0.125])
    same = group_advantages(torch.tensor([0.1] * 16), 8)  # fp32: r - mean = 7.45e-9; unmasked, A would be ~0.0074
    assert (same == 0).all() and not torch.isnan(same).any()
    mixed = group_advantages(torch.tensor([1.0, 0.1, 0.0, 0.1]), 4)
    assert mixed.sum().abs() < 1e-6 and (mixed.std(unbiased=False) - 1).abs() < 1e-4
    assert gmts.informative(r, 8).tolist() == [True, False, False]


def test_group_advantages_all_equal_groups_are_exactly_zero():
    """The float trap behind "exactly 0": at the default G = 8 the fp32 mean of eight 0.1s (0.2, 0.3, 0.7, 0.9, 1/3)
    is not the value itself, so r - mean is ~1e-8 and the population std the same size (or 0, as the reduction
    falls): (r - mean) / (std + eps) would be an advantage of 0.007-0.06 for answers that all earned the same. The
    test checks that its data reaches the trap, then that group_advantages gives exactly 0, with and without the
    std, and that informative() calls none of these groups informative, in one batch and one group at a time. A
    mixed group of inexact rewards keeps the binary values."""
    G = 8
    values = [0.1, 0.2, 0.3, 0.7, 0.9, 1 / 3, 0.5, 1.0]  # six inexact in fp32, two exact
    r = torch.tensor([v for v in values for _ in range(G)])
    for batch in [r] + [torch.full((G,), v) for v in values]:  # the whole batch, and each group alone (B = 1)
        groups = batch.view(-1, G)
        centred = groups - groups.mean(dim=1, keepdim=True)
        raw = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + 1e-6)  # the formula without its mask
        inexact = (groups[:, 0] != 0.5) & (groups[:, 0] != 1.0)
        assert (raw.abs().amin(dim=1)[inexact] > 5e-3).all()  # the data reaches the trap: noise / std is 0.007-0.06
        for std in (True, False):
            a = group_advantages(batch, G, std_normalize=std)
            assert (a == 0).all() and a.dtype == torch.float32, (batch, std)
        assert not gmts.informative(batch, G).any(), batch
    one_right = group_advantages(torch.tensor([1.0] + [0.1] * 7), G)  # countdown: one right, seven tagged but wrong
    assert one_right.tolist() == pytest.approx([math.sqrt(7)] + [-math.sqrt(1 / 7)] * 7, abs=1e-5)
    assert gmts.informative(torch.tensor([1.0] + [0.1] * 7 + [0.1] * 8), G).tolist() == [True, False]


PAD = 258


def _part(tag, P, T, rewards, G=2):
    """A hand-built rollout part: prompts of width P (first column padding), responses of width T (last column
    invalid), every entry tagged so that each row can be recognised after filter_groups."""
    N = len(rewards)
    prompt_mask = torch.ones(N, P, dtype=torch.bool)
    prompt_mask[:, 0] = False
    resp_mask = torch.ones(N, T, dtype=torch.bool)
    resp_mask[:, -1] = False
    r = torch.tensor(rewards)
    return (dict(prompt_ids=torch.arange(N * P).view(N, P) + 1000 * tag, prompt_mask=prompt_mask,
                 comp_ids=torch.arange(N * T).view(N, T) + 100 * tag, resp_mask=resp_mask,
                 truncated=torch.arange(N) % 3 == tag, texts=[f"{tag}-{i}" for i in range(N)]),
            r, group_advantages(r, G))


def test_filter_groups_keeps_the_first_b_informative_groups():
    a = _part(1, 3, 4, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups: equal, informative, equal
    b = _part(2, 5, 2, [1.0, 0.0, 1.0, 1.0, 0.1, 1.0])  # informative, equal, informative
    # B = 2: a's group 1, then b's group 0
    batch, rewards, adv = gmts.filter_groups([a, b], 2, 2, PAD)
    (ba, ra, aa), (bb, rb, ab) = a, b
    assert batch["texts"] == ["1-2", "1-3", "2-0", "2-1"]
    assert rewards.tolist() == [0.0, 1.0, 1.0, 0.0] and adv.tolist() == aa[2:4].tolist() + ab[0:2].tolist()
    pad2 = torch.full((2, 2), PAD)
    assert torch.equal(batch["prompt_ids"], torch.cat([torch.cat([pad2, ba["prompt_ids"][2:4]], 1),
                                                       bb["prompt_ids"][0:2]]))  # prompts: padded on the LEFT
    no2 = torch.zeros(2, 2, dtype=torch.bool)
    assert torch.equal(batch["prompt_mask"], torch.cat([torch.cat([no2, ba["prompt_mask"][2:4]], 1),
                                                        bb["prompt_mask"][0:2]]))
    assert torch.equal(batch["comp_ids"], torch.cat([ba["comp_ids"][2:4],
                                                     torch.cat([bb["comp_ids"][0:2], pad2], 1)]))  # on the RIGHT
    assert torch.equal(batch["resp_mask"], torch.cat([ba["resp_mask"][2:4], torch.cat([bb["resp_mask"][0:2], no2], 1)]))
    assert batch["truncated"].tolist() == ba["truncated"][2:4].tolist() + bb["truncated"][0:2].tolist()
    all_three = ["1-2", "1-3", "2-0", "2-1", "2-4", "2-5"]
    assert gmts.filter_groups([a, b], 2, 3, PAD)[0]["texts"] == all_three
    assert gmts.filter_groups([a, b], 2, 10, PAD)[0]["texts"] == all_three
    dead, dead2 = _part(3, 2, 2, [1.0, 1.0, 0.0, 0.0]), _part(4, 3, 2, [0.1, 0.1, 0.0, 0.0])
    # nothing informative: the FIRST batch as is (two distinct ones)
    first = gmts.filter_groups([dead, dead2], 2, 2, PAD)
    assert first[0] is dead[0] and first[1] is dead[1] and first[2] is dead[2] and (first[2] == 0).all()


# ---- token statistics: the derivation, pinned ------------------------------------------------------------------------


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


def test_token_stats_on_bf16_logits_is_fp32():
    """CUDA autocast hands the head bf16 logits: the statistics come out in fp32, equal to an fp64 reference on the
    bf16-rounded logits (only the input rounding remains, nothing is computed in bf16)."""
    torch.manual_seed(0)
    z = (torch.randn(64, 300) * 4).bfloat16()
    y = torch.randint(0, 300, (64,))
    T = 0.7
    out = token_stats(z, y, T)
    lp = torch.log_softmax(z.double() / T, -1)
    p = lp.exp()
    py = p.gather(-1, y[:, None]).squeeze(1)
    ref = (lp.gather(-1, y[:, None]).squeeze(1), -(p * lp).sum(-1), (1 - 2 * py + (p * p).sum(-1)).sqrt() / T)
    for got, want in zip(out, ref):
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5), (got.double() - want).abs().max()


def test_dz_norm_at_near_certain_tokens_does_not_cancel():
    """token_stats' comment: (1 - p_y)^2 + sum_{j != y} p_j^2 "does not cancel catastrophically when p_y ~ 1", unlike
    1 - 2 p_y + sum_j p_j^2. At sampled tokens with 1 - p_y = 1e-2, 1e-3, 1e-4 (the rest spread over 1 or 49 other
    tokens) the norm is within 0.5% of an fp64 reference; the data reaches the trap: there the textbook form in fp32
    is off by more than 50% (or NaN). What is left is log_softmax's own fp32 rounding of log p_y."""
    for V in (2, 50):
        for d in (1e-2, 1e-3, 1e-4):
            z = torch.full((1, V), -math.log((V - 1) * (1 - d) / d))  # token 0 at logit 0: p_0 = 1 - d exactly
            z[0, 0] = 0.0
            y = torch.tensor([0])
            _, _, gn = token_stats(z, y)
            p = torch.softmax(z.double(), -1)
            want = ((1 - p[0, 0]) ** 2 + (p[0, 1:] ** 2).sum()).sqrt()
            assert want.item() == pytest.approx(math.sqrt(d * d + d * d / (V - 1)), rel=1e-5)  # fp32 logits
            assert torch.isfinite(gn).all() and abs(gn.item() / want.item() - 1) < 5e-3, (V, d, gn.item(), want.item())
            if d == 1e-4:
                pf = torch.softmax(z, -1)
                textbook = (1 - 2 * pf[0, 0] + (pf * pf).sum()).sqrt()  # fp32, as the cancelling form computes it
                assert not abs(textbook.item() / want.item() - 1) < 0.5, (V, textbook.item())


def test_derivation_logit_gradient_of_clipped_loss():
    """dl/dz = -(omega/T) (onehot(y) - p), and 0 exactly where the clip is active (derivation steps 1-3). The last
    three tokens have A = 0 at ratios inside, above and below the clip range: never "clipped", just zero."""
    torch.manual_seed(0)
    V, T = 11, 0.7
    z = torch.randn(10, V, requires_grad=True)
    y = torch.randint(0, V, (10,))
    old = torch.log_softmax(z.detach() / T, -1).gather(-1, y[:, None]).squeeze(-1) + torch.tensor(
        [0.0, 0.5, -0.5, 0.1, 0.0, 0.5, -0.5, -0.1, -0.5, 0.5])  # ratios 1, e^-.5, e^.5, ...
    adv = torch.tensor([1.5, 1.5, 1.5, -0.7, -0.7, -0.7, -0.7, 0.0, 0.0, 0.0])
    logp, _, gn = token_stats(z, y, T)
    loss, clipped = gmts.grpo_token_loss(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    ratio = torch.exp(logp.detach() - old)
    om = omega(adv, ratio[:, None], 0.2, 0.28).squeeze(1)
    p = torch.softmax(z.detach() / T, -1)
    expect = -(om / T)[:, None] * (torch.nn.functional.one_hot(y, V) - p)
    assert torch.allclose(z.grad, expect, atol=1e-5)
    # = |omega| * dz_norm
    assert torch.allclose(z.grad.norm(dim=-1), om.abs() * gn.detach(), atol=1e-5)
    assert clipped.tolist() == (om == 0).tolist()[:7] + [False] * 3  # A = 0 is not "clipped", just zero
    assert clipped.tolist() == [False, False, True, False, False, True, False, False, False, False]
    assert ratio[8] > 1 + 0.28 and ratio[9] < 1 - 0.2 and (om[7:] == 0).all()  # the A = 0 cases are reached


def rank_corr(a, b):
    """Spearman's rank correlation for values without ties (continuous data)."""
    ra, rb = (x.flatten().argsort().argsort().double() for x in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def test_derivation_bounds_and_entropy_link():
    """Derivation step 4 on gmts's own numbers: token_stats' norm G and entropy H, and E_y[G^2] taken over y ~ p by
    calling token_stats for EVERY token y (no formula of the test's own)."""
    torch.manual_seed(0)
    R, V = 2000, 50
    z = torch.randn(R, V) * torch.rand(R, 1) * 6
    p = torch.softmax(z, -1)
    y = torch.multinomial(p, 1).squeeze(1)
    _, H, G = token_stats(z, y)
    py = p.gather(-1, y[:, None]).squeeze(1)
    assert ((1 - py) ** 2 <= G ** 2 + 1e-6).all() and (G ** 2 <= 2 * (1 - py) ** 2 + 1e-6).all()  # pointwise bounds
    _, H_all, G_all = token_stats(z[:, None, :].expand(R, V, V), torch.arange(V).expand(R, V))  # (R, V): y = 0..V-1
    assert torch.allclose(H_all, H[:, None].expand(R, V), atol=1e-5)  # H does not depend on the sampled token
    EG2 = (p * G_all ** 2).sum(-1)  # E_{y ~ p}[G^2]
    assert torch.allclose(EG2, 1 - (p * p).sum(-1), atol=1e-5)  # = 1 - sum p^2 (the Renyi-2 form)
    assert (EG2 <= 1 - torch.exp(-H) + 1e-6).all()  # <= 1 - exp(-H): in expectation, low entropy = small norm
    assert rank_corr(H, G) > 0.5  # within one "answer" (a fixed omega), entropy tracks the sampled token's norm
    # ... but not pointwise: the module's counterexample, a rare token sampled at a near-certain position
    p1 = torch.tensor([0.999] + [2e-5] * 50)
    _, h1, g1 = token_stats(p1.log()[None], torch.tensor([1]))
    assert h1.item() == pytest.approx(0.012, abs=5e-4) and g1.item() == pytest.approx(1.414, abs=1e-3)


def _batch_from(model, tok, seed=0, n_prompts=3, G=4, new=10):
    torch.manual_seed(seed)
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "x", "Use 9 9 to make 81."]]
    b = gmts.rollout(model, tok, prompts[:n_prompts], G, new)
    adv = group_advantages(torch.tensor([float(i % 3 == 0) for i in range(n_prompts * G)]), G)
    return b, adv


def _full_logits_stats(model, b, T):
    """token_stats on the full logits of one plain forward of the whole batch (the reference). 3 x (N, T)."""
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    P = b["prompt_ids"].shape[1]
    return token_stats(logits[:, P - 1:-1], b["comp_ids"], T)


def test_batch_token_stats_chunks_and_micro_batches_change_nothing(tiny):
    """batch_token_stats (hidden-state gather, the head applied `chunk` tokens at a time) equals token_stats on the
    full logits of a plain forward, for every chunk and micro-batch size; head_logp (autograd, recomputed chunks)
    gives the same log-probs and the same head gradient."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=4)
    m = b["resp_mask"]
    full = _full_logits_stats(model, b, 0.9)
    for mb, chunk in [(1, 1), (5, 7), (12, 1024)]:
        got = gmts.batch_token_stats(model, b, 0.9, mb, chunk)
        for g, f in zip(got, full):
            assert torch.allclose(g[m], f[m], atol=1e-5) and (g[~m] == 0).all()
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    h, y = torch.randn(50, 16), torch.randint(0, 300, (50,))
    lp = gmts.head_logp(h.requires_grad_(True), head, y, 0.9, chunk=7)
    assert torch.allclose(lp, token_stats(head(h), y, 0.9)[0].detach(), atol=1e-6)
    lp.sum().backward()
    g_chunked = head.weight.grad.clone()
    head.weight.grad = None
    token_stats(head(h), y, 0.9)[0].sum().backward()
    assert torch.allclose(g_chunked, head.weight.grad, atol=1e-5)


def test_token_stats_on_another_architecture():
    """response_hidden reaches the decoder through get_decoder(), not Qwen's `model.model`: on a GPT-NeoX (its
    decoder is `gpt_neox`, its head `embed_out`), batch_token_stats equals token_stats on a plain forward's full
    logits, and response_logp equals the log-probs."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    _, tok = gmts.build_tiny(hidden=32, layers=1)
    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).eval()
    assert not hasattr(model, "model")  # the attribute the old code called
    b, _ = _batch_from(model, tok, seed=2)
    m = b["resp_mask"]
    full = _full_logits_stats(model, b, 0.9)
    for g, f in zip(gmts.batch_token_stats(model, b, 0.9, 5, 7), full):
        assert torch.allclose(g[m], f[m], atol=1e-5) and (g[~m] == 0).all()
    ref = gmts.response_logp(model, b, m, 0.9, 5, 7)
    assert torch.allclose(ref[m], full[0][m], atol=1e-5) and (ref[~m] == 0).all()


def test_left_padding_positions_on_absolute_position_embeddings():
    """Rotary models (Qwen2, GPT-NeoX) see only differences of positions, so they cannot tell whether
    response_hidden's position ids follow the left padding. GPT-2's learned absolute positions can (checked: a
    forward with plain 0..P+T-1 positions is off): on left-padded prompts of two lengths, batch_token_stats and
    response_logp reproduce generate()'s own distribution, whose positions come from the attention mask."""
    from transformers import GPT2Config, GPT2LMHeadModel
    _, tok = gmts.build_tiny(hidden=32, layers=1)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tok), n_positions=256, bos_token_id=None,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 1.0)  # positions that matter
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "Hi"]]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    assert attn.sum(1).unique().numel() == 2  # the rows are left padded by different amounts
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0,
                         eos_token_id=gmts.end_token_ids(tok), pad_token_id=tok.pad_token_id, output_scores=True,
                         return_dict_in_generate=True)
    comp = out.sequences[:, ids.shape[1]:]
    mask, _ = completion_mask(comp, gmts.end_token_ids(tok))
    b = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=mask)
    want = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    logp = gmts.batch_token_stats(model, b, 1.0, 3, 5)[0]
    assert torch.allclose(logp[mask], want[mask], atol=1e-5)
    assert torch.allclose(gmts.response_logp(model, b, mask, 1.0, 3, 5)[mask], want[mask], atol=1e-5)
    with torch.no_grad():  # the data reaches the case: positions that ignore the padding give other log-probs
        full = torch.cat([ids, comp], 1)
        plain = model(input_ids=full, attention_mask=torch.cat([attn, mask.long()], 1)).logits[:, ids.shape[1] - 1:-1]
    off = torch.log_softmax(plain.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    assert (off - want)[mask].abs().max() > 1e-2


# ---- scores and selection --------------------------------------------------------------------------------------------


def slow_select(scores, mask, rho, nonzero=False):
    """Reference: sort valid tokens by (-score, flat index) and keep the first ceil(rho * n); nonzero: then keep
    only positive scores. NaN ranks lowest (and is not positive)."""
    flat = [(math.inf if math.isnan(s) else -float(s), i) for i, (s, m) in
            enumerate(zip(scores.reshape(-1).tolist(), mask.reshape(-1).tolist())) if m]
    k = math.ceil(rho * len(flat) - 1e-9)
    keep = {i for s, i in sorted(flat)[:k] if not nonzero or -s > 0}
    return torch.tensor([i in keep for i in range(mask.numel())]).view_as(mask)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0, 0.01])
def test_select_tokens_matches_slow_reference(seed, rho):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (7, 9), generator=g).float()  # many ties, and zeros
    scores[0, seed] = float("nan")
    mask = torch.rand(7, 9, generator=g) > 0.3
    sel = select_tokens(scores, mask, rho)
    assert sel.tolist() == slow_select(scores, mask, rho).tolist()
    assert int(sel.sum()) == math.ceil(rho * int(mask.sum()) - 1e-9)
    assert not (sel & ~mask).any()
    assert select_tokens(scores, mask, rho, nonzero=True).tolist() == slow_select(scores, mask, rho, True).tolist()


def test_select_tokens_edges():
    s = torch.tensor([[3.0, float("nan"), 1.0], [2.0, 5.0, 0.0]])
    m = torch.ones(2, 3, dtype=torch.bool)
    assert select_tokens(s, m, 1.0).all()
    assert not select_tokens(s, torch.zeros_like(m), 0.5).any()  # empty mask
    assert select_tokens(s, m, 0.5).tolist() == [[True, False, False], [True, True, False]]  # NaN ranks last
    assert select_tokens(s, m, 0.2).sum() == 2  # ceil(0.2 * 6) = 2
    assert select_tokens(torch.ones(10), torch.ones(10, dtype=torch.bool), 0.2).sum() == 2  # ceil(0.2 * 10) = 2
    # any rho in (0, 1] keeps at least one valid token: ceil(1e-10 * 5) = 1, the highest score
    assert select_tokens(torch.arange(5.).view(1, -1), torch.ones(1, 5, dtype=torch.bool), 1e-10).tolist() == \
        [[False, False, False, False, True]]
    assert 0.07 * 100 > 7  # floats put this product above 7 ...
    assert select_tokens(torch.arange(100.), torch.ones(100, dtype=torch.bool), 0.07).sum() == 7  # ... k stays 7


def test_select_tokens_beyond_2_pow_24_elements():
    """Above 2^24 elements torch.quantile refuses and an fp32 count of the tied values stalls at 2^24 (and would
    keep every tie). Hand-computed: 2^24 + 5 tokens, index 1 masked out, three 1.0s at the end, zeros elsewhere;
    keeping all valid tokens but one leaves out exactly the LAST valid zero (ties go to earlier positions)."""
    n = 2 ** 24 + 5
    scores = torch.zeros(n)
    scores[-3:] = 1.0
    mask = torch.ones(n, dtype=torch.bool)
    mask[1] = False
    valid = n - 1
    sel = select_tokens(scores, mask, (valid - 1) / valid)
    assert int(sel.sum()) == valid - 1
    assert not sel[1] and not sel[n - 4] and sel[-3:].all() and sel[:1].all() and sel[2:n - 4].all()
    del sel
    assert select_tokens(scores, mask, 0.5, nonzero=True).nonzero().squeeze(1).tolist() == [n - 3, n - 2, n - 1]


def literal_group_select(scores, mask, rho, G, nonzero=False):
    """The authors' per-group rule as gmts-official.md states it, one token at a time: each group of G rows pools
    its valid tokens in (row, position) order, sorts them by score ascending (Python's stable sort; NaN lowest),
    drops the lowest max(1, ceil((1 - rho) * n)) and keeps the rest; nonzero: then only positive scores."""
    keep = torch.zeros(mask.shape, dtype=torch.bool)
    for g in range(mask.shape[0] // G):
        entries = []
        for i in range(g * G, (g + 1) * G):
            for t in range(mask.shape[1]):
                if mask[i, t]:
                    v = float(scores[i, t])
                    entries.append(((0, 0.0) if math.isnan(v) else (1, v), i, t))
        entries.sort(key=lambda e: e[0])
        drop = max(1, math.ceil((1 - Fraction(str(rho))) * len(entries)))
        for (_, v), i, t in entries[drop:]:
            keep[i, t] = not nonzero or v > 0
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rho", [0.2, 0.5, 0.01, 0.99, 1.0])
def test_select_tokens_per_group_matches_the_literal_reference(seed, rho):
    """group_size=G against the literal loop: ties (few distinct scores), zeros (a zero-entropy token or A = 0),
    a group whose scores are all 0 (its advantages all 0: nonzero keeps nothing of it), rows of unequal lengths
    (random masks, one empty row), NaN, rho near 0 and 1 (at rho = 1 a group still drops its lowest token)."""
    g = torch.Generator().manual_seed(seed)
    G, N, T = 4, 16, 7
    scores = torch.randint(0, 4, (N, T), generator=g).float()
    scores[G:2 * G] = 0.0  # the all-zero group
    scores[0, seed] = float("nan")
    mask = torch.rand(N, T, generator=g) > 0.3
    mask[3] = False
    for nonzero in (False, True):
        sel = select_tokens(scores, mask, rho, nonzero=nonzero, group_size=G)
        assert sel.tolist() == literal_group_select(scores, mask, rho, G, nonzero).tolist(), nonzero
        assert not (sel & ~mask).any()
    sel = select_tokens(scores, mask, rho, nonzero=True, group_size=G)
    assert not sel[G:2 * G].any()
    budget = [gmts.kept_count([int(mask[i:i + G].sum())], rho, "drop")[0] for i in range(0, N, G)]
    assert gmts.scope_budget(mask, rho, G)[1].tolist() == budget
    assert [int(x) for x in select_tokens(scores, mask, rho, group_size=G).view(-1, G * T).sum(1)] == budget
    # the same rule through the labels gmts_trl passes: rows in any order, each row labelled by its group
    distinct = torch.rand(N, T, generator=g)  # no ties, so the rows' order cannot matter
    perm = torch.randperm(N, generator=g)  # row k of the shuffled batch is row perm[k]
    labels = (perm // G)[:, None].expand(N, T)
    by_label = select_tokens(distinct[perm], mask[perm], rho, groups=labels)
    assert torch.equal(by_label, select_tokens(distinct, mask, rho, group_size=G)[perm])


def test_group_budget_and_scope_hand_computed():
    """One group of 10 tokens, scores 0..9: rho 0.2 drops ceil(0.8 * 10) = 8 and keeps 8, 9; rho 0.25 drops
    ceil(7.5) = 8 too (the batch scope keeps ceil(2.5) = 3); rho 1 drops one. Ties: of equal scores the later is
    kept (the batch scope keeps the earlier). A scope that ranks over the whole batch keeps the highest scores
    of the high-scoring group only; per group, each group keeps its own top."""
    s = torch.arange(10.).view(2, 5)
    m = torch.ones(2, 5, dtype=torch.bool)
    assert select_tokens(s, m, 0.2, group_size=2).view(-1).nonzero().view(-1).tolist() == [8, 9]
    assert int(select_tokens(s, m, 0.25, group_size=2).sum()) == 2 and int(select_tokens(s, m, 0.25).sum()) == 3
    assert int(select_tokens(s, m, 1.0, group_size=2).sum()) == 9 and not select_tokens(s, m, 1.0, group_size=2)[0, 0]
    tie = torch.ones(1, 10)
    one = torch.ones(1, 10, dtype=torch.bool)
    assert select_tokens(tie, one, 0.2, group_size=1).view(-1).nonzero().view(-1).tolist() == [8, 9]
    assert select_tokens(tie, one, 0.2).view(-1).nonzero().view(-1).tolist() == [0, 1]
    two = torch.cat([torch.arange(10.).view(2, 5), torch.arange(10.).view(2, 5) + 100])  # group 1 scores higher
    mm = torch.ones(4, 5, dtype=torch.bool)
    per_group = select_tokens(two, mm, 0.2, group_size=2)
    assert per_group[:2].sum() == 2 and per_group[2:].sum() == 2
    assert select_tokens(two, mm, 0.2)[:2].sum() == 0  # the batch scope spends it all on group 1
    with pytest.raises(ValueError, match="not groups of 3"):
        select_tokens(two, mm, 0.2, group_size=3)


def test_scope_flag_and_each_methods_default():
    """--scope auto: group for gmts (its authors), batch for entropy (their ETS baseline), random and gradnorm;
    'all' keeps everything over the batch; --scope overrides either way; --loss-norm seq exists."""
    rule = {}
    for m in gmts.CHOICES["select"]:
        rule[m] = gmts.selection_rule(gmts.parse_args(["--select", m, "--group-size", "6"]))
    assert rule == {"all": (1.0, 0), "random": (0.2, 0), "entropy": (0.2, 0), "gmts": (0.2, 6), "gradnorm": (0.2, 0),
                    "rsi": (1.0, 0)}  # an interval: no budget
    assert gmts.selection_rule(gmts.parse_args(["--scope", "batch"])) == (0.2, 0)
    assert gmts.selection_rule(gmts.parse_args(["--select", "entropy", "--scope", "group"])) == (0.2, 8)
    assert gmts.selection_rule(gmts.parse_args(["--select", "all", "--scope", "group"])) == (1.0, 0)
    assert gmts.parse_args(["--loss-norm", "seq"]).loss_norm == "seq" and gmts.Config().scope == "auto"


def test_scores_definitions():
    H = torch.tensor([[0.5, 2.0], [1.0, 0.1]])
    G = torch.tensor([[0.3, 0.9], [0.6, 0.2]])
    om = omega(torch.tensor([-2.0, 0.5]), torch.ones(2, 2), 0.2, 0.28)
    assert token_scores("entropy", H, G, om).tolist() == H.tolist()
    assert torch.allclose(token_scores("gmts", H, G, om), torch.tensor([[1.0, 4.0], [0.5, 0.05]]))
    assert torch.allclose(token_scores("gradnorm", H, G, om), torch.tensor([[0.6, 1.8], [0.3, 0.1]]))
    assert token_scores("all", H, G, om).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    r = token_scores("random", H, G, om, generator=torch.Generator().manual_seed(0))
    assert r.shape == H.shape and torch.equal(r, token_scores("random", H, G, om, torch.Generator().manual_seed(0)))
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


def test_gmts_and_gradnorm_keep_no_token_of_an_all_equal_group():
    """Step 6 as train() runs it (step_selection) on three G = 8 groups: countdown-like rewards (one answer right at
    1.0, seven tagged but wrong at 0.1), then all 0.1 and all 0.7: inexact floats whose unmasked advantage would be
    ~0.007-0.06, not 0. The all-equal groups have the HIGHEST entropies. gmts and gradnorm keep none of their
    tokens, even with a budget beyond the 40 live tokens (then they keep exactly those 40); entropy spends its
    whole budget on them."""
    G, T = 8, 5
    adv = group_advantages(torch.tensor([1.0] + [0.1] * 7 + [0.1] * 8 + [0.7] * 8), G)  # (24,)
    g = torch.Generator().manual_seed(0)
    H = torch.rand(24, T, generator=g) + 0.5
    H[G:] += 2.0  # the all-equal groups: the highest entropies
    gn = torch.rand(24, T, generator=g) + 0.1
    mask = torch.ones(24, T, dtype=torch.bool)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    dead = (torch.arange(24) >= G)[:, None] & mask
    for method, scope in (("gmts", "batch"), ("gradnorm", "auto"), ("gmts", "auto"), ("gradnorm", "group")):
        for rho in (0.2, 0.5, 0.9):
            sel = gmts.step_selection(gmts.Config(select=method, rho=rho, scope=scope), None, H, gn, om, mask)
            assert not (sel & dead).any(), (method, rho)
            want = min(math.ceil(rho * 120), 40)  # over the batch: the budget moves to the live group
            if gmts.selection_rule(gmts.Config(select=method, scope=scope))[1]:  # per group: each keeps its own
                want = 40 - math.ceil((1 - Fraction(str(rho))) * 40)
            assert int(sel.sum()) == want, (method, scope, rho)
    ent = gmts.step_selection(gmts.Config(select="entropy", rho=0.2), None, H, gn, om, mask)
    assert int((ent & dead).sum()) == int(ent.sum()) == 24


def test_gmts_orders_like_entropy_within_an_answer(tiny):
    """On a real batch (gmts's rollout, batch_token_stats, omega at the first update, token_scores, select_tokens):
    within one answer omega is constant, so gmts orders and keeps that answer's tokens exactly as entropy does,
    for positive AND negative advantages."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=2)
    assert (adv > 0).any() and (adv < 0).any()
    logp, H, gn = gmts.batch_token_stats(model, b, 1.0, 4, 64)
    g = token_scores("gmts", H, gn, omega(adv, torch.exp(logp - logp), 0.2, 0.28))
    m = b["resp_mask"]
    for i in range(len(adv)):
        assert torch.equal(g[i][m[i]].argsort(stable=True), H[i][m[i]].argsort(stable=True)), i
        for rho in (0.1, 0.3, 0.6):
            assert torch.equal(select_tokens(g[i:i + 1], m[i:i + 1], rho, nonzero=True),
                               select_tokens(H[i:i + 1], m[i:i + 1], rho))


# ---- loss and update -------------------------------------------------------------------------------------------------


def test_k3_kl():
    a = torch.randn(100)
    assert (gmts.k3_kl(a, a) == 0).all()
    assert (gmts.k3_kl(a, a + torch.randn(100)) >= 0).all()
    # E_{y ~ pi}[k3] = KL(pi || ref), exactly, on small categoricals (d**2, |d| or the reversed KL all fail this)
    g = torch.Generator().manual_seed(0)
    for V in (2, 5, 30):
        pi = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, 0)
        ref = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, 0)
        expected_k3 = (pi * gmts.k3_kl(pi.log(), ref.log())).sum()
        assert expected_k3.item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-12, abs=1e-15)


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def _plain_logp(model, b, T):
    """log p of every response token from one plain forward: full logits, full log_softmax. (N, T)."""
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    P = b["prompt_ids"].shape[1]
    return torch.log_softmax(logits[:, P - 1:-1].float() / T, -1).gather(-1, b["comp_ids"][..., None]).squeeze(-1)


def _objective(valid, denom, T=1.0, beta=0.0):
    """The loss's settings: clip 0.2 / 0.28, w = 1, the policy term divided by denom, KL's by the
    valid count."""
    n_valid = float(max(int(valid.sum()), 1))
    return gmts.Objective(0.2, 0.28, beta, T, torch.ones(valid.shape), denom, n_valid)


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
    objective = _objective(b["resp_mask"], denom, T)
    stats = gmts.policy_update(model, opt, b, adv, sel, logp, objective, micro_batch=2, chunk=3,
                               max_grad_norm=1e9)
    assert stats["stepped"] == 1 and stats["live"] == int(sel.sum())
    opt.zero_grad()
    # policy_update clears .grad after its step: loss_backward leaves it for us
    gmts.loss_backward(model, b, adv, sel, logp, objective, micro_batch=2, chunk=3)
    g_ours = _grads(model)
    model.zero_grad()
    (-(adv[:, None] * _plain_logp(model, b, T) * sel).sum() / denom).backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0
    assert torch.allclose(g_ours, g_ref, atol=1e-5), (g_ours - g_ref).abs().max()
    assert stats["grad_norm"] == pytest.approx(float(g_ref.norm()), rel=1e-4)
    model.zero_grad()
    model.eval()


@pytest.mark.parametrize("loss_norm", ["all", "selected", "seq", "seq-sum"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_omega_is_minus_the_gradient_of_the_loss(tiny, loss_norm, beta):
    """omega_t = -dL/dlogp_t of the objective policy_update minimises (derivation step 1), for every --loss-norm,
    with KL off and on, on tokens whose clip is active and inactive (ratios 0.5-1.6, both signs of A):
    (a) against autograd of micro_batch_loss over the batch's needed tokens (kept: the whole omega; dropped: the
    KL part alone); (b) the parameter gradient loss_backward accumulates equals -sum_t omega_t dlogp_t/dtheta,
    computed through a plain forward. A mutant that drops w, the normaliser or the KL weight fails (a)."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=5)
    ref_model, _ = gmts.build_tiny(hidden=32, layers=2, seed=3)
    T, m = 1.0, b["resp_mask"]
    g = torch.Generator().manual_seed(1)
    logp = gmts.batch_token_stats(model, b, T, 4, 64)[0]
    old = (logp + (torch.rand(m.shape, generator=g) - 0.5)).masked_fill(~m, 0.0)  # ratios e^-0.5 .. e^0.5
    ref = gmts.batch_token_stats(ref_model, b, T, 4, 64)[0]
    sel = select_tokens(torch.rand(m.shape, generator=g), m, 0.4, group_size=4)
    norm = gmts.loss_weights(loss_norm, m, int(gmts.scope_budget(m, 0.4, 4)[1].sum()), 4)
    objective = gmts.Objective(0.2, 0.28, beta, T, **norm)
    ratio = torch.exp(logp - old)
    dead = gmts.clip_active(adv[:, None], ratio, 0.2, 0.28) & m
    assert dead.any() and (sel & m & ~dead & (adv != 0)[:, None]).any()
    om = omega(adv, ratio, 0.2, 0.28, beta, torch.exp(ref - logp), **norm)
    need = sel | m if beta else sel
    x = logp[need].clone().requires_grad_()
    loss, _ = gmts.micro_batch_loss(x, old[need], adv[:, None].expand_as(m)[need], sel[need], ref[need],
                                    norm["w"][need], objective)
    grad, = torch.autograd.grad(loss, x)
    kept = sel[need]
    assert torch.allclose(-grad[kept], om[need][kept], atol=1e-7, rtol=1e-5)
    kl_part = om - omega(adv, ratio, 0.2, 0.28, **norm)  # the KL term's weight: on dropped tokens too
    assert torch.allclose(-grad[~kept], kl_part[need][~kept], atol=1e-7, rtol=1e-5)
    assert (kl_part[need][~kept] != 0).any() == (beta > 0)
    model.zero_grad()
    gmts.loss_backward(model, b, adv, sel, old, objective, micro_batch=5, chunk=7, ref_logp=ref)
    g_ours = _grads(model)
    model.zero_grad()
    lp = _plain_logp(model, b, T)
    om_plain = omega(adv, torch.exp(lp.detach() - old), 0.2, 0.28, beta, torch.exp(ref - lp.detach()), **norm)
    weight = torch.where(sel, om_plain, om_plain - omega(adv, torch.exp(lp.detach() - old), 0.2, 0.28, **norm))
    (-(weight * lp * need).sum()).backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0 and torch.allclose(g_ours, g_ref, atol=1e-6), (g_ours - g_ref).abs().max()
    model.zero_grad()


def test_live_counts_a_token_once_under_kl():
    """Hand-computed step-rule count on four tokens, on-policy (r = 1): token 0 kept with A = 1 and
    its log-prob off the reference's; token 1 kept with A = 0, at the reference; token 2 dropped,
    off the reference; token 3 dropped, at it. Live (a gradient): 0 (both terms) and 2 (KL only):
    2 tokens, token 0 counted once, not twice (the code before issue 43 said 3)."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([1.0, 0.0, 1.0, 1.0])
    kept = torch.tensor([True, True, False, False])
    ref = logp + torch.tensor([0.1, 0.0, -0.2, 0.0])
    objective = gmts.Objective(0.2, 0.28, 0.1, 1.0, torch.ones(1, 4), 4.0, 4.0)
    _, counts = gmts.micro_batch_loss(logp, logp, adv, kept, ref, torch.ones(4), objective)
    assert counts["live"] == 2
    no_kl = gmts.Objective(0.2, 0.28, 0.0, 1.0, torch.ones(1, 4), 4.0, 4.0)
    assert gmts.micro_batch_loss(logp, logp, adv, kept, ref, torch.ones(4), no_kl)[1]["live"] == 1


def test_one_budget_feeds_the_mask_and_the_selected_normaliser(tmp_path, monkeypatch, parity):
    """A new budget rule given to the one function (kept_count: here n // 3 of each scope's n valid
    tokens) changes both what train's mask keeps and --loss-norm selected's divisor, in the group
    and the batch scope: they agree with the rule, and differ from the default rule's count."""
    real_count, real_update = gmts.kept_count, gmts.policy_update
    monkeypatch.setattr(gmts, "kept_count", lambda counts, rho, rule: [n // 3 for n in counts])
    seen = []

    def update(model, opt, batch, adv, sel_mask, old_logp, objective, **k):
        seen.append((sel_mask.clone(), objective.denom, k["valid"].clone()))
        return real_update(model, opt, batch, adv, sel_mask, old_logp, objective, **k)
    monkeypatch.setattr(gmts, "policy_update", update)
    for scope, G in (("group", 4), ("batch", 0)):
        seen.clear()
        train_main(*SMALL, "--steps", "1", "--select", "entropy", "--scope", scope,
                   "--loss-norm", "selected", "--out", tmp_path / scope)
        ((sel, denom, valid),) = seen
        per_scope = [int(valid.sum())]
        if G:
            per_scope = [int(valid[i:i + G].sum()) for i in range(0, len(valid), G)]
        want = sum(n // 3 for n in per_scope)
        assert int(sel.sum()) == denom == want
        assert want != sum(real_count(per_scope, 0.2, "drop" if G else "ceil"))


def test_a_users_method_row_sets_its_score_zero_rule_and_scope(tmp_path, monkeypatch, parity):
    """A method is one row: a Method (score, zero_kept, scope) added to METHODS is a --select method
    for token_scores and step_selection, and train(score_fn=Method(...)) trains a user's score with
    the row's properties. The score here is the entropy with every even position set to 0:
    zero_kept=False keeps none of those, and scope "group" ranks within each prompt's G answers by
    the authors' rule (select_tokens with group_size G, nonzero), where the default row (a bare
    function: zeros kept, --select gmts's group scope) and a batch row keep other tokens."""
    def score(logp, entropy, dz_norm, om, generator=None):
        s = entropy.clone()
        s[:, ::2] = 0.0
        return s
    row = gmts.Method(score, zero_kept=False, scope="group")
    monkeypatch.setitem(gmts.METHODS, "mine", row)
    H = torch.rand(8, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    mask = torch.ones(8, 6, dtype=torch.bool)
    assert torch.equal(gmts.token_scores("mine", H, H, H), score(None, H, H, H))
    # each group of 24 tokens keeps 18 by the budget, 12 of them non-zero
    cfg = gmts.Config(select="mine", group_size=4, rho=0.75)
    sel = gmts.step_selection(cfg, None, H, H, H, mask)
    want = select_tokens(score(None, H, H, H), mask, 0.75, nonzero=True, group_size=4)
    assert torch.equal(sel, want)
    assert not sel[:, ::2].any() and [int(sel[:4].sum()), int(sel[4:].sum())] == [12, 12]
    real_select = gmts.step_selection
    seen = []

    def spy(cfg, logp, entropy, dz_norm, om, mask, score_fn=None):
        sel = real_select(cfg, logp, entropy, dz_norm, om, mask, score_fn)
        seen.append((entropy, mask, sel))
        return sel
    monkeypatch.setattr(gmts, "step_selection", spy)
    kept = {}
    batch_row = gmts.Method(score, zero_kept=False, scope="batch")
    runs = {"mine": (row, 0.8), "bare": (score, 0.8), "mine@0.2": (row, 0.2),
            "batch": (batch_row, 0.2)}
    for name, (fn, rho) in runs.items():
        seen.clear()
        argv = [*map(str, SMALL), "--steps", "1", "--rho", str(rho), "--out", str(tmp_path / name)]
        gmts.train(gmts.parse_args(argv), log=lambda *a: None, score_fn=fn)
        ((entropy, mask, sel),) = seen
        s = score(None, entropy, None, None)
        nonzero, G = name != "bare", 4 if name != "batch" else 0
        assert torch.equal(sel, select_tokens(s, mask, rho, nonzero=nonzero, group_size=G)), name
        kept[name] = sel
    assert not kept["mine"][:, ::2].any() and kept["bare"][:, ::2].any()
    assert not torch.equal(kept["mine@0.2"], kept["batch"])


def test_loss_weights_hand_computed():
    """seq: w = 1 / |o_i| and both divisors N (GRPO's per-answer mean, averaged over the answers); all: the valid
    count; selected: the kept count for the policy term, the valid count for KL. A row with no valid token
    (--overlong-filter) gets a finite weight and counts in N."""
    valid = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    seq = gmts.loss_weights("seq", valid, 2)
    assert gmts.loss_weights("seq-sum", valid, 2, 2)["denom"] == 2.0  # (1/G) per group, summed
    assert seq["w"][:, 0].tolist() == pytest.approx([1 / 3, 1.0, 1.0], rel=1e-7)
    assert seq["denom"] == seq["kl_denom"] == 3.0
    assert (gmts.loss_weights("all", valid, 2)["denom"], gmts.loss_weights("all", valid, 2)["kl_denom"]) == (4., 4.)
    sel = gmts.loss_weights("selected", valid, 2)
    assert (sel["denom"], sel["kl_denom"]) == (2.0, 4.0) and sel["w"].eq(1).all()


def test_kl_gradient_matches_autograd_and_ignores_the_selection(tiny):
    """With kl_beta > 0 the loss is sum_kept l / denom + beta * sum_valid k3 / n_valid: the KL term's normaliser is
    the valid-token count whatever rho or --loss-norm, so its gradient is the same at rho 0.2 and 1.0."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=11)
    ref_model, _ = gmts.build_tiny(hidden=32, layers=2, seed=1)  # another model as pi_ref
    T, beta, m = 1.0, 0.1, b["resp_mask"]
    logp = gmts.batch_token_stats(model, b, T, 4, 64)[0]
    ref_logp = gmts.batch_token_stats(ref_model, b, T, 4, 64)[0]
    scores = torch.rand(m.shape, generator=torch.Generator().manual_seed(0))
    kw = dict(micro_batch=3, chunk=5, ref_logp=ref_logp)
    kl_only = []  # the KL term's gradient (A = 0) at each rho
    for rho in (0.2, 1.0):
        sel = select_tokens(scores, m, rho)
        denom = float(sel.sum())  # --loss-norm selected: the case whose KL used to scale by 1 / rho
        for a in (torch.zeros_like(adv), adv):
            model.zero_grad()
            stats = gmts.loss_backward(model, b, a, sel, logp, _objective(m, denom, T, beta), **kw)
            g_ours = _grads(model)
            model.zero_grad()
            lp = _plain_logp(model, b, T)
            k3 = gmts.k3_kl(lp, ref_logp) * m
            (-(a[:, None] * lp * sel).sum() / denom + beta * k3.sum() / m.sum()).backward()
            g_ref = _grads(model)
            assert torch.allclose(g_ours, g_ref, atol=1e-6), (rho, (g_ours - g_ref).abs().max())
            assert stats["kl"] == pytest.approx(float(k3.detach().sum() / m.sum()), rel=1e-5) and stats["kl"] > 0
            if not a.any():
                kl_only.append(g_ours)
    assert kl_only[0].abs().max() > 0 and torch.allclose(kl_only[0], kl_only[1], atol=1e-7)
    model.zero_grad()


def test_loss_clips_each_side_at_its_own_bound():
    """eps_l = 0.1 != eps_h = 0.3, ratios between the bounds, both signs of A (old_logp = 0, so r = exp(logp)).
    Hand-computed l = -min(r A, clip(r, 0.9, 1.3) A) and dl/dlogp (-A r where the clip is inactive, else 0):
      A = +1: r 1.2 -> -1.2, grad -1.2 (inside 1 + eps_h); r 1.35 -> -1.3, 0 (clipped at 1.3)
      A = -1: r 0.95 -> 0.95, grad 0.95; r 0.85 -> 0.9, 0 (clipped at 1 - eps_l); r 0.75 -> 0.9, 0;
              r 1.25 -> 1.25, grad 1.25 (A < 0 is never clipped above)
    Using eps_l for both bounds gives -1.1 at r 1.2; using eps_h below gives 0.85 and 0.75."""
    r = torch.tensor([1.2, 1.35, 0.95, 0.85, 0.75, 1.25], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    logp = r.log().requires_grad_(True)
    loss, active = gmts.grpo_token_loss(logp, torch.zeros_like(r), adv, 0.1, 0.3)
    assert loss.tolist() == pytest.approx([-1.2, -1.3, 0.95, 0.9, 0.9, 1.25], abs=1e-12)
    assert active.tolist() == [False, True, False, True, True, False]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.2, 0.0, 0.95, 0.0, 0.0, 1.25], abs=1e-12)


def test_kl_reference_on_the_loss_path_gives_equal_bits(tiny):
    """response_logp runs the loss's own code path: a reference whose weights equal the policy's gives the loss's
    log-probs bit for bit, so with A = 0 the KL is exactly 0, no token is live and nothing steps (the old path, via
    batch_token_stats, differed by float noise and stepped on it). A reference that differs makes every token live."""
    import copy
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=5)
    m, adv = b["resp_mask"], torch.zeros(b["comp_ids"].shape[0])
    same = copy.deepcopy(model)
    ref_logp = gmts.response_logp(same, b, m, 1.0, 3, 5)
    logp = gmts.batch_token_stats(model, b, 1.0, 3, 5)[0]
    kw = dict(micro_batch=3, chunk=5, max_grad_norm=1.0)
    objective = _objective(m, float(m.sum()), beta=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    stats = gmts.policy_update(model, opt, b, adv, m, logp, objective, ref_logp=ref_logp, **kw)
    assert stats["kl"] == 0.0 and stats["live"] == 0 and stats["stepped"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state
    other = gmts.response_logp(gmts.build_tiny(hidden=32, layers=2, seed=1)[0], b, m, 1.0, 3, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a no-op step: only the step rule is looked at
    stats = gmts.policy_update(model, opt, b, adv, m, logp, objective, ref_logp=other, **kw)
    assert stats["kl"] > 0 and stats["live"] == int(m.sum()) and stats["stepped"] == 1


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
    objective = _objective(b["resp_mask"], 10.0)
    stats = gmts.policy_update(model, opt, b, adv, b["resp_mask"], bad_old, objective,
                               micro_batch=4, chunk=64, max_grad_norm=1.0)
    assert stats["skipped"] == 1 and stats["stepped"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # Adam moments untouched too


def test_all_zero_advantage_batch_makes_no_update(tiny):
    """The step rule: no kept token with a live gradient, no optimiser step, for every method (even 'all', which
    keeps every token: a zero gradient would still move AdamW's moments and, with weight decay, the weights)."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=7)
    adv = torch.zeros(b["comp_ids"].shape[0])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    H = torch.rand(b["resp_mask"].shape)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    assert not gmts.select_tokens(token_scores("gmts", H, H, om), b["resp_mask"], 0.2, nonzero=True).any()
    for sel in (gmts.select_tokens(token_scores("gmts", H, H, om), b["resp_mask"], 0.2, nonzero=True),
                b["resp_mask"]):  # gmts keeps nothing; 'all' keeps every token, all with A = 0
        objective = _objective(b["resp_mask"], 10.0)
        stats = gmts.policy_update(model, opt, b, adv, sel, torch.zeros_like(H), objective,
                                   micro_batch=4, chunk=64, max_grad_norm=1.0)
        assert stats["stepped"] == 0 and stats["skipped"] == 0 and stats["live"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state


def test_a_batch_of_only_all_equal_groups_does_not_step(tiny):
    """The step rule on a real batch of two G = 8 groups whose rewards are all 0.1 and all 0.7 (inexact floats: the
    unmasked advantage would be ~0.007 and ~0.06). A is exactly 0, so for every method (train's step_selection) no
    kept token is live, policy_update does not step, and neither the weights nor AdamW's moments move (weight decay
    on: a step on a zero gradient would still move them)."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=7, n_prompts=2, G=8)
    adv = group_advantages(torch.tensor([0.1] * 8 + [0.7] * 8), 8)
    m = b["resp_mask"]
    logp, H, gn = gmts.batch_token_stats(model, b, 1.0, 4, 64)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for method in gmts.CHOICES["select"]:
        sel = gmts.step_selection(gmts.Config(select=method), logp, H, gn, om, m)
        assert sel.any() == (method in ("all", "random", "entropy", "rsi")), method
        objective = _objective(m, float(m.sum()))
        stats = gmts.policy_update(model, opt, b, adv, sel, logp, objective, micro_batch=4,
                                   chunk=64, max_grad_norm=1.0)
        assert stats["stepped"] == 0 and stats["live"] == 0 and stats["grad_norm"] == 0.0, (method, stats)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state


# ---- training loop: the lr schedule, then runs in this process through gmts.main -------------------------------------


def test_lr_schedule_hand_computed():
    f = [gmts.lr_factor(i, total=6, warmup=2) for i in range(6)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])  # up over 2 steps, then (6 - i) / 4
    assert [gmts.lr_factor(i, 6, 2, decay=False) for i in range(6)] == [0.5] + [1.0] * 5
    assert gmts.lr_factor(0, 1, 10) == 0.1 and gmts.lr_factor(99, 100, 0) == pytest.approx(0.01)


def test_step_lr_counts_update_slots():
    """--warmup-steps and the decay count update slots, steps x --inner-updates (the flag's help): with 3 steps of 2
    inner updates, warm-up 2, the six slots get lr_factor's 0.5, 1, 1, 0.75, 0.5, 0.25, in order."""
    cfg = gmts.Config(lr=2.0, steps=3, inner_updates=2, warmup_steps=2)
    got = [gmts.step_lr(cfg, step, inner) for step in (1, 2, 3) for inner in (0, 1)]
    assert got == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5])


SMALL = ["--model", "tiny", "--task", "countdown", "--data", "easy", "--short-prompt", "--prompts-per-step", "2",
         "--group-size", "4", "--max-new-tokens", "16", "--eval-size", "2", "--max-resample", "2",
         "--eval-every", "0", "--save-every", "0"]
VOLATILE = ("step_time_s", "tokens_per_s", "rollout_time_s")
STEP_KEYS = ("step", "reward_mean", "acc", "selected_frac", "entropy_mean", "entropy_selected_mean",
             "zero_adv_selected_frac", "grad_norm", "loss", "clip_frac", "kl", "completion_len", "truncated_frac", "lr",
             "skipped_steps", "groups_filtered_frac", "rollout_batches", "rollout_time_s", "step_time_s",
             "tokens_per_s")


def parity_reward(text, row):
    """A reward that splits almost every group of the random tiny model: the parity of the answer's characters.
    (The SIGKILL driver below spells out the same rule.)"""
    return float(sum(map(ord, text)) % 2)


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)


@pytest.fixture
def one_thread():
    """Runs compared bit for bit with a subprocess (OMP_NUM_THREADS=1) must use one thread here too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_main(*argv):
    """A run through gmts.main in this process; returns the metrics (the volatile timings dropped)."""
    argv = [str(a) for a in argv]
    gmts.main(argv)
    out = argv[argv.index("--resume") + 1] if "--resume" in argv else argv[len(argv) - argv[::-1].index("--out")]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in gmts.read_metrics(out)]


def _metrics(path):
    lines = path.read_text().splitlines()
    recs = [json.loads(x) for x in lines]  # a torn line would raise here
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in recs]


def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_method_honours_select_and_loss_norm(tmp_path, monkeypatch):
    """Each --select method, 2 steps, no dynamic sampling, on batches of one live group (parity reward) and one dead
    group (reward 0: A = 0). 'all' keeps every token; random/entropy keep ceil(rho * n) and spend some on the dead
    group; gmts/gradnorm never keep an A = 0 token. --loss-norm selected divides the same step-1 loss (and gradient)
    by the kept count instead of the valid count: n_valid / n_kept times larger."""
    from transformers import AutoModelForCausalLM

    real_read = gmts.read_data

    def read(cfg):  # every step: the first prompt live, the second dead
        data = real_read(cfg)
        draw = data.draw
        data.draw = lambda n, *key: [dict(r, live=i % 2 == 0) for i, r in enumerate(draw(n, *key))]
        return data
    monkeypatch.setattr(gmts, "read_data", read)
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: parity_reward(t, row) if row.get("live")
                        else 0.0)
    base = [*SMALL, "--group-size", "8", "--steps", "2", "--no-filter-groups"]
    runs = {m: train_main(*base, "--select", m, "--out", tmp_path / m)
            for m in ("all", "random", "entropy", "gmts", "gradnorm")}
    for method, recs in runs.items():
        steps = recs[1:]
        assert [r["step"] for r in recs] == [0, 1, 2] and "eval_acc" in recs[0] and "eval_acc" in steps[-1]
        for r in steps:
            assert set(STEP_KEYS) - set(VOLATILE) <= set(r), set(STEP_KEYS) - set(r)
            assert r["groups_filtered_frac"] == 0.5 and r["rollout_batches"] == 1  # the setup: one dead group
            n_valid = round(r["completion_len"] * 16)
            n_kept = round(r["selected_frac"] * n_valid)
            budget = math.ceil(0.2 * n_valid - 1e-9)
            if method == "all":
                assert r["selected_frac"] == 1.0 and r["zero_adv_selected_frac"] > 0
            elif method in ("random", "entropy"):
                assert n_kept == budget and r["zero_adv_selected_frac"] > 0, (method, r)
            else:
                assert r["zero_adv_selected_frac"] == 0.0 and 0 < n_kept <= budget, (method, r)
        assert AutoModelForCausalLM.from_pretrained(tmp_path / method).config.model_type == "qwen2"
    batch = [*base, "--select", "gmts", "--scope", "batch", "--rho", "0.9"]  # a budget beyond the live group
    sel = train_main(*batch, "--loss-norm", "selected", "--out", tmp_path / "gmts-selected")[1]
    ref = train_main(*batch, "--out", tmp_path / "gmts-batch")[1]  # the same step 1: same model, batch, kept tokens
    assert sel["selected_frac"] == ref["selected_frac"] < 1 and ref["loss"] != 0
    n_valid = round(ref["completion_len"] * 16)
    budget = math.ceil(0.9 * n_valid - 1e-9)  # what selected divides by: the budget, zero scores included
    assert round(ref["selected_frac"] * n_valid) < budget  # gmts dropped the dead group's zero scores
    assert sel["loss"] == pytest.approx(ref["loss"] * n_valid / budget, rel=1e-4)
    assert sel["grad_norm"] == pytest.approx(ref["grad_norm"] * n_valid / budget, rel=1e-4)


def test_constant_reward_every_method_ends_identical_and_unchanged(tmp_path, monkeypatch):
    """Issue 14's one step rule: with a constant reward (every advantage 0) no method steps its optimiser, so all
    five end with the starting weights, the same (empty) Adam state and the same lr, which follows GRPO steps.
    Weight decay is on: an optimiser step on a zero gradient would still move the weights. The reward is 0.1 at
    G = 8 (every answer tagged but wrong): an inexact float whose unmasked group advantage would be ~0.007."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: 0.1)
    ends = {}
    for m in ("all", "random", "entropy", "gmts", "gradnorm"):
        out = tmp_path / m
        recs = train_main(*SMALL, "--group-size", "8", "--prompts-per-step", "1", "--steps", "2", "--select", m,
                          "--weight-decay", "0.1", "--lr", "1e-3", "--out", out)
        steps = recs[1:]
        assert [r["lr"] for r in steps] == pytest.approx([1e-4, 2e-4])  # warm-up 10: lr * 1/10, 2/10
        assert all(r["groups_filtered_frac"] == 1.0 and r["rollout_batches"] == 2 for r in steps)  # resampled to cap
        assert all(r["grad_norm"] == 0 and r["loss"] == 0 for r in steps)
        for r in steps:  # 'all' keeps everything, random/entropy rho of it, gmts/gradnorm nothing (all scores 0)
            want = {"all": 1.0, "gmts": 0.0, "gradnorm": 0.0}.get(m)
            assert r["selected_frac"] == want if want is not None else 0 < r["selected_frac"] < 0.5, (m, r)
        assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000000", "ckpt-000002"]
        assert _same_weights(out, out / "ckpt-000000")  # unchanged from the start
        state = torch.load(out / "ckpt-000002" / "state.pt", weights_only=True)
        ends[m] = (_weights(out), state["opt"], [r["lr"] for r in steps])
    w0, opt0, lr0 = ends["all"]
    assert opt0["state"] == {}
    for m, (w, opt, lr) in ends.items():
        assert all(torch.equal(w[k], w0[k]) for k in w0) and opt == opt0 and lr == lr0, m


def test_kl_run_with_constant_reward_never_moves(tmp_path, monkeypatch):
    """Issue 24 item 4: the warm start, --kl-beta 0.05, lr 1e-4 and a constant reward (every A = 0). The true KL
    gradient is 0; the weights stay bit for bit those of the start and the KL is exactly 0 at every step (the old
    code measured a 1e-8 gradient between two log-prob paths and AdamW turned it into 0.1-0.9 lr moves)."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: 0.5)
    out = tmp_path / "kl"
    recs = train_main("--preset", "smoke", "--steps", "3", "--kl-beta", "0.05", "--lr", "1e-4", "--warmup-steps",
                      "0", "--no-filter-groups", "--save-every", "0", "--out", out)
    assert [r["kl"] for r in recs[1:]] == [0.0, 0.0, 0.0]
    assert all(r["grad_norm"] == 0.0 for r in recs[1:])
    assert _same_weights(out, out / "ckpt-000000")


def test_filter_groups_cli_writes_its_metrics(tmp_path):
    """The real CLI (issue 14's command, small sizes). The random tiny model never answers, so no group is
    informative: every step draws --max-resample (4) rollout batches and reports all groups filtered."""
    out = tmp_path / "f"
    r = run_cli("--model", "tiny", "--task", "countdown", "--steps", "2", "--filter-groups", "--prompts-per-step", "2",
                "--group-size", "4", "--max-new-tokens", "12", "--eval-size", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _metrics(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == [0, 1, 2]
    assert all(x["groups_filtered_frac"] == 1.0 and x["rollout_batches"] == 4 for x in recs[1:])
    assert (out / "metrics.png").stat().st_size > 1000


def test_kl_run_loads_a_reference_and_logs_kl(tmp_path, monkeypatch, parity):
    loaded, real = [], gmts.load_model
    monkeypatch.setattr(gmts, "load_model", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    recs = train_main(*SMALL, "--steps", "2", "--kl-beta", "0.1", "--lr", "1e-2", "--warmup-steps", "0",
                      "--out", tmp_path / "kl")
    assert loaded == ["tiny", "tiny"]  # the policy and pi_ref
    assert recs[1]["kl"] < 1e-6 < recs[2]["kl"]  # step 1: the policy is still pi_ref; step 2: it has moved
    assert recs[1]["grad_norm"] > 0
    loaded.clear()
    train_main(*SMALL, "--steps", "1", "--out", tmp_path / "nokl")
    assert loaded == ["tiny"]  # beta = 0: no reference model


def test_train_scores_with_the_kl_weight(tmp_path, monkeypatch, parity):
    """Step 6 as train() runs it with --kl-beta and --loss-norm seq: the omega handed to the selection is the loss's
    own (loss_weights, and the KL weight from the reference's log-probs), recomputed from the tensors train passes
    to policy_update; at step 2 the policy has left its reference, so the KL weight is not 0."""
    seen = []
    real_select, real_update = gmts.step_selection, gmts.policy_update
    monkeypatch.setattr(gmts, "step_selection", lambda cfg, logp, H, gn, om, mask, fn=None: seen.append(
        dict(logp=logp, om=om, mask=mask)) or real_select(cfg, logp, H, gn, om, mask, fn))
    def update(model, opt, batch, adv, sel, old, objective, **k):
        seen[-1].update(adv=adv, old=old, ref=k["ref_logp"], denom=objective.denom)
        return real_update(model, opt, batch, adv, sel, old, objective, **k)
    monkeypatch.setattr(gmts, "policy_update", update)
    train_main(*SMALL, "--steps", "2", "--kl-beta", "0.1", "--loss-norm", "seq", "--lr", "1e-2",
               "--warmup-steps", "0", "--out", tmp_path / "kl")
    last = seen[-1]
    rho, g = gmts.selection_rule(gmts.parse_args(["--group-size", "4"]))
    n_kept = int(gmts.scope_budget(last["mask"], rho, g)[1].sum())
    norm = gmts.loss_weights("seq", last["mask"], n_kept)
    ratio = torch.exp(last["logp"] - last["old"])
    want = omega(last["adv"], ratio, 0.2, 0.28, 0.1, torch.exp(last["ref"] - last["logp"]), **norm)
    assert torch.equal(last["om"], want) and norm["denom"] == last["denom"] == 8.0
    assert not torch.allclose(last["om"], omega(last["adv"], ratio, 0.2, 0.28, **norm), atol=1e-9)


def test_inner_updates_recompute_scores_and_move_the_ratio(tmp_path, monkeypatch, parity):
    """--inner-updates 2: the statistics and scores are recomputed before the second update, whose ratio
    pi_theta / pi_old has moved off 1 (the first is exactly 1)."""
    ratios, entropies = [], []
    real_omega, real_select = gmts.omega, gmts.step_selection
    monkeypatch.setattr(gmts, "omega", lambda adv, ratio, *a, **k: ratios.append(ratio.clone()) or
                        real_omega(adv, ratio, *a, **k))
    def select(cfg, logp, H, *a):
        entropies.append(H.clone())
        return real_select(cfg, logp, H, *a)
    monkeypatch.setattr(gmts, "step_selection", select)
    recs = train_main(*SMALL, "--steps", "1", "--inner-updates", "2", "--lr", "1e-2", "--warmup-steps", "0",
                      "--out", tmp_path / "mu")
    assert len(ratios) == len(entropies) == 2
    assert (ratios[0] == 1).all() and (ratios[1] - 1).abs().max() > 1e-3
    assert not torch.equal(entropies[0], entropies[1])
    assert recs[1]["grad_norm"] > 0


def test_filter_groups_resamples_new_prompts_until_b_groups_are_informative(tmp_path, monkeypatch):
    """Dynamic sampling (sample_groups, B = 2): the k-th rollout batch of step s draws its prompts with the key
    (s, k), and batches are drawn until B groups are informative. Here batch 0 has one live prompt, batch 1 none,
    batch 2 two: the step draws exactly 3 batches (keys (1, 0), (1, 1), (1, 2)), reports half of its 6 groups
    filtered and trains on the first 2 informative groups, both split 1, 0, 1, 0 (reward mean 0.5)."""
    live = {0: [True, False], 1: [False, False], 2: [True, True]}  # resample k -> which of its 2 prompts is live
    keys, real_read = [], gmts.read_data

    def read(cfg):
        data = real_read(cfg)
        draw = data.draw

        def tagged(n, *key):
            keys.append(key)
            return [dict(r, live=live.get(key[1], [False] * n)[i]) for i, r in enumerate(draw(n, *key))]
        data.draw = tagged
        return data
    monkeypatch.setattr(gmts, "read_data", read)
    it = itertools.cycle([1.0, 0.0])
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: next(it) if row.get("live") else 0.0)
    recs = train_main(*SMALL, "--steps", "1", "--filter-groups", "--max-resample", "4", "--out", tmp_path / "f")
    assert keys == [(1, 0), (1, 1), (1, 2)]
    step = recs[1]
    assert step["rollout_batches"] == 3 and step["groups_filtered_frac"] == 0.5
    assert step["reward_mean"] == 0.5 and step["grad_norm"] > 0


def test_training_at_a_temperature_is_on_policy(tmp_path, monkeypatch, parity):
    """--temperature 0.7 reaches every log-prob of a step: the sampler's (rollout), pi_old's statistics and the
    loss's. So the sampler and the learner agree (sampler_logp_gap < 1e-5) and the first update's ratio
    pi_theta / pi_old is 1 on every kept token ('all' keeps them all)."""
    ratios, real = [], gmts.grpo_token_loss
    monkeypatch.setattr(gmts, "grpo_token_loss", lambda logp, old, *a: ratios.append(torch.exp(logp - old).detach())
                        or real(logp, old, *a))
    recs = train_main(*SMALL, "--steps", "1", "--temperature", "0.7", "--select", "all", "--no-filter-groups",
                      "--out", tmp_path / "t")
    assert recs[1]["sampler_logp_gap_max"] < 1e-5 and recs[1]["clip_frac"] == 0.0
    r = torch.cat(ratios)
    assert r.numel() == round(recs[1]["completion_len"] * 8) and (r - 1).abs().max() < 1e-5


def test_a_truncated_answer_adds_nothing_to_the_gradient(tiny):
    """loss_backward with --overlong-filter's `valid` (resp_mask minus truncated answers), KL on: the gradient is the
    plain one of the kept tokens and the k3 terms of the other answers only, truncated rows contributing nothing
    though they are kept and have A != 0 (their advantage and their log-probs could move the weights otherwise)."""
    model, tok = tiny
    model.train()
    b, adv = _batch_from(model, tok, seed=5, n_prompts=3)
    trunc = torch.arange(len(adv)) % 3 == 0  # (N,): these answers count as cut at the length limit
    assert (adv[trunc] != 0).any()
    valid = b["resp_mask"] & ~trunc[:, None]
    logp = gmts.batch_token_stats(model, b, 1.0, 4, 7)[0]
    ref = logp - 0.3 * b["resp_mask"]  # a reference that differs everywhere: KL pulls on every valid token
    model.zero_grad()
    objective = _objective(valid, float(valid.sum()), beta=0.5)
    gmts.loss_backward(model, b, adv, valid, logp, objective, micro_batch=2, chunk=3, ref_logp=ref,
                       valid=valid)
    g_ours = _grads(model)
    model.zero_grad()
    lp = _plain_logp(model, b, 1.0)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    loss = (-(adv[:, None] * lp * valid).sum() + 0.5 * (k3 * valid).sum()) / valid.sum()
    loss.backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0 and torch.allclose(g_ours, g_ref, atol=1e-5), (g_ours - g_ref).abs().max()
    model.zero_grad()
    objective = _objective(b["resp_mask"], float(valid.sum()), beta=0.5)
    gmts.loss_backward(model, b, adv, b["resp_mask"], logp, objective, micro_batch=2, chunk=3,
                       ref_logp=ref)  # no filter
    assert not torch.allclose(_grads(model), g_ref, atol=1e-4)  # the truncated rows would have moved it
    model.zero_grad()


def test_overlong_filter_trains_nothing_on_truncated_answers(tmp_path, monkeypatch, parity):
    """--overlong-filter (DAPO): an answer flagged truncated trains nothing. Every other answer of train's rollouts
    is flagged here; policy_update must get valid = resp_mask minus those rows, a selection inside it ('all': all
    of it; gmts: part of it) and --loss-norm all's denominator = the valid count; with KL the same `valid`; the
    logged selected_frac is kept / valid."""
    real_rollout, real_update = gmts.rollout, gmts.policy_update
    seen = []

    def rollout(*a, **k):
        b = real_rollout(*a, **k)
        if k.get("sampler_logp"):  # train's rollouts, not evaluate's
            b["truncated"] = torch.arange(len(b["texts"])) % 2 == 1
        return b

    def update(model, opt, batch, adv, sel_mask, old_logp, objective, **k):
        seen.append((batch, sel_mask.clone(), objective.denom, k["valid"].clone()))
        return real_update(model, opt, batch, adv, sel_mask, old_logp, objective, **k)
    monkeypatch.setattr(gmts, "rollout", rollout)
    monkeypatch.setattr(gmts, "policy_update", update)
    for method, kl in (("all", "0"), ("gmts", "0.1")):
        seen.clear()
        recs = train_main(*SMALL, "--steps", "1", "--overlong-filter", "--select", method, "--kl-beta", kl,
                          "--no-filter-groups", "--out", tmp_path / method)
        ((batch, sel, denom, valid),) = seen
        trunc = batch["truncated"][:, None]
        assert trunc.any() and (~trunc).any()
        assert torch.equal(valid, batch["resp_mask"] & ~trunc) and not (sel & trunc).any()
        assert denom == float(valid.sum()) < float(batch["resp_mask"].sum())
        assert torch.equal(sel, valid) if method == "all" else (sel.any() and not (sel & ~valid).any())
        # selected_frac is a share of the valid tokens: 1 for 'all', not valid / resp_mask
        assert recs[-1]["selected_frac"] == float(sel.sum()) / float(valid.sum())


def test_cpu_preset_with_a_tiny_budget(tmp_path):
    out = tmp_path / "cpu"
    recs = train_main("--preset", "cpu", "--steps", "2", "--prompts-per-step", "2", "--eval-size", "4",
                      "--eval-every", "1", "--out", out)
    assert recs[0]["step"] == 0 and "eval_acc" in recs[0]  # the warm start's accuracy is the first eval_acc
    assert [x["step"] for x in recs] == [0, 1, 2] and (out / "metrics.png").stat().st_size > 1000
    assert json.loads((out / "run_config.json").read_text())["model"] == gmts.WARM_CPU


# ######################################################################################################################
# Below gmts.py's "Supporting code" banner, in its order.
# ######################################################################################################################


# ---- problem generators and data loaders -----------------------------------------------------------------------------


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
    for p in load_rows("math", "easy", 300, seed=0):  # one step; the words alone tell the operation
        a, op, b, _, c = p["steps"][0].split()
        assert len(p["steps"]) == 1 and p["answer"] == c and int(a) >= int(b) >= 2 and int(c) >= 0
        assert op == ("-" if " left?" in p["question"] else "*" if " in all?" in p["question"] else "+")
        assert re.search(rf" {a} .* {b}\b", p["question"])  # both numbers shown, a first


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("data", ["gen", "easy"])
def test_generators_are_deterministic_and_prompts_ask_for_the_format(task, data):
    t = get_task(task)  # (the reference answers and their test moved to gmts_lab.py)
    rows = t["load"](data, 200, 1)
    assert rows == t["load"](data, 200, 1)
    assert rows != t["load"](data, 200, 2)
    for row in rows:
        assert t["reward"]("no answer here", row) == 0.0
        for short in (False, True):
            assert isinstance(t["prompt"](row, short=short), str)
        assert "<answer>" in t["prompt"](row) and "<think>" in t["prompt"](row)


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
    assert get_task("math")["reward"]("<answer>\\boxed{1,450}</answer>", rows[0]) == 1.0
    lg = logic_problem(random.Random(3))
    p = write(tmp_path, "l.jsonl", [json.dumps(lg)])
    assert load_rows("logic", p, 0, 0) == [lg]


@pytest.mark.parametrize("task,lines,msg", [
    ("countdown", ['{"nums": [1, 2], "target": 3}', "", "{not json"], "line 3: invalid JSON"),
    ("countdown", ['{"nums": [1, 2], "target": 3}', '{"nums": [1, 2]}'], 'line 2: missing key "target"'),
    ("countdown", ['{"nums": [1, "2"], "target": 3}'], 'line 1: "nums" must be'),
    ("countdown", ['{"nums": [1, 2], "target": 3.5}'], 'line 1: "target" must be'),
    ("countdown", ["[1, 2, 3]"], "line 1: expected a JSON object"),
    ("math", ['{"question": "q", "answer": "x^"}'], 'line 1: "answer" must be'),  # "many" is LaTeX now (m a n y)
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
    import datasets  # noqa: F401  (a cold import is not what is timed)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"could not load .* from the hub \(no network\?\): .*; use --data gen"):
        load_rows(task, "hf", 10, 0)
    assert time.perf_counter() - t < 20  # offline fails at once: no network retries


def test_held_out_rows_and_lazy_draws(tmp_path, monkeypatch):
    """The first eval_size rows are held out whatever --steps is; training rows are drawn lazily per (seed, step,
    resample) and never repeat a held-out prompt; nothing is built up front, even for --steps 10**20."""
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
    data = gmts.read_data(gmts.Config(data=str(path), eval_size=2))
    draw, held = data.draw, data.held
    assert held == rows[:2] and {r["nums"][0] for r in draw(300, 1, 0)} == {2, 4, 5}
    assert all(sorted(r["nums"][0] for r in draw(3, step, 0)) == [2, 4, 5] for step in range(20))  # no repeats


# ---- model and tokenizer ---------------------------------------------------------------------------------------------


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


# ---- evaluation ------------------------------------------------------------------------------------------------------


def test_evaluate_greedy_accuracy_length_and_sample(tiny, monkeypatch):
    """evaluate = greedy rollouts in batches: the share of rows whose answer scores exactly 1.0, the mean number of
    valid response tokens, the first answer (at most 200 characters); nothing else (well-formedness: gmts_lab)."""
    model, tok = tiny
    task = dict(get_task("countdown"), reward=lambda text, row: 1.0 if row["target"] == 16 else 0.1)
    rows = [{"nums": [3, 5, 2], "target": 16}, {"nums": [1, 2], "target": 3}, {"nums": [4, 4], "target": 16}]
    want = gmts.rollout(model, tok, gmts.build_prompts(tok, task, rows, True, True), 1, 9, greedy=True)
    for bs in (64, 2, 1):
        got = gmts.evaluate(model, tok, task, rows, True, True, 9, batch_size=bs)
        assert set(got) == {"eval_acc", "eval_len", "eval_sample"}
        assert got["eval_acc"] == pytest.approx(2 / 3) and got["eval_sample"] == want["texts"][0][:200]
        assert got["eval_len"] == pytest.approx(float(want["resp_mask"].sum()) / 3)


# ---- the run folder: kill, resume, damaged checkpoints, a finished run kept ------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (parity reward, so it trains) with its checkpoints ckpt-000001 and ckpt-000002. Tests
    work on copies (run_copy)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(gmts.TASKS["countdown"], "reward", parity_reward)
        gmts.main([*SMALL, "--steps", "2", "--save-every", "1", "--lr", "1e-2", "--warmup-steps", "0", "--out",
                   str(out)])
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000001", "ckpt-000002"]
    return out


def run_copy(finished, tmp_path, name="run"):
    return shutil.copytree(finished, tmp_path / name)


def snapshot(folder):
    """Every file's bytes under folder, by relative path."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(folder) for f in fs}


def fails(capsys, argv, code):
    """gmts.main(argv) in this process must stop with `code` and exactly one stderr line, no traceback."""
    with pytest.raises(SystemExit) as e:
        gmts.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == code and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmts: error: "), err
    return lines[0]


KILL_DRIVER = """
import os, signal, sys
sys.path.insert(0, {here!r})
import torch
import gmts

gmts.TASKS["countdown"]["reward"] = lambda text, row: float(sum(map(ord, text)) % 2)  # test_gmts.parity_reward
where, argv = sys.argv[1], sys.argv[2:]
if where == "checkpoint":  # SIGKILL right after ckpt-000004.tmp is complete, before its rename
    save = torch.save
    def save_then_die(obj, path, *a, **k):
        save(obj, path, *a, **k)
        if os.path.basename(os.path.dirname(str(path))) == "ckpt-000004.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save_then_die
else:  # SIGKILL right after step 3's metrics line, before its checkpoint
    log = gmts.log_metrics
    def log_then_die(path, rec):
        log(path, rec)
        if rec["step"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    gmts.log_metrics = log_then_die
gmts.main(argv)
"""


def test_sigkill_mid_training_and_mid_checkpoint_then_resume(tmp_path, one_thread, parity):
    """A child killed (SIGKILL: no handler, no cleanup) after a metrics line, or inside a checkpoint write, then
    --resume: the same metrics, line for line, and a bit-identical final model as the uninterrupted run."""
    run = [*SMALL, "--steps", "6", "--save-every", "1", "--lr", "1e-2", "--warmup-steps", "0"]
    want = train_main(*run, "--out", tmp_path / "ref")
    assert any(r.get("grad_norm", 0) > 0 for r in want)  # it trains: the comparison means something
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(here=HERE))
    a, b = tmp_path / "a", tmp_path / "b"
    for where, out in (("metrics", a), ("checkpoint", b)):
        r = subprocess.run([sys.executable, str(driver), where, *run, "--out", str(out)], capture_output=True,
                           text=True, timeout=300, cwd=HERE, env=ENV1)
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert [x["step"] for x in _metrics(a / "metrics.jsonl")] == [0, 1, 2, 3]
    assert gmts.checkpoints(str(a))[-1].endswith("ckpt-000002")  # step 3's checkpoint was never written
    assert os.path.exists(os.path.join(gmts.checkpoints(str(a))[-1], "state.pt"))
    assert (b / "ckpt-000004.tmp" / "state.pt").exists()  # the temporary checkpoint is complete ...
    assert gmts.checkpoints(str(b))[-1].endswith("ckpt-000003")  # ... but only a renamed one counts
    for out in (a, b):
        assert train_main("--resume", out) == want  # no duplicated, missing or torn lines; the same numbers
        assert _same_weights(out, tmp_path / "ref")
        assert not list(out.glob("*.tmp")) and not list(out.glob("ckpt-*.old"))


def test_resume_ignores_partial_checkpoint_and_torn_line(tmp_path, finished, parity):
    out = run_copy(finished, tmp_path)
    os.makedirs(out / "ckpt-000003.tmp")  # a write that died half way
    (out / "ckpt-000003.tmp" / "config.json").write_text("{")
    shutil.copytree(out / "ckpt-000001", out / "ckpt-000009.old")  # a deletion that died half way
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mea')  # a torn line
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000001", "ckpt-000002"]
    recs = train_main("--resume", out, "--steps", "3")
    assert [x["step"] for x in recs] == [0, 1, 2, 3]


def _damage(path, how):
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "random": os.urandom(len(data))}[how])


DAMAGES = {"truncated state.pt": ("state.pt", "truncated"), "0-byte state.pt": ("state.pt", "empty"),
           "random state.pt": ("state.pt", "random"), "truncated model.safetensors": ("model.safetensors", "truncated")}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, finished, parity, capsys, damage):
    """ckpt-000002 damaged: --resume says so in one line, falls back to ckpt-000001 and reruns step 2 exactly (the
    whole config comes from run_config.json: only --resume is given)."""
    out = run_copy(finished, tmp_path)
    name, how = DAMAGES[damage]
    _damage(out / "ckpt-000002" / name, how)
    want = _metrics(out / "metrics.jsonl")
    assert train_main("--resume", out) == want
    said = [ln for ln in capsys.readouterr().out.splitlines() if "ckpt-000002" in ln and "does not load" in ln]
    assert len(said) == 1, said
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000001", "ckpt-000002"]
    assert _same_weights(out, finished)


def test_old_checkpoints_are_renamed_before_they_are_deleted(tmp_path, monkeypatch):
    """save_checkpoint keeps the last 2: the new one is renamed into place first, then each old one is renamed to
    *.old and only then deleted, so a kill at any moment leaves no half-deleted folder that looks complete."""
    model, tok = gmts.build_tiny(hidden=16, layers=1)
    opt = torch.optim.AdamW(model.parameters())
    calls, replace, rmtree = [], os.replace, shutil.rmtree
    name = os.path.basename

    def spy_replace(a, b):
        if name(str(a)).startswith("ckpt-"):
            calls.append(("replace", name(str(a)), name(str(b))))
        return replace(a, b)

    def spy_rmtree(p, *a, **k):
        if name(str(p)).startswith("ckpt-"):
            calls.append(("rmtree", name(str(p))))
        return rmtree(p, *a, **k)
    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(shutil, "rmtree", spy_rmtree)
    for step in range(3):
        gmts.save_checkpoint(str(tmp_path), step, model, tok, opt, 0)
    new = calls.index(("replace", "ckpt-000002.tmp", "ckpt-000002"))
    old = calls.index(("replace", "ckpt-000000", "ckpt-000000.old"))
    assert new < old < calls.index(("rmtree", "ckpt-000000.old"))
    for k in range(3):  # a complete checkpoint is never deleted in place (only a leftover before its rename)
        done = calls.index(("replace", f"ckpt-{k:06d}.tmp", f"ckpt-{k:06d}"))
        assert ("rmtree", f"ckpt-{k:06d}") not in calls[done:]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002"]
    state = torch.load(tmp_path / "ckpt-000002" / "state.pt", weights_only=True)  # no pickle needed
    assert state["step"] == 2 and "opt" in state


def test_a_new_run_never_replaces_a_finished_one(tmp_path, finished, capsys, parity):
    """Without --overwrite a new run into a run's folder stops (exit 2) and leaves every byte; a deliberate
    --overwrite whose model cannot load (exit 1) leaves every byte too; a bad override with --resume is never
    saved; --overwrite with a loadable model replaces the run."""
    out = run_copy(finished, tmp_path)
    before = snapshot(out)
    assert "holds a run" in fails(capsys, [*SMALL, "--out", out], 2)
    assert snapshot(out) == before
    assert "cannot load model" in fails(capsys, [*SMALL, "--overwrite", "--model", tmp_path / "none", "--out", out], 1)
    assert snapshot(out) == before
    assert "--lr" in fails(capsys, ["--resume", out, "--lr", "-1"], 2)
    assert snapshot(out) == before and gmts.parse_args(["--resume", str(out)]).lr == 1e-2
    recs = train_main(*SMALL, "--steps", "1", "--overwrite", "--out", out)
    assert [x["step"] for x in recs] == [0, 1]
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000000", "ckpt-000001"]


# ---- step lines, the progress bar and trackers -----------------------------------------------------------------------


def _wandb_history(folder):
    """The history records of the one offline wandb run under folder: its .wandb file is a LevelDB-style log (a
    7-byte file header, 32 KiB blocks, records with a 7-byte header: crc, length, type 1 full / 2 first / 3 middle
    / 4 last) of wandb's protobuf Records. -> [{key: value}]"""
    import glob
    import struct
    from wandb.proto import wandb_internal_pb2
    (path,) = glob.glob(os.path.join(str(folder), "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    pos, pending, history = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return history


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_report_to_sends_every_step_record(tmp_path, monkeypatch, tracker):
    """--report-to: every number of every metrics.jsonl record (step 0's evaluation included) reaches the tracker at
    its step: read back from tensorboard's event file, or from wandb's offline run file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    recs = train_main("--preset", "smoke", "--report-to", tracker, "--out", out)
    want = {}  # (key, step) -> value
    for r in gmts.read_metrics(str(out)):
        for k, v in r.items():
            if k != "step" and type(v) in (int, float):
                want[k, r["step"]] = v
    got = {}
    if tracker == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        for k in acc.Tags()["scalars"]:
            for e in acc.Scalars(k):
                got[k, e.step] = e.value
    else:
        for h in _wandb_history(out):
            for k, v in h.items():
                if not k.startswith("_"):
                    got[k, h["_step"]] = v
    assert got.keys() == want.keys() and ("eval_acc", 0) in got and len(recs) == 3
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-30), k  # tensorboard stores float32


def test_report_to_without_its_package_is_one_line(tmp_path, monkeypatch, capsys):
    """A tracker whose package is missing: one line, exit 2, before any work (nothing written to --out)."""
    real = importlib.import_module
    monkeypatch.setattr(gmts.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real(name))
    with pytest.raises(SystemExit) as e:
        gmts.main(["--preset", "smoke", "--report-to", "wandb", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "pip install wandb" in err
    assert not (tmp_path / "r").exists()


def test_progress_bar_on_a_terminal_plain_lines_elsewhere(tmp_path):
    """On a TTY stdout a tqdm bar counts the steps (its '2/2' and the step's numbers on one redrawn line), the
    evaluations stay above it as step lines; piped, the same run prints one plain line per step and no bar."""
    import pty
    args = [sys.executable, os.path.join(HERE, "gmts.py"), "--preset", "smoke", "--eval-every", "2"]
    import fcntl
    import struct
    import termios
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    p = subprocess.Popen(args + ["--out", str(tmp_path / "tty")], stdout=follower, stderr=subprocess.PIPE, cwd=HERE,
                         env=ENV1)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert p.wait(timeout=300) == 0
    os.close(leader)
    tty = b"".join(chunks).decode()
    assert "2/2" in tty and "\r" in tty and "reward_mean" in tty
    assert re.search(r"step 2 \|[^\n]*eval_acc", tty)  # the evaluation step stays as a line
    assert "step 1 |" not in tty  # a step without an evaluation lives only in the bar
    piped = run_cli("--preset", "smoke", "--out", str(tmp_path / "pipe"))
    assert piped.returncode == 0 and "2/2" not in piped.stdout and "\r" not in piped.stdout
    assert re.search(r"^step 1 \|", piped.stdout, re.M) and re.search(r"^step 2 \|", piped.stdout, re.M)


# ---- config checks: the bad-input table ------------------------------------------------------------------------------
# The bad-input table (issue 18): flags, data files, output folders, resume folders, model folders. Each case runs
# gmts.main in this process and must end with exactly one stderr line, no traceback, and its exit code: 2 for bad
# input, 1 for a model that cannot be loaded or no loadable checkpoint. A case that names an existing run ({run},
# {norc}, ...) must leave that folder byte for byte as it was. Placeholders are built by PLACES.
def _json_file(rows):
    return lambda tmp, run: _write(tmp / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return path


def _run_with(edit):
    """A copy of the finished run, then edit(copy)."""
    def build(tmp, run):
        out = shutil.copytree(run, tmp / "r")
        edit(out)
        return out
    return build


def _model_folder(keep, edit=None):
    def build(tmp, run):
        out = tmp / "m"
        os.makedirs(out)
        for n in keep:
            shutil.copy(run / "ckpt-000002" / n, out / n)
        if edit:
            edit(out)
        return out
    return build


def _read_only(tmp, run):
    os.makedirs(tmp / "ro")
    os.chmod(tmp / "ro", 0o555)
    return tmp / "ro"


CD = {"nums": [3, 5, 2], "target": 16}
PLACES = {
    "tmp": lambda tmp, run: tmp,
    "run": _run_with(lambda out: None),
    "file": lambda tmp, run: _write(tmp / "file", "x"),
    "ro": _read_only,
    "bad_json": lambda tmp, run: _write(tmp / "d.jsonl", json.dumps(CD) + '\n{"nums": [1, 2], "target": }\n'),
    "no_target": _json_file([CD, {"nums": [1, 2, 3]}]),
    "str_nums": _json_file([{"nums": [1, "2"], "target": 3}]),
    "list_row": lambda tmp, run: _write(tmp / "d.jsonl", "[1, 2, 3]\n"),
    "blank": lambda tmp, run: _write(tmp / "d.jsonl", "\n\n"),
    "latin1": lambda tmp, run: _write(tmp / "d.jsonl", b'{"nums": [1], "target": 1} \xff\n', "wb"),
    "three_rows": _json_file([CD, {"nums": [1, 2], "target": 3}, {"nums": [4, 4], "target": 8}]),
    "dup_rows": _json_file([CD, {"nums": [1, 2], "target": 3}, CD, {"nums": [1, 2], "target": 3}]),
    "norc": _run_with(lambda out: os.remove(out / "run_config.json")),
    "garbage": _run_with(lambda out: _write(out / "run_config.json", '{"lr": 1e-3, "steps"')),
    "json_list": _run_with(lambda out: _write(out / "run_config.json", "[1, 2]")),
    "null_lr": _run_with(lambda out: _write(out / "run_config.json", '{"lr": null}')),
    "all_damaged": _run_with(lambda out: [_damage(out / os.path.basename(c) / "state.pt", "random")
                                          for c in gmts.checkpoints(str(out))]),
    "config_only": _model_folder(["config.json"]),
    "no_weights": _model_folder(["config.json", "tokenizer.json", "tokenizer_config.json"]),
    "trunc_weights": _model_folder(["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"],
                                   lambda out: _damage(out / "model.safetensors", "truncated")),
    "bad_config": _model_folder(["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"],
                                lambda out: _write(out / "config.json", '{"model_type": "qwen2", "hidden_size": -3}')),
}
BAD_INPUT = [  # (id, argv, exit code, a piece of the message or a tuple of pieces[, a skip mark])
    ("lr inf", ["--lr", "inf"], 2, "--lr"),
    ("lr -1", ["--lr", "-1"], 2, "--lr"),
    ("lr nan", ["--lr", "nan"], 2, "--lr"),
    ("top-p 0", ["--top-p", "0"], 2, "--top-p"),
    ("top-p 1.5", ["--top-p", "1.5"], 2, "--top-p"),
    ("temperature inf", ["--temperature", "inf"], 2, "--temperature"),
    ("temperature 0", ["--temperature", "0"], 2, "--temperature"),
    ("clip-low -0.5", ["--clip-low", "-0.5"], 2, "--clip-low"),
    ("clip-low 1.5", ["--clip-low", "1.5"], 2, "--clip-low"),
    ("clip-high nan", ["--clip-high", "nan"], 2, "--clip-high"),
    ("kl-beta -1", ["--kl-beta", "-1"], 2, "--kl-beta"),
    ("kl-beta nan", ["--kl-beta", "nan"], 2, "--kl-beta"),
    ("max-grad-norm -1", ["--max-grad-norm", "-1"], 2, "--max-grad-norm"),
    ("save-every -1", ["--save-every", "-1"], 2, "--save-every"),
    ("warmup-steps -5", ["--warmup-steps", "-5"], 2, "--warmup-steps"),
    ("weight-decay -1", ["--weight-decay", "-1"], 2, "--weight-decay"),
    ("tiny-hidden 0", ["--tiny-hidden", "0"], 2, "--tiny-hidden"),
    ("tiny-hidden 12", ["--tiny-hidden", "12"], 2, "--tiny-hidden"),
    ("tiny-layers -1", ["--tiny-layers", "-1"], 2, "--tiny-layers"),
    ("rho 0", ["--rho", "0"], 2, "--rho"),
    ("rho 1.5", ["--rho", "1.5"], 2, "--rho"),
    ("group-size 1", ["--group-size", "1"], 2, "--group-size"),
    ("steps 0", ["--steps", "0"], 2, "--steps"),
    ("steps two", ["--steps", "two"], 2, "invalid int"),
    ("inner-updates 0", ["--inner-updates", "0"], 2, "--inner-updates"),
    ("micro-batch 0", ["--micro-batch", "0"], 2, "--micro-batch"),
    ("max-resample 0", ["--max-resample", "0"], 2, "--max-resample"),
    ("eval-every -1", ["--eval-every", "-1"], 2, "--eval-every"),
    ("top-k -1", ["--top-k", "-1"], 2, "--top-k"),
    ("unknown select", ["--select", "best"], 2, "invalid choice"),
    ("rsi-low above rsi-high", ["--rsi-low", "3", "--rsi-high", "2"], 2, "no RSI is kept"),
    ("rsi-high inf", ["--rsi-high", "inf"], 2, "--rsi-high must be finite"),
    ("rsi-low negative", ["--rsi-low", "-1"], 2, "--rsi-low must be finite and >= 0"),
    ("rsi with a scope", ["--select", "rsi", "--scope", "group"], 2, "keeps an interval"),
    ("rsi with loss-norm selected", ["--select", "rsi", "--loss-norm", "selected"], 2, "keeps an interval"),
    ("unknown task", ["--task", "poetry"], 2, "unknown task"),
    ("unknown preset", ["--preset", "gpu9000"], 2, "invalid choice"),
    ("unknown device", ["--device", "tpu"], 2, "invalid choice"),
    ("unknown loss-norm", ["--loss-norm", "tokens"], 2, "invalid choice"),
    ("unknown chat-template", ["--chat-template", "maybe"], 2, "invalid choice"),
    ("a lab flag", ["--sft-steps", "3"], 2, "unrecognized arguments"),
    ("cuda without cuda", ["--device", "cuda"], 2, "no such device",
     pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    ("out empty", ["--out", ""], 2, "--out"),
    ("out is a file", ["--out", "{file}"], 2, "--out"),
    ("out under a file", ["--out", "{file}/sub"], 2, "--out"),
    ("out read-only", ["--out", "{ro}/run"], 2, "--out",
     pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")),
    ("out holds a run", ["--out", "{run}"], 2, "holds a run"),
    ("data missing", ["--data", "{tmp}/nope.jsonl"], 2, "cannot read"),
    ("data is a folder", ["--data", "{tmp}"], 2, "cannot read"),
    ("data bad json", ["--data", "{bad_json}"], 2, "line 2: invalid JSON"),
    ("data missing key", ["--data", "{no_target}"], 2, 'line 2: missing key "target"'),
    ("data wrong type", ["--data", "{str_nums}"], 2, 'line 1: "nums" must be'),
    ("data not objects", ["--data", "{list_row}"], 2, "expected a JSON object"),
    ("data no rows", ["--data", "{blank}"], 2, "no rows"),
    ("data not utf-8", ["--data", "{latin1}"], 2, "cannot read"),
    ("data rows of another task", ["--task", "math", "--data", "{three_rows}"], 2, 'missing key "question"'),
    ("data all held out", ["--data", "{three_rows}", "--eval-size", "3"], 2, "no training rows"),
    ("data duplicates of held out", ["--data", "{dup_rows}", "--eval-size", "2"], 2, "no training rows"),
    ("data hf split", ["--data", "hf:dev"], 2, "hf:train or hf:test"),
    ("data hf logic", ["--task", "logic", "--data", "hf"], 2, "logic has no hub data set"),
    ("max-new-tokens past positions", ["--max-new-tokens", "5000"], 2, "positions"),
    ("eval-size 10**12", ["--eval-size", str(10 ** 12)], 2, "--eval-size"),
    ("steps 10**20 on a used-up file", ["--steps", str(10 ** 20), "--data", "{three_rows}", "--eval-size", "3"], 2,
     "no training rows"),
    ("steps 10**20 eval-size 10**12", ["--steps", str(10 ** 20), "--eval-size", str(10 ** 12)], 2, "--eval-size"),
    ("resume missing folder", ["--resume", "{tmp}/missing"], 2, "no run_config.json"),
    ("resume without run_config", ["--resume", "{norc}"], 2, "no run_config.json"),
    ("resume garbage run_config", ["--resume", "{garbage}"], 2, "unreadable"),
    ("resume run_config a list", ["--resume", "{json_list}"], 2, "not a JSON object"),
    ("resume run_config lr null", ["--resume", "{null_lr}"], 2, "lr"),
    ("resume steps below the last", ["--resume", "{run}", "--steps", "1"], 2, "below"),
    ("resume task changed", ["--resume", "{run}", "--task", "math"], 2, "--allow-change"),
    ("resume data changed", ["--resume", "{run}", "--data", "gen"], 2, "--allow-change"),
    ("resume bad override", ["--resume", "{run}", "--lr", "-1"], 2, "--lr"),
    ("resume into another --out", ["--resume", "{run}", "--steps", "3", "--out", "{tmp}/elsewhere"], 2, "another"),
    ("resume max-new-tokens past positions", ["--resume", "{run}", "--steps", "3", "--max-new-tokens", "5000",
                                              "--allow-change"], 2, "positions"),
    ("resume every checkpoint damaged", ["--resume", "{all_damaged}"], 1, "no loadable checkpoint"),
    ("model misspelled", ["--model", "Qwen2.5-0.5B-Instrukt"], 1, ("Qwen/Qwen2.5-0.5B-Instrukt", "--model tiny")),
    ("model folder missing", ["--model", "{tmp}/no-model"], 1, "cannot load model"),
    ("model folder config only", ["--model", "{config_only}"], 1, "cannot load model"),
    ("model folder no weights", ["--model", "{no_weights}"], 1, "cannot load model"),
    ("model folder truncated weights", ["--model", "{trunc_weights}"], 1, "cannot load model"),
    ("model folder bad config", ["--model", "{bad_config}"], 1, "cannot load model"),
]


@pytest.mark.parametrize("argv, code, needle", [pytest.param(*c[1:4], id=c[0], marks=c[4:]) for c in BAD_INPUT])
def test_bad_input_is_one_line_and_its_exit_code(tmp_path, finished, capsys, argv, code, needle):
    built = {}

    def place(m):
        if m[1] not in built:
            built[m[1]] = PLACES[m[1]](tmp_path, finished)
        return str(built[m[1]])
    argv = [re.sub(r"\{(\w+)\}", place, a) for a in argv]
    if "--resume" not in argv:
        argv = [*SMALL, "--out", str(tmp_path / "o"), *argv]  # the case's own --out comes last and wins
    runs = {p: snapshot(p) for p in map(str, built.values()) if os.path.isdir(p) and p != str(tmp_path)}
    try:
        err = fails(capsys, argv, code)
    finally:
        if os.path.isdir(tmp_path / "ro"):
            os.chmod(tmp_path / "ro", 0o755)
    assert all(n in err for n in ([needle] if isinstance(needle, str) else needle)), err
    for p, before in runs.items():
        assert snapshot(p) == before, f"{p} changed"


# ---- CLI and signals: memory and interrupts are one line -------------------------------------------------------------


def test_out_of_memory_is_one_line_with_the_flags_to_lower(tmp_path, monkeypatch, capsys):
    real = gmts.rollout

    def oom_in_training(model, tok, prompts, group_size, *a, **k):  # the greedy step-0 eval (G = 1) still runs
        if group_size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, tok, prompts, group_size, *a, **k)
    monkeypatch.setattr(gmts, "rollout", oom_in_training)
    err = fails(capsys, [*SMALL, "--out", tmp_path / "o"], 1)
    assert "--micro-batch" in err and "--group-size" in err and "--max-new-tokens" in err
    assert gmts.checkpoints(str(tmp_path / "o"))  # the last checkpoint is kept


def test_out_of_memory_in_evaluation_and_interrupt_are_one_line(tmp_path, monkeypatch, capsys):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(gmts, "evaluate", oom)
    assert "--micro-batch" in fails(capsys, [*SMALL, "--out", tmp_path / "o"], 1)

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gmts, "evaluate", interrupt)
    assert "no checkpoint yet" in fails(capsys, [*SMALL, "--out", tmp_path / "i"], 130)  # the step-0 eval: true


def test_a_run_from_before_issue_42_resumes_with_its_own_values(tmp_path):
    """A run_config.json written before --data-order, --skip-bad-rows, --max-prompt-tokens,
    --rollout-rows and --adam-eps existed resumes with the values that run had (gmts.ADDED);
    without ADDED the resume was refused ("lacks ...")."""
    out = tmp_path / "old"
    train_main(*SMALL, "--steps", "1", "--out", out)
    path = out / "run_config.json"
    saved = json.loads(path.read_text())
    for key in ("data_order", "skip_bad_rows", "max_prompt_tokens", "rollout_rows", "adam_eps"):
        assert saved.pop(key) == gmts.ADDED[key]  # the value a run of then had
    path.write_text(json.dumps(saved))
    recs = train_main("--resume", out, "--steps", "2")
    assert [r["step"] for r in recs] == [0, 1, 2]


# ---- RSI-S: the interval rule (--select rsi) --------------------------------------------------------------------------

def test_relative_surprisal_by_hand():
    """p = (1/2, 1/4, 1/4): H = 1.5 ln 2, so RSI = ln 2 / H = 2/3 for the likeliest token and 2 ln 2 / H = 4/3 for
    the others; a one-hot p (H = 0) has RSI inf; over y ~ p the mean RSI is 1 (E[-log p_y] = H), for any p."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]] * 3 + [[1.0, 1.0, 1.0]]))
    logits[3] = torch.tensor([0.0, -200.0, -200.0])  # e^-200 is 0 in float32: p is one-hot
    logp, H, _ = token_stats(logits, torch.tensor([0, 1, 2, 0]))
    rsi = gmts.relative_surprisal(logp, H)
    assert H[3] == 0 and rsi[3] == math.inf
    assert torch.allclose(rsi[:3], torch.tensor([2 / 3, 4 / 3, 4 / 3]), rtol=1e-6)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 50, generator=g) * 3  # five random distributions over 50 tokens
    p = torch.softmax(z, -1)
    every_y = torch.arange(50).expand(5, 50)  # (5, 50): each token of each distribution
    lp, ent, _ = token_stats(z[:, None, :].expand(5, 50, 50), every_y)
    mean = (p * gmts.relative_surprisal(lp, ent)).sum(-1)  # sum_y p_y RSI(y)
    assert torch.allclose(mean, torch.ones(5), atol=1e-5), mean


@pytest.mark.parametrize("low, high", [(0.5, 2.0), (0.0, 1.0), (1.0, 1.0), (0.9, 50.0)])
def test_rsi_keeps_its_interval_against_a_slow_loop(low, high):
    """step_selection with --select rsi equals a Python loop over the tokens that computes p, H and -log p_y in
    float64 from the logits and keeps a valid token iff low <= RSI <= high (a closed interval, so no ties: a token on
    a bound is kept); omega does not enter; the kept share is what selected_frac logs."""
    g = torch.Generator().manual_seed(3)
    N, T, V = 6, 9, 11
    logits = torch.randn(N, T, V, generator=g) * 2.5
    logits[0, 0] = torch.tensor([30.0] + [0.0] * (V - 1))  # near one-hot: RSI far below 1
    logits[1, 1] = torch.tensor([0.0, 0.0] + [-200.0] * (V - 2))  # a fair coin (e^-200 is 0 in float32)
    tokens = torch.randint(0, V, (N, T), generator=g)
    tokens[1, 1] = 0
    mask = torch.rand(N, T, generator=g) > 0.2
    mask[1, 1] = True
    logp, H, dz = token_stats(logits, tokens)
    assert gmts.relative_surprisal(logp, H)[1, 1] == 1.0  # -log p_y = H = ln 2 in float32: on a bound below
    cfg = gmts.Config(select="rsi", rsi_low=low, rsi_high=high)
    for om in (torch.randn(N, T, generator=g), torch.zeros(N, T)):  # omega does not matter
        sel = gmts.step_selection(cfg, logp, H, dz, om, mask)
        want = torch.zeros(N, T, dtype=torch.bool)
        for i in range(N):
            for t in range(T):
                p = [math.exp(v) for v in logits[i, t].double().tolist()]
                p = [v / sum(p) for v in p]
                ent = -sum(v * math.log(v) for v in p if v > 0)
                rsi = -math.log(p[tokens[i, t]]) / ent if ent > 0 else math.inf
                # a float32 RSI within 1e-5 of a bound may land on either side of it: skip those
                if min(abs(rsi - low), abs(rsi - high)) < 1e-5 and not (i, t) == (1, 1):
                    want[i, t] = sel[i, t]
                    continue
                want[i, t] = bool(mask[i, t]) and low <= rsi <= high
        assert torch.equal(sel, want), (low, high)
    assert sel[1, 1] == (low <= 1.0 <= high)  # (1.0, 1.0): kept, as the interval is closed


def test_rsi_trains_and_logs_its_kept_share(tmp_path, capsys):
    """A short real run with --select rsi from the cpu preset's warm start (the tiny random model's near-uniform p
    puts every RSI near 1): every step logs selected_frac, the share inside the interval, here neither 0 nor 1
    (test_gmts_trl: the TRL wrapper refuses rsi, its selection being a top rho)."""
    out = tmp_path / "rsi"
    gmts.main(["--preset", "smoke", "--select", "rsi", "--out", str(out)])
    recs = gmts.read_metrics(str(out))
    shares = [r["selected_frac"] for r in recs if "selected_frac" in r]
    assert shares and all(0.0 < f < 1.0 for f in shares), shares
