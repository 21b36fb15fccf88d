"""
gmts.py: GRPO with Gradient Magnitude-based Token Selection (GMTS), in one file. Read it beside the papers:
  GMTS   Lv et al. 2026, "Gradient Magnitude-based Token Selection Improves RLVR Training for LLM
         Reasoning", arXiv 2608.30632: train on about the top 20% of each prompt's tokens by H_t *
         |omega_t|, an approximation of the size of their gradient, as the authors' code does it.
  80/20  Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for
         LLM Reasoning", arXiv 2506.01939: train on the top 20% by entropy H_t.

One training step, as train() numbers it; the file follows this order:
  1. draw B prompts from the task                                     [plumbing]
  2. sample G answers per prompt with HF generate (N = B*G answers)   [paper: rollout]
  3. score every answer with a rule-based verifier -> reward r_i      [paper: reward]
  4. group advantages A_i = (r_i - mean_group) / (std_group + eps)    [paper: GRPO advantage]
  5. per response token: log pi(y_t) and entropy H_t                  [paper: token statistics]
     and grad_norm = ||d log p_y / d logits|| (for gradnorm)          [ours]
  6. score tokens, keep the top rho of each group or of the batch     [paper: selection]
       entropy   H_t, over the whole batch                            [80/20, GMTS's ETS baseline]
       gmts      H_t * |omega_t|, omega = -dL/dlogp_t, per group      [GMTS]
       gradnorm  |omega_t| * grad_norm = ||dL/dz||, over the batch    [ours: an ablation]
  7. PPO-clip update on the kept tokens only, in micro-batches        [paper: objective]
  8. log, evaluate, checkpoint                                        [plumbing]
Below the "Supporting code" banner: data, model loading, evaluation, the run folder, the CLI.

Provenance. GMTS as its authors' code runs it (github.com/outongyiLv/GMTS, GMTS-Framework1, a one-GPU loop like
this file: grpo_tools/grpo.py's GMTS() for the score and per-group budget, normalize_rewards_per_group and
approx_kl_divergence for the normaliser and KL inside omega, update_policy for the ETS entropy baseline). Their
Framework2 (verl, Qwen3-8B) differs: omega = r * I * A, ties at the threshold dropped, and as released its group
loop reaches only the first of every four groups of a GPU's mini-batch. Ours: --scope batch for gmts (our earlier
variant), gradnorm, the defaults --loss-norm all and no KL (theirs: seq, 0.001), the entropy tie rule.

Axes: B prompts per step, G answers per prompt, N = B*G answers, P prompt length (left padded), T
response length, V vocabulary, d hidden size. Every (N, T) tensor is aligned to RESPONSE positions:
column t holds the statistics of the t-th generated token, predicted from the hidden state before it.

Deviations from the papers and choices they leave open:
  1. Scope (--scope): gmts ranks within each prompt's group, as its authors; the others over the whole
     batch, keeping exactly ceil(rho * n), ties to the earlier token (the authors' ETS keeps every tie
     at its threshold, NOTES; the 80/20 code selects per micro-batch and GPU).
  2. omega = -dL/dlogp of the whole configured loss (derivation step 1), rescored each inner update.
  3. --loss-norm all (default) divides by all valid tokens (80/20 paper, TRL): selection is a pure mask
     of one sum, one lr for every method; 'selected' by the kept budget (80/20 code); 'seq' is GRPO's
     per-answer mean, averaged over the answers where GMTS's authors sum over prompts (NOTES).
  4. Population std in the group advantage (divide by G).
  5. --filter-groups (DAPO's dynamic sampling, default on, every method alike) drops groups whose
     rewards are all equal and draws more prompts, up to --max-resample rollout batches per step.
  6. One step rule: the optimiser steps iff some token has a non-zero gradient (a kept token with
     A != 0 and an inactive clip, or with KL one whose log-prob differs from the reference's) and the
     loss and gradient norm are finite; the lr follows GRPO steps regardless.
  7. KL (k3, beta > 0) covers all valid tokens, with the loss's normaliser; its reference is the model
     --model loads, its log-probs on the loss's own code path (equal weights, equal bits).
  8. fp32 master weights with bf16 autocast on CUDA; log-softmax, entropy and the loss always fp32.
  9. gmts/gradnorm never keep a token whose score is 0 (its gradient is exactly 0; for gmts also a
     token of zero entropy, as its authors): maybe fewer than rho.
 10. Rewards: countdown's 0.1 format reward (TinyZero), math binary (80/20 paper), logic as countdown.

Run:  python gmts.py --preset cpu                   (offline, CPU: a tiny warm-started model learns)
      python gmts.py --model Qwen2.5-0.5B-Instruct --task countdown --out out/qwen   (one GPU)
"""
import os
import signal

if __name__ == "__main__":  # a stop signal while torch imports (seconds): one line, not a traceback
    def _stopped_while_starting(*_):
        os.write(2, b"gmts: error: interrupted while starting\n")
        os._exit(130)
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _stopped_while_starting)

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse, ast, contextlib, copy, dataclasses, fcntl, fnmatch, functools, hashlib, importlib
import itertools, json, logging, math, queue, random, re, select, shutil, subprocess, sys, tempfile
import concurrent.futures, threading, time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F

# ==== Config [plumbing]: every field is a --flag; --preset NAME applies PRESETS[NAME] first =======
def arg(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})

@dataclass
class Config:
    # run
    out: str = arg("out/run", "output folder: metrics.jsonl, checkpoints, the final model")
    overwrite: bool = arg(False, "replace the run in --out (its metrics and checkpoints go)")
    resume: str = arg("", "an earlier --out: continue its run from the newest loadable checkpoint")
    allow_change: bool = arg(False, "with --resume: allow flags that change the run's trajectory (all but --out, "
                                    "--steps, --save-every, --eval-every, --device, --report-to, --threads)")
    seed: int = arg(0, "seeds python, torch and every step's sampling")
    device: str = arg("auto", "auto picks cuda > mps > cpu")
    threads: int = arg(0, "CPU threads torch uses (0: torch's choice, faster on idle cores; cpu, smoke presets: 1)")
    steps: int = arg(200, "GRPO steps")
    save_every: int = arg(50, "checkpoint every this many steps (0: only at the end)")
    report_to: str = arg("none", "also to tensorboard (OUT/tensorboard) or wandb (OUT/wandb)")
    # model
    model: str = arg("tiny", "'tiny' (random, built offline), a short Qwen name (Qwen2.5-0.5B), a hub id or a folder")
    chat_template: str = arg("auto", "wrap prompts in the chat template: auto (decided by the tokenizer), yes, no")
    tiny_hidden: int = arg(64, "--model tiny: hidden size")
    tiny_layers: int = arg(2, "--model tiny: transformer layers")
    grad_ckpt: bool = arg(False, "gradient checkpointing in the update forward")
    # task
    task: str = arg("countdown", "countdown, math or logic")
    data: str = arg("gen", "gen (offline generator), easy (its smallest variant), hf, hf:test, hf:ID[:CONFIG][:SPLIT] "
                           "(a hub set or a local dataset folder), or a .jsonl, .json, .csv or .parquet file")
    data_columns: str = arg("", "QUESTION,ANSWER columns for a math set's own layout (a.b: b in a)")
    prompt_style: str = arg("ours", "ours (<think>, <answer>), qwen-math (GMTS Framework1's \\boxed{} system prompt) "
                                    "or boxed-suffix (Framework2's \\boxed{} request after the question); math only")
    short_prompt: bool = arg(False, "terse prompts, no system line (for the byte-level tiny model)")
    eval_every: int = arg(20, "held-out accuracy every this many steps (0: at step 0 and the last)")
    eval_size: int = arg(64, "held-out problems (the data's first rows; none with --eval-data)")
    eval_data: str = arg("", "benchmarks instead of held-out rows: NAME=DATA,... (DATA as --data), eval_NAME each")
    eval_samples: int = arg(0, "0: greedy; k: avg@k, k samples per problem (--temperature, --top-p)")
    # rollout
    prompts_per_step: int = arg(8, "B, informative prompts (groups) per step")
    group_size: int = arg(8, "G, answers sampled per prompt")
    max_new_tokens: int = arg(256, "response length limit; longer answers are cut and flagged")
    temperature: float = arg(1.0, "sampling temperature, also used for log-probs and entropy")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the full distribution (on-policy)")
    top_k: int = arg(0, "top-k sampling; 0 disables it")
    sampler_dtype: str = arg("auto", "generate's weights: bf16 (a copy) or fp32; auto: bf16 on CUDA")
    fast_generate: bool = arg(None, "a static KV cache, compiled decoding (unset: on with CUDA)")
    filter_groups: bool = arg(True, "DAPO dynamic sampling: drop equal-reward groups, draw more")
    max_resample: int = arg(4, "--filter-groups: at most this many rollout batches per step")
    overlong_filter: bool = arg(False, "DAPO's overlong filter: a truncated answer trains nothing")
    # GRPO
    clip_low: float = arg(0.2, "PPO clip eps below 1")
    clip_high: float = arg(0.28, "PPO clip eps above 1 (DAPO clip-higher)")
    kl_beta: float = arg(0.0, "k3 KL to the starting model (0: no reference model is loaded)")
    std_normalize: bool = arg(True, "divide advantages by the group std (off: Dr. GRPO)")
    inner_updates: int = arg(1, "optimiser steps per rollout batch (mu)")
    loss_norm: str = arg("all", "all: divide by all valid response tokens; selected: by the kept budget; seq: GRPO's "
                                "per-answer mean (1/|o_i|), averaged over the answers (GMTS's authors)")
    # token selection
    select: str = arg("gmts", "all, random, entropy, gmts (GMTS as its authors' code; its scope: --scope) or gradnorm")
    rho: float = arg(0.2, "share of the response tokens kept")
    scope: str = arg("auto", "where the top rho is taken: group (each prompt's G answers: GMTS's authors) or batch "
                             "(80/20, ETS; with gmts, this project's variant); auto: group for gmts, else batch")
    # optimisation
    lr: float = arg(1e-6, "AdamW learning rate")
    warmup_steps: int = arg(10, "linear lr warm-up in update slots (steps x --inner-updates, stepped or not)")
    lr_decay: bool = arg(True, "after warm-up, a linear lr decay to ~0 at the end (off: constant)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    micro_batch: int = arg(8, "answers per forward/backward (gradient accumulation over the batch)")
    stats_chunk: int = arg(1024, "rows of the (tokens x V) logits held at once in the head")

CHOICES = {
    "select": ["all", "random", "entropy", "gmts", "gradnorm"],
    "device": ["auto", "cuda", "mps", "cpu"],
    "chat_template": ["auto", "yes", "no"],
    "loss_norm": ["all", "selected", "seq"],
    "scope": ["auto", "group", "batch"],
    "sampler_dtype": ["auto", "bf16", "fp32"],
    "report_to": ["none", "tensorboard", "wandb"],
    "prompt_style": ["ours", "qwen-math", "boxed-suffix"],
}
WARM_CPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm", "cpu")
PRESETS = {
    # Offline CPU demo: a 0.27M-parameter Qwen2 warm-started (`python gmts_lab.py warm`) to copy
    # the numbers of easy countdown with random signs; GRPO learns from the reward which signs hit
    # the target. No --filter-groups: on this demo it took 2.4x the rollouts for no gain.
    "cpu": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=80,
                prompts_per_step=32, group_size=8, max_new_tokens=64, lr=3e-4, micro_batch=256,
                eval_every=10, eval_size=256, save_every=20, filter_groups=False, threads=1, out="out/cpu"),
    # A seconds-long version of the same path, for tests.
    "smoke": dict(model=WARM_CPU, task="countdown", data="easy", short_prompt=True, steps=2,
                  prompts_per_step=2, group_size=4, max_new_tokens=16, eval_every=1, eval_size=4,
                  lr=1e-4, threads=1, out="out/smoke"),
}

# ==== Rollouts [paper: sampling]: G answers per prompt from the full softmax at temperature T =====
ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"  # TinyZero's prefill
SYSTEM_PROMPT = "You are a helpful assistant. You first think about the reasoning process and then answer."
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."  # GMTS Framework1's
BOXED_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."  # Framework2's, after a space

def end_token_ids(tok) -> list:
    """The ids that end an answer: the tokenizer's eos plus Qwen's <|im_end|> and <|endoftext|>."""
    ids = {tok.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)

def use_chat(tok, chat: str = "auto") -> bool:
    """Chat template for instruct models, plain text for base models. Qwen ships a template with both,
    but only instruct tokenizers end a turn with eos = <|im_end|>, so auto = a template and that eos."""
    if chat != "auto":
        return chat == "yes"
    return bool(getattr(tok, "chat_template", None)) and tok.eos_token == "<|im_end|>"

def render_prompt(tok, question: str, chat: bool, system: bool = True, style: str = "ours") -> str:
    """The text the model continues: the question in the chat template or a plain User/Assistant frame, ending
    inside the assistant's <think> (\\boxed{} styles: an empty turn). system=False drops the system line."""
    head, prefix = (SYSTEM_PROMPT, ASSISTANT_PREFIX) if style == "ours" else (QWEN_MATH_SYSTEM, "")
    if style == "boxed-suffix":
        question, system = f"{question} {BOXED_SUFFIX}", False
    if not chat:
        return (head + "\n" if system else "") + f"User: {question}\nAssistant: {prefix}".rstrip(" ")
    msgs = [{"role": "system", "content": head}] if system else []
    msgs.append({"role": "user", "content": question})
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + prefix

def build_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False) -> list:
    """Prompt strings for task rows in task["style"]; short=True: terse questions, no system line."""
    questions = [task["prompt"](r, short=short) if task.get("style", "ours") == "ours" else r["question"] for r in rows]
    return [render_prompt(tok, q, chat, not short, task.get("style", "ours")) for q in questions]

def completion_mask(completion_ids: torch.Tensor, end_ids: list) -> tuple:
    """(resp_mask (N, T) bool, truncated (N,)). Valid response positions, by POSITION: up to and
    including the first end token. Never by comparing with the pad id: Qwen's pad (<|endoftext|>) is
    also an end token, so a value test would drop the end token itself from the loss (tiny-grpo's bug)."""
    N, T = completion_ids.shape
    device = completion_ids.device
    is_end = torch.isin(completion_ids, torch.tensor(end_ids, device=device))  # (N, T)
    has_end = is_end.any(dim=1)  # (N,)
    no_end = torch.full((N,), T - 1, device=device)  # an answer without an end keeps every position
    first_end = torch.where(has_end, is_end.int().argmax(dim=1), no_end)  # (N,)
    resp_mask = torch.arange(T, device=device)[None, :] <= first_end[:, None]  # (N, T)
    return resp_mask, ~has_end

@torch.no_grad()
def rollout(model, tok, prompts: list, group_size: int, max_new_tokens: int, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, greedy: bool = False, fast: bool = False,
            sampler_logp: bool = False) -> dict:
    """group_size answers per prompt string (greedy=True: one greedy answer, for evaluation), on the model's device:
      prompt_ids, prompt_mask  (N, P)  the prompts, left padded, each repeated G times
      comp_ids, resp_mask      (N, T)  the answers and their valid positions (completion_mask)
      truncated                (N,)    answers that hit max_new_tokens without an end token
      texts                    N str   the answers, decoded up to their end
      sampler_logp             (N, T)  with sampler_logp=True: the sampler's log_softmax(logits / T) at each
                                       drawn token (pre-top-k/p, as the learner's; 0 after the end)
    fast: a static KV cache, its length rounded up to 64 (few shapes), compiled decoding on CUDA."""
    from transformers import GenerationConfig
    device = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    ids = enc["input_ids"].repeat_interleave(group_size, dim=0)  # (N, P)
    attn = enc["attention_mask"].repeat_interleave(group_size, dim=0)  # (N, P)
    check_positions(model, ids.shape[1], max_new_tokens)
    width = ids.shape[1] + max_new_tokens
    knobs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if greedy:
        knobs = dict(do_sample=False)
    if fast:
        knobs.update(cache_implementation="static", max_cache_len=-(-width // 64) * 64)
    end_ids = end_token_ids(tok)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=end_ids, pad_token_id=tok.pad_token_id, **knobs)
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
    texts = tok.batch_decode(comp.masked_fill(~resp_mask, tok.pad_token_id), skip_special_tokens=True)
    batch = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=resp_mask,
                 truncated=truncated, texts=texts)
    if recorder:
        batch["sampler_logp"] = recorder.finish(comp, resp_mask)  # (N, T)
    return batch

# ==== Rewards [paper: reward]: the tasks' rule-based verifiers, step 3 ============================
# Each task's prompt and verifier, in TASKS. Verifiers are pure, cap every length before parsing,
# use no eval/exec and never raise (a bug costs a reward, not a run). Task data: supporting code.
def _never_raise(fn, fallback=0.0):
    """A verifier's last-resort net (it handles expected failures itself): exception -> fallback."""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RunError:  # the grading worker cannot start: the machine's fault, never the answer's
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
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
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
        value = _OPS[_AST_OPS[type(node.op)]](left, right)
        if value is None:
            raise ZeroDivisionError
        return value
    raise ValueError(f"{type(node).__name__} not allowed")

@functools.partial(_never_raise, fallback=None)
def countdown_value(completion: str, nums: list):
    """Exact value of the last <answer> if an equation using each given number once, else None (no
    tag; '=', not allowed as in TinyZero; other characters or numbers; bad syntax)."""
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
    """1.0: the last <answer> is an equation that uses each given number once and equals the
    target; 0.1: an answer is there but wrong or invalid; 0.0: no answer tag."""
    if _last_answer(completion) is None:
        return 0.0
    return 1.0 if countdown_value(completion, nums) == target else 0.1

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
    """Exact value of '-$1,450', '72.00', '18.', '50%', '\\frac{1}{2}', '\\frac{-20}{2}', '3/4' ...; else None."""
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
        parts = [s]
    if len(parts) == 1:
        value = _decimal(parts[0].strip(), signed=False)
        if value is None:
            return None
        return sign * value
    top = _decimal(parts[0].strip(), signed=True)  # a fraction: a sign on either side (\frac{-20}{2}, \frac{20}{-2})
    bottom = _decimal(parts[1].strip(), signed=True)
    if top is None or bottom is None or bottom == 0:
        return None
    return sign * top / bottom

def _last_boxed(text: str, tries=5, cap=100):
    """The last closed \\boxed{...}'s content, by bounded brace scans from the last few openings."""
    end = len(text)
    for _ in range(tries):
        i = text.rfind("\\boxed{", 0, end)
        if i < 0:
            return None
        start = i + len("\\boxed{")
        depth = 1
        for j in range(start, min(len(text), start + cap)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start:j]
        end = i
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
    """The last \\boxed{}, else the number after the last ####, else the last number in the text
    (or None). boxed_only (competition answers): the last \\boxed{} of up to 300 characters only."""
    boxed = _last_boxed(text, cap=300 if boxed_only else 100)
    if boxed is not None or boxed_only:
        return boxed
    k = text.rfind("####")
    if k < 0:
        return _last_number(text)
    m = _NUM_TOKEN.search(text, k + 4, k + 104)
    if m is None:
        return None
    return m.group().rstrip(",.")

@_never_raise
def math_reward(completion: str, answer: str, latex: bool = False) -> float:
    """Binary: 1.0 iff the final answer equals the reference exactly (as fractions); no format bonus.
    latex (a competition row): the last \\boxed{}, by math-verify (latex_equal) unless both are numbers."""
    gold = parse_number(str(answer))
    got = math_final_answer(completion, boxed_only=latex)
    if got is None or (gold is None and not latex):
        return 0.0
    if gold is not None and (not latex or parse_number(got) is not None):
        return 1.0 if parse_number(got) == gold else 0.0
    return 1.0 if latex_equal(str(answer), got) else 0.0

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

# -- prompts (the caller prefills "Let me solve this step by step.\n<think>") --
_FORMAT = "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags"

def countdown_prompt(row: dict, short=False) -> str:
    nums = row["nums"]
    t = row["target"]
    if short:
        return f"Make {t} from {' '.join(map(str, nums))}."
    return (f"Using the numbers {list(nums)}, create an equation that equals {t}. You can use "
            f"basic arithmetic operations (+, -, *, /) and each number must be used exactly "
            f"once. {_FORMAT}, for example <answer> (1 + 2) / 3 </answer>.")

def math_prompt(row: dict, short=False) -> str:
    if short:
        return row["question"]
    return (f"{row['question']}\n{_FORMAT}, with the final number inside \\boxed{{}}, "
            f"for example <answer> \\boxed{{42}} </answer>.")

def logic_prompt(row: dict, short=False) -> str:
    said = "\n".join(row["statements"])
    if short:
        return said
    return (f"On an island every inhabitant is a knight, who always tells the truth, or a knave, "
            f"who always lies. You meet {len(row['names'])} inhabitants: "
            f"{', '.join(row['names'])}.\n{said}\nWho is a knight and who is a knave? {_FORMAT}, "
            f"one entry per person, for example <answer> Alice: knight, Bob: knave </answer>.")
TASKS = {  # sample_groups calls "prompt" and "reward"; the supporting code adds "load", the loader
    "countdown": {"prompt": countdown_prompt, "reward": lambda c, row: countdown_reward(c, row["nums"], row["target"])},
    "math": {"prompt": math_prompt, "reward": lambda c, row: math_reward(c, row["answer"], row.get("latex", False))},
    "logic": {"prompt": logic_prompt, "reward": lambda c, row: logic_reward(c, row["solution"])},
}

def get_task(name: str) -> dict:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]

# ==== Group advantages [paper: GRPO] and dynamic sampling [DAPO] ==================================
def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over each group of G consecutive answers, (N,) -> (N,). The POPULATION std
    (divide by G: the group is all we compare to) gives step 5's clean binary values (TRL's unbiased std scales them by
    sqrt((G-1)/G)). A uniform group gets exactly 0 (not 1e-17, never NaN). std_normalize=False: Dr. GRPO's r - mean."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    same = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values  # (B, 1)
    return adv.masked_fill(same, 0.0).view(-1)  # (N,)

def informative(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the groups whose rewards are not all equal (A != 0 somewhere: a gradient)."""
    r = rewards.view(-1, group_size)  # (B, G)
    return r.max(dim=1).values != r.min(dim=1).values

def keep_groups(parts: list, group_size: int, B: int, pad_id: int) -> tuple:
    """--filter-groups: join one step's rollout batches [(batch, rewards, adv), ...], keep the first B
    informative groups -> (batch, rewards, adv), every per-answer entry; none: the first batch (all A = 0)."""
    rewards = torch.cat([part[1] for part in parts])  # (N_all,)
    advs = torch.cat([part[2] for part in parts])  # (N_all,)
    keep = informative(rewards, group_size).nonzero().squeeze(1)[:B]  # (<= B,) kept groups
    if keep.numel() == 0:
        return parts[0]
    idx = (keep[:, None] * group_size + torch.arange(group_size)).view(-1)  # their answers
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
# A_i, ratio r = pi_theta(y) / pi_old(y). The GRPO/PPO-clip token loss (eps_l, eps_h the clip range):
#     l = -min( r * A,  clip(r, 1 - eps_l, 1 + eps_h) * A )
# Step 7 minimises it over the kept tokens S, with k3 KL (beta > 0) over every valid token:
#     L = sum_{t in S} w_t * l_t / D  +  beta * sum_{t valid} w_t * k3_t / D_kl
#     k3 = e^d - d - 1,  d = log pi_ref(y) - log pi_theta(y)
# w, D, D_kl are --loss-norm's normaliser (loss_weights): all w = 1, D = D_kl = the valid tokens;
# selected D = the kept budget; seq w_t = 1 / |o_i| (answer i's length), D = D_kl = N answers.
# 1. The min picks the clipped branch, whose gradient is 0, exactly when (A > 0 and r > 1 + eps_h)
#    or (A < 0 and r < 1 - eps_l): "the clip is active", I_t = 0 (else I_t = 1). Otherwise
#    dl/dlogp_y = -r * A (dr/dlogp_y = r), and dk3/dlogp_y = 1 - e^d = 1 - pi_ref / pi_theta. So for
#    a kept token, with omega its coefficient in dL = -omega * dlogp_t (GMTS's omega):
#        omega_t = -dL/dlogp_t = w_t r_t I_t A_i / D  +  beta w_t (pi_ref / pi_theta - 1) / D_kl
#    L depends on token t's logits only through log p_y, so dL/dtheta = -sum_t omega_t dlogp_t/dtheta.
# 2. log p_y = z_y / T - logsumexp(z / T), so dlogp_y/dz_j = (1/T) * (onehot(y)_j - p_j) and
#        dL/dz = -(omega / T) * (onehot(y) - p)                          (the logit gradient)
# 3. Its L2 norm: ||onehot(y) - p||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2 = 1 - 2 p_y + sum_j p_j^2,
#        ||dL/dz|| = |omega| / T * sqrt(1 - 2 p_y + sum_j p_j^2) = |omega| * grad_norm (token_stats)
# 4. How it relates to entropy WITHIN an answer (omega is the same for all of answer i's tokens when r = 1, beta = 0):
#    a. Pointwise, for the token actually sampled:
#           (1 - p_y)^2 <= ||onehot(y) - p||^2 <= 2 (1 - p_y)^2,
#       so the norm is set by p_y, not by H: a rare token sampled at a near-certain position has a
#       large one (at p = (0.999, 50 x 2e-5): H = 0.012 nats, norm 1.4135).
#    b. In expectation over y ~ p (Shannon entropy >= Renyi-2 entropy):
#           E||onehot(y) - p||^2 = 1 - sum_j p_j^2 <= 1 - exp(-H),
#       so a near-certain position (H ~ 0) has a near-zero logit gradient ON AVERAGE.
#    Entropy ranks positions by (b), missing (a)'s tokens; gradnorm scores each by its exact norm.
# 5. Why omega matters ACROSS answers: it differs between them. With binary rewards and k of G
#    answers correct, A = +sqrt((G-k)/k) for the correct and -sqrt(k/(G-k)) for the wrong ones
#    (G = 8, k = 1: +2.65 vs -0.38), A = 0 for a group whose answers all got the same reward, and
#    under seq the 1 / |o_i| ranks a token of a short answer above the same token of a long one.
#    Entropy ranking ignores this factor: it spends budget on tokens whose gradient is small or 0.
# 6. GMTS scores a token by H_t * |omega_t| (entropy standing in for step 3's per-token norm) and
#    keeps about the top rho of each prompt's group (group_keep's budget; a score of 0, H_t = 0
#    included, is never kept: the authors' code, see "Provenance"). 'gradnorm' uses the exact norm
#    ||dL/dz|| = |omega| * grad_norm instead (our ablation, for the same vocabulary reduction as H).
# Left open by the authors: p, H, log p at the rollout temperature T; omega, fp32: deviations 2, 8.

def token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> tuple:
    """(logp, entropy, grad_norm) of each sampled token, in fp32. logits (..., V), tokens (...) -> 3 x (...).
    logp      = log p_y,  p = softmax(logits / T)
    entropy   = -sum_j p_j log p_j                                   (nats)
    grad_norm = ||d logp_y / d logits||_2 = (1/T) * sqrt(1 - 2 p_y + sum_j p_j^2)   (step 3)"""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # (..., V)
    y = tokens.unsqueeze(-1)  # (..., 1)
    logp = logp_all.gather(-1, y).squeeze(-1)  # log p_y, (...)
    p_y = logp.exp()  # (...)
    # p_rest is p with p_y set to 0: its sums run over j != y; y's own term is added back to them.
    p_rest = logp_all.exp().scatter(-1, y, 0.0)  # (..., V)
    # H = -sum_j p_j log p_j = -(sum_{j != y} p_j log p_j + p_y log p_y)
    entropy = -((p_rest * logp_all).sum(-1) + p_y * logp)  # (...)
    # ||onehot(y) - p||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2. Unlike 1 - 2 p_y + sum_j p_j^2 it does
    # not cancel catastrophically when p_y ~ 1 (1 - p_y = -expm1(log p_y)).
    sq = torch.expm1(logp).square() + torch.linalg.vector_norm(p_rest, dim=-1).square()  # (...)
    return logp, entropy, sq.sqrt() / temperature

def response_hidden(model, batch: dict, rows=slice(None)) -> torch.Tensor:
    """Final hidden states that PREDICT each response token (position P-1+t predicts token t)
    -> (n, T, d). Position ids come from the attention mask (cumsum - 1), as generate() computes
    them under left padding. The decoder is the model's own (get_decoder), so any causal LM works."""
    ids = torch.cat([batch["prompt_ids"][rows], batch["comp_ids"][rows]], dim=1)  # (n, P + T)
    attn = torch.cat([batch["prompt_mask"][rows], batch["resp_mask"][rows]], dim=1).long()  # (n, P + T)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (n, P + T)
    with autocast(ids.device):
        h = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    P, T = batch["prompt_ids"].shape[1], batch["comp_ids"].shape[1]
    return h[:, P - 1:P + T - 1]  # (n, T, d)

@torch.no_grad()
def batch_token_stats(model, batch: dict, temperature: float, micro_batch: int, chunk: int) -> tuple:
    """(logp, entropy, grad_norm), each (N, T) fp32, 0 where invalid: a no-grad forward in micro-batches,
    the lm_head on `chunk` valid tokens at a time (~3 (chunk, V) fp32 buffers for any N * T)."""
    head = model.get_output_embeddings()
    mask = batch["resp_mask"]  # (N, T)
    out = [torch.zeros(mask.shape, device=mask.device) for _ in range(3)]  # 3 x (N, T)
    for start in range(0, mask.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        m = mask[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        y = batch["comp_ids"][rows][m]  # (M,)
        parts = []
        for hc, yc in zip(h.split(chunk), y.split(chunk)):
            parts.append(token_stats(F.linear(hc, head.weight, head.bias), yc, temperature))
        for o, values in zip(out, zip(*parts)):  # zip(*parts): each statistic's chunks, in order
            block = o[rows]  # (n, T): a view (rows is a slice), so writing it writes o
            block[m] = torch.cat(values)
    return tuple(out)

def head_logp(hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor,
              temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """log p_y WITH autograd, chunked: each chunk's (C, V) logits are recomputed in backward
    (activation checkpointing), bounding the head's memory by the chunk, not M. (M, d) -> (M,)."""
    from torch.utils.checkpoint import checkpoint

    def logp(h, y):
        z = F.linear(h, head.weight, head.bias).float() / temperature  # (C, V)
        return z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)  # (C,)
    parts = [checkpoint(logp, h, y, use_reentrant=False) for h, y in zip(hidden.split(chunk), tokens.split(chunk))]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

@torch.no_grad()
def response_logp(model, batch: dict, mask: torch.Tensor, temperature: float, micro_batch: int,
                  chunk: int) -> torch.Tensor:
    """log p_y of the tokens in mask, (N, T) fp32 (0 elsewhere), on loss_backward's exact code path (same rows per
    micro-batch, same chunked head): equal weights, equal log-probs to the bit. For the KL reference (deviation 7)."""
    head = model.get_output_embeddings()
    out = torch.zeros(mask.shape, device=mask.device)  # (N, T)
    active = mask.any(dim=1).nonzero().squeeze(1)  # answers that enter the forward
    for rows in active.split(micro_batch):
        if rows.numel() == 0:  # no valid token: split() still yields one empty piece
            break
        m = mask[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        logp = head_logp(h, head, batch["comp_ids"][rows][m], temperature, chunk)  # (M,)
        r, t = m.nonzero(as_tuple=True)  # row-major, as m selects the hidden states
        out[rows[r], t] = logp
    return out

# ==== Scores and top-rho selection [paper: GMTS's score H * |omega|; 80/20's entropy score] =======
def clip_active(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Where the PPO clip zeroes the gradient (derivation step 1); adv and ratio broadcast."""
    above = (adv > 0) & (ratio > 1 + clip_high)
    below = (adv < 0) & (ratio < 1 - clip_low)
    return above | below

def loss_weights(loss_norm: str, valid: torch.Tensor, n_kept: int) -> dict:
    """--loss-norm's normaliser of L (derivation): dict(w=(N, T), denom=D, kl_denom=D_kl), for omega and
    policy_update. valid (N, T): the loss's tokens; n_kept: the kept count (train passes keep_budget's)."""
    n_valid = float(max(int(valid.sum()), 1))
    w = torch.ones(valid.shape, device=valid.device)  # (N, T)
    if loss_norm == "seq":  # GRPO: (1/N) sum_i (1/|o_i|) sum_t
        n = float(valid.shape[0])
        return dict(w=w / valid.sum(1, keepdim=True).clamp_min(1), denom=n, kl_denom=n)
    if loss_norm == "selected":
        return dict(w=w, denom=float(max(n_kept, 1)), kl_denom=n_valid)
    return dict(w=w, denom=n_valid, kl_denom=n_valid)

def omega(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float, kl_beta: float = 0.0,
          ref_ratio: torch.Tensor = None, *, w=1.0, denom: float = 1.0, kl_denom: float = 1.0) -> torch.Tensor:
    """omega_t = -dL/dlogp_t of a kept token (derivation step 1): w * ratio * A / denom where the PPO clip leaves the
    gradient alive (else 0), plus the KL term's kl_beta * w * (ref_ratio - 1) / kl_denom, ref_ratio = pi_ref / pi_theta.
    w, denom, kl_denom: loss_weights'; their defaults leave ratio * A. adv (N,), ratio (N, T) -> (N, T)."""
    a = adv[:, None]  # (N, 1)
    dead = clip_active(a, ratio, clip_low, clip_high)  # (N, T)
    om = torch.where(dead, torch.zeros_like(ratio), ratio * a) * w / denom  # the policy term's
    if kl_beta > 0:
        om = om + kl_beta * w * (ref_ratio - 1) / kl_denom  # the KL term's
    return om

def token_scores(method: str, entropy: torch.Tensor, grad_norm: torch.Tensor, om: torch.Tensor,
                 generator: torch.Generator = None) -> torch.Tensor:
    """The ranking score of each token; higher is kept first. All inputs (N, T) -> (N, T)."""
    if method == "all":  # vanilla GRPO (train keeps every token, rho = 1)
        return torch.ones_like(entropy)
    if method == "random":  # the control
        return torch.rand(entropy.shape, generator=generator).to(entropy.device)
    if method == "entropy":  # H_t (80/20 paper)
        return entropy
    if method == "gmts":  # H_t * |omega_t| (GMTS; H >= 0)
        return (entropy * om).abs()
    if method == "gradnorm":  # ||dL/dz||, the loss's exact logit-gradient norm (step 3; ours)
        return om.abs() * grad_norm
    raise ValueError(f"unknown selection method {method!r}; choose one of: {', '.join(CHOICES['select'])}")

def group_keep(counts: torch.Tensor, rho: float) -> torch.Tensor:
    """The authors' budget: of a group's n valid tokens drop max(1, ceil((1 - rho) n)) (so one even at rho = 1),
    keep the rest; in integer arithmetic on rho as written (limited where int64 would overflow). (B,) -> (B,)."""
    top = int(counts.max()) + 1 if counts.numel() else 1
    frac = Fraction(str(float(rho))).limit_denominator(2**62 // top)
    p, q = frac.numerator, frac.denominator
    drop = ((q - p) * counts + q - 1) // q  # ceil((1 - rho) n)
    return (counts - drop.clamp_min(1)).clamp_min(0)

def keep_budget(mask: torch.Tensor, rho: float, group_size: int = 0) -> int:
    """How many valid tokens select_tokens keeps before it drops zero scores: ceil(rho * n) of the whole
    batch's n (at least one), or with group_size G group_keep summed over the groups of G rows."""
    if group_size:
        return int(group_keep(mask.reshape(-1, group_size * mask.shape[-1]).sum(1), rho).sum())
    n = int(mask.sum())
    # rho * n exactly, on rho as written: in floats 0.07 * 100 is 7.000000000000001, up to 8 tokens
    return min(n, max(1, math.ceil(Fraction(str(float(rho))) * n)))

def keep_in_groups(vals: torch.Tensor, groups: torch.Tensor, rho: float) -> torch.Tensor:
    """The authors' per-group selection, vectorised: each group's scores sorted ascending (stable: of equal
    scores the earlier comes first), group_keep's lowest dropped. vals, groups (n,) -> keep (n,) bool."""
    order = torch.sort(vals, stable=True).indices  # by score
    order = order[torch.sort(groups[order], stable=True).indices]  # then by group: lowest first
    _, counts = torch.unique_consecutive(groups[order], return_counts=True)  # (B,)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(len(order), device=vals.device) - starts.repeat_interleave(counts)  # 0: a group's lowest
    keep = torch.zeros_like(vals, dtype=torch.bool)
    keep[order] = rank >= (counts - group_keep(counts, rho)).repeat_interleave(counts)
    return keep

def select_tokens(scores: torch.Tensor, mask: torch.Tensor, rho: float, nonzero: bool = False,
                  group_size: int = 0, groups: torch.Tensor = None) -> torch.Tensor:
    """The top valid tokens by score: (N, T) -> (N, T) bool; masked-out tokens are never kept, NaN ranks lowest.
    group_size 0 (and no groups): the keep_budget highest over the WHOLE batch, ties to the earlier position (any
    rho in (0, 1] keeps at least one). group_size G: within each run of G consecutive rows (keep_groups' layout) by
    the authors' rule, keep_in_groups (ties: the later kept); groups (N, T): within each label instead. nonzero
    (gmts, gradnorm) then drops kept tokens whose score is 0 (deviation 9), so they may keep fewer."""
    flat_mask = mask.reshape(-1)  # (N*T,)
    sel = torch.zeros_like(flat_mask)
    if not flat_mask.any():
        return sel.view_as(mask)
    vals = scores.reshape(-1)[flat_mask].float()  # (n,), in position order
    vals = torch.nan_to_num(vals, nan=-math.inf)
    if group_size and groups is None:
        if mask.shape[0] % group_size:
            raise ValueError(f"{mask.shape[0]} answers are not groups of {group_size}")
        groups = (torch.arange(mask.shape[0], device=mask.device) // group_size)[:, None].expand(mask.shape)
    if groups is not None:
        keep = keep_in_groups(vals, groups.reshape(-1)[flat_mask], rho)
    else:
        # Highest first; the stable sort keeps equal scores in order: ties to the earlier token.
        order = torch.sort(vals, descending=True, stable=True).indices  # (n,)
        keep = torch.zeros_like(vals, dtype=torch.bool)
        keep[order[:keep_budget(mask, rho)]] = True
    if nonzero:
        keep &= vals > 0
    sel[flat_mask] = keep
    return sel.view_as(mask)

# ==== Loss and update [paper: GRPO / DAPO objective restricted to the kept tokens] ================
def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple:
    """Per-token PPO-clip loss l = -min(r * A, clip(r, 1 - eps_l, 1 + eps_h) * A), r = exp(logp - old_logp): (M,) inputs
    -> (loss (M,), clip active (M,) bool). On-policy r == 1 (REINFORCE) when old_logp is logp.detach(); train's old_logp
    takes token_stats' code path, not head_logp's, so on a first inner update r is 1 only up to rounding (~1e-6)."""
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    return loss, clip_active(adv, ratio.detach(), clip_low, clip_high)

def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman, "Approximating KL divergence"):
    exp(d) - d - 1, d = ref - logp: >= 0, 0 where the two agree, E_{y ~ pi_theta}[k3] = KL. (M,)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1

def micro_batch_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, kept: torch.Tensor,
                     ref_logp: torch.Tensor, w: torch.Tensor, *, denom: float, kl_denom: float, clip_low: float,
                     clip_high: float, kl_beta: float) -> tuple:
    """The objective L (derivation) on one micro-batch's M needed tokens, every input (M,):
        sum_{kept} w_t l_t / denom  +  kl_beta * sum_{all M} w_t k3_t / kl_denom
    -> (loss, counts): counts["clipped"] the kept tokens with an active clip, counts["live"] the tokens with a gradient
    (kept with A != 0 and an inactive clip; with KL also where 1 - exp(ref - logp) != 0), counts["kl"] the sum of k3."""
    pg, clip_m = grpo_token_loss(logp, old_logp, adv, clip_low, clip_high)  # (M,)
    loss = (pg * kept * w).sum() / denom
    counts = dict(clipped=int((clip_m & kept).sum()), live=int((kept & ~clip_m & (adv != 0)).sum()), kl=0.0)
    if kl_beta > 0:
        kl = k3_kl(logp, ref_logp)  # (M,)
        loss = loss + kl_beta * (kl * w).sum() / kl_denom  # its normaliser ignores the selection
        counts["kl"] = float(kl.detach().sum())
        counts["live"] += int((torch.exp(ref_logp - logp.detach()) != 1).sum())
    return loss, counts

def loss_backward(model, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor, old_logp: torch.Tensor, denom: float,
                  *, temperature: float, clip_low: float, clip_high: float, micro_batch: int, chunk: int,
                  kl_beta: float = 0.0, ref_logp: torch.Tensor = None, valid: torch.Tensor = None,
                  w: torch.Tensor = None, kl_denom: float = None) -> dict:
    """Accumulate into .grad micro_batch_loss's gradient, a micro-batch of answers at a time; denom,
    w (N, T), kl_denom: loss_weights' (defaults w = 1, kl_denom = the valid tokens). Masks, (N, T):
      valid     the loss's tokens, KL's too (default resp_mask; --overlong-filter: none truncated)
      sel_mask  the kept tokens, the policy term's
      need      the tokens whose log-prob is computed: the kept ones, with KL every valid one
    Only `need` enters the lm_head (the others' gradient is 0: leaving them out is exact) -> loss,
    clip_frac (of the kept), kl (per valid token), live (tokens with a gradient: deviation 6)."""
    head = model.get_output_embeddings()
    if valid is None:
        valid = batch["resp_mask"]
    need = sel_mask
    if kl_beta > 0:
        need = sel_mask | valid
    n_valid = max(int(valid.sum()), 1)
    if w is None:
        w = torch.ones(valid.shape, device=valid.device)
    if kl_denom is None:
        kl_denom = n_valid
    totals = dict(loss=0.0, clipped=0, live=0, kl=0.0)
    active = need.any(dim=1).nonzero().squeeze(1)  # answers that enter the forward
    for rows in active.split(micro_batch):
        if rows.numel() == 0:  # nothing kept: split() still yields one empty piece
            break
        m = need[rows]  # (n, T)
        h = response_hidden(model, batch, rows)[m]  # (M, d)
        logp = head_logp(h, head, batch["comp_ids"][rows][m], temperature, chunk)  # (M,)
        ref = None
        if kl_beta > 0:
            ref = ref_logp[rows][m]  # (M,)
        a = adv[rows][:, None].expand_as(m)[m]  # (M,)
        loss, counts = micro_batch_loss(logp, old_logp[rows][m], a, sel_mask[rows][m], ref, w[rows][m], denom=denom,
                                        kl_denom=kl_denom, clip_low=clip_low, clip_high=clip_high, kl_beta=kl_beta)
        loss.backward()
        totals["loss"] += float(loss.detach())
        for key, value in counts.items():
            totals[key] += value
    n_sel = max(int(sel_mask.sum()), 1)
    return dict(loss=totals["loss"], clip_frac=totals["clipped"] / n_sel, kl=totals["kl"] / n_valid,
                live=totals["live"])

def policy_update(model, opt, batch: dict, adv: torch.Tensor, sel_mask: torch.Tensor, old_logp: torch.Tensor,
                  denom: float, *, temperature: float, clip_low: float, clip_high: float, micro_batch: int, chunk: int,
                  max_grad_norm: float, kl_beta: float = 0.0, ref_logp: torch.Tensor = None, valid: torch.Tensor = None,
                  w: torch.Tensor = None, kl_denom: float = None) -> dict:
    """One optimiser step on the kept tokens (the arguments as loss_backward's) by deviation 6's step rule, so A = 0
    everywhere, with the policy at its reference, moves neither the weights nor the Adam moments."""
    opt.zero_grad(set_to_none=True)
    stats = loss_backward(model, batch, adv, sel_mask, old_logp, denom, temperature=temperature,
                          clip_low=clip_low, clip_high=clip_high, micro_batch=micro_batch, chunk=chunk,
                          kl_beta=kl_beta, ref_logp=ref_logp, valid=valid, w=w, kl_denom=kl_denom)
    norm = 0.0
    if stats["live"]:
        params = [p for p in model.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    finite = math.isfinite(norm) and math.isfinite(stats["loss"])
    stats["grad_norm"] = norm
    stats["skipped"] = int(not finite)
    stats["stepped"] = int(stats["live"] > 0 and finite)
    if stats["stepped"]:
        opt.step()
    opt.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights or the Adam moments
    return stats

# ==== Training loop [paper: the algorithm box; the numbered comments are the docstring's steps] ====
def lr_factor(i: int, total: int, warmup: int, decay: bool = True) -> float:
    """lr multiplier at update slot i (0-based) of `total` (one per inner update, stepped or not):
    min(1, (i + 1) / warmup, (total - i) / (total - warmup)), a linear warm-up over `warmup` slots,
    then a linear decay to 1 / (total - warmup) at the last (decay=False: none; TRL's is linear too)."""
    up = (i + 1) / max(warmup, 1)
    if not decay:
        return min(1.0, up)
    down = max(total - i, 1) / max(total - warmup, 1)
    return min(1.0, up, down)

def step_lr(cfg: Config, step: int, inner: int) -> float:
    """The lr of inner update `inner` of GRPO step `step` (1-based): slot (step - 1) * mu + inner."""
    slot = (step - 1) * cfg.inner_updates + inner
    return cfg.lr * lr_factor(slot, cfg.steps * cfg.inner_updates, cfg.warmup_steps, cfg.lr_decay)

@dataclass
class Run:
    """What start_run prepares for the loop."""
    model: torch.nn.Module  # the policy, fp32 master weights
    tok: object  # its tokenizer
    opt: torch.optim.Optimizer
    task: dict  # TASKS[cfg.task] and the prompt style ("style")
    draw: object  # draw(n, *key) -> n training rows (read_data)
    eval_rows: object  # the held-out rows, or --eval-data's {name: rows} (read_data)
    chat: bool  # prompts in the chat template
    ref: object  # the KL reference model, or None (--kl-beta 0)
    sampler: object  # the weights generate() reads: the model itself or its bf16 copy
    fast: bool  # generate with a static KV cache (compiled on CUDA); off after a failure
    start: int  # the first step to run (1 for a new run)
    skipped: int  # updates skipped so far for a non-finite loss or gradient
    report: object = None  # sends a metrics record to --report-to's tracker (record_start opens it)

def start_run(cfg: Config, log=print) -> Run:
    """The policy, its optimiser, the KL reference (deviation 7) and the sampler (--sampler-dtype: the
    model itself or a bf16 copy). The run folder's side, in the supporting code: open_run (the folder,
    the data, the model or a resume's checkpoint), record_start (the config, step 0, ckpt-000000)."""
    device = pick_device(cfg.device)
    if cfg.threads > 0:  # before any work
        torch.set_num_threads(cfg.threads)
    model, tok, state, data = open_run(cfg, device, log)
    ref = None
    if cfg.kl_beta > 0:  # pi_ref: the model --model loads, where RL starts
        ref = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)[0]
        ref = ref.eval().requires_grad_(False)
    if cfg.grad_ckpt:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if "opt" in state:  # a resume
        opt.load_state_dict(state["opt"])
    fast = cfg.fast_generate
    if fast is None:
        fast = device.type == "cuda"
    task = dict(get_task(cfg.task), style=cfg.prompt_style)  # build_prompts reads "style" there
    run = Run(model=model, tok=tok, opt=opt, task=task, draw=data.draw, eval_rows=data.held,
              chat=use_chat(tok, cfg.chat_template), ref=ref, sampler=model, fast=fast,
              start=state["step"] + 1, skipped=state["skipped"])
    record_start(cfg, run, data, state["resumed"], device, log)
    if cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda"):
        run.sampler = copy.deepcopy(model).eval().requires_grad_(False)  # generate's bf16 copy
        for p in run.sampler.parameters():  # RoPE's inv_freq buffer stays fp32, as in a bf16 load
            p.data = p.data.to(torch.bfloat16)
    return run

def sample_groups(run: Run, cfg: Config, step: int, log=print) -> tuple:
    """Steps 1-4 of GRPO step `step` -> (batch, rewards (N,), adv (N,), parts), B prompts x G answers:
    with --filter-groups (deviation 5) more batches until B groups are informative or --max-resample
    are drawn, joined by keep_groups; parts: each batch drawn, (batch, rewards, adv), for metrics."""
    B, G = cfg.prompts_per_step, cfg.group_size
    max_batches = 1
    if cfg.filter_groups:
        max_batches = cfg.max_resample
    parts = []
    n_informative = 0
    while len(parts) < max_batches and n_informative < B:
        # 1. B training prompts (the k-th rollout batch of a step draws with the key (step, k))
        rows = run.draw(B, step, len(parts))
        prompts = build_prompts(run.tok, run.task, rows, run.chat, cfg.short_prompt)
        # 2. G answers per prompt, with the sampler's own log-probs (answer n answers prompt n // G)
        batch = sample_answers(run, prompts, cfg, log)
        # 3. one reward per answer from the task's verifier (the Rewards section)
        rewards = torch.zeros(len(batch["texts"]))  # (N,)
        for n, text in enumerate(batch["texts"]):
            rewards[n] = run.task["reward"](text, rows[n // G])
        # 4. group advantages
        adv = group_advantages(rewards, G, cfg.std_normalize).to(batch["comp_ids"].device)  # (N,)
        parts.append((batch, rewards, adv))
        n_informative += int(informative(rewards, G).sum())
    if not cfg.filter_groups:
        return batch, rewards, adv, parts
    return (*keep_groups(parts, G, B, run.tok.pad_token_id), parts)

def selection_rule(cfg: Config) -> tuple:
    """(rho, group_size) of step 6: 'all' keeps every token (rho 1 over the batch); --scope group (auto: for
    gmts, as its authors) ranks within each prompt's G answers, batch (auto: the others) over the whole batch (0)."""
    if cfg.select == "all":
        return 1.0, 0
    per_group = cfg.scope == "group" or (cfg.scope == "auto" and cfg.select == "gmts")
    return cfg.rho, cfg.group_size if per_group else 0

def step_selection(cfg: Config, logp, entropy, grad_norm, om, mask, score_fn=None) -> torch.Tensor:
    """Step 6 as train() runs it, all (N, T): select_tokens by token_scores(cfg.select), selection_rule's rho and
    scope, nonzero for gmts and gradnorm (deviation 9); a given score_fn(logp, entropy, grad_norm, om) replaces it."""
    rho, group_size = selection_rule(cfg)
    if score_fn is not None:
        return select_tokens(score_fn(logp, entropy, grad_norm, om), mask, rho, group_size=group_size)
    scores = token_scores(cfg.select, entropy, grad_norm, om)
    return select_tokens(scores, mask, rho, nonzero=cfg.select in ("gmts", "gradnorm"), group_size=group_size)

def train(cfg: Config, log=print, score_fn=None) -> str:
    """GRPO with token selection (the docstring's steps 1-8) -> the output folder. score_fn, if
    given, replaces token_scores (step_selection): the notebook trains its own score through it."""
    check_tracker(cfg.report_to)  # a missing tracker package: one line, before any work
    cfg = resolved_paths(cfg)  # absolute paths in run_config.json: any folder's resume finds them
    run = start_run(cfg, log)  # model, optimiser, KL reference, sampler; --resume: its checkpoint
    model, opt = run.model, run.opt
    mb, chunk = cfg.micro_batch, cfg.stats_chunk  # answers per forward, tokens per head call
    report = run.report  # --report-to: tensorboard, wandb or nothing
    show = step_printer(cfg.steps, run.start, log)  # a progress bar on a terminal
    model.train()
    for step in range(run.start, cfg.steps + 1):
        t0 = time.time()
        set_seed(cfg.seed * 1_000_003 + step)  # a step's randomness depends on (seed, step) only
        # 1-4. B prompts, G answers each, their rewards and group advantages (sample_groups)
        batch, rewards, adv, parts = sample_groups(run, cfg, step, log)
        mask = batch["resp_mask"]  # (N, T)
        valid = mask  # the tokens the loss may use
        if cfg.overlong_filter:  # DAPO's overlong filtering: a truncated answer trains nothing
            valid = mask & ~batch["truncated"][:, None]
        t_roll = time.time() - t0
        # 5. statistics of pi_old, the fp32 policy before this update (--sampler-dtype bf16, CUDA's default: a bf16
        # copy of it sampled): log pi(y_t), H_t and grad_norm, each (N, T); the KL reference's log-probs (loss's path)
        logp, entropy, grad_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
        old_logp = logp
        ref_logp = None
        if run.ref is not None:
            ref_logp = response_logp(run.ref, batch, valid, cfg.temperature, mb, chunk)
        rho, group_size = selection_rule(cfg)
        norm = loss_weights(cfg.loss_norm, valid, keep_budget(valid, rho, group_size))  # w, D, D_kl
        for inner in range(cfg.inner_updates):
            if inner > 0:  # the policy has moved: its statistics again
                logp, entropy, grad_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
            # 6. omega (-dL/dlogp of step 7's loss: derivation step 1), scores, the top rho of each
            # prompt's group (--scope group: GMTS's authors) or of the whole batch (deviation 1)
            ref_ratio = None  # pi_ref / pi_theta, for the KL term's weight in omega
            if run.ref is not None:
                ref_ratio = torch.exp(ref_logp - logp)
            om = omega(adv, torch.exp(logp - old_logp), cfg.clip_low, cfg.clip_high, cfg.kl_beta, ref_ratio,
                       **norm)  # (N, T)
            sel_mask = step_selection(cfg, logp, entropy, grad_norm, om, valid, score_fn)  # (N, T) bool
            # 7. PPO-clip update on the kept tokens; one lr schedule and one step rule for all
            for group in opt.param_groups:
                group["lr"] = step_lr(cfg, step, inner)
            stats = policy_update(model, opt, batch, adv, sel_mask, old_logp, temperature=cfg.temperature,
                                  clip_low=cfg.clip_low, clip_high=cfg.clip_high, micro_batch=mb, chunk=chunk,
                                  max_grad_norm=cfg.max_grad_norm, kl_beta=cfg.kl_beta, ref_logp=ref_logp,
                                  valid=valid, **norm)
            run.skipped += stats["skipped"]
        refresh_sampler(run.sampler, model)
        check_weights(model, batch, step, cfg.out)  # non-finite weights: stop before a checkpoint
        # 8. log, evaluate, checkpoint
        rec = step_record(step, cfg, parts, batch, valid, rewards, adv, old_logp, entropy, sel_mask, stats, opt,
                          run.skipped, t0, t_roll)
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps:
            rec.update(evaluate_run(model, run, cfg))
        log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
        report(rec)
        show(step_line(rec), "eval_acc" in rec)
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.steps:
            save_checkpoint(cfg.out, step, model, run.tok, opt, run.skipped)
    show(None, False)
    report(None)
    plot_metrics(cfg.out)
    save_final(cfg.out, model, run.tok)  # last: its config.json marks the run finished
    log(f"done: {cfg.out} (metrics.jsonl, metrics.png, the model)")
    return cfg.out

# Supporting code [plumbing]: what lets the method above run; a reader of the paper may stop here. ###################

# ==== Problem generators and data loaders [plumbing] ==============================================
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}  # literals have precedence 3

def _combine(x: tuple, y: tuple, op: str):
    """(value, text, precedence) of `x op y`, parenthesised just enough to read back the same; None for x / 0."""
    value = _OPS[op](x[0], y[0])
    if value is None:
        return None
    p = _PREC[op]
    left = f"({x[1]})" if x[2] < p else x[1]
    right_needs = y[2] < p or (y[2] == p and op in "-/")  # a - (b + c), a / (b * c)
    right = f"({y[1]})" if right_needs else y[1]
    return value, f"{left} {op} {right}", p

def _sign_chain(nums: list, signs) -> tuple:
    """(value, text) of nums[0] s1 nums[1] s2 ..., each s in '+-', left to right: ([4, 3, 2], '+-')
    -> (5, '4 + 3 - 2'). The easy variant's solutions and the lab's warm-up answers are such chains."""
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
        items = [it for k, it in enumerate(items) if k not in (i, j)]
        items.append(z)
    return items[0]

def countdown_problem(rng: random.Random, n_nums=(3, 4), num_range=(1, 99),
                      target_range=(1, 1000), ops="+-*/"):
    """Random numbers and a random expression over them, whose value is the target: always solvable."""
    for _ in range(100_000):
        nums = [rng.randint(*num_range) for _ in range(rng.randint(*n_nums))]
        z = _random_expression(rng, nums, ops)
        if z is not None and target_range[0] <= z[0] <= target_range[1]:
            return {"nums": nums, "target": int(z[0]), "expr": z[1]}
    raise ValueError(f"no countdown problem with numbers in {num_range} and a target in {target_range}")

# -- math: GSM8K-style word problems, graded by the final number --
# A template: the question and its worked steps "x op y" over the numbers a, b, c, d (each drawn
# from 2..12), integer literals and the earlier steps' results s1, s2, ...
_MATH = [
    ("{who} buys {a} pens at ${b} each and pays with $150. How many dollars of change are due?", "a*b 150-s1"),
    ("{who} buys {a} pens at ${b} each and {c} books at ${d} each, and pays with $300. How many "
     "dollars of change are due?", "a*b c*d s1+s2 300-s3"),
    ("{who} bakes {a} trays of {b} cookies, eats {c} of them and shares the rest equally among "
     "{d} friends. How many cookies does each friend get?", "a*b s1-c s2/d"),
    ("{who}'s machine makes {a} toys an hour for {b} hours a day. How many toys does it make in {c} days?", "a*b s1*c"),
    ("{who}'s machine makes {a} toys an hour for {b} hours a day, and {d} toys a day come out "
     "broken. How many good toys does it make in {c} days?", "a*b s1-d s2*c"),
    ("{who} saves ${a} a week for {b} weeks, then buys a game for ${c}. How many dollars are left?", "a*b s1-c"),
    ("{who} saves ${a} a week for {b} weeks, then buys a game for ${c} and a book for ${d}. How "
     "many dollars are left?", "a*b c+d s1-s2"),
    ("{who} cycles {a} hours at {b} km/h, then walks {c} hours at {d} km/h. How many km is that "
     "in total?", "a*b c*d s1+s2"),
    ("{who} fills {a} bags with {b} marbles and {c} bags with {d} marbles, then gives half of all "
     "the marbles away. How many marbles are left?", "a*b c*d s1+s2 s3/2"),
]

def _run_program(program: str, values: dict):
    """Worked steps 'x op y = z' of a template's program over `values` (which gains s1, s2, ...),
    or None if a step leaves the natural numbers (a negative or a fraction)."""
    steps = []
    for i, step in enumerate(program.split(), 1):
        x, op, y = re.split(r"([-+*/])", step)
        x = values[x] if x in values else int(x)
        y = values[y] if y in values else int(y)
        z = _OPS[op](Fraction(x), y)
        if z < 0 or z.denominator != 1:
            return None
        values[f"s{i}"] = int(z)
        steps.append(f"{x} {op} {y} = {int(z)}")
    return steps

def math_problem(rng: random.Random, n_steps=(2, 4)) -> dict:
    """A problem from a template with n_steps steps: question, worked steps 'x op y = z' and the
    integer answer. A draw whose steps leave the natural numbers is redrawn."""
    fits = [t for t in _MATH if n_steps[0] <= len(t[1].split()) <= n_steps[1]]
    if not fits:
        raise ValueError(f"no math template has {n_steps} steps")
    while True:
        question, program = rng.choice(fits)
        values = {k: rng.randint(2, 12) for k in "abcd"}
        steps = _run_program(program, values)
        if steps is not None:
            answer = str(values[f"s{len(steps)}"])
            text = question.format(who=rng.choice(NAMES), **values)
            return {"question": text, "answer": answer, "steps": steps}

# The easy variant: one step whose operation only the words tell (the numbers in the step's order).
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
        worlds = []
        for w in itertools.product([True, False], repeat=n):
            if all(_holds(c, w) == w[i] for i, c in enumerate(claims)):
                worlds.append(w)
        if len(worlds) == 1:  # exactly one consistent assignment
            statements = []
            for i, claim in enumerate(claims):
                said = _say(claim, names, i)
                statements.append(f'{names[i]} says: "{said[0].upper() + said[1:]}."')
            return {"names": names, "statements": statements, "solution": dict(zip(names, worlds[0]))}
    raise ValueError(f"no knights-and-knaves puzzle with a unique solution for {n_people} people")

def _easy_countdown(rng: random.Random) -> dict:
    """The CPU demo's variant: 3 numbers in 1..9 in order, joined by + or -, the four sign patterns
    equally likely (numbers redrawn until the target is >= 0): a fixed sign guess is right about 1 time in 4."""
    signs = rng.choice(["++", "+-", "-+", "--"])
    while True:
        nums = [rng.randint(1, 9) for _ in range(3)]
        target, expr = _sign_chain(nums, signs)
        if target >= 0:
            return {"nums": nums, "target": target, "expr": expr}

_GEN = {  # "easy": the smallest variant (countdown: _easy_countdown; math: 1 step; logic: 2 people)
    "countdown": lambda r, easy: _easy_countdown(r) if easy else countdown_problem(r),
    "math": lambda r, easy: math_easy_problem(r) if easy else math_problem(r, (2, 4)),
    "logic": lambda r, easy: logic_problem(r, (2, 2) if easy else (2, 6)),
}

# ==== math-verify in a worker [plumbing]: bounded in time without signal.alarm, from any thread ==
# How a fault travels: a verdict is True / False, or None when none came back (the worker timed
# out, died or stalled, or the wait was interrupted). None is retried once on a fresh worker, then
# counted (_VERIFIER["unknown"]) and graded 0.0 by math_reward. step_record and evaluate_run log the
# count (grade_unknown, eval_grade_unknown) and stop the run past GRADE_UNKNOWN_MAX of its answers.
# A gold with no verdict at load, or a worker that does not start, is a RunError (exit 1), never
# the bad-row message: no model output can cause either.
VERIFY_TIMEOUT_S = 5.0
VERIFY_START_S = 120.0  # for the worker's imports (sympy) on a loaded machine
VERIFY_WORKERS = max(1, min(4, os.cpu_count() or 1))  # evaluation grades this many at a time
VERDICTS_KEPT = 1 << 16  # (gold, got) -> verdict pairs remembered, then forgotten all at once
GRADE_UNKNOWN_MAX = 0.02  # the share of a step's (evaluation's) answers that may lack a verdict
_VERIFY_WORKER = r"""
import ctypes, json, sys
try:  # Linux: die with the parent, even mid-hang (prctl PR_SET_PDEATHSIG = 1, SIGKILL = 9)
    ctypes.CDLL(None).prctl(1, 9)
except (AttributeError, OSError):
    pass
try:
    from math_verify import parse, verify
except Exception as e:
    print("cannot import math_verify (%s: %s); pip install -r requirements.txt"
          % (type(e).__name__, " ".join(str(e).split())[:200]), flush=True)
    sys.exit(1)
print("ready", flush=True)
for line in sys.stdin:
    gold, got = json.loads(line)
    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)  # no alarm: latex_equal bounds the time
    ok = any(not isinstance(x, str) for x in g)  # sympy read it, not only the string fallback
    if got is not None:
        ok = verify(g, parse("\\boxed{" + got + "}", parsing_timeout=None), timeout_seconds=None)
    print(json.dumps(ok), flush=True)
"""

def _verifier_pool(n: int) -> dict:
    """n worker slots ({"proc": a process or None}), the free ones in a LIFO queue (serial grading
    reuses one warm worker); the verdicts given (a pure function of gold and got: avg@16's right
    answers repeat), the count of verdicts that did not come back, the last one's cause, and
    "logged": the count at the last metrics record."""
    slots = [{"proc": None} for _ in range(n)]
    free = queue.LifoQueue()
    for slot in slots:
        free.put(slot)
    return {"free": free, "slots": slots, "verdicts": {}, "unknown": 0, "logged": 0, "cause": "",
            "lock": threading.Lock()}

_VERIFIER = _verifier_pool(VERIFY_WORKERS)

def _kill(proc):
    proc.kill()
    proc.wait()

def _start_verifier() -> subprocess.Popen:
    """A worker that said "ready": its own small python (no torch, no CUDA fork); -P: it never
    imports from the working folder (a user's json.py). Any failure: RunError, "did not start"."""
    safe = ["-P"] if sys.version_info >= (3, 11) else ["-I"]  # -I also drops user site-packages
    try:
        proc = subprocess.Popen([sys.executable, *safe, "-c", _VERIFY_WORKER], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        raise RunError(f"the math-verify worker did not start: {error_line(e, 200)}") from None
    said = None  # None: no word in time; "": it ended
    with contextlib.suppress(OSError, ValueError):
        if select.select([proc.stdout], [], [], VERIFY_START_S)[0]:
            said = proc.stdout.readline().strip()
    if said == "ready":
        return proc
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5 if said == "" else 0)
    _kill(proc)
    why = said or f"it exited with code {proc.returncode} before it was ready"
    if said is None:
        why = f"no word from it in {VERIFY_START_S:g} s"
    raise RunError(f"the math-verify worker did not start: {why[:300]}")

def _ask(proc, gold: str, got, timeout: float):
    """The worker's verdict, or the cause (a str) when none came back: then the worker is killed,
    so that no answer to this request can be read by the next one; Ctrl-C in the wait kills it."""
    said = ""
    try:
        proc.stdin.write(json.dumps([gold, got]) + "\n")
        proc.stdin.flush()
        if select.select([proc.stdout], [], [], timeout)[0]:
            said = proc.stdout.readline()
    except OSError:  # a broken pipe: it died
        said = ""
    except BaseException:
        _kill(proc)
        raise
    if said in ("true\n", "false\n"):
        return said == "true\n"
    alive = proc.poll() is None
    _kill(proc)
    if alive:
        return f"no verdict in {timeout:g} s (stalled or too slow)"
    return f"the worker died (exit {proc.returncode})"

def latex_equal(gold: str, got=None, timeout: float = None):
    """math-verify's verdict on two short answers as \\boxed{} contents, by one of VERIFY_WORKERS
    workers: True, False, or None when none came back twice (a fresh worker the second time; counted
    in _VERIFIER). got None: whether sympy reads gold (at load); no verdict: RunError. sympy hangs
    (\\boxed{9^{9^{9^{9}}}}): after timeout (VERIFY_TIMEOUT_S) seconds the worker is killed."""
    verdicts = _VERIFIER["verdicts"]
    if (gold, got) in verdicts:
        return verdicts[gold, got]
    slot = _VERIFIER["free"].get()  # blocks while every worker grades
    try:
        for _ in range(2):
            if slot["proc"] is None or slot["proc"].poll() is not None:
                slot["proc"] = None
                slot["proc"] = _start_verifier()
            said = _ask(slot["proc"], gold, got, timeout or VERIFY_TIMEOUT_S)
            if not isinstance(said, str):
                if len(verdicts) >= VERDICTS_KEPT:
                    verdicts.clear()
                verdicts[gold, got] = said
                return said
            slot["proc"] = None
    except BaseException:
        if slot["proc"] is not None and slot["proc"].poll() is not None:
            slot["proc"] = None
        raise
    finally:
        _VERIFIER["free"].put(slot)
    with _VERIFIER["lock"]:
        _VERIFIER["cause"] = said
        if got is not None:
            _VERIFIER["unknown"] += 1
    if got is None:
        raise RunError(f"the math-verify worker gave no verdict on the gold {gold[:60]!r}, "
                       f"twice (a fresh worker the second time): {said}")
    return None

def stop_verifiers():
    """Kill every idle worker (the next grade starts a fresh one)."""
    for slot in _VERIFIER["slots"]:
        if slot["proc"] is not None:
            _kill(slot["proc"])
            slot["proc"] = None

def unknown_since_logged() -> int:
    """The verdicts that did not come back since the last call (each metrics record takes its
    own)."""
    with _VERIFIER["lock"]:
        n = _VERIFIER["unknown"] - _VERIFIER["logged"]
        _VERIFIER["logged"] = _VERIFIER["unknown"]
    return n

def check_grades(key: str, graded: int, what: str, cfg) -> dict:
    """{key: the verdicts that did not come back since the last record} for a run whose answers
    math-verify may grade (task math, not only generated data), {} else. Past GRADE_UNKNOWN_MAX of
    the `graded` answers: RunError (one line, exit 1, the run's last checkpoint kept)."""
    unknown = unknown_since_logged()
    if unknown > GRADE_UNKNOWN_MAX * graded:
        raise RunError(f"{what}: {unknown} of {graded} answers got no verdict from the math-verify "
                       f"worker (the last: {_VERIFIER['cause']}), over {GRADE_UNKNOWN_MAX:.0%}; "
                       f"stopped, {interrupted_state(cfg.out)}")
    if cfg.task != "math" or (data_kind(cfg.data) == "gen" and not cfg.eval_data):
        return {}
    return {key: unknown}

# -- loaders: --data gen | easy | hf | hf:test | hf:ID[:CONFIG][:SPLIT] | a data file --
def data_kind(data: str) -> str:  # gen (gen, easy), hf (a hub set, a local dataset folder) or file
    if data in ("gen", "easy"):
        return "gen"
    return "hf" if data.split(":")[0] == "hf" else "file"

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
             "answer": ("a number, a GSM8K solution ending in '#### N' or a LaTeX answer math-verify reads",
                        lambda v: type(v) in (str, int, float))},
    "logic": {"names": ("a list of strings", _list_of(str)), "statements": ("a list of strings", _list_of(str)),
              "solution": ("an object {name: true/false}", lambda v: isinstance(v, dict)
                           and all(type(x) is bool for x in v.values()))},
}

# The published math layouts' (question, answer) columns, a.b: b in a (a list: its first item; a chat: its last turn)
LAYOUTS = {"MATH, MATH-500, Minerva": ("problem", "answer"), "AIME 2024 CSV": ("Question", "Answer"),
           "OlympiadBench": ("question", "final_answer"), "DAPO-Math-17k": ("prompt", "reward_model.ground_truth")}
LINE_CAP = 1 << 20  # bytes per line of a --data file

def _row_problem(task: str, row: dict):
    """Why a row with the schema's keys can never earn 1.0 from its verifier, or None."""
    if task == "countdown" and (not row["nums"] or min(row["nums"]) < 0):
        return '"nums" must be non-empty and >= 0 (an answer cannot write a negative number)'
    if task == "countdown" and sum(len(str(n)) + 1 for n in row["nums"]) > 201:
        return '"nums" are too long for an answer the verifier reads (200 characters)'
    if task == "math" and not row["question"].strip():
        return '"question" is empty'
    if task != "logic":
        return None
    lower = []
    for name in row["names"]:
        if not re.fullmatch("[A-Za-z]+", name):
            return f"name {name!r} is not ASCII letters only (the verifier reads [a-z]+)"
        lower.append(name.lower())
    if len(set(lower)) < len(lower):
        return '"names" repeat a name (the verifier ignores case)'
    if not lower or set(lower) != {k.lower() for k in row["solution"]}:
        return '"solution" must name exactly the people in "names"'
    return None

def _math_layout(row: dict, columns: str = "") -> dict:
    """A math row in --data-columns' layout or a published one (LAYOUTS) as a competition row; ours as it is."""
    layouts = list(LAYOUTS.values())
    if columns:
        layouts.insert(0, tuple(columns.split(",")))
    for q, a in layouts:
        question, answer = row.get(q), row
        for key in a.split("."):
            answer = answer.get(key) if isinstance(answer, dict) else None
        if isinstance(question, list) and question and isinstance(question[-1], dict):
            question = question[-1].get("content")
        if isinstance(answer, list) and answer:
            answer = answer[0]
        if question is not None and answer is not None:
            return {"question": question, "answer": answer, "latex": True}
    return row

def _check_row(row, task: str, columns: str = "") -> dict:
    """A row as read -> the row the task trains on (math: GSM8K's, or "latex" with a gold math-verify reads). Any
    problem raises (ValueError, RecursionError, ...): the reader's net names the file and line, or set and row."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if task == "math":
        row = _math_layout(row, columns)
    for key, (what, ok) in _SCHEMA[task].items():
        if key not in row or not ok(row[key]):
            raise ValueError(f'"{key}" must be {what}' if key in row else f'missing key "{key}"')
    json.dumps(row, ensure_ascii=False).encode("utf-8")  # a lone surrogate: no tokenizer reads it
    problem = _row_problem(task, row)
    if problem:
        raise ValueError(problem)
    if task != "math":
        return row
    gsm8k = _gsm8k_row(row["question"], row["answer"])
    if not row.get("latex") and parse_number(gsm8k["answer"]) is not None:
        return gsm8k
    gold = str(row["answer"]).strip()  # Minerva's end in a newline
    if parse_number(gold) is None and not latex_equal(gold):
        raise ValueError(f'"answer" must be {_SCHEMA["math"]["answer"][0]}, got {gold[:60]!r}')
    return {"question": row["question"], "answer": gold, "latex": True}

_WHY = {RecursionError: "JSON nested too deep", UnicodeDecodeError: "cannot read it as UTF-8",  # error -> words
        UnicodeEncodeError: "holds a lone surrogate (no tokenizer reads it)", json.JSONDecodeError: "invalid JSON"}

def _read_jsonl(path: str, task: str, columns: str = "") -> tuple:
    """(rows, their line numbers, the size and sha256 of the bytes read) of a data file split on "\n"
    only (a raw U+2028 in a string is no break); any problem in a line: ValueError "PATH line N: ..."."""
    if not os.path.isfile(path):  # a folder, a FIFO, /dev/zero: only a regular file ends
        raise ValueError(f"{path}: cannot read (not a regular file); --data takes gen, easy, hf or a data file")
    rows = []
    lines = []
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            for i, raw in enumerate(iter(lambda: f.readline(LINE_CAP + 1), b""), 1):
                digest.update(raw)
                size += len(raw)
                try:  # one net per line
                    if len(raw) > LINE_CAP:
                        raise ValueError(f"longer than {LINE_CAP} bytes")
                    line = raw.decode("utf-8")
                    if line.strip():  # a blank line is no row
                        rows.append(_check_row(json.loads(line), task, columns))
                        lines.append(i)
                except (ValueError, RecursionError, TypeError) as e:
                    why = _WHY.get(type(e)) or error_line(e, 200)
                    raise ValueError(f"{path} line {i}: {why}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or error_line(e, 200)})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows, lines, {"size": size, "sha256": digest.hexdigest()}

def _read_set(data: str, task: str, columns: str = "") -> tuple:
    """(rows, names "DATA row N", the sha256 of the rows) of a hub set or local dataset folder (hf:ID[:CONFIG][:SPLIT])
    or a .json, .csv or .parquet file, read through `datasets`; every row checked."""
    try:
        import datasets
        logging.getLogger("datasets").setLevel(logging.CRITICAL)  # its failures are said in our one line
        if data_kind(data) == "hf":
            name, *rest = data.split(":")[1:]
            ds = datasets.load_dataset(name, *rest[:-1], split=(rest or ["train"])[-1])
        elif os.path.isfile(data):  # not a FIFO or /dev/zero, which would never end
            ds = datasets.load_dataset(os.path.splitext(data)[1][1:], data_files=data, split="train")  # its builders
        else:
            raise ValueError("not a regular file")
    except Exception as e:  # no network, no such set, split or file, a file datasets cannot parse
        if data_kind(data) == "file":
            raise ValueError(f"{data}: cannot read it ({error_line(e)})") from None
        raise ValueError(f"could not load {data} from the hub (no network?): {error_line(e)}; use --data gen") from None
    rows, where = [], []
    for i, row in enumerate(ds, 1):
        where.append(f"{data} row {i}")
        try:
            rows.append(_check_row(row, task, columns))
        except (ValueError, RecursionError, TypeError) as e:
            raise ValueError(f"{where[-1]}: {_WHY.get(type(e), error_line(e))}") from None
    if not rows:
        raise ValueError(f"{data}: no rows")
    return rows, where, {"sha256": hashlib.sha256(json.dumps(rows).encode()).hexdigest()}

def load_rows(task: str, data="gen", n=1000, seed=0, named=False, columns=""):
    """gen/easy: n fresh problems from random.Random(seed). hf, hf:test: the task's own hub set, shuffled by seed.
    hf:ID[:CONFIG][:SPLIT] (a hub set or local dataset folder), a file: its rows in order. For all but gen n <= 0 or
    None means all rows. named=True -> (rows, each one's name in messages, a file's fingerprint), or None each."""
    get_task(task)
    kind, spec = data_kind(data), data.split(":")[1:]
    where, data_print = None, None
    if kind == "gen":
        rng = random.Random(seed)
        rows = [_GEN[task](rng, data == "easy") for _ in range(n)]
    elif kind == "hf" and (not spec or "/" not in spec[0]):  # the task's own hub set (`own`)
        if task == "logic" or spec not in ([], ["train"], ["test"]):
            raise ValueError(f"--data {data}: logic has no hub data set, and the split must be hf:train or hf:test")
        split = (spec or ["train"])[0]
        own = {"countdown": "hf:Jiayi-Pan/Countdown-Tasks-3to4:train", "math": f"hf:openai/gsm8k:main:{split}"}
        rows = _read_set(own[task], task)[0]  # the held-out rows stand for all
        if task == "countdown":  # one split: its first 327,680 rows train, the next 1,024 test
            rows = rows[:327_680] if split == "train" else rows[327_680:328_704]
        random.Random(seed).shuffle(rows)
    elif kind == "hf" or os.path.splitext(data)[1] in (".json", ".csv", ".parquet"):
        rows, where, data_print = _read_set(data, task, columns)
    else:
        rows, lines, data_print = _read_jsonl(data, task, columns)
        where = [f"{data} line {i}" for i in lines]
    if n and n > 0:
        rows = rows[:n]
    return (rows, where, data_print) if named else rows

for _name, _task in TASKS.items():  # each task's loader: TASKS[name]["load"](data, n, seed)
    _task["load"] = functools.partial(load_rows, _name)

@dataclass
class Data:
    """What read_data read: the rows a run trains on and what the checks before step 0 need."""
    draw: object  # draw(n, *key) -> n training rows
    held: object  # the held-out rows, or --eval-data's {name: rows}
    rows: list  # checked before step 0: a file's or set's rows (else the held-out ones), benchmarks'
    where: list  # each one's name in messages: "FILE line N", "held-out row N"
    fingerprint: dict  # a data file's size and sha256, of the bytes read (else None): what a resume checks
    longest: int = 0  # the longest prompt of `rows`, in tokens (check_prompts)

def read_data(cfg: Config) -> Data:
    """The FIRST eval_size rows of the data are held out (none with --eval-data: its sets are evaluated instead).
    draw(n, *key) -> n training rows from random.Random(str((seed,) + key)), never a held-out or benchmark prompt."""
    task = get_task(cfg.task)
    gen = data_kind(cfg.data) == "gen"
    n_held = 0 if cfg.eval_data else cfg.eval_size
    rows, where, data_print = load_rows(cfg.task, cfg.data, n_held if gen else 0, cfg.seed, True, cfg.data_columns)
    held = rows[:n_held]
    checked = rows
    if where is None:  # generated or hub rows: the held-out ones stand for all
        checked = held
        where = [f"held-out row {i} of --data {cfg.data}" for i in range(len(held))]
    bench = {}
    for name, spec in eval_sets(cfg.eval_data):
        bench[name], named, _ = load_rows(cfg.task, spec, 0, cfg.seed, True, cfg.data_columns)
        checked = checked + bench[name]
        where = where + (named or [f"row {i} of --eval-data {name}" for i in range(len(bench[name]))])
    seen = {task["prompt"](r) for r in held + sum(bench.values(), [])}
    held = bench or held
    pool = [r for r in rows[n_held:] if task["prompt"](r) not in seen]
    if not gen and not pool:
        raise ValueError(f"--data {cfg.data}: no training rows left after the {len(held)} held-out and benchmark ones "
                         f"({len(rows)} rows, --eval-size {cfg.eval_size})")

    def draw(n: int, *key) -> list:
        rng = random.Random(str((cfg.seed,) + key))
        if not gen and n <= len(pool):  # distinct rows while the pool lasts
            return rng.sample(pool, n)
        if not gen:
            return [rng.choice(pool) for _ in range(n)]
        out = []
        for _ in range(1000 * n):  # fresh problems until n of them are not held-out prompts
            row = _GEN[cfg.task](rng, cfg.data == "easy")
            if task["prompt"](row) not in seen:
                out.append(row)
            if len(out) == n:
                return out
        raise ValueError(f"--data {cfg.data}: almost every generated problem is a held-out one; lower --eval-size")
    return Data(draw=draw, held=held, rows=checked, where=where, fingerprint=data_print)

def eval_sets(spec: str) -> list:
    """--eval-data 'NAME=DATA,...' -> [(NAME, DATA), ...]; ValueError for a malformed entry."""
    pairs = [part.partition("=")[::2] for part in spec.split(",") if part]
    if not all(re.fullmatch(r"[\w.-]+", name) and name not in ("acc", "len", "sample") and d for name, d in pairs):
        raise ValueError(f"--eval-data {spec}: entries NAME=DATA, NAME of letters, digits, _ . - but acc, len, sample")
    return pairs

def check_prompts(cfg: Config, model, tok, data: Data, chunk: int = 1024):
    """ValueError naming the first row whose prompt does not render or, with its answer, passes the model's positions:
    every row read, before step 0 (at step 1 it fails every resume again), `chunk` rows at a time (bounded memory)."""
    task = dict(get_task(cfg.task), style=cfg.prompt_style)  # as start_run's
    for i in range(0, len(data.rows), chunk):
        prompts = checked_prompts(tok, task, data.rows[i:i + chunk], use_chat(tok, cfg.chat_template), cfg.short_prompt)
        for where, ids in zip(data.where[i:i + chunk], tok(prompts, add_special_tokens=False)["input_ids"]):
            check_positions(model, len(ids), cfg.max_new_tokens, f"{where}: its")
            data.longest = max(data.longest, len(ids))

def checked_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False) -> list:
    """build_prompts, where a chat template that fails on them (a role it refuses, bad syntax) is one ValueError."""
    try:
        return build_prompts(tok, task, rows, chat, short)
    except Exception as e:
        if memory_fault(e):
            raise
        raise ValueError(f"the model's chat template fails on this run's prompts ({type(e).__name__}: "
                         f"{error_line(e, 200)}); try --short-prompt, or gmts.py's --chat-template no") from None

# ==== Model and tokenizer [plumbing]: Qwen checkpoints, or a tiny Qwen2 built offline =============
def pick_device(name: str = "auto") -> torch.device:
    if name == "auto" and torch.cuda.is_available():
        name = "cuda"
    if name == "auto" and torch.backends.mps.is_available():
        name = "mps"
    return torch.device("cpu" if name == "auto" else name)

def autocast(device: torch.device):
    """bf16 compute on CUDA (weights stay fp32, deviation 8); a no-op elsewhere."""
    use = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)

def set_seed(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)

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
        for logger in ("huggingface_hub", "transformers"):  # a warning per retry offline: 22 lines
            logging.getLogger(logger).setLevel(logging.ERROR)
        try:
            tok = AutoTokenizer.from_pretrained(path)
            check_tokenizer(tok)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except Exception as e:  # a missing or misspelled name, no hub, damaged files
            if memory_fault(e):  # not the model's fault
                raise
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            why = "no hub access (HF_HUB_OFFLINE=1)" if offline else "no hub access, a misspelled name or bad files"
            if os.path.isdir(path):  # a local folder: its files, whatever the hub
                why = "its files are missing or damaged"
            raise OSError(f"cannot load model '{path}': {why}: {error_line(e, 200)}; "
                          f"try --model tiny for an offline run") from None
    tok.padding_side = "left"  # generate() appends to the right end of every row
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok

def check_tokenizer(tok):
    """ValueError unless tok yields tokens (a folder without tokenizer files loads an empty one)."""
    if not tok("Make 9 from 4 3 2.", add_special_tokens=False)["input_ids"]:
        raise ValueError("its tokenizer turns text into no tokens (no tokenizer files?)")

def check_positions(model, prompt_tokens: int, max_new_tokens: int, what: str = "a"):
    """ValueError (`what` names the prompt) if such a prompt and answer pass the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"{what} {prompt_tokens}-token prompt and --max-new-tokens {max_new_tokens} exceed the "
                         f"model's {limit} positions")

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
        """(N, T) log-probs of comp's tokens, 0 after the end: `read`, the last draw from `pending` if short, [:T]."""
        if self.pending is not None and len(self.read) < comp.shape[1]:
            self.read.append(self.pending.gather(1, comp[:, -1:]))
        return torch.cat(self.read[:comp.shape[1]], dim=1).masked_fill(~resp_mask, 0.0)

# How rollout batches of different widths join: prompts are left padded (generate appends on the
# right), responses right padded; token ids pad with the pad id, masks and log-probs with 0.
LEFT_PADDED = ("prompt_ids", "prompt_mask")
PAD_ID_FILLED = ("prompt_ids", "comp_ids")

def _join_rows(xs: list, key: str, pad_id: int):
    """One per-answer entry `key` of several rollout batches, joined along the answers: lists
    concatenated, (N, W) tensors' rows padded to one width by the rule above."""
    if isinstance(xs[0], list):
        return [x for part in xs for x in part]
    if xs[0].dim() == 1:
        return torch.cat(xs)
    fill = 0
    if key in PAD_ID_FILLED:
        fill = pad_id
    side = "right"
    if key in LEFT_PADDED:
        side = "left"
    rows = [row for x in xs for row in x]  # each answer's (W,) row
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill, padding_side=side)

def sample_answers(run, prompts: list, cfg: Config, log=print) -> dict:
    """Step 2: rollout() of G answers per prompt on run.sampler, with its log-probs, on the fast path (static cache,
    compiled decoding) while run.fast holds; if that raises, one line says so and from this step on the plain path."""
    knobs = dict(group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                 top_p=cfg.top_p, top_k=cfg.top_k, sampler_logp=True)
    if run.fast:
        try:
            return rollout(run.sampler, run.tok, prompts, fast=True, **knobs)
        except Exception as e:
            if isinstance(e, ValueError) or memory_fault(e):  # the plain path would fail too
                raise
            run.fast = False
            log(f"fast generation failed ({type(e).__name__}: {error_line(e, 120)}); on the plain path from now on")
    return rollout(run.sampler, run.tok, prompts, fast=False, **knobs)

@torch.no_grad()
def refresh_sampler(sampler, model):
    """The bf16 sampler follows the fp32 master weights, in place (no reallocation)."""
    if sampler is not model:
        torch._foreach_copy_(list(sampler.parameters()), list(model.parameters()))

# ==== Evaluation [plumbing] =======================================================================
@torch.no_grad()
def evaluate(model, tok, task: dict, rows: list, chat: bool, short: bool, max_new_tokens: int, batch_size: int = 64,
             samples: int = 0, temperature: float = 1.0, top_p: float = 1.0) -> dict:
    """Accuracy (the share of answers with reward 1.0; samples = k: avg@k at temperature, top_p), length, a sample."""
    k = max(samples, 1)
    per = max(batch_size // k, 1)  # problems per rollout
    correct, length, sample = 0, 0, ""
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        b = rollout(model, tok, build_prompts(tok, task, chunk, chat, short), k, max_new_tokens, temperature, top_p,
                    greedy=samples == 0)
        correct += sum(r == 1.0 for r in grade_answers(task, b["texts"], chunk, k))
        length += int(b["resp_mask"].sum())
        sample = sample or b["texts"][0]
    n = max(len(rows) * k, 1)
    return dict(eval_acc=correct / n, eval_len=length / n, eval_sample=sample[:200])

_GRADERS = []  # the threads that grade evaluations: they live on (a worker dies with its thread)

def grade_answers(task: dict, texts: list, rows: list, k: int = 1) -> list:
    """task["reward"](texts[j], rows[j // k]) for every j, VERIFY_WORKERS at a time (math-verify's
    verdicts from as many workers): serial grading's values, in order. Each row's first answer goes
    first, so that its repeats find the verdict given (latex_equal). Ctrl-C cancels the rest."""
    if not _GRADERS:
        pool = concurrent.futures.ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="grade")
        _GRADERS.append(pool)
    order = sorted(range(len(texts)), key=lambda j: (j % k, j))
    futures = {j: _GRADERS[0].submit(task["reward"], texts[j], rows[j // k]) for j in order}
    try:
        return [futures[j].result() for j in range(len(texts))]
    finally:
        for f in futures.values():
            f.cancel()

def evaluate_run(model, run, cfg: Config) -> dict:
    """A run's evaluation (--eval-samples at --temperature, --top-p): its held-out rows, or each --eval-data set as
    eval_NAME with eval_acc and eval_len their means. Never used to pick a checkpoint."""
    sets = run.eval_rows if isinstance(run.eval_rows, dict) else {"acc": run.eval_rows}
    unknown_since_logged()  # those before it: the step's (step_record took them) or not this run's
    recs = [evaluate(model, run.tok, run.task, rows, run.chat, cfg.short_prompt, cfg.max_new_tokens,
                     samples=cfg.eval_samples, temperature=cfg.temperature, top_p=cfg.top_p) for rows in sets.values()]
    means = {key: sum(rec[key] for rec in recs) / len(recs) for key in ("eval_acc", "eval_len")}
    graded = sum(map(len, sets.values())) * max(cfg.eval_samples, 1)
    return dict({f"eval_{name}": rec["eval_acc"] for name, rec in zip(sets, recs)}, **means,
                eval_sample=recs[0]["eval_sample"],
                **check_grades("eval_grade_unknown", graded, "the evaluation", cfg))

# ==== The paper's setting [plumbing]: GMTS Framework1's values ===================================
PRESETS["paper-math"] = dict(  # NOTES, "The paper's setting": what comes from Framework1, what not
    model="Qwen/Qwen2.5-Math-1.5B", task="math", data="hf:hiyouga/math12k:train", prompt_style="qwen-math",
    chat_template="yes", steps=188, prompts_per_step=64, group_size=16, max_new_tokens=2048, lr=3e-5,
    loss_norm="seq", max_grad_norm=1 / 64,  # their 64 prompts' sum clipped at 1 = our mean at 1/64
    warmup_steps=0, lr_decay=False, kl_beta=0.001, micro_batch=4, filter_groups=False, eval_every=0,
    eval_samples=16, out="out/paper-math", eval_data="aime24=hf:HuggingFaceH4/aime_2024:train,amc23=hf:math-ai/"
    "amc23:test,math500=hf:HuggingFaceH4/MATH-500:test,minerva=hf:math-ai/minervamath:test,"
    "olympiadbench=hf:Hothan/OlympiadBench:OE_TO_maths_en_COMP:train")

def memory_plan(cfg: Config, model, prompt_tokens: int, device: torch.device) -> dict:
    """The GiB of each part of a step's peak (NOTES, "The paper's setting"): what stays (weights, AdamW, sampler copy,
    KL reference) plus the larger of sampling's KV cache and the update's gradients, activations and logits."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    width = prompt_tokens + cfg.max_new_tokens  # P + T
    act = 2 if device.type == "cuda" else 4  # bytes of an activation: bf16 autocast on CUDA
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * act  # K and V of one token
    layer = act * (9 * c.hidden_size + 4 * c.intermediate_size)  # kept per token for backward
    kept = layer * c.num_hidden_layers
    if cfg.grad_ckpt:  # every layer's input, and one layer's activations at a time
        kept = act * c.hidden_size * c.num_hidden_layers + layer
    bf16 = cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda")
    plan = {"weights": 4 * n, "AdamW": 8 * n, "sampler copy": 2 * n * bf16, "KL reference": 4 * n * (cfg.kl_beta > 0)}
    answers = cfg.prompts_per_step * cfg.group_size
    sampling = {"KV cache": kv * answers * width, "sampling logits": 12 * answers * c.vocab_size}  # 3 (N, V) fp32
    update = {"gradients": 4 * n, "activations": kept * cfg.micro_batch * width,
              "logits": 12 * cfg.stats_chunk * c.vocab_size}  # token_stats' 3 fp32 (chunk, V)
    plan.update(max(sampling, update, key=lambda part: sum(part.values())))
    return {part: size / 2**30 for part, size in plan.items() if size}

def memory_line(cfg: Config, model, prompt_tokens: int, device: torch.device, have: float = None) -> str:
    """memory_plan in one line, against the device's memory (a CPU's: the machine's); beyond it, flags that fit."""
    if have is None and device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory / 2**30
    if have is None:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    plan = memory_plan(cfg, model, prompt_tokens, device)
    line = "memory plan (GiB): " + ", ".join(f"{part} {size:.2f}" for part, size in plan.items())
    line += f" = {sum(plan.values()):.2f} of {have:.1f} on {device}"
    if sum(plan.values()) <= have:
        return line
    for fix in MEMORY_FIXES:  # the first that fits
        if sum(memory_plan(dataclasses.replace(cfg, **fix), model, prompt_tokens, device).values()) <= have:
            flags = [f"--{k.replace('_', '-')} {v}".replace(" True", "") for k, v in fix.items()]
            return line + f"; too much: {' '.join(flags)} fits"
    return line + "; too much: lower --prompts-per-step, --group-size or --max-new-tokens"

MEMORY_FIXES = ({"grad_ckpt": True}, {"grad_ckpt": True, "micro_batch": 1},
                {"grad_ckpt": True, "micro_batch": 1, "sampler_dtype": "fp32"})

# ==== The run folder [plumbing]: claim, checkpoints, resume, fingerprints, metrics ================
def open_run(cfg: Config, device: torch.device, log=print) -> tuple:
    """The run folder's side of start_run, before the optimiser: claim the folder (this process its only writer),
    read the data (a resume: the file it started with), load the model (a resume: its newest loadable checkpoint;
    none: afresh), check every row's prompt, only then delete an old run's files -> (model, tok, state, data)."""
    saved = claim_run(cfg)
    set_seed(cfg.seed)
    data = read_data(cfg)
    want = saved.get("fingerprint", {}).get("data")
    if want and not cfg.allow_change and data.fingerprint != want:
        raise ValueError(f"--data {cfg.data} is not the file the run started with (its size or sha256 differ); "
                         "pass --allow-change to train on it")
    state = dict(step=0, skipped=0, resumed=False)
    if checkpoints(cfg.out) and cfg.resume:
        want = saved.get("fingerprint", {}).get("prompt")
        model, tok, state = load_checkpoint(cfg.out, device, log, cfg.chat_template, want)
        if state["step"] > cfg.steps:
            raise ValueError(f"--steps {cfg.steps} is below the run's last completed step {state['step']}")
        state["resumed"] = True
    else:
        model, tok = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    check_prompts(cfg, model, tok, data)  # every row renders and fits before anything changes
    if state["resumed"]:
        return model, tok, state, data
    for n in _names(cfg.out, ("metrics.jsonl", "run_config.json", "ckpt-*")):  # they go only now
        if _own(os.path.join(cfg.out, n)):
            remove(os.path.join(cfg.out, n))
    return model, tok, state, data

def record_start(cfg: Config, run, data: Data, resumed: bool, device: torch.device, log=print):
    """The run folder's side of start_run once the optimiser exists: check a resume's KL reference, open the tracker
    (run.report), write metrics.jsonl (a resume's up to its checkpoint), run_config.json (the config and what a resume
    checks: data file, prompt format, KL reference) and, for a new run, step 0 (held-out accuracy) and ckpt-000000."""
    prints = dict(data=data.fingerprint, prompt=prompt_print(run.tok, cfg.chat_template),
                  reference=weights_print(run.ref) if run.ref else None)
    want = read_run_config(cfg.out).get("fingerprint", {}).get("reference") if resumed else None
    if want and want != prints["reference"] and not cfg.allow_change:
        raise ValueError(f"--model {cfg.model} is not the KL reference the run started from (its weights' sha256 "
                         "differs); pass --allow-change to train against it")
    run.report = open_tracker(cfg)  # wandb without a login: one line, nothing written
    kept = ""
    if resumed:  # the steps after the checkpoint will rerun
        kept = "".join(json.dumps(r) + "\n" for r in read_metrics(cfg.out, run.start - 1))
    write_file(os.path.join(cfg.out, "metrics.jsonl"), kept)
    write_file(os.path.join(cfg.out, "run_config.json"), json.dumps(dict(**vars(cfg), fingerprint=prints), indent=1))
    n_params = sum(p.numel() for p in run.model.parameters())
    kernels = torch.backends.cpu.get_cpu_capability()  # CPU numbers depend on it (NOTES, issue 31)
    held = "sets" if isinstance(run.eval_rows, dict) else "rows"  # --eval-data's, or rows of --data
    log(f"device {device} ({kernels} kernels, {torch.get_num_threads()} threads) | model "
        f"{resolve_model_name(cfg.model)} ({n_params:,} params) | chat template {run.chat} | {len(run.eval_rows)} "
        f"held-out {held} | {cfg.prompts_per_step} prompts x {cfg.group_size} answers per step"
        + (f" | resumed at step {run.start}" if resumed else ""))
    log(memory_line(cfg, run.model, data.longest, device))  # before any work
    if resumed:
        return
    rec = dict(step=0, **evaluate_run(run.model, run, cfg))
    log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
    run.report(rec)
    log(f"step 0 | eval_acc {rec['eval_acc']:.3f} | sample: {rec['eval_sample'][:80]!r}")
    save_checkpoint(cfg.out, 0, run.model, run.tok, run.opt, 0)

def step_record(step: int, cfg: Config, parts: list, batch: dict, valid, rewards, adv, old_logp, entropy, sel_mask,
                stats: dict, opt, skipped: int, t0: float, t_roll: float) -> dict:
    """One metrics.jsonl line (the glossary in NOTES.md explains each key); t0: the step's start; valid: the loss's."""
    mask = batch["resp_mask"]  # (N, T)
    n_valid = max(int(mask.sum()), 1)
    n_sel = max(int(sel_mask.sum()), 1)
    sampled = torch.cat([informative(part[1], cfg.group_size) for part in parts])
    zero_adv_kept = sel_mask & (adv == 0)[:, None]  # (N, T)
    gap = (batch["sampler_logp"] - old_logp).abs()[mask]  # sampler vs learner precision
    dt = time.time() - t0
    return dict(step=step, reward_mean=rewards.mean().item(), acc=(rewards == 1.0).float().mean().item(),
                selected_frac=int(sel_mask.sum()) / max(int(valid.sum()), 1),
                entropy_mean=float((entropy * mask).sum()) / n_valid,
                entropy_selected_mean=float((entropy * sel_mask).sum()) / n_sel,
                zero_adv_selected_frac=float(zero_adv_kept.sum()) / n_sel,
                grad_norm=stats["grad_norm"], loss=stats["loss"], clip_frac=stats["clip_frac"], kl=stats["kl"],
                completion_len=n_valid / mask.shape[0], rollout_batches=len(parts),
                groups_filtered_frac=1.0 - sampled.float().mean().item(), lr=opt.param_groups[0]["lr"],
                skipped_steps=skipped, truncated_frac=batch["truncated"].float().mean().item(),
                rollout_time_s=t_roll, step_time_s=dt, tokens_per_s=float(mask.sum()) / dt,
                sampler_logp_gap=gap.mean().item(), sampler_logp_gap_max=gap.max().item(),
                **check_grades("grade_unknown", sum(len(p[1]) for p in parts), f"step {step}", cfg))

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
    """The complete checkpoint folders in out, oldest first (a folder is renamed into place only when complete;
    one that holds an output of this program of its own is not a checkpoint)."""
    names = os.listdir(out) if os.path.isdir(out) else []  # not glob: a name may hold [ ] * ?
    return sorted(os.path.join(out, n) for n in names if re.fullmatch(r"ckpt-\d+", n) and _own(os.path.join(out, n)))

def save_checkpoint(out: str, step: int, model, tok, opt, skipped: int, keep: int = 2):
    """OUT/ckpt-<step>: model, tokenizer and state.pt (step, optimiser; no RNG: every step reseeds), written as .tmp and
    renamed; then all but the newest `keep` go, each renamed first (a half-deleted one is no checkpoint)."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp):
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        torch.save(dict(step=step, skipped=skipped, opt=opt.state_dict()), os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(out)[:-keep]:
        os.replace(old, old + ".old")
        shutil.rmtree(old + ".old", ignore_errors=True)

def load_checkpoint(out: str, device: torch.device, log=print, chat_template="auto", want=None) -> tuple:
    """(model, tok, state) from the newest checkpoint that loads (load_model checks its tokenizer) and can continue the
    run: finite weights, a chat template that renders, the run's prompt format (prompt_print == want); a damaged one
    is reported in one line and the previous one tried. state.pt is read with weights_only=True. OSError if none."""
    for ck in reversed(checkpoints(out)):
        try:
            model, tok = load_model(ck, device)
            for name, p in model.named_parameters():
                if not torch.isfinite(p).all():
                    raise ValueError(f"non-finite weights in {name}")
            if tok.chat_template:
                render_prompt(tok, "2 + 2?", True)
            if want is not None and prompt_print(tok, chat_template) != want:
                raise ValueError(f"its prompt format {prompt_print(tok, chat_template)} is not the run's {want}")
            state = torch.load(os.path.join(ck, "state.pt"), map_location="cpu", weights_only=True)
            if not (isinstance(state, dict) and isinstance(state.get("step"), int) and "opt" in state):
                raise ValueError("state.pt holds no step and optimiser")
            log(f"resuming from {ck}")
            return model, tok, state
        except Exception as e:  # truncated, empty or foreign files: try the previous one
            if memory_fault(e):  # not the files' fault: every checkpoint stays as it is
                raise
            log(f"{ck} does not load ({type(e).__name__}: {error_line(e, 120)}); trying the previous checkpoint")
    raise OSError(f"--resume {out}: no loadable checkpoint (ckpt-*) in that folder; --overwrite starts it afresh")

@torch.no_grad()
def check_weights(model, batch: dict, step: int, out: str):
    """After an update: weights that are not finite, or so large that the batch's first answer's first-token
    distribution is not (the next step could not sample), end the run (RunError, exit 1) before a checkpoint."""
    finite = bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())
    if finite:  # one (1, V) row of logits: a sampling step's worth, not the whole answer's (T, V)
        h = response_hidden(model, batch, slice(0, 1))[0, :1]  # (1, d)
        finite = bool(torch.log_softmax(model.get_output_embeddings()(h).float(), -1).isfinite().all())
    if not finite:
        raise RunError(f"step {step} left non-finite weights or logits (is --lr too high?); stopped, the checkpoints "
                       f"in {out} are from before it")

def save_final(out: str, model, tok):
    """save_pretrained into OUT itself (from_pretrained(OUT) loads it) through a temporary folder, each file moved in by
    an atomic rename, config.json last: no reader sees a torn model (check_out refused others' such files in OUT)."""
    tmp = os.path.join(out, "final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp):
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

class RunError(RuntimeError):
    """A run that cannot go on (non-finite weights, nothing to analyse): one line, exit 1."""

RUN_MARK = ".gmts-run"  # {"kind": ...} in each folder this program writes; its live writer flocks it
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors*", "*.bin", "tokenizer*", "*_tokens*.json",
               "vocab.json", "merges.txt", "chat_template.*", "README.md")
WRITES = {"gmts": ("metrics.*", "run_config.json*", "ckpt-*", "final.tmp", *MODEL_FILES),
          "trl": ("checkpoint-*", "training_args.bin", "trainer_state.json", "runs", *MODEL_FILES),
          "warm": MODEL_FILES, "compare": ("compare.md", "compare.png"), "analyze": ("analysis.json",)}
_HELD = {}  # real path of a folder -> the fd of its marker, locked by this process

def run_kind(out: str):
    """The kind in out's marker (a run_config.json alone: a gmts run of an earlier version), "" while a marker is
    being written, None for a folder this program never wrote into."""
    try:
        with open(os.path.join(out, RUN_MARK)) as f:
            text = f.read()
        return json.loads(text)["kind"] if text.strip() else ""
    except FileNotFoundError:
        return "gmts" if os.path.isfile(os.path.join(out, "run_config.json")) else None
    except (OSError, ValueError, TypeError, KeyError):
        return "unreadable"

def _own(path: str) -> bool:
    """Whether a run may delete `path` as its own file: anything but a folder with an output of its own."""
    return not os.path.isdir(path) or run_kind(path) is None

def _run_around(out: str, below: bool = True):
    """(where, folder, kind) of the nearest folder above `out` with an output of this program other than a compare
    ("lies inside"), else of one below it ("holds"), or None: either would stop the other (the outer's clean-up or
    rotation could delete the inner, whose resume the outer's marker refuses)."""
    parent = os.path.dirname(os.path.realpath(out))
    while parent != os.path.dirname(parent):
        if run_kind(parent) not in (None, "compare"):
            return "lies inside", parent, run_kind(parent)
        parent = os.path.dirname(parent)
    for folder, subfolders, _ in os.walk(out) if below else []:
        for d in subfolders:
            if run_kind(os.path.join(folder, d)) is not None:
                return "holds", os.path.join(folder, d), run_kind(os.path.join(folder, d))
    return None

def _names(out: str, patterns) -> list:
    return [n for n in sorted(os.listdir(out)) if any(fnmatch.fnmatchcase(n, p) for p in patterns)]

def _held(out: str):
    """This process's locked marker fd for `out`, if it still is that folder's marker."""
    fd = _HELD.get(os.path.realpath(out))
    with contextlib.suppress(OSError):
        if fd is not None and os.fstat(fd).st_ino == os.stat(os.path.join(out, RUN_MARK)).st_ino:
            return fd
    return None

def _lock(out: str, exclusive: bool) -> int:
    """flock out's marker, no waiting (exclusive: created if missing) -> fd; ValueError if another process holds it."""
    fd = os.open(os.path.join(out, RUN_MARK), os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"--out {out}: another process is writing there now; wait for it or choose another --out")
    return fd

def check_out(out: str, kind: str = "gmts", model: str = "", overwrite=False, resume=False, more: tuple = ()):
    """ValueError unless a `kind` output may go into `out` replacing nothing not its own: no other live writer; no
    file this kind writes (or in `more`) unless the folder holds an earlier output of this kind (then --overwrite
    once it holds a checkpoint or result); not the --model folder or one holding it; in warm/ only warm starts."""
    real = os.path.realpath(out)
    warm = os.path.dirname(os.path.realpath(WARM_CPU))
    if kind != "warm" and os.path.commonpath([real, warm]) == warm:
        raise ValueError(f"--out {out} lies in {warm}, the committed warm starts; only gmts_lab.py warm writes there")
    if kind != "warm" and os.path.isdir(model) and os.path.commonpath([real, os.path.realpath(model)]) == real:
        raise ValueError(f"--out {out} is or holds the --model folder {model}: the run would replace it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is an existing file, not a folder")
    near = _run_around(out, below=kind != "compare")  # a compare folder holds its runs by design
    if near:
        raise ValueError(f"--out {out} {near[0]} {near[1]}, which holds a {near[2]} output of this program; choose "
                         "another --out")
    if not os.path.isdir(out):
        return
    if os.path.exists(os.path.join(out, RUN_MARK)) and _held(out) is None:
        os.close(_lock(out, exclusive=False))  # a probe: ValueError while another writes there
    found = run_kind(out)
    clash = _names(out, WRITES[kind] + tuple(more))
    if not found and clash:
        raise ValueError(f"--out {out} holds {clash[0]}, which no {kind} run of this program wrote; choose another "
                         "--out")
    if found and found != kind:
        raise ValueError(f"--out {out} holds a {found} output of this program, not a {kind} one; choose another --out")
    worth = clash
    if kind == "gmts":  # a run folder without a checkpoint holds nothing of value
        worth = checkpoints(out)
    if found and worth and not (resume or overwrite):
        hint = {"gmts": f"continue it with --resume {out}, or "}.get(kind, "")
        raise ValueError(f"--out {out} holds a run; {hint}pass --overwrite to replace it")

def claim_out(out: str, kind: str):
    """Make `out` this process's: create it and its marker and hold flock on it until the process ends (the OS drops
    it if the process is killed); then, only where a gmts run was, clear a killed run's .tmp and .old leftovers."""
    if _held(out) is not None:
        return
    leftovers = kind == "gmts" and run_kind(out) == "gmts"
    os.makedirs(out, exist_ok=True)
    fd = _lock(out, exclusive=True)
    mark = (json.dumps({"kind": kind}) + "\n").encode()
    if os.pread(fd, 4096, 0) != mark:
        os.ftruncate(fd, 0)
        os.pwrite(fd, mark, 0)
    _HELD[os.path.realpath(out)] = fd
    for n in _names(out, ("ckpt-*.tmp", "ckpt-*.old", "final.tmp", "metrics.jsonl.tmp", "run_config.json.tmp")):
        if leftovers and _own(os.path.join(out, n)):
            with contextlib.suppress(OSError):
                remove(os.path.join(out, n))

def release_all():
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)  # its lock goes with it
    _HELD.clear()

def claim_run(cfg: Config) -> dict:
    """check_out, claim_out, check_out under the lock (a run may have ended meanwhile) -> a resume's config or {}."""
    if cfg.resume and os.path.realpath(cfg.resume) != os.path.realpath(cfg.out):
        raise ValueError(f"--resume {cfg.resume} continues the run in that folder; --out {cfg.out} is another")
    check_out(cfg.out, "gmts", cfg.model, cfg.overwrite, bool(cfg.resume))
    claim_out(cfg.out, "gmts")
    check_out(cfg.out, "gmts", cfg.model, cfg.overwrite, bool(cfg.resume))
    if not cfg.resume:
        return {}
    return read_run_config(cfg.out)

def weights_print(model) -> str:
    """The KL reference's fingerprint: the sha256 of every parameter's bytes, in order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().float().cpu().numpy())
    return digest.hexdigest()

def prompt_print(tok, chat_template: str) -> dict:
    """The prompt format: chat template or not, and the template's sha256."""
    digest = hashlib.sha256(str(tok.chat_template).encode()).hexdigest()
    return {"chat": use_chat(tok, chat_template), "template_sha256": digest}

@contextlib.contextmanager
def writing(path: str):
    """A failed write removes the half-written `path`; a full disk (OSError, safetensors' SafetensorError, torch.save's
    RuntimeError) -> OSError with one line, memory raised as it is."""
    try:
        yield
    except Exception as e:
        with contextlib.suppress(OSError):
            remove(path)
        if memory_fault(e):
            raise
        raise OSError(f"cannot write {path}: {error_line(e, 200)}") from None

def remove(path: str):
    """Delete the file or folder at `path` (OSError if it cannot be deleted)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)

def write_file(path: str, text: str):
    """A small file written whole: a .tmp beside it, then an atomic rename."""
    with writing(path + ".tmp"):
        with open(path + ".tmp", "w") as f:
            f.write(text)
    os.replace(path + ".tmp", path)

# ==== Step lines, the progress bar and trackers [plumbing] ========================================
SHOWN = ("reward_mean", "acc", "selected_frac", "groups_filtered_frac", "entropy_mean", "grad_norm", "eval_acc")

def step_line(rec: dict) -> str:
    """'step 7 | reward_mean 0.412 | ... | 1.52 s': the keys of SHOWN that the record has."""
    fields = [f"step {rec['step']}"]
    for key in SHOWN:
        if key in rec:
            fields.append(f"{key} {rec[key]:.3f}")
    for key in ("grade_unknown", "eval_grade_unknown"):  # answers math-verify gave no verdict on
        if rec.get(key):
            fields.append(f"{key} {rec[key]}")
    fields.append(f"{rec['step_time_s']:.2f} s")
    return " | ".join(fields)

def step_printer(total: int, start: int, log=print):
    """show(line, keep) prints a step's line: on a terminal (log prints to a TTY) a tqdm bar counts steps and carries
    the latest line, keep=True ones (evaluations) above it; elsewhere all are logged. show(None, _) closes it."""
    if log not in (print, say) or not sys.stdout.isatty():
        def show(line, keep):
            if line is not None:
                log(line)
        return show
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start - 1, unit="step", file=sys.stdout, dynamic_ncols=True)

    def show(line, keep):
        if line is None:
            bar.close()
            return
        bar.update(1)
        bar.set_postfix_str(line.split(" | ", 1)[1], refresh=True)
        if keep:
            bar.write(line)
    return show

def check_tracker(name: str):
    """ValueError (one line) before any work if --report-to's package is not installed."""
    if name == "none":
        return
    try:
        importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)
    except ImportError:
        raise ValueError(f"--report-to {name} needs the {name} package (pip install {name})") from None

def open_tracker(cfg: Config):
    """report(rec) sends a record's numbers to --report-to's tracker (tensorboard or wandb, under --out),
    report(None) closes it. ValueError if the tracker cannot start (wandb without a login)."""
    if cfg.report_to == "none":
        return lambda rec: None
    try:
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            tracker = SummaryWriter(os.path.join(cfg.out, "tensorboard"))
        else:
            import wandb
            tracker = wandb.init(project="gmts", name=os.path.basename(os.path.abspath(cfg.out)), dir=cfg.out,
                                 config=dataclasses.asdict(cfg))
    except Exception as e:
        if memory_fault(e):
            raise
        raise ValueError(f"--report-to {cfg.report_to} cannot start: {error_line(e, 200)}") from None

    def report(rec):
        numbers = {k: v for k, v in (rec or {}).items() if k != "step" and type(v) in (int, float)}  # step: x axis
        if rec is None:
            getattr(tracker, "finish" if cfg.report_to == "wandb" else "close")()
        elif cfg.report_to == "wandb":
            tracker.log(numbers, step=rec["step"])
        else:
            for key, value in numbers.items():
                tracker.add_scalar(key, value, rec["step"])
    return report

# ==== Config checks [plumbing]: every value a run cannot use is refused before any work ===========
def die(msg, code: int = 2):
    """Bad input: one line on stderr (error_line), a non-zero exit, never a traceback."""
    print(f"gmts: error: {error_line(msg)}", file=sys.stderr)
    sys.exit(code)

RULES = [  # (fields, test, what their values must be); NaN fails every test
    (["rho", "top_p"], lambda v: 0 < v <= 1, "in (0, 1]"),
    (["lr"], lambda v: 0 < v <= 1, "in (0, 1] (a larger step leaves non-finite weights)"),
    (["temperature"], lambda v: 1e-4 <= v < math.inf, "finite and >= 1e-4 (logits / T must stay finite)"),
    (["max_grad_norm"], lambda v: 0 < v < math.inf, "finite and > 0"),
    (["clip_low", "clip_high"], lambda v: 0 <= v < 1, "in [0, 1)"),
    (["kl_beta", "weight_decay"], lambda v: 0 <= v < math.inf, "finite and >= 0"),
    (["steps", "prompts_per_step", "max_new_tokens", "micro_batch", "inner_updates", "stats_chunk", "eval_size",
      "max_resample", "tiny_layers"], lambda v: v >= 1, ">= 1"),
    (["save_every", "eval_every", "warmup_steps", "top_k", "eval_samples"], lambda v: v >= 0, ">= 0"),
    (["threads"], lambda v: 0 <= v <= 1024, "in [0, 1024] (0: torch's own choice)"),
    (["group_size"], lambda v: v >= 2, ">= 2 (an advantage needs a group)"),
    (["seed"], lambda v: 0 <= v < 2**32, "in [0, 2**32) (a step seeds with seed * 1000003 + step)"),
    (["tiny_hidden"], lambda v: v >= 8 and v % 8 == 0, "a multiple of 8 (4 heads of even size)"),
]

def check_config(cfg: Config, writes: bool = True):
    """ValueError for any value no run can use, before any work; writes=False (the command writes nothing): no --out."""
    types = {bool: bool, int: int, float: (int, float), str: str}  # bool is an int: see `typed`
    for f in dataclasses.fields(Config):  # a hand-edited run_config.json can hold any JSON value
        v = getattr(cfg, f.name)
        typed = isinstance(v, types[f.type]) and isinstance(v, bool) == (f.type is bool)
        unset = v is None and f.default is None  # --fast-generate left to the device
        if not (typed or unset):
            raise ValueError(f"--{f.name.replace('_', '-')} must be of type {f.type.__name__}, got {v!r}")
    choices = [([name], allowed.__contains__, "one of " + ", ".join(allowed)) for name, allowed in CHOICES.items()]
    for names, ok, want in choices + RULES:  # as RULES: (fields, test, what their values must be)
        for name in names:
            if not ok(getattr(cfg, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be {want}, got {getattr(cfg, name)!r}")
    get_task(cfg.task)
    eval_sets(cfg.eval_data)
    if cfg.data_columns and (cfg.task != "math" or not re.fullmatch(r"[^,]+,[^,]+", cfg.data_columns)):
        raise ValueError(f"--data-columns {cfg.data_columns!r}: QUESTION,ANSWER columns of a math data set")
    if cfg.prompt_style != "ours" and cfg.task != "math":
        raise ValueError(f"--prompt-style {cfg.prompt_style} asks for a \\boxed{{}} answer: --task math only")
    if data_kind(cfg.data) == "gen" and cfg.eval_size > 100_000:
        raise ValueError(f"--eval-size must be <= 100000 with generated data, got {cfg.eval_size}")
    if cfg.device in ("cuda", "mps") and pick_device("auto").type != cfg.device:
        raise ValueError(f"--device {cfg.device} but torch sees no such device (use --device auto or cpu)")
    if writes:
        check_out_path(cfg.out)

def check_out_path(out: str):
    """ValueError unless `out` is, or can be made, a folder this process can write."""
    parent = os.path.abspath(out or ".")
    while not os.path.exists(parent):
        if os.path.islink(parent):
            raise ValueError(f"--out {out!r}: {parent} is a symbolic link to nothing (dangling, or a loop)")
        parent = os.path.dirname(parent)
    with contextlib.suppress(OSError):  # a real write: os.access says yes to root even on /proc
        if out:  # (a file is no folder: NotADirectoryError)
            tempfile.TemporaryFile(dir=parent).close()
            return
    raise ValueError(f"--out {out!r} is not a folder that can be written")

# ==== CLI and signals [plumbing] ==================================================================
# A resume may change these freely; every other field changes the trajectory (--allow-change).
FREE = {"out", "resume", "overwrite", "allow_change", "steps", "save_every", "eval_every", "device", "report_to",
        "threads", "eval_samples"}

def parse_args(argv=None) -> Config:
    """Config fields become --flags (bools get --no-x too). --preset NAME sets defaults that explicit flags override;
    --resume OUT starts from that run's saved config (every field, no other key; no preset): a field outside FREE
    that differs needs --allow-change, paths compared by where they lead. Paths are stored absolute (resolved_paths)."""
    p = argparse.ArgumentParser(description="GRPO with GMTS token selection (see the module docstring).")
    p.error = die  # one line and exit 2, no usage dump
    p.add_argument("--preset", choices=list(PRESETS), help="a named group of defaults (not with --resume, which "
                   "takes the run's saved config): " + ", ".join(PRESETS))
    for f in dataclasses.fields(Config):
        flag, help_ = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            p.add_argument(flag, type=f.type, default=f.default, choices=CHOICES.get(f.name), help=help_)
    p.set_defaults(resume=None)  # None: not given; "" (an unset shell variable) names no folder
    pre, _ = p.parse_known_args(argv)
    if pre.resume == "":
        raise ValueError("--resume names no folder (an unset shell variable?); give the run folder to continue")
    if pre.resume and pre.preset:
        raise ValueError(f"--resume {pre.resume} continues that run with its saved config; --preset cannot apply to "
                         "it (give each field to change as a flag)")
    p.set_defaults(**PRESETS.get(pre.preset, {}))
    saved = {}
    names = {f.name for f in dataclasses.fields(Config)}
    if pre.resume:
        saved = read_run_config(pre.resume)
        check_saved_keys(pre.resume, saved, names)
    p.set_defaults(**{k: v for k, v in saved.items() if k in names - {"resume", "overwrite", "allow_change", "out"}})
    p.set_defaults(out=pre.resume or p.get_default("out"), resume="")  # a run goes on in its folder
    cfg = resolved_paths(Config(**{k: v for k, v in vars(p.parse_args(argv)).items() if k != "preset"}))
    for k in sorted(names - FREE):
        if cfg.resume and not same_value(k, getattr(cfg, k), saved[k]) and not cfg.allow_change:
            raise ValueError(f"--resume {cfg.resume}: the run was trained with --{k.replace('_', '-')} {saved[k]}, "
                             f"not {getattr(cfg, k)}; pass --allow-change to change it")
    return cfg

def resolved_paths(cfg: Config) -> Config:
    """cfg with its paths absolute (--model if a folder, --data and --eval-data's sets if a file or dataset folder,
    --out), as parse_args and train (configs made in Python) apply it: a resume from any folder finds the files."""
    model, data, eval_data, out = cfg.model, cfg.data, cfg.eval_data, cfg.out
    if isinstance(model, str) and model != "tiny" and os.path.isdir(model):
        model = os.path.abspath(model)
    if isinstance(data, str):
        data = absolute_data(data)
    if isinstance(eval_data, str):
        eval_data = ",".join(f"{name}={absolute_data(d)}" for name, d in eval_sets(eval_data))
    if isinstance(out, str) and out:
        out = os.path.abspath(out)
    return dataclasses.replace(cfg, model=model, data=data, eval_data=eval_data, out=out)

def absolute_data(data: str) -> str:
    """A --data value with its local file, or hf:FOLDER[:...]'s dataset folder, made absolute."""
    parts = data.split(":")
    if data_kind(data) == "file":
        return os.path.abspath(data)
    if data_kind(data) == "hf" and len(parts) > 1 and "/" in parts[1] and os.path.isdir(parts[1]):  # as load_rows
        return ":".join(["hf", os.path.abspath(parts[1]), *parts[2:]])
    return data

def same_value(field: str, a, b) -> bool:
    """A resume's test of a field against the saved one; paths are equal where they lead to one place."""
    if field in ("model", "data") and isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b

def check_saved_keys(out: str, saved: dict, names: set):
    """A run_config.json holds every Config field and nothing else (besides the fingerprint)."""
    missing = sorted(names - set(saved))
    unknown = sorted(set(saved) - names - {"fingerprint"})
    if missing:
        raise ValueError(f"--resume {out}: run_config.json lacks {', '.join(missing)}")
    if unknown:
        raise ValueError(f"--resume {out}: run_config.json holds unknown keys {', '.join(unknown)}")

def memory_fault(e, lower: str = "--micro-batch, --group-size or --max-new-tokens"):
    """The one line, naming the flags to `lower`, for an allocation that failed (the GPU's: torch.OutOfMemoryError or a
    RuntimeError saying "out of memory"; the CPU's: MemoryError, torch's allocator), or None for any other error."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    if isinstance(e, MemoryError) or "can't allocate memory" in text:
        return f"out of CPU memory: lower {lower}, or use a smaller model"
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
        return f"out of GPU memory: lower {lower}"
    return None

def error_line(e, cap: int = 1000) -> str:
    """The one line for an exception or a message, which every printed error goes through: memory first (memory_fault),
    else its message with line breaks written as \\n (a path may hold one) cut at `cap`, else its type's name."""
    return memory_fault(e) or "\\n".join(str(e).strip().splitlines())[:cap] or type(e).__name__

def fail(e: Exception, kept: str = ""):
    """The exit of a command that an exception ends: memory (exit 1; `kept` says what the run keeps), bad input
    (ValueError: 2), a fault (OSError, RunError: 1), each in one line. Any other exception is a bug: raised again."""
    if memory_fault(e):
        die(memory_fault(e) + kept, 1)
    if not isinstance(e, (ValueError, OSError, RunError)):
        raise e
    die(e, 2 if isinstance(e, ValueError) else 1)

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STOPPED = []  # the stop signal received, kept even when its KeyboardInterrupt was swallowed

def _on_signal(signum, frame):
    """The first stop signal raises KeyboardInterrupt, later ones are ignored (one message, however often pressed).
    Python swallows an exception raised inside a __del__ ('Exception ignored in: <function Group.__del__>', then
    the run went on and exited 0): _STOPPED remembers it and say() raises it again at the next line."""
    ignore_stops()
    _STOPPED.append(signum)
    raise KeyboardInterrupt

def say(*parts, **kwargs):
    """print for the CLI: raises a swallowed interrupt again; a closed stdout (| head -1) ends the printing only."""
    if _STOPPED:
        raise KeyboardInterrupt
    try:
        print(*parts, flush=True, **kwargs)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the rest goes nowhere

def ignore_stops():
    """From here on a stop signal changes nothing (after the first, after a run, in the teardown)."""
    for sig in STOP:
        signal.signal(sig, signal.SIG_IGN)

@contextlib.contextmanager
def handling_signals():
    """The command line's streams and signals: a closed stdout (>&-) is /dev/null, a character stdout cannot encode
    is written as an escape; _on_signal for the stop signals (main thread only), the old ones back unless one came."""
    sys.stdout = sys.stdout or open(os.devnull, "w")
    with contextlib.suppress(AttributeError, ValueError):  # a notebook's stream has no reconfigure
        sys.stdout.reconfigure(errors="backslashreplace")
    _STOPPED.clear()
    old = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in STOP:
            old[sig] = signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for sig in old:
            if not _STOPPED:
                signal.signal(sig, old[sig])

def main(argv=None):
    with handling_signals():
        _main(argv)

def _main(argv):
    out = None
    steps = None
    started = time.time()
    try:
        cfg = parse_args(argv)
        check_config(cfg)
        out = cfg.out
        steps = cfg.steps
        changed = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config, k)}
        say(f"config (other than the defaults; {cfg.out}/run_config.json has all): {json.dumps(changed)}")
        train(cfg, log=say)
        say("", end="")  # an interrupt swallowed at the very end still counts
        ignore_stops()  # done: every file is saved
    except KeyboardInterrupt:
        if finished(out, steps, started):  # the signal came after the final model was saved
            return
        die(f"interrupted; {interrupted_state(out)}", 130)
    except Exception as e:  # memory; bad input (flags, data, --out); a model that cannot load
        fail(e, f"; {interrupted_state(out)}")
    finally:
        release_all()

def finished(out, steps: int, since: float) -> bool:
    """Whether this process ended the run in `out`: its last step logged and its final model saved after `since`
    (train plots first; save_final moves config.json in last)."""
    recs = read_metrics(out) if out else []
    config = os.path.join(out or "", "config.json")
    return bool(recs) and recs[-1]["step"] == steps and os.path.isfile(config) and os.path.getmtime(config) >= since

def interrupted_state(out) -> str:
    """What an interrupted run leaves in `out`, truthfully, and how to go on."""
    if not out or _held(out) is None:
        return "nothing was written"
    done = checkpoints(out)
    if not done:
        return f"{out} holds no checkpoint yet: rerun the command to start it afresh"
    return f"{out} keeps {os.path.basename(done[-1])}: continue with --resume {out}"

if __name__ == "__main__":
    ignore_stops()  # torch imported: handling_signals takes over, then the teardown ignores them
    main()
