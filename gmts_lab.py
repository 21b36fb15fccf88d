"""
gmts_lab.py: the experiments around gmts.py. It imports gmts; gmts.py never imports this file.

What a user runs:
  python gmts_lab.py warm [--task countdown|math|logic|code|commonsense] [--out warm/cpu]
      rebuild a committed warm start (1 thread)
  python gmts_lab.py compare --methods all,entropy,gmts --seeds 3 --preset cpu --out out/compare
      methods x seeds, each a gmts run from the same --model: a table and a plot
  python gmts_lab.py report math=out/math --png docs/math.png
      tables and learning curves of compare folders, paired by seed
The analysis behind docs/results.md's figures:
  python gmts_lab.py analyze --preset cpu --batches 4 --out out/analyze
  python gmts_lab.py analyze --preset cpu --batches 4 --rhos 0.01,0.05,0.2 --out out/ret
      the kept-gradient curve
  python gmts_lab.py retention countdown=out/ret --png docs/retention.png
      its table and figure
  python gmts_lab.py decoy --model out/cpu
      held-out accuracy with the real and with another problem's target
  python gmts_lab.py scatter --png docs/scatter.png
      entropy against the GMTS score and the exact gradient norm, one batch per warm start

compare, analyze and decoy take gmts.py's flags beside their own (--preset, --model, --out,
--seed, --no-filter-groups, --steps ...); the others take only their own. Outputs follow gmts.py's
folder rule, checked before any work: warm, compare and analyze each hold one run of theirs in
their folder (marked .gmts_lab_COMMAND.run), which only --overwrite replaces, removing exactly the
names in WRITES (warm, which rebuilds the same bits, needs no --overwrite); a figure is one file,
replaced only with --overwrite. compare's runs are gmts runs, each in its own folder.

  warm     The CPU preset (gmts.PRESETS["cpu"]) starts from warm/cpu: a tiny Qwen2 trained by
           supervision to answer easy countdown problems with RANDOM well-formed answers (the
           prompt's numbers joined by random signs). It learns the format and to copy the numbers,
           nothing that links its signs to the target: whatever RL gains over its accuracy is
           learned from the reward. The same recipe (WARM: hidden 96, 3 layers, 1000 steps of 32
           rows, lr 1e-3, the cpu preset's rows with --data easy, seed 0) gives
             warm/math   one-step word problems ("Eve has 9 bags of 8 apples. How many apples in
                         all?"), taught `of 8: 9 op 8 = value` + \\boxed{value} with op drawn
                         from + - * at random: it learns to copy the word before the second number
                         and the numbers, and to compute, not which operation the words mean;
             warm/logic  two-person knights and knaves, taught every name in order with a random
                         role (a fair coin each): it learns the format and to copy the names, not
                         who is a knight;
             warm/code   'Write a function calc that returns its argument times 7.', taught a
                         ```python block `def calc(times): return times op 7` with op drawn from
                         + - * at random: it learns the block and to copy the name, the word
                         before the constant (as the parameter) and the constant, not which
                         operation the word means (its asserts run in gmts.py's sandbox).
             warm/commonsense  three options of three kinds ("Which of these is a fruit?"),
                         taught to box a random option's word (\\boxed{desk}, a third each): it
                         learns the format and to write one of the options, not which word is of
                         which kind.
           `warm` prints the held-out greedy accuracy beside what random content gets (exactly: the
           share of the nonnegative sign patterns / of + - * that hit the answer, 1/4 for two
           people, 1/3 for three options) and what the best content that ignores the prompt gets
           (one sign pattern, operation, role pattern or label for all). Runs from them:
             python gmts.py --preset cpu --task math --model warm/math
           (data easy, filter off, as the preset).
  compare  Every (method, seed) as one gmts.train run from the same --model, in parallel processes;
           a table of final held-out accuracy and a plot. A method may name its scope (gmts.py's
           --scope): gmts@batch is this project's whole-batch GMTS, gmts (--scope auto: group) the
           authors'; so may analyze's --arms.
  report   python gmts_lab.py report math=out/math logic=out/logic --png docs/domains.png: per
           compare folder, the final accuracy table and the paired differences by seed
           (gmts - entropy, gmts - all, gradnorm - gmts); one figure, a learning-curve panel per
           folder.
  analyze  What the kept tokens' gradient retains of the full batch gradient (cosine and norm ratio,
           per method, with and without dynamic sampling), and how each score ranks tokens by their
           true gradient norm. With --rhos R1,R2,...: the kept-gradient curve instead, the same
           cosine and ratio and the share of kept tokens in low-|A| groups at each rho on the raw
           batches (filter off), written to OUT/retention.json; `retention` draws it, a panel per
           folder.
  decoy    How much of a model's accuracy it reads from the target: the same held-out problems, each
           prompt showing another problem's target, scored against its own.
  scatter  The reviewers' picture: every response token of the first raw batch (seed 0, the cpu
           preset, filter off) of warm/cpu, warm/math and warm/logic, entropy H against H * |omega|
           (GMTS's score) and against the exact logit-gradient norm |omega| * dz_norm, coloured by
           its answer's |A|; with the Spearman correlations of H with each.
"""
import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import signal
import typing

import torch

import gmts

# --------------------------------------------------------------------------------------------------
# Warm start [plumbing]: supervised warm-up on reference answers so a tiny random model earns reward
# --------------------------------------------------------------------------------------------------

def countdown_reference(row: dict) -> str:
    if "expr" not in row:
        raise gmts.BadInput("a countdown reference needs a generated row (with its 'expr'): "
                            "use --data gen or easy")
    return f"{row['expr']} = {row['target']}</think>\n<answer>{row['expr']}</answer>"

def math_reference(row: dict) -> str:
    return ("\n".join(row.get("steps", []))
            + f"</think>\n<answer>\\boxed{{{row['answer']}}}</answer>")

def logic_reference(row: dict) -> str:
    roles = ", ".join(f"{k}: {'knight' if v else 'knave'}" for k, v in row["solution"].items())
    return f"</think>\n<answer>{roles}</answer>"  # short: it fits the cpu preset's 64 new tokens

def code_reference(row: dict) -> str:
    if "solution" not in row:
        raise ValueError("a code reference needs a generated row (with its 'solution'): "
                         "use --data gen or easy")
    return f"```python\n{row['solution']}```"


def commonsense_reference(row: dict) -> str:
    """The key's option by its text, boxed: the tiny model writes a word it has seen, where a
    label would have to be looked up beside the word (warm-ups taught 'desk (B)' learned the words
    but wrote one label for every row)."""
    key = row["answerKey"]
    text = dict(zip(row["choices"]["label"], row["choices"]["text"]))[key]
    return f"</think>\n<answer>\\boxed{{{text}}}</answer>"  # short: as logic's

REFERENCES = {"countdown": countdown_reference, "math": math_reference, "logic": logic_reference,
              "code": code_reference, "commonsense": commonsense_reference}

def countdown_blind(row: dict, rng: random.Random) -> dict:
    """The row with a random well-formed answer in place of its solution: its numbers in their order
    joined by + or -, each sign pattern whose value is >= 0 equally likely; that value becomes the
    row's target, so the reference's `expr = value` line is true. The row's own target is never
    read."""
    nums = row["nums"]
    if not nums:
        return row
    # uniform signs, redrawn until the value is >= 0: each such pattern equally likely
    for _ in range(100):
        value, expr = gmts._sign_chain(nums, [rng.choice("+-") for _ in nums[1:]])
        if value >= 0:
            break
    return dict(row, expr=expr, target=value)

MATH_BLIND_OPS = "+-*"

def math_blind(row: dict, rng: random.Random) -> dict:
    """An easy math row (one step `a op b = z`) with a random operation from + - * in place of its
    own (a >= b, so every value is >= 0); its value becomes the row's answer. The worked step first
    copies the word before b in the question ('eats 8: 9 - 8 = 1'): the words that decide the
    operation then sit right before it, while the operation itself is a coin. The question's meaning
    is never read."""
    steps = row.get("steps", [])
    parts = steps[0].split() if len(steps) == 1 else []
    if len(parts) != 5 or not (parts[0].isdigit() and parts[2].isdigit()):
        raise gmts.BadInput("a blind math warm-up needs one-step rows ('a op b = z'): use --data "
                            "easy")
    a, b, op = int(parts[0]), int(parts[2]), rng.choice(MATH_BLIND_OPS)
    cue = re.findall(rf"([A-Za-z]+) {b}(?![0-9])", row["question"])
    z = gmts._OPS[op](a, b)
    word = cue[-1] if cue else "so"  # (a question without a word before b: a fixed word)
    return dict(row, answer=str(z), steps=[f"{word} {b}: {a} {op} {b} = {z}"])

def logic_blind(row: dict, rng: random.Random) -> dict:
    """The row with a random role for each person (a fair coin each, in the prompt's order) as its
    solution."""
    return dict(row, solution={name: rng.random() < 0.5 for name in row["names"]})

CODE_BLIND_OPS = "+-*"

def code_blind(row: dict, rng: random.Random) -> dict:
    """A generated code row with a random operation from + - * in its solution: the function's
    name, the word before the constant (its parameter) and the constant copied from the prompt,
    the operation a coin. What the word means is never read."""
    if "solution" not in row:
        raise ValueError("a blind code warm-up needs generated rows: use --data easy")
    x, op = row["word"], rng.choice(CODE_BLIND_OPS)
    return dict(row, op=op, solution=f"def {row['name']}({x}):\n    return {x} {op} {row['k']}\n")

def commonsense_blind(row: dict, rng: random.Random) -> dict:
    """The row with a label drawn uniformly from its options as its key: the answer copies a random
    option and boxes its label; the question is never read."""
    return dict(row, answerKey=rng.choice(row["choices"]["label"]))

BLIND = {"countdown": countdown_blind, "math": math_blind, "logic": logic_blind, "code": code_blind,
         "commonsense": commonsense_blind}

def random_content_acc(task: str, rows: list) -> float:
    """Expected accuracy of blind answers on rows, computed exactly: countdown, the share of the
    nonnegative sign patterns that hit the target; math, the share of the operations + - * whose
    value is the answer; logic, 1 / 2^n (one assignment of n people is right); code, the share of
    + - * that is the row's operation (its asserts tell every operation apart); commonsense, 1 / n
    (one of n options)."""
    def one(row):
        if task == "commonsense":
            return 1 / len(row["choices"]["label"])
        if task == "logic":
            return 0.5 ** len(row["names"])
        if task == "code":
            return sum(op == row["op"] for op in CODE_BLIND_OPS) / len(CODE_BLIND_OPS)
        if task == "math":
            a, _, b = row["steps"][0].split()[:3]
            hit = [str(gmts._OPS[op](int(a), int(b))) == row["answer"] for op in MATH_BLIND_OPS]
            return sum(hit) / len(hit)
        values = [gmts._sign_chain(row["nums"], s)[0]
                  for s in itertools.product("+-", repeat=len(row["nums"]) - 1)]
        values = [v for v in values if v >= 0]
        return sum(v == row["target"] for v in values) / len(values)
    return sum(one(r) for r in rows) / len(rows)

def best_fixed_guess_acc(task: str, rows: list) -> float:
    """Accuracy of the best content that ignores the prompt: one sign pattern (countdown), one
    operation (math, code), one role pattern by position (logic), one label or one word
    (commonsense) for every row.
    What RL gets by learning only which content is common."""
    def hits(row):
        if task == "commonsense":  # one label, or one word, for all
            words = dict(zip(row["choices"]["label"], row["choices"]["text"]))
            return {row["answerKey"], words[row["answerKey"]]}
        if task == "countdown":
            return {s for s in itertools.product("+-", repeat=len(row["nums"]) - 1)
                    if gmts._sign_chain(row["nums"], s)[0] == row["target"]}
        if task == "math":
            a, _, b = row["steps"][0].split()[:3]
            return {op for op in MATH_BLIND_OPS
                    if str(gmts._OPS[op](int(a), int(b))) == row["answer"]}
        if task == "code":
            return {row["op"]} & set(CODE_BLIND_OPS)
        return {tuple(row["solution"].values())}
    count = collections.Counter(c for r in rows for c in hits(r))
    return max(count.values()) / len(rows) if count else 0.0

def well_formed(text: str, row: dict) -> bool:
    """A countdown answer that uses each given number once in a valid expression, right or wrong."""
    return gmts.countdown_value(text, row["nums"]) is not None

def sft_warmup(model, tok, task: str, draw, chat: bool, short: bool, steps: int, lr: float,
               batch_size: int, seed: int, blind: bool = False, log=print):
    """Cross-entropy on the answer tokens of reference completions, after each row's own prompt.

    draw(n, *key) -> n training rows (gmts.read_data). blind=True teaches BLIND[task]'s random
    answers instead of the solutions: the model learns the format and to copy (and compute with) the
    prompt's material, while the content of its answers (countdown's signs, math's operation,
    logic's roles) stays spread out and unrelated to the prompt."""
    t = gmts.get_task(task)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)  # the blind answers' signs
    model.train()
    for step in range(1, steps + 1):
        rows = draw(batch_size, "warm-up", step)
        prompts = gmts.build_prompts(tok, t, rows, chat, short)
        taught = [BLIND[task](r, rng) for r in rows] if blind else rows
        answers = [REFERENCES[task](r) + tok.eos_token for r in taught]
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        a_ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
        L = max(len(p) + len(a) for p, a in zip(p_ids, a_ids))
        # (n, L), right padded: no generation here
        ids = torch.full((batch_size, L), tok.pad_token_id)
        # (n, L), -100: no loss on the prompt and the padding
        labels = torch.full((batch_size, L), -100)
        for i, (p, a) in enumerate(zip(p_ids, a_ids)):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        attn = ((labels != -100)
                | (torch.arange(L)[None, :] < torch.tensor([len(p) for p in p_ids])[:, None]))
        loss = model(input_ids=ids.to(device), attention_mask=attn.long().to(device),
                     labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log and (step % 100 == 0 or step == steps):
            log(f"warm-up {step}/{steps} | loss {loss.item():.3f}")

# The recipe of warm/cpu. At this lr the loss drops (the copying appears) suddenly, steps 250-400.
WARM_CPU = dict(hidden=96, layers=3, steps=1000, lr=1e-3, batch_size=32)
# Every warm start: its recipe and the folder `warm --task T` writes by default. Runs start from it
# with the cpu preset's flags and two more (data easy, as cpu):
#   python gmts.py --preset cpu --task math --model warm/math
HERE = os.path.dirname(os.path.abspath(__file__))
WARM = {"countdown": dict(WARM_CPU, out=gmts.WARM_CPU),
        "math": dict(WARM_CPU, out=os.path.join(HERE, "warm", "math")),
        "logic": dict(WARM_CPU, out=os.path.join(HERE, "warm", "logic")),
        "code": dict(WARM_CPU, out=os.path.join(HERE, "warm", "code")),
        "commonsense": dict(WARM_CPU, out=os.path.join(HERE, "warm", "commonsense"))}

def warm_config(task: str) -> gmts.Config:
    """The cpu preset on `task` from its warm start: the rows and prompts the warm-up trains and
    evaluates on."""
    return gmts.Config(**dict(gmts.PRESETS["cpu"], task=task, model=WARM[task]["out"]))

def warm_start(out: str = None, task: str = "countdown", log=print, **recipe):
    """Rebuild `task`'s warm start into `out` (default WARM[task]["out"]; safetensors + tokenizer),
    bit for bit: one thread, fixed seeds. Its rows are the cpu preset's training rows on that task
    (seed 0); other seeds hold out other rows, which the warm-up may have shown, but only with
    random answers: it learned nothing about their solutions. recipe overrides WARM[task]'s fields
    (tests: a tiny size). out is claimed first (gmts.py's folder rule): a warm start there is
    replaced, a folder holding anything else refused. -> (model, tok)"""
    r = dict(WARM[task], **recipe)
    out = out or r["out"]
    threads = torch.get_num_threads()
    with gmts.claim_folder(out, WRITES["warm"], "gmts_lab_warm", resume=None, overwrite=True):
        torch.set_num_threads(1)  # another thread count may sum in another order: other bits
        try:
            cfg = warm_config(task)
            draw = gmts.read_data(cfg).draw
            model, tok = gmts.build_tiny(r["hidden"], r["layers"], seed=0)
            sft_warmup(model, tok, cfg.task, draw, gmts.use_chat(tok, cfg.chat_template),
                       cfg.short_prompt, r["steps"], r["lr"], r["batch_size"],
                       seed=0, blind=True, log=log)
        finally:
            torch.set_num_threads(threads)
        gmts.clear_folder(out, WRITES["warm"], "gmts_lab_warm")
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return model.eval(), tok

def greedy_texts(model, tok, task: dict, rows: list, chat: bool, short: bool,
                 max_new_tokens: int) -> list:
    prompts = gmts.build_prompts(tok, task, rows, chat, short)
    return [t for i in range(0, len(rows), 64)
            for t in gmts.rollout(model, tok, prompts[i:i + 64], 1, max_new_tokens,
                                  greedy=True)["texts"]]

def decoy_eval(model, tok, rows: list, chat: bool, short: bool, max_new_tokens: int) -> dict:
    """Greedy accuracy and well-formed share on countdown rows as posed (real) and with each prompt
    showing the previous row's target (decoy), both scored against the row's own target.
    real - decoy is what is read from it."""
    task = gmts.get_task("countdown")
    shown = {"real": rows,
             "decoy": [dict(r, target=rows[i - 1]["target"]) for i, r in enumerate(rows)]}
    res = {}
    for name, prompts_rows in shown.items():
        texts = greedy_texts(model, tok, task, prompts_rows, chat, short, max_new_tokens)
        res[f"{name}_acc"] = (sum(task["reward"](t, r) == 1.0 for t, r in zip(texts, rows))
                              / len(rows))
        res[f"{name}_valid"] = sum(well_formed(t, r) for t, r in zip(texts, rows)) / len(rows)
    return res


# --------------------------------------------------------------------------------------------------
# Comparison [plumbing]: methods x seeds, each a full gmts.train run from the same starting model
# --------------------------------------------------------------------------------------------------

def plot_runs(runs: dict, png: str):
    """runs: label -> list of run folders (seeds). Held-out accuracy and batch reward vs step,
    mean over seeds."""
    from matplotlib.figure import Figure  # no pyplot: an importing notebook keeps its own backend

    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for label, outs in runs.items():
        for ax, key in zip(axes, ("eval_acc", "reward_mean")):
            series = [{r["step"]: r[key] for r in gmts.read_metrics(o) if key in r} for o in outs]
            steps = sorted(set.intersection(*(set(x) for x in series)))
            ax.plot(steps, [sum(x[t] for x in series) / len(series) for t in steps], label=label,
                    marker=".")
            ax.set(xlabel="step",
                   ylabel=key + (f" (mean of {len(outs)} seeds)" if len(outs) > 1 else ""))
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, png)

def _train_quietly(job: tuple) -> str:
    """One run of compare, in a worker process, on its share of the threads."""
    cfg, threads = job
    torch.set_num_threads(threads)
    return gmts.train(cfg, log=lambda *a: None)

SCOPES = typing.get_args(gmts.Config.__annotations__["scope"])  # gmts.py's --scope values

def parse_arm(arm: str, flag: str = "--methods") -> tuple:
    """An arm is a --select method, or METHOD@SCOPE with a --scope (gmts@batch: this project's
    whole-batch GMTS) -> (method, scope or None); BadInput (one line) otherwise."""
    method, _, scope = arm.partition("@")
    if method not in gmts.METHODS or (scope and scope not in SCOPES):
        raise gmts.BadInput(f"{flag}: {arm!r} is not METHOD or METHOD@SCOPE (methods: "
                            f"{', '.join(gmts.METHODS)}; scopes: {', '.join(SCOPES)})")
    return method, scope or None

def is_arm(name: str) -> bool:
    try:
        parse_arm(name)
    except gmts.BadInput:
        return False
    return True

def arm_fields(arm: str, cfg: gmts.Config) -> dict:
    """The Config fields an arm sets: select, and scope (cfg's own when the arm names none)."""
    method, scope = parse_arm(arm)
    return dict(select=method, scope=scope or cfg.scope)

def arm_group_size(arm: str, cfg: gmts.Config) -> int:
    """The scope an arm ranks in on cfg's batches, as gmts.selection_rule says:
    G (per group) or 0 (batch)."""
    return gmts.selection_rule(dataclasses.replace(cfg, **arm_fields(arm, cfg)))[1]

def arm_style(arm: str) -> dict:
    """Plot style: a colour per method, a solid line for the group scope, dashed for the batch."""
    method = parse_arm(arm)[0]
    per_group = arm_group_size(arm, gmts.Config())
    return dict(color=f"C{list(gmts.METHODS).index(method)}",
                linestyle="-" if per_group else "--")

def compare(cfg: gmts.Config, methods: list, seeds: int, workers: int = 0, log=print) -> dict:
    """Each method with seeds cfg.seed, cfg.seed + 1, ... into OUT/<method>-s<seed>, all from
    cfg.model, in `workers` processes (0: one per CPU core on a CPU, 1 on a GPU); two 1-thread
    processes beat one 2-thread one on 2 cores. Writes OUT/compare.md and OUT/compare.png, OUT
    claimed first (gmts.py's folder rule: a compare there only with --overwrite, which removes
    its runs and files, nothing else) -> {method: [(eval_acc at step 0, final eval_acc) per
    seed]}."""
    for m in methods:
        parse_arm(m, "--methods")
    if not methods:
        raise gmts.BadInput("--methods is empty: name --select methods, e.g. "
                            "entropy,gmts,gmts@batch")
    if seeds < 1:
        raise gmts.BadInput(f"--seeds must be >= 1, got {seeds}")
    if len(set(methods)) < len(methods):  # two runs would write one folder
        raise gmts.BadInput(f"--methods {','.join(methods)!r} names a method twice")
    if workers < 0:
        raise gmts.BadInput(f"--workers must be >= 0, got {workers}")
    runs = [dataclasses.replace(cfg, **arm_fields(m, cfg), seed=s,
                                out=os.path.join(cfg.out, f"{m}-s{s}"))
            for m in methods for s in range(cfg.seed, cfg.seed + seeds)]
    workers = workers or (torch.get_num_threads()
                          if gmts.pick_device(cfg.device).type == "cpu" else 1)
    workers = min(workers, len(runs))  # no idle processes
    threads = max(1, torch.get_num_threads() // workers)
    threads = cfg.threads or threads  # a preset's (or the user's) --threads wins
    for c in runs:  # each arm is a gmts run: its flags by gmts.py's rules, first
        gmts.check_config(c)
    with gmts.claim_folder(cfg.out, WRITES["compare"], "gmts_lab_compare", **folder_rules(cfg)):
        gmts.clear_folder(cfg.out, WRITES["compare"], "gmts_lab_compare")  # an old compare goes
        log(f"{len(runs)} runs ({seeds} seed(s) x {len(methods)} method(s)) in {workers} "
            f"process(es), {threads} thread(s) each, all from {cfg.model}")
        evals = {}  # run folder -> [(step, eval_acc)], read once as the run finishes
        by_out = {c.out: c for c in runs}
        # workers ignore SIGINT; leaving the with block for any reason
        # (an interrupt, an error) terminates them
        pool = multiprocessing.get_context("spawn").Pool(workers, signal.signal,
                                                         (signal.SIGINT, signal.SIG_IGN))
        with pool:
            # a worker's error: raised
            for out in pool.imap_unordered(_train_quietly, [(c, threads) for c in runs]):
                c = by_out[out]
                evals[c.out] = [(r["step"], r["eval_acc"]) for r in gmts.read_metrics(c.out)
                                if "eval_acc" in r]
                log(f"{os.path.basename(c.out)}: eval_acc {evals[c.out][0][1]:.3f} -> "
                    f"{evals[c.out][-1][1]:.3f}")
        arm_of = {c.out: os.path.basename(c.out).rpartition("-s")[0] for c in runs}
        table = {m: [(evals[c.out][0][1], evals[c.out][-1][1]) for c in runs if arm_of[c.out] == m]
                 for m in methods}
        lines = [f"| method | eval_acc at step 0 | final eval_acc (mean +- std over {seeds} seeds) "
                 f"| standard error of one accuracy (eval_size {cfg.eval_size}) | "
                 f"per seed ({', '.join(f's{c.seed}' for c in runs[:seeds])}) |",
                 "|---|---|---|---|---|"]
        for m, v in table.items():
            fin = torch.tensor([b for _, b in v], dtype=torch.float64)
            p = float(fin.mean())
            lines.append(f"| {m} | {sum(a for a, _ in v) / len(v):.3f} | "
                         f"{p:.3f} +- {float(fin.std(unbiased=False)):.3f} | "
                         f"{math.sqrt(p * (1 - p) / cfg.eval_size):.3f} | "
                         + ", ".join(f"{b:.3f}" for _, b in v) + " |")
        gmts.write_file(os.path.join(cfg.out, "compare.md"), "\n".join(lines) + "\n")
        plot_runs({m: [c.out for c in runs if arm_of[c.out] == m] for m in methods},
                  os.path.join(cfg.out, "compare.png"))
        log("\n".join(lines))
        return table


PAIRS = (("gmts", "entropy"), ("gmts@batch", "entropy"), ("gmts", "gmts@batch"),
         ("gradnorm", "entropy"), ("gmts", "gradnorm"), ("gmts", "all"))
# Student's t, 0.975 quantile, by degrees of freedom (standard table values);
# above 30, the normal 1.960
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
        18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
        26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}

def ci95(v: list) -> tuple:
    """The 95% interval of the mean by Student's t over len(v) values (paired seeds):
    mean -+ t * SE."""
    mean = sum(v) / len(v)
    half = T975.get(len(v) - 1, 1.960) * _se(v)
    return mean - half, mean + half

def read_json(path: str):
    """A JSON file's value; BadInput (one line) naming the file if it cannot be read as one."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise gmts.BadInput(f"{path}: not readable as JSON ({type(e).__name__})") from None

def number(value, where: str):
    """value if it is a real number (not a bool), else BadInput (one line) saying where it was."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise gmts.BadInput(f"{where}: {value!r} is not a number")
    return value

# the fields of a run's run_config.json that report and decoy read
READ = ("steps", "task", "data", "seed", "eval_size", "short_prompt", "chat_template",
        "max_new_tokens")

def run_config(path: str) -> dict:
    """A run's run_config.json; BadInput (one line) unless it is an object with READ's fields
    (steps at least) of the types gmts.Config gives them."""
    file = os.path.join(path, "run_config.json")
    saved = read_json(file)
    if not (isinstance(saved, dict) and "steps" in saved and all(
            type(saved[k]) is type(getattr(gmts.Config, k)) for k in READ if k in saved)):
        raise gmts.BadInput(f"{file}: not a gmts run's config ({', '.join(READ)} of their types)")
    return saved

def finished_runs(folder: str) -> dict:
    """{method: {seed: [(step, eval_acc), ...]}} of compare's finished runs in folder
    (METHOD-sSEED folders whose last eval_acc is at the run's last step). A run still going or
    stopped early is left out; a malformed one is a BadInput (one line)."""
    runs = collections.defaultdict(dict)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        method, _, seed = name.rpartition("-s")
        path = os.path.join(folder, name)
        has_config = os.path.isfile(os.path.join(path, "run_config.json"))
        if is_arm(method) and seed.isdigit() and has_config:
            steps = run_config(path)["steps"]
            curve = [(r["step"], number(r["eval_acc"], f"{path} step {r['step']} eval_acc"))
                     for r in gmts.read_metrics(path) if "eval_acc" in r]
            if curve and curve[-1][0] == steps:
                runs[method][int(seed)] = curve
    return dict(runs)

def final_truncated(folder: str, runs: dict) -> dict:
    """{method: {seed: truncated_frac of the run's last step}} for finished_runs' runs."""
    out = {}
    for m, by_seed in runs.items():
        out[m] = {}
        for seed in by_seed:
            recs = [r for r in gmts.read_metrics(os.path.join(folder, f"{m}-s{seed}"))
                    if "truncated_frac" in r]
            where = os.path.join(folder, f"{m}-s{seed}", "metrics.jsonl truncated_frac")
            out[m][seed] = number(recs[-1]["truncated_frac"], where) if recs else math.nan
    return out

def report_tables(runs: dict, truncated: dict = None, pairs=PAIRS, value=None,
                  what: str = "final eval_acc") -> str:
    """Markdown: a measure of each run's curve per method (value(curve); default its final
    held-out accuracy) as mean +- std, SE of the mean over seeds, per seed (with `truncated`, each
    run's final truncated_frac), then the paired differences by seed for `pairs` over the seeds
    both methods finished: mean +- SE and the 95% t interval; a difference counts only if that
    interval excludes 0."""
    value = value or (lambda curve: curve[-1][1])
    lines = [f"| method | seeds | eval_acc at step 0 | {what}, mean +- std | SE of the mean "
             "| per seed |",
             "|---|---|---|---|---|---|"]
    for m, by_seed in runs.items():
        fin = [value(c) for c in by_seed.values()]
        mean, std = _mean(fin)
        cells = []
        for s, c in sorted(by_seed.items()):
            cells.append(f"s{s} {value(c):.3f}")
            if truncated:
                cells[-1] += f" (trunc {truncated[m][s]:.2f})"
        lines.append(f"| {m} | {len(fin)} | {_mean([c[0][1] for c in by_seed.values()])[0]:.3f} | "
                     f"{mean:.3f} +- {std:.3f} | {_se(fin):.3f} | " + ", ".join(cells) + " |")
    lines += ["", "| paired by seed | seeds | mean difference +- SE | 95% interval (t) "
                  "| excludes 0 | per seed |",
              "|---|---|---|---|---|---|"]
    for a, b in pairs:
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        d = [value(runs[a][s]) - value(runs[b][s]) for s in seeds]
        if len(d) < 2:
            continue
        lo, hi = ci95(d)
        lines.append(f"| {a} - {b} | {len(d)} | {_mean(d)[0]:+.3f} +- {_se(d):.3f} | "
                     f"[{lo:+.3f}, {hi:+.3f}] | {'yes' if lo > 0 or hi < 0 else 'no'} | "
                     + ", ".join(f"{x:+.3f}" for x in d) + " |")
    return "\n".join(lines)

def _se(v: list) -> float:
    """Standard error of the mean: sample std (n - 1) / sqrt(n); NaN for fewer than 2 values."""
    return (float(torch.tensor(v, dtype=torch.float64).std() / math.sqrt(len(v))) if len(v) > 1
            else math.nan)

def fixed_guess_line(folder: str, runs: dict) -> float:
    """best_fixed_guess_acc on each seed's held-out rows (from its runs' run_config.json), mean over
    the seeds; NaN unless the data is --data easy."""
    accs = []
    for seed in sorted({s for by_seed in runs.values() for s in by_seed}):
        m = next(m for m, by_seed in runs.items() if seed in by_seed)
        saved = run_config(os.path.join(folder, f"{m}-s{seed}"))
        cfg = gmts.Config(**{k: saved[k] for k in ("task", "data", "seed", "eval_size")
                             if k in saved})
        if cfg.data != "easy":
            # the easy variants' content is a sign pattern, an operation, a role pattern
            return math.nan
        accs.append(best_fixed_guess_acc(cfg.task, gmts.read_data(cfg).held))
    return sum(accs) / len(accs) if accs else math.nan

def plot_curves(ax, runs: dict, title: str, fixed: float = math.nan):
    """Mean held-out accuracy vs step per method, a band of +- one std over seeds (steps every seed
    logged); a dashed line at `fixed`, what the best content that ignores the prompt gets."""
    for m, by_seed in runs.items():
        steps = sorted(set.intersection(*(set(s for s, _ in c) for c in by_seed.values())))
        acc = torch.tensor([[dict(c)[t] for t in steps] for c in by_seed.values()],
                           dtype=torch.float64)  # (seeds, T)
        mean, std = acc.mean(0), acc.std(0, unbiased=False)
        # one colour per method in every panel, a line style per scope
        line, = ax.plot(steps, mean.tolist(), marker=".", label=f"{m} ({len(by_seed)} seeds)",
                        **arm_style(m))
        ax.fill_between(steps, (mean - std).tolist(), (mean + std).tolist(), color=line.get_color(),
                        alpha=0.15)
    if not math.isnan(fixed):
        ax.axhline(fixed, color="gray", linestyle="--", linewidth=1,
                   label=f"best fixed content ({fixed:.3f})")
    ax.set(title=title, xlabel="step", ylabel="held-out greedy accuracy")
    ax.legend(fontsize=8)

def report(panels: dict, png: str, log=print) -> dict:
    """panels: title -> a compare --out folder. Prints each folder's tables; one figure with a panel
    per folder (mean and +- std band over seeds per method)."""
    from matplotlib.figure import Figure

    runs = {title: finished_runs(folder) for title, folder in panels.items()}
    fig = Figure(figsize=(5 * len(panels), 3.8))
    for ax, (title, r) in zip(fig.subplots(1, len(panels), squeeze=False)[0], runs.items()):
        if not r:
            raise gmts.BadInput(f"{panels[title]}: no finished compare runs (METHOD-sSEED folders)")
        fixed = fixed_guess_line(panels[title], r)
        tables = report_tables(r, final_truncated(panels[title], r))
        log(f"## {title} ({panels[title]})\n\n{tables}\n\n"
            f"best fixed content on the held-out rows (mean over seeds): {fixed:.3f}\n")
        plot_curves(ax, r, title, fixed)
    fig.tight_layout()
    save_figure(fig, png)
    return runs


# --------------------------------------------------------------------------------------------------
# Analysis [paper: the claim] what does the kept tokens' gradient keep of the whole batch's, and
# does |H * omega| rank tokens by their true gradient norm better than H does?
# --------------------------------------------------------------------------------------------------
# each at its default scope (gmts.selection_rule)
ANALYZED = ("random", "entropy", "gmts", "gradnorm")

def flat_grad(model) -> torch.Tensor:
    """Every parameter's .grad (zeros where None) as one fp64 vector, (P,)."""
    return torch.cat([p.grad.flatten().double() if p.grad is not None
                      else torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
                      for p in model.parameters()])

def gradient_retention(model, batch: dict, adv: torch.Tensor, cfg: gmts.Config, methods=ANALYZED,
                       seed: int = 0) -> dict:
    """{arm: (cos(g_S, g_all), |g_S| / |g_all|, low-|A| share)} on one batch at cfg.rho, on-policy
    (ratio = 1). An arm is a method at its default scope or METHOD@SCOPE (parse_arm).

    g_S is the parameter gradient of the kept tokens' loss, g_all that of every valid token's, both
    with --loss-norm's weights of the full batch (selected: the valid count), so that selection is a
    pure masking of one sum; omega is that loss's (gmts.omega). Tokens add and cancel, so this is
    what an update keeps, not a per-token ranking. The low-|A| share: of the kept tokens, those in
    groups whose mean |A| is below the median over the batch's informative groups (a group whose A
    is 0 everywhere is below it). NaN where g_all is 0 (every A = 0)."""
    return retention_at(model, batch, adv, cfg, (cfg.rho,), methods, seed)[cfg.rho]

def low_adv_rows(adv: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool: the answers of the groups whose mean |A| is below the median over the
    informative groups."""
    group_abs = adv.abs().view(-1, group_size).mean(1)  # (B,)
    live = group_abs > 0
    if not live.any():
        return torch.ones_like(adv, dtype=torch.bool)
    median = torch.quantile(group_abs[live].double(), 0.5).float()
    return (group_abs < median).repeat_interleave(group_size)

def retention_at(model, batch: dict, adv: torch.Tensor, cfg: gmts.Config, rhos, methods=ANALYZED,
                 seed: int = 0) -> dict:
    """gradient_retention at each rho of rhos -> {rho: {arm: (cos, ratio, low)}}. The token
    statistics and g_all are computed once; random draws the same scores at every rho (its kept sets
    are nested, as the others')."""
    mask = batch["resp_mask"]  # (N, T)
    logp, entropy, dz_norm = gmts.batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch,
                                                    cfg.stats_chunk)
    weights = gmts.loss_weights(cfg.loss_norm, mask, int(mask.sum()), cfg.group_size)
    objective = gmts.Objective(cfg.clip_low, cfg.clip_high, 0.0, cfg.temperature, **weights)
    om = gmts.omega(adv, torch.ones_like(logp), cfg.clip_low, cfg.clip_high, **weights)  # (N, T)
    low = low_adv_rows(adv, cfg.group_size)[:, None] & mask  # (N, T)

    def grad(sel):
        model.zero_grad(set_to_none=True)
        gmts.loss_backward(model, batch, adv, sel, logp, objective, micro_batch=cfg.micro_batch,
                           chunk=cfg.stats_chunk)
        return flat_grad(model)
    g_all = grad(mask)
    n_all = float(g_all.norm())
    scores = {}
    for arm in methods:
        noise = torch.Generator().manual_seed(seed)
        scores[arm] = gmts.token_scores(parse_arm(arm)[0], entropy, dz_norm, om, noise)
    res = {}
    for rho in rhos:
        res[rho] = {}
        for arm in methods:
            if n_all == 0:  # every A = 0: no gradient to retain
                res[rho][arm] = (math.nan, math.nan, math.nan)
                continue
            method = parse_arm(arm)[0]
            keep, group_size = gmts.selection_rule(
                dataclasses.replace(cfg, rho=rho, **arm_fields(arm, cfg)))
            nonzero = not gmts.METHODS[method].zero_kept
            sel = gmts.select_tokens(scores[arm], mask, keep, nonzero, group_size)
            g = grad(sel)
            n_s = float(g.norm())
            cos = float(g @ g_all) / (n_s * n_all) if n_s > 0 else 0.0
            res[rho][arm] = (cos, n_s / n_all, float((sel & low).sum()) / max(int(sel.sum()), 1))
    model.zero_grad(set_to_none=True)
    return res

def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation with average ranks for ties; NaN when either side is constant.
    (n,), (n,) -> float"""
    def ranks(x):
        r = torch.empty(len(x), dtype=torch.float64)
        r[x.argsort()] = torch.arange(len(x), dtype=torch.float64)
        _, inv = torch.unique(x, return_inverse=True)
        return (torch.zeros(int(inv.max()) + 1, dtype=torch.float64).index_add_(0, inv, r)
                / inv.bincount())[inv]
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a.double().cpu()), ranks(b.double().cpu())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float((ra.square().sum() * rb.square().sum()).sqrt())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")

def param_grad_norms(model, batch: dict, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """TRUE per-token gradient norm w.r.t. all parameters,
    ||d l_t / d theta|| = |A_i| * ||d logp_t / d theta|| (on-policy: ratio = 1, omega = A), by one
    autograd backward per token. rows, cols (K,) index tokens -> (K,)."""
    params = [p for p in model.parameters() if p.requires_grad]
    head = model.get_output_embeddings()
    uniq, where = torch.unique(rows, return_inverse=True)
    h = gmts.response_hidden(model, batch, uniq)  # (u, T, d)
    logp = gmts.head_logp(h[where, cols], head, batch["comp_ids"][rows, cols], temperature)  # (K,)
    out = []
    for k in range(len(rows)):
        g = torch.autograd.grad(logp[k], params, retain_graph=k < len(rows) - 1, allow_unused=True)
        out.append(float(torch.sqrt(sum((x.float() ** 2).sum() for x in g if x is not None))))
    return adv[rows].abs().cpu() * torch.tensor(out)

def ranking_study(model, batch: dict, adv: torch.Tensor, temperature: float, max_tokens: int = 256,
                  per_answer: int = 24, seed: int = 0) -> dict:
    """Spearman correlation of each score with (a) the exact logit-gradient norm |omega| * dz_norm
    and (b) the parameter-gradient norm, within answers (mean over answers) and across the sampled
    tokens of the batch. Tokens: up to per_answer random ones from random answers with A != 0 (an
    A = 0 token's norm is exactly 0, and such ties would decide a batch ranking).
    -> {(method, 'logit_within' | ...): float}"""
    g = torch.Generator().manual_seed(seed)
    logp, entropy, dz_norm = gmts.batch_token_stats(model, batch, temperature, 8, 1024)
    mask = batch["resp_mask"].cpu()
    live = (adv != 0).cpu()
    rows, cols = [], []
    for i in torch.randperm(mask.shape[0], generator=g).tolist():
        valid = mask[i].nonzero().squeeze(1) if live[i] else torch.zeros(0, dtype=torch.long)
        take = valid[torch.randperm(len(valid), generator=g)[:per_answer]]
        rows += [i] * len(take)
        cols += take.tolist()
        if len(rows) >= max_tokens:
            break
    rows, cols = (torch.tensor(rows[:max_tokens], dtype=torch.long),
                  torch.tensor(cols[:max_tokens], dtype=torch.long))
    om = adv[:, None].expand_as(entropy)  # omega = A on-policy
    r_, c_ = rows.to(entropy.device), cols.to(entropy.device)
    targets = dict(logit=(om.abs() * dz_norm)[r_, c_].cpu(),
                   param=(param_grad_norms(model, batch, adv, r_, c_, temperature) if len(rows)
                          else torch.zeros(0)))
    res = {}
    for m in ANALYZED:
        s = gmts.token_scores(m, entropy, dz_norm, om, g)[r_, c_].cpu()
        for t, y in targets.items():
            within = [spearman(s[rows == i], y[rows == i]) for i in rows.unique().tolist()]
            within = [w for w in within if not math.isnan(w)]
            res[(m, f"{t}_within")] = sum(within) / len(within) if within else float("nan")
            res[(m, f"{t}_batch")] = spearman(s, y)
    return res

def sample_parts(model, tok, task: dict, draw, chat: bool, cfg: gmts.Config, key) -> list:
    """Steps 1-4 of gmts.train with dynamic sampling: rollout batches [(batch, rewards, adv), ...]
    of B prompts each, until B groups have unequal rewards or cfg.max_resample batches are drawn.
    parts[0] is the raw batch."""
    B, G, parts = cfg.prompts_per_step, cfg.group_size, []
    while len(parts) < cfg.max_resample:
        rows = draw(B, key, len(parts))
        prompts = gmts.build_prompts(tok, task, rows, chat, cfg.short_prompt, cfg.prompt_style)
        batch = gmts.rollout(model, tok, prompts, G,
                             cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        # (N,) each: the rewards and the advantages
        answered = [r for r in rows for _ in range(G)]
        rewards = gmts.grade_answers(task, batch["texts"], answered)[0]
        adv = gmts.group_advantages(rewards, G, cfg.std_normalize).to(batch["comp_ids"].device)
        parts.append((batch, rewards, adv))
        if sum(int(gmts.informative(r, G).sum()) for _, r, _ in parts) >= B:
            break
    return parts

SPEARMAN_COLS = ("logit_within", "logit_batch", "param_within", "param_batch")

def scatter_points(model, batch: dict, adv: torch.Tensor, cfg: gmts.Config) -> dict:
    """Every valid token of one batch, on-policy (ratio 1), omega that of cfg's loss (gmts.omega,
    the weights of the whole batch) -> {"H": entropy, "gmts": H * |omega|, "grad": |omega| *
    dz_norm = ||dL/dz|| (derivation step 3), "abs_adv": |A| of its answer}, (n,) each."""
    mask = batch["resp_mask"]  # (N, T)
    logp, entropy, dz_norm = gmts.batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch,
                                                    cfg.stats_chunk)
    weights = gmts.loss_weights(cfg.loss_norm, mask, int(mask.sum()), cfg.group_size)
    om = gmts.omega(adv, torch.ones_like(logp), cfg.clip_low, cfg.clip_high, **weights)  # (N, T)
    points = dict(H=entropy, gmts=gmts.token_scores("gmts", entropy, dz_norm, om),
                  grad=gmts.token_scores("gradnorm", entropy, dz_norm, om),
                  abs_adv=adv.abs()[:, None].expand_as(entropy))
    return {k: v[mask].float().cpu() for k, v in points.items()}

def scatter(png: str, tasks=("countdown", "math", "logic"), log=print) -> dict:
    """scatter_points on the first raw batch of each task's warm start (retention_curve's batch 0
    at seed 0), drawn into png: a row per task, H against H * |omega| and against ||dL/dz||,
    coloured by |A|. Logs a table of Spearman correlations (H with each, and H * |omega| with the
    exact norm) over all tokens and over those with A != 0.
    -> {task: scatter_points}"""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.2 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), 2, squeeze=False)
    lines = ["| warm start | tokens | with A = 0 | Spearman(H, H\\|omega\\|): all, A != 0 | "
             "Spearman(H, \\|dL/dz\\|): all, A != 0 | Spearman(H\\|omega\\|, \\|dL/dz\\|): all, "
             "A != 0 |", "|---|---|---|---|---|---|"]
    res = {}
    for row, task in zip(axes, tasks):
        cfg = dataclasses.replace(warm_config(task), max_resample=1)  # the raw batch
        gmts.set_seed(cfg.seed * 1_000_003)
        model, tok = gmts.load_model(cfg.model, gmts.pick_device(cfg.device), cfg.tiny_hidden,
                                     cfg.tiny_layers, cfg.seed)
        chat = gmts.use_chat(tok, cfg.chat_template)
        batch, _, adv = sample_parts(model, tok, gmts.get_task(task), gmts.read_data(cfg).draw,
                                     chat, cfg, ("analyze", 0))[0]
        pts = res[task] = scatter_points(model, batch, adv, cfg)
        live = pts["abs_adv"] > 0
        cells = []
        for x, y in (("H", "gmts"), ("H", "grad"), ("gmts", "grad")):
            cells.append(f"{spearman(pts[x], pts[y]):.3f}, "
                         f"{spearman(pts[x][live], pts[y][live]):.3f}")
        lines.append(f"| warm/{os.path.basename(WARM[task]['out'])} | {len(live)} | "
                     f"{1 - float(live.float().mean()):.2f} | " + " | ".join(cells) + " |")
        names = ("H * |omega| (GMTS)", "||dL/dz|| (exact)")
        for ax, key, name in zip(row, ("gmts", "grad"), names):
            dots = ax.scatter(pts["H"], pts[key], c=pts["abs_adv"], s=3, cmap="viridis")
            ax.set_xlabel("entropy H (nats)")
            ax.set_ylabel(name)
            ax.set_title(f"{task}: H against {name}", fontsize=9)
        fig.colorbar(dots, ax=row.tolist(), label="|A| of the answer")
    save_figure(fig, png, dpi=110)
    log("\n".join(lines))
    return res

@contextlib.contextmanager
def _analysis(cfg: gmts.Config, batches: int):
    """What analyze and retention_curve share: OUT claimed until the with ends (gmts.py's folder
    rule: an analysis there only with --overwrite), then the model loaded
    -> (model, tok, task, draw, chat)."""
    if batches < 1:
        raise gmts.BadInput(f"--batches must be >= 1, got {batches}")
    with gmts.claim_folder(cfg.out, WRITES["analyze"], "gmts_lab_analyze", **folder_rules(cfg)):
        device = gmts.pick_device(cfg.device)
        gmts.set_seed(cfg.seed)
        task = gmts.get_task(cfg.task)  # sample_parts builds its prompts in --prompt-style
        draw = gmts.read_data(cfg).draw
        model, tok = gmts.load_model(cfg.model, device, cfg.tiny_hidden, cfg.tiny_layers,
                                     cfg.seed)
        yield model, tok, task, draw, gmts.use_chat(tok, cfg.chat_template)

def _save_analysis(out: str, name: str, value):
    """analyze's result as OUT/name, the earlier analysis's files gone first (gmts.clear_folder)."""
    gmts.clear_folder(out, WRITES["analyze"], "gmts_lab_analyze")
    gmts.write_file(os.path.join(out, name), json.dumps(value, indent=1))

def _nothing_to_analyse(cfg: gmts.Config, batches: int):
    return gmts.RunError(f"nothing to analyse: in all {batches} batch(es) every group's answers "
                         f"earn one reward (A = 0 everywhere); {cfg.model} earns no signal on "
                         "these problems")

def analyze(cfg: gmts.Config, batches: int, log=print, arms=ANALYZED) -> dict:
    """Roll out `batches` batches from cfg.model and print one table: per arm, cos(g_S, g_all) and
    |g_S|/|g_all| (mean +- std over batches) on the raw batch (filter off) and on its
    dynamic-sampling version (filter on: informative groups only, more drawn as in train), and the
    ranking study of its method on the raw batch. OUT/analysis.json."""
    with _analysis(cfg, batches) as (model, tok, task, draw, chat):
        acc = collections.defaultdict(list)
        for b in range(batches):
            gmts.set_seed(cfg.seed * 1_000_003 + b)
            parts = sample_parts(model, tok, task, draw, chat, cfg, ("analyze", b))
            raw = parts[0]
            on = gmts.filter_groups(parts, cfg.group_size, cfg.prompts_per_step,
                                    tok.pad_token_id)[:3]
            # filter_groups fills up with dead groups
            live = int(gmts.informative(on[1], cfg.group_size).sum())
            log(f"batch {b + 1}/{batches}: reward {raw[1].mean():.3f}, "
                f"{int((raw[2] == 0).sum())}/{len(raw[2])} answers with A = 0; "
                f"filter on: {len(parts)} rollout batch(es), {live} informative groups")
            if not (raw[2] != 0).any():  # every A = 0: no gradient to compare, nothing ranks
                continue
            for name, (batch, _, adv) in (("off", raw), ("on", on)):
                for m, (cos, ratio, _) in gradient_retention(model, batch, adv, cfg, arms,
                                                             seed=cfg.seed + b).items():
                    acc[f"{m}/cos_{name}"].append(cos)
                    acc[f"{m}/ratio_{name}"].append(ratio)
            for (m, c), v in ranking_study(model, raw[0], raw[2], cfg.temperature,
                                           seed=cfg.seed + b).items():
                acc[f"{m}/{c}"].append(v)
        if not acc:
            raise _nothing_to_analyse(cfg, batches)
        res = {k: (v if "/cos_" in k or "/ratio_" in k else _mean(v)[0]) for k, v in acc.items()}
        log(analysis_table(res, arms))
        _save_analysis(cfg.out, "analysis.json", res)
        return res

def parse_rhos(text: str) -> list:
    """'0.01,0.05' -> [0.01, 0.05], each in (0, 1]; BadInput (one line) otherwise."""
    try:
        rhos = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rhos = []
    if not rhos or not all(0 < r <= 1 for r in rhos):
        raise gmts.BadInput(f"--rhos {text!r}: a comma list of values in (0, 1], "
                            "e.g. 0.01,0.05,0.2")
    return sorted(set(rhos))

def retention_curve(cfg: gmts.Config, batches: int, rhos: list, log=print, arms=ANALYZED) -> dict:
    """The kept-gradient curve: on `batches` raw rollout batches of cfg.model (filter off, as the
    comparison grid; the batches of analyze), cos(g_S, g_all), |g_S|/|g_all| and the low-|A| share
    (gradient_retention) per rho and arm
    -> {rho: {arm: {"cos": [...], "ratio": [...], "low": [...]}}}, one value per batch. Prints the
    tables and writes OUT/retention.json."""
    with _analysis(cfg, batches) as (model, tok, task, draw, chat):
        one = dataclasses.replace(cfg, max_resample=1)  # the raw batch only
        res = {r: {m: {"cos": [], "ratio": [], "low": []} for m in arms} for r in rhos}
        for b in range(batches):
            gmts.set_seed(cfg.seed * 1_000_003 + b)
            parts = sample_parts(model, tok, task, draw, chat, one, ("analyze", b))
            batch, rewards, adv = parts[0]
            log(f"batch {b + 1}/{batches}: reward {rewards.mean():.3f}, "
                f"{int((adv == 0).sum())}/{len(adv)} answers with A = 0")
            if not (adv != 0).any():  # no gradient to compare
                continue
            for r, by_arm in retention_at(model, batch, adv, cfg, rhos, arms,
                                          seed=cfg.seed + b).items():
                for m, (cos, ratio, low) in by_arm.items():
                    res[r][m]["cos"].append(cos)
                    res[r][m]["ratio"].append(ratio)
                    res[r][m]["low"].append(low)
        if not res[rhos[0]][arms[0]]["cos"]:
            raise _nothing_to_analyse(cfg, batches)
        log(retention_table(res))
        _save_analysis(cfg.out, "retention.json", {str(r): v for r, v in res.items()})
        return res

RETAINED = {"cos": "cos(g_S, g_all)", "ratio": "\\|g_S\\|/\\|g_all\\|",
            "low": "share of kept tokens in low-\\|A\\| groups"}

def retention_table(res: dict) -> str:
    """Markdown: per quantity of RETAINED that res holds, a table with a row per rho and a column
    per arm (mean +- population std over batches)."""
    arms = list(next(iter(res.values())))
    tables = []
    for key, title in RETAINED.items():
        # a curve of an earlier version: no low-|A| share
        if key not in res[next(iter(res))][arms[0]]:
            continue
        lines = [f"| rho: {title} | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
        for r, by_arm in res.items():
            cells = ["{:.3f} +- {:.3f}".format(*_mean(by_arm[m][key])) for m in arms]
            lines.append(f"| {float(r):g} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)

def read_retention(folder: str) -> dict:
    """retention_curve's result from OUT/retention.json
    -> {rho (float): {arm: {"cos": [...], "ratio": [...], ...}}}; BadInput (one line) unless
    every rho holds the same arms (METHOD[@SCOPE]), each the same lists of numbers, cos and ratio
    among them."""
    path = os.path.join(folder, "retention.json")
    res = read_json(path)
    try:
        res = {float(r): {m: {k: [number(x, path) for x in v] for k, v in stats.items()}
                          for m, stats in by_arm.items()} for r, by_arm in res.items()}
    except (AttributeError, TypeError, ValueError):  # not {rho: {arm: {key: [number, ...]}}}
        res = {}
    arms = {tuple(by_arm) for by_arm in res.values()}
    keys = {frozenset(stats) for by_arm in res.values() for stats in by_arm.values()}
    if len(arms) != 1 or len(keys) != 1 or not {"cos", "ratio"} <= set(*keys) or not all(
            map(is_arm, *arms)):
        raise gmts.BadInput(f"{path}: not a retention curve of analyze --rhos "
                            "({rho: {arm: {cos: [...], ratio: [...]}}} alike for every rho)")
    return dict(sorted(res.items()))

def retention(panels: dict, png: str, log=print) -> dict:
    """panels: title -> an analyze --rhos folder. Prints each folder's table; one figure, a panel
    per folder: cos(g_S, g_all) vs rho (log axis), a line per arm with a +- std bar over batches
    (arm_style: a colour per method, solid for the group scope, dashed for the batch)."""
    from matplotlib.figure import Figure

    curves = {title: read_retention(folder) for title, folder in panels.items()}
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    for ax, (title, res) in zip(fig.subplots(1, len(panels), squeeze=False)[0], curves.items()):
        log(f"## {title} ({panels[title]})\n\n{retention_table(res)}\n")
        rhos = list(res)
        for m in next(iter(res.values())):
            stats = [_mean(res[r][m]["cos"]) for r in rhos]
            ax.errorbar(rhos, [s[0] for s in stats], yerr=[s[1] for s in stats], marker=".",
                        capsize=2, label=m, **arm_style(m))  # the styles of report's panels
        ax.set_xscale("log")
        ax.set(title=title, xlabel="rho (share of tokens kept)", ylabel="cos(g_S, g_all)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)
    return curves

def _mean(v: list) -> tuple:
    """(mean, population std) of the non-NaN values; NaN, NaN if there are none."""
    x = torch.tensor([a for a in v if not math.isnan(a)], dtype=torch.float64)
    return (float(x.mean()), float(x.std(unbiased=False))) if len(x) else (math.nan, math.nan)

def analysis_table(res: dict, arms=ANALYZED) -> str:
    """The markdown table of analyze's result, a row per arm (its method's Spearman cells).
    gradnorm's score IS the logit-gradient norm: those cells are 1 by construction, labelled as the
    identity, not a finding."""
    head = ("| score | cos(g_S, g_all) filter off | \\|g_S\\|/\\|g_all\\| filter off | "
            "cos(g_S, g_all) filter on | \\|g_S\\|/\\|g_all\\| filter on | "
            "Spearman vs logit-grad norm, within answers | same, batch (A != 0) | "
            "Spearman vs param-grad norm, within answers | same, batch (A != 0) |")
    lines = [head, "|---" * 9 + "|"]
    for arm in arms:
        m = parse_arm(arm)[0]
        cells = ["{:.3f} +- {:.3f}".format(*_mean(res[f"{arm}/{k}_{f}"])) for f in ("off", "on")
                 for k in ("cos", "ratio")]
        cells += ["1 (identity)" if m == "gradnorm" and c.startswith("logit")
                  else f"{res[f'{m}/{c}']:.3f}"
                  for c in SPEARMAN_COLS]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI [plumbing]: gmts.run_cli is the one error handler; gmts.py's folder rule for every output
# --------------------------------------------------------------------------------------------------

# compare's run of an arm and a seed: METHOD-sSEED or METHOD@SCOPE-sSEED (parse_arm's arms)
ARM_RUN = rf"({'|'.join(map(re.escape, gmts.METHODS))})(@({'|'.join(SCOPES)}))?-s\d+"
# The names (re.fullmatch) each command that writes a folder writes there, all that its
# --overwrite removes: warm the tiny model and its tokenizer (save_pretrained), compare its table,
# plot and a run folder per arm and seed, analyze its JSON (analysis.json, or retention.json).
WRITES = {
    "warm": (r"config\.json", r"generation_config\.json", r"model\.safetensors",
             r"tokenizer(_config)?\.json", r"chat_template\.jinja"),
    "compare": (r"compare\.md", r"compare\.png", ARM_RUN),
    "analyze": (r"analysis\.json", r"retention\.json"),
}

def folder_rules(cfg: gmts.Config) -> dict:
    """gmts.check_folder's rules for compare and analyze: gmts.py's of cfg (--overwrite, --model,
    the data files read), with no --resume."""
    return dict(gmts.folder_rules(cfg), resume=None, scratch=())

def save_figure(fig, png: str, dpi: int = 90):
    """fig into png (checked first: gmts.check_file), its folder made if need be."""
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=dpi)

def main(argv=None):
    return gmts.run_cli("gmts_lab", lambda: _main(argv))

def parser() -> argparse.ArgumentParser:
    """The lab's commands and their own flags; compare's, analyze's and decoy's other flags go to
    gmts.parse_args."""
    p = argparse.ArgumentParser(prog="gmts_lab.py", allow_abbrev=False,
                                description="The experiments around gmts.py (see the module "
                                            "docstring).")
    p.error = gmts.bad_flag
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, gmts_flags: bool = False) -> argparse.ArgumentParser:
        # allow_abbrev=False: else compare's --seeds would take gmts.py's --seed
        c = commands.add_parser(name, help=help, allow_abbrev=False,
                                description=help + ("; gmts.py's flags too" if gmts_flags else ""))
        c.error = gmts.bad_flag
        return c

    def figure(c: argparse.ArgumentParser, panels: str = ""):
        if panels:
            c.add_argument("panels", nargs="+", help=f"TITLE=FOLDER: {panels} folder per panel")
        c.add_argument("--png", required=True, help="the figure")
        c.add_argument("--overwrite", action="store_true", help="replace an existing --png file")

    c = command("warm", "rebuild a committed warm start")
    c.add_argument("--task", default="countdown", choices=sorted(WARM),
                   help="the warm start to build")
    c.add_argument("--out", default=None, help="folder for the model and tokenizer "
                                               "(default: warm/cpu, or warm/TASK)")
    c = command("compare", "methods x seeds, each a gmts run from the same --model", True)
    c.add_argument("--methods", default="all,entropy,gmts",
                   help="comma list of --select methods, each maybe METHOD@SCOPE (gmts@batch)")
    c.add_argument("--seeds", type=int, default=3, help="seeds per method, from --seed on")
    c.add_argument("--workers", type=int, default=0,
                   help="parallel processes (0: one per CPU core)")
    figure(command("report", "tables and learning curves of compare folders"), "a compare --out")
    c = command("analyze", "what the kept tokens' gradient retains, and the rankings", True)
    c.add_argument("--batches", type=int, default=2, help="rollout batches")
    c.add_argument("--rhos", default="",
                   help="a comma list of rho values: the kept-gradient curve "
                        "(OUT/retention.json) instead of the one-rho table")
    c.add_argument("--arms", default=",".join(ANALYZED),
                   help="comma list of METHOD or METHOD@SCOPE (gmts@batch: the whole-batch "
                        "variant); a method alone ranks at --scope (auto: its default)")
    figure(command("retention", "the kept-gradient curves' tables and figure"),
           "an analyze --rhos --out")
    command("decoy", "held-out accuracy with another problem's target shown", True)
    figure(command("scatter", "entropy against the GMTS score and the exact norm"))
    return p

def _main(argv):
    lab, rest = parser().parse_known_args(argv)
    if lab.command in ("warm", "report", "retention", "scatter"):
        if rest:
            gmts.bad_flag(f"unrecognized arguments: {' '.join(rest)}")
        return (warm_main if lab.command == "warm" else figure_main)(lab)
    cfg = gmts.parse_args(rest)
    gmts.check_config(cfg)
    if lab.command == "compare":
        methods = [m.strip() for m in lab.methods.split(",") if m.strip()]
        return compare(cfg, methods, lab.seeds, lab.workers)
    if lab.command == "decoy":
        return decoy_main(cfg)
    arms = [a.strip() for a in lab.arms.split(",") if a.strip()]
    # none: one line, as a malformed arm; the one-rho table scores ANALYZED only
    for arm in arms or [","]:
        method = parse_arm(arm, "--arms")[0]
        if method not in ANALYZED and not lab.rhos:
            raise gmts.BadInput(f"--arms: {arm} is not scored by the one-rho table "
                                f"({', '.join(ANALYZED)}; with --rhos: any top-rho method)")
        if gmts.METHODS[method].band:  # its kept share is set by its interval, not by rho
            raise gmts.BadInput(f"--arms: {arm} keeps an interval, not a top rho: "
                                "analyze ranks top-rho methods only")
    if lab.rhos:
        return retention_curve(cfg, lab.batches, parse_rhos(lab.rhos), arms=arms)
    return analyze(cfg, lab.batches, arms=arms)

def warm_main(a: argparse.Namespace):
    out = a.out or WARM[a.task]["out"]
    model, tok = warm_start(out, a.task)
    cfg = warm_config(a.task)
    rows = gmts.read_data(cfg).held
    chance = (f"random content gets {random_content_acc(a.task, rows):.3f}, "
              f"the best fixed content {best_fixed_guess_acc(a.task, rows):.3f}")
    if a.task == "countdown":
        ev = decoy_eval(model, tok, rows, gmts.use_chat(tok, cfg.chat_template),
                        cfg.short_prompt, cfg.max_new_tokens)
        print(f"saved {out} | held-out (the preset's, seed 0): "
              f"acc {ev['real_acc']:.3f} ({chance}), well-formed {ev['real_valid']:.3f}; "
              f"another problem's target shown: acc {ev['decoy_acc']:.3f}")
        return
    t = gmts.get_task(a.task)
    texts = greedy_texts(model, tok, t, rows, gmts.use_chat(tok, cfg.chat_template),
                         cfg.short_prompt, cfg.max_new_tokens)
    acc = float((gmts.grade_answers(t, texts, rows)[0] == 1.0).float().mean())
    print(f"saved {out} | held-out (the cpu preset's rows on {a.task}, seed 0): "
          f"acc {acc:.3f} ({chance}); sample: {texts[0][:100]!r}")

def figure_main(a: argparse.Namespace):
    """report, retention, scatter: a figure at --png (checked first: gmts.check_file), tables on
    stdout."""
    given = vars(a).get("panels", [])
    panels = dict(x.split("=", 1) for x in given if "=" in x)
    if len(panels) < len(given):  # a title given twice would draw one panel
        raise gmts.BadInput(f"{a.command} takes TITLE=FOLDER arguments, each a title of its own")
    if not a.png.endswith(".png"):  # savefig would write PNG + ".png"
        raise gmts.BadInput(f"--png {a.png!r} must name a .png file, e.g. docs/{a.command}.png")
    gmts.check_file(a.png, "--png", a.overwrite)
    if a.command == "scatter":
        return scatter(a.png)
    return (report if a.command == "report" else retention)(panels, a.png)

def decoy_main(cfg: gmts.Config):
    """decoy --model OUT: the held-out rows and prompt format of OUT's own run (run_config.json),
    else the flags'."""
    if os.path.isfile(os.path.join(cfg.model, "run_config.json")):
        saved = run_config(cfg.model)
        cfg = dataclasses.replace(cfg, **{k: saved[k] for k in READ[1:] if k in saved})
        try:  # a hand-edited run_config.json can hold any value
            gmts.check_config(cfg)
        except gmts.BadInput as e:
            raise gmts.BadInput(f"{os.path.join(cfg.model, 'run_config.json')}: {e}") from None
    if cfg.task != "countdown":
        raise gmts.BadInput(f"decoy is defined for countdown, not --task {cfg.task}")
    if cfg.eval_data:  # its table is of held-out rows and their targets
        raise gmts.BadInput("decoy scores the held-out rows of --data (--eval-size), not "
                            "--eval-data's sets; leave --eval-data out")
    model, tok = gmts.load_model(cfg.model, gmts.pick_device(cfg.device), cfg.tiny_hidden,
                                 cfg.tiny_layers, cfg.seed)
    rows = gmts.read_data(cfg).held
    ev = decoy_eval(model, tok, rows, gmts.use_chat(tok, cfg.chat_template), cfg.short_prompt,
                    cfg.max_new_tokens)
    print(f"| model | held-out greedy acc | same, other targets shown | read from the target | "
          f"well-formed |\n|---|---|---|---|---|\n"
          f"| {cfg.model} (seed {cfg.seed}, {len(rows)} problems) | {ev['real_acc']:.3f} | "
          f"{ev['decoy_acc']:.3f} | {ev['real_acc'] - ev['decoy_acc']:.3f} | "
          f"{ev['real_valid']:.3f} |")
    return ev


if __name__ == "__main__":
    main()
