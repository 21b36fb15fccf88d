"""
bench_gmts.py: what GMTS costs, measured on gmts.py's own functions.

  a. token statistics (log p_y, entropy; ours also dz_norm) from the same hidden states (tokens,
     896) and a random lm_head (151936 x 896, fp32), head matmul included for every variant:
       naive  full torch.log_softmax over (tokens, V) + gather + entropy
       trl    trl.trainer.utils.selective_log_softmax + entropy_from_logits (its default chunk
              is 128 rows), the head applied --chunk rows at a time and entropy_from_logits
              given the same chunk
       ours   gmts.token_stats on --chunk rows of logits at a time, as gmts.batch_token_stats
              runs it, and at its default 1024 (Config.stats_chunk)
  b. loss head forward + backward (d hidden and d lm_head): gmts.head_logp (chunk 1024) on all
     tokens vs on the rho share of rows gathered from the hidden states first, as policy_update
     does.
  c. gmts.select_tokens on 1M and 32M random scores with a mask, beside torch.quantile (TRL's
     threshold; it refuses inputs above 2^24 elements: "fails"); and per group on one batch of
     the GMTS authors' shape (64 x 16 answers, up to 2,048 tokens): select_tokens(group_size=16)
     against the literal token loop of their code (one .item() per token), the same kept tokens,
     the ratio of the times.
  d. one training step of a random-init tiny model of warm/cpu's shape (gmts.build_tiny(96, 3),
     PRESETS["cpu"] batch sizes): rollout (gmts.rollout on countdown prompts) + the update of
     train() steps 5-7 (batch_token_stats, loss_weights, omega, token_scores, select_tokens at
     each method's scope, policy_update) for --select all, random and gmts on one fixed batch.
     A random model earns no reward, so rewards are random 0/1 with one right and one wrong
     answer per group (no answer has A = 0). Its entropy is nearly flat, so gmts keeps whole
     answers of the largest |A| and the update runs few answers; random spreads the kept tokens
     over every answer: gmts' worst case.
  e. the same step for a random-init model with the Qwen2.5-0.5B config (--device cuda),
     rollouts forced to a fixed length (min_new_tokens); --small runs it with a tiny config so
     the path is exercised on CPU. Beside it, interleaved in the same process: (1) today's
     rollout path (gmts.rollout on the fp32 master weights under bf16 autocast, dynamic KV
     cache) and the new one (a bf16 copy of the weights, static KV cache, decoding compiled by
     HF generate on CUDA): rollout_speedup = new tokens/s / old tokens/s, and sampler_logp_gap
     (_max) = mean (max) of |log p_sampler - log p_old| over response tokens, log p_old being
     train()'s fp32 recompute (gmts.batch_token_stats); (2) when trl is installed, TRL's
     GRPOTrainer steps (HF generate, all tokens; no gradient checkpointing, as gmts.py; bf16
     weights on CUDA, as TRL loads a Qwen checkpoint) on a copy of the same starting model, the
     same B x G prompts and completion length:
     step_ratio_gmts_trl = (new rollout + gmts update) / TRL's median step (steps 2..n).
  g. the memory plan (issue 42; `plan` below): memory_phases' bytes for each phase of a step
     (sampling, statistics, update, AdamW's step, evaluation) beside the measured peak of the same
     call on a random tiny Qwen2 (--plan-hidden, 2 layers, 8 x 8 countdown answers of 96 tokens),
     and their ratio: the CPU parts of the formula (4-byte activations, the fp32 sampler) checked.
  f. threads (issue 31): steps per second of `gmts.py --preset cpu --steps --thread-steps` (5)
     at --threads 1 and --threads 0 (torch's choice: every core), each run a fresh process with
     OMP_NUM_THREADS / MKL_NUM_THREADS taken out of its environment, so that 0 is the machine's
     default whatever the benchmark's own shell sets; the variants alternate (1 0, then 0 1,
     ...), --repeats runs each, on the CPU whatever --device says. steps_per_s = steps / the sum
     of their step_time_s (metrics.jsonl: the steps alone, not the import, the model load, the
     step-0 and final evals, the checkpoints: those are in wall_s); ratio = steps/s at 1 thread /
     at the default. Beside the timings it says whether the runs logged the same metrics (every
     key but the three timing keys), within a variant and across the two: the first step and key
     where they part, and every key that differs. Not in the default --sections: it starts
     2 x --repeats processes of a real training run (~2 minutes on a free 2-core CPU, far longer
     on a loaded one), a measurement of the machine rather than of GMTS; --quick runs 1 step of
     the smoke preset.
  h. grading at the paper's size (issue 42): one avg@16 pass of evaluate's grading over the five
     benchmarks the GMTS authors report, as public files (GRADE_SETS: MATH-500 as prm800k's test
     split, AIME 2024, AMC23, Minerva Math and OlympiadBench as Qwen2.5-Math's evaluation data),
     each completion its row's gold boxed ("So the final answer is $\\boxed{GOLD}$.",
     --grade-samples copies), graded as gmts.evaluate grades: TASKS["math"]["reward"] one answer
     at a time in the main thread (math-verify's own timeouts), gmts.latex_equal's cache emptied
     before each pass (avg@k's copies hit it, as in an evaluation; no pass reuses another's
     verdicts). --grade-repeats passes (median). It reports the time, answers/s, the slowest grade
     and each set's share of 1.0. Only when named (--sections h): ~24,000 grades a pass, minutes;
     --quick: 10 rows per set, twice, 1 pass.
  i. gmts_trl.py's rescoring (issue 45): TRL runs of warm/cpu (countdown easy, its reward,
     per-device batch 8, grad-accum 4, G 8, 64 new tokens, rho 0.2, --trl-rescore-steps steps)
     with --select gmts: the share of the run's time in GMTSTrainer.select (the no-grad scoring
     forward + the selection) at num_iterations 1 and 2, and at num_iterations 2 the share of the
     second pass's kept tokens that the first pass's mask (one selection per generation batch)
     would not keep, at lr 3e-4 and 1e-3. Only when named in --sections, on the CPU.
Method. Variants run interleaved (A B, then B A, ...) in one process; the table shows medians and
ratios of medians. Peak memory is the growth over the state before the call: CUDA:
torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before.
CPU: torch's CPU allocations are invisible to tracemalloc, so the process's resident set is used:
gc, write "5" to /proc/self/clear_refs (resets VmHWM to VmRSS), read VmRSS, run, read VmHWM from
/proc/self/status; peak_mb = VmHWM - VmRSS_before. glibc is told (mallopt M_MMAP_THRESHOLD =
1 MiB) to mmap every block >= 1 MiB, so freed tensors leave RSS and the next measurement starts
clean (repeats agree to ~1 MB). On CPU torch runs --threads 1 by default: on a shared,
oversubscribed 2-core machine two OpenMP threads wait on each other and small reductions slow
down 100x. --tokens defaults to 4096 on CPU with 2 interleaved runs per variant in the head
sections (a, b): one 4096-row head pass takes ~30 s on one core, so three runs would not fit in
10 minutes (--head-repeats 3 for more).

Run:  python bench_gmts.py --json bench.json        (CPU, ~8 minutes)
      python bench_gmts.py --device cuda --json gpu.json
      python bench_gmts.py --quick --json tmp.json  (seconds; tiny sizes, section e with --small)
      python bench_gmts.py --sections f --json threads.json
          (threads: the cpu preset at 1 thread and the default)
      python bench_gmts.py --sections h --json grading.json  (five benchmarks' grading)
      python bench_gmts.py --sections i --json rescore.json  (gmts_trl.py's rescoring, ~4 min)
      python bench_gmts.py plan --preset paper-math [gmts.py's flags]
          (the memory plan of that run, one line: before renting a GPU; no weights read)
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse
import copy
import ctypes
import dataclasses
import functools
import gc
import itertools
import json
import math
import random
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import gmts

try:
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax
except ImportError:  # trl is optional: the trl rows and targets are skipped
    selective_log_softmax = entropy_from_logits = None

QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
              max_position_embeddings=32768, rope_theta=1000000.0)
SMALL = dict(QWEN05, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4)
HIDDEN = 896
HERE = os.path.dirname(os.path.abspath(__file__))


class Meter:
    """meter(fn) -> (ms, peak_mb, fn's result); peak_mb is None where it cannot be measured
    (see docstring)."""

    def __init__(self, device: torch.device):
        # process_peak_mb: the highest total (process RSS / CUDA allocated) seen
        self.device, self.process_peak_mb = device, 0.0
        self.cpu_rss = device.type == "cpu" and os.path.exists("/proc/self/clear_refs")
        if self.cpu_rss:
            try:
                # M_MMAP_THRESHOLD: blocks >= 1 MiB are mmap'd
                ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
                self._clear()
            except OSError:
                self.cpu_rss = False

    @staticmethod
    def _clear():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status(key: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn):
        gc.collect()
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        elif self.cpu_rss:
            self._clear()
            base = self._status("VmRSS")
        t = time.perf_counter()
        out = fn()
        self.sync()
        ms = (time.perf_counter() - t) * 1e3
        if self.device.type == "cuda":
            top = torch.cuda.max_memory_allocated() / 2**20
            peak = top - base / 2**20
        else:
            top = self._status("VmHWM") if self.cpu_rss else 0.0
            peak = top - base if self.cpu_rss else None
        self.process_peak_mb = max(self.process_peak_mb, top)
        return ms, peak, out


def interleave(meter: Meter, variants: dict, repeats: int) -> dict:
    """Run every variant `repeats` times, reversing the order every other round; medians of ms and
    peak_mb."""
    runs, last = {k: [] for k in variants}, {}
    for r in range(repeats):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            ms, peak, last[k] = meter(variants[k])
            runs[k].append((ms, peak))
    med = lambda xs: statistics.median(xs) if None not in xs else None  # noqa: E731
    return {k: dict(ms=med([x[0] for x in v]), peak_mb=med([x[1] for x in v]),
                    ms_runs=[round(x[0], 1) for x in v],
                    peak_mb_runs=[x[1] and round(x[1], 1) for x in v], out=last[k])
            for k, v in runs.items()}


def head_inputs(M: int, V: int, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, V, bias=False)
    with torch.no_grad():
        # logits ~ N(0, 1) per row
        head.weight.copy_(torch.randn(V, HIDDEN, generator=g) * HIDDEN ** -0.5)
    h = torch.randn(M, HIDDEN, generator=g)
    y = torch.randint(0, V, (M,), generator=g)
    return head.to(device), h.to(device), y.to(device)


def sec_stats(args, meter, dev) -> dict:
    head, h, y = head_inputs(args.tokens, args.vocab, dev)
    W, C = head.weight, args.chunk

    @torch.no_grad()
    def naive(h, y):
        lp = torch.log_softmax(F.linear(h, W), dim=-1)  # (M, V)
        return lp.gather(-1, y[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)

    @torch.no_grad()
    def trl(h, y):
        parts = [(selective_log_softmax(z, yc), entropy_from_logits(z, chunk_size=C))
                 for z, yc in ((F.linear(hc, W), yc) for hc, yc in zip(h.split(C), y.split(C)))]
        return tuple(torch.cat(p) for p in zip(*parts))

    # gmts.batch_token_stats' head loop: token_stats on `chunk` rows of logits at a time
    @torch.no_grad()
    def ours(h, y, chunk):
        parts = [gmts.token_stats(F.linear(hc, W), yc, 1.0)
                 for hc, yc in zip(h.split(chunk), y.split(chunk))]
        return tuple(torch.cat(p) for p in zip(*parts))

    fns = {"naive": naive, "trl": trl if selective_log_softmax else None,
           f"ours@{C}": functools.partial(ours, chunk=C),
           "ours@1024": functools.partial(ours, chunk=1024) if args.extra else None}
    variants = {}
    for k, fn in fns.items():
        if fn is not None:
            fn(h[:8], y[:8])  # warm-up: first-call costs stay out of the medians
            variants[k] = functools.partial(fn, h, y)
    res = interleave(meter, variants, args.head_repeats)
    ref = res["naive"]["out"]
    for r in res.values():  # the variants must agree, or the timings compare different work
        r["max_abs_diff_logp"] = float((r["out"][0] - ref[0]).abs().max())
        r["max_abs_diff_entropy"] = float((r["out"][1] - ref[1]).abs().max())
        del r["out"]
    return res


def sec_loss_head(args, meter, dev) -> dict:
    head, h, y = head_inputs(args.tokens, args.vocab, dev, seed=1)
    M = args.tokens
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(M, generator=g).to(dev)
    # the kept rows
    idx = torch.randperm(M, generator=g)[:math.ceil(args.rho * M)].sort().values.to(dev)

    def run(rows, chunk):
        hh = h.detach().requires_grad_()  # stands for the transformer's output
        # gather the selected rows BEFORE the head, as policy_update does
        hs = hh if rows is None else hh[rows]
        logp = gmts.head_logp(hs, head, y if rows is None else y[rows], 1.0, chunk)
        a = adv if rows is None else adv[rows]
        (-(logp * a).sum() / M).backward()
        head.weight.grad = None  # every run allocates its own d lm_head

    # all: the head over every token in one piece, as an implementation without selection holds it
    # (logits for all N*T positions); selected: the same head over the kept 20% only; all@1024:
    # gmts.py's chunked head over all tokens (chunking alone bounds the memory too, so it is shown
    # beside them, not used in the target).
    variants = {"all": lambda: run(None, M), "selected": lambda: run(idx, 1024)}
    if args.extra:
        variants["all@1024"] = lambda: run(None, 1024)
    res = interleave(meter, variants, args.head_repeats)
    for r in res.values():
        del r["out"]
    return res


def sec_select(args, meter, dev) -> dict:
    out = {}
    for n in args.select_sizes:
        T = 1024 if n >= 1024 * 64 else 64
        g = torch.Generator().manual_seed(3)
        scores = torch.rand(n // T, T, generator=g).to(dev)
        lengths = torch.randint(T // 4, T + 1, (n // T, 1), generator=g).to(dev)
        # valid prefixes, ~62% of the positions
        mask = torch.arange(T, device=dev)[None, :] < lengths

        # TRL's get_high_entropy_mask: the (1 - rho) quantile of the valid scores as threshold
        def quantile():
            return (scores >= torch.quantile(scores[mask], 1 - args.rho)) & mask

        variants = {"select_tokens": lambda: gmts.select_tokens(scores, mask, args.rho),
                    "quantile": quantile}
        try:
            quantile()
        except RuntimeError as e:
            del variants["quantile"]
            out[f"{n}/quantile"] = dict(ms=None, peak_mb=None, error=str(e).splitlines()[0][:120])
        for k, r in interleave(meter, variants, args.repeats).items():
            del r["out"]
            out[f"{n}/{k}"] = r
    out.update(per_group(args, meter, dev))
    return out


def literal_group_select(scores: torch.Tensor, mask: torch.Tensor, rho: float,
                         G: int) -> torch.Tensor:
    """The GMTS authors' per-group selection written token by token, as their Framework1 runs it
    (one .item() per token): per group, a list of (score, row, position), sorted ascending, the
    lowest max(1, ceil((1 - rho) n)) dropped, a score of 0 never kept. The reference
    select_tokens(group_size=G, nonzero=True) is timed against."""
    keep = torch.zeros(mask.shape, dtype=torch.bool)
    for g in range(mask.shape[0] // G):
        entries = []
        for i in range(g * G, (g + 1) * G):
            for t in range(int(mask[i].sum())):  # the valid tokens are a prefix of each row
                entries.append((scores[i, t].item(), i, t))
        entries.sort(key=lambda e: e[0])
        for v, i, t in entries[max(1, math.ceil((1 - rho) * len(entries))):]:
            keep[i, t] = v != 0
    return keep


def per_group(args, meter, dev) -> dict:
    """Per-group selection on one batch of the authors' shape (64 prompts x 16 answers, up to 2,048
    tokens, as their Framework1 yaml; --quick: 4 x 4 x 64): the literal token loop (once: tens of
    seconds) beside the vectorised select_tokens (--repeats runs), the same kept tokens, and the
    ratio of their times."""
    B, G, T = (4, 4, 64) if args.quick else (64, 16, 2048)
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(B * G, T, generator=g)
    scores[torch.rand(B * G, T, generator=g) < 0.05] = 0.0  # zero entropy, A = 0: never kept
    lengths = torch.randint(T // 8, T + 1, (B * G, 1), generator=g)
    mask = torch.arange(T)[None, :] < lengths  # (N, T)
    # copied once: the timing is the selection's, not the transfer's
    on_dev = (scores.to(dev), mask.to(dev))
    fast = interleave(meter, {"fast": lambda: gmts.select_tokens(*on_dev, args.rho, nonzero=True,
                                                                 group_size=G)},
                      args.repeats)["fast"]
    slow = interleave(meter, {"loop": lambda: literal_group_select(scores, mask, args.rho, G)},
                      1)["loop"]
    same = torch.equal(fast.pop("out").cpu(), slow.pop("out"))
    shape = f"{B}x{G}x{T}"
    return {f"group {shape}/literal_loop": slow, f"group {shape}/select_tokens": dict(
        fast, tokens=int(mask.sum()), same_kept_tokens=same,
        loop_over_vectorised=slow["ms"] / fast["ms"])}


def qwen_batch(model, B: int, G: int, P: int, T: int, seed: int) -> dict:
    """A fixed-length rollout from random prompt ids, as gmts.rollout builds its batch
    (HF generate, bf16)."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (B, P), generator=g).repeat_interleave(G, 0).to(device)  # (N, P)
    attn = torch.ones_like(ids)
    model.eval()
    with torch.no_grad(), gmts.autocast(device):
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=T, min_new_tokens=T,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             repetition_penalty=1.0, eos_token_id=model.config.eos_token_id,
                             pad_token_id=model.config.pad_token_id)
    model.train()
    comp = out[:, P:]  # (N, T)
    return dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp,
                resp_mask=torch.ones_like(comp).bool(),
                truncated=torch.ones(comp.shape[0], dtype=torch.bool, device=device))


def step_bench(model, make_batch, cfg, meter, repeats) -> dict:
    """Rollout + update (train() steps 5-7) for --select all, random and gmts on one fixed batch,
    interleaved."""
    dev, methods = meter.device, ("all", "random", "gmts")
    batch = make_batch(0)
    N, T = batch["comp_ids"].shape
    rewards = torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(4)).float()
    # every group mixed: no answer has A = 0
    rewards[0::cfg.group_size], rewards[1::cfg.group_size] = 1.0, 0.0
    adv = gmts.group_advantages(rewards, cfg.group_size).to(dev)
    mask = batch["resp_mask"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sel_ms = {m: [] for m in methods}
    stats_ms = {m: [] for m in methods}
    meter.process_peak_mb = 0.0

    def clock():
        meter.sync()
        return time.perf_counter()

    def update(method):
        # the extra no-grad forward of the statistics (deviation 8 in gmts.py): its share of a step
        t0 = clock()
        logp, ent, gn = gmts.batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch,
                                               cfg.stats_chunk)
        stats_ms[method].append((clock() - t0) * 1e3)
        # as train() selects
        rho, group_size = gmts.selection_rule(dataclasses.replace(cfg, select=method))
        t = clock()
        n_kept = int(gmts.scope_budget(mask, rho, group_size)[1].sum())
        weights = gmts.loss_weights(cfg.loss_norm, mask, n_kept, cfg.group_size)
        objective = gmts.Objective(cfg.clip_low, cfg.clip_high, 0.0, cfg.temperature, **weights)
        ratio = torch.exp(logp - logp)  # inner update 0
        om = gmts.omega(adv, ratio, cfg.clip_low, cfg.clip_high, **weights)
        scores = gmts.token_scores(method, ent, gn, om)
        nonzero = not gmts.METHODS[method].zero_kept
        sel = gmts.select_tokens(scores, mask, rho, nonzero, group_size)
        sel_ms[method].append((clock() - t) * 1e3)
        gmts.policy_update(model, opt, batch, adv, sel, logp, objective,
                           micro_batch=cfg.micro_batch, chunk=cfg.stats_chunk,
                           max_grad_norm=cfg.max_grad_norm)
        return dict(kept_frac=int(sel.sum()) / int(mask.sum()),
                    active_frac=float(sel.any(1).float().mean()))

    for m in methods:  # warm-up: Adam state, kernels
        update(m)
        sel_ms[m].clear()
        stats_ms[m].clear()
    seeds = iter(range(1, 10 ** 6))
    res = interleave(meter, {"rollout": lambda: make_batch(next(seeds)),
                             **{m: functools.partial(update, m) for m in methods}}, repeats)
    roll = res.pop("rollout")
    del roll["out"]
    out = dict(rollout=dict(roll, tokens_per_s=N * T / (roll["ms"] / 1e3)), N=N, T=T,
               valid_tokens=int(mask.sum()))
    # a step = the median rollout + this update; select_ms = step 6 (omega, scores, selection)
    for m in methods:
        r = res[m]
        r.update(r.pop("out"), step_ms=roll["ms"] + r["ms"], select_ms=statistics.median(sel_ms[m]))
        r["select_share"] = r["select_ms"] / r["step_ms"]
        r["stats_ms"] = statistics.median(stats_ms[m])
        r["stats_share"] = r["stats_ms"] / r["step_ms"]
        out[m] = r
    out["step_ratio_gmts_all"] = out["gmts"]["step_ms"] / out["all"]["step_ms"]
    # CUDA: max allocated incl. weights and Adam; CPU: max RSS
    out["process_peak_mb"] = meter.process_peak_mb
    out["step_ratio_random_all"] = out["random"]["step_ms"] / out["all"]["step_ms"]
    return out


def sec_tiny_step(args, meter, dev) -> dict:
    keys = ("task", "data", "short_prompt", "prompts_per_step", "group_size", "max_new_tokens",
            "lr", "micro_batch")
    cfg = gmts.Config(**{k: v for k, v in gmts.PRESETS["smoke" if args.quick else "cpu"].items()
                         if k in keys})
    model, tok = gmts.build_tiny(96, 3, seed=0)  # warm/cpu's shape, random weights
    model.to(dev).train()
    task = gmts.get_task(cfg.task)
    rows = gmts.load_rows(cfg.task, cfg.data, cfg.prompts_per_step, 0)
    prompts = gmts.build_prompts(tok, task, rows, gmts.use_chat(tok), cfg.short_prompt)

    def make_batch(seed):
        gmts.set_seed(seed)
        return gmts.rollout(model, tok, prompts, cfg.group_size, cfg.max_new_tokens,
                            cfg.temperature)

    out = step_bench(model, make_batch, cfg, meter, args.repeats)
    out["model"] = "tiny hidden 96, 3 layers"
    return out


def bf16_copy(model):
    """What gmts.train samples from on CUDA: a bf16 copy of the parameters (buffers such as RoPE's
    inv_freq stay fp32, as from_pretrained(dtype=bf16) leaves them)."""
    out = copy.deepcopy(model).eval().requires_grad_(False)
    for p in out.parameters():
        p.data = p.data.to(torch.bfloat16)
    return out


def text_prompts(B: int, P: int, seed: int) -> list:
    """B printable-ASCII prompts of P - P//8 .. P bytes: as many tokens with the byte-level
    tokenizer, so the rows are left-padded as real prompts are."""
    r = random.Random(seed)
    return ["".join(r.choice(string.ascii_letters + " ") for _ in range(r.randint(P - P // 8, P)))
            for _ in range(B)]


def rollout_paths(model, tok, prompts, cfg, meter, args) -> dict:
    """Today's rollout (the fp32 master weights under autocast, dynamic KV cache) beside the new one
    (a bf16 copy, static KV cache, compiled decoding on CUDA), interleaved. Both return the
    sampler's log-probs (the bookkeeping train() now does on every rollout); the gap is taken
    against train()'s recompute of log pi_old."""
    sampler = bf16_copy(model) if args.sampler_dtype == "bf16" else model
    fast = args.fast_generate
    seeds = itertools.count()

    def run(m, fast_path):
        gmts.set_seed(next(seeds))
        return gmts.rollout(m, tok, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature,
                            fast=fast_path, sampler_logp=True)

    variants = {"old": lambda: run(model, False), "new": lambda: run(sampler, fast)}
    # compilation and CUDA-graph capture: not in medians
    first = {k: meter(fn)[0] for k, fn in variants.items()}
    res = interleave(meter, variants, args.repeats)
    for k, r in res.items():
        b = r.pop("out")
        logp = gmts.batch_token_stats(model, b, cfg.temperature, cfg.micro_batch,
                                      cfg.stats_chunk)[0]
        gap = (b["sampler_logp"] - logp).abs()[b["resp_mask"]]
        N, T = b["comp_ids"].shape
        r.update(first_call_ms=first[k], N=N, T=T, tokens_per_s=N * T / (r["ms"] / 1e3),
                 sampler_logp_gap=float(gap.mean()), sampler_logp_gap_max=float(gap.max()))
    res["new"].update(sampler_dtype=args.sampler_dtype, fast_generate=fast)
    res["old"].update(sampler_dtype="fp32", fast_generate=False)
    res["speedup"] = res["new"]["tokens_per_s"] / res["old"]["tokens_per_s"]
    return res, sampler


def trl_step(model, tok, prompts, cfg, dev, steps: int) -> dict:
    """TRL's GRPOTrainer (HF generate, all tokens) on a copy of `model`: the same prompts, G,
    completion length and micro-batch as gmts.py; random 0/1 rewards (seeded) so that advantages
    are not 0. Median step of 2..n."""
    try:
        import datasets
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return dict(error=f"trl not importable: {e}")
    cuda = dev.type == "cuda"
    N = cfg.prompts_per_step * cfg.group_size
    mb = math.gcd(cfg.micro_batch, N)
    rng = random.Random(0)
    times = []

    def reward(completions, **kw):
        return [float(rng.random() < 0.5) for _ in completions]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            meter_sync(dev)
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            meter_sync(dev)
            times.append((time.perf_counter() - self.t) * 1e3)

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, max_steps=steps, learning_rate=cfg.lr, seed=0,
                          per_device_train_batch_size=mb, gradient_accumulation_steps=N // mb,
                          num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens,
                          temperature=cfg.temperature, top_p=1.0, top_k=0, epsilon=cfg.clip_low,
                          epsilon_high=cfg.clip_high, gradient_checkpointing=False,
                          use_cpu=not cuda, bf16=cuda and torch.cuda.is_bf16_supported(),
                          report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True)
        m = bf16_copy(model).train().requires_grad_(True) if cuda else copy.deepcopy(model)
        data = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
        trainer = GRPOTrainer(model=m, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(Clock())
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        lens = [h["completions/mean_length"] for h in trainer.state.log_history
                if "completions/mean_length" in h]
        out = dict(step_ms=statistics.median(times[1:] or times),
                   step_ms_runs=[round(t, 1) for t in times],
                   completion_len=lens, micro_batch=mb, weights="bf16" if cuda else "fp32",
                   peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else None)
    del trainer, m
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def meter_sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def sec_model_step(args, meter, dev) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = args.small or dev.type != "cuda"
    cfg = gmts.Config(**(dict(prompts_per_step=2, group_size=2, max_new_tokens=8) if small else {}))
    torch.manual_seed(0)
    # random init directly on the device; fp32 master weights as gmts.load_model
    with torch.device(dev):
        model = Qwen2ForCausalLM(Qwen2Config(**(SMALL if small else QWEN05), eos_token_id=151645,
                                             pad_token_id=151643, bos_token_id=None))
    P = 8 if small else 64
    tok = gmts.build_tiny()[1]  # byte-level: its ids (< 259) are valid in any Qwen vocabulary
    prompts = text_prompts(cfg.prompts_per_step, P, seed=0)
    trl = (trl_step(model, tok, prompts, cfg, dev, args.trl_steps) if args.trl_steps
           else dict(error="--trl-steps 0"))
    # the copy stays for the peak below
    paths, sampler = rollout_paths(model, tok, prompts, cfg, meter, args)
    out = step_bench(model, lambda s: qwen_batch(model, cfg.prompts_per_step, cfg.group_size, P,
                                                 cfg.max_new_tokens, s), cfg, meter, args.repeats)
    out["model"] = ("small Qwen2 (smoke)" if small else "Qwen2.5-0.5B config, random init") + \
        f", {cfg.prompts_per_step}x{cfg.group_size} prompts x {cfg.max_new_tokens} new tokens, " \
        f"prompt {P}"
    out["rollout_paths"], out["trl"] = paths, trl
    # a step on the new rollout path: its median rollout + the update on the same shapes
    for m in ("all", "gmts"):
        out[m]["step_ms_new"] = paths["new"]["ms"] + out[m]["ms"]
    if "step_ms" in trl:
        out["step_ratio_gmts_trl"] = out["gmts"]["step_ms_new"] / trl["step_ms"]
        out["step_ratio_all_trl"] = out["all"]["step_ms_new"] / trl["step_ms"]
    del sampler
    return out


# the metrics.jsonl keys that are clock readings
TIMING_KEYS = ("rollout_time_s", "step_time_s", "tokens_per_s")
# A child: gmts.main on the arguments, then torch's thread count (what --threads 0 chose).
THREADS_CHILD = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import gmts; "
                 "gmts.main(sys.argv[2:]); "
                 "print('bench_torch_threads', torch.get_num_threads(), flush=True)")


def threads_run(preset: str, steps: int, threads: int) -> dict:
    """One fresh gmts.py process of `steps` steps of `preset` at --threads `threads`, in a
    temporary --out."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        cmd = [sys.executable, "-c", THREADS_CHILD, HERE, "--preset", preset, "--steps", str(steps),
               "--threads", str(threads), "--device", "cpu", "--out", out]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(f"threads {threads}: gmts.py exited {p.returncode}: "
                               f"{p.stderr[-1500:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f]
    got = re.search(r"^bench_torch_threads (\d+)$", p.stdout, re.M)
    step_s = [r["step_time_s"] for r in recs if r["step"] >= 1 and "step_time_s" in r]
    return dict(torch_threads=int(got.group(1)) if got else None, steps=len(step_s),
                step_s=sum(step_s), steps_per_s=len(step_s) / sum(step_s), wall_s=wall,
                eval_acc=[r["eval_acc"] for r in recs if "eval_acc" in r][-1],
                metrics=[{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs])


def first_difference(a: list, b: list):
    """The first (step, key, value a, value b) where two runs' metrics (timing keys left out)
    differ, or None."""
    for ra, rb in itertools.zip_longest(a, b, fillvalue={}):
        for k in sorted(set(ra) | set(rb), key=lambda k: (k != "step", k)):
            if ra.get(k) != rb.get(k):
                return dict(step=ra.get("step", rb.get("step")), key=k, a=ra.get(k), b=rb.get(k))
    return None


def sec_threads(args, meter, dev) -> dict:
    """Section f: the cpu preset's steps/s at each of --thread-variants (1, then 0: torch's
    default), interleaved."""
    preset, steps, variants = args.thread_preset, args.thread_steps, args.thread_variants
    runs = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            runs[v].append(threads_run(preset, steps, v))
            print(f"[f] --threads {v}: {runs[v][-1]['steps_per_s']:.3f} steps/s "
                  f"({runs[v][-1]['torch_threads']} torch threads)", file=sys.stderr, flush=True)
    out = dict(preset=preset, steps=steps, repeats=args.repeats, variants={})
    for v, rs in runs.items():
        same = [first_difference(rs[0]["metrics"], x["metrics"]) for x in rs[1:]]
        out["variants"][str(v)] = dict(
            threads_asked=v, torch_threads=rs[0]["torch_threads"],
            steps_per_s=statistics.median(x["steps_per_s"] for x in rs),
            steps_per_s_runs=[round(x["steps_per_s"], 4) for x in rs],
            step_s_runs=[round(x["step_s"], 2) for x in rs],
            wall_s=statistics.median(x["wall_s"] for x in rs),
            wall_s_runs=[round(x["wall_s"], 1) for x in rs],
            eval_acc=rs[0]["eval_acc"], metrics_identical=all(d is None for d in same),
            metrics_first_difference=next((d for d in same if d is not None), None))
    if len(variants) >= 2:
        a, b = (out["variants"][str(v)] for v in variants[:2])
        out["ratio"] = a["steps_per_s"] / b["steps_per_s"]
        out["ratio_of"] = f"steps/s at --threads {variants[0]} / at --threads {variants[1]}"
        ma, mb = runs[variants[0]][0]["metrics"], runs[variants[1]][0]["metrics"]
        d = first_difference(ma, mb)
        out["metrics_identical_across"], out["metrics_first_difference_across"] = d is None, d
        out["metrics_keys_differing_across"] = sorted({k for ra, rb in zip(ma, mb)
                                                       for k in set(ra) | set(rb)
                                                       if ra.get(k) != rb.get(k)})
    return out


def sec_memory_plan(args, meter, dev) -> dict:
    """g. memory_phases' phases against measured peaks: a random tiny Qwen2 (build_tiny(
    --plan-hidden, 2 layers)), B x G countdown prompts, each phase run as train() runs it, the peak
    (see Method) beside the plan's bytes for what the call allocates (the update's gradients
    included; the AdamW step measured at step 2, its moments already there)."""
    torch.manual_seed(0)
    model, tok = gmts.build_tiny(args.plan_hidden, 2)
    model = model.to(dev)
    B, G, T = (2, 4, 16) if args.quick else (8, 8, 96)
    cfg = gmts.Config(prompts_per_step=B, group_size=G, max_new_tokens=T, micro_batch=G,
                      stats_chunk=256, eval_samples=G, sampler_dtype="fp32")
    task = gmts.get_task("countdown")
    rows = gmts.load_rows("countdown", "easy", 64 // G, 0)
    prompts = gmts.build_prompts(tok, task, rows[:B], False, True)
    P = max(len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"])
    stay, phases = memory_phases(cfg, model, P, dev)
    batch = gmts.rollout(model, tok, prompts, G, T)
    mask = batch["resp_mask"]
    adv = torch.randn(mask.shape[0], device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    objective = gmts.Objective(0.2, 0.28, 0.0, 1.0, **gmts.loss_weights("all", mask, 0))

    def update():
        return gmts.loss_backward(model, batch, adv, mask, old, objective,
                                  micro_batch=cfg.micro_batch, chunk=cfg.stats_chunk)
    old = gmts.batch_token_stats(model, batch, 1.0, cfg.micro_batch, cfg.stats_chunk)[0]
    update()
    opt.step()  # AdamW's moments exist from here on, as at any step after the first
    opt.zero_grad(set_to_none=True)
    runs = {"sampling": lambda: gmts.rollout(model, tok, prompts, G, T),
            "statistics": lambda: gmts.batch_token_stats(model, batch, 1.0, cfg.micro_batch,
                                                         cfg.stats_chunk),
            "update": update,
            "evaluation": lambda: gmts.evaluate(model, tok, task, rows, False, True, T, samples=G)}
    out = {}
    for name, fn in runs.items():
        ms, peak, _ = meter(fn)
        if name == "update":
            ms2, step_peak, _ = meter(opt.step)
            opt.zero_grad(set_to_none=True)
            plan = phases["AdamW step"]["AdamW step"] / 2**20  # the gradients were already there
            out["AdamW step"] = dict(ms=ms2, peak_mb=step_peak, plan_mb=plan,
                                     ratio=step_peak / plan if step_peak is not None else None)
        plan = sum(phases[name].values()) / 2**20
        out[name] = dict(ms=ms, peak_mb=peak, plan_mb=plan,
                         ratio=peak / plan if peak is not None else None,
                         parts_mb={k: v / 2**20 for k, v in phases[name].items()})
    print(f"memory plan vs measured (P {P}, {B} x {G} answers of {T} tokens, "
          f"hidden {args.plan_hidden}):")
    for name, r in out.items():
        peak = "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:.2f}"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"  {name:<12} plan {r['plan_mb']:8.2f} MB  measured {peak:>8} MB  "
              f"measured/plan {ratio}")
    return dict(phases=out, P=P, B=B, G=G, T=T, hidden=args.plan_hidden)


# ==== The memory plan of a run: `python bench_gmts.py plan [gmts.py's flags]` ====================
def memory_plan(cfg: gmts.Config, model, prompt_tokens: int, device: torch.device) -> dict:
    """{part: GiB} of a step's peak: what stays and the largest of memory_phases' phases; {} when
    the config lacks a size (the plan is unknown)."""
    stay, phases = memory_phases(cfg, model, prompt_tokens, device)
    if not stay:
        return {}
    plan = dict(stay, **max(phases.values(), key=lambda part: sum(part.values())))
    return {part: size / 2**30 for part, size in plan.items() if size}


def memory_phases(cfg: gmts.Config, model, prompt_tokens: int, device: torch.device) -> tuple:
    """(stay, {phase: {part: bytes}}) from the config's sizes: what stays and each phase's own.
    Section g checks the CPU phases against measured peaks."""
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
    rows = gmts.prompts_per_call(cfg, cfg.prompts_per_step) * G  # answers per generate() call
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


def memory_line(cfg: gmts.Config, model, prompt_tokens: int, device: torch.device,
                have: float = None) -> str:
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
        if sum(memory_plan(dataclasses.replace(cfg, **fix), model, prompt_tokens,
                           device).values()) <= have:
            flags = [f"--{k.replace('_', '-')} {v}".replace(" True", "") for k, v in fix.items()]
            return line + f"; too much: {' '.join(flags)} fits"
    lower = "--prompts-per-step, --group-size, --eval-samples or --max-new-tokens"
    return line + f"; too much: lower {lower}"


MEMORY_FIXES = ({"grad_ckpt": True}, {"grad_ckpt": True, "micro_batch": 1},
                {"grad_ckpt": True, "micro_batch": 1, "sampler_dtype": "fp32"})


def plan_model(cfg: gmts.Config) -> tuple:
    """(model, tokenizer) of --model with its weights on the meta device: the sizes and the
    parameter count, no weight read or allocated. A model that cannot load: ValueError."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    with torch.device("meta"):
        if cfg.model == "tiny":
            return gmts.build_tiny(cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
        path = gmts.resolve_model_name(cfg.model)
        try:
            tok = AutoTokenizer.from_pretrained(path)
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)), tok
        except Exception as e:  # no such folder or hub id, no hub, an architecture it lacks
            if gmts.memory_fault(e):
                raise
            raise gmts.BadInput(f"cannot load model {path!r}: {gmts.error_line(e, 300)}") from None


def longest_prompt(cfg: gmts.Config, tok, chunk: int = 1024) -> int:
    """P: the longest prompt in tokens of the run's rows: its held-out (or --eval-data) rows and,
    for a data file or set, every training row (generated data: the held-out rows alone)."""
    gen = gmts.data_kind(cfg.data) == "gen"  # epoch order: one draw is the whole training pool
    data = gmts.read_data(cfg if gen else dataclasses.replace(cfg, data_order="epoch"))
    held = data.held if isinstance(data.held, dict) else {"held": data.held}
    rows = [r for rs in held.values() for r in rs] + ([] if gen else data.draw(sys.maxsize))
    task, chat = gmts.get_task(cfg.task), gmts.use_chat(tok, cfg.chat_template)
    longest = 0
    for i in range(0, len(rows), chunk):
        prompts = gmts.build_prompts(tok, task, rows[i:i + chunk], chat, cfg.short_prompt,
                                     cfg.prompt_style)
        ids = tok(prompts, add_special_tokens=False)["input_ids"]
        longest = max([longest, *map(len, ids)])
    return longest


def plan(argv: list) -> str:
    """`bench_gmts.py plan [gmts.py's flags]`: the memory plan of that run, printed in one line,
    before any GPU is rented: the model's sizes from its config, P from the run's data."""
    cfg = gmts.parse_args(argv)
    gmts.check_config(cfg)
    model, tok = plan_model(cfg)
    line = memory_line(cfg, model, longest_prompt(cfg, tok), gmts.pick_device(cfg.device))
    print(line, flush=True)
    return line


GRADE_SETS = {  # name -> (a git clone under --mirrors, the file in it): section h's public copies
    # MATH-500: prm800k's math_splits/test.jsonl, byte for byte (sha256 35dc4108...)
    "math500": ("MobileLLM+BudgetThinker", "evaluation/data/math500/test_ori.jsonl"),
    "aime24": ("QwenLM+Qwen2.5-Math", "evaluation/data/aime24/test.jsonl"),
    "amc23": ("QwenLM+Qwen2.5-Math", "evaluation/data/amc23/test.jsonl"),
    "minerva_math": ("QwenLM+Qwen2.5-Math", "evaluation/data/minerva_math/test.jsonl"),
    "olympiadbench": ("QwenLM+Qwen2.5-Math", "evaluation/data/olympiadbench/test.jsonl"),
}


def bench_gold(row: dict) -> str:
    """A benchmark row's gold: its answer (MATH-500, AIME, AMC), final_answer's first item
    (OlympiadBench), else its solution's last \\boxed{} (Qwen2.5-Math's Minerva file has none)."""
    if "answer" in row:
        return str(row["answer"]).strip()
    if "final_answer" in row:
        fa = row["final_answer"]
        return str(fa[0] if isinstance(fa, list) else fa).strip()
    return gmts._last_boxed(row["solution"], cap=10_000)


def grade_sets(args) -> dict:
    """{name: competition rows} of --grade-data NAME=FILE,..., or of GRADE_SETS (git show)."""
    texts = {}
    for part in filter(None, args.grade_data.split(",")):
        name, path = part.split("=", 1)
        with open(path) as f:
            texts[name] = f.read()
    for name, (repo, path) in GRADE_SETS.items() if not texts else ():
        git = os.path.join(args.mirrors, repo, "repo")
        texts[name] = subprocess.run(["git", "-C", git, "show", f"HEAD:{path}"], check=True,
                                     capture_output=True, text=True).stdout
    sets = {}
    for name, text in texts.items():
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        rows = rows[:10] if args.quick else rows
        sets[name] = [{"question": r.get("problem") or r.get("question"), "answer": bench_gold(r),
                       "latex": True} for r in rows]
    return sets


def grade_pass(task, texts: list, rows: list, k: int) -> tuple:
    """(verdicts, the slowest grade in s) of one pass as gmts.evaluate grades: the reward one answer
    at a time in this (the main) thread, latex_equal's cache emptied first."""
    gmts.latex_equal.cache_clear()
    got, slowest = [], 0.0
    for j, text in enumerate(texts):
        t = time.perf_counter()
        got.append(task["reward"](text, rows[j // k]))
        slowest = max(slowest, time.perf_counter() - t)
    return got, slowest


def sec_grading(args, meter, dev) -> dict:
    """Section h: avg@k passes of grading over the five benchmarks in the main thread."""
    sets = grade_sets(args)
    task, k = gmts.TASKS["math"], args.grade_samples
    rows = [r for rs in sets.values() for r in rs]
    texts = [f"So the final answer is $\\boxed{{{r['answer']}}}$." for r in rows for _ in range(k)]
    runs, slowest = [], 0.0
    for _ in range(args.grade_repeats):
        t = time.perf_counter()
        got, slow = grade_pass(task, texts, rows, k)
        runs.append(time.perf_counter() - t)
        slowest = max(slowest, slow)
    seconds = statistics.median(runs)
    out = dict(samples=k, grades=len(texts), seconds=seconds, answers_per_s=len(texts) / seconds,
               slowest_grade_s=slowest, seconds_runs=[round(x, 2) for x in runs], sets={})
    i = 0
    for name, rs in sets.items():
        n = len(rs) * k
        acc = sum(x == 1.0 for x in got[i:i + n]) / n
        out["sets"][name] = dict(rows=len(rs), grades=n, acc=acc)
        i += n
    return out


def targets(R: dict, C: int) -> list:
    """PASS/FAIL of each target, computed from the measurements."""
    t = []

    def add(name, value, limit):
        t.append(dict(target=name, value=value, limit=limit,
                      passed=value is not None and value <= limit))

    s = R.get("stats", {})
    if "trl" in s and s["trl"]["peak_mb"] is not None:
        add(f"stats peak: ours@{C} / trl@{C}", s[f"ours@{C}"]["peak_mb"] / s["trl"]["peak_mb"], 1.0)
    if "trl" in s:
        add(f"stats time: ours@{C} / trl@{C}", s[f"ours@{C}"]["ms"] / s["trl"]["ms"], 1.5)
    if "loss_head" in R:
        a, b = R["loss_head"]["all"], R["loss_head"]["selected"]
        add("loss head time: selected / all", b["ms"] / a["ms"], 0.35)
        if a["peak_mb"]:
            add("loss head peak: selected / all", b["peak_mb"] / a["peak_mb"], 0.35)
    for key, r in R.get("select", {}).items():
        # the authors' shape; --quick's is tiny
        if "loop_over_vectorised" in r and not R["meta"]["quick"]:
            add(f"per-group select: vectorised / loop ({key.split('/')[0]})",
                1 / r["loop_over_vectorised"], 0.1)
    for key in ("step_tiny", "step_model"):
        if key in R:
            add(f"{key}: step 6's share of a gmts step", R[key]["gmts"]["select_share"], 0.01)
            add(f"{key}: step time gmts / all", R[key]["step_ratio_gmts_all"], 1.05)
    S = R.get("step_model", {})
    # issue 16's GPU targets (a CPU run has none)
    if "rollout_paths" in S and R["meta"]["device"] != "cpu":
        add("rollout tokens/s old / new path (new >= 5x)", 1 / S["rollout_paths"]["speedup"], 0.2)
        if "step_ratio_gmts_trl" in S:
            add("step gmts (new rollout) / TRL GRPOTrainer", S["step_ratio_gmts_trl"], 0.4)
        add("process peak GB (fp32 + AdamW + bf16 copy)", S["process_peak_mb"] / 1024, 15.9)
    return t


def table(R: dict) -> str:
    fmt = lambda x, f: (format(max(x, 0.0), f) if x is not None  # noqa: E731
                        else format("-", ">" + f.split(".")[0]))
    lines = [f"{'section':<12} {'variant':<26} {'ms':>10} {'peak_mb':>9}  note", "-" * 78]
    for sec, rows in (("a stats", R.get("stats", {})), ("b loss head", R.get("loss_head", {})),
                      ("c select", R.get("select", {}))):
        for k, r in rows.items():
            note = ("fails: " + r["error"]) if "error" in r else \
                (f"max|d logp| {r['max_abs_diff_logp']:.1e}, "
                 f"max|d H| {r['max_abs_diff_entropy']:.1e} vs naive"
                 if "max_abs_diff_logp" in r else "")
            if "loop_over_vectorised" in r:
                note = (f"{r['tokens']} tokens; same kept tokens as the loop: "
                        f"{r['same_kept_tokens']}; loop / select_tokens "
                        f"{r['loop_over_vectorised']:.0f}x")
            lines.append(f"{sec:<12} {k:<26} {fmt(r['ms'], '10.1f')} "
                         f"{fmt(r['peak_mb'], '9.0f')}  {note}")
    for key, sec in (("step_tiny", "d step"), ("step_model", "e step")):
        if key in R:
            S = R[key]
            lines.append(f"{sec:<12} {'rollout':<26} {S['rollout']['ms']:10.1f} "
                         f"{fmt(S['rollout']['peak_mb'], '9.0f')}  "
                         f"{S['rollout']['tokens_per_s']:.0f} tok/s; {S['model']}; "
                         f"total peak {S['process_peak_mb']:.0f} MB")
            for m in ("all", "random", "gmts"):
                r = S[m]
                lines.append(f"{sec:<12} {'update --select ' + m:<26} {r['ms']:10.1f} "
                             f"{fmt(r['peak_mb'], '9.0f')}  "
                             f"step {r['step_ms']:.0f} ms, stats pass {r['stats_share']:.0%}, "
                             f"select {r['select_ms']:.1f} ms, kept {r['kept_frac']:.2f} in "
                             f"{r['active_frac']:.0%} of answers")
    S = R.get("step_model", {})
    for k, r in S.get("rollout_paths", {}).items():
        if k in ("old", "new"):
            cache = (("static+compile" if R["meta"]["device"] != "cpu" else "static")
                     if r.get("fast_generate") else "dynamic")
            what = f"{k} ({r.get('sampler_dtype', 'fp32')}, {cache})"
            lines.append(f"{'e rollout':<12} {what:<26} {r['ms']:10.1f} "
                         f"{fmt(r['peak_mb'], '9.0f')}  "
                         f"{r['tokens_per_s']:.0f} tok/s, first call {r['first_call_ms']:.0f} ms, "
                         f"|d logp| vs recompute mean {r['sampler_logp_gap']:.1e} "
                         f"max {r['sampler_logp_gap_max']:.1e}")
    if "rollout_paths" in S:
        lines.append(f"{'e rollout':<12} {'speedup new / old':<26} "
                     f"{S['rollout_paths']['speedup']:10.2f}")
    if "trl" in S:
        r = S["trl"]
        lines.append(f"{'e trl':<12} {'GRPOTrainer step':<26} " + (
            f"{r['step_ms']:10.1f} {fmt(r['peak_mb'], '9.0f')}  {r['weights']} weights; "
            f"gmts step (new rollout) / trl {S['step_ratio_gmts_trl']:.2f}, "
            f"all / trl {S['step_ratio_all_trl']:.2f}"
            if "step_ms" in r else f"{'-':>10} {'-':>9}  {r['error']}"))
    if "threads" in R:
        T = R["threads"]
        for v, r in T["variants"].items():
            what = f"--threads {v} ({r['torch_threads']} torch)"
            lines.append(f"{'f threads':<12} {what:<26} {1e3 / r['steps_per_s']:10.1f} {'-':>9}  "
                         f"{r['steps_per_s']:.3f} steps/s (runs {r['steps_per_s_runs']}), "
                         f"wall {r['wall_s']:.0f} s for {T['steps']} steps of --preset "
                         f"{T['preset']}; same metrics each run: "
                         f"{'yes' if r['metrics_identical'] else 'no'}")
        if "ratio" in T:
            d = T["metrics_first_difference_across"]
            lines.append(f"{'f threads':<12} {'ratio ' + ' / '.join(T['variants']):<26} "
                         f"{T['ratio']:10.2f} {'':>9}  {T['ratio_of']}; metrics "
                         + ("identical" if d is None else f"differ from step {d['step']} in "
                            + ", ".join(T["metrics_keys_differing_across"])))
    if "grading" in R:
        g = R["grading"]
        accs = ", ".join(f"{n} {s['acc']:.3f} of {s['rows']}" for n, s in g["sets"].items())
        lines.append(f"{'h grading':<12} {'main thread':<26} {g['seconds'] * 1e3:10.0f} {'-':>9}  "
                     f"{g['grades']} grades (avg@{g['samples']}), {g['answers_per_s']:.0f} "
                     f"answers/s, runs {g['seconds_runs']} s, slowest grade "
                     f"{g['slowest_grade_s']:.2f} s; share of 1.0: {accs}")
    lines += ["-" * 78, "targets"]
    for t in R["targets"]:
        lines.append(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['target']:<48} {t['value']:.3g}  "
                     f"(<= {t['limit']})")
    return "\n".join(lines)


def trl_rescore_run(lr: float, num_iterations: int, steps: int) -> dict:
    """One TRL run of warm/cpu with gmts_trl's GMTSTrainer (section i): time in select, and at
    each later pass the kept tokens that differ from the mask the first pass wrote."""
    import gmts_trl

    model, tok = gmts.load_model(gmts.WARM_CPU, torch.device("cpu"))
    rows = gmts.load_rows("countdown", "easy", n=256, seed=0)
    data = gmts_trl.make_dataset(tok, "countdown", rows, chat=gmts.use_chat(tok), short=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = gmts_trl.GMTSConfig(
            output_dir=tmp, use_cpu=True, report_to=[], bf16=False, per_device_train_batch_size=8,
            gradient_accumulation_steps=4, num_generations=8, num_iterations=num_iterations,
            max_completion_length=64, max_steps=steps, logging_steps=1, save_strategy="no",
            gradient_checkpointing=False, learning_rate=lr, token_selection="gmts", token_rho=0.2,
            epsilon=0.2, epsilon_high=0.28, disable_tqdm=True, seed=0)
        tr = gmts_trl.GMTSTrainer(model=model, reward_funcs=gmts_trl.make_reward("countdown"),
                                  args=cfg, train_dataset=data, processing_class=tok)
        from transformers import PrinterCallback
        tr.remove_callback(PrinterCallback)
        select, clock, kept, same = tr.select, [0.0], [0], [0]

        def timed(batches, group_size):
            before = [b.get("gmts_keep") for b in batches]
            t = time.perf_counter()
            select(batches, group_size)
            clock[0] += time.perf_counter() - t
            if before[0] is not None:  # a later pass over the same generation batch
                now = torch.cat([b["gmts_keep"] for b in batches])
                kept[0] += int(now.sum())
                same[0] += int((torch.cat(before) & now).sum())

        tr.select = timed
        t0 = time.perf_counter()
        tr.train()
        total = time.perf_counter() - t0
        clip = [h["clip_ratio/region_mean"] for h in tr.state.log_history
                if "clip_ratio/region_mean" in h]
    return dict(lr=lr, num_iterations=num_iterations, steps=steps, total_s=round(total, 2),
                select_s=round(clock[0], 2), select_share=round(clock[0] / total, 3),
                changed_share=round(1 - same[0] / kept[0], 3) if kept[0] else None,
                clip_region_mean=round(statistics.mean(clip), 4) if clip else None)


def sec_trl_rescore(args, meter, dev) -> dict:
    """Section i: gmts_trl.py's scoring pass per pass over a generation batch, its time and what
    it changes."""
    try:
        import trl  # noqa: F401
    except ImportError as e:
        return dict(error=f"trl not importable: {e}")
    steps = args.trl_rescore_steps
    runs = [trl_rescore_run(3e-4, 1, steps)]
    runs += [trl_rescore_run(lr, 2, steps) for lr in (3e-4, 1e-3)]
    for r in runs:
        print(f"[i] {r}", file=sys.stderr, flush=True)
    return dict(runs=runs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="GMTS performance benchmark (see the module docstring). "
                    "`bench_gmts.py plan [gmts.py's flags]` prints the memory plan of that run "
                    "instead (e.g. plan --preset paper-math).")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=0,
                   help="rows in sections a and b (0: 4096 on CPU, 32768 on CUDA)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=128,
                   help="rows per chunk for trl and ours in section a")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (medians)")
    p.add_argument("--head-repeats", type=int, default=0,
                   help="runs per variant in the head sections a and b (0: 2 on CPU, where one "
                        "4096-row head pass takes ~30 s on a core; --repeats on CUDA)")
    p.add_argument("--extra", action="store_true",
                   help="also ours@1024 in a and all@1024 (chunked) in b")
    p.add_argument("--rho", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--plan-hidden", type=int, default=256, help="section g's tiny model width")
    p.add_argument("--sections", default="abcdeg",
                   help="which sections to run (e: on CUDA or with --small; f, h: only when named)")
    p.add_argument("--small", action="store_true",
                   help="section e with a tiny Qwen2 config (CPU smoke of the path)")
    p.add_argument("--quick", action="store_true",
                   help="seconds: tiny sizes everywhere, implies --small")
    p.add_argument("--sampler-dtype", default="bf16", choices=["bf16", "fp32"],
                   help="section e's new rollout path samples from a copy in this dtype (bf16) or "
                        "the master (fp32)")
    p.add_argument("--fast-generate", default=None, action=argparse.BooleanOptionalAction,
                   help="section e's new path: static KV cache + compiled decoding (default: on "
                        "with CUDA or --quick; HF generate compiles on CUDA only)")
    p.add_argument("--trl-steps", type=int, default=-1,
                   help="TRL GRPOTrainer steps in section e, median of steps 2..n (-1: 4, "
                        "--quick 2; 0: none)")
    p.add_argument("--thread-steps", type=int, default=0,
                   help="steps per run in section f (0: 5, --quick 1)")
    p.add_argument("--thread-preset", default="",
                   help="gmts.py preset section f runs (default: cpu, --quick smoke)")
    p.add_argument("--thread-variants", default="1,0",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="section f's --threads values, compared first / second "
                        "(0: torch's default)")
    p.add_argument("--grade-samples", type=int, default=0,
                   help="section h's answers per row (0: 16, --quick 2)")
    p.add_argument("--grade-repeats", type=int, default=2, help="section h's passes (median)")
    p.add_argument("--grade-data", default="",
                   help="section h's sets as NAME=FILE,... (default: GRADE_SETS in --mirrors)")
    p.add_argument("--mirrors", default="/work/.mirror",
                   help="section h: the folder of GRADE_SETS' git clones")
    p.add_argument("--trl-rescore-steps", type=int, default=0,
                   help="optimizer steps per run in section i (0: 12, --quick 2)")
    p.add_argument("--json", default="", help="write all measurements here")
    a = p.parse_args(argv)
    a.tokens = a.tokens or (256 if a.quick else 32768 if a.device == "cuda" else 4096)
    a.head_repeats = a.head_repeats or (a.repeats if a.device == "cuda" or a.quick else 2)
    a.select_sizes = [2 ** 14, 2 ** 16] if a.quick else [2 ** 20, 2 ** 25]
    a.trl_steps = (2 if a.quick else 4) if a.trl_steps < 0 else a.trl_steps
    a.thread_steps = a.thread_steps or (1 if a.quick else 5)
    a.grade_samples = a.grade_samples or (2 if a.quick else 16)
    a.grade_repeats = 1 if a.quick else a.grade_repeats
    a.trl_rescore_steps = a.trl_rescore_steps or (2 if a.quick else 12)
    a.thread_preset = a.thread_preset or ("smoke" if a.quick else "cpu")
    if a.fast_generate is None:
        a.fast_generate = a.quick or a.device == "cuda"
    if a.quick:
        a.vocab, a.repeats, a.small, a.extra = min(a.vocab, 8192), min(a.repeats, 2), True, True
    return a


def main(argv=None):
    """`plan [gmts.py's flags]`: the memory plan of that run; else the benchmark. Errors: one line
    (gmts.run_cli)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return gmts.run_cli("bench_gmts", lambda: plan(argv[1:]))
    return gmts.run_cli("bench_gmts", lambda: bench(argv))


def bench(argv: list) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise gmts.BadInput("--device cuda but torch sees no CUDA device")
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    meter = Meter(dev)
    t0 = time.time()
    R = dict(meta=dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       torch=torch.__version__, threads=torch.get_num_threads(),
                       cpus=os.cpu_count(), tokens=args.tokens, vocab=args.vocab, hidden=HIDDEN,
                       chunk=args.chunk, rho=args.rho, repeats=args.repeats, quick=args.quick,
                       trl=selective_log_softmax is not None, loadavg_start=os.getloadavg(),
                       peak_method="cuda max_memory_allocated" if dev.type == "cuda"
                       else "VmHWM - VmRSS" if meter.cpu_rss else "none"))
    steps = [("a", "stats", sec_stats), ("b", "loss_head", sec_loss_head),
             ("c", "select", sec_select), ("d", "step_tiny", sec_tiny_step)]
    if dev.type == "cuda" or args.small:
        steps.append(("e", "step_model", sec_model_step))
    steps.append(("f", "threads", sec_threads))
    steps.append(("g", "memory_plan", sec_memory_plan))
    steps.append(("h", "grading", sec_grading))
    steps.append(("i", "trl_rescore", sec_trl_rescore))
    for letter, key, fn in steps:
        if letter in args.sections:
            t = time.time()
            R[key] = fn(args, meter, dev)
            print(f"[{letter}] {key}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    S = R.get("step_model", {})  # issue 16's headline figures, at the top level of the JSON
    if "rollout_paths" in S:
        new = S["rollout_paths"]["new"]
        R.update(rollout_speedup=S["rollout_paths"]["speedup"],
                 sampler_logp_gap=new["sampler_logp_gap"],
                 sampler_logp_gap_max=new["sampler_logp_gap_max"],
                 step_ratio_gmts_trl=S.get("step_ratio_gmts_trl"))
    R["targets"] = targets(R, args.chunk)
    R["meta"].update(loadavg_end=os.getloadavg(), seconds=round(time.time() - t0, 1))
    m = R["meta"]
    print(f"device {m['device']} | torch {m['torch']} | {m['threads']} thread(s) of {m['cpus']} "
          f"CPUs | tokens {m['tokens']} x vocab {m['vocab']} x hidden {HIDDEN} "
          f"| chunk {m['chunk']} | rho {m['rho']} "
          f"| medians of {m['repeats']} (a, b: {args.head_repeats}) "
          f"| load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f} | {m['seconds']:.0f} s",
          flush=True)
    print(table(R), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1)
    return R


if __name__ == "__main__":
    main()
