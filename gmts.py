"""
gmts.py: GRPO with Gradient Magnitude-based Token Selection (GMTS) in one file, to read beside:
  GMTS   Lv et al. 2026, "Gradient Magnitude-based Token Selection Improves RLVR Training for LLM
         Reasoning", arXiv 2608.30632: train on about the top 20% of each prompt's tokens by
         H_t * |omega_t|, a stand-in for the size of their gradient. --select gmts follows its
         authors' code, github.com/outongyiLv/GMTS (GMTS-Framework1's GMTS(); docs/design.md).
  80/20  Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL
         for LLM Reasoning", arXiv 2506.01939: train on the top 20% by entropy H_t.
  RSI-S  Lv et al. 2026, "Which Tokens Matter? Adaptive Token Selection for RLVR with the Relative
         Surprisal Index", arXiv 2606.31575: train on the tokens whose (-log p_y) / H_t is in an
         interval (ours: [0.5, 2]; the paper's was not in the sources we could read).

One training step, as train() numbers it; the file follows this order:
  1. draw B prompts from the task                                     [plumbing]
  2. sample G answers per prompt with HF generate (N = B*G answers)   [paper: rollout]
  3. score every answer with a rule-based verifier -> reward r_i      [paper: reward]
  4. group advantages A_i = (r_i - mean_group) / (std_group + eps)    [paper: GRPO advantage]
  5. per response token: log pi(y_t) and entropy H_t                  [paper: token statistics]
     and dz_norm = ||d log p_y / d logits|| (for gradnorm)            [ours]
  6. score tokens, keep the top rho of each group or of the batch     [paper: selection]
       entropy   H_t, over the whole batch                            [80/20, GMTS's ETS baseline]
       gmts      H_t * |omega_t|, omega = -dL/dlogp_t, per group      [GMTS, as its authors' code]
       gradnorm  |omega_t| * dz_norm = ||dL/dz||, over the batch      [ours: an ablation]
       rsi       -log p_y / H_t in an interval: no rho, no scope      [RSI-S]
  7. PPO-clip update on the kept tokens only, in micro-batches        [paper: objective]
  8. log, evaluate, checkpoint                                        [plumbing]
Below the "Supporting code" banner: answer parsing, data, prompts, the model, evaluation, the run
folder and the command line.

Axes: B prompts per step, G answers per prompt, N = B*G answers, P prompt length (left padded), T
response length, V vocabulary, d hidden size. Every (N, T) tensor is aligned to RESPONSE positions:
column t holds the statistics of the t-th generated token, predicted by the hidden state before it.

Deviations from the papers and choices they leave open (the reasons: docs/design.md):
  1. Scope: gmts ranks within each prompt's group, by its authors' rule; the other methods over
     the whole batch, keeping exactly ceil(rho * n), ties to the earlier token (--scope).
  2. omega is -dL/dlogp of the whole configured loss, rescored before each inner update.
  3. --loss-norm all (default) divides by all valid tokens; the authors' objective is seq-sum
     with KL 0.001 (--preset paper-math).
  4. The group advantage divides by the population std.
  5. DAPO's dynamic sampling (--filter-groups, default on) for every method.
  6. The optimiser steps only if some token has a non-zero gradient and the loss and gradient
     norm are finite; the lr schedule advances either way.
  7. KL (k3, --kl-beta) covers all valid tokens; its reference is the model --model loads.
  8. fp32 master weights, bf16 autocast on CUDA; log-softmax, entropy and the loss in fp32.
  9. gmts and gradnorm never keep a token whose score is 0, so they may keep fewer than rho.
 10. Rewards: countdown's and logic's 0.1 format reward (TinyZero); math is binary (80/20);
     code (ours: all of a row's tests pass in the sandbox; model output runs nowhere else) and
     commonsense (ours: the boxed option) are binary; the papers name no rule for either.

Run:  python gmts.py --preset cpu                         (offline, CPU: a tiny warm start learns)
      python gmts.py --model Qwen2.5-0.5B --task countdown    (one GPU)
"""
import argparse, ast, collections, contextlib, copy, dataclasses, functools, glob
import importlib.util, itertools, json, math, operator, os, random, re, shutil, sys, threading, time
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args, get_origin, get_type_hints

import torch
import torch.nn.functional as F

# ==== Config [plumbing]: every field is a --flag; --preset NAME applies PRESETS[NAME] first =======
def arg(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})

@dataclass
class Config:
    # run
    out: str = arg("out/run", "output folder: metrics.jsonl, checkpoints, the final model")
    overwrite: bool = arg(False, "replace the run in --out (only the files a run writes)")
    resume: str = arg("", "a run's --out: continue it from its newest checkpoint")
    seed: int = arg(0, "seeds python, torch and every step's sampling")
    device: Literal["auto", "cuda", "mps", "cpu"] = arg("auto", "auto picks cuda > mps > cpu")
    threads: int = arg(0, "CPU threads torch uses (0: torch's choice)")
    steps: int = arg(200, "GRPO steps")
    save_every: int = arg(50, "checkpoint every this many steps (0: only at the end)")
    report_to: Literal["none", "tensorboard", "wandb"] = arg("none", "also log to this tracker")
    # model
    model: str = arg("tiny", "'tiny' (random, built offline), Qwen2.5-0.5B, a hub id or a folder")
    chat_template: Literal["auto", "yes", "no"] = arg("auto", "wrap prompts in the chat template")
    tiny_hidden: int = arg(64, "--model tiny: hidden size")
    tiny_layers: int = arg(2, "--model tiny: transformer layers")
    grad_ckpt: bool = arg(False, "gradient checkpointing in the update forward")
    # task
    task: Literal["countdown", "math", "logic", "code", "commonsense"] = arg(
        "countdown", "the task (TASKS)")
    data: str = arg("gen", "gen, easy (generated), hf:ID, hf:ID:SPLIT or hf:ID:CONFIG:SPLIT (a "
                           "hub set or a dataset folder; split train if none), or a .jsonl, .json, "
                           ".csv or .parquet file")
    data_order: Literal["draw", "epoch"] = arg("draw", "draw: rows drawn afresh each step; "
                                               "epoch: seeded passes over a file's rows")
    prompt_style: Literal["ours", "qwen-math"] = arg(
        "ours", "math, commonsense: ours (<think>, <answer>; default) or qwen-math (the GMTS "
                "authors' \\boxed{} system prompt: the paper's template for both)")
    short_prompt: bool = arg(False, "terse prompts, no system line (for the byte-level tiny model)")
    eval_every: int = arg(20, "held-out accuracy every this many steps (0: at 0 and the end)")
    eval_size: int = arg(64, "held-out problems: the data's first rows")
    eval_data: str = arg("", "benchmarks instead of held-out rows: NAME=DATA,...")
    eval_samples: int = arg(0, "0: greedy; k: avg@k, k samples per problem")
    # rollout
    prompts_per_step: int = arg(8, "B, prompts (groups) per step")
    group_size: int = arg(8, "G, answers sampled per prompt")
    max_new_tokens: int = arg(256, "response length limit")
    temperature: float = arg(1.0, "sampling temperature, also of the log-probs and entropy")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the full distribution (on-policy)")
    top_k: int = arg(0, "top-k sampling; 0 disables it")
    sampler_dtype: Literal["auto", "bf16", "fp32"] = arg("auto", "generate's weights (auto: bf16 "
                                                         "on CUDA)")
    fast_generate: bool = arg(None, "static KV cache, compiled decoding (unset: on with CUDA)")
    rollout_rows: int = arg(0, "answers per generate() call, whole groups (0: all at once)")
    filter_groups: bool = arg(True, "DAPO dynamic sampling: drop equal-reward groups, draw more")
    max_resample: int = arg(4, "--filter-groups: at most this many rollout batches per step")
    overlong_filter: bool = arg(False, "DAPO's overlong filter: a truncated answer trains nothing")
    # GRPO
    clip_low: float = arg(0.2, "PPO clip eps below 1")
    clip_high: float = arg(0.28, "PPO clip eps above 1 (DAPO clip-higher)")
    kl_beta: float = arg(0.0, "k3 KL to the starting model (0: no reference model is loaded)")
    std_normalize: bool = arg(True, "divide advantages by the group std (off: Dr. GRPO)")
    inner_updates: int = arg(1, "optimiser steps per rollout batch (mu)")
    loss_norm: Literal["all", "selected", "seq", "seq-sum"] = arg(
        "all", "all: divide by the valid tokens; selected: by the kept budget; seq: GRPO's "
               "per-answer mean, averaged; seq-sum: summed over prompts (GMTS's authors)")
    # token selection
    select: str = arg("gmts", "all, random, entropy, gmts, gradnorm or rsi (METHODS)")
    rho: float = arg(0.2, "share of the response tokens kept (not read by all and rsi)")
    rsi_low: float = arg(0.5, "rsi: keep RSI = -log p_y / H in [rsi_low, rsi_high]")
    rsi_high: float = arg(2.0, "rsi: the interval's upper end")
    scope: Literal["auto", "group", "batch"] = arg(
        "auto", "where the top rho is taken: group (each prompt's answers) or batch; auto: the "
                "method's own (group for gmts)")
    # optimisation
    lr: float = arg(1e-6, "AdamW learning rate")
    warmup_steps: int = arg(10, "linear lr warm-up, in update slots")
    lr_decay: bool = arg(True, "after warm-up, a linear lr decay to ~0 at the end")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_eps: float = arg(1e-8, "AdamW eps")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    micro_batch: int = arg(8, "answers per forward/backward (gradient accumulation)")
    stats_chunk: int = arg(1024, "rows of the (tokens x V) logits held at once in the head")

WARM_CPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm", "cpu")
PRESETS = {
    # Offline CPU demo: a 0.27M-parameter Qwen2 warm-started (`python gmts_lab.py warm`) to copy
    # the numbers of easy countdown with random signs; GRPO learns from the reward which signs hit
    # the target. No --filter-groups: on this demo it took 2.4x the rollouts for no gain.
    "cpu": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=80,
                prompts_per_step=32, group_size=8, max_new_tokens=64, lr=3e-4, micro_batch=256,
                eval_every=10, eval_size=256, save_every=20, filter_groups=False, threads=1,
                out="out/cpu"),
    # A seconds-long version of the same path, for tests: it trains. The warm start's answers are
    # about 50 tokens (byte-level), so 64 lets them end; they earn rewards, groups split, and
    # the update moves the weights (seed 0: selected_frac 0.2, grad_norm 0.37 and 2.1).
    "smoke": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=2,
                  prompts_per_step=2, group_size=4, max_new_tokens=64, eval_every=1, eval_size=4,
                  lr=1e-4, threads=1, out="out/smoke"),
    # GMTS Framework1's values (docs/design.md: what is theirs, what not). One pass over math12k's
    # 12,000 rows: 187 steps of 64 and a last one of 32, each row once.
    "paper-math": dict(model="Qwen/Qwen2.5-Math-1.5B", task="math",
                       data="hf:hiyouga/math12k:train", prompt_style="qwen-math",
                       chat_template="yes", steps=188, prompts_per_step=64, group_size=16,
                       max_new_tokens=2048, lr=3e-5, loss_norm="seq-sum", max_grad_norm=1.0,
                       data_order="epoch", warmup_steps=0, lr_decay=False, kl_beta=0.001,
                       micro_batch=4, filter_groups=False, eval_every=0, eval_samples=16,
                       out="out/paper-math",
                       eval_data="aime24=hf:HuggingFaceH4/aime_2024:train,"
                                 "amc23=hf:math-ai/amc23:test,"
                                 "math500=hf:HuggingFaceH4/MATH-500:test,"
                                 "minerva=hf:math-ai/minervamath:test,"
                                 "olympiadbench=hf:Hothan/OlympiadBench:OE_TO_maths_en_COMP:train"),
}

# ==== Rollouts [paper: sampling]: G answers per prompt from the full softmax at temperature T =====
def completion_mask(completion_ids: torch.Tensor, end_ids: list) -> tuple:
    """(resp_mask (N, T) bool, truncated (N,)). Valid response positions, by POSITION: up to and
    including the first end token. Never by the pad id: Qwen's pad (<|endoftext|>) is an end token
    too, so a value test would drop the end token itself from the loss (tiny-grpo's bug)."""
    N, T = completion_ids.shape
    device = completion_ids.device
    is_end = torch.isin(completion_ids, torch.tensor(end_ids, device=device))  # (N, T)
    has_end = is_end.any(dim=1)  # (N,)
    no_end = torch.full((N,), T - 1, device=device)  # an answer without an end keeps every position
    first_end = torch.where(has_end, is_end.int().argmax(dim=1), no_end)  # (N,)
    resp_mask = torch.arange(T, device=device)[None, :] <= first_end[:, None]  # (N, T)
    return resp_mask, ~has_end

@torch.no_grad()
def rollout(model, tok, prompts: list, group_size: int, max_new_tokens: int,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
            fast: bool = False, sampler_logp: bool = False) -> dict:
    """group_size answers per prompt (greedy=True: one greedy answer, to evaluate), on its device:
      prompt_ids, prompt_mask  (N, P)  the prompts, left padded, each repeated G times
      comp_ids, resp_mask      (N, T)  the answers and their valid positions (completion_mask)
      truncated                (N,)    answers that hit max_new_tokens without an end token
      texts                    N str   the answers, decoded up to their end
      sampler_logp             (N, T)  with sampler_logp=True: the sampler's log_softmax(logits / T)
                                       at each drawn token (pre-top-k/p, as the learner's; 0 after)
    fast: a static KV cache, its length rounded up to 64 (few shapes), compiled decoding on CUDA."""
    from transformers import GenerationConfig
    device = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    ids = enc["input_ids"].repeat_interleave(group_size, dim=0)  # (N, P)
    attn = enc["attention_mask"].repeat_interleave(group_size, dim=0)  # (N, P)
    width = ids.shape[1] + max_new_tokens
    knobs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if greedy:
        knobs = dict(do_sample=False)
    if fast:
        knobs.update(cache_implementation="static", max_cache_len=-(-width // 64) * 64)
    end_ids = end_token_ids(tok)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=end_ids,
                           pad_token_id=tok.pad_token_id, **knobs)
    recorder = SamplerLogp(temperature) if sampler_logp else None
    # generate() fills each knob left unset from the checkpoint's generation_config (Qwen instruct:
    # top_k 20, top_p 0.8, repetition_penalty 1.1, ...), sampling another distribution than our
    # policy: `gen` is complete, and the model's default is blanked for the call and put back after.
    was_training = model.training
    saved = model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        with autocast(device):
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen,
                                 logits_processor=[recorder] if recorder else None)  # (N, P + T)
    finally:
        model.generation_config = saved
        model.train(was_training)
    comp = out[:, ids.shape[1]:]  # (N, T), T >= 1: generate makes at least one token
    resp_mask, truncated = completion_mask(comp, end_ids)
    shown = comp.masked_fill(~resp_mask, tok.pad_token_id)  # (N, T)
    texts = tok.batch_decode(shown, skip_special_tokens=True)
    batch = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=resp_mask,
                 truncated=truncated, texts=texts)
    if recorder:
        batch["sampler_logp"] = recorder.finish(comp, resp_mask)  # (N, T)
    return batch

# ==== Rewards [paper: reward]: the tasks' rule-based verifiers, algorithm step 3 ==================
# Each task's prompt and verifier, in TASKS. Verifiers cap every length before parsing, use no
# eval/exec and never raise: a bug costs a reward, not a run. All are pure functions; math-verify,
# which math_reward asks about LaTeX answers, bounds its own time (grade in the main thread).
# Model output runs only inside the sandbox: code_rewards' programs, in processes of their own.
def _never_raise(fn, fallback=0.0):
    """A verifier's last-resort net (it handles expected failures itself): exception -> fallback."""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RunError:  # grading off the main thread: the caller's bug, never the answer's
            raise
        except Exception:
            return fallback
    return functools.wraps(fn)(wrapped)

def _last_answer(text: str):
    """The last complete <answer>...</answer>'s content or None (rfind: linear, no backtracking)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return text[start + len("<answer>"):end]

# -- countdown (TinyZero): combine the given numbers with + - * / to hit the target --
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: a / b if b else None}  # None: division by zero
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.Div: operator.truediv}  # on Fractions: x / 0 raises ZeroDivisionError
_CD_CHARS = re.compile(r"[0-9+\-*/() \t\r\n]*")  # ASCII digits only: ast reads "٣" as 3 too

def _cd_eval(node, lits: list, depth=0) -> Fraction:
    """Exact value of a whitelisted tree, collecting its int literals. Anything else raises
    ValueError: ** // % (they pass the character filter), unary + and - (the numbers are positive:
    -a is unlisted; a - b does it), names, calls, floats ("2.5" is not 2 and 5), bools, strings."""
    if depth > 60:
        raise ValueError("too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        lits.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        left = _cd_eval(node.left, lits, depth + 1)
        right = _cd_eval(node.right, lits, depth + 1)
        return _AST_OPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} not allowed")

@functools.partial(_never_raise, fallback=None)
def countdown_value(completion: str, nums: list):
    """Exact value of the last <answer> if an equation using each given number once, else None (no
    tag; '=', not allowed as in TinyZero; other characters or numbers; bad syntax)."""
    ans = (_last_answer(completion) or "").strip()
    # cap the length before ast.parse, which recurses on nesting
    if not ans or len(ans) > 200 or not _CD_CHARS.fullmatch(ans):
        return None
    lits = []
    try:  # newlines are plain whitespace here, not statement breaks
        value = _cd_eval(ast.parse(" ".join(ans.split()), mode="eval").body, lits)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    return value if sorted(lits) == sorted(nums) else None

@_never_raise
def countdown_reward(completion: str, nums: list, target: int) -> float:
    """1.0: the last <answer> is an equation that uses each given number once and equals the
    target; 0.1: an answer is there but wrong or invalid; 0.0: no answer tag."""
    if _last_answer(completion) is None:
        return 0.0
    return 1.0 if countdown_value(completion, nums) == target else 0.1

# -- math: the final answer against the gold, binary; the parsing is in the supporting code --
@_never_raise
def math_reward(completion: str, answer: str, latex: bool = False,
                answer_line: bool = False) -> float:
    """1.0 iff the final answer equals the gold; no format bonus. A GSM8K row (latex False): the
    last \\boxed{}, else the number after ####, else the last number, as an exact fraction. Any
    other row: the last \\boxed{} (answer_line: the last 'Answer:' line; an unclosed last box is
    no answer) by same_latex: units compared where both sides have one, numbers exactly (4.5e33 is
    4.5 \\times 10^{33}), anything else by math-verify."""
    got = _answer_line(completion) if answer_line else math_final_answer(completion, latex)
    if got is None:
        return 0.0
    if latex:
        return float(same_latex(str(answer), got))
    gold = parse_number(str(answer))
    return float(gold is not None and parse_number(got) == gold)

_ENTRY = r"[\s,;]*([a-z]+)\s*:\s*(knight|knave)(?![a-z])(?:\s*\.)?"  # 'name: role', maybe a '.'

@_never_raise
def logic_reward(completion: str, solution: dict) -> float:
    """1.0: the last <answer> names everyone exactly once as 'Name: knight|knave', the roles right
    (any case; split by , ; or whitespace incl. newlines); 0.1: wrong or malformed; 0.0: none."""
    ans = _last_answer(completion)
    if ans is None:
        return 0.0
    ans = ans.lower()
    if len(ans) > 1000 or not re.fullmatch(f"(?:{_ENTRY})*[\\s,;]*", ans):
        return 0.1
    got = re.findall(_ENTRY, ans)
    if len({name for name, _ in got}) < len(got):  # someone named twice
        return 0.1
    said = {name: role == "knight" for name, role in got}
    truth = {name.lower(): is_knight for name, is_knight in solution.items()}
    return 1.0 if said == truth else 0.1

# -- code (ours: neither paper names a code reward): the program in the last ```python block,
# run with the row's tests in the sandbox (run_programs, in the supporting code) --
def last_code_block(text: str):
    """The code in the last closed ```python (or ```py) block, or None. Fences are found by
    str.find, left to right: linear in the text."""
    code, i = None, text.find("```")
    while i >= 0:
        eol = text.find("\n", i)
        close = text.find("\n```", eol) if eol >= 0 else -1
        if close < 0:
            break
        if text[i + 3:eol].strip().lower() in ("python", "py", "python3"):
            code = text[eol + 1:close + 1]
        i = text.find("```", close + 4)
    return code

def code_rewards(completions: list, rows: list) -> list:
    """1.0 for each completion whose last ```python block passes every test of its row in the
    sandbox; 0.0 for a failing test, an error, a timeout or no closed block (no format reward).
    The batch's programs run in parallel, up to the cores; a program repeated for the same row
    runs once. A row's tests: asserts calling its functions, or stdin inputs and the outputs
    expected (compared whole, trailing whitespace of each line and of the end aside)."""
    try:
        todo = {}  # (program, its row's tests) -> the job, each once
        keys = []
        for text, row in zip(completions, rows):
            code = last_code_block(text[-100_000:])
            key = None if code is None else (code, code_tests(row))
            if key is not None:
                todo.setdefault(key, (code, row))
            keys.append(key)
        passed = dict(zip(todo, run_programs(list(todo.values()))))
        return [float(key is not None and passed[key]) for key in keys]
    except RunError:
        raise
    except Exception:  # a fault of the sandbox's own: reward 0, never a crashed run
        return [0.0] * len(completions)

# -- commonsense (CommonsenseQA, CSQA2): the option the last \\boxed{} names, binary. Our rule:
# neither the GMTS paper nor its authors' code names a reward for it --
_WRAPS = ("\\text{", "\\textbf{", "\\mathrm{", "\\mathbf{")

def _plain(s: str) -> str:
    """A box's or an option's words as compared: no $ or one \\text{}-like wrap around the whole,
    no trailing '.', lower case, runs of whitespace as one space."""
    s = s.strip().strip("$").strip()
    wrap = next((w for w in _WRAPS if s.startswith(w) and s.endswith("}")), None)
    if wrap:
        s = s[len(wrap):-1]
    return " ".join(s.lower().split()).rstrip(".").rstrip()

@_never_raise
def commonsense_reward(completion: str, choices: dict, key: str) -> float:
    """1.0 iff the last \\boxed{} names the key's option and no other; else 0.0, no format bonus.
    A box names an option by its label alone ('B', '(B)', 'B.', 'B)', 'B:', any case), by its
    label, a space and its own text ('B. dog'), or by its text alone ('Dog'). So a box that
    names several ('A, B', 'B or C', 'B. dog C. cup'), a label with another option's text
    ('B. cup'), a text two options share, or an unclosed last box earns 0.
    choices: {label: [...], text: [...]}."""
    box = _last_boxed(completion)  # the LAST box; not closed within BOX_CAP: no answer
    if box is None:
        return 0.0
    said = _plain(box)
    named = set()
    for label, text in zip(choices["label"], choices["text"]):
        forms = [f.lower() for f in (label, f"({label})", f"{label}.", f"{label})", f"{label}:")]
        with_text = [f"{f} {_plain(text)}" for f in forms]
        if said in forms or said in with_text or said == _plain(text):
            named.add(label)
    return float(named == {key})

# -- prompts (build_prompts, in the supporting code, frames them in --prompt-style) --
_FORMAT = ("Show your work in <think> </think> tags. "
           "And return the final answer in <answer> </answer> tags")

def countdown_prompt(row: dict, short=False) -> str:
    nums = row["nums"]
    t = row["target"]
    if short:
        return f"Make {t} from {' '.join(map(str, nums))}."
    return (f"Using the numbers {list(nums)}, create an equation that equals {t}. You can use "
            f"basic arithmetic operations (+, -, *, /) and each number must be used exactly "
            f"once. {_FORMAT}, for example <answer> (1 + 2) / 3 </answer>.")

def math_prompt(row: dict, short=False) -> str:
    if short or row.get("answer_line"):  # a row that asks for its answer itself (DAPO's): as it is
        return row["question"]
    return (f"{row['question']}\n{_FORMAT}, with the final number inside \\boxed{{}}, "
            f"for example <answer> \\boxed{{42}} </answer>.")

def commonsense_question(row: dict) -> str:
    """The question and its options, one a line ('A. dog'): the whole of it in every style."""
    options = zip(row["choices"]["label"], row["choices"]["text"])
    return "\n".join([row["question"]] + [f"{label}. {text}" for label, text in options])

def commonsense_prompt(row: dict, short=False) -> str:
    if short:
        return commonsense_question(row)
    return (f"{commonsense_question(row)}\n{_FORMAT}, with the letter of your choice inside "
            f"\\boxed{{}}.")

def logic_prompt(row: dict, short=False) -> str:
    said = "\n".join(row["statements"])
    if short:
        return said
    return (f"On an island every inhabitant is a knight, who always tells the truth, or a knave, "
            f"who always lies. You meet {len(row['names'])} inhabitants: "
            f"{', '.join(row['names'])}.\n{said}\nWho is a knight and who is a knave? {_FORMAT}, "
            f"one entry per person, for example <answer> Alice: knight, Bob: knave </answer>.")

def code_prompt(row: dict, short=False) -> str:
    """The GMTS paper's code prompt (its words where it quotes them, ours between); no system
    line of ours: the model's default (TASKS' "frame")."""
    if short:
        return row["question"]
    starter = row.get("starter", "")
    if starter:
        starter = (f"\nYou will use the following starter code, and complete it:\n```python\n"
                   f"{starter}\n```")
    return (f"Please provide a self-contained Python script that solves the following problem:"
            f"\n{row['question']}{starter}\nPut your code answer in a markdown code block "
            f"(```python ... ```).")

TASKS = {  # a task: its prompt, its verifier, and the keys a data row must have
    "countdown": {"prompt": countdown_prompt, "keys": ("nums", "target"),
                  "reward": lambda c, row: countdown_reward(c, row["nums"], row["target"])},
    "math": {"prompt": math_prompt, "keys": ("question", "answer"),
             "reward": lambda c, row: math_reward(c, row["answer"], row.get("latex", False),
                                                  row.get("answer_line", False))},
    "logic": {"prompt": logic_prompt, "keys": ("names", "statements", "solution"),
              "reward": lambda c, row: logic_reward(c, row["solution"])},
    # "rewards": a batch at once; "frame": the prompt's frame whatever --prompt-style says
    "code": {"prompt": code_prompt, "keys": ("question",), "frame": "own",
             "reward": lambda c, row: code_rewards([c], [row])[0], "rewards": code_rewards},
    # "question": what the \\boxed{} styles show (math shows row["question"] alone)
    "commonsense": {"prompt": commonsense_prompt, "question": commonsense_question,
                    "keys": ("question", "choices", "answerKey"),
                    "reward": lambda c, row: commonsense_reward(c, row["choices"],
                                                                row["answerKey"])},
}

# ==== Group advantages [paper: GRPO] and dynamic sampling [DAPO] ==================================
def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of G consecutive answers, (N,) -> (N,).
    The POPULATION std (divide by G: the group is all we compare to) gives derivation step 5's clean
    binary values (TRL's unbiased std scales them by sqrt((G-1)/G)). A uniform group gets exactly 0
    (not 1e-17, never NaN). std_normalize=False: Dr. GRPO's r - mean."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    same = ~informative(r, group_size)[:, None]  # (B, 1)
    return adv.masked_fill(same, 0.0).view(-1)  # (N,)

def informative(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the groups whose rewards are not all equal (A != 0 somewhere: a gradient)."""
    r = rewards.view(-1, group_size)  # (B, G)
    return r.max(dim=1).values != r.min(dim=1).values

def filter_groups(parts: list, group_size: int, B: int, pad_id: int) -> tuple:
    """--filter-groups: join one step's rollout batches [(batch, rewards, adv), ...] (_join_rows,
    in the supporting code), take the first B informative groups -> (batch, rewards, adv), every
    per-answer entry; none: the first batch (all A = 0)."""
    rewards = torch.cat([part[1] for part in parts])  # (N_all,)
    advs = torch.cat([part[2] for part in parts])  # (N_all,)
    taken = informative(rewards, group_size).nonzero().squeeze(1)[:B]  # (<= B,) groups
    if taken.numel() == 0:
        return parts[0]
    idx = (taken[:, None] * group_size + torch.arange(group_size)).view(-1)  # their answers
    batch = {}
    for key in parts[0][0]:
        joined = _join_rows([part[0][key] for part in parts], key, pad_id)
        if isinstance(joined, list):
            batch[key] = [joined[i] for i in idx.tolist()]
        else:
            batch[key] = joined[idx.to(joined.device)]
    return batch, rewards[idx], advs[idx.to(advs.device)]

# ==== Token statistics [paper: the gradient of the loss w.r.t. the logits; the derivation] ========
# Token t of answer i: logits z (V,), temperature T, p = softmax(z / T), sampled token y, advantage
# A_i, ratio r = pi_theta(y) / pi_old(y). The GRPO/PPO-clip token loss (eps_l, eps_h: clip range):
#     l = -min( r * A,  clip(r, 1 - eps_l, 1 + eps_h) * A )
# Algorithm step 7 minimises it over the kept tokens S, with k3 KL (beta > 0) over all valid tokens:
#     L = sum_{t in S} w_t * l_t / D  +  beta * sum_{t valid} w_t * k3_t / D_kl
#     k3 = e^d - d - 1,  d = log pi_ref(y) - log pi_theta(y)
# w, D, D_kl are --loss-norm's normaliser (loss_weights; the Objective record holds them with the
# clip range, beta and T): all w = 1, D = D_kl = the valid tokens; selected D = the kept budget;
# seq w_t = 1 / |o_i| (answer i's length), D = D_kl = N answers; seq-sum D = D_kl = G.
#
# 1. The min picks the clipped branch, whose gradient is 0, exactly when (A > 0 and r > 1 + eps_h)
#    or (A < 0 and r < 1 - eps_l): "the clip is active", I_t = 0 (else I_t = 1). Otherwise
#    dl/dlogp_y = -r * A (dr/dlogp_y = r), and dk3/dlogp_y = 1 - e^d = 1 - pi_ref / pi_theta. So for
#    a kept token, with omega its coefficient in dL = -omega * dlogp_t (GMTS's omega):
#        omega_t = -dL/dlogp_t = w_t r_t I_t A_i / D  +  beta w_t (pi_ref / pi_theta - 1) / D_kl
#    L depends on token t's logits only through log p_y: dL/dtheta = -sum_t omega_t dlogp_t/dtheta.
# 2. log p_y = z_y / T - logsumexp(z / T), so dlogp_y/dz_j = (1/T) * (onehot(y)_j - p_j) and
#        dL/dz = -(omega / T) * (onehot(y) - p)                          (the logit gradient)
# 3. Its L2 norm: ||onehot(y) - p||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2 = 1 - 2 p_y + sum_j p_j^2,
#        ||dL/dz|| = |omega| / T * sqrt(1 - 2 p_y + sum_j p_j^2) = |omega| * dz_norm (token_stats)
#    dz_norm = ||d log p_y / dz||: the per-token factor (metrics' grad_norm is the update's norm).
#
# So the size of a token's gradient is |omega| times a factor of its distribution alone. Step 4
# relates that factor to entropy within one answer; step 5 shows why omega matters across answers.
# 4. Within an answer (omega is the same for all of answer i's tokens when r = 1, beta = 0):
#    a. Pointwise, for the token actually sampled:
#           (1 - p_y)^2 <= ||onehot(y) - p||^2 <= 2 (1 - p_y)^2,
#       so the norm is set by p_y, not by H: a rare token sampled at a near-certain position has a
#       large one (at p = (0.999, 50 x 2e-5): H = 0.012 nats, norm 1.4135).
#    b. In expectation over y ~ p (Shannon entropy >= Renyi-2 entropy):
#           E||onehot(y) - p||^2 = 1 - sum_j p_j^2 <= 1 - exp(-H),
#       so a near-certain position (H ~ 0) has a near-zero logit gradient ON AVERAGE.
#    Entropy ranks positions by (b), missing (a)'s tokens; gradnorm scores each by its exact norm.
# 5. Across answers omega differs. With binary rewards and k of G answers correct, A =
#    +sqrt((G-k)/k) for the correct and -sqrt(k/(G-k)) for the wrong ones (G = 8, k = 1: +2.65 vs
#    -0.38), A = 0 for a group whose answers all got the same reward, and under seq the 1 / |o_i|
#    ranks a token of a short answer above the same token of a long one. Entropy ranking ignores
#    this factor: it spends budget on tokens whose gradient is small or 0.
# 6. GMTS scores a token by H_t * |omega_t| (entropy standing in for step 3's norm, dz_norm) and
#    keeps about the top rho of each prompt's group (kept_count's drop rule; deviation 9). Our
#    ablation 'gradnorm' scores by the exact ||dL/dz|| = |omega| * dz_norm (one reduction over V).
# The temperature: p, H, log p at the rollout temperature T (the authors sample at T = 1 only).

def token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> tuple:
    """(logp, entropy, dz_norm) of each sampled token, in fp32. logits (..., V), tokens (...)
    -> 3 x (...):
    logp     = log p_y,  p = softmax(logits / T)
    entropy  = -sum_j p_j log p_j                                   (nats)
    dz_norm  = ||d logp_y / d logits||_2 = (1/T) sqrt(1 - 2 p_y + sum_j p_j^2)   (derivation 3)"""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # (..., V)
    y = tokens.unsqueeze(-1)  # (..., 1)
    logp = logp_all.gather(-1, y).squeeze(-1)  # log p_y, (...)
    p_y = logp.exp()  # (...)
    # p_rest is p with p_y set to 0: its sums run over j != y; y's own term is added back to them.
    p_rest = logp_all.exp().scatter(-1, y, 0.0)  # (..., V)
    entropy = -((p_rest * logp_all).sum(-1) + p_y * logp)  # (...)
    # ||onehot(y) - p||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2. Unlike 1 - 2 p_y + sum_j p_j^2 it does
    # not cancel catastrophically when p_y ~ 1 (1 - p_y = -expm1(log p_y)).
    sq = torch.expm1(logp).square() + torch.linalg.vector_norm(p_rest, dim=-1).square()  # (...)
    return logp, entropy, sq.sqrt() / temperature

def response_hidden(model, batch: dict, rows=slice(None)) -> torch.Tensor:
    """Final hidden states that PREDICT each response token (position P-1+t predicts token t)
    -> (n, T, d). Position ids come from the attention mask (cumsum - 1), as generate() computes
    them under left padding. The decoder is the model's own (get_decoder): any causal LM works."""
    ids = torch.cat([batch["prompt_ids"][rows], batch["comp_ids"][rows]], dim=1)  # (n, P + T)
    attn = torch.cat([batch["prompt_mask"][rows], batch["resp_mask"][rows]], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (n, P + T)
    with autocast(ids.device):
        out = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos,
                                  use_cache=False)  # no KV cache to fill: one pass
    h = out.last_hidden_state  # (n, P + T, d)
    P, T = batch["prompt_ids"].shape[1], batch["comp_ids"].shape[1]
    return h[:, P - 1:P + T - 1]  # (n, T, d)

@torch.no_grad()
def batch_token_stats(model, batch: dict, temperature: float, micro_batch: int,
                      chunk: int) -> tuple:
    """(logp, entropy, dz_norm), each (N, T) fp32, 0 where invalid: a no-grad forward in
    micro-batches, the lm_head on `chunk` valid tokens at a time (~3 (chunk, V) fp32 buffers for
    any N * T)."""
    head = model.get_output_embeddings()
    mask = batch["resp_mask"]  # (N, T)
    out = [torch.zeros(mask.shape, device=mask.device) for _ in range(3)]  # 3 x (N, T)
    for start in range(0, mask.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        m = mask[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        y = batch["comp_ids"][rows][m]  # (M,)
        parts = [token_stats(F.linear(hc, head.weight, head.bias), yc, temperature)
                 for hc, yc in zip(h.split(chunk), y.split(chunk))]
        for o, values in zip(out, zip(*parts)):  # zip(*parts): each statistic's chunks, in order
            o[rows][m] = torch.cat(values)  # o[rows]: a view (rows is a slice), writes o
    return tuple(out)

def head_logp(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor,
              temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """log p_y WITH autograd, chunked: each chunk's (C, V) logits are recomputed in backward
    (activation checkpointing), bounding the head's memory by the chunk, not M. (M, d) -> (M,)."""
    from torch.utils.checkpoint import checkpoint

    def logp(h, y):
        z = F.linear(h, head.weight, head.bias).float() / temperature  # (C, V)
        return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)  # (C,)
    parts = [checkpoint(logp, h, y, use_reentrant=False)
             for h, y in zip(hidden.split(chunk), tokens.split(chunk))]
    return torch.cat(parts)  # split() yields one empty piece for no tokens: never an empty list

def micro_batch_logp(model, batch: dict, mask: torch.Tensor, temperature: float, micro_batch: int,
                     chunk: int):
    """Yields (rows (n,), m = mask[rows] (n, T), logp (M,): log p_y of m's tokens, row-major) per
    micro-batch of the answers with a token in mask (N, T). The one log-prob pass of the loss
    (loss_backward) and of the KL reference (response_logp): equal weights give equal bits."""
    head = model.get_output_embeddings()
    active = mask.any(dim=1).nonzero().squeeze(1)  # answers that enter the forward
    for rows in active.split(micro_batch):
        if rows.numel() == 0:  # no token: split() still yields one empty piece
            return
        m = mask[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        yield rows, m, head_logp(h, head, batch["comp_ids"][rows][m], temperature, chunk)

@torch.no_grad()
def response_logp(model, batch: dict, mask: torch.Tensor, temperature: float, micro_batch: int,
                  chunk: int) -> torch.Tensor:
    """The KL reference's log p_y in mask (deviation 7), (N, T) fp32, 0 elsewhere; loss's pass."""
    out = torch.zeros(mask.shape, device=mask.device)  # (N, T)
    for rows, m, logp in micro_batch_logp(model, batch, mask, temperature, micro_batch, chunk):
        r, t = m.nonzero(as_tuple=True)  # row-major, as m selects the hidden states
        out[rows[r], t] = logp
    return out

# ==== Scores and top-rho selection [paper: GMTS's score H * |omega|; 80/20's entropy score] =======
def clip_active(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float,
                clip_high: float) -> torch.Tensor:
    """Where the PPO clip zeroes the gradient (derivation step 1); adv and ratio broadcast."""
    above = (adv > 0) & (ratio > 1 + clip_high)
    below = (adv < 0) & (ratio < 1 - clip_low)
    return above | below

def loss_weights(loss_norm: str, valid: torch.Tensor, n_kept: int, group_size: int = 1) -> dict:
    """--loss-norm's normaliser of L (derivation): dict(w=(N, T), denom=D, kl_denom=D_kl), for
    omega and the Objective. valid (N, T): the loss's tokens; n_kept: the budget (scope_budget).
    'selected' divides by the budget, not by the tokens finally kept: omega, which the selection
    ranks by, needs D before any token is selected (the budget is the kept count unless zero
    scores are dropped)."""
    n_valid = float(max(int(valid.sum()), 1))
    w = torch.ones(valid.shape, device=valid.device)  # (N, T)
    if loss_norm in ("seq", "seq-sum"):  # seq: GRPO's; seq-sum: GMTS Framework1's
        n = float(group_size if loss_norm == "seq-sum" else valid.shape[0])
        return dict(w=w / valid.sum(1, keepdim=True).clamp_min(1), denom=n, kl_denom=n)
    denom = float(max(n_kept, 1)) if loss_norm == "selected" else n_valid
    return dict(w=w, denom=denom, kl_denom=n_valid)

def omega(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float,
          kl_beta: float = 0.0, ref_ratio: torch.Tensor = None, *, w=1.0, denom: float = 1.0,
          kl_denom: float = 1.0) -> torch.Tensor:
    """omega_t = -dL/dlogp_t of a kept token, as derivation step 1 writes it (ref_ratio = pi_ref /
    pi_theta, the KL term's). w, denom, kl_denom: loss_weights'; their defaults leave ratio * A
    where the clip is inactive. adv (N,), ratio (N, T) -> (N, T)."""
    a = adv[:, None]  # (N, 1)
    dead = clip_active(a, ratio, clip_low, clip_high)  # (N, T)
    om = torch.where(dead, torch.zeros_like(ratio), ratio * a) * w / denom  # the policy term's
    if kl_beta > 0:
        om = om + kl_beta * w * (ref_ratio - 1) / kl_denom  # the KL term's
    return om

@dataclass(frozen=True)
class Method:
    """A --select method (a row of METHODS), or a user's score for train(score_fn=...)."""
    score: object  # score(logp, entropy, dz_norm, om, generator=None), all (N, T): high kept first
    zero_kept: bool = True  # False: a score of 0 is never kept (its gradient is 0; deviation 9)
    scope: str = "batch"  # --scope auto's: group (each prompt's G answers) or batch
    band: bool = False  # True: keep every token whose score is in [--rsi-low, --rsi-high], no rho

def relative_surprisal(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """RSI = (-log p_y) / H (Lv et al., arXiv 2606.31575). E_{y ~ p}[-log p_y] = H, so RSI is 1 on
    average over on-policy samples: < 1 for a token likelier than typical (redundant), > 1 for a
    rarer one (the unstable tail). H = 0 (p one-hot: the logit gradient is 0) -> inf, never kept.
    (N, T) -> (N, T)."""
    return torch.where(entropy > 0, -logp / entropy, math.inf)

# The methods of --select: adding one is a row and its score. 'all' keeps every token (rho 1).
METHODS = {
    "all": Method(lambda logp, H, dz_norm, om, gen=None: torch.ones_like(H)),  # vanilla GRPO
    "random": Method(lambda logp, H, dz_norm, om, gen=None:  # the control
                     torch.rand(H.shape, generator=gen).to(H.device)),
    "entropy": Method(lambda logp, H, dz_norm, om, gen=None: H),  # H_t (80/20 paper)
    # H_t * |omega_t| (GMTS; H >= 0), per group as its authors
    "gmts": Method(lambda logp, H, dz_norm, om, gen=None: (H * om).abs(), False, "group"),
    # ||dL/dz|| = |omega_t| * dz_norm, the exact logit-gradient norm (derivation step 3; ours)
    "gradnorm": Method(lambda logp, H, dz_norm, om, gen=None: om.abs() * dz_norm, False),
    # RSI-S: RSI in [--rsi-low, --rsi-high], an interval, not a top rho (Lv et al. 2606.31575)
    "rsi": Method(lambda logp, H, dz_norm, om, gen=None: relative_surprisal(logp, H), band=True),
}

def token_scores(method: str, entropy: torch.Tensor, dz_norm: torch.Tensor, om: torch.Tensor,
                 generator: torch.Generator = None, logp: torch.Tensor = None) -> torch.Tensor:
    """METHODS[method]'s ranking score of each token; higher is kept first. (N, T) -> (N, T)."""
    if method not in METHODS:
        choices = ", ".join(METHODS)
        raise ValueError(f"unknown selection method {method!r}; choose one of: {choices}")
    return METHODS[method].score(logp, entropy, dz_norm, om, generator)

def kept_count(counts: list, rho: float, rule: str) -> list:
    """How many of a scope's n valid tokens are kept, for each n in counts, on rho as written (in
    floats 0.07 * 100 is 7.000000000000001, up to 8 tokens):
      drop  the authors' rule: drop max(1, ceil((1 - rho) n)), keep the rest (one dropped even
            at rho = 1); ties at the threshold go to the later token (their ascending sort)
      ceil  ours: keep ceil(rho n), at least one (none of none); ties to the earlier token"""
    r = Fraction(str(float(rho)))
    if rule == "drop":
        return [max(0, n - max(1, math.ceil((1 - r) * n))) for n in counts]
    return [min(n, max(1, math.ceil(r * n))) for n in counts]

def scope_budget(mask: torch.Tensor, rho: float, group_size: int = 0,
                 groups: torch.Tensor = None) -> tuple:
    """Algorithm step 6's budget, read by both the mask (select_tokens) and the 'selected'
    normaliser (train) -> (label, kept, rule). The scope is a label per token: groups (N, T), or
    with group_size G each run of G rows (filter_groups' layout), or one label: the whole batch.
    label (n,): each valid token's label index, in position order (None: one label); kept (L,):
    how many of each label's tokens are kept, by kept_count's drop rule (one label: its ceil)."""
    flat_mask = mask.reshape(-1)  # (N*T,)
    if groups is None and not group_size:
        return None, torch.tensor(kept_count([int(flat_mask.sum())], rho, "ceil")), "ceil"
    if groups is None:
        if mask.shape[0] % group_size:
            raise ValueError(f"{mask.shape[0]} answers are not groups of {group_size}")
        rows = torch.arange(mask.shape[0], device=mask.device)  # (N,)
        groups = (rows // group_size)[:, None].expand(mask.shape)  # (N, T)
    found = torch.unique(groups.reshape(-1)[flat_mask], return_inverse=True, return_counts=True)
    _, label, counts = found  # (L,), (n,), (L,)
    return label, torch.tensor(kept_count(counts.tolist(), rho, "drop"), device=mask.device), "drop"

def select_tokens(scores: torch.Tensor, mask: torch.Tensor, rho: float, nonzero: bool = False,
                  group_size: int = 0, groups: torch.Tensor = None) -> torch.Tensor:
    """The top valid tokens by score in each scope, as many as scope_budget's count, ties as
    kept_count says: (N, T) -> (N, T) bool; masked out tokens are never kept, NaN ranks lowest.
    nonzero (gmts, gradnorm) then drops kept tokens whose score is 0 (deviation 9): maybe fewer."""
    flat_mask = mask.reshape(-1)  # (N*T,)
    sel = torch.zeros_like(flat_mask)
    if not flat_mask.any():
        return sel.view_as(mask)
    label, kept, rule = scope_budget(mask, rho, group_size, groups)
    vals = scores.reshape(-1)[flat_mask].float()  # (n,), in position order
    vals = torch.nan_to_num(vals, nan=-math.inf)
    # The tie rule is the one line to change for another: a stable sort keeps equal scores in
    # position order, so ties go to the earlier token; the authors' ascending sort, which drops
    # from the bottom, leaves them to the later one, which a stable sort of the reversed scores
    # gives (mapped back to positions by len - 1 - index).
    if rule == "drop":
        order = len(vals) - 1 - torch.sort(vals.flip(0), descending=True, stable=True).indices
    else:
        order = torch.sort(vals, descending=True, stable=True).indices  # (n,), highest first
    rank = torch.arange(len(vals), device=vals.device)  # (n,): 0 for the highest of its label
    if label is not None:  # regroup the order by label (stable: each label's stays highest first)
        order = order[torch.sort(label[order], stable=True).indices]
        counts = torch.bincount(label, minlength=len(kept))  # (L,)
        rank = rank - (counts.cumsum(0) - counts).repeat_interleave(counts)
        kept = kept[label[order]]  # (n,)
    keep = torch.zeros_like(vals, dtype=torch.bool)
    keep[order] = rank < kept.to(vals.device)
    if nonzero:
        keep &= vals > 0
    sel[flat_mask] = keep
    return sel.view_as(mask)

# ==== Loss and update [paper: GRPO / DAPO objective restricted to the kept tokens] ================
@dataclass
class Objective:
    """The settings of the loss L (derivation), passed whole to the update; omega takes them too."""
    clip_low: float  # eps_l: PPO clip below 1
    clip_high: float  # eps_h: above 1
    kl_beta: float  # beta of the k3 KL term (0: none)
    temperature: float  # T of the log-probs
    w: torch.Tensor  # (N, T) token weights, loss_weights'
    denom: float  # D, the policy term's normaliser
    kl_denom: float  # D_kl, the KL term's

def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple:
    """The PPO-clip token loss l (derivation), r = exp(logp - old_logp): (M,) inputs -> (loss, clip
    active bool), each (M,). On-policy r == 1 (REINFORCE) when old_logp is logp.detach(); train's
    comes from token_stats, not head_logp: on a first inner update r is 1 up to rounding (~1e-6)."""
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, clip_active(adv, ratio.detach(), clip_low, clip_high)

def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman, "Approximating KL divergence"):
    exp(d) - d - 1, d = ref - logp: >= 0, 0 where the two agree, E_{y ~ pi_theta}[k3] = KL. (M,)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1

def micro_batch_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                     kept: torch.Tensor, ref_logp: torch.Tensor, w: torch.Tensor,
                     objective: Objective) -> tuple:
    """The objective L (derivation) on one micro-batch's M needed tokens, every input (M,)
    -> (loss, counts): counts["clipped"] the kept tokens with an active clip, counts["kl"] the sum
    of k3, counts["live"] the tokens with a gradient (deviation 6), each once."""
    o = objective
    pg, clip_m = grpo_token_loss(logp, old_logp, adv, o.clip_low, o.clip_high)  # (M,)
    loss = (pg * kept * w).sum() / o.denom
    live = kept & ~clip_m & (adv != 0)  # (M,)
    counts = dict(clipped=int((clip_m & kept).sum()), kl=0.0)
    if o.kl_beta > 0:
        kl = k3_kl(logp, ref_logp)  # (M,)
        loss = loss + o.kl_beta * (kl * w).sum() / o.kl_denom  # D_kl ignores the selection
        counts["kl"] = float(kl.detach().sum())
        # a KL token has a gradient iff pi_ref / pi_theta != 1 (dk3/dlogp = 1 - pi_ref / pi_theta)
        live = live | (torch.exp(ref_logp - logp.detach()) != 1)
    counts["live"] = int(live.sum())
    return loss, counts

def loss_backward(model, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor,
                  old_logp: torch.Tensor, objective: Objective, *, micro_batch: int, chunk: int,
                  ref_logp: torch.Tensor = None, valid: torch.Tensor = None) -> dict:
    """Accumulate into .grad micro_batch_loss's gradient, a micro-batch of answers at a time, by
    micro_batch_logp (the KL reference's pass). Masks, (N, T):
      valid     the loss's tokens, KL's too (default resp_mask; --overlong-filter: none truncated)
      sel_mask  the kept tokens, the policy term's
      need      the tokens whose log-prob is computed: the kept ones, with KL every valid one
    Only `need` enters the lm_head (the others' gradient is 0: leaving them out is exact) -> loss,
    clip_frac (of the kept), kl (per valid token), live (tokens with a gradient: deviation 6)."""
    if valid is None:
        valid = batch["resp_mask"]
    need = sel_mask | valid if objective.kl_beta > 0 else sel_mask
    totals = dict(loss=0.0, clipped=0, live=0, kl=0.0)
    passes = micro_batch_logp(model, batch, need, objective.temperature, micro_batch, chunk)
    for rows, m, logp in passes:
        ref = ref_logp[rows][m] if objective.kl_beta > 0 else None  # (M,)
        a = adv[rows][:, None].expand_as(m)[m]  # (M,)
        loss, counts = micro_batch_loss(logp, old_logp[rows][m], a, sel_mask[rows][m], ref,
                                        objective.w[rows][m], objective)
        loss.backward()
        totals["loss"] += float(loss.detach())
        for key, value in counts.items():
            totals[key] += value
    n_sel = max(int(sel_mask.sum()), 1)
    n_valid = max(int(valid.sum()), 1)
    return dict(loss=totals["loss"], clip_frac=totals["clipped"] / n_sel,
                kl=totals["kl"] / n_valid, live=totals["live"])

def policy_update(model, opt, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor,
                  old_logp: torch.Tensor, objective: Objective, *, micro_batch: int, chunk: int,
                  max_grad_norm: float, ref_logp: torch.Tensor = None,
                  valid: torch.Tensor = None) -> dict:
    """One optimiser step on the kept tokens (the arguments as loss_backward's) by deviation 6's
    step rule: A = 0 everywhere, with the policy at its reference, moves neither the weights nor
    the Adam moments. Adds grad_norm (the parameter-gradient norm, unclipped), skipped, stepped."""
    opt.zero_grad(set_to_none=True)
    stats = loss_backward(model, batch, adv, sel_mask, old_logp, objective,
                          micro_batch=micro_batch, chunk=chunk, ref_logp=ref_logp, valid=valid)
    grad_norm = 0.0
    if stats["live"]:
        params = [p for p in model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    finite = math.isfinite(grad_norm) and math.isfinite(stats["loss"])
    stats.update(grad_norm=grad_norm, skipped=int(not finite),
                 stepped=int(stats["live"] > 0 and finite))
    if stats["stepped"]:
        opt.step()
    opt.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights or the Adam moments
    return stats

# ==== Training loop [paper: the algorithm box; the numbered comments: the algorithm steps] ========
@dataclass
class Run:
    """The state a step starts from (start_run, in the supporting code, makes it)."""
    model: torch.nn.Module  # the policy, fp32 master weights
    tok: object  # its tokenizer
    opt: torch.optim.Optimizer  # AdamW
    ref: object  # the KL reference (deviation 7), or None with --kl-beta 0
    sampler: object  # the weights generate() reads: the model itself or its bf16 copy
    task: dict  # TASKS[cfg.task]
    data: object  # Data: draw(n, *key) -> training rows, the held-out rows (read_data)
    chat: bool  # prompts in the chat template
    fast: bool  # generate with a static KV cache
    start: int  # the first step to run (1 for a new run)
    skipped: int  # updates skipped so far for a non-finite loss or gradient
    log_step: object  # rec -> metrics.jsonl, the tracker, the step line (step_logger)

def sample_groups(run: Run, cfg: Config, step: int) -> tuple:
    """Algorithm steps 1-4 of GRPO step `step` -> (batch, rewards (N,), adv (N,), parts), B x G:
    with --filter-groups (deviation 5) more batches until B groups are informative or --max-resample
    are drawn, joined by filter_groups; parts: each batch drawn, (batch, rewards, adv)."""
    B, G = cfg.prompts_per_step, cfg.group_size
    max_batches = cfg.max_resample if cfg.filter_groups else 1
    parts = []
    n_informative = 0
    while len(parts) < max_batches and n_informative < B:
        # 1. B training prompts (the k-th rollout batch of a step draws with the key (step, k))
        rows = run.data.draw(B, step, len(parts))
        prompts = build_prompts(run.tok, run.task, rows, run.chat, cfg.short_prompt,
                                cfg.prompt_style)
        # 2. G answers per prompt from the sampler, with its own log-probs (answer n answers
        # prompt n // G), in generate() calls of --rollout-rows answers (sample_answers)
        batch = sample_answers(run, prompts, cfg)
        # 3. one reward per answer from the task's verifier (the Rewards section), each timed
        answered = [rows[n // G] for n in range(len(batch["texts"]))]
        rewards, batch["grade_s"], batch["grade_timeout"] = grade_answers(
            run.task, batch["texts"], answered)  # (N,) each
        # 4. group advantages
        adv = group_advantages(rewards, G, cfg.std_normalize).to(batch["comp_ids"].device)  # (N,)
        parts.append((batch, rewards, adv))
        n_informative += int(informative(rewards, G).sum())
    if not cfg.filter_groups:
        return batch, rewards, adv, parts
    return (*filter_groups(parts, G, B, run.tok.pad_token_id), parts)

def step_method(cfg: Config, score_fn=None) -> Method:
    """Algorithm step 6's method: METHODS[cfg.select], or train's score_fn: a Method as given, a
    bare score function as a Method that keeps zero scores, at --select's scope."""
    if isinstance(score_fn, Method):
        return score_fn
    if score_fn is not None:
        return Method(score_fn, True, METHODS[cfg.select].scope)
    return METHODS[cfg.select]

def selection_rule(cfg: Config, method: Method = None) -> tuple:
    """(rho, group_size) of algorithm step 6: 'all' and band methods (rsi) have no budget (rho 1
    over the batch), the others --scope's: group (G), batch (0), auto: the method's (default
    METHODS[cfg.select]'s)."""
    if method is None:
        method = METHODS[cfg.select]
    if cfg.select == "all" or method.band:
        return 1.0, 0
    scope = method.scope if cfg.scope == "auto" else cfg.scope
    if scope == "group":
        return cfg.rho, cfg.group_size
    return cfg.rho, 0

def step_selection(cfg: Config, logp, entropy, dz_norm, om, mask, score_fn=None) -> torch.Tensor:
    """Algorithm step 6 as train() runs it, all (N, T): select_tokens by step_method's score, zero
    rule (deviation 9) and scope (selection_rule); a band method keeps its closed interval
    (no ties to break: a token on a bound is kept; NaN never is)."""
    method = step_method(cfg, score_fn)
    rho, group_size = selection_rule(cfg, method)
    scores = method.score(logp, entropy, dz_norm, om)
    if method.band:
        return mask & (scores >= cfg.rsi_low) & (scores <= cfg.rsi_high)
    return select_tokens(scores, mask, rho, not method.zero_kept, group_size)

def train(cfg: Config, log=print, score_fn=None) -> str:
    """GRPO with token selection (the docstring's algorithm steps 1-8) -> the output folder.
    score_fn: step_method's (the notebook trains its own score through it)."""
    with start_run(cfg, log) as run:  # the run folder (locked), data, model, optimiser, step 0
        model, opt = run.model, run.opt
        mb, chunk = cfg.micro_batch, cfg.stats_chunk  # answers per forward, tokens per head call
        method = step_method(cfg, score_fn)
        model.train()
        for step in range(run.start, cfg.steps + 1):
            t0 = time.time()
            set_seed(cfg.seed * 1_000_003 + step)  # a step's randomness depends on (seed, step)
            # 1-4. B prompts, G answers each, their rewards and group advantages (sample_groups)
            batch, rewards, adv, parts = sample_groups(run, cfg, step)
            valid = batch["resp_mask"]  # the tokens the loss may use
            if cfg.overlong_filter:  # DAPO's overlong filtering: a truncated answer trains nothing
                valid = valid & ~batch["truncated"][:, None]
            t_roll = time.time() - t0
            # 5. log pi(y_t), H_t, dz_norm (N, T) of pi_old, the fp32 policy before this update
            # (a bf16 copy of it sampled under --sampler-dtype bf16); the KL reference's log-probs
            logp, entropy, dz_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
            old_logp = logp
            ref_logp = None
            if run.ref is not None:
                ref_logp = response_logp(run.ref, batch, valid, cfg.temperature, mb, chunk)
            # the loss's settings; 'selected' divides by scope_budget's count, the mask's budget
            rho, group_size = selection_rule(cfg, method)
            n_kept = int(scope_budget(valid, rho, group_size)[1].sum())
            weights = loss_weights(cfg.loss_norm, valid, n_kept, cfg.group_size)  # w, D, D_kl
            objective = Objective(cfg.clip_low, cfg.clip_high, cfg.kl_beta, cfg.temperature,
                                  **weights)
            for inner in range(cfg.inner_updates):
                if inner > 0:  # the policy has moved: its statistics again
                    logp, entropy, dz_norm = batch_token_stats(model, batch, cfg.temperature, mb,
                                                               chunk)
                # 6. omega (-dL/dlogp of the loss: derivation step 1), scores, the top rho of each
                # prompt's group (--scope group: GMTS's authors) or of the whole batch (deviation
                # 1); rsi: an interval of its score instead
                ref_ratio = None if ref_logp is None else torch.exp(ref_logp - logp)
                ratio = torch.exp(logp - old_logp)  # (N, T)
                om = omega(adv, ratio, cfg.clip_low, cfg.clip_high, cfg.kl_beta, ref_ratio,
                           **weights)  # (N, T)
                sel_mask = step_selection(cfg, logp, entropy, dz_norm, om, valid, method)
                # 7. PPO-clip update on the kept tokens; one lr schedule and one step rule for all
                for group in opt.param_groups:
                    group["lr"] = step_lr(cfg, step, inner)
                stats = policy_update(model, opt, batch, adv, sel_mask, old_logp, objective,
                                      micro_batch=mb, chunk=chunk,
                                      max_grad_norm=cfg.max_grad_norm, ref_logp=ref_logp,
                                      valid=valid)
                run.skipped += stats["skipped"]
            refresh_sampler(run.sampler, model)
            # 8. log, evaluate (every --eval-every steps and the last), checkpoint (--save-every)
            rec = step_record(step, cfg, parts, batch, valid, rewards, adv, old_logp, entropy,
                              sel_mask, stats, opt, run.skipped, t0, t_roll)
            if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps:
                rec.update(evaluate_run(run, cfg, log))
            run.log_step(rec)
            if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.steps:
                save_checkpoint(cfg.out, step, run)
    return cfg.out  # the with's end saved the final model there

# Supporting code [plumbing]: what lets the method above run; a reader of the paper may stop here.

def hub_bars(stream=sys.stderr, environ=os.environ):
    """The hub's and datasets' download bars where a person watches (stream a terminal: a first
    paper-math run downloads a model and six data sets); off in logs, CI and tests. A variable
    the user set wins. The libraries read these when they are imported, after this runs."""
    if not stream.isatty():
        environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

hub_bars()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

class RunError(RuntimeError):
    """A run that cannot go on, not for its input's sake: one line, exit 1 (run_cli)."""

class BadInput(ValueError):
    """What the user gave (a flag, a file, a path, a folder's state) cannot be used: one line,
    exit 2, raised by the checks that run before any work (run_cli)."""

# ==== The lr schedule [plumbing]: warm-up and decay over update slots, all methods alike ==========
def lr_factor(i: int, total: int, warmup: int, decay: bool = True) -> float:
    """lr multiplier at update slot i (0-based) of `total` (one per inner update, stepped or not):
    a linear warm-up over `warmup` slots, then a linear decay (TRL's) unless decay=False."""
    up = (i + 1) / max(warmup, 1)
    down = max(total - i, 1) / max(total - warmup, 1) if decay else 1.0
    return min(1.0, up, down)

def step_lr(cfg: Config, step: int, inner: int) -> float:
    """The lr of inner update `inner` of GRPO step `step` (from 1): slot (step - 1) * mu + inner."""
    slot = (step - 1) * cfg.inner_updates + inner
    return cfg.lr * lr_factor(slot, cfg.steps * cfg.inner_updates, cfg.warmup_steps, cfg.lr_decay)

# ==== Math answers [plumbing]: math_reward's final answer, numbers, and LaTeX by math-verify ====
# [0-9], not \d (which matches other scripts' digits too)
_DEC = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_NUM_TOKEN = re.compile(r"-?\$?[0-9][0-9,.]*")  # one character class per run: no backtracking

def _decimal(s: str, signed: bool):
    """Exact value of '1,450', '72.00' or '.5' (with signed=True also '-20'), else None."""
    sign = 1
    if signed and s.startswith("-"):
        sign = -1
        s = s[1:].strip()
    if len(s) > 60 or not _DEC.fullmatch(s):  # <= ~50 digits before Fraction sees them
        return None
    return sign * Fraction(s.replace(",", ""))

def parse_number(s: str):
    """Exact value of '-$1,450', '72.00', '18.', '50%', '\\frac{1}{2}', '\\frac{-20}{2}', '3/4' ...
    (else None)."""
    s = s.strip()
    if len(s) > 100:
        return None
    s = s.replace("{,}", ",").replace("\\,", ",")  # LaTeX thousands separators
    sign = 1
    if s.startswith("-"):
        sign = -1
        s = s[1:].strip()
    s = s.removeprefix("\\$").removeprefix("$")
    s = s.removesuffix(".").removesuffix("\\%").removesuffix("%").strip()
    m = _FRAC.fullmatch(s)
    if m:
        parts = list(m.groups())
    elif s.count("/") == 1:
        parts = s.split("/")
    else:
        value = _decimal(s, signed=False)
        if value is None:
            return None
        return sign * value
    top = _decimal(parts[0].strip(), signed=True)  # a fraction: a sign on either side
    bottom = _decimal(parts[1].strip(), signed=True)
    if top is None or bottom is None or bottom == 0:
        return None
    return sign * top / bottom

# -- the final answer: the last \boxed{} (or \fbox{}), the number after ####, an 'Answer:' line --
BOX_CAP = 1000  # characters: a last \boxed{} not closed within them is no answer (a truncated one)

def _last_box(text: str, tries: int = 5) -> int:
    """Where the last \\boxed{ or \\fbox{ (a space before '{' allowed) opens: the index after its
    '{', or -1. A few bare mentions of \\boxed (no '{' after them) are passed over."""
    end = len(text)
    for _ in range(tries):
        i = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if i < 0:
            return -1
        j = i + (len("\\boxed") if text.startswith("\\boxed", i) else len("\\fbox"))
        while j < min(len(text), i + 20) and text[j] == " ":
            j += 1
        if text.startswith("{", j):
            return j + 1
        end = i
    return -1

def _last_boxed(text: str, cap: int = BOX_CAP):
    """The last \\boxed{...}'s (or \\fbox{...}'s) content, or None: no box, or the last one not
    closed within cap characters (a truncated answer: an earlier box never stands in for it)."""
    start = _last_box(text)
    if start < 0:
        return None
    depth = 1
    for j in range(start, min(len(text), start + cap)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j]
    return None

def _last_number(text: str):
    """The last run of digits, commas, points (<= ~60 characters; a '-' before it kept), or None."""
    last_digit = max(text.rfind(d) for d in "0123456789")  # ten C-speed scans, no regex
    if last_digit < 0:
        return None
    first = last_digit
    while first > 0 and last_digit - first < 60 and text[first - 1] in "0123456789,.":
        first -= 1
    number = text[first:last_digit + 1].lstrip(",.")
    if first > 0 and text[first - 1] == "-":
        number = "-" + number
    if parse_number(number) is None:
        return number.rsplit(",", 1)[-1]  # "3,4,5" is a list: take 5
    return number

def math_final_answer(text: str, boxed_only: bool = False):
    """The last \\boxed{} (None if it is not closed: a truncated answer), else the number after the
    last ####, else the last number in the text (or None). boxed_only (competition answers): the
    last \\boxed{} only."""
    if boxed_only or _last_box(text) >= 0:
        return _last_boxed(text)
    k = text.rfind("####")
    if k < 0:
        return _last_number(text)
    m = _NUM_TOKEN.search(text, k + 4, k + 104)
    return None if m is None else m.group().rstrip(",.")

def _answer_line(text: str):
    """What follows the last 'Answer:' to its line's end ($, \\boxed{} around it gone) or None."""
    k = text.rfind("Answer:")
    if k < 0:
        return None
    line = text[k + len("Answer:"):k + 400].split("\n", 1)[0].strip().strip("$").strip()
    boxed = _last_boxed(line)
    return boxed if boxed is not None else line or None

# -- numbers: parse_number's forms and those LaTeX answers add, exact --
_SCI = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)[eE]([-+]?[0-9]{1,3})")  # 4.5e33, 1.2E-5
_TIMES_TEN = re.compile(  # 4.5 \times 10^{33}, 6 \cdot 10^8, 10^{-5}
    r"(?:(.+?)\s*(?:\\times|\\cdot|\*)\s*)?10\s*\^\s*(?:\{\s*([-+]?[0-9]{1,3})\s*\}|([0-9]))")
# 0.1\overline{6}, 4\frac{2}{3}
_REPEATING = re.compile(r"([0-9]*)\.([0-9]*)\s*\\(?:overline|bar)\s*\{([0-9]{1,30})\}")
_MIXED = re.compile(r"([0-9]{1,30})\s*\\[dt]?frac\s*\{([0-9]{1,30})\}\s*\{([0-9]{1,30})\}")

def read_number(s: str):
    """Exact value of a LaTeX answer's number: parse_number's forms, e-notation (4.5e33, read as a
    number, not as 4.5 * e * 33), a power of ten (4.5 \\times 10^{33}, 10^{-5}), a repeating decimal
    (0.\\overline{3}, 0.1\\overline{6}), a mixed number (4\\frac{2}{3}), with a sign; else None."""
    s = s.strip()
    if len(s) > 100:
        return None
    sign = -1 if s.startswith("-") else 1
    if s[:1] in "-+":
        s = s[1:].strip()
    m = _SCI.fullmatch(s)
    if m:
        return sign * Fraction(m[1]) * Fraction(10) ** int(m[2])
    m = _TIMES_TEN.fullmatch(s)
    if m:
        mantissa = Fraction(1) if m[1] is None else parse_number(m[1])
        exponent = int((m[2] or m[3]).replace("+", ""))
        return None if mantissa is None else sign * mantissa * Fraction(10) ** exponent
    m = _REPEATING.fullmatch(s)
    if m:
        whole, fixed, repeat = m[1] or "0", m[2], m[3]
        shift = Fraction(1, 10 ** len(fixed))
        return sign * (int(whole) + int(fixed or "0") * shift
                       + Fraction(int(repeat), 10 ** len(repeat) - 1) * shift)
    m = _MIXED.fullmatch(s)
    if m and 0 < int(m[2]) < int(m[3]):
        return sign * (int(m[1]) + Fraction(int(m[2]), int(m[3])))
    n = parse_number(s)
    return None if n is None else sign * n

def _exact(n: Fraction) -> str:
    """A number as LaTeX that math-verify reads exactly: '-3', '\\frac{1}{3}'."""
    if n.denominator == 1:
        return str(n.numerator)
    return "-" * (n < 0) + f"\\frac{{{abs(n.numerator)}}}{{{n.denominator}}}"

# -- units: one table of spellings; an answer's unit read from its end (value_unit) --
_TEXT = r"\\(?:text|textnormal|textrm|textup|textsf|textit|textbf|mathrm|mbox|operatorname)"
_GROUP = r"\{(?:[^{}]|\{[^{}]*\})*\}"  # {...}, one level of braces inside
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])")
# A unit's symbol: (its kind, its other spellings); a spelling's plural in -s or -es reads too
_UNITS = {
    "m": ("length", "meter metre"), "cm": ("length", "centimeter centimetre"),
    "mm": ("length", "millimeter millimetre"), "km": ("length", "kilometer kilometre"),
    "um": ("length", "µm micrometer micron"), "nm": ("length", "nanometer nanometre"),
    "pm": ("length", "picometer picometre"), "Å": ("length", "angstrom"),
    "in": ("length", "inch"), "ft": ("length", "foot feet"), "yd": ("length", "yard"),
    "mi": ("length", "mile"),
    "s": ("time", "sec second"), "min": ("time", "minute"), "h": ("time", "hr hour"),
    "day": ("time", ""), "week": ("time", "wk"), "month": ("time", ""), "yr": ("time", "year"),
    "g": ("mass", "gram"), "kg": ("mass", "kilogram"), "mg": ("mass", "milligram"),
    "lb": ("mass", "pound"), "oz": ("mass", "ounce"), "ton": ("mass", "tonne"),
    "L": ("volume", "l liter litre"), "mL": ("volume", "ml milliliter millilitre"),
    "gal": ("volume", "gallon"), "unit": ("unit", ""),
    "$": ("money", "dollar usd"), "cent": ("money", "¢ \\textcent"), "%": ("percent", "percent"),
    "deg": ("angle", "degree"), "rad": ("angle", "radian"),
    "K": ("temperature", "kelvin"), "C": ("temperature", "celsius"),
    "F": ("temperature", "fahrenheit"),
    "J": ("energy", "joule"), "eV": ("energy", "electronvolt"), "erg": ("energy", ""),
    "cal": ("energy", "calorie"), "kcal": ("energy", "kilocalorie"), "N": ("force", "newton"),
    "W": ("power", "watt"), "V": ("voltage", "volt"), "M": ("concentration", "molar"),
}
_UNIT_ALIAS = {w: sym for sym, (_, spellings) in _UNITS.items() for w in [sym, *spellings.split()]}
_COMPOUND = {"mph": {"mi": 1, "h": -1}, "kph": {"km": 1, "h": -1}, "kmh": {"km": 1, "h": -1},
             "cc": {"cm": 3}}  # spellings of a unit of several symbols
_BARE = {"cm", "mm", "km", "ft", "in", "yd", "mi", "kg", "lb", "oz", "hr"}  # 2 letters, no \text
_MAGNITUDE = {"hundred": 2, "thousand": 3, "million": 6, "billion": 9, "trillion": 12,
              "tenth": -1, "hundredth": -2, "thousandth": -3, "millionth": -6}  # words x 10^k
_POWER_WORD = {"square": 2, "sq": 2, "cubic": 3, "cu": 3, "squared": 2, "cubed": 3}
_NUMBER_WORD = dict(zip(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split(), range(21)))
_NUMBER_WORD.update(zip("thirty forty fifty sixty seventy eighty ninety".split(),
                        range(30, 100, 10)))

def _singular(w: str) -> str:
    """An English plural's singular, roughly: boxes -> box, pennies -> penny, hours -> hour."""
    if len(w) < 4 or not w.endswith("s") or w.endswith("ss"):
        return w
    if w.endswith(("sses", "xes", "ches", "shes", "zzes")):
        return w[:-2]
    return w[:-3] + "y" if w.endswith("ies") else w[:-1]

def _unit_word(word: str) -> str:
    """A unit word's symbol (a spelling's, its plural's), else the word: lower case, singular."""
    for w in dict.fromkeys([word, word.lower()]):
        plurals = [w[:-1], w[:-2]] if len(w) > 2 and w.endswith("s") else []
        for form in [w, *plurals]:
            if form in _UNIT_ALIAS:
                return _UNIT_ALIAS[form]
    return _singular(word.lower())

def _magnitude(word: str):
    """10's power a magnitude word (thousand, millions, hundredths) stands for, else None."""
    w = word.lower()
    return _MAGNITUDE.get(w, _MAGNITUDE.get(w[:-1])) if w.endswith("s") else _MAGNITUDE.get(w)

def _unit_of(text: str) -> tuple:
    """Unit words ('hundred thousand', 'square feet', 'km/h', 'm s^{-1}', 'miles per hour', '\\%')
    -> (the power of 10 of their leading magnitude words, the unit as a canonical string)."""
    text = re.sub(r"(?:\\mu|µ|μ)\s*", "µ", _DEGREE.sub(" deg ", text))
    for latex, symbol in (("\\$", "$"), ("\\%", "%"), ("\\AA", "Å"), ("\\textcent", "¢")):
        text = text.replace(latex, symbol)
    text = re.sub(r"\\[A-Za-z]+", " ", text)  # \cdot, \quad, \text: no unit words
    exp10, unit, last, sign, power = 0, collections.Counter(), None, 1, 1
    for word in re.findall(r"\^\s*\{?\s*-?\s*[0-9]|/|[A-Za-z$%¢µÅ]+", text):
        w = word.lower()
        if word.startswith("^") or w in ("squared", "cubed"):  # the power of the symbol before it
            p = _POWER_WORD[w] if w in _POWER_WORD else int(re.sub(r"[^-0-9]", "", word))
            if last:
                unit[last[0]] += last[1] * (p - 1)
        elif w in ("/", "per"):
            sign = -1
        elif w in _POWER_WORD:
            power = _POWER_WORD[w]
        elif not unit and _magnitude(w) is not None:
            exp10 += _magnitude(w)
        else:
            symbol = _unit_word(word)
            for sym, p in _COMPOUND.get(symbol, {symbol: 1}).items():
                unit[sym] += sign * power * p
            last = (symbol, sign * power) if symbol not in _COMPOUND else None
            sign, power = 1, 1
    return exp10, " ".join(s if p == 1 else f"{s}^{p}" for s, p in sorted(unit.items()) if p)

def unit_kind(unit: str) -> str:
    """A canonical unit's kind: 'h^-1 km' -> 'length time^-1'; an unknown symbol is its own."""
    kinds = collections.Counter()
    for part in unit.split():
        sym, _, p = part.partition("^")
        kinds[_UNITS.get(sym, (sym,))[0]] += int(p or 1)
    return " ".join(k if p == 1 else f"{k}^{p}" for k, p in sorted(kinds.items()) if p)

def same_unit(a: str, b: str) -> bool:
    """Whether two units' words ('cm', 'centimeters'; 'mph', 'miles per hour') are one unit."""
    return _unit_of(a)[1] == _unit_of(b)[1]

_TOKEN = re.compile(  # an answer's pieces, for value_unit to read its unit from the end
    rf"(?P<text>{_TEXT}\s*{_GROUP}|\{{\s*~\s*[A-Za-z]+\s*\}})"  # \text{ cm}, Minerva's {~m}
    rf"|(?P<frac>\\[dt]?frac\s*{_GROUP}\s*{_GROUP})"  # \frac{\text{m}}{\text{s}}
    rf"|(?P<deg>{_DEGREE.pattern})"
    r"|(?P<power>\^\s*(?:\{\s*-?\s*[0-9]\s*\}|-?[0-9]))"
    r"|(?P<sign>\\%|%|\\AA(?![A-Za-z])|¢|µ|μ|\\mu(?![A-Za-z]))"
    r"|(?P<word>[A-Za-z]+)"
    r"|(?P<op>/|\\cdot(?![A-Za-z]))"
    r"|(?P<gap>\s+|\\[,;:! ]|~|\\q?quad(?![A-Za-z]))"
    r"|\\[A-Za-z]+|.", re.S)
_LETTER = re.compile(rf"{_TEXT}\{{ *([A-Za-z]) *\}}")  # \mathrm{i}: the letter i
_MONEY = re.compile(r"(-?)\s*\\?\$\s*(?=[0-9.]|\\[dt]?frac)")  # \$5, $5, -\$5, \$\frac{1}{2}

def _unit_text(token) -> str:
    """A unit token's words: a \\text{}'s content, a \\frac{}{}'s as 'top / bottom', else itself."""
    if token.lastgroup == "frac":
        top, bottom = re.match(rf"\\[dt]?frac\s*({_GROUP})\s*({_GROUP})", token[0]).groups()
        return f" {top[1:-1]} / {bottom[1:-1]} "
    if token.lastgroup == "text":
        return " " + token[0].split("{", 1)[1][:-1] + " "
    return token[0]

def _is_unit_word(word: str) -> bool:
    """A bare word (no \\text{}) read as a unit: a symbol or spelling of one (a two-letter one
    only from _BARE: mg may be m times g), a magnitude or power word, per."""
    w = word.lower()
    if len(word) == 2 and _unit_word(word) not in _BARE and w not in _BARE:
        return False
    return (_unit_word(word) in _UNITS or w in _COMPOUND or _magnitude(w) is not None
            or w in _POWER_WORD or w == "per")

def _word_number(word: str):
    """'four' -> '4', 'Twenty-one' -> '21'; else None."""
    tens, _, ones = word.lower().partition("-")
    n, k = _NUMBER_WORD.get(tens), _NUMBER_WORD.get(ones, None if ones else 0)
    if n is None or k is None or (ones and (n < 20 or n % 10 or not 0 < k < 10)):
        return None
    return str(n + k)

def _number_words(s: str) -> str:
    """An answer that starts with a number word, as digits: 'four' -> '4', '\\mbox{four}' -> '4',
    '\\text{two hundred}' -> '2\\text{ hundred}'."""
    inner = re.fullmatch(rf"{_TEXT}\s*\{{([^{{}}]*)\}}", s)
    words = inner[1] if inner else s
    m = re.match(r"\s*([A-Za-z]+(?:-[A-Za-z]+)?)(?![A-Za-z-])", words)
    n = m and _word_number(m[1])
    if not n:
        return s
    rest = words[m.end():]
    return n + (f"\\text{{{rest}}}" if rest.strip() else "")

@functools.lru_cache(maxsize=1 << 12)  # a gold is split again for each answer graded against it
def value_unit(s: str, letters: bool = False) -> tuple:
    """A LaTeX answer -> (its value, its unit: a canonical string, "" for none). No $...$ around
    it, no trailing . , ;, a leading number word as digits. The unit: what ends it after a value:
    the words of \\text{}, \\mathrm{}, \\mbox{}, \\textnormal{} ... (a one-letter one that is no
    unit, \\mathrm{i}, stays in the value), ^\\circ, \\%, a leading \\$, bare unit words (5 miles,
    60 mph), powers, / and per, the spacing before it; bare single letters (5 m, 5 m/s) only with
    letters=True. Magnitude words (10\\text{ thousand}, 5 million, 3 tenths) are no unit: they
    multiply the value."""
    s = s.strip().rstrip(".,; ")
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) > len(a + b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):-len(b)].strip().rstrip(".,; ")
    s = _number_words(s)
    money = _MONEY.match(s)
    if money:
        s = money[1] + s[money.end():]
    tokens = list(_TOKEN.finditer(s))
    i, explicit = len(tokens), bool(money)
    while i > 0:
        kind, word = tokens[i - 1].lastgroup, tokens[i - 1].group()
        letter = _LETTER.fullmatch(word)
        if kind == "text" and letter and letter[1] not in _UNITS:  # \mathrm{i}: the value's
            break
        if kind == "frac" and (not re.search(_TEXT, word) or re.search("[0-9]", word)):
            break  # \frac{1}{2}: a number, not \frac{\text{m}}{\text{s}}
        if kind == "word" and not _is_unit_word(word):
            break
        if kind not in ("text", "frac", "deg", "sign", "word", "power", "op", "gap"):
            break
        explicit = explicit or kind in ("text", "frac", "deg", "sign")
        explicit = explicit or (kind == "word" and len(word) > 1)  # 5 cm; 5 m: a letter
        i -= 1
    while i < len(tokens) and tokens[i].lastgroup == "power":  # x^2 cm: ^2 is the value's
        i += 1
    start = tokens[i].start() if i < len(tokens) else len(s)
    value = _DEGREE.sub("", s[:start]).strip()
    tail = s[start:]
    bare = not any(t.lastgroup in ("text", "frac", "deg") for t in tokens[i:])
    if not value or (bare and not re.search(r"[0-9})]$", value)) or not (explicit or letters):
        value, tail = _DEGREE.sub("", s).strip(), ""
    words = "".join(_unit_text(t) for t in _TOKEN.finditer(tail)) + " $" * bool(money)
    exp10, unit = _unit_of(words)
    value = _LETTER.sub(r"\1", value)
    n = read_number(value) if exp10 else None
    if n is not None:
        value = _exact(n * Fraction(10) ** exp10)
    elif exp10:
        value = f"{value}\\times10^{{{exp10}}}"
    return value or s, unit

def _pair_units(gold: str, got: str) -> tuple:
    """value_unit of both sides, a bare letter after a value (5 m, 5 m/s) decided by the pair: a
    unit where the other side's unit is of its kind, or in the answer where the gold has no unit
    and no such letter; else a variable (Minerva's '\\frac{37}{4} m' is not '\\frac{37}{4}')."""
    g, a = value_unit(gold), value_unit(got)
    g_letter, a_letter = value_unit(gold, True), value_unit(got, True)
    if g_letter != g and a[1] and unit_kind(g_letter[1]) == unit_kind(a[1]):
        g = g_letter
    gold_variable = g_letter != g
    if a_letter != a and (unit_kind(a_letter[1]) == unit_kind(g[1]) if g[1] else not gold_variable):
        a = a_letter
    return g, a

def _brackets(s: str) -> str:
    """'set' for \\{1, 2\\} (not a set of tuples); 'tuple' for one (..) or [..] group with a comma
    in it (a tuple, an interval); else ''."""
    s = s.replace("\\left", "").replace("\\right", "").replace("\\lbrace", "\\{")
    s = s.replace("\\rbrace", "\\}").strip()
    if s.startswith("\\{") and s.endswith("\\}"):
        return "" if s[2:].lstrip().startswith(("(", "[")) else "set"
    if s[:1] not in ("(", "[") or s[-1:] not in (")", "]") or "," not in s:
        return ""
    depth = 0
    for k, c in enumerate(s):
        depth += (c in "([") - (c in ")]")
        if depth == 0 and k < len(s) - 1:  # (1,2) \cup (3,4): two groups
            return ""
    return "tuple"

# The forms of a value handed to math-verify 0.9, which misreads these
_POWER_ARG = re.compile(  # \sin^2 t
    r"(\\(?:sin|cos|tan|sec|csc|cot)\^(?:[0-9]|\{[0-9]+\}))\s*([A-Za-z])(?![A-Za-z])")
_SPACED_OP = re.compile(r"\s*([-+=])\s*")  # it reads 'a + b + c' as 'a +'
_DIGIT_I = re.compile(r"(?<=[0-9])i(?![A-Za-z])")  # it reads 2i's i as real, 2 i's not
_END_LETTERS = re.compile(  # its unit rule drops 2t's t, 2ab's ab (not an ordinal's th, 5 pm's pm)
    r"(?<=[0-9}\s)])(?!(?:st|nd|rd|th|am|pm)\s*$)([A-Za-z]{1,2})\s*$")

def normal_answer(s: str) -> str:
    """A LaTeX answer's value (value_unit's) as math-verify 0.9 reads it right: a number only
    read_number reads (4.5e33) exact, no spaces around + - =, \\sin^2 t as \\sin^{2}(t), 2i as 2 i,
    one or two letters at the end in braces (2{t}: its unit rule drops a t, m, ab there)."""
    s = value_unit(s)[0]
    n = read_number(s)
    if n is not None and parse_number(s) is None:
        return _exact(n)
    s = _POWER_ARG.sub(lambda m: f"{m[1]}({m[2]})", s)
    s = _DIGIT_I.sub(" i", _SPACED_OP.sub(r"\1", s))
    return _END_LETTERS.sub(r"{\1}", s)

def bare_answer(s: str) -> str:
    """The fallback's form (the rule: these strings equal) of an answer math-verify cannot read."""
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", normal_answer(s))
    for a, b in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                 ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", "")):
        s = s.replace(a, b)
    return "".join(s.split())

def same_latex(gold: str, got: str) -> bool:
    """A LaTeX answer against its gold: a unit on both sides (_pair_units') must be one (on one side
    only it is not compared); a set is no tuple or interval; two numbers (read_number) must be
    equal; anything else goes to math-verify as normal_answer forms, or where math-verify cannot
    read the gold, their bare_answer forms must be equal."""
    (g, g_unit), (a, a_unit) = _pair_units(gold, got)
    if g_unit and a_unit and g_unit != a_unit:
        return False
    if {_brackets(g), _brackets(a)} == {"set", "tuple"}:
        return False
    g_number, a_number = read_number(g), read_number(a)
    if g_number is not None and a_number is not None:
        return g_number == a_number
    g = normal_answer(g)
    if latex_equal(g):
        return latex_equal(g, normal_answer(a))
    return bare_answer(gold) == bare_answer(got)

VERIFY_TIMEOUT_S = 5  # math-verify's own bound on each parse and comparison (signal.alarm)
TIMEOUTS = collections.Counter()  # math-verify's timeouts so far ("parse", "verify"): each grade's

def _verify_parse(s: str) -> list:
    """math-verify's parse of \\boxed{s}: [] where it fails, and on a timeout, counted."""
    from math_verify import parse
    from math_verify.errors import TimeoutException
    try:  # raise_on_error: its timeout is raised to us (it would only log it), not only returned
        return parse("\\boxed{" + s + "}", parsing_timeout=VERIFY_TIMEOUT_S, raise_on_error=True)
    except TimeoutException:  # a BaseException
        TIMEOUTS["parse"] += 1
    except Exception:  # what parse returns without raise_on_error
        pass
    return []

def _verify_pair(gold, got) -> bool:
    """math-verify's verify of one parsed gold against one parsed answer: False where it fails, and
    on a timeout, counted."""
    from math_verify import verify
    from math_verify.errors import TimeoutException
    try:
        return verify(gold, got, timeout_seconds=VERIFY_TIMEOUT_S, raise_on_error=True)
    except TimeoutException:
        TIMEOUTS["verify"] += 1
    except Exception:
        pass
    return False

@functools.lru_cache(maxsize=1 << 16)  # avg@k grades the same answers again
def latex_equal(gold: str, got: str = None) -> bool:
    """math-verify's verdict on two short answers as \\boxed{} contents, each parse and comparison
    within VERIFY_TIMEOUT_S (a timeout is False, counted in TIMEOUTS); got None: whether it reads
    gold as math. Its timeouts use signal.alarm, so grading runs in the main thread (a thread:
    RunError)."""
    if threading.current_thread() is not threading.main_thread():
        raise RunError("math answers are graded in the main thread (math-verify's timeouts use "
                       "signal.alarm)")
    g = _verify_parse(gold)
    if got is None:
        return any(not isinstance(x, str) for x in g)  # sympy read it, not only the string
    a = _verify_parse(got)
    return any(_verify_pair(x, y) for x, y in itertools.product(g, a))  # verify's own loop

def grade_answers(task: dict, texts: list, rows: list) -> tuple:
    """Algorithm step 3, timed: the task's verifier on each answer texts[n] against rows[n] ->
    (rewards (N,), the seconds each took (N,), whether each hit a math-verify timeout (N,)).
    A task with a batch verifier ("rewards"; code: the programs in parallel, in the sandbox) is
    timed as a whole, each answer taking an equal share."""
    if "rewards" in task:
        t = time.perf_counter()
        rewards = task["rewards"](texts, rows)
        seconds = [(time.perf_counter() - t) / max(len(texts), 1)] * len(texts)
        return (torch.tensor(rewards, dtype=torch.float32),
                torch.tensor(seconds, dtype=torch.float64),
                torch.zeros(len(texts), dtype=torch.bool))
    rewards, seconds, timed_out = [], [], []
    for text, row in zip(texts, rows):
        t, before = time.perf_counter(), sum(TIMEOUTS.values())
        rewards.append(float(task["reward"](text, row)))
        seconds.append(time.perf_counter() - t)
        timed_out.append(sum(TIMEOUTS.values()) > before)
    return (torch.tensor(rewards), torch.tensor(seconds, dtype=torch.float64),
            torch.tensor(timed_out, dtype=torch.bool))

# ==== Problem generators [plumbing]: each task's offline data ====================================
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}  # literals have precedence 3

def _combine(x: tuple, y: tuple, op: str):
    """(value, text, precedence) of `x op y`, with the parentheses it needs; None for x / 0."""
    value = _OPS[op](x[0], y[0])
    if value is None:
        return None
    p = _PREC[op]
    left = f"({x[1]})" if x[2] < p else x[1]
    right_needs = y[2] < p or (y[2] == p and op in "-/")  # a - (b + c), a / (b * c)
    right = f"({y[1]})" if right_needs else y[1]
    return value, f"{left} {op} {right}", p

def _sign_chain(nums: list, signs) -> tuple:
    """(value, text) of nums joined by signs, left to right:
    ([4, 3, 2], '+-') -> (5, '4 + 3 - 2')."""
    value = nums[0]
    text = str(nums[0])
    for sign, x in zip(signs, nums[1:]):
        value += x if sign == "+" else -x
        text += f" {sign} {x}"
    return value, text

def _random_expression(rng: random.Random, nums: list, ops: str):
    """A random expression over all of nums, combined in random order: (value, text, precedence),
    or None where a step leaves the natural numbers (a fraction, a negative, a division by 0)."""
    items = [(Fraction(x), str(x), 3) for x in nums]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)  # random order of use
        z = _combine(items[i], items[j], rng.choice(ops))
        if z is None or z[0].denominator != 1 or z[0] < 0:
            return None
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [z]
    return items[0]

def countdown_problem(rng: random.Random, n_nums=(3, 4), num_range=(1, 99),
                      target_range=(1, 1000), ops="+-*/"):
    """Random numbers and a random expression over them, whose value is the target: always
    solvable."""
    for _ in range(100_000):
        nums = [rng.randint(*num_range) for _ in range(rng.randint(*n_nums))]
        z = _random_expression(rng, nums, ops)
        if z is not None and target_range[0] <= z[0] <= target_range[1]:
            return {"nums": nums, "target": int(z[0]), "expr": z[1]}
    raise ValueError(f"no countdown problem with numbers in {num_range} and a target in "
                     f"{target_range}")

# -- math: one-step word problems (GSM8K itself: --data hf:openai/gsm8k:main:train) --
# One step whose operation only the words tell (the numbers in the step's order).
_MATH_EASY = [
    ("{who} has {a} apples and buys {b} more. How many apples now?", "+"),
    ("{who} has {a} cards and finds {b} more. How many cards now?", "+"),
    ("{who} has {a} apples and eats {b}. How many apples are left?", "-"),
    ("{who} had {a} cards and lost {b}. How many cards are left?", "-"),
    ("{who} has {a} bags of {b} apples. How many apples in all?", "*"),
    ("{who} buys {a} boxes of {b} cards. How many cards in all?", "*"),
]

def math_easy_problem(rng: random.Random) -> dict:
    """One step `a op b` on a, b in 2..9 with a >= b (so a - b >= 0); the template's words decide
    op."""
    question, op = rng.choice(_MATH_EASY)
    a, b = sorted((rng.randint(2, 9), rng.randint(2, 9)), reverse=True)
    z = _OPS[op](a, b)
    text = question.format(who=rng.choice(NAMES), a=a, b=b)
    return {"question": text, "answer": str(z), "steps": [f"{a} {op} {b} = {z}"]}

# -- logic: knights (always truthful) and knaves (always lying) --
# A claim is ("is", person, is_knight) | ("not", claim) | ("and" | "or" | "if", claim, claim).
def _holds(c: tuple, world: tuple) -> bool:
    if c[0] == "is":
        return world[c[1]] == c[2]
    if c[0] == "not":
        return not _holds(c[1], world)
    a = _holds(c[1], world)
    b = _holds(c[2], world)
    return {"and": a and b, "or": a or b, "if": (not a) or b}[c[0]]

def _say(c: tuple, names: list, me: int) -> str:
    """A claim as the person `me` says it: 'I am a knight', 'Bob is a knave', 'if ... then ...'."""
    if c[0] == "is":
        role = "knight" if c[2] else "knave"
        return f"I am a {role}" if c[1] == me else f"{names[c[1]]} is a {role}"
    if c[0] == "not":
        return "it is not the case that " + _say(c[1], names, me)
    a = _say(c[1], names, me)
    b = _say(c[2], names, me)
    return f"if {a} then {b}" if c[0] == "if" else f"{a} {c[0]} {b}"

def _random_claim(rng: random.Random, n: int, me: int) -> tuple:
    """What person `me` of n says: about one person, negated, or two joined by and/or/if."""
    p, q = rng.sample(range(n), 2)  # two different people, maybe the speaker
    form = rng.choice(["is", "not", "and", "or", "if"])
    a = rng.random() < 0.5
    b = rng.random() < 0.5
    if form in ("is", "not"):  # a plain claim is about someone else ("I am a knight": nothing)
        atom = ("is", q if p == me else p, a)
        return atom if form == "is" else ("not", atom)
    return (form, ("is", p, a), ("is", q, b))

def logic_problem(rng: random.Random, n_people=(2, 6)) -> dict:
    for _ in range(100_000):
        n = rng.randint(*n_people)
        names = rng.sample(NAMES, n)
        claims = [_random_claim(rng, n, me) for me in range(n)]
        worlds = [w for w in itertools.product([True, False], repeat=n)
                  if all(_holds(c, w) == w[i] for i, c in enumerate(claims))]
        if len(worlds) == 1:  # exactly one consistent assignment
            said = [_say(c, names, i) for i, c in enumerate(claims)]
            statements = [f'{who} says: "{x[0].upper() + x[1:]}."' for who, x in zip(names, said)]
            return {"names": names, "statements": statements,
                    "solution": dict(zip(names, worlds[0]))}
    raise ValueError(f"no knights-and-knaves puzzle with a unique solution for {n_people} people")

# -- commonsense: which option belongs to a kind, in CommonsenseQA's flat layout --
# Four words of each kind, no two with the same first letter: a byte-level model that writes an
# option's first letter has chosen it, and the rest of the word follows from that letter.
KINDS = {
    "a fruit": ["apple", "grape", "lemon", "peach"],
    "a color": ["red", "blue", "yellow", "white"],
    "an animal": ["dog", "horse", "mouse", "zebra"],
    "a vehicle": ["car", "train", "van", "jeep"],
    "a tool": ["saw", "knife", "file", "needle"],
}

def commonsense_problem(rng: random.Random, n_options: int = 5) -> dict:
    """'Which of these is a fruit?' with n_options words of n_options different kinds, one of
    which is asked: the key is uniform over the labels, and an answer that reads the options but
    not the question (a preferred kind) is right 1 time in n_options, as a guess."""
    kinds = rng.sample(sorted(KINDS), n_options)  # a random order: the options' order
    words = [rng.choice(KINDS[k]) for k in kinds]
    asked = rng.randrange(n_options)
    labels = list("ABCDE"[:n_options])
    return {"question": f"Which of these is {kinds[asked]}?",
            "choices": {"label": labels, "text": words}, "answerKey": labels[asked]}

def _easy_countdown(rng: random.Random) -> dict:
    """The CPU demo's variant: 3 numbers in 1..9, in order, joined by + or -, the four sign patterns
    equally likely (numbers redrawn until the target is >= 0): a sign guess is right 1 time in 4."""
    signs = rng.choice(["++", "+-", "-+", "--"])
    while True:
        nums = [rng.randint(1, 9) for _ in range(3)]
        target, expr = _sign_chain(nums, signs)
        if target >= 0:
            return {"nums": nums, "target": target, "expr": expr}

# -- code: a one-line function whose operation one word tells, and asserts on it --
_CODE_WORDS = {"+": "plus", "-": "minus", "*": "times", "%": "modulo"}  # easy: + - * only
_CODE_FORMS = ("Write a function {name} that returns its argument {word} {k}.",
               "Write a function {name} that takes a number and returns it {word} {k}.",
               "Write {name}, which gives back its input {word} {k}.")
_CODE_NAMES = ("f", "g", "h", "calc", "solve", "step")

def code_problem(rng: random.Random, easy: bool = False) -> dict:
    """'Write a function calc that returns its argument times 7.' with three asserts on it
    (arguments 3..20, where no two operations agree) and its solution, whose parameter the word
    names (`def calc(times): return times * 7`): as math's worked step copies the word before
    its second number, the token before the operation is the word that tells it."""
    op = rng.choice("+-*" if easy else list(_CODE_WORDS))
    name, word, k = rng.choice(_CODE_NAMES), _CODE_WORDS[op], rng.randint(2, 29)
    cases = []
    while len(cases) < 3:
        arg = rng.randint(3, 20)
        values = [eval_op(o, arg, k) for o in _CODE_WORDS]
        if arg not in [c[0] for c in cases] and values.count(eval_op(op, arg, k)) == 1:
            cases.append((arg, eval_op(op, arg, k)))
    return {"question": rng.choice(_CODE_FORMS).format(name=name, word=word, k=k), "starter": "",
            "setup": "", "tests": "".join(f"assert {name}({a}) == {v}\n" for a, v in cases),
            "solution": f"def {name}({word}):\n    return {word} {op} {k}\n", "name": name,
            "word": word, "op": op, "k": k}

def eval_op(op: str, a: int, b: int) -> int:  # the code generator's operations on integers
    return {"+": a + b, "-": a - b, "*": a * b, "%": a % b}[op]

_GEN = {  # "easy": the smallest variant (countdown: _easy_countdown; logic: 2 people; 3 options)
    "countdown": lambda r, easy: _easy_countdown(r) if easy else countdown_problem(r),
    "math": lambda r, easy: math_easy_problem(r),  # gen and easy alike
    "logic": lambda r, easy: logic_problem(r, (2, 2) if easy else (2, 6)),
    "code": lambda r, easy: code_problem(r, easy),  # easy: + - * only
    "commonsense": lambda r, easy: commonsense_problem(r, 3 if easy else 5),
}

# ==== Data files [plumbing]: gen, easy, hf:ID[:CONFIG]:SPLIT or a file ===========================
def data_kind(data: str) -> str:  # gen (gen, easy), hf (a hub set, a local dataset folder) or file
    if data in ("gen", "easy"):
        return "gen"
    return "hf" if data.startswith("hf:") else "file"

def hf_spec(data: str) -> tuple:
    """hf:ID -> (ID, None, None); hf:ID:SPLIT -> (ID, None, SPLIT); hf:ID:CONFIG:SPLIT -> (ID,
    CONFIG, SPLIT). Two parts name a split, as every set of the paper-math preset does; a config
    is always followed by its split (hf:openai/gsm8k:main:train). ID: a hub id or a folder."""
    parts = data.removeprefix("hf:").split(":")
    if len(parts) > 3 or not all(parts):
        raise BadInput(f"{data}: write hf:ID, hf:ID:SPLIT or hf:ID:CONFIG:SPLIT")
    return parts[0], parts[1] if len(parts) == 3 else None, parts[-1] if len(parts) > 1 else None

def _read_hf(data: str):
    """The rows of hf:... as a datasets.Dataset: a folder saved by save_to_disk through
    load_from_disk (a DatasetDict: its SPLIT, train if none), else load_dataset(ID[, CONFIG],
    split=SPLIT or train): a hub set, or a folder laid out as one (data files by split)."""
    import datasets
    name, config, split = hf_spec(data)
    if not any(os.path.isfile(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json")):
        return datasets.load_dataset(name, *[config] if config else [], split=split or "train")
    ds = datasets.load_from_disk(name)  # a Dataset, or a DatasetDict of splits
    if isinstance(ds, datasets.Dataset):
        if split:
            raise BadInput(f"{data}: {name} holds one dataset (save_to_disk), no splits: write "
                           f"hf:{name}")
        return ds
    if config or (split or "train") not in ds:
        raise BadInput(f"{data}: {name} holds the splits {', '.join(ds)} (save_to_disk): write "
                       f"hf:{name}:SPLIT")
    return ds[split or "train"]

def _gsm8k_row(question: str, solution) -> dict:
    """GSM8K answers are 'steps with <<calc>> notes ... #### 1,450': keep the clean steps and the
    bare number."""
    body, _, gold = str(solution).rpartition("####")
    steps = [re.sub(r"<<[^<>]*>>", "", ln).strip() for ln in body.splitlines() if ln.strip()]
    return {"question": question, "answer": gold.strip().replace(",", ""), "steps": steps}

# The math layouts' (question, answer) columns: a.b: b in a (a list: its first item; a chat: its
# last turn); an answer column a\\boxed: the last \\boxed{} of a's text (a worked solution) is gold
LAYOUTS = {"ours, GSM8K": ("question", "answer"),
           "MATH-500, math12k, Minerva": ("problem", "answer"),
           "AIME 2024 CSV": ("Question", "Answer"), "OlympiadBench": ("question", "final_answer"),
           "DAPO-Math-17k": ("prompt", "reward_model.ground_truth"),
           "MATH (Hendrycks), Qwen2.5-Math's minerva_math": ("problem", "solution\\boxed")}
_OWN_ANSWER = re.compile(r'(?:form|after) "?Answer:')  # DAPO's: a last line 'Answer: N'

def _cell(row: dict, key: str):
    for k in key.split("."):
        row = row.get(k) if isinstance(row, dict) else None
    return row

def _math_layout(row: dict, where: str) -> dict:
    """{question, answer} of a math row in the first of LAYOUTS it has both of; else BadInput
    naming `where` and what it lacks."""
    for q, a in LAYOUTS.values():
        question, answer = _cell(row, q), _cell(row, a.removesuffix("\\boxed"))
        if isinstance(question, list) and question and isinstance(question[-1], dict):  # a chat
            question = question[-1].get("content")
        if isinstance(answer, list) and answer:
            answer = answer[0]
        if a.endswith("\\boxed") and isinstance(answer, str):
            answer = _last_boxed(answer, cap=2000)
        if question is not None and answer is not None:
            return {"question": question, "answer": answer}
    has_question = any(_cell(row, q) is not None for q, _ in LAYOUTS.values())
    what = "answer" if has_question else "question"
    looked = [a.replace("\\boxed", "'s last \\boxed{}") if has_question else q
              for q, a in LAYOUTS.values()]
    raise BadInput(f"{where} has no {what} (looked for {', '.join(dict.fromkeys(looked))})")

def _words(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)

ROW_TYPES = {  # what a data row's key holds (a key not here: being there is enough)
    "nums": ("a list of whole numbers", lambda v: isinstance(v, list) and v != []
             and all(type(x) is int for x in v)),
    "target": ("a whole number", lambda v: type(v) is int),
    "question": ("text", lambda v: isinstance(v, str)),
    "answer": ("text or a number", lambda v: type(v) in (str, int, float)),
    "names": ("a list of names", _words),
    "statements": ("a list of sentences", _words),
    "solution": ("an object of name: true or false", lambda v: isinstance(v, dict)
                 and all(type(x) is bool for x in v.values())),
}

# The code layouts, each read as {question, starter, prelude, setup, tests, entry, inputs,
# outputs}: prelude runs before the program, in its process; tests are asserts the judge runs
# after setup, calling the program's functions (not the names setup defines or builtins, but the
# entry point); inputs are stdin texts, each to give outputs' text. MBPP's challenge_test_list is
# not graded (as in the MBPP paper).
CODE_LAYOUTS = {"ours (generated)": ("question", "tests | inputs, outputs"),
                "HumanEval": ("prompt", "test (check), entry_point"),
                "MBPP": ("text", "test_list, test_setup_code"),
                "MBPP sanitized": ("prompt", "test_list, test_imports"),
                "APPS": ("question", "input_output (inputs, outputs, fn_name)"),
                "CodeContests (deepmind)": ("description", "public_tests, private_tests")}

# What APPS's grader puts before every program (and its published solutions assume): imports.
APPS_PRELUDE = ("import sys, time, itertools, collections, math, heapq, random, fractions\n"
                "from itertools import accumulate, product, permutations, combinations\n"
                "from collections import Counter, OrderedDict, deque, defaultdict, ChainMap\n"
                "from functools import lru_cache\n"
                "from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2\n"
                "from typing import List, Tuple\nfrom heapq import *\n")

def _io_text(x) -> str:  # an APPS input or output: a text, or a list of its lines
    return "\n".join(map(str, x)) + "\n" if isinstance(x, list) else str(x)

def _code_layout(row: dict, where: str) -> dict:
    """A code row in one of CODE_LAYOUTS -> the row the code task trains on; else BadInput naming
    where (a row without tests, tests that are not Python, inputs without their outputs)."""
    out = dict(question=row.get("question"), starter="", prelude="", setup="", tests="",
               entry="", inputs=None, outputs=None)
    if isinstance(row.get("entry_point"), str) and isinstance(row.get("test"), str):  # HumanEval
        point = row["entry_point"]
        out.update(question=f"Write the Python function {point} declared below.",
                   starter=str(row.get("prompt", "")).strip("\n"), setup=row.get("prompt", ""),
                   tests=f"{row['test']}\ncheck({point})\n", entry=point)
    elif isinstance(row.get("test_list"), list) and row.get("test_list"):  # MBPP
        tests = [str(t) for t in row["test_list"]]
        text = row.get("text") or row.get("prompt")
        out.update(question=f"{text}\nYour code should pass this test:\n{tests[0]}",
                   tests="\n".join(tests) + "\n", setup=row.get("test_setup_code") or
                   "\n".join(row.get("test_imports") or []))
    elif "input_output" in row or "public_tests" in row:  # APPS, CodeContests
        io = row.get("input_output") or {}
        try:
            io = json.loads(io) if isinstance(io, str) else io
        except ValueError:
            raise BadInput(f"{where}: its input_output is not JSON") from None
        tests = [row.get(k) or {} for k in ("public_tests", "private_tests")]
        ins = io.get("inputs") or [x for t in tests for x in t.get("input", [])]
        outs = io.get("outputs") or [x for t in tests for x in t.get("output", [])]
        out.update(question=row.get("question") or row.get("description"),
                   starter=row.get("starter_code") or "", inputs=ins, outputs=outs,
                   prelude=APPS_PRELUDE if "input_output" in row else "")
        if io.get("fn_name") and len(ins) == len(outs):  # call-based: arguments -> a value
            calls = [f"_check_call({io['fn_name']!r}, {a if isinstance(a, list) else [a]!r}, {b!r})"
                     for a, b in zip(ins, outs)]
            out.update(tests="\n".join(calls) + "\n", inputs=None, outputs=None)
        else:
            out.update(inputs=[_io_text(x) for x in ins], outputs=[_io_text(x) for x in outs])
    elif row.get("tests") or row.get("inputs"):  # ours: every column kept (a generator's too)
        out = dict(out, **{k: v for k, v in row.items() if v is not None})
    else:
        looked = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in CODE_LAYOUTS.items())
        raise BadInput(f"{where} has no tests in a layout we read ({looked})")
    if out["question"] is None:
        raise BadInput(f'{where} has no question (its "question", "text", "description")')
    if out["inputs"] is not None and (len(out["inputs"]) != len(out["outputs"] or ())
                                      or not out["inputs"]):
        raise BadInput(f"{where}: its tests need as many outputs as inputs, at least one")
    try:
        ast.parse(out["setup"] + "\n" + out["tests"])
    except (SyntaxError, ValueError) as e:
        raise BadInput(f"{where}: its tests are not Python ({type(e).__name__})") from None
    return out

# The commonsense layouts, each read into the flat one (TASKS' keys): CommonsenseQA's published
# question.stem with question.choices [{label, text}]; its flat copy, question with choices
# {label: [...], text: [...]}; both with answerKey. CSQA2's question and answer yes/no: options
# A. yes, B. no.
def _commonsense_layout(row: dict, where: str) -> dict:
    """{question, choices, answerKey} of a commonsense row, or BadInput naming `where`."""
    q, key = row.get("question"), row.get("answerKey")
    if isinstance(q, dict):  # CommonsenseQA as published
        q, listed = q.get("stem"), q.get("choices")
        ok = isinstance(listed, list) and all(isinstance(c, dict) for c in listed)
        choices = {"label": [c.get("label") for c in listed],
                   "text": [c.get("text") for c in listed]} if ok else None
    elif row.get("choices") is None and row.get("answer") is not None:  # CSQA2
        said = str(row["answer"]).strip().lower()
        if said not in ("yes", "no"):
            raise BadInput(f'{where}: "answer" is {row["answer"]!r}, not "yes" or "no" (CSQA2)')
        choices, key = {"label": ["A", "B"], "text": ["yes", "no"]}, "AB"[said == "no"]
    else:  # the flat copy
        choices = row.get("choices")
    if not isinstance(q, str) or not q.strip():
        raise BadInput(f'{where} has no "question" (a string, or CommonsenseQA\'s {{"stem": ...}})')
    labels = choices.get("label") if isinstance(choices, dict) else None
    texts = choices.get("text") if isinstance(choices, dict) else None
    if not (isinstance(labels, list) and isinstance(texts, list) and len(labels) == len(texts) >= 2
            and all(isinstance(x, str) and x.strip() for x in labels + texts)
            and len(set(labels)) == len(labels)):
        raise BadInput(f'{where} has no "choices" of two or more options, each a label (once) and '
                       "a text")
    if key not in labels:
        raise BadInput(f'{where} has no "answerKey" among its labels {", ".join(labels)} '
                       f"(got {key!r})")
    return {"question": q, "choices": {"label": labels, "text": texts}, "answerKey": key}

def _check_row(row: dict, task: str, where: str = "a row") -> dict:
    """A row as read -> the row the task trains on, or BadInput naming `where` if it lacks one of
    the task's keys (TASKS) or holds a value not of its type (ROW_TYPES). math: a gold given as a
    GSM8K solution ('... #### N') keeps GSM8K's rule; any other is "latex" (the last \\boxed{} is
    graded), with "answer_line" where the question asks for a last line 'Answer: N' (DAPO's)."""
    if task == "math":
        row = _math_layout(row, where)
    if task == "code":
        row = _code_layout(row, where)
    if task == "commonsense":
        return _commonsense_layout(row, where)
    missing = [k for k in TASKS[task]["keys"] if row.get(k) is None]
    if missing:
        raise BadInput(f'{where} has no "{missing[0]}"')
    for key in TASKS[task]["keys"]:
        want, ok = ROW_TYPES.get(key, ("", lambda v: True))
        if not ok(row[key]):
            value = json.dumps(row[key], default=str)[:60]
            raise BadInput(f'{where} has "{key}": {value}, not {want}')
    if task != "math":
        return row
    gsm8k = _gsm8k_row(row["question"], row["answer"])
    if "####" in str(row["answer"]) and parse_number(gsm8k["answer"]) is not None:
        return gsm8k
    out = {"question": str(row["question"]), "answer": str(row["answer"]).strip(), "latex": True}
    if _OWN_ANSWER.search(out["question"]):
        out["answer_line"] = True
    return out

def _read_set(data: str, task: str) -> list:
    """The checked rows (_check_row) of hf:ID, hf:ID:SPLIT or hf:ID:CONFIG:SPLIT (_read_hf) or of a
    data file, read by `datasets`."""
    import datasets
    kind = data_kind(data)
    fmt = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    if kind == "file" and os.path.splitext(data)[1] not in fmt:
        raise BadInput(f"--data {data}: not a .jsonl, .json, .csv or .parquet file")
    if kind == "file" and not os.path.isfile(data):
        raise BadInput(f"{data}: cannot read it (no such file)")
    if kind == "file" and "::" in data:  # datasets (fsspec) reads a:: as a chain of file systems
        raise BadInput(f"{data}: datasets cannot read a path with '::' in it; rename the file")
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failure: our one line
    try:
        if kind == "hf":
            ds = _read_hf(data)
        else:
            ds = datasets.load_dataset(fmt[os.path.splitext(data)[1]], split="train",
                                       data_files=glob.escape(os.path.abspath(data)))  # that file
    except BadInput:
        raise
    except Exception as e:  # no such file, set or split; no hub; a file it cannot parse
        if memory_fault(e):
            raise
        hint = "; offline: --data gen or a data file" if kind == "hf" else ""
        if kind == "hf" and data.count(":") == 2:
            hint += f" (two parts name a split; a config: hf:{data[3:]}:train)"
        raise BadInput(f"{data}: cannot read it ({error_line(e, 300)}){hint}") from None
    return [_check_row(row, task, f"{data} row {i}") for i, row in enumerate(ds, 1)]

def load_rows(task: str, data="gen", n=1000, seed=0) -> list:
    """gen/easy: n fresh problems from random.Random(seed); an hf: set or a file: its first n rows
    in order (n <= 0 or None: all of them)."""
    get_task(task)
    if data_kind(data) == "gen":
        rng = random.Random(seed)
        return [_GEN[task](rng, data == "easy") for _ in range(n)]
    rows = _read_set(data, task)
    return rows[:n] if n and n > 0 else rows

def get_task(name: str) -> dict:
    if name not in TASKS:
        raise BadInput(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]

@dataclass
class Data:
    """What read_data read: how to draw training rows, and the held-out ones."""
    draw: object  # draw(n, *key) -> n training rows (a pass's last draw under epoch: what is left)
    held: object  # the held-out rows, or --eval-data's {name: rows}
    order: dict  # --data-order epoch: {"drawn": rows drawn so far}, saved in each checkpoint

def read_data(cfg: Config) -> Data:
    """The FIRST eval_size rows of the data are held out (none with --eval-data: its sets are
    evaluated instead). draw(n, *key) -> n training rows, never a held-out or benchmark prompt;
    --data-order epoch: the next rows of seeded passes over them, each a shuffle."""
    task = get_task(cfg.task)
    gen = data_kind(cfg.data) == "gen"
    n_held = 0 if cfg.eval_data else cfg.eval_size
    rows = load_rows(cfg.task, cfg.data, n_held if gen else 0, cfg.seed)
    held = rows[:n_held]
    bench = {name: load_rows(cfg.task, spec, 0, cfg.seed)
             for name, spec in eval_sets(cfg.eval_data)}
    seen = {task["prompt"](r) for r in held + sum(bench.values(), [])}
    held = bench or held
    pool = [r for r in rows[n_held:] if task["prompt"](r) not in seen]
    if not gen and len(pool) < cfg.prompts_per_step:
        raise BadInput(f"--data {cfg.data}: {len(pool)} training rows after the "
                       f"{len(rows) - len(pool)} held-out and benchmark ones, fewer than "
                       f"--prompts-per-step {cfg.prompts_per_step}")
    order = {"drawn": 0}

    @functools.lru_cache(maxsize=2)
    def epoch(e: int) -> list:  # the e-th pass's order of the pool
        return random.Random(str((cfg.seed, "epoch", e))).sample(range(len(pool)), len(pool))

    def draw(n: int, *key) -> list:
        if cfg.data_order == "epoch":  # the next n rows of the passes; never gen (check_config)
            first = order["drawn"]
            order["drawn"] += min(n, len(pool) - first % len(pool))  # no draw crosses a pass
            return [pool[epoch(i // len(pool))[i % len(pool)]]
                    for i in range(first, order["drawn"])]
        rng = random.Random(str((cfg.seed,) + key))
        if not gen:  # distinct rows
            return rng.sample(pool, n)
        out = []
        for _ in range(1000 * n):  # fresh problems until n of them are not held-out prompts
            row = _GEN[cfg.task](rng, cfg.data == "easy")
            if task["prompt"](row) not in seen:
                out.append(row)
            if len(out) == n:
                return out
        raise BadInput(f"--data {cfg.data}: almost every generated problem is a held-out one; "
                       "lower --eval-size")
    return Data(draw=draw, held=held, order=order)

def eval_sets(spec: str) -> list:
    """--eval-data 'NAME=DATA,...' -> [(NAME, DATA), ...]; BadInput for a malformed entry."""
    pairs = [part.partition("=")[::2] for part in spec.split(",") if part]
    names = [name for name, _ in pairs]
    for name, d in pairs:
        bad_name = not re.fullmatch(r"[\w.-]+", name) or name in ("acc", "len", "sample")
        if bad_name or names.count(name) > 1 or data_kind(d) == "gen":
            raise BadInput(f"--eval-data {spec}: NAME=DATA entries, each NAME once (letters, "
                           "digits, _ . -; not acc, len, sample), each DATA a file or a hub set")
    return pairs

# -- prompts (algorithm step 1): --prompt-style's frame around a task's question (TASKS) --
ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"  # TinyZero's prefill
SYSTEM_PROMPT = ("You are a helpful assistant. You first think about the reasoning process and "
                 "then answer.")
# GMTS's system line
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."

PROMPT_STYLES = {  # --prompt-style -> (its system line or None, the assistant's prefill)
    "ours": (SYSTEM_PROMPT, ASSISTANT_PREFIX),
    "qwen-math": (QWEN_MATH_SYSTEM, ""),
    "own": (None, ""),  # in every style, a row that asks for its answer itself (DAPO's)
}

def render_prompt(tok, question: str, chat: bool, system: bool = True, style: str = "ours") -> str:
    """The text the model continues: the question in the chat template or a plain User/Assistant
    frame, ending inside the assistant's <think> (\\boxed{} styles: an empty turn)."""
    head, prefix = PROMPT_STYLES[style]
    system = system and head is not None
    if not chat:
        frame = f"User: {question}\nAssistant: {prefix}".rstrip(" ")
        return (head + "\n" if system else "") + frame
    msgs = [{"role": "system", "content": head}] if system else []
    msgs.append({"role": "user", "content": question})
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + prefix

def build_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False,
                  style: str = "ours") -> list:
    """Prompt strings for task rows; short=True: terse, no system line. "ours" asks task["prompt"],
    qwen-math takes the row's question (task["question"] where a task has one: commonsense's
    options); a row that asks for its own "Answer:" line (DAPO's): as is. A task with a "frame"
    (code) is framed so whatever the style."""
    prompts = []
    for r in rows:
        own = "own" if r.get("answer_line") else style
        if own == "ours" or "frame" in task:  # the task's own prompt
            question = task["prompt"](r, short=short)
        else:
            question = task["question"](r) if "question" in task else r["question"]
        prompts.append(render_prompt(tok, question, chat, not short, task.get("frame", own)))
    return prompts

# ==== Model and tokenizer [plumbing]: Qwen checkpoints, or a tiny Qwen2 built offline =============
# auto: the accelerator there is (cuda, mps), else cpu
def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    return torch.device(name)

def guard_cuda(device: torch.device):
    """On CUDA, cuDNN's attention backend is kept out of training: its backward returns NaN dQ when
    an explicit attention mask is passed (left padding passes one), the sequence length is 64 mod
    128 and a query's logsumexp is below about -88.7, as in Qwen2.5's massive-activation heads
    (torch >= 2.11 on H100/H200; pytorch/pytorch#196678, huggingface/trl#7181, whose workaround
    for torch 2.13 this is). SDPA then picks flash or memory-efficient attention."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)

def autocast(device: torch.device):
    """bf16 compute on CUDA (weights stay fp32, deviation 8); a no-op elsewhere."""
    use = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)

def set_seed(seed: int):  # not transformers.set_seed: numpy's seeds stop at 2**32, a step's do not
    random.seed(seed)
    torch.manual_seed(seed)

TINY_CHAT_TEMPLATE = ("{% for m in messages %}"
                      "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def build_tiny(hidden: int = 64, layers: int = 2, seed: int = 0):
    """A random-init Qwen2ForCausalLM and a byte-level Qwen2Tokenizer (256 bytes + 3 specials, no
    merges): the class a qwen2 folder reloads with, so ids survive a round trip. eos is <|im_end|>
    (instruct-style), pad <|endoftext|>."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()) + specials)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None,
                         additional_special_tokens=["<|im_start|>"],
                         chat_template=TINY_CHAT_TEMPLATE, padding_side="left")
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096, bos_token_id=None, vocab_size=len(tok),
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg), tok

def resolve_model_name(name: str) -> str:
    """'Qwen2.5-0.5B' -> 'Qwen/Qwen2.5-0.5B'; hub ids and local folders pass through."""
    if os.path.isdir(name) or "/" in name or not name.lower().startswith("qwen"):
        return name
    return "Qwen/" + name

@contextlib.contextmanager
def loading(path: str):
    """Around the loading of a model's files (weights, tokenizer, config; bench_gmts.py plan reads
    the config alone): one that cannot load is bad input, BadInput naming path."""
    try:
        yield
    except Exception as e:  # no such folder or hub id, no hub, damaged files, an unknown model
        if memory_fault(e):
            raise
        raise BadInput(f"cannot load model {path!r}: {error_line(e, 300)}") from None

def load_model(name: str, device: torch.device, tiny_hidden: int = 64, tiny_layers: int = 2,
               seed: int = 0):
    """(model, tokenizer) on device in fp32. A model that cannot load is bad input: BadInput."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if name == "tiny":
        model, tok = build_tiny(tiny_hidden, tiny_layers, seed)
    else:
        path = resolve_model_name(name)
        with loading(path):
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok.padding_side = "left"  # generate() appends to the right end of every row
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok

def end_token_ids(tok) -> list:
    """The ids that end an answer: the tokenizer's eos plus Qwen's <|im_end|> and <|endoftext|>."""
    ids = {tok.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)

def use_chat(tok, chat: str = "auto") -> bool:
    """auto: the chat template for instruct models (a template and eos <|im_end|>), else plain
    text."""
    if chat != "auto":
        return chat == "yes"
    return bool(getattr(tok, "chat_template", None)) and tok.eos_token == "<|im_end|>"

class SamplerLogp:
    """A logits processor that records the sampler's log_softmax(logits / T) at each drawn token.
    generate() calls it once per new token, BEFORE that token is drawn, with the ids drawn so far:
      call 1   sees the prompt only; keeps the distribution of draw 1
      call 2   sees draw 1: reads its log-prob from the kept distribution; keeps that of draw 2; ...
      finish() reads the last draw from the last kept distribution (no call comes after it)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.read = []  # one (N, 1) column per draw already seen
        self.pending = None  # (N, V): the distribution of the draw not yet seen

    def __call__(self, drawn: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.read.append(self.pending.gather(1, drawn[:, -1:]))
        self.pending = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # (N, V)
        return logits

    def finish(self, comp: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
        """(N, T) log-probs of comp's tokens, 0 after the end: `read`, the last draw from `pending`
        if short, [:T]."""
        if self.pending is not None and len(self.read) < comp.shape[1]:
            self.read.append(self.pending.gather(1, comp[:, -1:]))
        return torch.cat(self.read[:comp.shape[1]], dim=1).masked_fill(~resp_mask, 0.0)

# How rollout batches of different widths join: prompts are left padded (generate appends on the
# right), responses right padded; token ids pad with the pad id, masks and log-probs with 0.
LEFT_PADDED = ("prompt_ids", "prompt_mask")
PAD_ID_FILLED = ("prompt_ids", "comp_ids")

def _join_rows(xs: list, key: str, pad_id: int):
    """One per-answer entry `key` of several rollout batches, joined along the answers as above."""
    if isinstance(xs[0], list):
        return [x for part in xs for x in part]
    if xs[0].dim() == 1:
        return torch.cat(xs)
    fill = pad_id if key in PAD_ID_FILLED else 0
    side = "left" if key in LEFT_PADDED else "right"
    rows = [row for x in xs for row in x]  # each answer's (W,) row
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill,
                                           padding_side=side)

def prompts_per_call(cfg: Config, n: int) -> int:
    """Prompts per generate() call of n: all n, or max(R // G, 1) under --rollout-rows R."""
    return min(n, max(cfg.rollout_rows // cfg.group_size, 1)) if cfg.rollout_rows else n

def sample_answers(run, prompts: list, cfg: Config) -> dict:
    """Algorithm step 2: rollout() on run.sampler with its log-probs, prompts_per_call prompts a
    call, the calls joined by _join_rows."""
    knobs = dict(group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                 temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, fast=run.fast,
                 sampler_logp=True)
    per = prompts_per_call(cfg, len(prompts))
    parts = [rollout(run.sampler, run.tok, prompts[i:i + per], **knobs)
             for i in range(0, len(prompts), per)]
    return {key: _join_rows([p[key] for p in parts], key, run.tok.pad_token_id) for key in parts[0]}

@torch.no_grad()
def refresh_sampler(sampler, model):
    """The bf16 sampler follows the fp32 master weights, in place (no reallocation)."""
    if sampler is not model:
        torch._foreach_copy_(list(sampler.parameters()), list(model.parameters()))

# ==== Evaluation [plumbing] =======================================================================
@torch.no_grad()
def evaluate(model, tok, task: dict, rows: list, chat: bool, short: bool, max_new_tokens: int,
             batch_size: int = 64, samples: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             style: str = "ours", progress=None) -> dict:
    """Accuracy (answers with reward 1.0; samples = k: avg@k at temperature, top_p), length, a
    sample. progress(done): called with the answers done so far after each rollout."""
    k = max(samples, 1)
    per = max(batch_size // k, 1)  # problems per rollout
    correct, length, sample = 0, 0, ""
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        prompts = build_prompts(tok, task, chunk, chat, short, style)
        b = rollout(model, tok, prompts, k, max_new_tokens, temperature, top_p, greedy=samples == 0)
        answered = [chunk[j // k] for j in range(len(b["texts"]))]
        correct += int((grade_answers(task, b["texts"], answered)[0] == 1.0).sum())
        length += int(b["resp_mask"].sum())
        sample = sample or b["texts"][0]
        if progress:
            progress((i + len(chunk)) * k)
    n = max(len(rows) * k, 1)
    return dict(eval_acc=correct / n, eval_len=length / n, eval_sample=sample[:200])

EVAL_EVERY_S = 30  # an evaluation that will run longer says where it is, at most this often

def eval_progress(total: int, log=print):
    """progress(name, done) for an evaluation of `total` answers over one or more sets: silent if
    it projects to end within EVAL_EVERY_S; else a line as soon as it projects past it, then
    every EVAL_EVERY_S and at the end: 'eval aime24 (set 1/5): 960/24,272 answers (4%) |
    0:01:02 | eta 0:25:10', the set it is on, the answers done of all and the time left."""
    start = time.time()
    last = [None]  # when it last logged

    def progress(name: str, done: int):
        now = time.time()
        elapsed = now - start
        eta = elapsed / done * (total - done)
        if last[0] is None and elapsed + eta < EVAL_EVERY_S:
            return
        if last[0] is not None and now - last[0] < EVAL_EVERY_S and done < total:
            return
        last[0] = now
        log(f"eval {name}: {done:,}/{total:,} answers ({done / total:.0%}) | {clock(elapsed)} "
            f"| eta {clock(eta)}")
    return progress

def evaluate_run(run, cfg: Config, log=print) -> dict:
    """evaluate() on the held-out rows, or on each --eval-data set as eval_NAME (eval_acc: their
    mean). A long evaluation logs how far it is (eval_progress)."""
    sets = run.data.held if isinstance(run.data.held, dict) else {"acc": run.data.held}
    k = max(cfg.eval_samples, 1)
    report = eval_progress(sum(len(rows) for rows in sets.values()) * k, log)
    recs, before = [], 0  # before: the answers of the sets already evaluated
    for i, (name, rows) in enumerate(sets.items(), 1):
        shown = "held-out rows" if name == "acc" else f"{name} (set {i}/{len(sets)})"
        recs.append(evaluate(run.model, run.tok, run.task, rows, run.chat, cfg.short_prompt,
                             cfg.max_new_tokens, batch_size=cfg.rollout_rows or 64,
                             samples=cfg.eval_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                             style=cfg.prompt_style,
                             progress=lambda done, s=shown, b=before: report(s, b + done)))
        before += len(rows) * k
    means = {key: sum(rec[key] for rec in recs) / len(recs) for key in ("eval_acc", "eval_len")}
    return dict({f"eval_{name}": rec["eval_acc"] for name, rec in zip(sets, recs)}, **means,
                eval_sample=recs[0]["eval_sample"])

# ==== The folder rule [plumbing]: where a command may write, and what --overwrite removes =========
# A command's --out holds one run of it, marked by .KIND.run (written before the run's first file;
# nothing else writes that name), or nothing of anyone's. Every other folder, and every name in it
# the command does not write, stays as it is. gmts.py's run folder below is one user of the rule.
def check_folder(out: str, names, kind: str = "gmts", resume=False, overwrite=False,
                 model: str = "", reads=(), scratch=()):
    """BadInput (one line), before any work, unless a command `kind` that writes the entries `names`
    (regexes, each matching a whole name: re.fullmatch) may write in the folder out: out names a
    folder, or one not made yet; it is not, nor holds, the --model folder; no file it reads
    (`reads`) lies in one of its names there; and out holds nothing but the lock, the mark and
    half-written `scratch` names, or holds a run of `kind` (the mark), which --resume continues or
    --overwrite replaces (resume=None: a command with no --resume)."""
    if not out:
        raise BadInput("--out must name a folder")
    real = os.path.realpath(out)
    if os.path.isdir(model) and os.path.commonpath([real, os.path.realpath(model)]) == real:
        raise BadInput(f"--out {out} is or holds the --model folder {model}: the run would "
                       "replace it")
    for path in reads:  # --data OUT/metrics.jsonl: the run would remove or rewrite what it reads
        first = os.path.relpath(os.path.realpath(path), real).split(os.sep)[0]
        if any(re.fullmatch(name, first) for name in names):
            raise BadInput(f"{path} is in {os.path.join(out, first)}, which the run writes: "
                           "move it out of --out")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise BadInput(f"--out {out} is a file, not a folder")
    try:
        entries = os.listdir(out) if os.path.isdir(out) else []
    except OSError as e:
        raise BadInput(f"--out {out} cannot be read ({e.strerror})") from None
    marked = f".{kind}.run" in entries
    held = sorted(n for n in entries if n not in (f".{kind}.lock", f".{kind}.run", f".{kind}.trash")
                  and not any(re.fullmatch(name, n) for name in scratch))
    old_run = "run_config.json" in entries and any(re.fullmatch(CKPT, n) for n in entries)
    if resume and not marked and kind == "gmts" and old_run:
        raise BadInput(f"--resume {out}: a run of a gmts.py from before runs were marked; if it is "
                       f"yours, mark it (touch {os.path.join(out, '.gmts.run')}) and resume again")
    if resume and not marked:
        raise BadInput(f"--resume {out}: no {kind} run there")
    if held and not marked:
        raise BadInput(f"--out {out} holds files that are not a {kind} run ({held[0]} ...); choose "
                       "another --out")
    if held and not (resume or overwrite):
        how = "replace it" if resume is None else f"continue it with --resume {out}, or replace it"
        raise BadInput(f"--out {out} holds a {kind} run: {how} with --overwrite")

@contextlib.contextmanager
def claim_folder(out: str, names, kind: str = "gmts", **rules):
    """The folder rule: check_folder(out, names, kind, **rules); then out made and locked for this
    process (filelock: out/.KIND.lock) and checked again under the lock (a run may have ended there
    meanwhile); the lock goes when the with ends. Inside it, with its input loaded and before its
    first write, the command calls clear_folder. A satellite, with its own names and kind:

        with gmts.claim_folder(args.out, RUN_NAMES, "gmts_trl", resume=None,
                               overwrite=args.overwrite, model=args.model, reads=[args.data]):
            trainer = build(args)  # a BadInput here: nothing in --out has changed
            gmts.clear_folder(args.out, RUN_NAMES, "gmts_trl")  # the old run's names go; marked
            trainer.train()
    """
    from filelock import FileLock, Timeout
    check_folder(out, names, kind, **rules)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:  # under a file or /proc, a name too long
        raise BadInput(f"--out {out} cannot be made ({e.strerror})") from None
    lock = FileLock(os.path.join(out, f".{kind}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # filelock says Timeout where it cannot make the file too (/proc)
        if os.path.exists(lock.lock_file):
            raise BadInput(f"--out {out}: another process writes there now") from None
        raise BadInput(f"--out {out} cannot be written") from None
    except OSError as e:
        raise BadInput(f"--out {out} cannot be written ({e.strerror})") from None
    try:
        check_folder(out, names, kind, **rules)
        yield
    finally:
        lock.release()

def clear_folder(out: str, names, kind: str = "gmts"):
    """Remove exactly the entries of out that fullmatch one of names, all or nothing, then mark out
    as a run of kind (.KIND.run). Each entry is first renamed into out/.KIND.trash (a link moves as
    a link: its target is never touched); if one cannot be, those moved go back and nothing is
    removed (BadInput naming it); then the trash goes."""
    trash = os.path.join(out, f".{kind}.trash")
    _remove(trash)  # a removal that a kill cut short
    doomed = sorted(n for n in os.listdir(out) if any(re.fullmatch(name, n) for name in names))
    os.mkdir(trash)
    moved = []
    try:
        for name in doomed:
            os.rename(os.path.join(out, name), os.path.join(trash, name))
            moved.append(name)
    except OSError as e:
        for n in reversed(moved):
            os.rename(os.path.join(trash, n), os.path.join(out, n))
        os.rmdir(trash)
        raise BadInput(f"--out {out}: {name} cannot be removed ({e.strerror}); nothing was"
                       ) from None
    _remove(trash)
    with open(os.path.join(out, f".{kind}.run"), "w") as f:
        f.write(f"{kind} marks its run folders with this file; its --overwrite removes only the "
                "names it writes\n")

def _remove(path: str):
    """A file or link (not its target), or a folder with all in it."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)

def check_file(path: str, flag: str, overwrite=False):
    """The rule for a command that writes one file (a satellite's figure or JSON): BadInput (one
    line), before any work, where path is a folder or lies under a file, or names a file that is
    there (anyone's) without --overwrite. The folders above it that are not there are made."""
    if not path or os.path.isdir(path):
        raise BadInput(f"{flag} {path!r} must name a file")
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(above):  # the nearest folder that is there: the rest is made in it
        if os.path.lexists(above):
            raise BadInput(f"{flag} {path}: {above} is a file, not a folder")
        above = os.path.dirname(above)
    if os.path.lexists(path) and not overwrite:
        raise BadInput(f"{flag} {path} exists: replace it with --overwrite")

# ==== The run folder [plumbing]: one writer, checkpoints, resume, metrics =========================
LOCK = ".gmts.lock"  # claim_folder's lock (kind "gmts"): one process writes a run folder at a time
CKPT = r"ckpt-(\d{6}|[1-9]\d{6,})"  # f"ckpt-{step:06d}": a checkpoint's exact name
RUN_FILES = (  # every name a run writes in OUT (re.fullmatch): all that --overwrite removes
    r"run_config\.json(\.tmp)?", r"metrics\.jsonl(\.tmp)?", r"metrics\.png", "tensorboard", "wandb",
    CKPT + r"(\.tmp|\.old)?", r"final\.tmp",
    # the final model: what save_pretrained writes for a Qwen model and its tokenizer
    r"config\.json", r"generation_config\.json", r"model(-\d{5}-of-\d{5})?\.safetensors",
    r"model\.safetensors\.index\.json", r"tokenizer(_config)?\.json", r"special_tokens_map\.json",
    r"added_tokens\.json", r"vocab\.json", r"merges\.txt", r"chat_template\.(jinja|json)")
HALF_WRITTEN = (CKPT + r"\.(tmp|old)", r"final\.tmp", r"run_config\.json\.tmp",
                r"metrics\.jsonl\.tmp")

def checkpoints(out: str) -> list:
    """The complete checkpoint folders in out (named exactly CKPT; ckpt-N.tmp is half-written),
    oldest first by step."""
    names = os.listdir(out) if os.path.isdir(out) else []
    done = [n for n in names if re.fullmatch(CKPT, n) and os.path.isdir(os.path.join(out, n))]
    return [os.path.join(out, n) for n in sorted(done, key=lambda n: int(n[len("ckpt-"):]))]

def folder_rules(cfg: Config) -> dict:
    """check_folder's rules for a run of cfg: --resume, --overwrite, --model, the files it reads."""
    specs = [cfg.data] + [data for _, data in eval_sets(cfg.eval_data)]
    return dict(resume=bool(cfg.resume), overwrite=cfg.overwrite, model=cfg.model,
                reads=[d for d in specs if data_kind(d) == "file"], scratch=HALF_WRITTEN)

def check_out(cfg: Config):
    """BadInput unless the run may write in cfg.out: the folder rule, check_folder with
    RUN_FILES."""
    check_folder(cfg.out, RUN_FILES, "gmts", **folder_rules(cfg))

@contextlib.contextmanager
def start_run(cfg: Config, log=print):
    """The Run a step starts from, cfg.out claimed (claim_folder: checked, locked) until the loop
    ends: the data, the model (a resume: the newest checkpoint's, with state.pt's step, optimiser
    and rows drawn), the optimiser, the KL reference, the sampler; only then does --out change
    (open_folder). After the loop: metrics.png and the final model in --out itself."""
    with claim_folder(cfg.out, RUN_FILES, "gmts", **folder_rules(cfg)):
        device = pick_device(cfg.device)
        guard_cuda(device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        set_seed(cfg.seed)
        data = read_data(cfg)
        if cfg.task == "code":
            sandbox_mode()  # RunError now, before any work, where no sandbox runs a program
        state = dict(step=0, skipped=0, drawn=0)
        if cfg.resume:
            ckpt, model, tok, state = read_checkpoint(cfg.out, device)
            data.order["drawn"] = state["drawn"]
            check_steps(cfg, read_run_config(cfg.out)["steps"], state["step"])
        else:
            model, tok = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
        ref = None
        if cfg.kl_beta > 0:  # pi_ref: the model --model loads, where RL starts
            ref = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)[0]
            ref = ref.eval().requires_grad_(False)
        if cfg.grad_ckpt:  # transformers 5's name (gradient_checkpointing_enable is deprecated)
            model.activation_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                eps=cfg.adam_eps)
        if cfg.resume:
            try:
                opt.load_state_dict(state["opt"])
            except (ValueError, KeyError, TypeError, IndexError) as e:  # another model's optimiser
                raise unreadable(ckpt, f"state.pt's optimiser: {error_line(e, 200)}") from None
        sampler = model
        if cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda"):
            sampler = copy.deepcopy(model).eval().requires_grad_(False)
            for p in sampler.parameters():  # RoPE's inv_freq buffer stays fp32, as in a bf16 load
                p.data = p.data.to(torch.bfloat16)
        fast = device.type == "cuda" if cfg.fast_generate is None else cfg.fast_generate
        run = Run(model=model, tok=tok, opt=opt, ref=ref, sampler=sampler, task=get_task(cfg.task),
                  data=data, chat=use_chat(tok, cfg.chat_template), fast=fast,
                  start=state["step"] + 1, skipped=state["skipped"], log_step=None)
        open_folder(cfg, run, device, log)
        yield run  # the loop; then, after its last step:
        run.log_step(None)  # the step lines and the tracker close
        plot_metrics(cfg.out)
        save_final(cfg.out, run.model, run.tok)  # last: its config.json marks the run finished
        log(f"done: {cfg.out} (metrics.jsonl, metrics.png, the model)")

def read_checkpoint(out: str, device: torch.device) -> tuple:
    """--resume: (the newest checkpoint, its model, tokenizer and state.pt: the step, skipped, rows
    drawn, the optimiser's state); one that cannot be read: BadInput naming it and the one
    before."""
    done = checkpoints(out)
    if not done:
        raise BadInput(f"--resume {out}: no checkpoint there to continue (start again with "
                       "--overwrite)")
    ckpt = done[-1]
    try:
        model, tok = load_model(ckpt, device)
    except BadInput as e:
        raise unreadable(ckpt, str(e)) from None
    try:
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # torch reads a cut or overwritten file as many kinds of errors
        if memory_fault(e):
            raise
        raise unreadable(ckpt, f"state.pt: {error_line(e, 200)}") from None
    kinds = dict(step=int, skipped=int, drawn=int, opt=dict)
    if not (isinstance(state, dict) and all(type(state.get(k)) is t for k, t in kinds.items())
            and state["step"] == int(os.path.basename(ckpt)[len("ckpt-"):])):
        raise unreadable(ckpt, "state.pt holds no step, skipped, drawn and opt of this checkpoint")
    return ckpt, model, tok, state

def unreadable(ckpt: str, why: str) -> BadInput:
    """A checkpoint --resume cannot use: one line naming it, and the checkpoint before it."""
    older = [c for c in checkpoints(os.path.dirname(ckpt)) if c != ckpt]
    how = (f"remove it to resume from {os.path.basename(older[-1])}" if older
           else "no checkpoint before it: start again with --overwrite")
    return BadInput(f"--resume: {ckpt} cannot be read ({why}); {how}")

def check_steps(cfg: Config, saved_steps: int, done: int):
    """--steps with --resume: at least the steps done, and another value only where steps 1..done
    had the lrs a run of the new length gives them (the decay's horizon is --steps): with
    --no-lr-decay, or within the warm-up. Then the run is that uninterrupted run."""
    if cfg.steps < done:
        raise BadInput(f"--steps {cfg.steps} is below the run's last saved step {done}")
    old = dataclasses.replace(cfg, steps=saved_steps)
    slots = itertools.product(range(1, done + 1), range(cfg.inner_updates))  # (step, inner)
    if saved_steps != cfg.steps and any(step_lr(old, *s) != step_lr(cfg, *s) for s in slots):
        raise BadInput(f"--steps {cfg.steps} would change the lr of steps 1-{done}, trained with "
                       f"--steps {saved_steps} (the lr decays to 0 at --steps): keep --steps "
                       f"{saved_steps}, or start a new run from --model {cfg.out}/ckpt-N")

def open_folder(cfg: Config, run: Run, device: torch.device, log=print):
    """start_run's writes: an earlier run's files go (clear_folder; a resume keeps its run, and
    metrics.jsonl up to its checkpoint), then the config, the tracker, the first line, a new run's
    step 0 and ckpt-000000."""
    kept = read_metrics(cfg.out, run.start - 1) if cfg.resume else []  # later steps will rerun
    clear_folder(cfg.out, HALF_WRITTEN if cfg.resume else RUN_FILES, "gmts")
    write_file(os.path.join(cfg.out, "run_config.json"), json.dumps(vars(cfg), indent=1))
    write_file(os.path.join(cfg.out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in kept))
    run.log_step = step_logger(cfg, log)
    n_params = sum(p.numel() for p in run.model.parameters())
    kernels = torch.backends.cpu.get_cpu_capability()  # CPU digits depend on it (docs/results.md)
    held = "sets" if isinstance(run.data.held, dict) else "rows"  # --eval-data's, or rows of --data
    log(f"device {device} ({kernels} kernels, {torch.get_num_threads()} threads) | model "
        f"{resolve_model_name(cfg.model)} ({n_params:,} params) | chat template {run.chat} | "
        f"{len(run.data.held)} held-out {held} | "
        f"{cfg.prompts_per_step} prompts x {cfg.group_size} answers per step"
        + (f" | code sandbox: {sandbox_mode()}" if cfg.task == "code" else "")
        + (f" | resumed from {os.path.basename(checkpoints(cfg.out)[-1])}" if cfg.resume else ""))
    if not cfg.resume:
        run.log_step(dict(step=0, **evaluate_run(run, cfg, log)))
        save_checkpoint(cfg.out, 0, run)

def save_checkpoint(out: str, step: int, run: Run, keep: int = 2):
    """OUT/ckpt-<step>: a model folder (save_pretrained: --model takes it) with state.pt (the step,
    the updates skipped, the optimiser, the rows drawn; no RNG: every step reseeds), written as
    ckpt-<step>.tmp and renamed whole; then all but the newest `keep` go, each renamed first (a
    half-deleted one is no checkpoint). A kill at any moment leaves the newest complete one."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    state = dict(step=step, skipped=run.skipped, drawn=run.data.order["drawn"],
                 opt=run.opt.state_dict())
    _save_model(final + ".tmp", run.model, run.tok, state)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(final + ".tmp", final)
    for old in checkpoints(out)[:-keep]:
        os.replace(old, old + ".old")
        shutil.rmtree(old + ".old", ignore_errors=True)

def _save_model(tmp: str, model, tok, state=None):
    """model, tokenizer (and state.pt) into a fresh folder tmp; a failed write removes it, and is a
    fault of the run (RunError) whatever raised it: a full disk is torch's RuntimeError,
    safetensors' SafetensorError, the tokenizer's Exception or an OSError."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if state is not None:
            torch.save(state, os.path.join(tmp, "state.pt"))
    except BaseException as e:  # a full disk, Ctrl-C: no half folder left to fill it
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception) or memory_fault(e):
            raise
        free = shutil.disk_usage(os.path.dirname(tmp)).free
        raise RunError(f"writing {tmp} failed ({error_line(e, 300)}; {free / 2**20:.1f} MiB free "
                       "there)") from e

def save_final(out: str, model, tok):
    """save_pretrained into OUT itself via final.tmp, config.json renamed in last: never torn."""
    tmp = os.path.join(out, "final.tmp")
    _save_model(tmp, model, tok)
    for n in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)

def write_file(path: str, text: str):
    """A small file written whole: a .tmp beside it, then an atomic rename."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)

def read_run_config(out: str) -> dict:
    """The saved config of the run in `out` (Config's fields in it): BadInput (one line) unless
    run_config.json is an object whose values have their fields' types."""
    path = os.path.join(out, "run_config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"--resume {out}: no readable run_config.json there ({type(e).__name__})"
                       ) from None
    fields = get_type_hints(Config)
    if not isinstance(saved, dict):
        raise BadInput(f"{path}: not an object of settings")
    for key, value in saved.items():
        if key in fields and not _of_type(value, fields[key], getattr(Config, key)):
            raise BadInput(f"{path}: {key} is {value!r}, not of its type ({fields[key]})")
    return {key: value for key, value in saved.items() if key in fields}

def _of_type(value, kind, default) -> bool:
    """Whether a JSON value fits a Config field: one of a Literal's choices, a number for a float,
    exactly the type otherwise (true is no int); None only where None is the default."""
    if value is None:
        return default is None
    if get_origin(kind) is Literal:
        return value in get_args(kind)
    return type(value) in ((int, float) if kind is float else (kind,))

def log_metrics(path: str, rec: dict):
    """Append one JSON line with a single write() on an O_APPEND file: a kill leaves whole lines or
    none."""
    with open(path, "ab", buffering=0) as f:
        f.write((json.dumps(rec) + "\n").encode())

def read_metrics(out: str, last_step: float = math.inf) -> list:
    """The whole JSON lines of OUT/metrics.jsonl with step <= last_step (a torn last line is
    skipped)."""
    recs = []
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    rec = json.loads(line)
                    if line.endswith("\n") and rec["step"] <= last_step:
                        recs.append(rec)
    return recs

def step_record(step: int, cfg: Config, parts: list, batch: dict, valid, rewards, adv, old_logp,
                entropy, sel_mask, stats: dict, opt, skipped: int, t0: float,
                t_roll: float) -> dict:
    """One metrics.jsonl line (docs/metrics.md explains each key); t0: the step's start; valid: the
    loss's."""
    mask = batch["resp_mask"]  # (N, T)
    n_valid = max(int(mask.sum()), 1)
    n_sel = max(int(sel_mask.sum()), 1)
    sampled = torch.cat([informative(part[1], cfg.group_size) for part in parts])
    zero_adv_kept = sel_mask & (adv == 0)[:, None]  # (N, T)
    gap = (batch["sampler_logp"] - old_logp).abs()[mask]  # sampler vs learner precision
    graded = [part[0] for part in parts]  # every answer graded this step, kept or filtered out
    dt = time.time() - t0
    return dict(step=step, reward_mean=rewards.mean().item(),
                acc=(rewards == 1.0).float().mean().item(),
                selected_frac=int(sel_mask.sum()) / max(int(valid.sum()), 1),
                entropy_mean=float((entropy * mask).sum()) / n_valid,
                entropy_selected_mean=float((entropy * sel_mask).sum()) / n_sel,
                zero_adv_selected_frac=float(zero_adv_kept.sum()) / n_sel,
                grad_norm=stats["grad_norm"], loss=stats["loss"], clip_frac=stats["clip_frac"],
                kl=stats["kl"],
                completion_len=n_valid / mask.shape[0], rollout_batches=len(parts),
                groups_filtered_frac=1.0 - sampled.float().mean().item(),
                lr=opt.param_groups[0]["lr"],
                skipped_steps=skipped, truncated_frac=batch["truncated"].float().mean().item(),
                rollout_time_s=t_roll, step_time_s=dt, tokens_per_s=float(mask.sum()) / dt,
                grade_time_s=sum(float(b["grade_s"].sum()) for b in graded),
                grade_timeouts=sum(int(b["grade_timeout"].sum()) for b in graded),
                sampler_logp_gap=gap.mean().item(), sampler_logp_gap_max=gap.max().item())

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

# ==== Step lines and trackers [plumbing] ==========================================================
SHOWN = ("reward_mean", "acc", "selected_frac", "groups_filtered_frac", "entropy_mean", "grad_norm",
         "eval_acc")
GRADING_SHOWN = 0.2  # the line names the grading time when it is this share of the step or more

def step_line(rec: dict, steps: int = 0, eta_s: float = None) -> str:
    """'step 7/200 | reward_mean 0.412 | ... | 1.52 s | eta 0:04:51': the keys of SHOWN that the
    record has, the grading time where it is GRADING_SHOWN of the step or more or an answer's
    grading timed out; /steps and the eta when given."""
    fields = [f"step {rec['step']}" + (f"/{steps}" if steps else "")]
    fields += [f"{key} {rec[key]:.3f}" for key in SHOWN if key in rec]
    if "step_time_s" not in rec:  # step 0: the evaluation alone
        return " | ".join(fields + [f"sample: {rec['eval_sample'][:80]!r}"])
    grading, timed_out = rec.get("grade_time_s", 0.0), rec.get("grade_timeouts", 0)
    if grading >= GRADING_SHOWN * rec["step_time_s"] or timed_out:
        fields.append(f"grading {grading:.2f} s" + f" ({timed_out} timed out)" * bool(timed_out))
    eta = [] if eta_s is None else [f"eta {clock(eta_s)}"]
    return " | ".join(fields + [f"{rec['step_time_s']:.2f} s"] + eta)

def clock(seconds: float) -> str:
    """3725.4 -> '1:02:05' (h:mm:ss)."""
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"

def step_logger(cfg: Config, log=print):
    """log_step(rec): rec appended to OUT/metrics.jsonl, sent to --report-to's tracker, and one line
    to log; log_step(None) closes the tracker. The eta: the steps left times the mean wall time per
    step since this process's first step began (evaluations and checkpoints between steps
    included; the last evaluation not)."""
    report = open_tracker(cfg)
    first = []  # (step before it, its start time) of the first step this process ran

    def log_step(rec):
        if rec is None:
            return report(None)
        log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
        report(rec)
        eta = None
        if "step_time_s" in rec:
            first[:] = first or [rec["step"] - 1, time.time() - rec["step_time_s"]]
            per_step = (time.time() - first[1]) / (rec["step"] - first[0])
            eta = per_step * (cfg.steps - rec["step"])
        log(step_line(rec, cfg.steps, eta))
    return log_step

def open_tracker(cfg: Config):
    """report(rec) sends a record's numbers to --report-to's tracker (OUT/tensorboard, OUT/wandb),
    report(None) closes it."""
    if cfg.report_to == "none":
        return lambda rec: None
    try:
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            tracker = SummaryWriter(os.path.join(cfg.out, "tensorboard"))
        else:
            import wandb
            tracker = wandb.init(project="gmts", name=os.path.basename(cfg.out), dir=cfg.out,
                                 config=dataclasses.asdict(cfg))
    except Exception as e:  # not installed; wandb not logged in (WANDB_MODE=offline needs no login)
        raise BadInput(f"--report-to {cfg.report_to} cannot start: {error_line(e, 300)}") from None

    def report(rec):
        if rec is None:
            return getattr(tracker, "finish" if cfg.report_to == "wandb" else "close")()
        numbers = {k: v for k, v in rec.items() if k != "step" and type(v) in (int, float)}
        if cfg.report_to == "wandb":
            return tracker.log(numbers, step=rec["step"])
        for key, value in numbers.items():
            tracker.add_scalar(key, value, rec["step"])
    return report

# ==== The code sandbox [plumbing]: model-written programs run here, never in this process ========
# A grading worker starts a zygote (SANDBOX_HARNESS, this Python with -I -S -B: no site, nothing
# of ours imported or written); per program it forks a judge that forks the program's process and
# only then reads the tests. Isolation, by sandbox_mode():
#   ns      root, namespaces (unshare): no network; its own pids, all killed when the zygote ends;
#           a new root of read-only binds of the system's and Python's folders (no home, no data)
#           and a fresh tmpfs /tmp; the program runs as a user of its own, so RLIMIT_NPROC binds
#           (no second process or thread) and it can signal nothing of ours
#   userns  not root, user namespaces allowed: the same, the program the namespace's root with
#           every capability dropped
#   uid     root, no namespaces: a user of its own; the network and world-writable folders
#           (/tmp, /var/tmp, /dev/shm) stay open to it
#   plain   neither: your user; the network and your files stay open to it, and your processes
#           to its signals
# In every mode: its own session, limits on CPU time, memory, file size and open files, no core,
# a bare environment, stdin a memfd or /dev/null, a fresh folder removed after it, a wall clock.
# A pass is the judge's verdict after the last test with a nonce the program never saw: nothing
# the program does in its own process (exiting early, printing, patching builtins) makes one.
CODE_TIMEOUT_S = 10.0  # wall clock per program, all of its tests
CODE_MEMORY = 1 << 30  # address space per program, bytes
CODE_OUTPUT = 1 << 22  # bytes a program may write to stdout or a file, or return to the tests
UID_BASE = 2_000_000_000  # as root a program's user is UID_BASE + its zygote's pid: used by no one
UNSHARE = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin") or "unshare"

SANDBOX_HARNESS = r'''
# gmts.py's code sandbox, run as `python -I -S -B -c SANDBOX_HARNESS`: the standard library only,
# nothing of the trainer's; its first message says its mode, folder, user and the trainer's
# site-packages (on the programs' sys.path). Three kinds of process:
#   zygote   one per grading worker: reads a job's public part (program, setup, stdin inputs),
#            forks a judge, relays its verdict to the trainer, cleans the folder, takes the next
#   judge    forks the program's process, THEN reads the job's secret part (tests, nonce): the
#            program's memory never holds them; runs the tests (asserts: calling the program's
#            functions across a pipe, its replies plain values only; stdio: a process per input)
#   program  the model's code alone: its own session, limits, two pipe ends, its folder, a user
#            of its own or no capabilities, no second process
import builtins, hashlib, marshal, os, pickle, resource, select, sys, time

HEAD = 10  # every message: its length in 10 digits, then its bytes
LIBC = None  # ctypes' libc: prctl, capset, mount

def read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf

def read_part(fd):  # one of the trainer's parts: read to its last byte, never beyond
    return marshal.loads(read_exact(fd, int(read_exact(fd, HEAD))))

def send(fd, data):
    data = b"%010d" % len(data) + data
    while data:
        data = data[os.write(fd, data):]

def recv(fd, deadline, cap):
    """One message of an untrusted writer before the deadline, or None (end, timeout, too long,
    malformed)."""
    buf, need = b"", HEAD
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, min(need - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
        if need == HEAD and len(buf) == HEAD:
            if not buf.isdigit() or int(buf) > cap:
                return None
            need += int(buf)
    return buf[HEAD:]

# -- values between the tests and the program: plain data, never one of the program's objects --
KINDS = (("L", list), ("U", tuple), ("Z", frozenset), ("S", set), ("D", dict))

def enc(x, out, depth=0):
    if depth > 100:
        raise ValueError("nested too deep")
    if x is None or x is True or x is False:
        out.append("N" if x is None else "T" if x else "F")
    elif isinstance(x, bool):
        out.append("T" if x else "F")
    elif isinstance(x, int):
        out.append("i%s;" % int.__repr__(x))
    elif isinstance(x, float):
        out.append("f%s;" % float.__repr__(x))
    elif isinstance(x, complex):
        out.append("c%s;%s;" % (float.__repr__(x.real), float.__repr__(x.imag)))
    elif isinstance(x, str):
        out.append("s%s;" % str.encode(x, "utf-8", "surrogatepass").hex())
    elif isinstance(x, (bytes, bytearray)):
        out.append("b%s;" % bytes(x).hex())
    else:
        for tag, kind in KINDS:
            if isinstance(x, kind):
                items = [v for kv in dict.items(x) for v in kv] if kind is dict else list(x)
                out.append("%s%d;" % (tag, len(items)))
                for item in items:
                    enc(item, out, depth + 1)
                return out
        raise TypeError("a %s is not plain data" % type(x).__name__)
    return out

def dec(s, i, depth=0):
    """(value, next index) of enc's text at i; ValueError, IndexError or KeyError for others."""
    if depth > 100:
        raise ValueError("nested too deep")
    tag = s[i]
    if tag in "NTF":
        return {"N": None, "T": True, "F": False}[tag], i + 1
    end = s.index(";", i)
    body = s[i + 1:end]
    if tag == "i":
        return int(body), end + 1
    if tag == "f":
        return float(body), end + 1
    if tag == "c":
        end2 = s.index(";", end + 1)
        return complex(float(body), float(s[end + 1:end2])), end2 + 1
    if tag == "s":
        return bytes.fromhex(body).decode("utf-8", "surrogatepass"), end + 1
    if tag == "b":
        return bytes.fromhex(body), end + 1
    kind, items, i = dict(KINDS)[tag], [], end + 1
    for _ in range(int(body)):
        item, i = dec(s, i, depth + 1)
        items.append(item)
    return (dict(zip(items[::2], items[1::2])) if kind is dict else kind(items)), i

def pack(x):
    return "".join(enc(x, [])).encode()

def unpack(data):
    s = data.decode()
    value, i = dec(s, 0)
    if i != len(s):
        raise ValueError("trailing data")
    return value

# -- the program's process --
def prctl(*args):
    if LIBC.prctl(*args) != 0:
        raise OSError("prctl%r failed" % (args,))

def die_with_parent(parent):
    prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL
    if os.getppid() != parent:  # it ended before that
        os._exit(1)

def drop_capabilities():
    """Root in a user namespace: no capability left, none to regain (securebits, no_new_privs)."""
    import ctypes
    for cap in range(64):
        LIBC.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
    prctl(28, 0x2F, 0, 0, 0)  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, locked
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if LIBC.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError("capset failed")
    prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS

def become_program(job, fds, parent):
    """In the forked child, before any of the program's code: its own session; fds (stdin,
    stdout, calls in, replies out) at 0, 1, 3, 4, stderr to /dev/null, every other fd closed;
    the limits; its folder and a bare environment; a user of its own (root) or no capabilities
    (root in a user namespace)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    wanted = [null if f is None else f for f in (fds[0], fds[1], None, fds[2], fds[3])]
    moved = [os.dup(f) for f in wanted]
    for target, f in enumerate(moved):
        os.dup2(f, target)
    os.closerange(5, 1 << 20)
    limits = job["limits"]
    for name, value in (("CPU", limits["cpu"]), ("AS", limits["memory"]),
                        ("FSIZE", limits["output"]), ("NOFILE", 64), ("CORE", 0), ("NPROC", 1)):
        hard = value + 1 if name == "CPU" else value  # SIGXCPU at the soft limit, KILL a s later
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))
    os.chdir(job["work"])
    os.environ.clear()
    os.environ.update(PATH="/usr/bin:/bin", HOME=job["work"], TMPDIR=job["work"], LANG="C.UTF-8",
                      OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if job["uid"] >= 0:  # its one process of this user: RLIMIT_NPROC binds, kill(2) reaches none
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    elif job["mode"] == "userns":
        drop_capabilities()
    die_with_parent(parent)  # after setuid, which clears it
    os.umask(0o077)
    sys.stdin, sys.stdout = open(0, "r", closefd=False), open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["solution.py"]
    sys.path.extend(job["paths"])  # the trainer's site-packages, after the standard library
    builtins.exit = builtins.quit = sys.exit  # what site would have added
    if "random" in sys.modules:  # preloaded by the zygote: a seed of the program's own
        sys.modules["random"].seed()

def serve_calls(ns):
    """The program's side of the asserts: the names of its callables, then a reply per call.
    A call comes pickled (from the judge: trusted, objects of the setup's classes included), a
    reply goes back as plain data."""
    send(4, pack([k for k, v in ns.items() if callable(v) and not k.startswith("__")]))
    while True:
        try:
            name, args, kwargs = pickle.loads(read_exact(3, int(read_exact(3, HEAD))))
        except EOFError:
            return
        try:
            if name in ns:
                target = ns[name]
            else:  # 'Solution.f': a LeetCode-style method
                target = getattr(ns[name.split(".")[0]](), name.split(".", 1)[1])
            reply = pack(["ok", target(*args, **kwargs)])
        except BaseException as e:
            try:
                reply = pack(["raised", type(e).__name__, str(e)[:300]])
            except BaseException:
                reply = pack(["raised", "Exception", ""])
        send(4, reply)

def spawn(job, fds, as_script):
    """Fork the program's process, which becomes the program and runs its code. -> its pid."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        become_program(job, fds, parent)
        if job["setup"]:  # the row's setup as the module `tests`: its classes for the calls
            sys.modules["tests"] = tests = type(sys)("tests")
            exec(compile(job["setup"], "setup.py", "exec"), tests.__dict__)
        ns = {"__name__": "__main__" if as_script else "solution", "__builtins__": builtins}
        exec(compile(job["program"], "solution.py", "exec"), ns)
        if not as_script:
            serve_calls(ns)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        code = 1
    finally:
        try:
            sys.stdout.flush()
        except BaseException:
            code = code or 1
        os._exit(code & 255)

def end(pid, deadline=None):
    """Its exit status if it ends before the deadline (else None); then its session's group and
    it are killed and it is reaped."""
    status = None
    if deadline is not None:
        fd = os.pidfd_open(pid)
        left = deadline - time.monotonic()
        if left > 0 and select.select([fd], [], [], left)[0]:
            status = os.waitpid(pid, 0)[1]
        os.close(fd)
    for target in (-pid, pid):
        try:
            os.kill(target, 9)
        except OSError:
            pass
    if status is None:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return status

# -- the judge --
class Gone(BaseException):
    """The program's process ended, timed out or broke the protocol: the tests fail, whatever an
    except in them catches."""

ENDS = (StopIteration, StopAsyncIteration)

def judge_asserts(job, deadline):
    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = spawn(job, [None, None, call_r, reply_w], as_script=False)
    os.close(call_r)
    os.close(reply_w)
    secret = read_part(0)  # only now: the program's process never held the tests or the nonce
    cap, gone = job["limits"]["reply"], []

    def proxy(name):
        def call(*args, **kwargs):
            try:
                if gone:
                    raise ValueError
                send(call_w, pickle.dumps([name, list(args), kwargs]))
                reply = unpack(recv(reply_r, deadline, cap))
                ok = type(reply) is list and (reply[:1] == ["ok"] and len(reply) == 2
                                              or reply[:1] == ["raised"] and len(reply) == 3)
            except Exception:
                ok = False
            if not ok:
                gone.append(name)
                raise Gone
            if reply[0] == "ok":
                return reply[1]
            kind = getattr(builtins, str(reply[1]), None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)) or kind in ENDS:
                kind = RuntimeError  # never one that ends a loop or map() in the tests early
            raise kind(str(reply[2]))
        return call

    def check_call(name, args, expected):  # APPS's call-based rows: its comparison
        got = proxy(name if name in names else "Solution." + name)(*args)
        got = as_lists(got)
        if got != expected and not (type(expected) is list and expected and got == expected[0]):
            raise AssertionError("%r returned %r" % (name, got))

    ok, why = False, ""
    try:
        names = unpack(recv(reply_r, deadline, cap) or b"N")
        names = [n for n in names if type(n) is str] if type(names) is list else []
        sys.modules["tests"] = tests = type(sys)("tests")  # pickle finds the setup's classes
        ns = tests.__dict__
        ns.update({name: sys.modules[name] for name in PRELOAD if name in sys.modules})
        exec(secret["setup"], ns)
        trusted = set(ns) | set(dir(builtins))  # the tests' own names: never the program's
        ns.update({n: proxy(n) for n in names if n not in trusted or n == secret["entry"]})
        ns["_check_call"] = check_call
        exec(secret["tests"], ns)
        ok = not gone and bool(names)
        why = "" if ok else "the program did not load" if not names else "its process ended"
    except Gone:
        why = "the program's process ended, timed out or broke the protocol"
    except BaseException as e:
        why = "%s: %s" % (type(e).__name__, e)
    end(pid)
    return secret, b"pass" if ok else b"fail " + why[:500].encode("utf-8", "replace")

def as_lists(x):
    if isinstance(x, (list, tuple)):
        return [as_lists(v) for v in x]
    if isinstance(x, dict):
        return {k: as_lists(v) for k, v in x.items()}
    return x

def digest(out):  # what is compared: every line without its trailing whitespace, none at the end
    lines = out.rstrip().split(b"\n")
    return hashlib.sha256(b"\n".join(line.rstrip() for line in lines)).hexdigest().encode()

def judge_stdio(job, deadline):
    """Each input in a fresh process: the digest of its output, or '-' for a crash or a timeout
    (and no more inputs)."""
    outs = []
    for text in job["inputs"]:
        stdin, stdout = os.memfd_create("stdin"), os.memfd_create("stdout")
        os.write(stdin, text.encode())
        os.lseek(stdin, 0, 0)
        pid = spawn(job, [stdin, stdout, None, None], as_script=True)
        os.close(stdin)
        status = end(pid, deadline)
        ok = status is not None and os.waitstatus_to_exitcode(status) == 0
        os.lseek(stdout, 0, 0)
        out = []
        while ok:
            chunk = os.read(stdout, 1 << 20)
            if not chunk:
                break
            out.append(chunk)
        os.close(stdout)
        outs.append(digest(b"".join(out)) if ok else b"-")
        if not ok:
            break
    return read_part(0), b"\n".join(outs)

def judge(job, verdict_w, parent):
    die_with_parent(parent)
    deadline = time.monotonic() + job["limits"]["wall"]
    run = judge_stdio if job["inputs"] is not None else judge_asserts
    secret, verdict = run(job, deadline)
    send(verdict_w, secret["nonce"].encode() + b"\n" + verdict)

# -- the zygote --
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
PRELOAD = ("typing", "collections", "itertools", "functools", "math", "heapq", "random",
           "fractions", "re", "string", "bisect", "decimal", "statistics")

def enter_box(mode, paths):
    """Once per zygote. ns, userns (namespaces from unshare): a new root of read-only binds of the
    system folders and Python's (paths), /dev's null, zero, random and urandom, this namespace's
    /proc and a fresh tmpfs at /tmp for the programs' folders; no other file of the machine's.
    userns, plain: not dumpable (no process of the same user reads ours through /proc).
    -> the names in /tmp that hold Python's folders (a venv under /tmp), which clear keeps."""
    global LIBC
    import ctypes
    LIBC = ctypes.CDLL(None, use_errno=True)
    if mode in ("userns", "plain"):
        prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    if mode not in ("ns", "userns"):
        return set()

    def mount(source, target, kind, flags, data=None):
        args = [x if x is None else x.encode() for x in (source, target, kind, data)]
        if LIBC.mount(args[0], args[1], args[2], flags, args[3]) != 0:
            raise OSError(ctypes.get_errno(), "mount " + target)

    def read_only(target, recursive=True):  # mount_setattr(AT_FDCWD, ..., AT_RECURSIVE, RDONLY)
        attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)
        if LIBC.syscall(442, -100, target.encode(), 0x8000 * recursive, attr, 32) != 0:
            raise OSError(ctypes.get_errno(), "mount_setattr " + target)
    keep = []
    for path in sorted(set(SYSTEM + tuple(paths))):
        if os.path.lexists(path) and not any(path.startswith(k + "/") for k, _ in keep):
            keep.append((path, os.open(path, os.O_PATH)))  # still reachable once /tmp is covered
    root = "/tmp"
    mount("gmts", root, "tmpfs", 2 | 4, "size=1m,mode=0755")  # MS_NOSUID | MS_NODEV
    os.mkdir(root + "/tmp")  # the programs' /tmp first: a Python under /tmp is bound on top of it
    mount("gmts", root + "/tmp", "tmpfs", 2 | 4, "size=256m,mode=0755")
    for path, fd in keep:
        if os.path.islink(path):  # /bin -> usr/bin
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir("/proc/self/fd/%d" % fd):
            os.makedirs(root + path)  # its parents 0755 here, whatever they are outside
            mount("/proc/self/fd/%d" % fd, root + path, None, 4096 | 16384)  # MS_BIND | MS_REC
            read_only(root + path)
        os.close(fd)
    in_tmp = {path.split("/")[2] for path, _ in keep if path.startswith("/tmp/")}
    for name in in_tmp:  # its folders there read-only too, whoever the program is
        mount(root + "/tmp/" + name, root + "/tmp/" + name, None, 4096 | 16384)
        read_only(root + "/tmp/" + name)
    os.makedirs(root + "/dev")
    for name in ("null", "zero", "random", "urandom"):
        os.close(os.open(root + "/dev/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        mount("/dev/" + name, root + "/dev/" + name, None, 4096)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", 2 | 4 | 8)  # MS_NOEXEC too
    read_only(root, recursive=False)
    os.chroot(root)
    os.chdir("/")
    return in_tmp

def clear(folder, keep=()):
    """Remove everything in folder but the names in keep, whatever modes the program left."""
    import shutil

    def retry(fn, path, _):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        fn(path)
    for entry in set(os.listdir(folder)) - set(keep):
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=retry)
        else:
            os.unlink(path)

def main():
    config = read_part(0)
    mode, base, uid = config["mode"], config["base"], config["uid"]
    sys.path[:] = [os.path.realpath(p) for p in sys.path]
    paths = [os.path.realpath(p) for p in config["paths"] if os.path.isdir(p)]
    keep = enter_box(mode, [p for p in sys.path if os.path.isdir(p)] + paths)
    for name in PRELOAD:  # loaded once here: a program's import of them costs nothing
        try:
            __import__(name)
        except ImportError:
            pass
    base = "/tmp" if mode in ("ns", "userns") else base
    while True:
        try:
            job = read_part(0)
        except EOFError:
            return
        job.update(work=os.path.join(base, "w"), uid=uid, paths=paths, mode=mode)
        os.mkdir(job["work"], 0o700)
        if uid >= 0:
            os.chown(job["work"], uid, uid)
        verdict_r, verdict_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(verdict_r)
            try:
                judge(job, verdict_w, parent)
            finally:
                os._exit(0)
        os.close(verdict_w)
        verdict = recv(verdict_r, time.monotonic() + job["limits"]["wall"] + 1, 1 << 30)
        os.close(verdict_r)
        end(pid)
        clear(base, keep)
        send(1, verdict or b"")
        if verdict is None:  # the judge may have left part of its secret unread: stop here
            return

main()
'''

def code_tests(row: dict) -> tuple:
    """What a code row is graded on, hashable: (prelude, setup, tests, entry, inputs, outputs)."""
    return (row.get("prelude", ""), row.get("setup", ""), row.get("tests", ""),
            row.get("entry", ""), tuple(row.get("inputs") or ()), tuple(row.get("outputs") or ()))

def output_digest(text: bytes) -> str:
    """The stdio comparison, as the judge digests a program's stdout: every line without its
    trailing whitespace, and no trailing whitespace at the end; no line is dropped."""
    import hashlib
    lines = text.rstrip().split(b"\n")
    return hashlib.sha256(b"\n".join(line.rstrip() for line in lines)).hexdigest()

def _frame(data: bytes) -> bytes:  # the harness's messages: the length in 10 digits, the bytes
    return b"%010d" % len(data) + data

def _read_frame(fd: int, deadline: float, cap: int = 1 << 24) -> bytes:
    """One message from the zygote before the deadline; OSError for none (an end, a timeout)."""
    import select
    data, need = b"", 10
    while len(data) < need:
        ready = select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]
        chunk = os.read(fd, need - len(data)) if ready else b""
        if not chunk:
            raise OSError("the zygote sent no verdict in time")
        data += chunk
        if need == 10 and len(data) == 10:
            if not data.isdigit() or int(data) > cap:
                raise OSError("the zygote broke the protocol")
            need += int(data)
    return data[10:]

class Zygote:
    """A sandbox's zygote process (SANDBOX_HARNESS in `mode`); run() grades one program."""

    def __init__(self, mode: str):
        import marshal, site, subprocess, tempfile
        cmd = [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", SANDBOX_HARNESS]
        if mode in ("ns", "userns"):
            spaces = ["--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
                      "--mount-proc"]
            cmd = [UNSHARE] + ["--user", "--map-root-user"] * (mode == "userns") + spaces + cmd
        self.base = None if mode in ("ns", "userns") else tempfile.mkdtemp(prefix="gmts-code-")
        if self.base:
            os.chmod(self.base, 0o711)  # the program's user reaches its folder there, no more
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd="/", start_new_session=True,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        uid = UID_BASE + self.proc.pid if mode in ("ns", "uid") else -1
        paths = site.getsitepackages() + [site.getusersitepackages()]
        config = dict(mode=mode, base=self.base, uid=uid, paths=paths)
        self.proc.stdin.write(_frame(marshal.dumps(config)))
        self.proc.stdin.flush()

    def run(self, code: str, row: dict, timeout: float = CODE_TIMEOUT_S):
        """Whether the program passes every test of the row; None where the zygote broke (it is
        closed then)."""
        import marshal
        stdio = row.get("inputs") is not None
        nonce = os.urandom(16).hex()
        limits = dict(cpu=math.ceil(timeout), memory=CODE_MEMORY, output=CODE_OUTPUT,
                      wall=timeout, reply=CODE_OUTPUT)
        program = row.get("prelude", "") + code
        job = dict(program=program, inputs=list(row["inputs"]) if stdio else None, limits=limits,
                   setup=row.get("setup", ""))  # public: the tests' inputs may be built there
        secret = dict(setup=row.get("setup", ""), tests=row.get("tests", ""), nonce=nonce,
                      entry=row.get("entry", ""))
        try:
            self.proc.stdin.write(_frame(marshal.dumps(job)) + _frame(marshal.dumps(secret)))
            self.proc.stdin.flush()
            verdict = _read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout + 3)
        except (OSError, ValueError):
            self.close()
            return None
        said, _, verdict = verdict.partition(b"\n")
        if said != nonce.encode():
            self.close()
            return None
        if not stdio:
            return verdict == b"pass"
        want = [output_digest(str(w).encode()).encode() for w in row["outputs"]]
        return verdict.split(b"\n") == want

    def close(self):
        """End the zygote and everything in it; remove its folder."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, 9)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)

CANARY = [("import math\ndef f(n):\n    return math.isqrt(n)\n", dict(tests="assert f(16) == 4\n")),
          ("print(int(input()) + 1)\n", dict(inputs=["41\n"], outputs=["42"]))]

@functools.lru_cache(maxsize=None)
def sandbox_mode() -> str:
    """The strongest isolation this machine gives (the table above): the first mode whose zygote
    starts and runs the CANARY programs (they import the standard library); else RunError."""
    tried = []
    for mode in (["ns", "uid"] if os.geteuid() == 0 else ["userns", "plain"]):
        try:
            box = Zygote(mode)
            passed = [box.run(code, row, timeout=5.0) for code, row in CANARY]
            box.close()
        except OSError as e:  # no unshare
            passed = [error_line(e, 100)]
        if passed == [True, True]:
            return mode
        tried.append(f"{mode}: {passed}")
    raise RunError("--task code: no sandbox mode runs a test program on this machine ("
                   + "; ".join(tried) + "): namespaces (unshare) must be allowed, or the "
                   "programs' user able to read Python's standard library")

def run_programs(jobs: list, timeout: float = None, workers: int = 0) -> list:
    """[(program, row), ...] -> [passed, ...]: each program in the sandbox (Zygote) within
    `timeout` s (None: CODE_TIMEOUT_S), `workers` at once (0: the cores). A broken zygote fails
    its program and is replaced; nothing is raised but RunError (no sandbox runs here)."""
    import queue
    mode = sandbox_mode()
    timeout = timeout or CODE_TIMEOUT_S
    todo = queue.SimpleQueue()
    for i in range(len(jobs)):
        todo.put(i)
    passed = [False] * len(jobs)

    def worker():
        box = None
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                with contextlib.suppress(Exception):  # a fault of ours: this program fails
                    box = box or Zygote(mode)
                    passed[i] = bool(box.run(*jobs[i], timeout=timeout))
                if box and box.proc.poll() is not None:  # broken: a new one for the next
                    box.close()
                    box = None
        finally:
            if box:
                box.close()
    workers = min(workers or len(os.sched_getaffinity(0)), len(jobs))
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return passed

# ==== The command line [plumbing]: flags, their checks, and the one error handler ===============
RULES = [  # (fields, test, what their values must be); NaN fails every test
    (["rho", "top_p", "lr"], lambda v: 0 < v <= 1, "in (0, 1]"),
    (["temperature"], lambda v: 1e-4 <= v < math.inf, "finite and >= 1e-4"),
    (["max_grad_norm", "adam_eps"], lambda v: 0 < v < math.inf, "finite and > 0"),
    (["clip_low", "clip_high"], lambda v: 0 <= v < 1, "in [0, 1)"),
    (["kl_beta", "weight_decay", "rsi_low", "rsi_high"], lambda v: 0 <= v < math.inf,
     "finite and >= 0"),
    (["steps", "prompts_per_step", "max_new_tokens", "micro_batch", "inner_updates", "stats_chunk",
      "eval_size", "max_resample", "tiny_layers"], lambda v: v >= 1, ">= 1"),
    (["save_every", "eval_every", "warmup_steps", "top_k", "rollout_rows", "eval_samples",
      "threads"], lambda v: v >= 0, ">= 0"),
    (["group_size"], lambda v: v >= 2, ">= 2 (an advantage needs a group)"),
    (["seed"], lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    (["tiny_hidden"], lambda v: v >= 8 and v % 8 == 0, "a multiple of 8 (4 heads of even size)"),
]

def check_config(cfg: Config):
    """BadInput, in one line, for a value no run can use: before any work."""
    for names, ok, want in RULES:
        for name in names:
            if not ok(getattr(cfg, name)):
                raise BadInput(f"--{name.replace('_', '-')} must be {want}, "
                               f"got {getattr(cfg, name)!r}")
    if cfg.select not in METHODS:
        raise BadInput(f"--select must be one of {', '.join(METHODS)}, got {cfg.select!r}")
    if cfg.rsi_low >= cfg.rsi_high:
        raise BadInput(f"--rsi-low {cfg.rsi_low} must be below --rsi-high {cfg.rsi_high} "
                         "(an interval of one value keeps no token)")
    if METHODS[cfg.select].band and (cfg.scope != "auto" or cfg.loss_norm == "selected"):
        raise BadInput(f"--select {cfg.select} keeps an interval, with no budget: not with --scope "
                         "group/batch or --loss-norm selected")
    for data in [cfg.data] + [d for _, d in eval_sets(cfg.eval_data)]:
        if data_kind(data) == "hf":
            hf_spec(data)
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        raise BadInput(f"--report-to {cfg.report_to} needs the {cfg.report_to} package "
                       f"(pip install {cfg.report_to})")
    if cfg.prompt_style != "ours" and cfg.task not in ("math", "commonsense"):
        raise BadInput(f"--prompt-style {cfg.prompt_style} asks for a \\boxed{{}} answer: "
                       "--task math or commonsense only")
    if data_kind(cfg.data) == "gen" and cfg.data_order == "epoch":
        raise BadInput(f"--data-order epoch passes over a file's or set's rows; --data {cfg.data} "
                       "draws fresh problems")
    if cfg.device != "auto" and pick_device("auto").type != cfg.device and cfg.device != "cpu":
        raise BadInput(f"--device {cfg.device} but torch sees no such device "
                       "(use --device auto or cpu)")

RESUME_FLAGS = ("resume", "steps", "eval_every", "save_every", "device", "threads", "report_to")

def parse_args(argv=None) -> Config:
    """Config from the command line (HfArgumentParser: a --flag per field): the defaults, then
    --preset NAME's, then the flags given. --resume OUT: the run's saved config (resume_config)."""
    from transformers import HfArgumentParser
    p = HfArgumentParser(Config,
                         description="GRPO with GMTS token selection (gmts.py's docstring).")
    p.add_argument("--preset", choices=list(PRESETS),
                   help="a named group of defaults: " + ", ".join(PRESETS))
    p.error = bad_flag
    names = [f.name for f in dataclasses.fields(Config)] + ["preset"]
    # argparse leaves a value it finds in the namespace: unset marks a flag not given
    unset = object()
    parsed = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(names, unset)))
    given = {k: v for k, v in vars(parsed).items() if v is not unset}
    preset = given.pop("preset", None)
    if given.get("resume"):
        return Config(**resume_config(given, preset))
    return Config(**dict(PRESETS.get(preset, {}), **given))

def resume_config(given: dict, preset=None) -> dict:
    """--resume OUT: the run's saved config (read_run_config) with the RESUME_FLAGS given (--steps:
    check_steps). Any other flag given, or set by --preset, must repeat its saved value: a changed
    run is a new run from --model OUT/ckpt-N. BadInput names the flag and both values."""
    out = given["resume"]
    saved = read_run_config(out)
    for key, value in dict(PRESETS.get(preset, {}), **given).items():
        if key == "out" and key in given and os.path.realpath(value) != os.path.realpath(out):
            raise BadInput(f"--out {value} is not the --resume folder {out}")
        if key in RESUME_FLAGS or key == "out":  # may change (a preset's --out: the run's own)
            continue
        was = saved.get(key, getattr(Config, key))
        if value != was:
            flag = f"--{key.replace('_', '-')} {value}"
            said = flag if key in given else f"--preset {preset} sets {flag}"
            raise BadInput(f"{said}, but the run in {out} has {was}: --resume continues a run "
                           f"with its saved config (a changed run is a new run from --model "
                           f"{out}/ckpt-N)")
    return dict(saved, **{k: v for k, v in given.items() if k in RESUME_FLAGS}, out=out)

def bad_flag(message: str):  # argparse's error(): BadInput, so run_cli's one line says it, exit 2
    raise BadInput(message)

def memory_fault(e, lower: str = "--micro-batch, --group-size or --max-new-tokens "
                                 "(or set --rollout-rows)"):
    """The one line for a failed CPU or GPU allocation, naming the flags to lower; else None."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    if isinstance(e, MemoryError) or "can't allocate memory" in text:
        return f"out of CPU memory: lower {lower}, or use a smaller model"
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
        return f"out of GPU memory: lower {lower}"
    return None

def error_line(e, cap: int = 1000) -> str:
    """An error's one line: memory_fault's, else its message (newlines escaped) cut at cap."""
    return memory_fault(e) or "\\n".join(str(e).strip().splitlines())[:cap] or type(e).__name__

def kept_note(out) -> str:
    """What an interrupted or failed run in `out` leaves, and how to go on."""
    done = checkpoints(out) if out else []
    if not done:
        return f"; {out} holds no checkpoint of this run" if out else ""
    return f"; {out} keeps {os.path.basename(done[-1])}: continue with --resume {out}"

def run_cli(prog: str, command, kept=lambda: "", lower: str = None):
    """The one error handler of gmts.py and of its satellites: command() runs, and an error ends it
    as one line 'PROG: error: ...' on stderr, its exit code set by where the error came from:
      2    bad input: BadInput, raised by the checks of what the user gave (a flag, a file, a path,
           a folder's state) before any work;
      1    a fault while running: out of memory (with the flags to lower), an OSError (a full
           disk), a RunError (a checkpoint or final model that could not be written, whatever
           raised it); the line adds kept(), the checkpoint kept;
      1    anything else is a bug, a plain ValueError too: the same line, then the exception goes
           on (Python prints its traceback under the line; a caller gets the exception);
      130  Ctrl-C, with kept()."""
    try:
        return command()
    except KeyboardInterrupt:
        code, why = 130, "interrupted"
    except BadInput as e:
        code, why = 2, error_line(e)
    except Exception as e:
        fault = memory_fault(e, lower) if lower else memory_fault(e)
        if not (fault or isinstance(e, (OSError, RunError))):
            print(f"{prog}: error: {type(e).__name__}: {error_line(e, 300)}{kept()} (a bug, not "
                  "bad input: its traceback follows)", file=sys.stderr, flush=True)
            raise
        code, why = 1, fault or error_line(e)
    print(f"{prog}: error: {why}{kept() if code != 2 else ''}", file=sys.stderr, flush=True)
    sys.exit(code)

def main(argv=None):
    cfg = None

    def command():
        nonlocal cfg
        cfg = parse_args(argv)
        check_config(cfg)
        changed = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config, k)}
        print(f"config (other than the defaults; {cfg.out}/run_config.json has all): "
              f"{json.dumps(changed)}")
        train(cfg)
    run_cli("gmts", command, lambda: kept_note(cfg.out if cfg else None))

if __name__ == "__main__":
    main()
