"""
gmts.py: GRPO with Gradient Magnitude-based Token Selection (GMTS), in one file.

Read it beside the papers:
  GMTS   Lv et al. 2026, "Gradient Magnitude-based Token Selection Improves RLVR Training for LLM Reasoning",
         arXiv 2608.30632 (OpenReview JGvOicAo3g). Score a response token by |H_t * omega_t| and train on the top 20%.
  80/20  Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
         Reasoning", arXiv 2506.01939. Score a response token by its entropy H_t and train on the top 20%.

The algorithm, one training step (train() below follows these numbers):
  1. sample B prompts from the task                                       [plumbing]
  2. sample G answers per prompt with HF generate (N = B*G answers)       [paper: rollout]
  3. score every answer with a rule-based verifier -> reward r_i          [paper: reward]
  4. group advantages A_i = (r_i - mean_group) / (std_group + eps)       [paper: GRPO advantage]
  5. per response token: log pi(y_t), entropy H_t, logit-gradient norm    [paper: token statistics]
  6. score tokens (entropy: H_t; gmts: |H_t * omega_t|) and keep the top rho of the WHOLE batch
  7. PPO-clip update on the kept tokens only, in micro-batches          [paper: objective]
  8. log, evaluate, checkpoint                                            [plumbing]

Axis legend: B prompts per step, G answers per prompt, N = B*G answers, P prompt length (left padded),
T response length, V vocabulary, d hidden size. Every (N, T) tensor is aligned to RESPONSE positions:
column t holds the statistics of the t-th generated token, predicted from the hidden state one position earlier.

Deviations from the papers and choices they leave open (README "Deviations" repeats this list):
  1. Selection is over the whole rollout batch (N*T tokens), not per micro-batch or per GPU as in the 80/20 code.
  2. omega = ratio * A, zeroed where the clip is active (the GMTS score as the whileai replication reads eq. 4);
     on the first inner update ratio == 1, so omega == A. Scores are recomputed before every inner update.
  3. Loss normaliser (--loss-norm): 'all' (default) divides by all valid response tokens of the batch, as in the
     80/20 paper's equation and TRL; 'selected' divides by the kept tokens, as in the official 80/20 code (5x the
     step at rho = 0.2). 'all' makes selection a pure masking of the same sum, so methods compare at one lr.
  4. Std of the group advantage: population std (divide by G), see group_advantages.
  5. KL (beta > 0, k3 estimator) is applied to all valid tokens, not only the selected ones; beta = 0 by default
     and then no reference model is loaded.
  6. fp32 master weights with bf16 autocast on CUDA (pure-bf16 AdamW would drop updates of size lr = 1e-6 that are
     far below bf16's resolution of a weight); log-softmax, entropy and the loss always in fp32.
  7. gmts/gradnorm never keep a token whose score is 0 (its gradient is exactly 0), so they may keep < rho.
  8. Token statistics come from one no-grad forward pass before the update (bench_gmts.py measures its cost).
  9. Rewards: countdown's 0.1 format reward follows TinyZero, math is binary (80/20 paper), logic mirrors countdown.

Run:  python gmts.py --preset cpu                                  (offline, CPU, a tiny model that learns)
      python gmts.py --model Qwen2.5-0.5B-Instruct --task countdown  (one GPU)
"""
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import ast
import dataclasses
import functools
import glob
import itertools
import json
import math
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Config [plumbing]: every field is a --flag (underscores become dashes); PRESETS are applied before explicit flags.
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Config:
    # run
    out: str = "out"  # output folder: metrics.jsonl, checkpoints, the final model
    seed: int = 0  # seeds python, torch and the per-step samplers
    device: str = "auto"  # auto picks cuda > mps > cpu
    steps: int = 200  # GRPO steps (one rollout batch each)
    save_every: int = 50  # checkpoint every this many steps (0: only at the end)
    resume: str = ""  # an earlier --out folder: continue from its last complete checkpoint
    report_to: str = "none"  # also log to wandb or tensorboard
    preset: str = ""  # named group of defaults, see PRESETS
    analyze: bool = False  # run the gradient-magnitude ranking study instead of training
    batches: int = 2  # --analyze: rollout batches to study
    compare: str = ""  # comma list of --select methods to run side by side, e.g. all,entropy,gmts
    seeds: int = 1  # --compare: seeds per method
    workers: int = 0  # --compare: runs in parallel processes (0: one per CPU core on a CPU, 1 on a GPU)
    # model
    model: str = "tiny"  # 'tiny' (built offline), a short Qwen name (Qwen2.5-0.5B), a hub id or a local folder
    chat: str = "auto"  # use the chat template: auto (by the tokenizer, see render_prompt), yes, no
    tiny_hidden: int = 64  # --model tiny: hidden size
    tiny_layers: int = 2  # --model tiny: transformer layers
    grad_ckpt: bool = False  # gradient checkpointing in the update forward
    # task
    task: str = "countdown"  # countdown, math or logic
    data: str = "gen"  # gen (offline generator), easy, hf (the hub set), or a .jsonl path
    short_prompt: bool = False  # terse prompts (for the byte-level tiny model)
    eval_every: int = 20  # greedy held-out accuracy every this many steps (0: only at the end)
    eval_size: int = 64  # held-out problems
    # rollout
    prompts_per_step: int = 8  # B, prompts sampled per step
    group_size: int = 8  # G, answers sampled per prompt
    max_new_tokens: int = 256  # response length limit; longer answers are cut and flagged
    temperature: float = 1.0  # sampling temperature; the same T is used for log-probs and entropy
    top_p: float = 1.0  # 1.0 samples from the full distribution (on-policy)
    top_k: int = 0  # 0 disables top-k
    # GRPO
    clip_low: float = 0.2  # PPO clip eps below 1
    clip_high: float = 0.28  # PPO clip eps above 1 (DAPO clip-higher)
    kl_beta: float = 0.0  # k3 KL to a frozen reference model (0: no reference model is loaded)
    std_normalize: bool = True  # divide advantages by the group std (off: Dr. GRPO)
    inner_updates: int = 1  # optimiser steps per rollout batch (mu)
    loss_norm: str = "all"  # all: divide by all valid response tokens; selected: by the kept tokens
    # token selection
    select: str = "gmts"  # all, random, entropy, gmts, gradnorm
    rho: float = 0.2  # share of the batch's response tokens kept
    # optimisation
    lr: float = 1e-6  # AdamW learning rate of the GRPO updates
    warmup_steps: int = 10  # linear lr warm-up, in optimiser steps
    lr_decay: bool = True  # after the warm-up, decay the lr linearly to ~0 at the last step (off: constant)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the global gradient norm to this
    micro_batch: int = 8  # answers per forward/backward (gradient accumulation over the batch)
    stats_chunk: int = 1024  # rows of the (tokens x V) logits held at once in the head
    # supervised warm-up on reference solutions (the CPU preset uses it so that a tiny model earns reward)
    sft_steps: int = 0  # supervised warm-up steps before RL (0: none)
    sft_lr: float = 3e-3  # warm-up learning rate
    sft_batch: int = 32  # warm-up batch size
    sft_target: float = 0.0  # stop the warm-up once greedy accuracy (blind: well-formed share) on 64 train rows >= this
    sft_blind: bool = False  # the warm-up imitates random well-formed answers, not solutions: format only

CHOICES = {
    "select": ["all", "random", "entropy", "gmts", "gradnorm"],
    "device": ["auto", "cuda", "mps", "cpu"],
    "chat": ["auto", "yes", "no"],
    "loss_norm": ["all", "selected"],
    "report_to": ["none", "wandb", "tensorboard"],
}

PRESETS = {
    # Offline CPU demo: a 0.27M-parameter Qwen2 warmed up for 1000 steps on random well-formed answers to easy
    # countdown (it learns to copy the numbers but picks the signs at random; its accuracy is the first eval_acc),
    # then GRPO + GMTS learns from the reward which signs hit the target. README shows it.
    "cpu": dict(model="tiny", tiny_hidden=96, tiny_layers=3, task="countdown", data="easy", short_prompt=True,
                steps=80, prompts_per_step=32, group_size=8, max_new_tokens=64, lr=3e-4, warmup_steps=10,
                micro_batch=256, eval_every=10, eval_size=256, save_every=20, sft_steps=1000, sft_lr=1e-3,
                sft_blind=True, out="out/cpu"),
    # A seconds-long version of the same path, for tests.
    "smoke": dict(model="tiny", task="countdown", data="easy", short_prompt=True, steps=2, prompts_per_step=2,
                  group_size=4, max_new_tokens=16, eval_every=1, eval_size=4, sft_steps=2, lr=1e-4, out="out/smoke"),
}

def die(msg: str, code: int = 2):
    """Bad input: one line on stderr and a non-zero exit, never a traceback."""
    print(f"gmts: error: {msg}", file=sys.stderr)
    sys.exit(code)

def check_config(cfg: Config):
    """Raise ValueError (one line) for values no run can use."""
    for k, allowed in CHOICES.items():
        if getattr(cfg, k) not in allowed:
            raise ValueError(f"--{k.replace('_', '-')} {getattr(cfg, k)!r} is not one of: {', '.join(allowed)}")
    get_task(cfg.task)
    if not 0.0 < cfg.rho <= 1.0:
        raise ValueError(f"--rho must be in (0, 1], got {cfg.rho}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 (an advantage needs a group), got {cfg.group_size}")
    for k in ("prompts_per_step", "max_new_tokens", "micro_batch", "inner_updates", "stats_chunk", "eval_size"):
        if getattr(cfg, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(cfg, k)}")
    if cfg.sft_blind and "blind" not in get_task(cfg.task):
        raise ValueError(f"--sft-blind is defined for countdown only, not --task {cfg.task}")
    if cfg.temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {cfg.temperature}")
    if os.path.isfile(cfg.out):
        raise ValueError(f"--out {cfg.out} is an existing file, not a folder")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (use --device auto or cpu)")
    if cfg.device == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps but torch sees no MPS device (use --device auto or cpu)")


# ---------------------------------------------------------------------------------------------------------------
# Small helpers [plumbing]
# ---------------------------------------------------------------------------------------------------------------

def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")

def autocast(device: torch.device):
    """bf16 compute on CUDA (weights stay fp32, see deviation 6); a no-op elsewhere."""
    use = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)

def set_seed(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Tasks and verifiers [paper: reward]
# ---------------------------------------------------------------------------------------------------------------
# Each task = offline generator + prompt + verifier + reference completion + loader, collected in TASKS.
# Verifiers are pure, cap every length before parsing, use no eval/exec and never raise (a bug costs a reward).
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]

def _never_raise(fn=None, fallback=0.0):
    if fn is None:  # used as @_never_raise(fallback=...)
        return functools.partial(_never_raise, fallback=fallback)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # last-resort net only: expected failures are handled inside each verifier
            return fallback
    return wrapped

def _last_answer(text: str):
    """Content of the last complete <answer>...</answer> pair, or None. str.rfind: linear, no regex backtracking."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len("<answer>"):end]


# -- countdown (TinyZero): combine the given numbers with + - * / to hit the target --
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: a / b if b else None}  # None: division by zero
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}  # literals have precedence 3
_CD_CHARS = re.compile(r"[0-9+\-*/() \t\r\n]*")  # ASCII digits only: ast would also read "٣" as 3

def _combine(x: tuple, y: tuple, op: str):
    """(value, text, precedence) of `x op y`, parenthesised just enough that Python reads the text back the same."""
    v, p = _OPS[op](x[0], y[0]), _PREC[op]
    sx = f"({x[1]})" if x[2] < p else x[1]
    sy = f"({y[1]})" if y[2] < p or (y[2] == p and op in "-/") else y[1]  # a - (b + c), a / (b * c)
    return None if v is None else (v, f"{sx} {op} {sy}", p)

def _sign_chain(nums: list, signs) -> tuple:
    """(value, text) of nums[0] s1 nums[1] s2 ... with each s in '+-', read left to right: ([4, 3, 2], '+-') -> (5,
    '4 + 3 - 2'). The easy variant's solutions and the blind warm-up's random answers are such chains."""
    value = nums[0] + sum(x if s == "+" else -x for s, x in zip(signs, nums[1:]))
    return value, " ".join([str(nums[0])] + [f"{s} {x}" for s, x in zip(signs, nums[1:])])

def countdown_problem(rng: random.Random, n_nums=(3, 4), num_range=(1, 99), target_range=(1, 1000),
                      ops="+-*/") -> dict:
    """Random numbers and a random expression over them; its value is the target, so every problem is solvable."""
    for _ in range(100_000):
        nums = [rng.randint(*num_range) for _ in range(rng.randint(*n_nums))]
        items = [(Fraction(x), str(x), 3) for x in nums]
        while items and len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)  # random order of use
            z = _combine(items[i], items[j], rng.choice(ops))
            ok = z is not None and z[0].denominator == 1 and z[0] >= 0  # exact divisions, natural intermediates
            items = [it for k, it in enumerate(items) if k not in (i, j)] + [z] if ok else None
        if items and target_range[0] <= items[0][0] <= target_range[1]:
            return {"nums": nums, "target": int(items[0][0]), "expr": items[0][1]}
    raise ValueError(f"no countdown problem with numbers in {num_range} and a target in {target_range}")

def _cd_eval(node, lits: list, depth=0) -> Fraction:
    """Exact value of a whitelisted tree, collecting its int literals. Anything else raises ValueError: ** // %
    (they pass the character filter), unary + and - (the numbers are given positive, so -a would be a number not
    in the list; a - b is enough), names, calls, floats ("2.5" is not the numbers 2 and 5), bools, strings."""
    if depth > 60:
        raise ValueError("too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        lits.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        v = _OPS[_AST_OPS[type(node.op)]](_cd_eval(node.left, lits, depth + 1), _cd_eval(node.right, lits, depth + 1))
        if v is None:
            raise ZeroDivisionError
        return v
    raise ValueError(f"{type(node).__name__} not allowed")

@_never_raise(fallback=None)
def countdown_value(completion: str, nums: list):
    """Exact value of the last <answer> if it is an equation that uses each given number once, else None
    (no answer tag, '=' in it: not allowed, as in TinyZero; other characters, other numbers, bad syntax)."""
    ans = _last_answer(completion)
    if ans is None:
        return None
    ans = ans.strip()
    if not ans or len(ans) > 200 or not _CD_CHARS.fullmatch(ans):  # cap before ast.parse, which recurses on nesting
        return None
    lits = []
    try:  # newlines are plain whitespace here, not statement breaks
        value = _cd_eval(ast.parse(" ".join(ans.split()), mode="eval").body, lits)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    return value if sorted(lits) == sorted(nums) else None

@_never_raise
def countdown_reward(completion: str, nums: list, target: int) -> float:
    """1.0: the last <answer> is an equation that uses each given number once and equals the target; 0.1: an answer
    is there but wrong or invalid; 0.0: no answer tag."""
    if _last_answer(completion) is None:
        return 0.0
    return 1.0 if countdown_value(completion, nums) == target else 0.1


# -- math: GSM8K-style word problems, graded by the final number --
def _math_story(r: random.Random, who: str, steps: list) -> str:
    """One of five templates; every worked step 'a op b = c' is appended to `steps` (2 to 4 of them)."""
    def calc(a, op, b):
        c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        steps.append(f"{a} {op} {b} = {c}")
        return c
    kind, two = r.randrange(5), r.random() < 0.5
    if kind == 0:  # shopping and change: 2 or 4 steps
        n, p, m, q = r.randint(2, 9), r.randint(2, 15), r.randint(2, 6), r.randint(2, 9)
        total = calc(calc(n, "*", p), "+", calc(m, "*", q)) if two else calc(n, "*", p)
        bill = total // 10 * 10 + 10 * r.randint(1, 5)
        calc(bill, "-", total)
        pens = f" and {m} pens at ${q} each" if two else ""
        return f"{who} buys {n} notebooks at ${p} each{pens} and pays with ${bill}. How many dollars of change are due?"
    if kind == 1:  # sharing: 3 steps
        trays, per, friends = r.randint(3, 6), r.randint(6, 12), r.randint(2, 6)
        total = calc(trays, "*", per)
        eaten = total % friends + friends * r.randint(1, 2)  # leaves a multiple of `friends`
        calc(calc(total, "-", eaten), "/", friends)
        return (f"{who} bakes {trays} trays of {per} cookies, eats {eaten} of them and shares the rest equally "
                f"among {friends} friends. How many cookies does each friend get?")
    if kind == 2:  # rates: 2 or 3 steps
        rate, hours, days = r.randint(5, 40), r.randint(2, 10), r.randint(2, 7)
        made = calc(calc(rate, "*", hours), "*", days)
        bad = r.randint(1, made // 4)
        if two:
            calc(made, "-", bad)
        ask = f", and {bad} of the toys come out broken. How many good toys" if two else ". How many toys"
        return f"{who}'s machine makes {rate} toys per hour. It runs {hours} hours a day for {days} days{ask} are made?"
    if kind == 3:  # saving and spending: 2 or 3 steps
        weekly, weeks = r.randint(5, 30), r.randint(4, 12)
        saved = calc(weekly, "*", weeks)
        game, book = r.randint(1, saved // 3), r.randint(1, saved // 3)
        calc(saved, "-", calc(game, "+", book) if two else game)
        extra = f" and a book for ${book}" if two else ""
        return (f"{who} saves ${weekly} a week for {weeks} weeks, then buys a game for ${game}{extra}. How many "
                "dollars are left?")
    v1, h1, v2, h2 = r.randint(30, 90), r.randint(1, 5), r.randint(30, 90), r.randint(1, 5)  # distance: 3 steps
    calc(calc(v1, "*", h1), "+", calc(v2, "*", h2))
    return f"{who} drives {h1} hours at {v1} km/h, then {h2} hours at {v2} km/h. How many km is that in total?"

def math_problem(rng: random.Random, n_steps=(2, 4)) -> dict:
    for _ in range(10_000):
        steps = []
        question = _math_story(rng, rng.choice(NAMES), steps)
        if n_steps[0] <= len(steps) <= n_steps[1]:
            return {"question": question, "answer": steps[-1].split()[-1], "steps": steps}
    raise ValueError(f"no math template has {n_steps} steps")

_DEC = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+")  # [0-9], not \d (unicode)
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_NUM_TOKEN = re.compile(r"-?\$?[0-9][0-9,.]*")  # a single character class per run: nothing to backtrack into

def parse_number(s: str):
    """Exact value of an answer like '-$1,450', '72.00', '18.', '50%', '\\frac{1}{2}', '3/4'; None if not a number."""
    s = s.strip()
    if len(s) > 100:
        return None
    s = s.replace("{,}", ",").replace("\\,", ",")  # LaTeX thousands separators
    sign = -1 if s.startswith("-") else 1
    s = s[1:].strip() if sign < 0 else s
    s = s.removeprefix("\\$").removeprefix("$").removesuffix(".").removesuffix("\\%").removesuffix("%").strip()
    m = _FRAC.fullmatch(s)
    parts = [x.strip() for x in (m.groups() if m else s.split("/") if s.count("/") == 1 else [s])]
    if not all(len(x) <= 60 and _DEC.fullmatch(x) for x in parts):  # <= ~50 digits before Fraction sees them
        return None
    vals = [Fraction(x.replace(",", "")) for x in parts]
    return None if len(vals) == 2 and vals[1] == 0 else sign * (vals[0] / vals[1] if len(vals) == 2 else vals[0])

def _last_boxed(text: str, tries=5, cap=100):
    """Content of the last closed \\boxed{...}: a bounded forward brace scan from each of the last few openings."""
    end = len(text)
    for _ in range(tries):
        i = text.rfind("\\boxed{", 0, end)
        if i < 0:
            return None
        start, depth = i + len("\\boxed{"), 1
        for j in range(start, min(len(text), start + cap)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start:j]
        end = i
    return None

def math_final_answer(text: str):
    """The last \\boxed{}, else the number after the last ####, else the last number in the text (or None)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    k = text.rfind("####")
    if k >= 0:
        m = _NUM_TOKEN.search(text, k + 4, k + 104)
        return m.group().rstrip(",.") if m else None
    i = j = max(text.rfind(d) for d in "0123456789")  # ten C-speed scans instead of a regex over the whole text
    if j < 0:
        return None
    while i > 0 and j - i < 60 and text[i - 1] in "0123456789,.":  # walk back over at most 60 characters
        i -= 1
    last = ("-" if i > 0 and text[i - 1] == "-" else "") + text[i:j + 1].lstrip(",.")
    return last if parse_number(last) is not None else last.rsplit(",", 1)[-1]  # "3,4,5" is a list: take 5

@_never_raise
def math_reward(completion: str, answer: str) -> float:
    """Binary: 1.0 iff the final answer equals the reference exactly (as fractions); no format bonus."""
    gold, got = parse_number(str(answer)), math_final_answer(completion)
    return 1.0 if gold is not None and got is not None and parse_number(got) == gold else 0.0


# -- logic: knights (always truthful) and knaves (always lying) --
# A claim is ("is", person, is_knight) | ("not", atom) | ("and" | "or" | "if", atom, atom).
def _holds(c: tuple, world: tuple) -> bool:
    if c[0] in ("is", "not"):
        return (world[c[1]] == c[2]) if c[0] == "is" else not _holds(c[1], world)
    a, b = _holds(c[1], world), _holds(c[2], world)
    return {"and": a and b, "or": a or b, "if": (not a) or b}[c[0]]

def _say(c: tuple, names: list, me: int) -> str:
    if c[0] == "is":
        return f"{'I am' if c[1] == me else names[c[1]] + ' is'} a {'knight' if c[2] else 'knave'}"
    if c[0] == "not":
        return "it is not the case that " + _say(c[1], names, me)
    a, b = _say(c[1], names, me), _say(c[2], names, me)
    return f"if {a} then {b}" if c[0] == "if" else f"{a} {c[0]} {b}"

def logic_problem(rng: random.Random, n_people=(2, 6)) -> dict:
    for _ in range(100_000):
        n = rng.randint(*n_people)
        names, claims = rng.sample(NAMES, n), []
        for me in range(n):
            p, q = rng.sample(range(n), 2)  # two different people, maybe the speaker
            form, a, b = rng.choice(["is", "not", "and", "or", "if"]), rng.random() < 0.5, rng.random() < 0.5
            if form in ("is", "not"):  # a plain claim is about someone else ("I am a knight" says nothing)
                atom = ("is", q if p == me else p, a)
                claims.append(atom if form == "is" else ("not", atom))
            else:
                claims.append((form, ("is", p, a), ("is", q, b)))
        worlds = [w for w in itertools.product([True, False], repeat=n)
                  if all(_holds(c, w) == w[i] for i, c in enumerate(claims))]
        if len(worlds) == 1:  # exactly one consistent assignment
            said = [_say(c, names, i) for i, c in enumerate(claims)]
            statements = [f'{name} says: "{t[0].upper() + t[1:]}."' for name, t in zip(names, said)]
            return {"names": names, "statements": statements, "solution": dict(zip(names, worlds[0]))}
    raise ValueError(f"no knights-and-knaves puzzle with a unique solution for {n_people} people")

@_never_raise
def logic_reward(completion: str, solution: dict) -> float:
    """1.0: the last <answer> names everyone exactly once as 'Name: knight|knave' with the right roles (any case;
    entries may be split by , ; or whitespace incl. newlines); 0.1: an answer that is wrong or malformed; 0.0: none."""
    ans = _last_answer(completion)
    if ans is None:
        return 0.0
    if len(ans) > 1000:
        return 0.1
    toks, got, i = re.findall(r"[a-z]+|\S", ans.lower()), {}, 0  # words and single symbols; whitespace only separates
    while i < len(toks):
        if toks[i] in (",", ";"):
            i += 1
            continue
        name, colon, role = (toks[i:i + 3] + ["", ""])[:3]
        if colon != ":" or role not in ("knight", "knave") or name in got:  # malformed, or someone named twice
            return 0.1
        got[name] = role == "knight"
        i += 4 if toks[i + 3:i + 4] == ["."] else 3
    return 1.0 if got == {k.lower(): v for k, v in solution.items()} else 0.1


# -- prompts and reference completions (the caller prefills "Let me solve this step by step.\n<think>") --
_FORMAT = "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags"

def countdown_prompt(row: dict, short=False) -> str:
    nums, t = row["nums"], row["target"]
    return f"Make {t} from {' '.join(map(str, nums))}." if short else (
        f"Using the numbers {list(nums)}, create an equation that equals {t}. You can use basic arithmetic operations "
        f"(+, -, *, /) and each number must be used exactly once. {_FORMAT}, "
        f"for example <answer> (1 + 2) / 3 </answer>.")

def math_prompt(row: dict, short=False) -> str:
    return row["question"] if short else (f"{row['question']}\n{_FORMAT}, with the final number inside \\boxed{{}}, "
                                          f"for example <answer> \\boxed{{42}} </answer>.")

def logic_prompt(row: dict, short=False) -> str:
    said = "\n".join(row["statements"])
    return said if short else (
        f"On an island every inhabitant is a knight, who always tells the truth, or a knave, who always lies. You meet "
        f"{len(row['names'])} inhabitants: {', '.join(row['names'])}.\n{said}\nWho is a knight and who is a knave? "
        f"{_FORMAT}, one entry per person, for example <answer> Alice: knight, Bob: knave </answer>.")

def countdown_reference(row: dict) -> str:
    if "expr" not in row:
        raise ValueError("a countdown reference needs a generated row (with its 'expr'): use --data gen or easy")
    return f"{row['expr']} = {row['target']}</think>\n<answer>{row['expr']}</answer>"

def countdown_blind(row: dict, rng: random.Random) -> dict:
    """--sft-blind: the row with a random well-formed answer in place of its solution: its numbers in their order
    joined by + or -, each sign pattern whose value is >= 0 equally likely; that value becomes the row's target, so
    the reference's `expr = value` line is true. Imitating these, the warm-up learns the format, to copy the numbers
    and to add them up, but it picks the signs at random: nothing links them to the target in the prompt."""
    nums = row["nums"]
    if not nums:
        return row
    for _ in range(100):  # uniform signs, redrawn until the value is >= 0: each such pattern equally likely
        value, expr = _sign_chain(nums, [rng.choice("+-") for _ in nums[1:]])
        if value >= 0:
            break
    return dict(row, expr=expr, target=value)

def math_reference(row: dict) -> str:
    return "\n".join(row.get("steps", [])) + f"</think>\n<answer>\\boxed{{{row['answer']}}}</answer>"

def logic_reference(row: dict) -> str:
    roles = ", ".join(f"{k}: {'knight' if v else 'knave'}" for k, v in row["solution"].items())
    return f"Only one assignment is consistent.</think>\n<answer>{roles}</answer>"


# -- loaders: data = "gen" | "easy" | "hf" | "hf:test" | path.jsonl --
def _gsm8k_row(question: str, solution) -> dict:
    """GSM8K answers are 'steps with <<calc>> notes ... #### 1,450': keep the clean steps and the bare number."""
    body, _, gold = str(solution).rpartition("####")
    steps = [re.sub(r"<<[^<>]*>>", "", ln).strip() for ln in body.splitlines() if ln.strip()]
    return {"question": question, "answer": gold.strip().replace(",", ""), "steps": steps}

def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)

_SCHEMA = {  # task -> key -> (what it must be, check)
    "countdown": {"nums": ("a list of integers", lambda v: isinstance(v, list) and all(type(x) is int for x in v)),
                  "target": ("an integer", lambda v: type(v) is int)},
    "math": {"question": ("a string", lambda v: isinstance(v, str)),
             "answer": ("a number or a GSM8K solution ending in '#### N'", lambda v: type(v) in (str, int, float)
                        and parse_number(_gsm8k_row("", v)["answer"]) is not None)},
    "logic": {"names": ("a list of strings", _strs), "statements": ("a list of strings", _strs),
              "solution": ("an object {name: true/false}",
                           lambda v: isinstance(v, dict) and all(type(x) is bool for x in v.values()))},
}

def _read_jsonl(path: str, task: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ValueError(f"{path}: cannot read ({reason}); --data takes gen, easy, hf or a .jsonl path") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {i}: expected a JSON object, got {type(row).__name__}")
        for key, (what, ok) in _SCHEMA[task].items():
            if key not in row:
                raise ValueError(f'{path} line {i}: missing key "{key}"')
            if not ok(row[key]):
                raise ValueError(f'{path} line {i}: "{key}" must be {what}')
        rows.append(_gsm8k_row(row["question"], row["answer"]) if task == "math" else row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows

def _load_hf(task: str, split: str) -> list:
    if task == "logic":
        raise ValueError("logic has no hub data set; use --data gen, easy or a .jsonl file")
    name = "Jiayi-Pan/Countdown-Tasks-3to4" if task == "countdown" else "openai/gsm8k"
    try:
        import datasets
        if task == "math":
            return [_gsm8k_row(r["question"], r["answer"]) for r in datasets.load_dataset(name, "main", split=split)]
        ds = datasets.load_dataset(name, split="train")  # one split; TinyZero: first 327,680 train, next 1,024 test
    except ImportError:
        raise ValueError("--data hf needs the `datasets` package; use --data gen") from None
    except OSError as e:  # ConnectionError (offline mode, no network) and missing files are OSErrors
        raise ValueError(f"could not load {name} from the hub (no network?): {str(e).splitlines()[0][:200]}; "
                         "use --data gen") from None
    rows = [{"nums": list(x), "target": int(t)} for x, t in zip(ds["nums"], ds["target"])]
    return rows[:327_680] if split == "train" else rows[327_680:328_704]

def load_rows(task: str, data="gen", n=1000, seed=0) -> list:
    """gen/easy: n fresh problems from random.Random(seed). hf: the hub set (hf:test: its test split) shuffled by
    seed. A .jsonl path: the file in order. For hf and files, n <= 0 or None means all rows."""
    get_task(task)
    if data in ("gen", "easy"):
        rng = random.Random(seed)
        return [_GEN[task](rng, data == "easy") for _ in range(n)]
    if data.split(":")[0] == "hf":
        split = data.partition(":")[2] or "train"
        if split not in ("train", "test"):
            raise ValueError(f"--data {data}: the split must be hf:train or hf:test")
        rows = _load_hf(task, split)
        random.Random(seed).shuffle(rows)
    else:
        rows = _read_jsonl(data, task)
    return rows[:n] if n and n > 0 else rows

def _easy_countdown(rng: random.Random) -> dict:
    """The CPU demo's variant: 3 numbers in 1..9 joined left to right by + or -, listed in that order, each of the
    four sign patterns equally likely (numbers redrawn until the target is >= 0). A model that copies the numbers
    only has to choose the two signs, and a fixed guess is right for about 1 problem in 4 (see the tests)."""
    signs = rng.choice(["++", "+-", "-+", "--"])
    while True:
        nums = [rng.randint(1, 9) for _ in range(3)]
        target, expr = _sign_chain(nums, signs)
        if target >= 0:
            return {"nums": nums, "target": target, "expr": expr}


_GEN = {  # "easy": the smallest variant (countdown: 3 numbers in 1..9, + and -; math: 2 steps; logic: 2 people)
    "countdown": lambda r, easy: _easy_countdown(r) if easy else countdown_problem(r),
    "math": lambda r, easy: math_problem(r, (2, 2) if easy else (2, 4)),
    "logic": lambda r, easy: logic_problem(r, (2, 2) if easy else (2, 6)),
}
TASKS = {
    "countdown": {"load": functools.partial(load_rows, "countdown"), "prompt": countdown_prompt,
                  "reward": lambda c, row: countdown_reward(c, row["nums"], row["target"]),
                  "reference": countdown_reference, "blind": countdown_blind,
                  "valid": lambda c, row: countdown_value(c, row["nums"]) is not None},
    "math": {"load": functools.partial(load_rows, "math"), "prompt": math_prompt,
             "reward": lambda c, row: math_reward(c, row["answer"]), "reference": math_reference},
    "logic": {"load": functools.partial(load_rows, "logic"), "prompt": logic_prompt,
              "reward": lambda c, row: logic_reward(c, row["solution"]), "reference": logic_reference},
}

def get_task(name: str) -> dict:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]

# ---------------------------------------------------------------------------------------------------------------
# Model and tokenizer [plumbing]: real Qwen checkpoints, or a tiny Qwen2 built offline with the same architecture.
# ---------------------------------------------------------------------------------------------------------------

TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def build_tiny(hidden: int = 64, layers: int = 2, seed: int = 0):
    """A random-init Qwen2ForCausalLM and a byte-level Qwen2Tokenizer (256 bytes + 3 specials, no merges).

    Built as the very class transformers reloads a qwen2 folder with (Qwen2Tokenizer), so token ids survive a
    save/load round trip; eos is <|im_end|> (an instruct-style tokenizer), pad is <|endoftext|>.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                         additional_special_tokens=["<|im_start|>"], chat_template=TINY_CHAT_TEMPLATE,
                         padding_side="left")
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, vocab_size=len(tok),
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg), tok

def resolve_model_name(name: str) -> str:
    """'Qwen2.5-0.5B' -> 'Qwen/Qwen2.5-0.5B'; hub ids and local folders pass through."""
    if os.path.isdir(name) or "/" in name or not name.lower().startswith("qwen"):
        return name
    return "Qwen/" + name

def load_model(name: str, device: torch.device, tiny_hidden: int = 64, tiny_layers: int = 2, seed: int = 0):
    """Return (model, tokenizer) on device in fp32, or raise OSError with a one-line reason."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        model, tok = build_tiny(tiny_hidden, tiny_layers, seed)
    else:
        path = resolve_model_name(name)
        try:
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            why = "no hub access (HF_HUB_OFFLINE=1)" if offline else "no hub access or a misspelled name"
            raise OSError(f"cannot load model '{path}': {why}: {str(e).splitlines()[0][:200]}; "
                          f"try --model tiny for an offline run") from None
    tok.padding_side = "left"  # generate() appends to the right end of every row
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok

def end_token_ids(tok) -> list:
    """The ids that end an answer: the tokenizer's eos plus Qwen's <|im_end|> and <|endoftext|> when present."""
    ids = {tok.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


# ---------------------------------------------------------------------------------------------------------------
# Rollouts [paper: sampling]: G answers per prompt from the full softmax at temperature T.
# ---------------------------------------------------------------------------------------------------------------

ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"  # TinyZero's prefill: the answer starts inside <think>
SYSTEM_PROMPT = "You are a helpful assistant. You first think about the reasoning process and then answer."

def use_chat(tok, chat: str = "auto") -> bool:
    """Chat template for instruct models, plain text for base models.

    Decided by the tokenizer: Qwen ships a chat template with base AND instruct models, but only instruct
    tokenizers end a turn with eos = <|im_end|> (base ones use <|endoftext|>). auto = has a template and eos is
    the template's turn end. --chat yes/no overrides.
    """
    if chat != "auto":
        return chat == "yes"
    return bool(getattr(tok, "chat_template", None)) and tok.eos_token == "<|im_end|>"

def render_prompt(tok, question: str, chat: bool, system: bool = True) -> str:
    """The text the model continues: the question in the chat template or a plain User/Assistant frame, ending
    inside the assistant's <think> (TinyZero's prefill). system=False drops the system line (terse CPU prompts)."""
    if chat:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
        msgs.append({"role": "user", "content": question})
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + ASSISTANT_PREFIX
    return (SYSTEM_PROMPT + "\n" if system else "") + f"User: {question}\nAssistant: {ASSISTANT_PREFIX}"

def build_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False) -> list:
    """Prompt strings for task rows; short=True: the task's terse question and no system line."""
    return [render_prompt(tok, task["prompt"](r, short=short), chat, system=not short) for r in rows]

def completion_mask(completion_ids: torch.Tensor, end_ids: list) -> tuple:
    """Valid response positions, by POSITION: up to and including the first end token, nothing after.

    Never by comparing with the pad id: Qwen's pad (<|endoftext|>) is also an end token, so a value test would
    drop the end token itself from the loss (the tiny-grpo bug). Returns (resp_mask (N, T) bool, truncated (N,)).
    """
    N, T = completion_ids.shape
    is_end = torch.isin(completion_ids, torch.tensor(end_ids, device=completion_ids.device))  # (N, T)
    has_end = is_end.any(dim=1)  # (N,)
    first_end = torch.where(has_end, is_end.int().argmax(dim=1), torch.full_like(has_end, T - 1, dtype=torch.long))
    resp_mask = torch.arange(T, device=completion_ids.device)[None, :] <= first_end[:, None]  # (N, T)
    return resp_mask, ~has_end

@torch.no_grad()
def rollout(model, tok, prompts: list, group_size: int, max_new_tokens: int, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, greedy: bool = False) -> dict:
    """Sample group_size answers for each prompt string. Returns a batch dict of tensors on the model's device.

    Every generation knob is passed explicitly: transformers fills unset ones from the checkpoint's
    generation_config (Qwen instruct: top_k 20, top_p 0.8, repetition_penalty 1.1), which would make the sampler
    differ from the policy whose log-probs we train on.
    """
    device = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    ids = enc["input_ids"].repeat_interleave(group_size, dim=0)  # (N, P)
    attn = enc["attention_mask"].repeat_interleave(group_size, dim=0)  # (N, P)
    end_ids = end_token_ids(tok)
    knobs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p,
                                                      top_k=top_k)
    was_training = model.training
    model.eval()
    with autocast(device):
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                             eos_token_id=end_ids, pad_token_id=tok.pad_token_id, repetition_penalty=1.0,
                             **knobs)  # (N, P + T)
    model.train(was_training)
    comp = out[:, ids.shape[1]:]  # (N, T)
    if comp.shape[1] == 0:  # every answer ended at once is impossible (>= 1 token); guard anyway
        comp = torch.full((ids.shape[0], 1), end_ids[0], device=device)
    resp_mask, truncated = completion_mask(comp, end_ids)
    texts = tok.batch_decode(comp.masked_fill(~resp_mask, tok.pad_token_id), skip_special_tokens=True)
    return dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=resp_mask,
                truncated=truncated, texts=texts)


# ---------------------------------------------------------------------------------------------------------------
# Group advantages [paper: GRPO, A_i = (r_i - mean) / (std + eps)]
# ---------------------------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of G consecutive answers; (N,) -> (N,).

    std is the POPULATION std (divide by G): the group is every answer we compare against, not a sample of a larger
    one, and it gives the clean binary-reward values A = +sqrt((G-k)/k), -sqrt(k/(G-k)) for k of G correct
    (TRL's unbiased std scales all of them by sqrt((G-1)/G)). A group whose rewards are all equal gets exactly 0:
    (r - mean) of equal floats can be 1e-17 rather than 0, so such groups are zeroed explicitly, never NaN.
    std_normalize=False gives r - mean (Dr. GRPO).
    """
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    same = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)  # (B, 1)
    return adv.masked_fill(same, 0.0).view(-1)  # (N,)


# ---------------------------------------------------------------------------------------------------------------
# Token statistics [paper: GMTS section 3; the derivation lives here]
#
# Token t of answer i: logits z (V,), temperature T, p = softmax(z / T), sampled token y, advantage A_i,
# ratio r = pi_theta(y) / pi_old(y). The GRPO/PPO-clip token loss (eps_l, eps_h the clip range) is
#     l = -min( r * A,  clip(r, 1 - eps_l, 1 + eps_h) * A )
# 1. The min picks the clipped branch, whose gradient is 0, exactly when (A > 0 and r > 1 + eps_h) or
#    (A < 0 and r < 1 - eps_l): "the clip is active". Otherwise dl/dtheta = -A * dr/dtheta = -A * r * dlogp_y/dtheta.
#    Write omega = r * A where the clip is inactive and omega = 0 where it is active: dl/dtheta = -omega*dlogp_y/dtheta.
# 2. log p_y = z_y / T - logsumexp(z / T), so dlogp_y/dz_j = (1/T) * (onehot(y)_j - p_j) and
#        dl/dz = -(omega / T) * (onehot(y) - p)                                          (the logit gradient)
# 3. Its L2 norm: ||onehot(y) - p||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2 = 1 - 2 p_y + sum_j p_j^2, so
#        ||dl/dz|| = |omega| / T * sqrt(1 - 2 p_y + sum_j p_j^2) = |omega| * grad_norm           -> token_stats
# 4. Why it tracks entropy WITHIN an answer (omega is the same for every token of answer i when r = 1):
#    (1 - p_y)^2 <= ||onehot(y) - p||^2 <= 2 (1 - p_y)^2, and over y ~ p, E||onehot(y) - p||^2 = 1 - sum_j p_j^2
#    <= 1 - exp(-H) (Shannon entropy >= Renyi-2 entropy -log sum p^2). A near-certain token (H ~ 0, p_y ~ 1) has
#    a near-zero logit gradient; only uncertain (high-H) tokens can have a large one. test_derivation_* pins these.
# 5. Why |A| matters ACROSS answers: the factor |omega| = |r * A| differs between answers. With binary rewards and
#    k of G answers correct, A = +sqrt((G-k)/k) for the correct and -sqrt(k/(G-k)) for the wrong ones
#    (G = 8, k = 1: +2.65 vs -0.38), and A = 0 for a group whose answers all got the same reward. Entropy ranking
#    ignores this factor: it spends budget on tokens whose gradient is small or exactly 0.
# 6. GMTS scores a token by |H_t * omega_t| (entropy standing in for the per-token norm of step 3), and keeps the
#    top rho of the batch. 'gradnorm' uses the exact logit-gradient norm |omega| * grad_norm instead (an ablation
#    the paper does not run; it costs the same vocabulary reduction as H).
# Where the paper is silent this code: uses the rollout temperature T for p, H and log p; selects over the whole
# batch; recomputes omega (with the current ratio and clip) before every inner update; computes all of it in fp32.
# ---------------------------------------------------------------------------------------------------------------

def token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> tuple:
    """(logp, entropy, grad_norm) of each sampled token, in fp32. logits (..., V), tokens (...) -> 3 x (...).

    logp      = log p_y,  p = softmax(logits / T)
    entropy   = -sum_j p_j log p_j                                   (nats)
    grad_norm = ||d logp_y / d logits||_2 = (1/T) * sqrt(1 - 2 p_y + sum_j p_j^2)   (derivation step 3)
    """
    z = logits.float()
    logp_all = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)  # (..., V)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (...)
    # 1 - 2 p_y + sum p^2 cancels catastrophically when p_y ~ 1; the same number as (1 - p_y)^2 + sum_{j!=y} p_j^2
    # has no cancellation (1 - p_y = -expm1(logp_y)). Without autograd, p is reused in place: 3 (..., V) buffers.
    inplace = not torch.is_grad_enabled()
    p = logp_all.exp()  # (..., V)
    p = p.scatter_(-1, tokens.unsqueeze(-1), 0.0) if inplace else p.scatter(-1, tokens.unsqueeze(-1), 0.0)  # p_y := 0
    others_sq = torch.linalg.vector_norm(p, dim=-1).square()  # sum_{j != y} p_j^2
    plogp = p.mul_(logp_all) if inplace else p * logp_all  # (..., V)
    entropy = -(plogp.sum(-1) + logp.exp() * logp)  # y's term added back
    sq = torch.expm1(logp).square() + others_sq  # (...)
    return logp, entropy, sq.sqrt() / temperature

def head_stats(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float = 1.0,
               chunk: int = 1024) -> tuple:
    """token_stats from final hidden states, through the lm_head chunk by chunk, without autograd.

    hidden (M, d), tokens (M,) -> 3 x (M,). Peak extra memory is ~3 (chunk, V) fp32 tensors, whatever M is.
    """
    outs = []
    with torch.no_grad():
        for h, y in zip(hidden.split(chunk), tokens.split(chunk)):
            outs.append(token_stats(F.linear(h, head.weight, head.bias), y, temperature))
    return tuple(torch.cat(o) for o in zip(*outs)) if outs else (hidden.new_zeros(0),) * 3

def _chunk_logp(h: torch.Tensor, weight: torch.Tensor, bias, y: torch.Tensor, temperature: float):
    z = F.linear(h, weight, bias).float()  # (C, V)
    z = z / temperature if temperature != 1.0 else z
    return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)  # (C,)

def head_logp(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float = 1.0,
              chunk: int = 1024) -> torch.Tensor:
    """log p_y WITH autograd, chunked: each chunk's (C, V) logits are recomputed in backward (activation
    checkpointing), so the head's memory is bounded by the chunk, not by the number of tokens. (M, d) -> (M,)."""
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_chunk_logp, h, head.weight, head.bias, y, temperature, use_reentrant=False)
             for h, y in zip(hidden.split(chunk), tokens.split(chunk))]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

def response_hidden(model, batch: dict, rows: slice = slice(None)) -> torch.Tensor:
    """Final hidden states that PREDICT each response token: position P-1+t predicts token t. -> (n, T, d).

    Left padding: position ids come from the attention mask (cumsum - 1), as generate() computed them, otherwise
    recomputed log-probs differ from the sampler's.
    """
    ids = torch.cat([batch["prompt_ids"][rows], batch["comp_ids"][rows]], dim=1)  # (n, P + T)
    attn = torch.cat([batch["prompt_mask"][rows], batch["resp_mask"][rows]], dim=1).long()  # (n, P + T)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (n, P + T)
    device = ids.device
    with autocast(device):
        h = model.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state  # (n, P+T, d)
    P, T = batch["prompt_ids"].shape[1], batch["comp_ids"].shape[1]
    return h[:, P - 1:P + T - 1]  # (n, T, d)

@torch.no_grad()
def batch_token_stats(model, batch: dict, temperature: float, micro_batch: int, chunk: int) -> tuple:
    """(logp, entropy, grad_norm), each (N, T) fp32, 0 at invalid positions: one no-grad forward, in micro-batches."""
    head = model.get_output_embeddings()
    mask, comp = batch["resp_mask"], batch["comp_ids"]
    out = [torch.zeros(mask.shape, device=mask.device) for _ in range(3)]  # 3 x (N, T)
    for s in range(0, mask.shape[0], micro_batch):
        rows = slice(s, s + micro_batch)
        h = response_hidden(model, batch, rows)  # (n, T, d)
        m = mask[rows]  # (n, T)
        for o, v in zip(out, head_stats(h[m], head, comp[rows][m], temperature, chunk)):
            o[rows][m] = v
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# Scores and top-rho selection [paper: GMTS eq. 4; 80/20 section 4]
# ---------------------------------------------------------------------------------------------------------------

def omega(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """omega = ratio * A where the PPO clip leaves the gradient alive, 0 where the clip is active (step 1).
    adv (N,), ratio (N, T) -> (N, T)."""
    a = adv[:, None].expand_as(ratio)  # (N, T)
    clipped = ((a > 0) & (ratio > 1 + clip_high)) | ((a < 0) & (ratio < 1 - clip_low))  # (N, T)
    return torch.where(clipped, torch.zeros_like(ratio), ratio * a)

def token_scores(method: str, entropy: torch.Tensor, grad_norm: torch.Tensor, om: torch.Tensor,
                 generator: torch.Generator = None) -> torch.Tensor:
    """The ranking score of each token; higher is kept first. All inputs (N, T) -> (N, T).

      all      : 1 everywhere (vanilla GRPO: select_tokens with rho = 1 keeps everything anyway)
      random   : uniform noise (the control: a random rho of the tokens)
      entropy  : H_t                         (80/20 paper)
      gmts     : |H_t * omega_t|             (GMTS)
      gradnorm : |omega_t| * grad_norm_t     (the exact logit-gradient norm, derivation step 3)
    """
    if method == "all":
        return torch.ones_like(entropy)
    if method == "random":
        return torch.rand(entropy.shape, generator=generator).to(entropy.device)
    if method == "entropy":
        return entropy
    if method == "gmts":
        return (entropy * om).abs()
    if method == "gradnorm":
        return om.abs() * grad_norm
    raise ValueError(f"unknown selection method {method!r}; choose one of: {', '.join(CHOICES['select'])}")

def select_tokens(scores: torch.Tensor, mask: torch.Tensor, rho: float, nonzero: bool = False) -> torch.Tensor:
    """sel_mask: the k = ceil(rho * mask.sum()) valid tokens with the highest scores over the WHOLE batch.

    Ties are broken by position (earlier flat index first), masked-out tokens are never kept, NaN ranks lowest.
    A k-th-value threshold plus a cumulative count over the tied values: O(n), exact, and unlike torch.quantile
    it works above 2^24 elements and never over-selects on ties. nonzero=True (gmts, gradnorm) then drops kept
    tokens whose score is 0: their gradient is exactly 0, so those methods may keep fewer than k.
    (N, T) float, (N, T) bool -> (N, T) bool.
    """
    flat_mask = mask.reshape(-1)  # (N*T,)
    n = int(flat_mask.sum())
    k = min(n, math.ceil(rho * n - 1e-9))  # the 1e-9 keeps 0.2 * 10 from rounding up to 3
    sel = torch.zeros_like(flat_mask)
    if k == 0:
        return sel.view_as(mask)
    vals = torch.nan_to_num(scores.reshape(-1)[flat_mask].float(), nan=-math.inf)  # (n,)
    thr = torch.kthvalue(vals, n - k + 1).values  # the k-th largest value
    keep = vals > thr
    ties = vals == thr
    keep |= ties & (ties.cumsum(0) <= k - int(keep.sum()))
    if nonzero:
        keep &= vals > 0
    sel[flat_mask] = keep
    return sel.view_as(mask)


# ---------------------------------------------------------------------------------------------------------------
# Loss [paper: GRPO / DAPO objective restricted to the selected tokens]
# ---------------------------------------------------------------------------------------------------------------

def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                    clip_high: float) -> tuple:
    """Per-token PPO-clip loss, inputs (M,) for M tokens -> (loss (M,), clipped (M,) bool).

    l = -min(r * A, clip(r, 1 - eps_l, 1 + eps_h) * A),  r = exp(logp - old_logp). With old_logp = logp.detach()
    (one on-policy update) r == 1 and dl/dtheta = -A * dlogp/dtheta: plain REINFORCE (test_loss_* pins this).
    """
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    return loss, clipped

def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman, "Approximating KL divergence"):
    exp(ref - logp) - (ref - logp) - 1, >= 0 and exactly 0 where the two policies agree. (M,) -> (M,)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1

def policy_update(model, opt, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor, old_logp: torch.Tensor,
                  denom: float, *, temperature: float, clip_low: float, clip_high: float, micro_batch: int,
                  chunk: int, max_grad_norm: float, kl_beta: float = 0.0, ref_logp: torch.Tensor = None) -> dict:
    """One optimiser step on the selected tokens: sum of token losses / denom, accumulated over micro-batches.

    Only answers with a selected token are run, and the lm_head + log-softmax only at the selected positions:
    unselected tokens have zero gradient, so leaving them out is exact (all valid positions when kl_beta > 0, since
    the KL covers every token). A non-finite gradient skips the step and leaves weights and optimiser untouched.
    """
    head = model.get_output_embeddings()
    need = (sel_mask | batch["resp_mask"]) if kl_beta > 0 else sel_mask  # (N, T) positions whose log-prob we need
    opt.zero_grad(set_to_none=True)
    loss_sum, clipped, kl_sum = 0.0, 0, 0.0
    active = need.any(dim=1).nonzero().squeeze(1)  # answers that enter the forward
    for rows in active.split(micro_batch) if active.numel() else []:
        m = need[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        logp = head_logp(h, head, batch["comp_ids"][rows][m], temperature, chunk)  # (M,)
        a = adv[rows][:, None].expand_as(m)[m]  # (M,)
        pg, clip_m = grpo_token_loss(logp, old_logp[rows][m], a, clip_low, clip_high)
        s = sel_mask[rows][m].float()  # (M,)
        loss = (pg * s).sum()
        if kl_beta > 0:
            kl = k3_kl(logp, ref_logp[rows][m])
            loss = loss + kl_beta * kl.sum()
            kl_sum += float(kl.detach().sum())
        (loss / denom).backward()
        loss_sum += float(loss.detach())
        clipped += int((clip_m & s.bool()).sum())
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if active.numel() else 0.0
    skipped = not math.isfinite(grad_norm) or not math.isfinite(loss_sum)
    if skipped:
        opt.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights or the Adam moments
    elif active.numel():
        opt.step()
    n_sel = max(int(sel_mask.sum()), 1)
    return dict(loss=loss_sum / denom, grad_norm=grad_norm, clip_frac=clipped / n_sel,
                kl=kl_sum / max(int(batch["resp_mask"].sum()), 1), skipped=int(skipped),
                stepped=int(active.numel() > 0))


# ---------------------------------------------------------------------------------------------------------------
# Evaluation, warm-up, checkpoints, metrics [plumbing]
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, tok, task: dict, rows: list, chat: bool, short: bool, max_new_tokens: int,
             batch_size: int = 64) -> dict:
    """Greedy accuracy (share of answers with reward 1.0) on held-out rows, one sample answer, and for tasks with a
    format check (countdown) the share of well-formed answers, right or wrong (eval_valid)."""
    correct, valid, lengths, sample = 0, 0, [], ""
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = build_prompts(tok, task, chunk, chat, short)
        b = rollout(model, tok, prompts, 1, max_new_tokens, greedy=True)
        for r, text in zip(chunk, b["texts"]):
            correct += task["reward"](text, r) == 1.0
            valid += "valid" in task and task["valid"](text, r)
        lengths += b["resp_mask"].sum(1).tolist()
        sample = sample or b["texts"][0]
    n = max(len(rows), 1)
    return dict(eval_acc=correct / n, **({"eval_valid": valid / n} if "valid" in task else {}),
                eval_len=sum(lengths) / max(len(lengths), 1), eval_sample=sample[:200])

def sft_warmup(model, tok, task: dict, rows: list, chat: bool, short: bool, steps: int, lr: float,
               batch_size: int, seed: int, log=print, target_acc: float = 0.0, max_new_tokens: int = 64,
               blind: bool = False) -> int:
    """Supervised warm-up on reference solutions (cross-entropy on the answer tokens only), so that a tiny random
    model earns some reward before RL. Real checkpoints skip it (--sft-steps 0). With target_acc > 0 it stops as
    soon as the greedy accuracy on 64 TRAINING problems (checked every 50 steps) reaches target_acc.

    blind=True trains on random well-formed answers instead of solutions (task["blind"]; countdown: random signs):
    the model learns the format and to copy the numbers, but its choice of signs stays spread out and unrelated to
    the target, so what it gains later is learned by RL from the reward. target_acc then applies to the share of
    well-formed answers (task["valid"]), right or wrong. Returns the steps run."""
    if steps <= 0:
        return 0
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    end = tok.eos_token
    model.train()
    for step in range(1, steps + 1):
        pick = [rng.choice(rows) for _ in range(batch_size)]
        prompts = build_prompts(tok, task, pick, chat, short)
        taught = [task["blind"](r, rng) for r in pick] if blind else pick  # blind: random answers, not solutions
        answers = [task["reference"](r) + end for r in taught]
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        a_ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
        L = max(len(p) + len(a) for p, a in zip(p_ids, a_ids))
        ids = torch.full((batch_size, L), tok.pad_token_id)
        labels = torch.full((batch_size, L), -100)
        for i, (p, a) in enumerate(zip(p_ids, a_ids)):  # right padding is fine here: no generation
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        attn = (labels != -100) | (torch.arange(L)[None, :] < torch.tensor([len(p) for p in p_ids])[:, None])
        with autocast(device):
            loss = model(input_ids=ids.to(device), attention_mask=attn.long().to(device),
                         labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step % 50 == 0 or step == steps) and (log or target_acc):  # log=None: no checks unless to stop
            ev = evaluate(model, tok, task, rows[:64], chat, short, max_new_tokens)  # greedy, 64 TRAINING rows
            model.train()
            if log:
                log(f"warm-up {step}/{steps} | sft loss {loss.item():.3f}"
                    + "".join(f" | {k[5:]} {ev[k]:.3f}" for k in ("eval_acc", "eval_valid") if k in ev))
            if target_acc and ev["eval_valid" if blind else "eval_acc"] >= target_acc:
                return step
    return steps


def warm_up(model, tok, task: dict, rows: list, chat: bool, cfg: Config, log=print) -> int:
    return sft_warmup(model, tok, task, rows, chat, cfg.short_prompt, cfg.sft_steps, cfg.sft_lr, cfg.sft_batch,
                      cfg.seed, log, cfg.sft_target, cfg.max_new_tokens, cfg.sft_blind)

def log_metrics(path: str, rec: dict):
    """Append one JSON line with a single write() on an O_APPEND file: a kill leaves whole lines or none."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)

def trim_metrics(path: str, last_step: int):
    """On resume: keep the whole lines of steps <= last_step (drops a torn tail and steps that will rerun)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if line.endswith("\n") and json.loads(line)["step"] <= last_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)

def save_checkpoint(out: str, step: int, model, tok, opt, sched):
    """OUT/ckpt-<step>: model, tokenizer, optimiser, scheduler, RNG states, step. Written into a .tmp folder and
    renamed (atomic), so a kill mid-write never leaves a folder that looks complete. Older ones are then removed."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    rng = dict(python=random.getstate(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])
    torch.save(dict(step=step, opt=opt.state_dict(), sched=sched.state_dict(), rng=rng), os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in glob.glob(os.path.join(out, "ckpt-*")):
        if old != final and not old.endswith(".old"):
            os.replace(old, old + ".old")  # renamed first: a half-deleted folder never looks like a checkpoint
            shutil.rmtree(old + ".old", ignore_errors=True)

def last_checkpoint(out: str):
    """The newest complete checkpoint folder in out, or None."""
    done = [d for d in glob.glob(os.path.join(out, "ckpt-*"))
            if re.fullmatch(r"ckpt-\d+", os.path.basename(d)) and os.path.exists(os.path.join(d, "state.pt"))]
    return max(done, default=None)

def save_final(out: str, model, tok):
    """save_pretrained into OUT itself (AutoModelForCausalLM.from_pretrained(OUT) loads it): written to a temporary
    folder, then each file moved in with an atomic rename, config.json last so a reader never sees a torn model."""
    tmp = os.path.join(out, "final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
    for n in names:
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)

def make_reporter(kind: str, cfg: Config):
    """An optional external logger, imported lazily; a function (record, step) -> None, or None."""
    if kind == "none":
        return None
    try:
        if kind == "wandb":
            import wandb
            run = wandb.init(project="gmts", config=dataclasses.asdict(cfg))
            return lambda rec, step: run.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)
        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(os.path.join(cfg.out, "tb"))
        return lambda rec, step: [w.add_scalar(k, v, step) for k, v in rec.items() if isinstance(v, (int, float))]
    except ImportError as e:
        raise ValueError(f"--report-to {kind} needs a package that is not installed ({e.name}): pip install {e.name}")

OOM_HINT = ("out of GPU memory in {}: lower --micro-batch, --group-size or --max-new-tokens "
            "(the last checkpoint is kept)")


# ---------------------------------------------------------------------------------------------------------------
# Training loop [paper: algorithm box; the numbers match the header]
# ---------------------------------------------------------------------------------------------------------------

def lr_factor(i: int, total: int, warmup: int, decay: bool = True) -> float:
    """lr multiplier at optimiser step i (0-based) of `total`: linear warm-up over `warmup` steps, then (decay) a
    linear decay that reaches 1 / (total - warmup) at the last step (TRL's default schedule is also linear)."""
    up = (i + 1) / max(warmup, 1)
    return min(1.0, up, max(total - i, 1) / max(total - warmup, 1)) if decay else min(1.0, up)

def split_rows(task: dict, cfg: Config) -> tuple:
    """(train rows, held-out eval rows): the FIRST eval_size rows are held out, so they stay the same whatever
    --steps asks for (rows come from a seeded generator or a seeded shuffle); train drops any repeat of them."""
    rows = task["load"](cfg.data, max(cfg.steps * cfg.prompts_per_step, 2000) + cfg.eval_size, cfg.seed)
    if len(rows) <= cfg.eval_size:
        raise ValueError(f"--data {cfg.data}: {len(rows)} rows, need more than --eval-size {cfg.eval_size}")
    held = rows[:cfg.eval_size]
    seen = {task["prompt"](r) for r in held}
    return [r for r in rows[cfg.eval_size:] if task["prompt"](r) not in seen], held

def sample_and_score(model, tok, task: dict, train_rows: list, chat: bool, cfg: Config) -> tuple:
    """Steps 1-4: B prompts, G answers each, rewards from the verifier, group advantages -> (batch, rewards, adv)."""
    rows = random.sample(train_rows, min(cfg.prompts_per_step, len(train_rows)))
    prompts = build_prompts(tok, task, rows, chat, cfg.short_prompt)
    try:
        batch = rollout(model, tok, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    except torch.OutOfMemoryError:
        raise RuntimeError(OOM_HINT.format("generation")) from None
    group_rows = [r for r in rows for _ in range(cfg.group_size)]
    rewards = torch.tensor([task["reward"](t, r) for t, r in zip(batch["texts"], group_rows)])  # (N,)
    adv = group_advantages(rewards, cfg.group_size, cfg.std_normalize).to(batch["comp_ids"].device)  # (N,)
    return batch, rewards, adv


def train(cfg: Config, log=print) -> str:
    """GRPO with token selection. Returns the output folder (metrics.jsonl, checkpoints, the final model)."""
    from tqdm import tqdm

    if cfg.resume:
        cfg.out = cfg.resume
        ckpt = last_checkpoint(cfg.resume)
        if ckpt is None:
            raise ValueError(f"--resume {cfg.resume}: no complete checkpoint (ckpt-*) in that folder")
    else:
        ckpt = None
    device = pick_device(cfg.device)
    set_seed(cfg.seed)
    task = get_task(cfg.task)
    train_rows, eval_rows = split_rows(task, cfg)
    os.makedirs(cfg.out, exist_ok=True)
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    log(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    with open(os.path.join(cfg.out, "run_config.json"), "w") as f:  # --resume reads it back
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    model, tok = load_model(ckpt or cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    chat = use_chat(tok, cfg.chat)
    log(f"device {device} | model {resolve_model_name(cfg.model)} ({sum(p.numel() for p in model.parameters()):,} "
        f"params) | chat template {chat} | {len(train_rows)} train / {len(eval_rows)} eval rows | N = "
        f"{cfg.prompts_per_step}x{cfg.group_size} = {cfg.prompts_per_step * cfg.group_size} answers per step")
    ref = None
    if cfg.kl_beta > 0:  # the frozen reference: the starting weights (before any warm-up)
        ref = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)[0].eval().requires_grad_(False)
    if cfg.grad_ckpt:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, total=cfg.steps * cfg.inner_updates, warmup=cfg.warmup_steps, decay=cfg.lr_decay))
    ev = lambda: evaluate(model, tok, task, eval_rows, chat, cfg.short_prompt, cfg.max_new_tokens)  # noqa: E731
    report = make_reporter(cfg.report_to, cfg)
    start, skipped_steps = 1, 0
    if ckpt:
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        start = state["step"] + 1
        trim_metrics(metrics_path, state["step"])
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                skipped_steps = max([json.loads(line).get("skipped_steps", 0) for line in f] or [0])
        log(f"resumed from {ckpt} at step {start}")
    else:
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        warm_up(model, tok, task, train_rows, chat, cfg, log)
        if cfg.eval_every > 0:  # the starting accuracy is the first eval_acc, logged at step 0
            rec = dict(step=0, **ev())
            log_metrics(metrics_path, rec)
            log(f"step 0 | eval_acc {rec['eval_acc']:.3f} | sample: {rec['eval_sample'][:80]!r}")
        save_checkpoint(cfg.out, 0, model, tok, opt, sched)
    model.train()
    bar = tqdm(range(start, cfg.steps + 1), initial=start - 1, total=cfg.steps, disable=not sys.stderr.isatty(),
               desc="gmts")
    for step in bar:
        t0 = time.time()
        set_seed(cfg.seed * 1_000_003 + step)  # every step's randomness is a function of (seed, step): resumable
        # 1.-4. sample B prompts, roll out G answers each, verify -> rewards, group advantages
        batch, rewards, adv = sample_and_score(model, tok, task, train_rows, chat, cfg)  # (N,) each
        t_roll = time.time() - t0
        mask = batch["resp_mask"]  # (N, T)
        zero_group = (adv == 0)[:, None] & mask  # (N, T) tokens of answers with A = 0
        n_valid = int(mask.sum())
        try:
            for inner in range(cfg.inner_updates):
                # 5. token statistics of the current policy, scores, top-rho selection over the whole batch
                logp, entropy, grad_norm = batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch,
                                                             cfg.stats_chunk)  # 3 x (N, T)
                if inner == 0:
                    old_logp = logp  # pi_old: the policy that sampled the batch
                    ref_logp = (batch_token_stats(ref, batch, cfg.temperature, cfg.micro_batch, cfg.stats_chunk)[0]
                                if ref is not None else None)
                om = omega(adv, torch.exp(logp - old_logp), cfg.clip_low, cfg.clip_high)  # (N, T)
                scores = token_scores(cfg.select, entropy, grad_norm, om)
                sel_mask = select_tokens(scores, mask, 1.0 if cfg.select == "all" else cfg.rho, nonzero=cfg.select in ("gmts", "gradnorm"))
                denom = float(n_valid if cfg.loss_norm == "all" else max(int(sel_mask.sum()), 1))
                # 6. PPO-clip update on the selected tokens only
                stats = policy_update(model, opt, batch, adv, sel_mask, old_logp, denom,
                                      temperature=cfg.temperature, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      micro_batch=cfg.micro_batch, chunk=cfg.stats_chunk,
                                      max_grad_norm=cfg.max_grad_norm, kl_beta=cfg.kl_beta, ref_logp=ref_logp)
                skipped_steps += stats["skipped"]
                if stats["stepped"] and not stats["skipped"]:
                    sched.step()
        except torch.OutOfMemoryError:
            raise RuntimeError(OOM_HINT.format("the update")) from None
        # 7. log, evaluate, checkpoint
        n_sel = max(int(sel_mask.sum()), 1)
        ent_sel = select_tokens(entropy, mask, cfg.rho)
        gmts_sel = select_tokens(token_scores("gmts", entropy, grad_norm, om), mask, cfg.rho, nonzero=True)
        dt = time.time() - t0
        rec = dict(step=step, reward_mean=rewards.mean().item(), acc=(rewards == 1.0).float().mean().item(),
                   selected_frac=int(sel_mask.sum()) / max(n_valid, 1),
                   entropy_mean=float((entropy * mask).sum()) / max(n_valid, 1),
                   entropy_selected_mean=float((entropy * sel_mask).sum()) / n_sel,
                   zero_adv_selected_frac=float((sel_mask & zero_group).sum()) / n_sel,
                   entropy_gmts_overlap=float((ent_sel & gmts_sel).sum()) / max(int((ent_sel | gmts_sel).sum()), 1),
                   selected_abs_adv_mean=float((adv.abs()[:, None] * sel_mask).sum()) / n_sel,
                   grad_norm=stats["grad_norm"], loss=stats["loss"], clip_frac=stats["clip_frac"], kl=stats["kl"],
                   completion_len=n_valid / mask.shape[0], truncated_frac=batch["truncated"].float().mean().item(),
                   lr=sched.get_last_lr()[0], skipped_steps=skipped_steps, rollout_time_s=t_roll, step_time_s=dt,
                   tokens_per_s=n_valid / dt)
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps:
            rec.update(ev())
        log_metrics(metrics_path, rec)
        if report:
            report(rec, step)
        msg = (f"step {step} | reward {rec['reward_mean']:.3f} | acc {rec['acc']:.3f} | kept {rec['selected_frac']:.2f}"
               f" | H {rec['entropy_mean']:.3f} | gnorm {rec['grad_norm']:.3f} | len {rec['completion_len']:.1f}"
               f" | {dt:.2f} s" + (f" | eval_acc {rec['eval_acc']:.3f}" if "eval_acc" in rec else ""))
        tqdm.write(msg) if not bar.disable else log(msg)
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.steps:
            save_checkpoint(cfg.out, step, model, tok, opt, sched)
    save_final(cfg.out, model, tok)
    plot_runs({cfg.select: [cfg.out]}, os.path.join(cfg.out, "metrics.png"))
    log(f"done: {cfg.out} (metrics.jsonl, metrics.png, the model)")
    return cfg.out

def read_metrics(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]

def plot_runs(runs: dict, png: str):
    """runs: label -> list of run folders (seeds). Held-out accuracy and batch reward vs step, mean over seeds."""
    from matplotlib.figure import Figure  # no pyplot: an importing notebook keeps its own backend

    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for label, outs in runs.items():
        for ax, key in zip(axes, ("eval_acc", "reward_mean")):
            series = [{r["step"]: r[key] for r in read_metrics(o) if key in r} for o in outs]
            steps = sorted(set.intersection(*(set(x) for x in series)))
            ax.plot(steps, [sum(x[t] for x in series) / len(series) for t in steps], label=label, marker=".")
            ax.set_xlabel("step")
            ax.set_ylabel(key + (f" (mean of {len(outs)} seeds)" if len(outs) > 1 else ""))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)

def _compare_job(job: tuple) -> str:
    """One unit of --compare, run in a worker process: ("warm", cfg, threads) warms up and saves the model to
    cfg.out, ("train", cfg, threads) is one silent training run."""
    kind, cfg, threads = job
    torch.set_num_threads(threads)
    if kind == "train":
        return train(cfg, log=lambda *a: None)
    model, tok = load_model(cfg.model, pick_device(cfg.device), cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    task = get_task(cfg.task)
    warm_up(model, tok, task, split_rows(task, cfg)[0], use_chat(tok, cfg.chat), cfg, log=None)  # no evals
    model.save_pretrained(cfg.out)
    tok.save_pretrained(cfg.out)
    return cfg.out

def compare(cfg: Config, log=print) -> dict:
    """--compare all,entropy,gmts --seeds 3: the same seeds with each method; a plot and a table of final accuracy.
    The warm-up is done once per seed and shared by the methods; runs go to --workers parallel processes."""
    methods = [m.strip() for m in cfg.compare.split(",") if m.strip()]
    bad = [m for m in methods if m not in CHOICES["select"]]
    if bad or not methods:
        raise ValueError(f"--compare {cfg.compare!r}: methods must be from {', '.join(CHOICES['select'])}")
    seeds = range(cfg.seed, cfg.seed + cfg.seeds)
    workers = cfg.workers or (torch.get_num_threads() if pick_device(cfg.device).type == "cpu" else 1)
    threads = max(1, torch.get_num_threads() // workers)  # two 1-thread processes beat one 2-thread one on 2 cores
    starts = {s: dataclasses.replace(cfg, seed=s, compare="") for s in seeds}
    warm = {s: dataclasses.replace(starts[s], out=os.path.join(cfg.out, f"warm-s{s}")) for s in seeds}
    runs = [dataclasses.replace(starts[s], select=m, out=os.path.join(cfg.out, f"{m}-s{s}")) for m in methods
            for s in seeds]
    if cfg.sft_steps > 0:  # the warm-up is done once per seed; every method starts from the same saved model
        runs = [dataclasses.replace(c, model=warm[c.seed].out, sft_steps=0) for c in runs]
    log(f"{len(runs)} runs ({cfg.seeds} seed(s) x {len(methods)} method(s)) in {workers} process(es), "
        f"{threads} thread(s) each" + (", after a warm-up per seed" if cfg.sft_steps > 0 else ""))
    import concurrent.futures as cf
    import multiprocessing
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        def submit(kind, cs):
            return {ex.submit(_compare_job, (kind, c, threads)): (kind, c) for c in cs}
        pending = submit("warm", warm.values()) if cfg.sft_steps > 0 else submit("train", runs)
        recs = {}  # run folder -> its metrics, read once as it finishes
        while pending:  # a seed's runs start as soon as its warm-up is saved
            finished, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                kind, c = pending.pop(f)
                f.result()  # a worker's exception is raised here, with its type
                if kind == "warm":
                    log(f"warm-up of seed {c.seed} saved to {c.out}")
                    pending.update(submit("train", [r for r in runs if r.seed == c.seed]))
                else:
                    rec = recs[c.out] = read_metrics(c.out)
                    log(f"{c.select} seed {c.seed}: eval_acc {rec[0]['eval_acc']:.3f} -> {rec[-1]['eval_acc']:.3f}")
    outs, table = {}, {}
    for c in runs:  # in method, seed order, whatever order the processes finished in
        rec = recs[c.out]
        outs.setdefault(c.select, []).append(c.out)
        table.setdefault(c.select, []).append((rec[0]["eval_acc"], rec[-1]["eval_acc"]))
    lines = ["| method | eval_acc at step 0 | final eval_acc (mean +- std over seeds) | per seed |",
             "|---|---|---|---|"]
    for m, v in table.items():
        fin = torch.tensor([b for _, b in v])
        sd = float(fin.std(unbiased=False))
        lines.append(f"| {m} | {sum(a for a, _ in v) / len(v):.3f} | {float(fin.mean()):.3f} +- {sd:.3f} | "
                     + ", ".join(f"{b:.3f}" for _, b in v) + " |")
    with open(os.path.join(cfg.out, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_runs(outs, os.path.join(cfg.out, "compare.png"))
    log("\n".join(lines))
    return table


# ---------------------------------------------------------------------------------------------------------------
# Analysis [paper: the claim] does |H * omega| rank tokens by their true gradient magnitude better than H does?
# ---------------------------------------------------------------------------------------------------------------

def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation with average ranks for ties; NaN when either side is constant. (n,), (n,) -> float"""
    def ranks(x):
        r = torch.empty(len(x), dtype=torch.float64)
        r[x.argsort()] = torch.arange(len(x), dtype=torch.float64)
        _, inv = torch.unique(x, return_inverse=True)
        return (torch.zeros(int(inv.max()) + 1, dtype=torch.float64).index_add_(0, inv, r) / inv.bincount())[inv]
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a.double().cpu()), ranks(b.double().cpu())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float((ra.square().sum() * rb.square().sum()).sqrt())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")

def param_grad_norms(model, batch: dict, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """TRUE per-token gradient norm w.r.t. all parameters, ||d l_t / d theta|| = |A_i| * ||d logp_t / d theta||
    (on-policy: ratio = 1, omega = A), by one autograd backward per token. rows, cols (K,) index tokens -> (K,)."""
    params = [p for p in model.parameters() if p.requires_grad]
    head = model.get_output_embeddings()
    uniq, where = torch.unique(rows, return_inverse=True)
    h = response_hidden(model, batch, uniq)  # (u, T, d)
    logp = head_logp(h[where, cols], head, batch["comp_ids"][rows, cols], temperature)  # (K,)
    out = []
    for k in range(len(rows)):
        g = torch.autograd.grad(logp[k], params, retain_graph=k < len(rows) - 1, allow_unused=True)
        out.append(float(torch.sqrt(sum((x.float() ** 2).sum() for x in g if x is not None))))
    return adv[rows].abs().cpu() * torch.tensor(out)

def ranking_study(model, batch: dict, adv: torch.Tensor, temperature: float, max_tokens: int = 256,
                  per_answer: int = 24, seed: int = 0) -> dict:
    """Spearman correlation of each score (entropy, gmts, gradnorm, random) with (a) the exact logit-gradient norm
    and (b) the parameter-gradient norm, within answers (mean over answers whose target is not constant) and
    across the sampled tokens of the whole batch. Tokens: up to per_answer random ones from random answers."""
    g = torch.Generator().manual_seed(seed)
    logp, entropy, grad_norm = batch_token_stats(model, batch, temperature, 8, 1024)
    mask = batch["resp_mask"].cpu()
    rows, cols = [], []
    for i in torch.randperm(mask.shape[0], generator=g).tolist():
        valid = mask[i].nonzero().squeeze(1)
        take = valid[torch.randperm(len(valid), generator=g)[:per_answer]]
        rows += [i] * len(take)
        cols += take.tolist()
        if len(rows) >= max_tokens:
            break
    rows, cols = torch.tensor(rows[:max_tokens]), torch.tensor(cols[:max_tokens])
    om = adv[:, None].expand_as(entropy)  # omega = A on-policy
    dev = entropy.device
    r_, c_ = rows.to(dev), cols.to(dev)
    targets = dict(logit=(om.abs() * grad_norm)[r_, c_].cpu(),
                   param=param_grad_norms(model, batch, adv, r_, c_, temperature))
    methods = ("entropy", "gmts", "gradnorm", "random")
    scores = {m: token_scores(m, entropy, grad_norm, om, g)[r_, c_].cpu() for m in methods}
    res = {}
    for m, s in scores.items():
        for t, y in targets.items():
            within = [spearman(s[rows == i], y[rows == i]) for i in rows.unique().tolist()]
            within = [w for w in within if not math.isnan(w)]
            res[(m, f"{t}_within")] = sum(within) / len(within) if within else float("nan")
            res[(m, f"{t}_batch")] = spearman(s, y)
    return res

def analyze(cfg: Config, log=print) -> dict:
    """--analyze: roll out cfg.batches batches and print the ranking study averaged over them."""
    device = pick_device(cfg.device)
    set_seed(cfg.seed)
    task = get_task(cfg.task)
    train_rows, _ = split_rows(task, cfg)
    model, tok = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    chat = use_chat(tok, cfg.chat)
    warm_up(model, tok, task, train_rows, chat, cfg, log)
    acc = {}
    for b in range(cfg.batches):
        batch, rewards, adv = sample_and_score(model, tok, task, train_rows, chat, cfg)
        log(f"batch {b + 1}/{cfg.batches}: reward {rewards.mean():.3f}, {int((adv == 0).sum())}/{len(adv)} "
            f"answers with A = 0")
        for k, v in ranking_study(model, batch, adv, cfg.temperature, seed=cfg.seed + b).items():
            acc.setdefault(k, []).append(v)
    mean = lambda v: sum(x for x in v if not math.isnan(x)) / max(sum(not math.isnan(x) for x in v), 1)  # noqa: E731
    res = {k: mean(v) for k, v in acc.items()}
    cols = ["logit_within", "logit_batch", "param_within", "param_batch"]
    log("score     | " + " | ".join(f"spearman {c:<12}" for c in cols))
    for m in ("entropy", "gmts", "gradnorm", "random"):
        log(f"{m:<9} | " + " | ".join(f"{res[(m, c)]:>21.3f}" for c in cols))
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "analysis.json"), "w") as f:
        json.dump({f"{m}/{c}": v for (m, c), v in res.items()}, f, indent=1)
    return res


# ---------------------------------------------------------------------------------------------------------------
# CLI [plumbing]
# ---------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> Config:
    """Config fields become --flags (bools get --no-x too); --preset NAME sets defaults that explicit flags override."""
    p = argparse.ArgumentParser(description="GRPO with GMTS token selection (see the module docstring).")
    p.error = die  # one line and exit 2, no usage dump
    comments = {}
    src = open(__file__).read()
    for f in dataclasses.fields(Config):  # the trailing comment of each field is its help text
        m = re.search(rf"^\s+{f.name}: [^=]+= [^#\n]*#\s*(.*)$", src, re.M)
        comments[f.name] = m.group(1) if m else ""
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{comments[f.name]} (default: {f.default})"
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(flag, type=typ, default=f.default, choices=CHOICES.get(f.name), help=help_)
    pre, _ = p.parse_known_args(argv)
    if pre.preset:
        if pre.preset not in PRESETS:
            die(f"unknown --preset {pre.preset!r}; choose one of: {', '.join(PRESETS)}")
        p.set_defaults(**PRESETS[pre.preset])
    if pre.resume and os.path.exists(os.path.join(pre.resume, "run_config.json")):
        with open(os.path.join(pre.resume, "run_config.json")) as f:  # --resume: the run's own config; flags win
            p.set_defaults(**{k: v for k, v in json.load(f).items() if k not in ("resume", "preset")})
    return Config(**vars(p.parse_args(argv)))

def main(argv=None):
    cfg = parse_args(argv)
    try:
        check_config(cfg)
        if cfg.analyze:
            analyze(cfg)
        elif cfg.compare:
            compare(cfg)
        else:
            train(cfg)
    except ValueError as e:  # bad input: flags, data files, --resume without a checkpoint
        die(str(e), 2)
    except OSError as e:  # a model that cannot be loaded, a full disk
        die(str(e).splitlines()[0] if str(e) else type(e).__name__, 1)
    except RuntimeError as e:
        if not str(e).startswith("out of GPU memory"):
            raise  # a bug: keep its traceback
        die(str(e), 1)
    except KeyboardInterrupt:
        die("interrupted; the checkpoints in --out are intact (continue with --resume)", 130)


if __name__ == "__main__":
    main()
