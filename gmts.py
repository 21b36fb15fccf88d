"""
gmts.py: GRPO with Gradient Magnitude-based Token Selection (GMTS), in one file.

Read it beside the papers:
  GMTS   Lv et al. 2026, "Gradient Magnitude-based Token Selection Improves RLVR Training for LLM Reasoning",
         arXiv 2608.30632. Score a response token by |H_t * omega_t| and train on the top 20% of the batch.
  80/20  Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
         Reasoning", arXiv 2506.01939. Score a response token by its entropy H_t and train on the top 20%.

The algorithm, one training step (train() below follows these numbers):
  1. draw B prompts from the task                                          [plumbing]
  2. sample G answers per prompt with HF generate (N = B*G answers)        [paper: rollout]
  3. score every answer with a rule-based verifier -> reward r_i           [paper: reward]
  4. group advantages A_i = (r_i - mean_group) / (std_group + eps)        [paper: GRPO advantage]
  5. per response token: log pi(y_t), entropy H_t, logit-gradient norm     [paper: token statistics]
  6. score tokens (entropy: H_t; gmts: |H_t * omega_t|), keep the top rho of the WHOLE batch   [paper: selection]
  7. PPO-clip update on the kept tokens only, in micro-batches           [paper: objective]
  8. log, evaluate, checkpoint                                             [plumbing]

Axis legend: B prompts per step, G answers per prompt, N = B*G answers, P prompt length (left padded),
T response length, V vocabulary, d hidden size. Every (N, T) tensor is aligned to RESPONSE positions:
column t holds the statistics of the t-th generated token, predicted from the hidden state one position earlier.

Deviations from the papers and choices they leave open:
  1. Selection is over the whole rollout batch (N*T tokens), not per micro-batch or per GPU as in the 80/20 code.
  2. omega = ratio * A, 0 where the clip is active (= A on the first inner update), rescored before each inner update.
  3. --loss-norm all (default) divides by all valid tokens, as the 80/20 paper's equation and TRL: selection is
     a pure mask of one sum, so every method runs at one lr; 'selected' divides by the kept tokens (80/20 code).
  4. Population std in the group advantage (divide by G).
  5. --filter-groups (DAPO's dynamic sampling, default on, every method alike) drops groups whose rewards are all
     equal and draws more prompts, up to --max-resample rollout batches per step.
  6. One step rule: the optimiser steps iff a kept token has a non-zero gradient; the lr follows GRPO steps regardless.
  7. KL (k3, beta > 0) covers all valid tokens, divided by their count; its reference is the model --model loads.
  8. fp32 master weights with bf16 autocast on CUDA; log-softmax, entropy and the loss always in fp32.
  9. gmts/gradnorm never keep a token whose score is 0 (its gradient is exactly 0), so they may keep < rho.
 10. Rewards: countdown's 0.1 format reward follows TinyZero, math is binary (80/20 paper), logic mirrors countdown.

Run:  python gmts.py --preset cpu                                  (offline, CPU: a tiny warm-started model learns)
      python gmts.py --model Qwen2.5-0.5B-Instruct --task countdown  (one GPU)
"""
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse, ast, copy, dataclasses, functools, glob, itertools, json, math, random, re, shutil, sys, time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F

# ==== Config [plumbing]: every field is a --flag; --preset NAME applies PRESETS[NAME] first =======================
def arg(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})

@dataclass
class Config:
    # run
    out: str = arg("out", "output folder: metrics.jsonl, checkpoints, the final model")
    overwrite: bool = arg(False, "allow a new run into a folder that holds one (its metrics and checkpoints go)")
    resume: str = arg("", "an earlier --out folder: continue that run from its newest loadable checkpoint")
    allow_change: bool = arg(False, "with --resume: allow another --task, --data or --model than the run's")
    seed: int = arg(0, "seeds python, torch and every step's sampling")
    device: str = arg("auto", "auto picks cuda > mps > cpu")
    steps: int = arg(200, "GRPO steps")
    save_every: int = arg(50, "checkpoint every this many steps (0: only at the end)")
    # model
    model: str = arg("tiny", "'tiny' (random, built offline), a short Qwen name (Qwen2.5-0.5B), a hub id or a folder")
    chat_template: str = arg("auto", "wrap prompts in the chat template: auto (decided by the tokenizer), yes, no")
    tiny_hidden: int = arg(64, "--model tiny: hidden size")
    tiny_layers: int = arg(2, "--model tiny: transformer layers")
    grad_ckpt: bool = arg(False, "gradient checkpointing in the update forward")
    # task
    task: str = arg("countdown", "countdown, math or logic")
    data: str = arg("gen", "gen (offline generator), easy (its smallest variant), hf, hf:test or a .jsonl path")
    short_prompt: bool = arg(False, "terse prompts without the system line (for the byte-level tiny model)")
    eval_every: int = arg(20, "greedy held-out accuracy every this many steps (0: only at the start and the end)")
    eval_size: int = arg(64, "held-out problems (the first rows of the data)")
    # rollout
    prompts_per_step: int = arg(8, "B, informative prompts (groups) per step")
    group_size: int = arg(8, "G, answers sampled per prompt")
    max_new_tokens: int = arg(256, "response length limit; longer answers are cut and flagged")
    temperature: float = arg(1.0, "sampling temperature, also used for log-probs and entropy")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the full distribution (on-policy)")
    top_k: int = arg(0, "top-k sampling; 0 disables it")
    sampler_dtype: str = arg("auto", "weights generate samples from: bf16 (a copy, refreshed after each step), "
                             "fp32 (the master weights); auto: bf16 on CUDA")
    fast_generate: bool = arg(None, "a static KV cache and compiled decoding in generate (unset: on with CUDA)")
    filter_groups: bool = arg(True, "drop groups whose rewards are all equal and draw more (DAPO dynamic sampling)")
    max_resample: int = arg(4, "--filter-groups: at most this many rollout batches per step")
    # GRPO
    clip_low: float = arg(0.2, "PPO clip eps below 1")
    clip_high: float = arg(0.28, "PPO clip eps above 1 (DAPO clip-higher)")
    kl_beta: float = arg(0.0, "k3 KL to the starting model (0: no reference model is loaded)")
    std_normalize: bool = arg(True, "divide advantages by the group std (off: Dr. GRPO)")
    inner_updates: int = arg(1, "optimiser steps per rollout batch (mu)")
    loss_norm: str = arg("all", "all: divide by all valid response tokens; selected: by the kept tokens")
    # token selection
    select: str = arg("gmts", "all, random, entropy, gmts or gradnorm")
    rho: float = arg(0.2, "share of the batch's response tokens kept")
    # optimisation
    lr: float = arg(1e-6, "AdamW learning rate")
    warmup_steps: int = arg(10, "linear lr warm-up, in optimiser steps")
    lr_decay: bool = arg(True, "after the warm-up, decay the lr linearly to ~0 at the last step (off: constant)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    micro_batch: int = arg(8, "answers per forward/backward (gradient accumulation over the batch)")
    stats_chunk: int = arg(1024, "rows of the (tokens x V) logits held at once in the head")

CHOICES = {"select": ["all", "random", "entropy", "gmts", "gradnorm"], "device": ["auto", "cuda", "mps", "cpu"],
           "chat_template": ["auto", "yes", "no"], "loss_norm": ["all", "selected"],
           "sampler_dtype": ["auto", "bf16", "fp32"]}
WARM_CPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm", "cpu")
PRESETS = {
    # Offline CPU demo: a 0.27M-parameter Qwen2 warm-started (`python gmts_lab.py warm`) to copy the numbers of easy
    # countdown with random signs; GRPO learns from the reward which signs hit the target.
    "cpu": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=80, prompts_per_step=32,
                group_size=8, max_new_tokens=64, lr=3e-4, micro_batch=256, eval_every=10, eval_size=256,
                save_every=20, filter_groups=False, out="out/cpu"),  # filtering: 2.4x the rollouts, no gain here
    # A seconds-long version of the same path, for tests.
    "smoke": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=2, prompts_per_step=2,
                  group_size=4, max_new_tokens=16, eval_every=1, eval_size=4, lr=1e-4, out="out/smoke"),
}

def die(msg: str, code: int = 2):
    """Bad input: one line on stderr and a non-zero exit, never a traceback."""
    print(f"gmts: error: {msg}", file=sys.stderr)
    sys.exit(code)

RULES = {  # field -> (test, what the value must be); NaN fails every test
    **dict.fromkeys(["rho", "top_p"], (lambda v: 0 < v <= 1, "in (0, 1]")),
    **dict.fromkeys(["lr", "temperature", "max_grad_norm"], (lambda v: 0 < v < math.inf, "finite and > 0")),
    **dict.fromkeys(["clip_low", "clip_high"], (lambda v: 0 <= v < 1, "in [0, 1)")),
    **dict.fromkeys(["kl_beta", "weight_decay"], (lambda v: 0 <= v < math.inf, "finite and >= 0")),
    **dict.fromkeys(["steps", "prompts_per_step", "max_new_tokens", "micro_batch", "inner_updates", "stats_chunk",
                     "eval_size", "max_resample", "tiny_layers"], (lambda v: v >= 1, ">= 1")),
    **dict.fromkeys(["save_every", "eval_every", "warmup_steps", "top_k"], (lambda v: v >= 0, ">= 0")),
    "group_size": (lambda v: v >= 2, ">= 2 (an advantage needs a group)"),
    "tiny_hidden": (lambda v: v >= 8 and v % 8 == 0, "a multiple of 8 (4 heads of even size)"),
}

def check_config(cfg: Config):
    """Raise ValueError (one line) for any value no run can use, before any work is done."""
    rules = {k: (lambda v, a=allowed: v in a, "one of " + ", ".join(allowed)) for k, allowed in CHOICES.items()}
    for f in dataclasses.fields(Config):  # a hand-edited run_config.json can hold any JSON value
        v, want = getattr(cfg, f.name), {bool: bool, int: int, float: (int, float), str: str}[f.type]
        if not (isinstance(v, want) and isinstance(v, bool) == (f.type is bool) or v is None is f.default):
            raise ValueError(f"--{f.name.replace('_', '-')} must be of type {f.type.__name__}, got {v!r}")
    for k, (ok, want) in {**rules, **RULES}.items():
        if not ok(getattr(cfg, k)):
            raise ValueError(f"--{k.replace('_', '-')} must be {want}, got {getattr(cfg, k)!r}")
    get_task(cfg.task)
    if cfg.data in ("gen", "easy") and cfg.eval_size > 100_000:
        raise ValueError(f"--eval-size must be <= 100000 with generated data, got {cfg.eval_size}")
    parent = os.path.abspath(cfg.out or ".")
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not cfg.out or os.path.isfile(cfg.out) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--out {cfg.out!r} is not a folder that can be written")
    if cfg.device in ("cuda", "mps") and pick_device("auto").type != cfg.device:
        raise ValueError(f"--device {cfg.device} but torch sees no such device (use --device auto or cpu)")

# ==== Small helpers [plumbing] ====================================================================================
def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    return torch.device(name)

def autocast(device: torch.device):
    """bf16 compute on CUDA (weights stay fp32, deviation 8); a no-op elsewhere."""
    use = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)

def set_seed(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)

# ==== Tasks and verifiers [paper: reward] =========================================================================
# Each task = offline generator + prompt + verifier + loader, collected in TASKS.
# Verifiers are pure, cap every length before parsing, use no eval/exec and never raise (a bug costs a reward).
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]

def _never_raise(fn, fallback=0.0):
    """A last-resort net around a verifier (expected failures are handled inside it): an exception -> fallback."""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            return fallback
    return functools.wraps(fn)(wrapped)

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
    '4 + 3 - 2'). The easy variant's solutions (and the lab's warm-up answers) are such chains."""
    value = nums[0] + sum(x if s == "+" else -x for s, x in zip(signs, nums[1:]))
    return value, " ".join([str(nums[0])] + [f"{s} {x}" for s, x in zip(signs, nums[1:])])

def countdown_problem(rng: random.Random, n_nums=(3, 4), num_range=(1, 99), target_range=(1, 1000), ops="+-*/"):
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

@functools.partial(_never_raise, fallback=None)
def countdown_value(completion: str, nums: list):
    """Exact value of the last <answer> if it is an equation that uses each given number once, else None
    (no answer tag, '=' in it: not allowed, as in TinyZero; other characters, other numbers, bad syntax)."""
    ans = (_last_answer(completion) or "").strip()
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
# A template: the question and its worked steps "x op y" over the numbers a, b, c, d (each drawn from 2..12),
# integer literals and the earlier steps' results s1, s2, ...
_MATH = [
    ("{who} buys {a} pens at ${b} each and pays with $150. How many dollars of change are due?", "a*b 150-s1"),
    ("{who} buys {a} pens at ${b} each and {c} books at ${d} each, and pays with $300. How many dollars of change "
     "are due?", "a*b c*d s1+s2 300-s3"),
    ("{who} bakes {a} trays of {b} cookies, eats {c} of them and shares the rest equally among {d} friends. How "
     "many cookies does each friend get?", "a*b s1-c s2/d"),
    ("{who}'s machine makes {a} toys an hour for {b} hours a day. How many toys does it make in {c} days?",
     "a*b s1*c"),
    ("{who}'s machine makes {a} toys an hour for {b} hours a day, and {d} toys a day come out broken. How many "
     "good toys does it make in {c} days?", "a*b s1-d s2*c"),
    ("{who} saves ${a} a week for {b} weeks, then buys a game for ${c}. How many dollars are left?", "a*b s1-c"),
    ("{who} saves ${a} a week for {b} weeks, then buys a game for ${c} and a book for ${d}. How many dollars are "
     "left?", "a*b c+d s1-s2"),
    ("{who} cycles {a} hours at {b} km/h, then walks {c} hours at {d} km/h. How many km is that in total?",
     "a*b c*d s1+s2"),
    ("{who} fills {a} bags with {b} marbles and {c} bags with {d} marbles, then gives half of all the marbles away. "
     "How many marbles are left?", "a*b c*d s1+s2 s3/2"),
]

def math_problem(rng: random.Random, n_steps=(2, 4)) -> dict:
    """A problem from a template with n_steps steps: question, worked steps 'x op y = z' and the integer answer.
    A draw whose steps leave the natural numbers (a negative or a fraction) is redrawn."""
    fits = [t for t in _MATH if n_steps[0] <= len(t[1].split()) <= n_steps[1]]
    while fits:
        question, program = rng.choice(fits)
        v, steps = {k: rng.randint(2, 12) for k in "abcd"}, []
        for i, step in enumerate(program.split(), 1):
            x, op, y = re.split(r"([-+*/])", step)
            x, y = (v[t] if t in v else int(t) for t in (x, y))
            z = _OPS[op](Fraction(x), y)
            if z < 0 or z.denominator != 1:
                break
            v[f"s{i}"] = z = int(z)
            steps.append(f"{x} {op} {y} = {z}")
        else:
            return {"question": question.format(who=rng.choice(NAMES), **v), "answer": str(z), "steps": steps}
    raise ValueError(f"no math template has {n_steps} steps")

# The easy variant: one step whose operation only the words tell (the numbers are shown in the step's order).
_MATH_EASY = [
    ("{who} has {a} apples and buys {b} more. How many apples now?", "+"),
    ("{who} has {a} cards and finds {b} more. How many cards now?", "+"),
    ("{who} has {a} apples and eats {b}. How many apples are left?", "-"),
    ("{who} had {a} cards and lost {b}. How many cards are left?", "-"),
    ("{who} has {a} bags of {b} apples. How many apples in all?", "*"),
    ("{who} buys {a} boxes of {b} cards. How many cards in all?", "*"),
]

def math_easy_problem(rng: random.Random) -> dict:
    """One step `a op b` on a, b in 2..9 with a >= b (so a - b >= 0); the template's words decide op."""
    question, op = rng.choice(_MATH_EASY)
    a, b = sorted((rng.randint(2, 9), rng.randint(2, 9)), reverse=True)
    z = _OPS[op](a, b)
    return {"question": question.format(who=rng.choice(NAMES), a=a, b=b), "answer": str(z),
            "steps": [f"{a} {op} {b} = {z}"]}

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

_ENTRY = r"[\s,;]*([a-z]+)\s*:\s*(knight|knave)(?![a-z])(?:\s*\.)?"  # 'name: role', maybe a full stop

@_never_raise
def logic_reward(completion: str, solution: dict) -> float:
    """1.0: the last <answer> names everyone exactly once as 'Name: knight|knave' with the right roles (any case;
    entries may be split by , ; or whitespace incl. newlines); 0.1: an answer that is wrong or malformed; 0.0: none."""
    ans = _last_answer(completion)
    if ans is None:
        return 0.0
    ans = ans.lower()
    if len(ans) > 1000 or not re.fullmatch(f"(?:{_ENTRY})*[\\s,;]*", ans):
        return 0.1
    got = re.findall(_ENTRY, ans)
    if len({name for name, _ in got}) < len(got):  # someone named twice
        return 0.1
    return 1.0 if {name: role == "knight" for name, role in got} == {k.lower(): v for k, v in solution.items()} else 0.1

# -- prompts (the caller prefills "Let me solve this step by step.\n<think>") --
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

# -- loaders: data = "gen" | "easy" | "hf" | "hf:test" | path.jsonl --
def _gsm8k_row(question: str, solution) -> dict:
    """GSM8K answers are 'steps with <<calc>> notes ... #### 1,450': keep the clean steps and the bare number."""
    body, _, gold = str(solution).rpartition("####")
    steps = [re.sub(r"<<[^<>]*>>", "", ln).strip() for ln in body.splitlines() if ln.strip()]
    return {"question": question, "answer": gold.strip().replace(",", ""), "steps": steps}

def _list_of(t: type):
    return lambda v: isinstance(v, list) and all(type(x) is t for x in v)

_SCHEMA = {  # task -> key -> (what the value must be, its test)
    "countdown": {"nums": ("a list of integers", _list_of(int)), "target": ("an integer", lambda v: type(v) is int)},
    "math": {"question": ("a string", lambda v: isinstance(v, str)),
             "answer": ("a number or a GSM8K solution ending in '#### N'", lambda v: type(v) in (str, int, float)
                        and parse_number(_gsm8k_row("", v)["answer"]) is not None)},
    "logic": {"names": ("a list of strings", _list_of(str)), "statements": ("a list of strings", _list_of(str)),
              "solution": ("an object {name: true/false}", lambda v: isinstance(v, dict)
                           and all(type(x) is bool for x in v.values()))},
}

def _read_jsonl(path: str, task: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e}); --data takes gen, easy, hf or a "
                         ".jsonl path") from None
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
            if key not in row or not ok(row[key]):
                why = f'"{key}" must be {what}' if key in row else f'missing key "{key}"'
                raise ValueError(f"{path} line {i}: {why}")
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
    """The CPU demo's variant: 3 numbers in 1..9, in order, joined by + or - with each of the four sign patterns
    equally likely (numbers redrawn until the target is >= 0). A fixed guess of the signs is right about 1 time in 4."""
    signs = rng.choice(["++", "+-", "-+", "--"])
    while True:
        nums = [rng.randint(1, 9) for _ in range(3)]
        target, expr = _sign_chain(nums, signs)
        if target >= 0:
            return {"nums": nums, "target": target, "expr": expr}

_GEN = {  # "easy": the smallest variant (countdown: 3 numbers in 1..9, + and -; math: 1 step; logic: 2 people)
    "countdown": lambda r, easy: _easy_countdown(r) if easy else countdown_problem(r),
    "math": lambda r, easy: math_easy_problem(r) if easy else math_problem(r, (2, 4)),
    "logic": lambda r, easy: logic_problem(r, (2, 2) if easy else (2, 6)),
}
TASKS = {
    "countdown": {"load": functools.partial(load_rows, "countdown"), "prompt": countdown_prompt,
                  "reward": lambda c, row: countdown_reward(c, row["nums"], row["target"])},
    "math": {"load": functools.partial(load_rows, "math"), "prompt": math_prompt,
             "reward": lambda c, row: math_reward(c, row["answer"])},
    "logic": {"load": functools.partial(load_rows, "logic"), "prompt": logic_prompt,
              "reward": lambda c, row: logic_reward(c, row["solution"])},
}

def get_task(name: str) -> dict:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]

def split_rows(cfg: Config) -> tuple:
    """(draw, held-out rows): the FIRST eval_size rows of the data are held out. draw(n, *key) -> n training rows
    from random.Random(str((seed,) + key)), never a held-out prompt, drawn when a step needs them."""
    task, gen = get_task(cfg.task), cfg.data in ("gen", "easy")
    rows = task["load"](cfg.data, cfg.eval_size if gen else 0, cfg.seed)
    held = rows[:cfg.eval_size]
    seen = {task["prompt"](r) for r in held}
    pool = [] if gen else [r for r in rows[cfg.eval_size:] if task["prompt"](r) not in seen]
    if not gen and not pool:
        raise ValueError(f"--data {cfg.data}: no training rows left after the {len(held)} held-out ones "
                         f"({len(rows)} rows, --eval-size {cfg.eval_size})")

    def draw(n: int, *key) -> list:
        rng = random.Random(str((cfg.seed,) + key))
        if not gen:  # distinct rows while the pool lasts
            return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
        tries = (_GEN[cfg.task](rng, cfg.data == "easy") for _ in range(1000 * n))  # lazy: stops at the n-th new row
        out = list(itertools.islice((r for r in tries if task["prompt"](r) not in seen), n))
        if len(out) < n:
            raise ValueError(f"--data {cfg.data}: almost every generated problem is a held-out one; lower --eval-size")
        return out
    return draw, held

# ==== Model and tokenizer [plumbing]: Qwen checkpoints, or a tiny Qwen2 built offline =============================
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def build_tiny(hidden: int = 64, layers: int = 2, seed: int = 0):
    """A random-init Qwen2ForCausalLM and a byte-level Qwen2Tokenizer (256 bytes + 3 specials, no merges): the class
    a qwen2 folder reloads with, so ids survive a round trip. eos is <|im_end|> (instruct-style), pad <|endoftext|>."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()) + specials)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                         additional_special_tokens=["<|im_start|>"], chat_template=TINY_CHAT_TEMPLATE,
                         padding_side="left")
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=None,
                      vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg), tok

def resolve_model_name(name: str) -> str:
    """'Qwen2.5-0.5B' -> 'Qwen/Qwen2.5-0.5B'; hub ids and local folders pass through."""
    return name if os.path.isdir(name) or "/" in name or not name.lower().startswith("qwen") else "Qwen/" + name

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
        except Exception as e:  # a missing or misspelled name, no hub, a damaged folder (weights, config)
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            why = "no hub access (HF_HUB_OFFLINE=1)" if offline else "no hub access, a misspelled name or bad files"
            raise OSError(f"cannot load model '{path}': {why}: {str(e).splitlines()[0][:200]}; "
                          f"try --model tiny for an offline run") from None
    tok.padding_side = "left"  # generate() appends to the right end of every row
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok

def end_token_ids(tok) -> list:
    """The ids that end an answer: the tokenizer's eos plus Qwen's <|im_end|> and <|endoftext|> when present."""
    qwen = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = {tok.eos_token_id} | {i for i in qwen if isinstance(i, int) and i != tok.unk_token_id}
    return sorted(i for i in ids if i is not None)

# ==== Rollouts [paper: sampling]: G answers per prompt from the full softmax at temperature T =====================
ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"  # TinyZero's prefill: the answer starts inside <think>
SYSTEM_PROMPT = "You are a helpful assistant. You first think about the reasoning process and then answer."

def use_chat(tok, chat: str = "auto") -> bool:
    """Chat template for instruct models, plain text for base models. Qwen ships a template with both, but only
    instruct tokenizers end a turn with eos = <|im_end|>, so auto = a template and that eos. yes/no force it."""
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
    """(resp_mask (N, T) bool, truncated (N,)). Valid response positions, by POSITION: up to and including the first
    end token. Never by comparing with the pad id: Qwen's pad (<|endoftext|>) is also an end token, so a value test
    would drop the end token itself from the loss (the tiny-grpo bug)."""
    T = completion_ids.shape[1]
    is_end = torch.isin(completion_ids, torch.tensor(end_ids, device=completion_ids.device))  # (N, T)
    has_end = is_end.any(dim=1)  # (N,)
    first_end = torch.where(has_end, is_end.int().argmax(dim=1), torch.full_like(has_end, T - 1, dtype=torch.long))
    resp_mask = torch.arange(T, device=completion_ids.device)[None, :] <= first_end[:, None]  # (N, T)
    return resp_mask, ~has_end
@torch.no_grad()
def rollout(model, tok, prompts: list, group_size: int, max_new_tokens: int, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, greedy: bool = False, fast: bool = False,
            sampler_logp: bool = False) -> dict:
    """Sample group_size answers per prompt string -> dict(prompt_ids, prompt_mask, comp_ids, resp_mask, truncated,
    texts) on the model's device. generate() would fill every knob left unset from the checkpoint's generation_config
    (Qwen instruct: top_k 20, top_p 0.8, repetition_penalty 1.1, ...), sampling from another distribution than the
    policy we train, so it sees a complete config of our own and a blank model default. fast: a static KV cache
    (length rounded up to 64: few shapes; generate compiles its step on CUDA). sampler_logp: also `sampler_logp`
    (N, T), the sampler's log_softmax(logits / T) at each drawn token (before top-k/p, as the learner's; 0 after
    the end)."""
    from transformers import GenerationConfig
    device = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    ids, attn = (enc[k].repeat_interleave(group_size, dim=0) for k in ("input_ids", "attention_mask"))  # (N, P)
    width, limit = ids.shape[1] + max_new_tokens, getattr(model.config, "max_position_embeddings", None)
    if limit and width > limit:
        raise ValueError(f"--max-new-tokens {max_new_tokens} + a {ids.shape[1]}-token prompt exceed the model's "
                         f"{limit} positions")
    knobs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if fast:
        knobs.update(cache_implementation="static", max_cache_len=-(-width // 64) * 64)
    end_ids = end_token_ids(tok)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=end_ids, pad_token_id=tok.pad_token_id, **knobs)
    seen, last = [], []  # generate calls record() before each draw, with the ids drawn so far

    def record(drawn, logits):  # the previous draw's log-prob, read at the token it drew; keep this step's
        seen.extend(p.gather(1, drawn[:, -1:]) for p in last)
        last[:] = [torch.log_softmax(logits.float() / temperature, dim=-1)]
        return logits
    was_training, saved = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()  # the checkpoint's sampling knobs never reach this call
    try:
        with autocast(device):
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen,
                                 logits_processor=[record] if sampler_logp else None)  # (N, P + T)
    finally:
        model.generation_config = saved
        model.train(was_training)
    comp = out[:, ids.shape[1]:]  # (N, T), T >= 1: generate makes at least one token
    resp_mask, truncated = completion_mask(comp, end_ids)
    batch = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=resp_mask, truncated=truncated,
                 texts=tok.batch_decode(comp.masked_fill(~resp_mask, tok.pad_token_id), skip_special_tokens=True))
    if sampler_logp:  # the last draw is read here (unless generate ran steps past the end and cut them)
        seen.extend(p.gather(1, comp[:, -1:]) for p in last[:comp.shape[1] - len(seen)])
        batch["sampler_logp"] = torch.cat(seen[:comp.shape[1]], dim=1).masked_fill(~resp_mask, 0.0)  # (N, T)
    return batch

# ==== Group advantages [paper: GRPO] and dynamic sampling [DAPO] ==================================================
def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of G consecutive answers; (N,) -> (N,).
    The POPULATION std (divide by G: the group is all we compare against) gives the clean binary-reward values
    A = +sqrt((G-k)/k), -sqrt(k/(G-k)) for k of G correct (TRL's unbiased std scales them by sqrt((G-1)/G)).
    A group whose rewards are all equal gets exactly 0 (not 1e-17, never NaN). std_normalize=False: Dr. GRPO's r - mean.
    """
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    same = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)  # (B, 1)
    return adv.masked_fill(same, 0.0).view(-1)  # (N,)

def informative(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the groups whose rewards are not all equal (A != 0 somewhere, so they carry a gradient)."""
    r = rewards.view(-1, group_size)  # (B, G)
    return r.max(dim=1).values != r.min(dim=1).values

def keep_groups(parts: list, group_size: int, B: int, pad_id: int) -> tuple:
    """--filter-groups: join one step's rollout batches [(batch, rewards, adv), ...] and keep the first B informative
    groups -> (batch, rewards, adv). Every per-answer entry is carried: lists are indexed, (N, W) tensors padded to
    one width (prompt_* on the left, the rest on the right; *_ids with pad_id, others with 0). With no informative
    group the first batch is returned as it is (all A = 0)."""
    batches, rewards, advs = zip(*parts)
    keep = torch.cat([informative(r, group_size) for r in rewards]).nonzero().squeeze(1)[:B]  # (<= B,)
    if keep.numel() == 0:
        return parts[0]
    idx = (keep[:, None] * group_size + torch.arange(group_size)).view(-1)  # the answers of the kept groups

    def pick(xs: list, key: str = ""):  # the parts' entries joined, rows idx kept
        if isinstance(xs[0], list):
            flat = [x for part in xs for x in part]
            return [flat[i] for i in idx.tolist()]
        if xs[0].dim() == 2:
            w, fill = max(x.shape[1] for x in xs), pad_id if key.endswith("_ids") else 0
            xs = [F.pad(x, (w - x.shape[1], 0) if key.startswith("prompt") else (0, w - x.shape[1]), value=fill)
                  for x in xs]
        x = torch.cat(xs)
        return x[idx.to(x.device)]
    return {key: pick([b[key] for b in batches], key) for key in batches[0]}, pick(rewards), pick(advs)

# ==== Token statistics [paper: the gradient of the loss w.r.t. the logits; the derivation] ========================
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
# 4. How it relates to entropy WITHIN an answer (omega is the same for every token of answer i when r = 1):
#    pointwise (1 - p_y)^2 <= ||onehot(y) - p||^2 <= 2 (1 - p_y)^2, so the norm is set by p_y, not by H. Over
#    y ~ p, E||onehot(y) - p||^2 = 1 - sum_j p_j^2 <= 1 - exp(-H) (Shannon entropy >= Renyi-2 entropy): IN
#    EXPECTATION a near-certain position (H ~ 0) has a near-zero logit gradient. Not pointwise: at
#    p = (0.999, 50 x 2e-5) a sampled rare token has H = 0.012 nats but norm 1.414. Entropy misses such tokens;
#    gradnorm (below) scores them by their exact norm.
# 5. Why |A| matters ACROSS answers: the factor |omega| = |r * A| differs between answers. With binary rewards and
#    k of G answers correct, A = +sqrt((G-k)/k) for the correct and -sqrt(k/(G-k)) for the wrong ones
#    (G = 8, k = 1: +2.65 vs -0.38), and A = 0 for a group whose answers all got the same reward. Entropy ranking
#    ignores this factor: it spends budget on tokens whose gradient is small or exactly 0.
# 6. GMTS scores a token by |H_t * omega_t| (entropy standing in for the per-token norm of step 3), and keeps the
#    top rho of the batch. 'gradnorm' uses the exact logit-gradient norm |omega| * grad_norm instead (our
#    ablation; it costs the same vocabulary reduction as H).
# Where the paper is silent this code: uses the rollout temperature T for p, H and log p; selects over the whole
# batch; recomputes omega (with the current ratio and clip) before every inner update; computes all of it in fp32.

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

def response_hidden(model, batch: dict, rows=slice(None)) -> torch.Tensor:
    """Final hidden states that PREDICT each response token (position P-1+t predicts token t) -> (n, T, d). Position
    ids come from the attention mask (cumsum - 1), as generate() computes them under left padding."""
    ids = torch.cat([batch["prompt_ids"][rows], batch["comp_ids"][rows]], dim=1)  # (n, P + T)
    attn = torch.cat([batch["prompt_mask"][rows], batch["resp_mask"][rows]], dim=1).long()  # (n, P + T)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (n, P + T)
    with autocast(ids.device):
        h = model.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state  # (n, P+T, d)
    P, T = batch["prompt_ids"].shape[1], batch["comp_ids"].shape[1]
    return h[:, P - 1:P + T - 1]  # (n, T, d)

@torch.no_grad()
def batch_token_stats(model, batch: dict, temperature: float, micro_batch: int, chunk: int) -> tuple:
    """(logp, entropy, grad_norm), each (N, T) fp32, 0 at invalid positions: one no-grad forward in micro-batches,
    the lm_head applied to `chunk` valid tokens at a time (~3 (chunk, V) fp32 buffers, whatever N * T is)."""
    head = model.get_output_embeddings()
    mask, comp = batch["resp_mask"], batch["comp_ids"]
    out = [torch.zeros(mask.shape, device=mask.device) for _ in range(3)]  # 3 x (N, T)
    for s in range(0, mask.shape[0], micro_batch):
        rows, m = slice(s, s + micro_batch), mask[s:s + micro_batch]  # m (n, T)
        h, y = response_hidden(model, batch, rows)[m], comp[rows][m]  # (M, d), (M,)
        stats = [token_stats(F.linear(hc, head.weight, head.bias), yc, temperature)
                 for hc, yc in zip(h.split(chunk), y.split(chunk))]
        for o, v in zip(out, zip(*stats)):
            o[rows][m] = torch.cat(v)
    return tuple(out)

def head_logp(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float = 1.0,
              chunk: int = 1024) -> torch.Tensor:
    """log p_y WITH autograd, chunked: each chunk's (C, V) logits are recomputed in backward (activation
    checkpointing), so the head's memory is bounded by the chunk, not by the number of tokens. (M, d) -> (M,)."""
    from torch.utils.checkpoint import checkpoint
    def logp(h, y):
        z = F.linear(h, head.weight, head.bias).float() / temperature  # (C, V)
        return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)  # (C,)
    parts = [checkpoint(logp, h, y, use_reentrant=False) for h, y in zip(hidden.split(chunk), tokens.split(chunk))]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

# ==== Scores and top-rho selection [paper: GMTS's score |H * omega|; 80/20's entropy score] =======================
def clip_active(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Where the PPO clip zeroes the gradient (derivation step 1); adv and ratio broadcast to one shape."""
    return ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))

def omega(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """ratio * A where the PPO clip leaves the gradient alive, 0 where it is active (step 1). (N,), (N, T) -> (N, T)"""
    a = adv[:, None]  # (N, 1)
    return torch.where(clip_active(a, ratio, clip_low, clip_high), torch.zeros_like(ratio), ratio * a)

def token_scores(method: str, entropy: torch.Tensor, grad_norm: torch.Tensor, om: torch.Tensor,
                 generator: torch.Generator = None) -> torch.Tensor:
    """The ranking score of each token; higher is kept first. All inputs (N, T) -> (N, T)."""
    scores = {"all": lambda: torch.ones_like(entropy),  # vanilla GRPO (train keeps every token, rho = 1)
              "random": lambda: torch.rand(entropy.shape, generator=generator).to(entropy.device),  # the control
              "entropy": lambda: entropy,  # H_t (80/20 paper)
              "gmts": lambda: (entropy * om).abs(),  # |H_t * omega_t| (GMTS)
              "gradnorm": lambda: om.abs() * grad_norm}  # the exact logit-gradient norm (derivation step 3)
    if method not in scores:
        raise ValueError(f"unknown selection method {method!r}; choose one of: {', '.join(CHOICES['select'])}")
    return scores[method]()

def select_tokens(scores: torch.Tensor, mask: torch.Tensor, rho: float, nonzero: bool = False) -> torch.Tensor:
    """The k = ceil(rho * mask.sum()) valid tokens with the highest scores over the WHOLE batch: (N, T) -> (N, T) bool.
    Ties go to the earlier position, masked-out tokens are never kept, NaN ranks lowest. A k-th-value threshold plus a
    count over the tied values: O(n), exact, and unlike torch.quantile fine above 2^24 elements. nonzero=True (gmts,
    gradnorm) then drops kept tokens whose score is 0 (their gradient is exactly 0), so they may keep fewer than k."""
    flat_mask = mask.reshape(-1)  # (N*T,)
    n = int(flat_mask.sum())
    k = min(n, math.ceil(rho * n - 1e-9))  # the 1e-9 keeps 0.2 * 10 from rounding up to 3
    sel = torch.zeros_like(flat_mask)
    if k == 0:
        return sel.view_as(mask)
    vals = torch.nan_to_num(scores.reshape(-1)[flat_mask].float(), nan=-math.inf)  # (n,)
    thr = torch.kthvalue(vals, n - k + 1).values  # the k-th largest value
    keep, ties = vals > thr, vals == thr
    keep |= ties & (ties.cumsum(0) <= k - int(keep.sum()))
    if nonzero:
        keep &= vals > 0
    sel[flat_mask] = keep
    return sel.view_as(mask)

# ==== Loss and update [paper: GRPO / DAPO objective restricted to the kept tokens] ================================
def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                    clip_high: float) -> tuple:
    """Per-token PPO-clip loss l = -min(r * A, clip(r, 1 - eps_l, 1 + eps_h) * A), r = exp(logp - old_logp):
    (M,) inputs -> (loss (M,), clip active (M,) bool). On-policy (old_logp = logp.detach()) r == 1: REINFORCE."""
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    return loss, clip_active(adv, ratio.detach(), clip_low, clip_high)

def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman, "Approximating KL divergence"):
    exp(ref - logp) - (ref - logp) - 1, >= 0, exactly 0 where the two agree, and E_{y ~ pi_theta}[k3] = KL. (M,)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1

def loss_backward(model, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor, old_logp: torch.Tensor,
                  denom: float, *, temperature: float, clip_low: float, clip_high: float, micro_batch: int,
                  chunk: int, kl_beta: float = 0.0, ref_logp: torch.Tensor = None) -> dict:
    """Accumulate into .grad the gradient of  sum_{kept} l_t / denom  (+ kl_beta * mean k3 over ALL valid tokens).
    Only the needed positions go through the lm_head (the others have zero gradient: leaving them out is exact).
    Returns loss, clip_frac, kl and `live`, the kept tokens with a non-zero gradient (policy_update's step rule)."""
    head, valid = model.get_output_embeddings(), batch["resp_mask"]
    need = (sel_mask | valid) if kl_beta > 0 else sel_mask  # (N, T) positions whose log-prob we need
    n_valid = max(int(valid.sum()), 1)
    loss_sum, clipped, live, kl_sum = 0.0, 0, 0, 0.0
    active = need.any(dim=1).nonzero().squeeze(1)  # answers that enter the forward
    for rows in active.split(micro_batch) if active.numel() else []:
        m = need[rows]  # (n, T)
        logp = head_logp(response_hidden(model, batch, rows)[m], head, batch["comp_ids"][rows][m], temperature, chunk)
        a = adv[rows][:, None].expand_as(m)[m]  # (M,)
        pg, clip_m = grpo_token_loss(logp, old_logp[rows][m], a, clip_low, clip_high)  # (M,) each
        s = sel_mask[rows][m]  # (M,) bool
        loss = (pg * s).sum() / denom
        if kl_beta > 0:
            kl = k3_kl(logp, ref_logp[rows][m])
            loss = loss + kl_beta * kl.sum() / n_valid  # the KL's normaliser does not depend on the selection
            kl_sum += float(kl.detach().sum())
        loss.backward()
        loss_sum += float(loss.detach())
        clipped += int((clip_m & s).sum())
        live += int((s & ~clip_m & (a != 0)).sum()) + (int(m.sum()) if kl_beta > 0 else 0)
    return dict(loss=loss_sum, clip_frac=clipped / max(int(sel_mask.sum()), 1), kl=kl_sum / n_valid, live=live)

def policy_update(model, opt, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor, old_logp: torch.Tensor,
                  denom: float, *, max_grad_norm: float, **kw) -> dict:
    """One optimiser step on the kept tokens (loss_backward's arguments in kw). The step rule, the same for every
    method: step iff some kept token has a non-zero gradient (A = 0 everywhere moves neither the weights nor the Adam
    moments) and the gradient is finite."""
    opt.zero_grad(set_to_none=True)
    stats = loss_backward(model, batch, adv, sel_mask, old_logp, denom, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if stats["live"] else 0.0
    stats.update(grad_norm=norm, skipped=int(not (math.isfinite(norm) and math.isfinite(stats["loss"]))))
    stats["stepped"] = int(stats["live"] > 0 and not stats["skipped"])
    if stats["stepped"]:
        opt.step()
    opt.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights or the Adam moments
    return stats

# ==== Evaluation, run folder, checkpoints, metrics [plumbing] =====================================================
@torch.no_grad()
def evaluate(model, tok, task: dict, rows: list, chat: bool, short: bool, max_new_tokens: int,
             batch_size: int = 64) -> dict:
    """Greedy held-out accuracy (share of answers with reward 1.0), mean answer length and one sample answer."""
    correct, length, sample = 0, 0, ""
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        b = rollout(model, tok, build_prompts(tok, task, chunk, chat, short), 1, max_new_tokens, greedy=True)
        correct += sum(task["reward"](t, r) == 1.0 for t, r in zip(b["texts"], chunk))
        length += int(b["resp_mask"].sum())
        sample = sample or b["texts"][0]
    n = max(len(rows), 1)
    return dict(eval_acc=correct / n, eval_len=length / n, eval_sample=sample[:200])

def run_files(out: str) -> list:
    """What in `out` belongs to a run: its metrics, config and checkpoints."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted(n for n in names if n in ("metrics.jsonl", "run_config.json") or n.startswith("ckpt-"))

def read_run_config(out: str) -> dict:
    """The saved config of the run in `out` (--resume), or ValueError with one line."""
    try:
        with open(os.path.join(out, "run_config.json")) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--resume {out}: no run_config.json there (not a run folder, or its run never started)")
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {out}: run_config.json is unreadable ({type(e).__name__})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--resume {out}: run_config.json is not a JSON object")
    return saved

def log_metrics(path: str, rec: dict):
    """Append one JSON line with a single write() on an O_APPEND file: a kill leaves whole lines or none."""
    with open(path, "ab", buffering=0) as f:  # unbuffered: the line is one write() call
        f.write((json.dumps(rec) + "\n").encode())

def read_metrics(out: str, last_step: float = math.inf) -> list:
    """The whole JSON lines of OUT/metrics.jsonl with step <= last_step (a torn last line is skipped)."""
    recs = []
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                try:
                    rec = json.loads(line) if line.endswith("\n") else None
                except ValueError:
                    rec = None
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
                    recs.append(rec)
    return recs

def checkpoints(out: str) -> list:
    """The complete checkpoint folders in out, oldest first (a folder is renamed into place only when complete)."""
    return sorted(d for d in glob.glob(os.path.join(out, "ckpt-*")) if re.fullmatch(r"ckpt-\d+", os.path.basename(d)))

def save_checkpoint(out: str, step: int, model, tok, opt, skipped: int, keep: int = 2):
    """OUT/ckpt-<step>: model, tokenizer and state.pt (step, optimiser: loads with weights_only=True; no RNG state,
    every step reseeds). Written to a .tmp folder and renamed; then all but the newest `keep` go, each renamed first
    so that a half-deleted folder never looks like a checkpoint."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save(dict(step=step, skipped=skipped, opt=opt.state_dict()), os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(out)[:-keep]:
        os.replace(old, old + ".old")
        shutil.rmtree(old + ".old", ignore_errors=True)

def load_checkpoint(out: str, device: torch.device, log=print) -> tuple:
    """(model, tok, state) from the newest checkpoint that loads; a damaged one is reported in one line and the
    previous one tried. Nothing is unpickled: state.pt is read with weights_only=True. OSError if none loads."""
    for ck in reversed(checkpoints(out)):
        try:
            model, tok = load_model(ck, device)
            state = torch.load(os.path.join(ck, "state.pt"), map_location="cpu", weights_only=True)
            if not (isinstance(state, dict) and isinstance(state.get("step"), int) and "opt" in state):
                raise ValueError("state.pt holds no step and optimiser")
            log(f"resuming from {ck}")
            return model, tok, state
        except Exception as e:  # truncated, empty or foreign files: fall back to the previous checkpoint
            log(f"{ck} does not load ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                "trying the previous checkpoint")
    raise OSError(f"--resume {out}: no loadable checkpoint (ckpt-*) in that folder")

def save_final(out: str, model, tok):
    """save_pretrained into OUT itself (AutoModelForCausalLM.from_pretrained(OUT) loads it): written to a temporary
    folder, then each file moved in with an atomic rename, config.json last so a reader never sees a torn model."""
    tmp = os.path.join(out, "final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for n in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)

def plot_metrics(out: str):
    """OUT/metrics.png: held-out accuracy and batch reward vs step."""
    from matplotlib.figure import Figure  # no pyplot: an importing notebook keeps its own backend
    recs = read_metrics(out)
    fig = Figure(figsize=(10, 3.6))
    for ax, key in zip(fig.subplots(1, 2), ("eval_acc", "reward_mean")):
        ax.plot(*zip(*[(r["step"], r[key]) for r in recs if key in r]), marker=".")
        ax.set(xlabel="step", ylabel=key)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "metrics.png"), dpi=90)

# ==== Training loop [paper: the algorithm box; the numbered comments are the module docstring's steps] ============
def lr_factor(i: int, total: int, warmup: int, decay: bool = True) -> float:
    """lr multiplier at optimiser step i (0-based) of `total`: linear warm-up over `warmup` steps, then (decay) a
    linear decay that reaches 1 / (total - warmup) at the last step (TRL's default schedule is also linear)."""
    up = (i + 1) / max(warmup, 1)
    return min(1.0, up, max(total - i, 1) / max(total - warmup, 1)) if decay else min(1.0, up)

def start_run(cfg: Config, log=print) -> dict:
    """Everything before the loop: data, model, optimiser, the KL reference, the sampler (--sampler-dtype: the model
    or a bf16 copy) and the run folder. --resume loads the newest loadable checkpoint and drops the metrics after it;
    a new run logs the starting model's held-out accuracy as step 0 and saves ckpt-000000. run_config.json is
    written only once model and data have loaded."""
    device = pick_device(cfg.device)
    set_seed(cfg.seed)
    draw, eval_rows = split_rows(cfg)
    load = functools.partial(load_model, cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    if cfg.resume:
        if os.path.abspath(cfg.resume) != os.path.abspath(cfg.out):
            raise ValueError(f"--resume {cfg.resume} continues the run in that folder; --out {cfg.out} is another")
        model, tok, state = load_checkpoint(cfg.out, device, log)
        if state["step"] > cfg.steps:
            raise ValueError(f"--steps {cfg.steps} is below the run's last completed step {state['step']}")
    else:
        if run_files(cfg.out) and not cfg.overwrite:
            raise ValueError(f"--out {cfg.out} holds a run; continue it with --resume {cfg.out}, or pass --overwrite")
        model, tok = load()
        state = dict(step=0, skipped=0)
        for n in run_files(cfg.out):  # the old run's files go only now that the new model has loaded
            shutil.rmtree(os.path.join(cfg.out, n)) if n.startswith("ckpt-") else os.remove(os.path.join(cfg.out, n))
    ref = load()[0].eval().requires_grad_(False) if cfg.kl_beta > 0 else None  # pi_ref: where RL starts (deviation 7)
    if cfg.grad_ckpt:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if "opt" in state:
        opt.load_state_dict(state["opt"])
    chat, limit = use_chat(tok, cfg.chat_template), getattr(model.config, "max_position_embeddings", math.inf)
    prompts = build_prompts(tok, get_task(cfg.task), eval_rows, chat, cfg.short_prompt)  # held out: a sample of them
    longest = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    if longest + cfg.max_new_tokens > limit:
        raise ValueError(f"--max-new-tokens {cfg.max_new_tokens} + a {longest}-token prompt exceed the model's {limit} "
                         "positions")
    os.makedirs(cfg.out, exist_ok=True)
    kept = "".join(json.dumps(r) + "\n" for r in read_metrics(cfg.out, state["step"]))
    with open(os.path.join(cfg.out, "metrics.jsonl.tmp"), "w") as f:
        f.write(kept)  # resume: the steps after the checkpoint will rerun
    os.replace(os.path.join(cfg.out, "metrics.jsonl.tmp"), os.path.join(cfg.out, "metrics.jsonl"))
    with open(os.path.join(cfg.out, "run_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    log(f"device {device} | model {resolve_model_name(cfg.model)} ({sum(p.numel() for p in model.parameters()):,} "
        f"params) | chat template {chat} | {len(eval_rows)} held-out rows | {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} answers per step" + (f" | resumed at step {state['step'] + 1}" if cfg.resume else ""))
    run = dict(model=model, tok=tok, task=get_task(cfg.task), draw=draw, eval_rows=eval_rows, chat=chat, opt=opt,
               ref=ref, start=state["step"] + 1, skipped=state["skipped"], sampler=model,
               fast=device.type == "cuda" if cfg.fast_generate is None else cfg.fast_generate)
    if not cfg.resume:
        rec = dict(step=0, **evaluate(model, tok, run["task"], eval_rows, chat, cfg.short_prompt, cfg.max_new_tokens))
        log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
        log(f"step 0 | eval_acc {rec['eval_acc']:.3f} | sample: {rec['eval_sample'][:80]!r}")
        save_checkpoint(cfg.out, 0, model, tok, opt, 0)
    if cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda"):
        run["sampler"] = copy.deepcopy(model).eval().requires_grad_(False)  # generate reads a bf16 copy
        for p in run["sampler"].parameters():  # parameters only: RoPE's inv_freq stays fp32, as from_pretrained(bf16)
            p.data = p.data.to(torch.bfloat16)
    return run

@torch.no_grad()
def refresh_sampler(sampler, model):
    """The bf16 sampler follows the fp32 master weights, in place (no reallocation)."""
    if sampler is not model:
        torch._foreach_copy_(list(sampler.parameters()), list(model.parameters()))

def step_record(step: int, G: int, parts: list, rewards, adv, mask, entropy, sel_mask, stats: dict, **extra) -> dict:
    """One line of metrics.jsonl (the README's glossary explains each key)."""
    n_valid, n_sel = max(int(mask.sum()), 1), max(int(sel_mask.sum()), 1)
    sampled = torch.cat([informative(r, G) for _, r, _ in parts])  # every group sampled this step
    return dict(step=step, reward_mean=rewards.mean().item(), acc=(rewards == 1.0).float().mean().item(),
                selected_frac=int(sel_mask.sum()) / n_valid, entropy_mean=float((entropy * mask).sum()) / n_valid,
                entropy_selected_mean=float((entropy * sel_mask).sum()) / n_sel,
                zero_adv_selected_frac=float((sel_mask & (adv == 0)[:, None]).sum()) / n_sel,
                grad_norm=stats["grad_norm"], loss=stats["loss"], clip_frac=stats["clip_frac"], kl=stats["kl"],
                completion_len=n_valid / mask.shape[0], rollout_batches=len(parts),
                groups_filtered_frac=1.0 - sampled.float().mean().item(), **extra)

def train(cfg: Config, log=print, score_fn=None) -> str:
    """GRPO with token selection, steps 1-8 of the module docstring. Returns the output folder (metrics.jsonl,
    metrics.png, checkpoints, the final model). score_fn(logp, entropy, grad_norm, om) -> (N, T) scores, if given,
    replaces token_scores(cfg.select, ...): the notebook trains its own score through it."""
    run = start_run(cfg, log)  # data, model, optimiser, KL reference; --resume: the newest loadable checkpoint
    model, tok, task, opt, chat = (run[k] for k in ("model", "tok", "task", "opt", "chat"))
    B, G, mb, chunk = cfg.prompts_per_step, cfg.group_size, cfg.micro_batch, cfg.stats_chunk
    rho = 1.0 if cfg.select == "all" and score_fn is None else cfg.rho
    nonzero = score_fn is None and cfg.select in ("gmts", "gradnorm")  # never keep a zero score (deviation 9)
    score = score_fn or (lambda logp, *stats: token_scores(cfg.select, *stats))  # (logp, H, grad_norm, omega)
    model.train()
    for step in range(run["start"], cfg.steps + 1):
        t0 = time.time()
        set_seed(cfg.seed * 1_000_003 + step)  # every step's randomness is a function of (seed, step): resumable
        parts = []  # --filter-groups (deviation 5): more prompts until B groups have unequal rewards
        while len(parts) < (cfg.max_resample if cfg.filter_groups else 1):
            rows = run["draw"](B, step, len(parts))  # 1. B training prompts
            prompts = build_prompts(tok, task, rows, chat, cfg.short_prompt)
            batch = rollout(run["sampler"], tok, prompts, G, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k,
                            fast=run["fast"], sampler_logp=True)  # 2.
            rewards = torch.tensor([task["reward"](t, rows[n // G]) for n, t in enumerate(batch["texts"])])  # 3. (N,)
            adv = group_advantages(rewards, G, cfg.std_normalize).to(batch["comp_ids"].device)  # 4. (N,)
            parts.append((batch, rewards, adv))
            if sum(int(informative(r, G).sum()) for _, r, _ in parts) >= B:
                break
        batch, rewards, adv = keep_groups(parts, G, B, tok.pad_token_id) if cfg.filter_groups else parts[0]
        mask, t_roll = batch["resp_mask"], time.time() - t0  # (N, T)
        for inner in range(cfg.inner_updates):
            # 5. token statistics of the current policy: log pi(y_t), H_t, the logit-gradient norm, each (N, T)
            logp, entropy, grad_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
            if inner == 0:  # pi_old: the policy that sampled the batch
                old_logp, gap = logp, (batch["sampler_logp"] - logp).abs()[mask]  # sampler vs learner precision
                ref_logp = batch_token_stats(run["ref"], batch, cfg.temperature, mb, chunk)[0] if run["ref"] else None
            # 6. scores, and the top rho of the WHOLE batch (deviation 1)
            om = omega(adv, torch.exp(logp - old_logp), cfg.clip_low, cfg.clip_high)  # (N, T)
            sel_mask = select_tokens(score(logp, entropy, grad_norm, om), mask, rho, nonzero)  # (N, T) bool
            # 7. PPO-clip update on the kept tokens; the lr follows GRPO steps, the step rule is the same for all
            i = (step - 1) * cfg.inner_updates + inner
            for g in opt.param_groups:
                g["lr"] = cfg.lr * lr_factor(i, cfg.steps * cfg.inner_updates, cfg.warmup_steps, cfg.lr_decay)
            denom = float(mask.sum()) if cfg.loss_norm == "all" else max(float(sel_mask.sum()), 1.0)
            stats = policy_update(model, opt, batch, adv, sel_mask, old_logp, denom, max_grad_norm=cfg.max_grad_norm,
                                  temperature=cfg.temperature, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                  micro_batch=mb, chunk=chunk, kl_beta=cfg.kl_beta, ref_logp=ref_logp)
            run["skipped"] += stats["skipped"]
        refresh_sampler(run["sampler"], model)
        # 8. log, evaluate, checkpoint
        dt = time.time() - t0
        rec = step_record(step, G, parts, rewards, adv, mask, entropy, sel_mask, stats, lr=opt.param_groups[0]["lr"],
                          skipped_steps=run["skipped"], truncated_frac=batch["truncated"].float().mean().item(),
                          rollout_time_s=t_roll, step_time_s=dt, tokens_per_s=float(mask.sum()) / dt,
                          sampler_logp_gap=gap.mean().item(), sampler_logp_gap_max=gap.max().item())
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps:
            rec.update(evaluate(model, tok, task, run["eval_rows"], chat, cfg.short_prompt, cfg.max_new_tokens))
        log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
        shown = ("reward_mean", "acc", "selected_frac", "groups_filtered_frac", "entropy_mean", "grad_norm", "eval_acc")
        log(f"step {step} | " + " | ".join(f"{k} {rec[k]:.3f}" for k in shown if k in rec) + f" | {dt:.2f} s")
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.steps:
            save_checkpoint(cfg.out, step, model, tok, opt, run["skipped"])
    save_final(cfg.out, model, tok)
    plot_metrics(cfg.out)
    log(f"done: {cfg.out} (metrics.jsonl, metrics.png, the model)")
    return cfg.out

# ==== CLI [plumbing] ==============================================================================================
def parse_args(argv=None) -> Config:
    """Config fields become --flags (bools get --no-x too). --preset NAME sets defaults that explicit flags override;
    --resume OUT starts from that run's saved config, and changing its task, data or model needs --allow-change."""
    p = argparse.ArgumentParser(description="GRPO with GMTS token selection (see the module docstring).")
    p.error = die  # one line and exit 2, no usage dump
    p.add_argument("--preset", choices=list(PRESETS), help="a named group of defaults: " + ", ".join(PRESETS))
    for f in dataclasses.fields(Config):
        flag, help_ = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            p.add_argument(flag, type=f.type, default=f.default, choices=CHOICES.get(f.name), help=help_)
    pre, _ = p.parse_known_args(argv)
    p.set_defaults(**PRESETS.get(pre.preset, {}))
    saved = read_run_config(pre.resume) if pre.resume else {}
    names = {f.name for f in dataclasses.fields(Config)}
    p.set_defaults(**{k: v for k, v in saved.items() if k in names - {"resume", "overwrite", "allow_change", "out"}})
    p.set_defaults(out=pre.resume or p.get_default("out"))  # a run continues in its own folder
    cfg = Config(**{k: v for k, v in vars(p.parse_args(argv)).items() if k != "preset"})
    if cfg.resume:
        for k in ("task", "data", "model"):
            if k in saved and getattr(cfg, k) != saved[k] and not cfg.allow_change:
                raise ValueError(f"--resume {cfg.resume}: the run was trained with --{k} {saved[k]}, not "
                                 f"{getattr(cfg, k)}; pass --allow-change to change it")
    return cfg

OOM_HINT = "out of GPU memory: lower --micro-batch, --group-size or --max-new-tokens (the last checkpoint is kept)"

def main(argv=None):
    try:
        cfg = parse_args(argv)
        check_config(cfg)
        changed = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config, k)}  # the class: defaults
        print(f"config (other than the defaults; {cfg.out}/run_config.json has all): {json.dumps(changed)}")
        train(cfg)
    except ValueError as e:  # bad input: flags, data files, a folder that holds a run
        die(str(e), 2)
    except torch.OutOfMemoryError:
        die(OOM_HINT, 1)
    except OSError as e:  # a model that cannot be loaded, no loadable checkpoint, a full disk
        die(str(e).splitlines()[0] if str(e) else type(e).__name__, 1)
    except KeyboardInterrupt:
        die("interrupted; the checkpoints in --out are intact (continue with --resume)", 130)

if __name__ == "__main__":
    main()
