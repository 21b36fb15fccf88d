"""
gmts.py: GRPO with Gradient Magnitude-based Token Selection (GMTS) in one file, to read with:
  GMTS   Lv et al. 2026, "Gradient Magnitude-based Token Selection Improves RLVR Training for LLM
         Reasoning", arXiv 2608.30632: train on about the top 20% of each prompt's tokens by H_t *
         |omega_t|, an approximation of the size of their gradient. The selection as the authors'
         code does it; their omega's normaliser and KL under --loss-norm seq-sum --kl-beta 0.001.
  80/20  Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL
         for LLM Reasoning", arXiv 2506.01939: train on the top 20% by entropy H_t.
  RSI-S  Lv et al. 2026, "Which Tokens Matter? Adaptive Token Selection for RLVR with the Relative
         Surprisal Index", arXiv 2606.31575: train on the tokens whose (-log p_y) / H_t is in an
         interval (ours: [0.5, 2]; the paper's was not in the sources we could read).

One training step, as train() numbers it (the algorithm steps); the file follows this order:
  1. draw B prompts from the task                                     [plumbing]
  2. sample G answers per prompt with HF generate (N = B*G answers)   [paper: rollout]
  3. score every answer with a rule-based verifier -> reward r_i      [paper: reward]
  4. group advantages A_i = (r_i - mean_group) / (std_group + eps)    [paper: GRPO advantage]
  5. per response token: log pi(y_t) and entropy H_t                  [paper: token statistics]
     and dz_norm = ||d log p_y / d logits|| (for gradnorm)            [ours]
  6. score tokens, keep the top rho of each group or of the batch     [paper: selection]
       entropy   H_t, over the whole batch                            [80/20, GMTS's ETS baseline]
       gmts      H_t * |omega_t|, omega = -dL/dlogp_t, per group      [GMTS]
       gradnorm  |omega_t| * dz_norm = ||dL/dz||, over the batch      [ours: an ablation]
       rsi       -log p_y / H_t in an interval: no rho, no scope      [RSI-S]
  7. PPO-clip update on the kept tokens only, in micro-batches        [paper: objective]
  8. log, evaluate, checkpoint                                        [plumbing]
Below the "Supporting code" banner: the lr schedule, data, prompts, math-verify, model loading,
evaluation, the run folder, the CLI.

Provenance. GMTS as its authors' code runs it (github.com/outongyiLv/GMTS, GMTS-Framework1, one-GPU
loop like this file: grpo_tools/grpo.py's GMTS() for the score and per-group budget,
normalize_rewards_per_group and approx_kl_divergence for the normaliser and KL inside omega,
update_policy for the ETS entropy baseline). Their Framework2 (verl, Qwen3-8B) differs: omega =
r * I * A, ties at the threshold dropped, and as released its group loop reaches only the first of
every four groups of a GPU's mini-batch. Ours: --scope batch for gmts (our earlier variant),
gradnorm, the defaults --loss-norm all and no KL (theirs: seq-sum, 0.001), the entropy tie rule.

Axes: B prompts per step, G answers per prompt, N = B*G answers, P prompt length (left padded), T
response length, V vocabulary, d hidden size. Every (N, T) tensor is aligned to RESPONSE positions:
column t holds the statistics of the t-th generated token, predicted by the hidden state before it.

Deviations from the papers and choices they leave open:
  1. Scope (--scope): gmts ranks within each prompt's group, as its authors; the others over the
     whole batch, keeping exactly ceil(rho * n), ties to the earlier token (the authors' ETS keeps
     every tie at its threshold, NOTES; the 80/20 code selects per micro-batch and GPU).
  2. omega = -dL/dlogp of the whole configured loss (derivation step 1), rescored each inner update.
  3. --loss-norm all (default) divides by all valid tokens (80/20 paper, TRL): selection is a pure
     mask of one sum, one lr for every method; 'selected' by the kept budget (80/20 code); 'seq' is
     GRPO's per-answer mean, averaged over the answers; 'seq-sum' sums it over prompts (GMTS's).
  4. Population std in the group advantage (divide by G).
  5. --filter-groups (DAPO's dynamic sampling, default on, every method alike) drops groups whose
     rewards are all equal and draws more prompts, up to --max-resample rollout batches per step.
  6. One step rule: the optimiser steps iff some token has a non-zero gradient (a kept token with
     A != 0 and an inactive clip, or with KL one whose log-prob differs from the reference's) and
     the loss and gradient norm are finite; the lr follows GRPO steps regardless.
  7. KL (k3, beta > 0) covers all valid tokens, with the loss's normaliser; its reference is the
     model --model loads, its log-probs by the loss's own pass (equal weights, equal bits).
  8. fp32 master weights with bf16 autocast on CUDA; log-softmax, entropy and the loss always fp32.
  9. gmts/gradnorm never keep a token whose score is 0 (its gradient is exactly 0; for gmts also a
     token of zero entropy, as its authors): maybe fewer than rho.
 10. Rewards: countdown's and logic's 0.1 format reward (TinyZero), math binary (80/20 paper).

Run:  python gmts.py --preset cpu                   (offline, CPU: a tiny warm-started model learns)
      python gmts.py --model Qwen2.5-0.5B --task countdown                    (one GPU)
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

import argparse, ast, concurrent.futures, contextlib, copy, dataclasses, errno, fcntl, fnmatch
import functools, hashlib, importlib, itertools, json, logging, math, queue, random, re, select
import operator, shutil, subprocess, sys, tempfile, threading, time
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
    allow_change: bool = arg(False,
        "with --resume: allow flags that change the run's trajectory (all but --out, --steps, "
        "--save-every, --eval-every, --device, --report-to, --threads)")
    seed: int = arg(0, "seeds python, torch and every step's sampling")
    device: str = arg("auto", "auto picks cuda > mps > cpu")
    threads: int = arg(0,
        "CPU threads torch uses (0: torch's choice, faster on idle cores; cpu, smoke presets: 1)")
    steps: int = arg(200, "GRPO steps")
    save_every: int = arg(50, "checkpoint every this many steps (0: only at the end)")
    report_to: str = arg("none", "also to tensorboard (OUT/tensorboard) or wandb (OUT/wandb)")
    # model
    model: str = arg("tiny",
        "'tiny' (random, built offline), a short Qwen name (Qwen2.5-0.5B), a hub id or a folder")
    chat_template: str = arg("auto",
        "wrap prompts in the chat template: auto (decided by the tokenizer), yes, no")
    tiny_hidden: int = arg(64, "--model tiny: hidden size")
    tiny_layers: int = arg(2, "--model tiny: transformer layers")
    grad_ckpt: bool = arg(False, "gradient checkpointing in the update forward")
    # task
    task: str = arg("countdown", "countdown, math or logic")
    data: str = arg("gen",
        "gen (offline generator), easy (its smallest variant), hf, hf:test, hf:ID[:CONFIG][:SPLIT] "
        "(a hub set or a local dataset folder), or a .jsonl, .json, .csv or .parquet file")
    data_columns: str = arg("", "QUESTION,ANSWER columns for a math set's own layout (a.b: b in a)")
    data_order: str = arg(
        "draw",
        "draw: each step draws its rows afresh, seeded by (seed, step); epoch: a file's or set's "
        "rows in a seeded shuffle, each once per pass, continued by --resume; gen, easy: draw only")
    skip_bad_rows: bool = arg(
        False, "train without --data's bad rows (no answer, a broken one), listed in "
               "OUT/skipped_rows.jsonl; default: refuse them all before step 0")
    prompt_style: str = arg("ours",
        "ours (<think>, <answer>), qwen-math (GMTS Framework1's \\boxed{} system prompt) "
        "or boxed-suffix (Framework2's \\boxed{} request after the question); math only")
    short_prompt: bool = arg(False, "terse prompts, no system line (for the byte-level tiny model)")
    eval_every: int = arg(20, "held-out accuracy every this many steps (0: at step 0 and the last)")
    eval_size: int = arg(64, "held-out problems (the data's first rows; none with --eval-data)")
    eval_data: str = arg("",
        "benchmarks instead of held-out rows: NAME=DATA,... (DATA as --data), eval_NAME each")
    eval_samples: int = arg(0,
        "0: greedy; k: avg@k, k samples per problem (--temperature, --top-p)")
    max_prompt_tokens: int = arg(0, "refuse rows whose prompt has more tokens, before step 0 "
                                    "(0: only the model's positions bound it)")
    # rollout
    prompts_per_step: int = arg(8, "B, informative prompts (groups) per step")
    group_size: int = arg(8, "G, answers sampled per prompt")
    max_new_tokens: int = arg(256, "response length limit; longer answers are cut and flagged")
    temperature: float = arg(1.0, "sampling temperature, also used for log-probs and entropy")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples the full distribution (on-policy)")
    top_k: int = arg(0, "top-k sampling; 0 disables it")
    sampler_dtype: str = arg("auto",
        "generate's weights: bf16 (a copy) or fp32; auto: bf16 on CUDA")
    fast_generate: bool = arg(None, "a static KV cache, compiled decoding (unset: on with CUDA)")
    rollout_rows: int = arg(0, "answers per generate() call, whole groups (0: all B*G at once); "
                               "fewer bound the KV cache and the prefill")
    filter_groups: bool = arg(True, "DAPO dynamic sampling: drop equal-reward groups, draw more")
    max_resample: int = arg(4, "--filter-groups: at most this many rollout batches per step")
    overlong_filter: bool = arg(False, "DAPO's overlong filter: a truncated answer trains nothing")
    # GRPO
    clip_low: float = arg(0.2, "PPO clip eps below 1")
    clip_high: float = arg(0.28, "PPO clip eps above 1 (DAPO clip-higher)")
    kl_beta: float = arg(0.0, "k3 KL to the starting model (0: no reference model is loaded)")
    std_normalize: bool = arg(True, "divide advantages by the group std (off: Dr. GRPO)")
    inner_updates: int = arg(1, "optimiser steps per rollout batch (mu)")
    loss_norm: str = arg("all",
        "all: divide by all valid response tokens; selected: by the kept budget; seq: GRPO's "
        "per-answer mean (1/|o_i|), averaged over the answers; seq-sum: averaged over each "
        "prompt's G answers and summed over the prompts (GMTS's authors)")
    # token selection
    select: str = arg("gmts",
        "all, random, entropy, gmts, gradnorm or rsi (METHODS); gmts selects as its authors' "
        "code (their omega's normaliser and KL only with --loss-norm seq-sum --kl-beta 0.001); "
        "rsi keeps an interval of RSI (--rsi-low, --rsi-high), not a top rho")
    rho: float = arg(0.2, "share of the response tokens kept (not read by all and rsi)")
    rsi_low: float = arg(0.5,
        "rsi: keep the tokens whose RSI = -log p_y / H is >= this; ours, half RSI's on-policy mean "
        "of 1 (the RSI paper's interval was not in the sources we could read)")
    rsi_high: float = arg(2.0, "rsi: ... and <= this; ours, twice the on-policy mean")
    scope: str = arg("auto",
        "where the top rho of the valid tokens is taken: group (each prompt's G answers), by the "
        "rule of GMTS's authors' code: of n tokens drop max(1, ceil((1 - rho) n)) (one even at rho "
        "1), ties to the later token; or batch (80/20, ETS; with gmts this project's variant), our "
        "rule: keep ceil(rho n), ties to the earlier token; auto: the method's own (METHODS: group "
        "for gmts, else batch)")
    # optimisation
    lr: float = arg(1e-6, "AdamW learning rate")
    warmup_steps: int = arg(10,
        "linear lr warm-up in update slots (steps x --inner-updates, stepped or not)")
    lr_decay: bool = arg(True, "after warm-up, a linear lr decay to ~0 at the end (off: constant)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_eps: float = arg(1e-8, "AdamW eps (torch's; a loss B times smaller, as --loss-norm seq's "
                                "mean is seq-sum's, takes eps / B for the same update)")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    micro_batch: int = arg(8, "answers per forward/backward (gradient accumulation over the batch)")
    stats_chunk: int = arg(1024, "rows of the (tokens x V) logits held at once in the head")

CHOICES = {
    "select": [],  # METHODS' names, filled beside the table
    "device": ["auto", "cuda", "mps", "cpu"],
    "chat_template": ["auto", "yes", "no"],
    "loss_norm": ["all", "selected", "seq", "seq-sum"],
    "scope": ["auto", "group", "batch"],
    "sampler_dtype": ["auto", "bf16", "fp32"],
    "report_to": ["none", "tensorboard", "wandb"],
    "prompt_style": ["ours", "qwen-math", "boxed-suffix"],
    "data_order": ["draw", "epoch"],
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
    # GMTS Framework1's values (NOTES, "The paper's setting": what is theirs, what not); seq-sum
    # with the clip at 1 is their update (test_one_step_equals_the_authors_update).
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
    check_positions(model, ids.shape[1], max_new_tokens)
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
# eval/exec and never raise (a bug costs a reward, not a run). All are pure functions but one:
# math_reward on a competition (LaTeX) row asks math-verify in a worker process (latex_equal, in
# the supporting code), bounded in time; a timeout kills the worker. Task data: supporting code.
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
    return None if m is None else m.group().rstrip(",.")

def _answer_line(text: str):
    """What follows the last 'Answer:' to its line's end ($, \\boxed{} around it gone) or None."""
    k = text.rfind("Answer:")
    if k < 0:
        return None
    line = text[k + len("Answer:"):k + 400].split("\n", 1)[0].strip().strip("$").strip()
    boxed = _last_boxed(line, cap=300)
    return boxed if boxed is not None else line or None

@_never_raise
def math_reward(completion: str, answer: str, latex: bool = False, fallback: bool = False,
                answer_line: bool = False) -> float:
    """Binary: 1.0 iff the final answer equals the reference exactly (as fractions); no format
    bonus. latex (every row but GSM8K's): the last \\boxed{} (answer_line: the last 'Answer:'
    line), by math-verify on normal_answer's forms unless both are numbers; fallback (a gold
    math-verify cannot read): bare_answer's forms equal; a unit on both sides (value_unit's) must
    be the same_unit, on one side it is not compared (these four: supporting code)."""
    gold = parse_number(str(answer))
    got = _answer_line(completion) if answer_line else math_final_answer(completion, latex)
    if got is None or (gold is None and not latex):
        return 0.0
    if gold is not None and (not latex or parse_number(got) is not None):
        return float(parse_number(got) == gold)
    units = value_unit(str(answer))[1], value_unit(got)[1]
    if all(units) and not same_unit(*units):
        return 0.0
    if fallback:
        return float(bare_answer(str(answer)) == bare_answer(got))
    return 1.0 if latex_equal(normal_answer(str(answer)), normal_answer(got)) else 0.0

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

# -- prompts (build_prompts, in the supporting code, frames them in --prompt-style) --
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
    if short or row.get("answer_line"):  # a row that asks for its answer itself (DAPO's): as it is
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
    "countdown": {"prompt": countdown_prompt,
                  "reward": lambda c, row: countdown_reward(c, row["nums"], row["target"])},
    "math": {"prompt": math_prompt, "reward": lambda c, row: math_reward(
        c, row["answer"], row.get("latex", False), row.get("fallback", False),
        row.get("answer_line", False))},
    "logic": {"prompt": logic_prompt, "reward": lambda c, row: logic_reward(c, row["solution"])},
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
# 4. How it relates to entropy WITHIN an answer (omega is the same for all of answer i's tokens
#    when r = 1, beta = 0):
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
# 6. GMTS scores a token by H_t * |omega_t| (entropy standing in for step 3's norm, dz_norm) and
#    keeps about the top rho of each prompt's group (kept_count's drop rule; deviation 9). Our
#    ablation 'gradnorm' scores by the exact ||dL/dz|| = |omega| * dz_norm (one reduction over V).
# The temperature: p, H, log p at the rollout temperature T (the authors sample at T = 1 only);
# omega, fp32: deviations 2, 8.

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
        out = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos)
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
CHOICES["select"].extend(METHODS)

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
    # Highest first; the stable sort keeps equal scores in position order (ties to the earlier),
    # or, on the scores reversed, in reverse order (ties to the later).
    if rule == "drop":
        order = len(vals) - 1 - torch.sort(vals.flip(0), descending=True, stable=True).indices
    else:
        order = torch.sort(vals, descending=True, stable=True).indices  # (n,)
    rank = torch.arange(len(vals), device=vals.device)  # (n,): 0 for the highest of its label
    if label is not None:
        order = order[torch.sort(label[order], stable=True).indices]  # then by label
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
    need = sel_mask
    if objective.kl_beta > 0:
        need = sel_mask | valid
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
    """What start_run prepares for the loop."""
    model: torch.nn.Module  # the policy, fp32 master weights
    tok: object  # its tokenizer
    opt: torch.optim.Optimizer
    task: dict  # TASKS[cfg.task]
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
    """The policy, its optimiser, the KL reference (deviation 7) and the sampler (--sampler-dtype:
    the model or a bf16 copy). The run folder's side, in the supporting code: open_run (the folder,
    the data, the model or a resume's checkpoint), record_start (config, step 0, ckpt-000000)."""
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
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    if "opt" in state:  # a resume
        opt.load_state_dict(state["opt"])
    fast = cfg.fast_generate
    if fast is None:
        fast = device.type == "cuda"
    task = get_task(cfg.task)
    run = Run(model=model, tok=tok, opt=opt, task=task, draw=data.draw, eval_rows=data.held,
              chat=use_chat(tok, cfg.chat_template), ref=ref, sampler=model, fast=fast,
              start=state["step"] + 1, skipped=state["skipped"])
    record_start(cfg, run, data, state["resumed"], device, log)
    if cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda"):
        run.sampler = copy.deepcopy(model).eval().requires_grad_(False)
        for p in run.sampler.parameters():  # RoPE's inv_freq buffer stays fp32, as in a bf16 load
            p.data = p.data.to(torch.bfloat16)
    return run

def sample_groups(run: Run, cfg: Config, step: int, log=print) -> tuple:
    """Algorithm steps 1-4 of GRPO step `step` -> (batch, rewards (N,), adv (N,), parts), B x G:
    with --filter-groups (deviation 5) more batches until B groups are informative or --max-resample
    are drawn, joined by filter_groups; parts: each batch drawn, (batch, rewards, adv)."""
    B, G = cfg.prompts_per_step, cfg.group_size
    max_batches = 1
    if cfg.filter_groups:
        max_batches = cfg.max_resample
    parts = []
    n_informative = 0
    while len(parts) < max_batches and n_informative < B:
        # 1. B training prompts (the k-th rollout batch of a step draws with the key (step, k))
        rows = run.draw(B, step, len(parts))
        prompts = build_prompts(run.tok, run.task, rows, run.chat, cfg.short_prompt,
                                cfg.prompt_style)
        # 2. G answers per prompt, with the sampler's own log-probs (answer n answers prompt
        # n // G), by rollout() on the fast path while it works (sample_answers, supporting code)
        batch = sample_answers(run, prompts, cfg, log)
        # 3. one reward per answer from the task's verifier (the Rewards section)
        rewards = torch.tensor([float(run.task["reward"](text, rows[n // G]))
                                for n, text in enumerate(batch["texts"])])  # (N,)
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
    scope = cfg.scope
    if scope == "auto":
        scope = method.scope
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
    check_tracker(cfg.report_to)  # a missing tracker package: one line, before any work
    cfg = resolved_paths(cfg)  # absolute paths in run_config.json: any folder's resume finds them
    run = start_run(cfg, log)
    model, opt = run.model, run.opt
    mb, chunk = cfg.micro_batch, cfg.stats_chunk  # answers per forward, tokens per head call
    show = step_printer(cfg.steps, run.start, log)  # a progress bar on a terminal
    method = step_method(cfg, score_fn)
    model.train()
    for step in range(run.start, cfg.steps + 1):
        t0 = time.time()
        set_seed(cfg.seed * 1_000_003 + step)  # a step's randomness depends on (seed, step) only
        # 1-4. B prompts, G answers each, their rewards and group advantages (sample_groups)
        batch, rewards, adv, parts = sample_groups(run, cfg, step, log)
        valid = batch["resp_mask"]  # the tokens the loss may use
        if cfg.overlong_filter:  # DAPO's overlong filtering: a truncated answer trains nothing
            valid = valid & ~batch["truncated"][:, None]
        t_roll = time.time() - t0
        # 5. log pi(y_t), H_t, dz_norm (N, T) of pi_old, the fp32 policy before this update (a bf16
        # copy of it sampled under --sampler-dtype bf16); the KL reference's log-probs
        logp, entropy, dz_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
        old_logp = logp
        ref_logp = None
        if run.ref is not None:
            ref_logp = response_logp(run.ref, batch, valid, cfg.temperature, mb, chunk)
        # the loss's settings; 'selected' divides by scope_budget's count, the one the mask keeps
        rho, group_size = selection_rule(cfg, method)
        n_kept = int(scope_budget(valid, rho, group_size)[1].sum())
        weights = loss_weights(cfg.loss_norm, valid, n_kept, cfg.group_size)  # w, D, D_kl
        objective = Objective(cfg.clip_low, cfg.clip_high, cfg.kl_beta, cfg.temperature, **weights)
        for inner in range(cfg.inner_updates):
            if inner > 0:  # the policy has moved: its statistics again
                logp, entropy, dz_norm = batch_token_stats(model, batch, cfg.temperature, mb, chunk)
            # 6. omega (-dL/dlogp of the loss: derivation step 1), scores, the top rho of each
            # prompt's group (--scope group: GMTS's authors) or of the whole batch (deviation 1);
            # rsi: an interval of its score instead
            ref_ratio = None if ref_logp is None else torch.exp(ref_logp - logp)
            ratio = torch.exp(logp - old_logp)  # (N, T)
            om = omega(adv, ratio, cfg.clip_low, cfg.clip_high, cfg.kl_beta, ref_ratio,
                       **weights)  # (N, T)
            sel_mask = step_selection(cfg, logp, entropy, dz_norm, om, valid, method)  # (N, T)
            # 7. PPO-clip update on the kept tokens; one lr schedule and one step rule for all
            for group in opt.param_groups:
                group["lr"] = step_lr(cfg, step, inner)
            stats = policy_update(model, opt, batch, adv, sel_mask, old_logp, objective,
                                  micro_batch=mb, chunk=chunk, max_grad_norm=cfg.max_grad_norm,
                                  ref_logp=ref_logp, valid=valid)
            run.skipped += stats["skipped"]
        refresh_sampler(run.sampler, model)
        check_weights(model, batch, step, cfg.out)  # non-finite weights: stop before a checkpoint
        # 8. log, evaluate, checkpoint
        rec = step_record(step, cfg, parts, batch, valid, rewards, adv, old_logp, entropy, sel_mask,
                          stats, opt, run.skipped, t0, t_roll)
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.steps:
            rec.update(evaluate_run(model, run, cfg))
        log_metrics(os.path.join(cfg.out, "metrics.jsonl"), rec)
        run.report(rec)
        show(step_line(rec), "eval_acc" in rec)
        if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.steps:
            save_checkpoint(cfg.out, step, model, run.tok, opt, run.skipped)
    show(None, False)
    run.report(None)
    plot_metrics(cfg.out)
    save_final(cfg.out, model, run.tok)  # last: its config.json marks the run finished
    log(f"done: {cfg.out} (metrics.jsonl, metrics.png, the model)")
    return cfg.out

# Supporting code [plumbing]: what lets the method above run; a reader of the paper may stop here. ###################

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

# ==== Problem generators and data loaders [plumbing] ==============================================
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
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [z]
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
    """Worked steps 'x op y = z' of a template's program over `values` (which gains s1, s2, ...)."""
    steps = []
    for i, step in enumerate(program.split(), 1):
        x, op, y = re.split(r"([-+*/])", step)
        x = int(values.get(x, x))
        y = int(values.get(y, y))
        z = _OPS[op](Fraction(x), y)
        if z < 0 or z.denominator != 1:
            return None
        values[f"s{i}"] = int(z)
        steps.append(f"{x} {op} {y} = {int(z)}")
    return steps

def math_problem(rng: random.Random, n_steps=(2, 4)) -> dict:
    """A problem from a template with n_steps steps: question, worked steps and integer answer."""
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
        worlds = [w for w in itertools.product([True, False], repeat=n)
                  if all(_holds(c, w) == w[i] for i, c in enumerate(claims))]
        if len(worlds) == 1:  # exactly one consistent assignment
            said = [_say(c, names, i) for i, c in enumerate(claims)]
            statements = [f'{who} says: "{x[0].upper() + x[1:]}."' for who, x in zip(names, said)]
            return {"names": names, "statements": statements, "solution": dict(zip(names, worlds[0]))}
    raise ValueError(f"no knights-and-knaves puzzle with a unique solution for {n_people} people")

def _easy_countdown(rng: random.Random) -> dict:
    """The CPU demo's variant: 3 numbers in 1..9, in order, joined by + or -, the four sign patterns
    equally likely (numbers redrawn until the target is >= 0): a sign guess is right 1 time in 4."""
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
# A verdict is True / False, or None when none came back (the worker timed out, died or stalled,
# or the wait was interrupted): latex_equal counts it, math_reward grades it 0.0, check_grades
# stops the run past GRADE_UNKNOWN_MAX. A gold with no verdict at load, or a worker that does not
# start, is a RunError (exit 1), never the bad-row message: no model output can cause either.
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
    reuses one warm worker); the verdicts given (pure in gold and got: avg@16's answers repeat), the
    count that did not come back, the last one's cause, "logged": the count at the last record."""
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
    workers, asked twice (a fresh worker the second time); got None: whether sympy reads gold (at
    load). A hung worker (\\boxed{9^{9^{9^{9}}}}) is killed after timeout (VERIFY_TIMEOUT_S) s."""
    verdicts = _VERIFIER["verdicts"]
    if (gold, got) in verdicts:
        return verdicts[gold, got]
    slot = _VERIFIER["free"].get()  # blocks while every worker grades
    try:
        for _ in range(2):
            if slot["proc"] is None or slot["proc"].poll() is not None:
                slot["proc"] = _start_verifier()
            said = _ask(slot["proc"], gold, got, timeout or VERIFY_TIMEOUT_S)
            if not isinstance(said, str):
                if len(verdicts) >= VERDICTS_KEPT:
                    verdicts.clear()
                verdicts[gold, got] = said
                return said
    finally:
        _VERIFIER["free"].put(slot)
    if got is None:
        raise RunError(f"the math-verify worker gave no verdict on the gold {gold[:60]!r}, "
                       f"twice (a fresh worker the second time): {said}")
    with _VERIFIER["lock"]:
        _VERIFIER["cause"] = said
        _VERIFIER["unknown"] += 1
    return None

def stop_verifiers():
    """Kill every idle worker (the next grade starts a fresh one)."""
    for slot in _VERIFIER["slots"]:
        if slot["proc"] is not None:
            _kill(slot["proc"])
            slot["proc"] = None

def unknown_since_logged() -> int:
    """The verdicts that did not come back since the last call (each metrics record its own)."""
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

# -- the forms of an answer math-verify reads (math_reward's); a gold none can match (_broken) --
_LETTER = re.compile(r"\\(?:text|mbox|mathrm)\{ *([A-Za-z]) *\}")  # \mathrm{i}: the letter i
_UNIT = re.compile(  # 7\text{ hours}, 5\mathrm{cm}^2
    r"\\(?:text|mbox|mathrm)\{ *([A-Za-z][A-Za-z ]*)\}(?:\^\{?([23])\}?)?")
_GAPS = ("\\,", "\\;", "\\:", "\\!", "\\quad", "\\qquad", "~")  # spacing before a unit (and "\ ")
_MAGNITUDE = {"hundred": 2, "thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_UNIT_ALIAS = {"centimeter": "cm", "centimetre": "cm", "millimeter": "mm", "millimetre": "mm",
               "meter": "m", "metre": "m", "kilometer": "km", "kilometre": "km", "inch": "in",
               "foot": "ft", "feet": "ft", "hour": "h", "hr": "h", "minute": "min", "second": "s",
               "sec": "s", "degree": "deg"}
_POWER_ARG = re.compile(  # \sin^2 t
    r"(\\(?:sin|cos|tan|sec|csc|cot)\^(?:[0-9]|\{[0-9]+\}))\s*([A-Za-z])(?![A-Za-z])")
_SPACED_OP = re.compile(r"\s*([-+=])\s*")  # math-verify 0.9 reads 'a + b + c' as 'a +'

def _unit_forms(word: str) -> set:
    """A unit word's spellings: itself and its singulars (-s, -es), each through _UNIT_ALIAS."""
    forms = {word, word[:-1] if len(word) > 2 and word.endswith("s") else "",
             word[:-2] if len(word) > 3 and word.endswith("es") else ""} - {""}
    return {_UNIT_ALIAS.get(f, f) for f in forms}

def same_unit(a: str, b: str) -> bool:
    """value_unit's units are one unit: the same words, the last one's spellings (cm,
    centimeters, centimetre; hour, hrs) shared, the same power."""
    (a, pa), (b, pb) = a.partition("^")[::2], b.partition("^")[::2]
    (*a, last_a), (*b, last_b) = a.split() or [""], b.split() or [""]
    return a == b and pa == pb and bool(_unit_forms(last_a) & _unit_forms(last_b))

def value_unit(s: str) -> tuple:
    """A LaTeX answer -> (its value, its unit: the lower-case words of a trailing \\text{..},
    \\mbox{..} or \\mathrm{..} after a value, with a power ^2 ^3 after them, or ""). Spacing before
    the unit (5\\,\\text{cm}) goes with it; a magnitude word (10\\text{ thousand}) multiplies the
    value; a one-letter \\text{} (\\mathrm{i}, \\mathrm{e}, \\text{ m}) is the letter, in the value
    (at the end also the unit)."""
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) > len(a + b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):-len(b)].strip()
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s.rstrip(".,; ")).rstrip(".,; ")
    i = max(s.rfind("\\text{"), s.rfind("\\mbox{"), s.rfind("\\mathrm{"))
    m = _UNIT.fullmatch(s, i) if i > 0 else None
    value, cut = _LETTER.sub(r"\1", s[:i]) if m else "", True
    while cut:  # the spacing before the unit, from the right
        value = value.rstrip()
        if value.endswith("\\") and not value.endswith("\\\\"):  # "\ " (its space just went)
            value = value[:-1]
        gap = next((g for g in _GAPS if value.endswith(g)), "")
        value, cut = value[:len(value) - len(gap)], gap != ""
    if not value or not (value[-1] in "0123456789})]%" or value[-1].isalpha()):
        return _LETTER.sub(r"\1", s).rstrip(".,; "), ""  # no value before it: all of it is text
    words, power = m[1].lower().split(), f"^{m[2]}" if m[2] else ""
    if len(m[1].strip()) == 1:  # a letter: never dropped from the value
        letter = m[1].strip() + (f"^{{{m[2]}}}" if m[2] else "")
        return value + " " * value[-1].isalpha() + letter, words[0] + power
    if words[0].removesuffix("s") in _MAGNITUDE:  # never dropped: part of the value
        k = _MAGNITUDE[words.pop(0).removesuffix("s")]
        n = parse_number(value)
        top, bottom = (0, 0) if n is None else (n * 10 ** k).as_integer_ratio()
        value = (f"{value}\\times10^{{{k}}}" if n is None else
                 str(top) if bottom == 1 else f"\\frac{{{top}}}{{{bottom}}}")
    return value, " ".join(words) + power * bool(words)

def normal_answer(s: str) -> str:
    """A LaTeX answer's value (value_unit's) as math-verify reads it: no $...$ around it, no
    trailing . , ; no degree sign, no spaces around + - =, \\sin^2 t as \\sin^{2}(t)
    (math-verify 0.9 misreads each of them)."""
    s = value_unit(s)[0]
    s = _POWER_ARG.sub(lambda m: f"{m[1]}({m[2]})", s)
    return _SPACED_OP.sub(r"\1", s)

def bare_answer(s: str) -> str:
    """The fallback's form (the rule: these strings equal) of an answer math-verify cannot read."""
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", normal_answer(s))
    for a, b in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                 ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", "")):
        s = s.replace(a, b)
    return "".join(s.split())

def _broken(gold: str) -> bool:
    """A LaTeX gold no answer can match: empty, braces unbalanced, ending in ^ _ or a backslash."""
    depth = 0
    for c in gold.replace("\\{", "").replace("\\}", ""):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth < 0:
            return True
    return depth != 0 or normal_answer(gold)[-1:] in "^_\\"  # "" (empty) is in it too

# ==== Data files [plumbing]: gen, easy, hf, hf:test, hf:ID[:CONFIG][:SPLIT], a file, as it is =====
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
             "answer": ("a finite number, a GSM8K solution ending in '#### N' or a LaTeX answer "
                        "(<= 1,000 characters, braces balanced, no ^ _ \\ at its end)",
                        lambda v: type(v) in (str, int, float))},
    "logic": {"names": ("a list of strings", _list_of(str)), "statements": ("a list of strings", _list_of(str)),
              "solution": ("an object {name: true/false}", lambda v: isinstance(v, dict)
                           and all(type(x) is bool for x in v.values()))},
}

# The math layouts' (question, answer) columns: a.b: b in a (a list: its first item; a chat: its
# last turn); an answer column a\\boxed: the last \\boxed{} of a's text (a worked solution) is gold
LAYOUTS = {"ours, GSM8K": ("question", "answer"),
           "MATH-500, math12k, Minerva": ("problem", "answer"),
           "AIME 2024 CSV": ("Question", "Answer"), "OlympiadBench": ("question", "final_answer"),
           "DAPO-Math-17k": ("prompt", "reward_model.ground_truth"),
           "MATH (Hendrycks), Qwen2.5-Math's minerva_math": ("problem", "solution\\boxed")}
LINE_CAP = 1 << 20  # bytes per line of a --data file
MATH_EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata",
                            "math_train_layout.jsonl")  # offline hint: a file in MATH's layout
_OWN_ANSWER = re.compile(r'(?:form|after) "?Answer:')  # DAPO's: a last line 'Answer: N'

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

def _cell(row: dict, key: str):
    for k in key.split("."):
        row = row.get(k) if isinstance(row, dict) else None
    return row

def _math_layout(row: dict, columns: str = "") -> dict:
    """{question, answer} of a math row in --data-columns' layout (only that one) or the first of
    LAYOUTS it has. The layout never decides the grading rule (_check_row does)."""
    layouts = [tuple(columns.split(","))] if columns else list(LAYOUTS.values())
    for q, a in layouts:
        question, answer = _cell(row, q), _cell(row, a.removesuffix("\\boxed"))
        if isinstance(question, list) and question and isinstance(question[-1], dict):
            question = question[-1].get("content")
        if isinstance(answer, list) and answer:
            answer = answer[0]
        if a.endswith("\\boxed") and isinstance(answer, str) and question is not None:
            answer = _last_boxed(answer, tries=1, cap=2000)
            if answer is None:
                raise ValueError(f'"{a[:-6]}" has no closed \\boxed{{}} to take the answer from')
        if question is not None and answer is not None:
            return {"question": question, "answer": answer}
    if columns:
        missing = next(k for k in layouts[0] if _cell(row, k.removesuffix("\\boxed")) is None)
        raise ValueError(f'--data-columns {columns}: the row has no column "{missing}"')
    if any(_cell(row, q) is not None for q, _ in layouts):
        answers = [a.replace("\\boxed", " (its last \\boxed{})") for _, a in layouts]
        looked = ", ".join(dict.fromkeys(answers))
        raise ValueError(f'missing key "answer" (looked for the answer in: {looked})')
    looked = ", ".join(dict.fromkeys(q for q, _ in layouts))
    raise ValueError(f'missing key "question" (looked for: {looked}; or use --data-columns)')

def _finite(gold: str) -> bool:
    try:
        return math.isfinite(float(gold))
    except ValueError:  # no float literal: LaTeX
        return True

def _check_row(row, task: str, columns: str = "") -> dict:
    """A row as read -> the row the task trains on: math: GSM8K's ('... #### N') or "latex" (every
    other gold: graded by the last \\boxed{}; "answer_line" where the question asks for a last line
    'Answer: N'; "fallback" where math-verify cannot read the gold). Any problem raises (ValueError,
    RecursionError, ...): the reader's net (_checked) names the file and line, or set and row."""
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
    if "####" in str(row["answer"]) and parse_number(gsm8k["answer"]) is not None:
        return gsm8k
    gold = str(row["answer"]).strip()  # Minerva's end in a newline
    refused = ValueError(f'"answer" must be {_SCHEMA["math"]["answer"][0]}, got {gold[:40]!r}')
    if not _finite(gold) or len(gold) > 1000:  # NaN, Infinity: sympy would read "nan" as n*a*n
        raise refused
    out = {"question": row["question"], "answer": gold, "latex": True}
    if _OWN_ANSWER.search(row["question"]):
        out["answer_line"] = True
    if parse_number(gold) is None and not latex_equal(normal_answer(gold)):
        if _broken(gold):
            raise refused
        out["fallback"] = True
    return out

_WHY = {RecursionError: "JSON nested too deep", UnicodeDecodeError: "cannot read it as UTF-8",  # error -> words
        UnicodeEncodeError: "holds a lone surrogate (no tokenizer reads it)", json.JSONDecodeError: "invalid JSON"}

def _checked(items, data: str, task: str, columns: str = "", skip: list = None) -> tuple:
    """items: (WHERE, a function giving the row as read, None for no row) -> (rows, their WHEREs),
    each checked (_check_row); the bad ones, "WHERE: why", in one ValueError or added to skip."""
    rows, where, bad = [], [], []
    for at, read in items:
        try:
            row = read()
            if row is not None:
                rows.append(_check_row(row, task, columns))
                where.append(at)
        except (ValueError, RecursionError, TypeError) as e:
            bad.append(f"{at}: {_WHY.get(type(e)) or error_line(e, 200)}")
        except OSError as e:  # not the data's (it was read): the grader's, exit 1
            raise RunError(error_line(e)) from None
    if skip is not None:
        skip.extend(bad)
    elif bad:
        more = f"; and {len(bad) - 20} more bad rows" if len(bad) > 20 else ""
        raise ValueError("; ".join(bad[:20]) + more)
    if not rows:
        raise ValueError(f"{data}: no rows")
    return rows, where

def _json_row(raw: bytes):
    if len(raw) > LINE_CAP:
        raise ValueError(f"longer than {LINE_CAP} bytes")
    line = raw.decode("utf-8")
    return json.loads(line) if line.strip() else None  # a blank line is no row

def _read_jsonl(path: str, task: str, columns: str = "", skip: list = None) -> tuple:
    """(rows, "PATH line N" each, bytes_print) of a data file split on "\n" only (a raw U+2028 in a
    string is no break)."""
    try:
        data_print = bytes_print(path)
        with open(path, "rb") as f:
            raws = list(iter(lambda: f.readline(LINE_CAP + 1), b""))
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or error_line(e, 200)})") from None
    items = ((f"{path} line {i}", functools.partial(_json_row, raw))
             for i, raw in enumerate(raws, 1))
    return (*_checked(items, path, task, columns, skip), data_print)

def bytes_print(path: str) -> dict:
    """The size and sha256 of a data file's bytes, or of a dataset folder's regular files (each
    one's relative path and bytes, sorted): what a resume compares, whatever the format."""
    files = [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
    digest = hashlib.sha256()
    size = 0
    for name in files:
        if name != path and not os.path.isfile(name):  # a FIFO would never end
            continue
        if name != path:
            digest.update(os.path.relpath(name, path).encode("utf-8", "surrogateescape") + b"\0")
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}

def _cell_cap(row, depth: int = 0):
    """The row read through `datasets`, or ValueError if a string cell of it is longer than
    LINE_CAP characters (a JSONL line's cap): no cell that long reaches a tokenizer."""
    if isinstance(row, str) and len(row) > LINE_CAP:
        raise ValueError(f"a cell is longer than {LINE_CAP} characters")
    if isinstance(row, (dict, list)) and depth <= 100:
        for cell in (row.values() if isinstance(row, dict) else row):
            _cell_cap(cell, depth + 1)
    return row

_ENV_ERRNO = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

def _env_fault(e):
    """e's OSError that is the machine's fault (a full disk, a folder it cannot write), or None."""
    for _ in range(20):  # datasets wraps a writer's error in its own
        if isinstance(e, OSError) and e.errno in _ENV_ERRNO:
            return e
        e = e and (e.__cause__ or e.__context__)
    return None

def _read_set(data: str, task: str, columns: str = "", skip: list = None) -> tuple:
    """(rows, "DATA row N" each, a fingerprint) of hf:ID[:CONFIG][:SPLIT] or a .json, .csv or
    .parquet file, read through `datasets`. A local one: bytes_print, read into a fresh cache folder
    (datasets' own hands back the old rows of a file edited back to its old mtime); a hub set: the
    sha256 of its rows. Memory, a full or read-only cache: exit 1; a bad file or row: ValueError."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{data}: needs datasets (pip install -r requirements.txt)") from None
    logging.getLogger("datasets").setLevel(logging.CRITICAL)  # its failures: our one line
    kind = data_kind(data)
    name, *rest = data.split(":")[1:] if kind == "hf" else [data]
    local = os.path.exists(name)
    try:
        data_print = bytes_print(name) if local else None
    except OSError as e:
        raise ValueError(f"{data}: cannot read it ({e.strerror or error_line(e, 200)})") from None
    cache = datasets.config.HF_DATASETS_CACHE
    tmp = None
    try:
        if local:
            os.makedirs(cache, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix="gmts-data-", dir=cache)
    except OSError as e:
        raise OSError(f"cannot write the datasets cache folder {cache} ({e.strerror}); set "
                      "HF_DATASETS_CACHE to a folder that can be written") from None
    try:
        try:
            fresh = {"cache_dir": tmp} if tmp else {}
            if kind == "hf":
                split = (rest or ["train"])[-1]
                ds = datasets.load_dataset(name, *rest[:-1], split=split, **fresh)
            else:  # its builders, by the file's extension
                fmt = os.path.splitext(data)[1][1:]
                ds = datasets.load_dataset(fmt, data_files=data, split="train", **fresh)
        except Exception as e:  # no network, no such set, split or file, a file it cannot parse
            fault = _env_fault(e)
            if memory_fault(e):
                raise
            if fault:
                raise OSError(f"{data}: cannot write the datasets cache {tmp or cache} "
                              f"({fault.strerror}); free space or set HF_DATASETS_CACHE to a "
                              "folder that can be written") from None
            if kind == "file":
                raise ValueError(f"{data}: cannot read it ({error_line(e)})") from None
            why = f"could not load {data} from the hub (no network?): {error_line(e)}"
            hint = "use --data gen"  # countdown's and GSM8K's sets: the generator stands in for them
            if task == "math" and "gsm8k" not in data:
                hint = f"use files in a MATH layout (--data {MATH_EXAMPLE}, --eval-data NAME=FILE)"
            raise ValueError(f"{why}; {hint}") from None
        items = ((f"{data} row {i}", functools.partial(_cell_cap, row))
                 for i, row in enumerate(ds, 1))
        rows, where = _checked(items, data, task, columns, skip)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    data_print = data_print or {"sha256": hashlib.sha256(json.dumps(rows).encode()).hexdigest()}
    return rows, where, data_print

def load_rows(task: str, data="gen", n=1000, seed=0, named=False, columns="", skip: list = None):
    """gen/easy: n fresh problems from random.Random(seed). hf, hf:test: the task's own hub set,
    shuffled by seed. Any other set or file: its rows in order. n <= 0 or None (not gen): all rows.
    named=True -> (rows, each one's name in messages, a file's fingerprint), or None each."""
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
    elif kind == "file" and not os.path.isfile(data):  # a folder, a FIFO, /dev/zero: never rows
        raise ValueError(f"{data}: cannot read it (not a regular file); --data takes gen, easy, "
                         "hf or a data file")
    elif kind == "hf" or os.path.splitext(data)[1] in (".json", ".csv", ".parquet"):
        rows, where, data_print = _read_set(data, task, columns, skip)
    else:
        rows, where, data_print = _read_jsonl(data, task, columns, skip)
    if n and n > 0:
        rows = rows[:n]
    return (rows, where, data_print) if named else rows

for _name, _task in TASKS.items():  # each task's loader: TASKS[name]["load"](data, n, seed)
    _task["load"] = functools.partial(load_rows, _name)

def get_task(name: str) -> dict:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]

@dataclass
class Data:
    """What read_data read: the rows a run trains on and what the checks before step 0 need."""
    draw: object  # draw(n, *key) -> n training rows
    held: object  # the held-out rows, or --eval-data's {name: rows}
    rows: list  # checked before step 0: a file's or set's rows (else the held-out ones), benchmarks'
    where: list  # each one's name in messages: "FILE line N", "held-out row N"
    fingerprint: dict  # a data file's size and sha256, of the bytes read (else None): what a resume checks
    longest: int = 0  # the longest prompt of `rows`, in tokens (check_prompts)
    bench: dict = None  # --eval-data's fingerprints by name (a hub set's: of its rows)
    order: dict = None  # --data-order epoch: {"drawn": rows drawn so far}, which a resume sets
    skipped: list = None  # --skip-bad-rows: the bad rows of --data left out, "WHERE: why"

def read_data(cfg: Config) -> Data:
    """The FIRST eval_size rows of the data are held out (none with --eval-data: its sets are
    evaluated instead). draw(n, *key) -> n training rows, never a held-out or benchmark prompt;
    --data-order epoch: the next n rows of seeded passes over them, each a shuffle."""
    task = get_task(cfg.task)
    gen = data_kind(cfg.data) == "gen"
    n_held = 0 if cfg.eval_data else cfg.eval_size
    skipped = [] if cfg.skip_bad_rows else None
    rows, where, data_print = load_rows(cfg.task, cfg.data, n_held if gen else 0, cfg.seed, True,
                                        cfg.data_columns, skipped)
    held = rows[:n_held]
    checked = rows
    if where is None:  # generated or hub rows: the held-out ones stand for all
        checked = held
        where = [f"held-out row {i} of --data {cfg.data}" for i in range(len(held))]
    bench = {}
    prints = {}
    for name, spec in eval_sets(cfg.eval_data):
        bench[name], named, prints[name] = load_rows(cfg.task, spec, 0, cfg.seed, True,
                                                     cfg.data_columns)
        checked = checked + bench[name]
        where = where + (named or [f"row {i} of --eval-data {name}" for i in range(len(bench[name]))])
    seen = {task["prompt"](r) for r in held + sum(bench.values(), [])}
    held = bench or held
    pool = [r for r in rows[n_held:] if task["prompt"](r) not in seen]
    if not gen and not pool:
        raise ValueError(f"--data {cfg.data}: no training rows left after the {len(held)} held-out and benchmark ones "
                         f"({len(rows)} rows, --eval-size {cfg.eval_size})")

    order = {"drawn": 0}

    @functools.lru_cache(maxsize=2)
    def epoch(e: int) -> list:  # the e-th pass's order of the pool
        return random.Random(str((cfg.seed, "epoch", e))).sample(range(len(pool)), len(pool))

    def draw(n: int, *key) -> list:
        if cfg.data_order == "epoch":  # the next n rows of the passes; never gen (check_config)
            first = order["drawn"]
            order["drawn"] += n
            return [pool[epoch(i // len(pool))[i % len(pool)]] for i in range(first, first + n)]
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
    return Data(draw=draw, held=held, rows=checked, where=where, fingerprint=data_print,
                bench=prints, order=order, skipped=skipped)

def eval_sets(spec: str) -> list:
    """--eval-data 'NAME=DATA,...' -> [(NAME, DATA), ...]; ValueError for a malformed entry."""
    pairs = [part.partition("=")[::2] for part in spec.split(",") if part]
    if not all(re.fullmatch(r"[\w.-]+", name) and name not in ("acc", "len", "sample") and d for name, d in pairs):
        raise ValueError(f"--eval-data {spec}: entries NAME=DATA, NAME of letters, digits, _ . - but acc, len, sample")
    names = [name for name, _ in pairs]
    for name, d in pairs:
        if names.count(name) > 1:
            raise ValueError(f"--eval-data {spec}: {name} is named twice (a benchmark per name)")
        if data_kind(d) == "gen":
            raise ValueError(f"--eval-data {name}={d}: a benchmark is a data file or set; for "
                             "generated held-out rows leave --eval-data out (--eval-size)")
    return pairs

# -- prompts (algorithm step 1): --prompt-style's frame around a task's question (TASKS) --
ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"  # TinyZero's prefill
SYSTEM_PROMPT = ("You are a helpful assistant. You first think about the reasoning process and "
                 "then answer.")
# GMTS Framework1's system prompt; Framework2's request, after the question and a space
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
BOXED_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."

# --prompt-style -> (its system line or None, the assistant's prefill, a suffix to the question)
PROMPT_STYLES = {
    "ours": (SYSTEM_PROMPT, ASSISTANT_PREFIX, ""),
    "qwen-math": (QWEN_MATH_SYSTEM, "", ""),
    "boxed-suffix": (None, "", " " + BOXED_SUFFIX),
    "own": (None, "", ""),  # in every style, a row that asks for its answer itself (DAPO's)
}

def render_prompt(tok, question: str, chat: bool, system: bool = True, style: str = "ours") -> str:
    """The text the model continues: the question in the chat template or a plain User/Assistant
    frame, ending inside the assistant's <think> (\\boxed{} styles: an empty turn)."""
    head, prefix, suffix = PROMPT_STYLES[style]
    question = question + suffix
    system = system and head is not None
    if not chat:
        frame = f"User: {question}\nAssistant: {prefix}".rstrip(" ")
        return (head + "\n" if system else "") + frame
    msgs = [{"role": "system", "content": head}] if system else []
    msgs.append({"role": "user", "content": question})
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + prefix

def build_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False,
                  style: str = "ours") -> list:
    """Prompt strings for task rows in a prompt style; short=True: terse questions, no system
    line. "ours" asks task["prompt"] for the question, the \\boxed{} styles take the row's; a row
    that says where its answer goes (DAPO's "Answer:" line) takes style "own": nothing added."""
    prompts = []
    for r in rows:
        own = "own" if r.get("answer_line") else style
        question = task["prompt"](r, short=short) if own == "ours" else r["question"]
        prompts.append(render_prompt(tok, question, chat, not short, own))
    return prompts

def check_prompts(cfg: Config, model, tok, data: Data, chunk: int = 1024):
    """ValueError naming the first row whose prompt does not render or, with its answer, passes the
    model's positions, or every row past --max-prompt-tokens (refused, never cut; data.longest: the
    plan's P): every row read, before step 0 (at step 1 it fails every resume again), in chunks."""
    long = []  # the rows past --max-prompt-tokens, all named in one line
    limit = getattr(model.config, "max_position_embeddings", None) or 0
    for i in range(0, len(data.rows), chunk):
        prompts = checked_prompts(tok, get_task(cfg.task), data.rows[i:i + chunk],
                                  use_chat(tok, cfg.chat_template), cfg.short_prompt,
                                  cfg.prompt_style)
        for where, prompt in zip(data.where[i:i + chunk], prompts):  # a long one: its head first
            cut = prompt.rfind(" ", 0, 8 * limit)  # at a space: the head's tokens <= the whole's
            if len(prompt) > 8 * limit and cut > 0:
                head = len(tok(prompt[:cut], add_special_tokens=False)["input_ids"])
                what = f"{where}: its first {cut} characters make a"
                check_positions(model, head, cfg.max_new_tokens, what)
        for where, ids in zip(data.where[i:i + chunk], tok(prompts, add_special_tokens=False)["input_ids"]):
            check_positions(model, len(ids), cfg.max_new_tokens, f"{where}: its")
            data.longest = max(data.longest, len(ids))
            if 0 < cfg.max_prompt_tokens < len(ids):
                long.append(f"{where} ({len(ids)})")
    if long:
        more = f" and {len(long) - 20} more" if len(long) > 20 else ""
        raise ValueError(f"{len(long)} prompts have more tokens than --max-prompt-tokens "
                         f"{cfg.max_prompt_tokens}: {', '.join(long[:20])}{more}; raise it or "
                         "drop them")

def checked_prompts(tok, task: dict, rows: list, chat: bool, short: bool = False,
                    style: str = "ours") -> list:
    """build_prompts, where a chat template that fails on them (a role it refuses, bad syntax) is one ValueError."""
    try:
        return build_prompts(tok, task, rows, chat, short, style)
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
            why = "no hub access, a misspelled name or bad files"
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                why = "no hub access (HF_HUB_OFFLINE=1)"
            if os.path.isdir(path):  # a local folder: its files, whatever the hub
                why = "its files are missing or damaged"
            raise OSError(f"cannot load model '{path}': {why}: {error_line(e, 200)}; "
                          f"try --model tiny for an offline run") from None
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
    """Chat template for instruct models, plain text for base models. Qwen ships a template with
    both; only instruct tokenizers end a turn with eos = <|im_end|>, so auto = both."""
    if chat != "auto":
        return chat == "yes"
    return bool(getattr(tok, "chat_template", None)) and tok.eos_token == "<|im_end|>"

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
    """One per-answer entry `key` of several rollout batches, joined along the answers as above."""
    if isinstance(xs[0], list):
        return [x for part in xs for x in part]
    if xs[0].dim() == 1:
        return torch.cat(xs)
    fill = pad_id if key in PAD_ID_FILLED else 0
    side = "left" if key in LEFT_PADDED else "right"
    rows = [row for x in xs for row in x]  # each answer's (W,) row
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill, padding_side=side)

def prompts_per_call(cfg: Config, n: int) -> int:
    """Prompts per generate() call of n: all n, or max(R // G, 1) under --rollout-rows R."""
    return min(n, max(cfg.rollout_rows // cfg.group_size, 1)) if cfg.rollout_rows else n

def sample_answers(run, prompts: list, cfg: Config, log=print) -> dict:
    """Algorithm step 2: G answers per prompt, prompts_per_call at a time, joined by _join_rows."""
    per = prompts_per_call(cfg, len(prompts))
    parts = [_sample_call(run, prompts[i:i + per], cfg, log) for i in range(0, len(prompts), per)]
    return {key: _join_rows([p[key] for p in parts], key, run.tok.pad_token_id) for key in parts[0]}

def _sample_call(run, prompts: list, cfg: Config, log=print) -> dict:
    """rollout() on run.sampler with its log-probs, fast until a failure clears run.fast."""
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
             samples: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             style: str = "ours") -> dict:
    """Accuracy (the share of answers with reward 1.0; samples = k: avg@k at temperature, top_p), length, a sample."""
    k = max(samples, 1)
    per = max(batch_size // k, 1)  # problems per rollout
    correct, length, sample = 0, 0, ""
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        prompts = build_prompts(tok, task, chunk, chat, short, style)
        b = rollout(model, tok, prompts, k, max_new_tokens, temperature, top_p, greedy=samples == 0)
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
                     batch_size=cfg.rollout_rows or 64, samples=cfg.eval_samples,
                     temperature=cfg.temperature, top_p=cfg.top_p, style=cfg.prompt_style)
                 for rows in sets.values()]
    means = {key: sum(rec[key] for rec in recs) / len(recs) for key in ("eval_acc", "eval_len")}
    graded = sum(map(len, sets.values())) * max(cfg.eval_samples, 1)
    return dict({f"eval_{name}": rec["eval_acc"] for name, rec in zip(sets, recs)}, **means,
                eval_sample=recs[0]["eval_sample"],
                **check_grades("eval_grade_unknown", graded, "the evaluation", cfg))

# ==== The paper's setting [plumbing]: the memory plan of a step ==============================
def memory_plan(cfg: Config, model, prompt_tokens: int, device: torch.device) -> dict:
    """{part: GiB} of a step's peak (NOTES, "The memory plan"): what stays and the largest of
    memory_phases' phases; {} when the config lacks a size (the plan is unknown)."""
    stay, phases = memory_phases(cfg, model, prompt_tokens, device)
    if not stay:
        return {}
    plan = dict(stay, **max(phases.values(), key=lambda part: sum(part.values())))
    return {part: size / 2**30 for part, size in plan.items() if size}

def memory_phases(cfg: Config, model, prompt_tokens: int, device: torch.device) -> tuple:
    """(stay, {phase: {part: bytes}}) from the config's sizes: what stays and each phase's own.
    bench_gmts.py section g checks the CPU phases against measured peaks."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    V = getattr(c, "vocab_size", None)
    if not all(isinstance(x, int) and x > 0 for x in (d, layers, heads, V)):
        return {}, {}
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or d // heads
    d_ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    n = sum(p.numel() for p in model.parameters())
    act = 2 if device.type == "cuda" else 4  # bytes of an activation: bf16 autocast on CUDA
    width = prompt_tokens + cfg.max_new_tokens  # P + T
    kv = 2 * layers * kv_heads * head_dim * act  # K and V of one token
    cpu = device.type != "cuda"  # CPU attention holds (W, W) scores per head; CUDA's kernels do not

    def forward(w: int) -> int:  # a no-grad forward's widest moment per token, attending to w
        return act * (2 * d + 3 * d_ff + heads * w * cpu)
    layer = act * (9 * d + 4 * d_ff + heads * width * cpu)  # kept per token and layer for backward
    kept = layer * layers + forward(width)  # and backward's own temporaries, one layer at a time
    if cfg.grad_ckpt:  # every layer's input, and one layer's activations at a time
        kept = act * d * layers + layer + forward(width)
    bf16 = cfg.sampler_dtype == "bf16" or (cfg.sampler_dtype == "auto" and device.type == "cuda")
    stay = {"weights": 4 * n, "AdamW": 8 * n, "sampler copy": 2 * n * bf16,
            "KL reference": 4 * n * (cfg.kl_beta > 0)}
    G, mb = cfg.group_size, cfg.micro_batch
    rows = prompts_per_call(cfg, cfg.prompts_per_step) * G  # answers per generate() call
    k = max(cfg.eval_samples, 1)
    evals = max((cfg.rollout_rows or 64) // k, 1) * k  # evaluate's rollout
    chunk = min(cfg.stats_chunk, mb * cfg.max_new_tokens)  # head rows at once: at most the tokens
    prefill = "prefill" if forward(prompt_tokens) * prompt_tokens > 12 * V else "sampling logits"
    sampled = max(forward(prompt_tokens) * prompt_tokens, 12 * V)  # decoding: 3 (rows, V) fp32
    phases = {"sampling": {"KV cache": kv * rows * width, prefill: rows * sampled},
              "statistics": {"statistics forward": forward(width) * mb * width,
                             "statistics logits": 16 * chunk * V},
              "update": {"gradients": 4 * n, "activations": kept * mb * width,
                         "loss head": 16 * chunk * V},
              "AdamW step": {"gradients": 4 * n, "AdamW step": 4 * n},  # foreach sqrt(v)
              "evaluation": {"eval KV cache": kv * evals * width,
                             "eval " + prefill: evals * sampled}}
    return stay, phases

def memory_line(cfg: Config, model, prompt_tokens: int, device: torch.device, have: float = None) -> str:
    """memory_plan in one line, against the device's memory (a CPU's: the machine's); beyond
    it, the first that fits of MEMORY_FIXES and --rollout-rows halved (alone, then with them)."""
    if have is None and device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory / 2**30
    if have is None:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    plan = memory_plan(cfg, model, prompt_tokens, device)
    if not plan:
        return (f"memory plan: unknown for this architecture ({type(model.config).__name__} "
                "names no hidden size, layer count, head count or vocabulary size)")
    line = "memory plan (GiB): " + ", ".join(f"{part} {size:.2f}" for part, size in plan.items())
    line += f" = {sum(plan.values()):.2f} of {have:.1f} on {device}"
    if sum(plan.values()) <= have:
        return line
    N = cfg.prompts_per_step * cfg.group_size
    rows = [N >> i for i in range(1, N.bit_length()) if N >> i >= cfg.group_size]
    fixes = [*MEMORY_FIXES[:2], *({"rollout_rows": r} for r in rows),
             *(dict(fix, rollout_rows=r) for fix in MEMORY_FIXES[1:] for r in rows)]
    for fix in fixes:  # the first that fits
        if sum(memory_plan(dataclasses.replace(cfg, **fix), model, prompt_tokens, device).values()) <= have:
            flags = [f"--{k.replace('_', '-')} {v}".replace(" True", "") for k, v in fix.items()]
            return line + f"; too much: {' '.join(flags)} fits"
    lower = "--prompts-per-step, --group-size, --eval-samples or --max-new-tokens"
    return line + f"; too much: lower {lower}"

MEMORY_FIXES = ({"grad_ckpt": True}, {"grad_ckpt": True, "micro_batch": 1},
                {"grad_ckpt": True, "micro_batch": 1, "sampler_dtype": "fp32"})

# ==== The run folder [plumbing]: claim, checkpoints, resume, fingerprints, metrics ================
def open_run(cfg: Config, device: torch.device, log=print) -> tuple:
    """start_run's first half -> (model, tok, state, data): claim the folder, read the data,
    load the model (a resume: its newest good checkpoint), check prompts, then clear an old run."""
    if cfg.resume and os.path.realpath(cfg.resume) != os.path.realpath(cfg.out):
        raise ValueError(f"--resume {cfg.resume} continues the run in that folder; "
                         f"--out {cfg.out} is another")
    check_out(cfg.out, "gmts", cfg.model, cfg.overwrite, bool(cfg.resume))
    claim_out(cfg.out, "gmts")  # then check again under the lock: a run may have ended meanwhile
    check_out(cfg.out, "gmts", cfg.model, cfg.overwrite, bool(cfg.resume))
    prints = read_run_config(cfg.out).get("fingerprint", {}) if cfg.resume else {}
    set_seed(cfg.seed)
    data = read_data(cfg)
    changed = [(f"--data {cfg.data}", prints.get("data"), data.fingerprint)]
    benches = dict(eval_sets(cfg.eval_data))
    for name, want in (prints.get("eval_data") or {}).items():  # a run before issue 44: none
        changed.append((f"--eval-data {name}={benches.get(name)}", want, data.bench.get(name)))
    for flag, want, now in changed:
        if want and not cfg.allow_change and now != want:
            raise ValueError(f"{flag} is not the file the run started with (its size or sha256 "
                             "differ); pass --allow-change to use it")
    state = dict(step=0, skipped=0, resumed=False)
    if checkpoints(cfg.out) and cfg.resume:
        model, tok, state = load_checkpoint(cfg.out, device, log, cfg.chat_template,
                                            prints.get("prompt"))
        if state["step"] > cfg.steps:
            raise ValueError(f"--steps {cfg.steps} is below the run's last completed step {state['step']}")
        state["resumed"] = True
        if cfg.data_order == "epoch":  # where its passes go on
            data.order["drawn"] = rows_drawn(cfg, state["step"])
    else:
        model, tok = load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
    check_prompts(cfg, model, tok, data)  # every row renders and fits before anything changes
    if not state["resumed"]:
        for n in _names(cfg.out, ("metrics.jsonl", "run_config.json", "ckpt-*")):  # only now
            if _own(os.path.join(cfg.out, n)):
                remove(os.path.join(cfg.out, n))
    return model, tok, state, data

def rows_drawn(cfg: Config, step: int) -> int:
    """The rows the run in cfg.out drew in steps 1..step (metrics.jsonl's rollout_batches x B)."""
    recs = [r for r in read_metrics(cfg.out, step) if r["step"] >= 1]
    if [r["step"] for r in recs] != list(range(1, step + 1)):
        raise ValueError(f"--resume {cfg.out}: metrics.jsonl lacks steps before {step}, so "
                         "--data-order epoch cannot go on where it was; --overwrite starts afresh")
    return cfg.prompts_per_step * sum(int(r.get("rollout_batches", 1)) for r in recs)

def record_start(cfg: Config, run, data: Data, resumed: bool, device: torch.device, log=print):
    """start_run's second half: check a resume's KL reference, open the tracker, write
    metrics.jsonl, run_config.json (what a resume checks), a new run's step 0 and checkpoint."""
    prints = dict(data=data.fingerprint, prompt=prompt_print(run.tok, cfg.chat_template),
                  reference=weights_print(run.ref) if run.ref else None)
    if data.bench:  # absent without --eval-data: run_config.json as before
        prints["eval_data"] = data.bench
    want = read_run_config(cfg.out).get("fingerprint", {}).get("reference") if resumed else None
    if want and want != prints["reference"] and not cfg.allow_change:
        raise ValueError(f"--model {cfg.model} is not the KL reference the run started from (its weights' sha256 "
                         "differs); pass --allow-change to train against it")
    run.report = open_tracker(cfg)  # wandb without a login: one line, nothing written
    kept = read_metrics(cfg.out, run.start - 1) if resumed else []  # later steps will rerun
    write_file(os.path.join(cfg.out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in kept))
    write_file(os.path.join(cfg.out, "run_config.json"), json.dumps(dict(**vars(cfg), fingerprint=prints), indent=1))
    n_params = sum(p.numel() for p in run.model.parameters())
    kernels = torch.backends.cpu.get_cpu_capability()  # CPU numbers depend on it (NOTES, issue 31)
    held = "sets" if isinstance(run.eval_rows, dict) else "rows"  # --eval-data's, or rows of --data
    log(f"device {device} ({kernels} kernels, {torch.get_num_threads()} threads) | model "
        f"{resolve_model_name(cfg.model)} ({n_params:,} params) | chat template {run.chat} | {len(run.eval_rows)} "
        f"held-out {held} | {cfg.prompts_per_step} prompts x {cfg.group_size} answers per step"
        + (f" | resumed at step {run.start}" if resumed else ""))
    log(memory_line(cfg, run.model, data.longest, device))  # before any work
    pairs = zip(data.where, data.rows)
    fallback = [dict(where=w, answer=r["answer"]) for w, r in pairs if r.get("fallback")]
    skipped = [dict(zip(("where", "why"), w.split(": ", 1))) for w in data.skipped or []]
    lists = (("fallback_rows.jsonl", fallback, "graded by exact match (math-verify cannot read "
              "their gold)"),
             ("skipped_rows.jsonl", skipped, "of --data left out (--skip-bad-rows)"))
    for name, recs, what in lists:
        if recs:
            write_file(os.path.join(cfg.out, name), "".join(json.dumps(r) + "\n" for r in recs))
            log(f"{len(recs)} rows {what}: {os.path.join(cfg.out, name)}")
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
    with open(path, "ab", buffering=0) as f:
        f.write((json.dumps(rec) + "\n").encode())

def read_metrics(out: str, last_step: float = math.inf) -> list:
    """The whole JSON lines of OUT/metrics.jsonl with step <= last_step (a torn last line is skipped)."""
    recs = []
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if (line.endswith("\n") and isinstance(rec, dict)
                            and isinstance(rec.get("step"), int) and rec["step"] <= last_step):
                        recs.append(rec)
    return recs

def checkpoints(out: str) -> list:
    """The complete checkpoint folders in out, oldest first (none with an output of its own)."""
    names = os.listdir(out) if os.path.isdir(out) else []  # not glob: a name may hold [ ] * ?
    return sorted(os.path.join(out, n) for n in names if re.fullmatch(r"ckpt-\d+", n) and _own(os.path.join(out, n)))

def save_checkpoint(out: str, step: int, model, tok, opt, skipped: int, keep: int = 2):
    """OUT/ckpt-<step> (model, tokenizer, state.pt; no RNG: every step reseeds) by _save_model; then
    all but the newest `keep` go, each renamed first (a half-deleted one is no checkpoint)."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    state = dict(step=step, skipped=skipped, opt=opt.state_dict())
    tmp = _save_model(final + ".tmp", model, tok, state)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(out)[:-keep]:
        os.replace(old, old + ".old")
        shutil.rmtree(old + ".old", ignore_errors=True)

def load_checkpoint(out: str, device: torch.device, log=print, chat_template="auto", want=None) -> tuple:
    """(model, tok, state) from the newest checkpoint that loads and can go on, else OSError."""
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
        except Exception as e:  # truncated, empty or foreign files
            if memory_fault(e):  # not the files' fault: every checkpoint stays as it is
                raise
            log(f"{ck} does not load ({type(e).__name__}: {error_line(e, 120)}); trying the previous checkpoint")
    raise OSError(f"--resume {out}: no loadable checkpoint (ckpt-*) in that folder; --overwrite starts it afresh")

@torch.no_grad()
def check_weights(model, batch: dict, step: int, out: str):
    """Non-finite weights or first-token logits after an update end the run (RunError)."""
    finite = bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())
    if finite:  # one (1, V) row of logits: a sampling step's worth, not the whole answer's (T, V)
        h = response_hidden(model, batch, slice(0, 1))[0, :1]  # (1, d)
        finite = bool(torch.log_softmax(model.get_output_embeddings()(h).float(), -1).isfinite().all())
    if not finite:
        raise RunError(f"step {step} left non-finite weights or logits (is --lr too high?); stopped, the checkpoints "
                       f"in {out} are from before it")

def save_final(out: str, model, tok):
    """save_pretrained into OUT itself via final.tmp, config.json renamed in last: never torn."""
    tmp = _save_model(os.path.join(out, "final.tmp"), model, tok)
    for n in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)

def _save_model(tmp: str, model, tok, state=None) -> str:
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp):
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if state is not None:
            torch.save(state, os.path.join(tmp, "state.pt"))
    return tmp

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
WRITES = {"gmts": ("metrics.*", "run_config.json*", "ckpt-*", "final.tmp", "*_rows.jsonl",
                   *MODEL_FILES),
          "trl": ("checkpoint-*", "training_args.bin", "trainer_state.json", "runs", *MODEL_FILES),
          "warm": MODEL_FILES, "compare": ("compare.md", "compare.png"), "analyze": ("analysis.json",)}
_HELD = {}  # real path of a folder -> the fd of its marker, locked by this process

def run_kind(out: str):
    """The kind in out's marker ("gmts" for an old run_config.json alone), "" mid-write, or None."""
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
    """(where, folder, kind) of the nearest output of this program (not a compare) above `out`
    ("lies inside"), else below it ("holds"), or None: one's clean-up could delete the other."""
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
    """ValueError unless a `kind` output may go into `out` replacing nothing not its own: no other
    live writer, file of WRITES[kind] or `more` or --model; --overwrite to replace a result."""
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
    worth = checkpoints(out) if kind == "gmts" else clash  # a run without a checkpoint: nothing
    if found and worth and not (resume or overwrite):
        hint = {"gmts": f"continue it with --resume {out}, or "}.get(kind, "")
        raise ValueError(f"--out {out} holds a run; {hint}pass --overwrite to replace it")

def claim_out(out: str, kind: str):
    """Make `out` this process's (its marker flocked), then clear a killed gmts run's leftovers."""
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
    """A failed write removes `path` and raises OSError with one line (memory raised as it is)."""
    try:
        yield
    except Exception as e:
        with contextlib.suppress(OSError):
            remove(path)
        if memory_fault(e):
            raise
        raise OSError(f"cannot write {path}: {error_line(e, 200)}") from None

def remove(path: str):
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
    fields = [f"step {rec['step']}"] + [f"{key} {rec[key]:.3f}" for key in SHOWN if key in rec]
    unknown = ("grade_unknown", "eval_grade_unknown")  # answers math-verify gave no verdict on
    fields += [f"{key} {rec[key]}" for key in unknown if rec.get(key)]
    fields.append(f"{rec['step_time_s']:.2f} s")
    return " | ".join(fields)

def step_printer(total: int, start: int, log=print):
    """show(line, keep): a tqdm bar on a TTY (keep: line kept above), else log; None closes."""
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
    """report(rec) sends a record's numbers to --report-to's tracker, report(None) closes it."""
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
    (["max_grad_norm", "adam_eps"], lambda v: 0 < v < math.inf, "finite and > 0"),
    (["clip_low", "clip_high"], lambda v: 0 <= v < 1, "in [0, 1)"),
    (["kl_beta", "weight_decay", "rsi_low", "rsi_high"], lambda v: 0 <= v < math.inf, "finite and >= 0"),
    (["steps", "prompts_per_step", "max_new_tokens", "micro_batch", "inner_updates", "stats_chunk", "eval_size",
      "max_resample", "tiny_layers"], lambda v: v >= 1, ">= 1"),
    (["save_every", "eval_every", "warmup_steps", "top_k", "max_prompt_tokens", "rollout_rows"],
     lambda v: v >= 0, ">= 0"),
    (["eval_samples"], lambda v: 0 <= v <= 1024,
     "in [0, 1024] (a rollout holds max(64, k) answers)"),
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
    if cfg.rsi_low > cfg.rsi_high:
        raise ValueError(f"--rsi-low {cfg.rsi_low} is above --rsi-high {cfg.rsi_high}: no RSI is kept")
    if METHODS[cfg.select].band and (cfg.scope != "auto" or cfg.loss_norm == "selected"):
        raise ValueError(f"--select {cfg.select} keeps an interval, with no budget: not with --scope "
                         "group/batch or --loss-norm selected (a budget's normaliser)")
    get_task(cfg.task)
    eval_sets(cfg.eval_data)
    if cfg.data_columns and (cfg.task != "math" or not re.fullmatch(r"[^,]+,[^,]+", cfg.data_columns)):
        raise ValueError(f"--data-columns {cfg.data_columns!r}: QUESTION,ANSWER columns of a math data set")
    if cfg.prompt_style != "ours" and cfg.task != "math":
        raise ValueError(f"--prompt-style {cfg.prompt_style} asks for a \\boxed{{}} answer: --task math only")
    if data_kind(cfg.data) == "gen" and cfg.data_order != "draw":
        raise ValueError(f"--data-order {cfg.data_order} passes over a file's or set's rows; "
                         f"--data {cfg.data} draws fresh problems (--data-order draw)")
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

# fields newer than a run_config.json: the value its run had (issues 42, 44)
ADDED = {"data_order": "draw", "skip_bad_rows": False, "max_prompt_tokens": 0, "rollout_rows": 0,
         "adam_eps": 1e-8, "rsi_low": 0.5, "rsi_high": 2.0}

def parse_args(argv=None) -> Config:
    """Config fields as --flags over --preset NAME's defaults or --resume OUT's saved config (a
    field outside FREE that differs needs --allow-change); paths made absolute (resolved_paths)."""
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
        saved = dict(ADDED, **read_run_config(pre.resume))
        for what, keys in (("lacks", names - set(saved)),  # every Config field and nothing else
                           ("holds unknown keys", set(saved) - names - {"fingerprint"})):
            if keys:
                raise ValueError(f"--resume {pre.resume}: run_config.json {what} "
                                 f"{', '.join(sorted(keys))}")
    p.set_defaults(**{k: v for k, v in saved.items() if k in names - {"resume", "overwrite", "allow_change", "out"}})
    p.set_defaults(out=pre.resume or p.get_default("out"), resume="")  # a run goes on in its folder
    cfg = resolved_paths(Config(**{k: v for k, v in vars(p.parse_args(argv)).items() if k != "preset"}))
    for k in sorted(names - FREE):
        if cfg.resume and not same_value(k, getattr(cfg, k), saved[k]) and not cfg.allow_change:
            raise ValueError(f"--resume {cfg.resume}: the run was trained with --{k.replace('_', '-')} {saved[k]}, "
                             f"not {getattr(cfg, k)}; pass --allow-change to change it")
    return cfg

def resolved_paths(cfg: Config) -> Config:
    """cfg with its paths absolute (--model, --data, --eval-data, --out): a resume finds them."""
    new = {}  # train applies it too (configs made in Python)
    if isinstance(cfg.model, str) and cfg.model != "tiny" and os.path.isdir(cfg.model):
        new["model"] = os.path.abspath(cfg.model)
    if isinstance(cfg.data, str):
        new["data"] = absolute_data(cfg.data)
    if isinstance(cfg.eval_data, str):
        new["eval_data"] = ",".join(f"{n}={absolute_data(d)}" for n, d in eval_sets(cfg.eval_data))
    if isinstance(cfg.out, str) and cfg.out:
        new["out"] = os.path.abspath(cfg.out)
    return dataclasses.replace(cfg, **new)

def absolute_data(data: str, where=os.path.abspath) -> str:
    """A --data value with its local file or dataset folder written as where(path)."""
    parts = data.split(":")
    if data_kind(data) == "file":
        return where(data)
    if data_kind(data) == "hf" and len(parts) > 1 and "/" in parts[1] and os.path.isdir(parts[1]):  # as load_rows
        return ":".join(["hf", where(parts[1]), *parts[2:]])
    return data

def same_value(field: str, a, b) -> bool:
    """A resume's test of a field against the saved one; paths are equal where they lead."""
    def real_data(data):
        return absolute_data(data, os.path.realpath)
    real = {"model": os.path.realpath, "data": real_data,
            "eval_data": lambda x: [(name, real_data(d)) for name, d in eval_sets(x)]}
    if field in real and isinstance(a, str) and isinstance(b, str):
        return real[field](a) == real[field](b)
    return a == b

def memory_fault(e, lower: str = "--micro-batch, --group-size or --max-new-tokens"):
    """The one line (naming the flags to `lower`) for a failed CPU or GPU allocation, else None."""
    text = str(e) if isinstance(e, RuntimeError) else ""
    if isinstance(e, MemoryError) or "can't allocate memory" in text:
        return f"out of CPU memory: lower {lower}, or use a smaller model"
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text:
        return f"out of GPU memory: lower {lower}"
    return None

def error_line(e, cap: int = 1000) -> str:
    """Every printed error's one line: memory_fault's, else the message (\n escaped) cut at cap."""
    return memory_fault(e) or "\\n".join(str(e).strip().splitlines())[:cap] or type(e).__name__

def fail(e: Exception, kept: str = ""):
    """Exit for an exception in one line: memory or OSError/RunError 1, ValueError 2; else a bug."""
    if memory_fault(e):
        die(memory_fault(e) + kept, 1)
    if not isinstance(e, (ValueError, OSError, RunError)):
        raise e
    die(e, 2 if isinstance(e, ValueError) else 1)

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STOPPED = []  # the stop signal received, kept even when its KeyboardInterrupt was swallowed

def _on_signal(signum, frame):
    """The first stop signal raises KeyboardInterrupt, later ones are ignored. Python swallows it
    in a __del__ (the run went on, exit 0): _STOPPED remembers it, say() raises it again."""
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
    """A closed stdout is /dev/null, bad characters escaped; _on_signal for the stop signals."""
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
        out = steps = None
        started = time.time()
        try:
            cfg = parse_args(argv)
            check_config(cfg)
            out = cfg.out
            steps = cfg.steps
            changed = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(Config, k)}
            say(f"config (other than the defaults; {cfg.out}/run_config.json has all): "
                f"{json.dumps(changed)}")
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
    """Whether this process logged the run's last step and saved its final model after `since`."""
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
