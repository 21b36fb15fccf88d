"""
bench_gmts.py: what GMTS costs, measured with gmts.py's own functions. One command per question;
each prints its table and its ratios and writes them as JSON (--json, default bench_COMMAND.json).

  plan [--prompt-tokens P] [gmts.py's flags]
           The memory a gmts.py run needs, before renting a GPU: the bytes of what stays (weights,
           AdamW, the sampler copy, the KL reference) plus the largest phase of a step, from the
           model's config alone (no weight is read), against the device's memory; beyond it, the
           first flags that fit. --model: a hub id (online), a local folder or a config.json
           (offline). P, the longest prompt in tokens, comes from the run's data and tokenizer
           unless --prompt-tokens gives it.
  memory   The plan checked: each phase of a step (sampling, statistics, update, AdamW's step,
           evaluation) run on a random tiny Qwen2, its measured peak beside the plan's bytes
           (ratio measured / plan). The CPU terms only: 4-byte activations, the fp32 sampler.
  stats    The token statistics and the selection: log p_y and entropy of (tokens x 151,936)
           logits by a full log_softmax, by TRL's selective_log_softmax and entropy_from_logits,
           and by gmts.token_stats in chunks; the loss head's forward and backward over every token
           against over the kept rho share; gmts.select_tokens against torch.quantile (TRL's
           threshold) and, per group at the GMTS authors' batch (64 x 16 answers of up to 2,048
           tokens), against their token-by-token loop.
  step     One training step (rollout, then train()'s statistics, scores, selection and update)
           for --select all, random and gmts on one fixed batch, beside TRL's GRPOTrainer step on
           the same model, prompts and lengths. The model is random, so its rewards are random 0/1
           with one right and one wrong answer per group: every answer has A != 0.
  rollout  Tokens per second of gmts.py's rollout on the fp32 master weights (dynamic KV cache)
           and on the bf16 sampler copy train() uses on CUDA (static KV cache, compiled decoding),
           and how far the sampler's log-probs are from train()'s fp32 recompute.
  grading  Grading at the paper's size: one avg@16 pass over the five benchmarks --preset
           paper-math evaluates on (or --grade-data NAME=DATA,...), each answer its row's own
           gold boxed, graded as gmts.evaluate grades (one answer at a time, in the main thread).
  trl-select
           gmts_trl.py's selection pass in a TRL run of warm/cpu: its share of the run's time, and
           with num_iterations 2, the share of a later pass's kept tokens that the first pass's
           mask would not keep.

step and rollout use the Qwen2.5-0.5B config at random init on CUDA (--shape qwen0.5b) and
warm/cpu's shape with the cpu preset's batch on the CPU (--shape tiny); --quick: seconds, tiny
sizes everywhere (--shape small: a 2-layer Qwen2 config).

How it measures. Variants run interleaved (A B, then B A, ...) in one process; tables show
medians. Peak memory is the growth over the state before the call: on CUDA max_memory_allocated
after reset_peak_memory_stats; on the CPU the process's resident set (VmHWM after resetting it,
minus VmRSS before), with glibc told to mmap every block of 1 MiB or more so that freed tensors
leave the resident set. On the CPU torch runs one thread by default (--threads): on a shared
2-core machine two OpenMP threads wait on each other.

Run:  python bench_gmts.py plan --preset paper-math
      python bench_gmts.py step --device cuda
      python bench_gmts.py stats --quick --json /tmp/stats.json
Why each command came to be, and what each measured: dev/LOG.md.
"""
import argparse
import copy
import ctypes
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import random
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
except ImportError:  # trl is optional: the TRL rows are left out
    selective_log_softmax = entropy_from_logits = None

QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
              tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0)
SMALL = dict(QWEN05, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4)
HIDDEN = 896  # stats: Qwen2.5-0.5B's hidden size
HERE = os.path.dirname(os.path.abspath(__file__))


# ==== Measuring [plumbing]: time and peak memory of a call, variants interleaved =================
class Meter:
    """meter(fn) -> (ms, peak_mb, fn's result); peak_mb is None where it cannot be measured."""

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
    """Run every variant `repeats` times, reversing the order every other round -> {variant:
    medians of ms and peak_mb, each run's, and the last result as "out"}."""
    runs, last = {k: [] for k in variants}, {}
    for r in range(repeats):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            ms, peak, last[k] = meter(variants[k])
            runs[k].append((ms, peak))

    def median(xs):
        return statistics.median(xs) if None not in xs else None
    return {k: dict(ms=median([x[0] for x in v]), peak_mb=median([x[1] for x in v]),
                    ms_runs=[round(x[0], 1) for x in v],
                    peak_mb_runs=[x[1] and round(x[1], 1) for x in v], out=last[k])
            for k, v in runs.items()}


# ==== stats: token statistics, the loss head on the kept rows, the selection ====================
def head_inputs(M: int, V: int, device, seed=0):
    """A random lm_head (V x HIDDEN, logits ~ N(0, 1) per row), M hidden states and M tokens."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, HIDDEN, generator=g) * HIDDEN ** -0.5)
    h = torch.randn(M, HIDDEN, generator=g)
    y = torch.randint(0, V, (M,), generator=g)
    return head.to(device), h.to(device), y.to(device)


def token_statistics(args, meter, dev) -> dict:
    """log p_y and entropy from the same hidden states, the head matmul included everywhere:
    naive (a full log_softmax), trl (its selective_log_softmax and entropy_from_logits, --chunk
    rows at a time), ours (gmts.token_stats on --chunk rows, and on 1024: Config.stats_chunk)."""
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

    @torch.no_grad()
    def ours(h, y, chunk):  # gmts.batch_token_stats' head loop
        parts = [gmts.token_stats(F.linear(hc, W), yc, 1.0)
                 for hc, yc in zip(h.split(chunk), y.split(chunk))]
        return tuple(torch.cat(p) for p in zip(*parts))

    fns = {"naive": naive, "trl": trl if selective_log_softmax else None,
           f"ours@{C}": functools.partial(ours, chunk=C), "ours@1024":
           functools.partial(ours, chunk=1024)}
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


def loss_head(args, meter, dev) -> dict:
    """The head's forward and backward (d hidden and d lm_head) with gmts.head_logp: over every
    token in one piece ("all": the logits of all N*T positions at once), over the rho share of
    rows gathered from the hidden states first ("selected", as policy_update does), and over
    every token in chunks of 1024 ("all@1024": chunking alone bounds the memory too)."""
    head, h, y = head_inputs(args.tokens, args.vocab, dev, seed=1)
    M = args.tokens
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(M, generator=g).to(dev)
    kept = torch.randperm(M, generator=g)[:math.ceil(args.rho * M)].sort().values.to(dev)

    def run(rows, chunk):
        hh = h.detach().requires_grad_()  # stands for the transformer's output
        hs = hh if rows is None else hh[rows]
        logp = gmts.head_logp(hs, head, y if rows is None else y[rows], 1.0, chunk)
        a = adv if rows is None else adv[rows]
        (-(logp * a).sum() / M).backward()
        head.weight.grad = None  # every run allocates its own d lm_head

    res = interleave(meter, {"all": lambda: run(None, M), "selected": lambda: run(kept, 1024),
                             "all@1024": lambda: run(None, 1024)}, args.head_repeats)
    for r in res.values():
        del r["out"]
    return res


def selection(args, meter, dev) -> dict:
    """gmts.select_tokens over the batch beside torch.quantile (TRL's threshold; it refuses more
    than 2^24 elements), then per group at the authors' shape beside their token loop."""
    out = {}
    for n in args.select_sizes:
        T = 1024 if n >= 1024 * 64 else 64
        g = torch.Generator().manual_seed(3)
        scores = torch.rand(n // T, T, generator=g).to(dev)
        lengths = torch.randint(T // 4, T + 1, (n // T, 1), generator=g).to(dev)
        mask = torch.arange(T, device=dev)[None, :] < lengths  # valid prefixes, ~62% of positions

        def quantile():  # TRL's get_high_entropy_mask: the (1 - rho) quantile as threshold
            return (scores >= torch.quantile(scores[mask], 1 - args.rho)) & mask

        variants = {"select_tokens": lambda: gmts.select_tokens(scores, mask, args.rho),
                    "quantile": quantile}
        try:
            quantile()
        except RuntimeError as e:
            del variants["quantile"]
            out[f"{n}/quantile"] = dict(ms=None, peak_mb=None, error=gmts.error_line(e, 120))
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
    """Per-group selection on one batch of the authors' shape (64 prompts x 16 answers, up to
    2,048 tokens; --quick: 4 x 4 x 64): the literal loop (once: tens of seconds) beside
    select_tokens (--repeats runs), whether they keep the same tokens, and their time ratio."""
    B, G, T = (4, 4, 64) if args.quick else (64, 16, 2048)
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(B * G, T, generator=g)
    scores[torch.rand(B * G, T, generator=g) < 0.05] = 0.0  # zero entropy, A = 0: never kept
    lengths = torch.randint(T // 8, T + 1, (B * G, 1), generator=g)
    mask = torch.arange(T)[None, :] < lengths  # (N, T)
    on_dev = (scores.to(dev), mask.to(dev))  # copied once: the timing is the selection's

    def fast():
        return gmts.select_tokens(*on_dev, args.rho, nonzero=True, group_size=G)
    fast = interleave(meter, {"fast": fast}, args.repeats)["fast"]
    loop = interleave(meter, {"loop": lambda: literal_group_select(scores, mask, args.rho, G)},
                      1)["loop"]
    same = torch.equal(fast.pop("out").cpu(), loop.pop("out"))
    shape = f"{B}x{G}x{T}"
    return {f"group {shape}/literal_loop": loop,
            f"group {shape}/select_tokens": dict(fast, tokens=int(mask.sum()),
                                                 same_kept_tokens=same)}


def stats_command(args, meter, dev) -> tuple:
    res = dict(stats=token_statistics(args, meter, dev), loss_head=loss_head(args, meter, dev),
               select=selection(args, meter, dev))
    S, L, C = res["stats"], res["loss_head"], args.chunk
    ratios = {f"stats time ours@{C} / naive": S[f"ours@{C}"]["ms"] / S["naive"]["ms"]}
    if "trl" in S:
        ratios[f"stats time ours@{C} / trl@{C}"] = S[f"ours@{C}"]["ms"] / S["trl"]["ms"]
        if S["trl"]["peak_mb"]:
            ratios[f"stats peak ours@{C} / trl@{C}"] = (S[f"ours@{C}"]["peak_mb"]
                                                        / S["trl"]["peak_mb"])
    ratios["loss head time selected / all"] = L["selected"]["ms"] / L["all"]["ms"]
    if L["all"]["peak_mb"]:
        ratios["loss head peak selected / all"] = L["selected"]["peak_mb"] / L["all"]["peak_mb"]
    for n in args.select_sizes:
        q, ours = res["select"][f"{n}/quantile"], res["select"][f"{n}/select_tokens"]
        if q["ms"] is not None:
            ratios[f"quantile / select_tokens ({n})"] = q["ms"] / ours["ms"]
    loop, fast = (r for k, r in res["select"].items() if k.startswith("group "))
    ratios["authors' loop / select_tokens per group"] = loop["ms"] / fast["ms"]
    rows = [(f"stats {k}", r, f"max|d logp| {r['max_abs_diff_logp']:.1e}, max|d H| "
             f"{r['max_abs_diff_entropy']:.1e} vs naive") for k, r in S.items()]
    rows += [(f"loss head {k}", r, "") for k, r in L.items()]
    same = "the same" if fast["same_kept_tokens"] else "OTHERS"
    rows += [(f"select {k}", r, r.get("error") or (f"{r['tokens']} tokens; the loop's kept tokens: "
                                                  f"{same}" if "tokens" in r else ""))
             for k, r in res["select"].items()]
    return res, rows, ratios


# ==== step and rollout: one training step beside TRL's; the rollout paths =======================
def bench_model(args, dev) -> tuple:
    """(model, tok, prompts, cfg, what) of --shape: tiny (warm/cpu's shape, random weights, the
    cpu preset's countdown batch), small or qwen0.5b (that Qwen2 config at random init, fp32 as
    gmts.load_model, the byte-level tokenizer, whose ids are valid in any Qwen vocabulary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if args.shape == "tiny":
        keys = ("prompts_per_step", "group_size", "max_new_tokens", "lr", "micro_batch")
        preset = gmts.PRESETS["smoke" if args.quick else "cpu"]
        cfg = gmts.Config(**{k: preset[k] for k in keys if k in preset})
        model, tok = gmts.build_tiny(96, 3, seed=0)
        rows = gmts.load_rows("countdown", "easy", cfg.prompts_per_step, 0)
        prompts = gmts.build_prompts(tok, gmts.get_task("countdown"), rows, False, True)
        return model.to(dev).train(), tok, prompts, cfg, "warm/cpu's shape, random init"
    small = args.shape == "small"
    cfg = gmts.Config(**(dict(prompts_per_step=2, group_size=2, max_new_tokens=8) if small
                         else {}))
    torch.manual_seed(0)
    with torch.device(dev):  # random init directly on the device
        model = Qwen2ForCausalLM(Qwen2Config(**(SMALL if small else QWEN05), eos_token_id=151645,
                                             pad_token_id=151643, bos_token_id=None))
    tok = gmts.build_tiny()[1]
    prompts = text_prompts(cfg.prompts_per_step, 8 if small else 64, seed=0)
    what = "a 2-layer Qwen2 config" if small else "the Qwen2.5-0.5B config"
    return model.train(), tok, prompts, cfg, what + ", random init"


def text_prompts(B: int, P: int, seed: int) -> list:
    """B printable-ASCII prompts of P - P//8 .. P bytes: as many tokens with the byte-level
    tokenizer, so the rows are left-padded as real prompts are."""
    r = random.Random(seed)
    return ["".join(r.choice(string.ascii_letters + " ") for _ in range(r.randint(P - P // 8, P)))
            for _ in range(B)]


def bf16_copy(model):
    """What gmts.train samples from on CUDA: a bf16 copy of the parameters (buffers such as RoPE's
    inv_freq stay fp32, as from_pretrained(dtype=bf16) leaves them)."""
    out = copy.deepcopy(model).eval().requires_grad_(False)
    for p in out.parameters():
        p.data = p.data.to(torch.bfloat16)
    return out


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
        t0 = clock()  # the extra no-grad forward of the statistics: its share of a step
        logp, ent, gn = gmts.batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch,
                                               cfg.stats_chunk)
        stats_ms[method].append((clock() - t0) * 1e3)
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
    for m in methods:  # a step: the median rollout + this update; select_ms: step 6
        r = res[m]
        r.update(r.pop("out"), step_ms=roll["ms"] + r["ms"], select_ms=statistics.median(sel_ms[m]))
        r["select_share"] = r["select_ms"] / r["step_ms"]
        r["stats_ms"] = statistics.median(stats_ms[m])
        r["stats_share"] = r["stats_ms"] / r["step_ms"]
        out[m] = r
    out["process_peak_mb"] = meter.process_peak_mb  # CUDA: weights and Adam too; CPU: max RSS
    return out


def trl_step(model, tok, prompts, cfg, dev, steps: int) -> dict:
    """TRL's GRPOTrainer (HF generate, all tokens; no gradient checkpointing, as gmts.py; bf16
    weights on CUDA, as TRL loads a Qwen checkpoint) on a copy of `model`: the same prompts, G,
    completion length and micro-batch; random 0/1 rewards (seeded) so that advantages are not 0.
    Median step of 2..n."""
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


def step_command(args, meter, dev) -> tuple:
    """step_bench with train()'s rollout (the bf16 sampler copy refreshed from the master, with a
    static cache and compiled decoding, on CUDA), and TRL's step on the same model and prompts."""
    model, tok, prompts, cfg, what = bench_model(args, dev)
    cuda = dev.type == "cuda"
    trl = (trl_step(model, tok, prompts, cfg, dev, args.trl_steps) if args.trl_steps
           else dict(error="--trl-steps 0"))
    sampler = bf16_copy(model) if cuda else model

    def make_batch(seed):
        gmts.refresh_sampler(sampler, model)
        gmts.set_seed(seed)
        return gmts.rollout(sampler, tok, prompts, cfg.group_size, cfg.max_new_tokens,
                            cfg.temperature, fast=cuda)

    res = step_bench(model, make_batch, cfg, meter, args.repeats)
    res.update(trl=trl, model=f"{what}, {cfg.prompts_per_step} x {cfg.group_size} answers of "
                              f"up to {cfg.max_new_tokens} tokens")
    ratios = {f"step time {m} / all": res[m]["step_ms"] / res["all"]["step_ms"]
              for m in ("random", "gmts")}
    ratios["step 6 (omega, scores, selection) / gmts step"] = res["gmts"]["select_share"]
    ratios["statistics pass / gmts step"] = res["gmts"]["stats_share"]
    if "step_ms" in trl:
        ratios.update({f"step time {m} / TRL GRPOTrainer": res[m]["step_ms"] / trl["step_ms"]
                       for m in ("all", "gmts")})
    r = res["rollout"]
    rows = [("rollout", r, f"{r['tokens_per_s']:.0f} tok/s; {res['model']}; process peak "
                           f"{res['process_peak_mb']:.0f} MB")]
    rows += [(f"update --select {m}", res[m],
              f"step {res[m]['step_ms']:.0f} ms, kept {res[m]['kept_frac']:.2f} in "
              f"{res[m]['active_frac']:.0%} of the answers") for m in ("all", "random", "gmts")]
    rows.append(("TRL GRPOTrainer step", dict(ms=trl.get("step_ms"), peak_mb=trl.get("peak_mb")),
                 trl.get("error") or f"{trl['weights']} weights, steps {trl['step_ms_runs']}"))
    return res, rows, ratios


def rollout_command(args, meter, dev) -> tuple:
    """gmts.rollout on the fp32 master (dynamic KV cache) beside the sampler train() uses on CUDA
    (a bf16 copy, static KV cache, compiled decoding), interleaved; each returns the sampler's
    log-probs, compared with train()'s fp32 recompute (gmts.batch_token_stats)."""
    model, tok, prompts, cfg, what = bench_model(args, dev)
    fast = dev.type == "cuda" or args.quick  # HF generate compiles on CUDA only
    sampler = bf16_copy(model)
    seeds = itertools.count()

    def run(m, fast_path):
        gmts.set_seed(next(seeds))
        return gmts.rollout(m, tok, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature,
                            fast=fast_path, sampler_logp=True)

    variants = {"fp32 master": lambda: run(model, False), "bf16 sampler": lambda: run(sampler,
                                                                                      fast)}
    first = {k: meter(fn)[0] for k, fn in variants.items()}  # compilation: not in the medians
    res = interleave(meter, variants, args.repeats)
    for k, r in res.items():
        b = r.pop("out")
        logp = gmts.batch_token_stats(model, b, cfg.temperature, cfg.micro_batch,
                                      cfg.stats_chunk)[0]
        gap = (b["sampler_logp"] - logp).abs()[b["resp_mask"]]
        N, T = b["comp_ids"].shape
        r.update(first_call_ms=first[k], N=N, T=T, tokens_per_s=N * T / (r["ms"] / 1e3),
                 sampler_logp_gap=float(gap.mean()), sampler_logp_gap_max=float(gap.max()))
    res["bf16 sampler"]["static_cache"] = fast
    res["model"] = what
    old, new = res["fp32 master"], res["bf16 sampler"]
    ratios = {"tokens/s bf16 sampler / fp32 master": new["tokens_per_s"] / old["tokens_per_s"],
              "sampler log-prob gap, mean (bf16 sampler)": new["sampler_logp_gap"],
              "sampler log-prob gap, max (bf16 sampler)": new["sampler_logp_gap_max"]}
    rows = [(k, r, f"{r['tokens_per_s']:.0f} tok/s, first call {r['first_call_ms']:.0f} ms, "
                   f"|d logp| vs recompute mean {r['sampler_logp_gap']:.1e} max "
                   f"{r['sampler_logp_gap_max']:.1e}") for k, r in (("fp32 master", old),
                                                                  ("bf16 sampler", new))]
    return res, rows, ratios


# ==== memory: the plan's phases against measured peaks =========================================
def memory_command(args, meter, dev) -> tuple:
    """memory_phases' phases against measured peaks: a random tiny Qwen2 (build_tiny(
    --plan-hidden, 2 layers)), B x G countdown prompts, each phase run as train() runs it, the peak
    beside the plan's bytes for what the call allocates (the update's gradients included; AdamW's
    step measured at step 2, its moments already there)."""
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
    phases = memory_phases(cfg, model, P, dev)[1]
    batch = gmts.rollout(model, tok, prompts, G, T)
    mask = batch["resp_mask"]
    adv = torch.randn(mask.shape[0], device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    objective = gmts.Objective(0.2, 0.28, 0.0, 1.0, **gmts.loss_weights("all", mask, 0))
    old = gmts.batch_token_stats(model, batch, 1.0, cfg.micro_batch, cfg.stats_chunk)[0]

    def update():
        return gmts.loss_backward(model, batch, adv, mask, old, objective,
                                  micro_batch=cfg.micro_batch, chunk=cfg.stats_chunk)
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
            out["AdamW step"] = dict(ms=ms2, peak_mb=step_peak, plan_mb=plan)
        plan = sum(phases[name].values()) / 2**20
        out[name] = dict(ms=ms, peak_mb=peak, plan_mb=plan,
                         parts_mb={k: v / 2**20 for k, v in phases[name].items()})
    ratios = {f"{name}: measured / plan": r["peak_mb"] / r["plan_mb"] for name, r in out.items()
              if r["peak_mb"] is not None}
    rows = [(name, r, f"plan {r['plan_mb']:.2f} MB") for name, r in out.items()]
    res = dict(phases=out, P=P, B=B, G=G, T=T, hidden=args.plan_hidden)
    return res, rows, ratios


# ==== plan: the memory plan of a run, from the model's config ===================================
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
    `memory` checks the CPU phases against measured peaks."""
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


MEMORY_FIXES = ({"grad_ckpt": True}, {"grad_ckpt": True, "micro_batch": 1},
                {"grad_ckpt": True, "micro_batch": 1, "sampler_dtype": "fp32"})


def device_gib(device: torch.device) -> float:
    """The device's memory in GiB: the GPU's, or the machine's for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def memory_line(cfg: gmts.Config, model, prompt_tokens: int, device: torch.device,
                have: float = None) -> str:
    """memory_plan in one line, against `have` GiB (default: the device's); beyond it, the first
    that fits of MEMORY_FIXES and --rollout-rows halved (alone, then with them)."""
    have = device_gib(device) if have is None else have
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


def plan_model(cfg: gmts.Config, tokenizer: bool = True) -> tuple:
    """(model, tokenizer or None) of --model with its weights on the meta device: the sizes and
    the parameter count, no weight read or allocated. --model: 'tiny', a hub id (online), a
    folder or a config.json file (no tokenizer). A model that cannot load: BadInput."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    with torch.device("meta"):
        if cfg.model == "tiny":
            return gmts.build_tiny(cfg.tiny_hidden, cfg.tiny_layers, cfg.seed)
        path = gmts.resolve_model_name(cfg.model)
        try:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
            return model, tok
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
    """`bench_gmts.py plan [--prompt-tokens P] [--json FILE] [gmts.py's flags]`: the memory plan
    of that run in one line; with --json, its parts too."""
    p = argparse.ArgumentParser(prog="bench_gmts.py plan", allow_abbrev=False,
                                description="The memory plan of a gmts.py run; every other flag "
                                            "is gmts.py's (python gmts.py --help).")
    p.error = gmts.bad_flag
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="P, the longest prompt in tokens (default: measured on the run's data "
                        "with the model's tokenizer)")
    p.add_argument("--json", default="", help="also write the plan's parts here")
    own, rest = p.parse_known_args(argv)
    cfg = gmts.parse_args(rest)
    gmts.check_config(cfg)
    if own.prompt_tokens < 0:
        raise gmts.BadInput(f"--prompt-tokens must be >= 1, got {own.prompt_tokens}")
    check_json(own.json)
    if not own.prompt_tokens and os.path.isfile(cfg.model):
        raise gmts.BadInput(f"--model {cfg.model} is a config file, which has no tokenizer: give "
                            "--prompt-tokens P, the longest prompt in tokens")
    model, tok = plan_model(cfg, tokenizer=not own.prompt_tokens)
    P = own.prompt_tokens or longest_prompt(cfg, tok)
    device = gmts.pick_device(cfg.device)
    have = device_gib(device)
    line = memory_line(cfg, model, P, device, have)
    print(line, flush=True)
    if own.json:
        parts = memory_plan(cfg, model, P, device)
        write_json(own.json, dict(line=line, model=cfg.model, prompt_tokens=P, device=str(device),
                                  device_gib=have, plan_gib=parts,
                                  plan_over_device=sum(parts.values()) / have if parts else None))
    return line


# ==== grading: avg@16 over the paper's five benchmarks, in the main thread ======================
def grade_sets(spec: str, quick: bool) -> dict:
    """{name: rows} of NAME=DATA,... (a file or hub set each), read and checked as gmts.py reads
    --eval-data (a row with no question or gold: one line naming the file and the row)."""
    try:
        pairs = gmts.eval_sets(spec)
    except ValueError as e:
        raise gmts.BadInput(str(e).replace("--eval-data", "--grade-data")) from None
    if not pairs:
        raise gmts.BadInput("--grade-data names no set: NAME=DATA,...")
    return {name: gmts.load_rows("math", data, 10 if quick else 0) for name, data in pairs}


def gold_answer(row: dict) -> str:
    """A completion that states the row's gold where its prompt asks for it."""
    if row.get("answer_line"):
        return f"So the answer is below.\nAnswer: {row['answer']}"
    return f"So the final answer is $\\boxed{{{row['answer']}}}$."


def grade_pass(task, texts: list, rows: list, k: int) -> tuple:
    """(verdicts, the slowest grade in s) of one pass as gmts.evaluate grades: the reward one
    answer at a time in this (the main) thread, latex_equal's cache emptied first (avg@k's copies
    hit it, as in an evaluation; no pass reuses another's verdicts)."""
    gmts.latex_equal.cache_clear()
    got, slowest = [], 0.0
    for j, text in enumerate(texts):
        t = time.perf_counter()
        got.append(task["reward"](text, rows[j // k]))
        slowest = max(slowest, time.perf_counter() - t)
    return got, slowest


def grading_command(args, meter, dev) -> tuple:
    sets = grade_sets(args.grade_data, args.quick)
    task, k = gmts.TASKS["math"], args.grade_samples
    rows = [r for rs in sets.values() for r in rs]
    texts = [gold_answer(r) for r in rows for _ in range(k)]
    runs, slowest = [], 0.0
    for _ in range(args.repeats):
        t = time.perf_counter()
        got, slow = grade_pass(task, texts, rows, k)
        runs.append(time.perf_counter() - t)
        slowest = max(slowest, slow)
    seconds = statistics.median(runs)
    res = dict(samples=k, grades=len(texts), seconds=seconds, answers_per_s=len(texts) / seconds,
               slowest_grade_s=slowest, seconds_runs=[round(x, 2) for x in runs], sets={})
    i = 0
    for name, rs in sets.items():
        n = len(rs) * k
        acc = sum(x == 1.0 for x in got[i:i + n]) / n
        res["sets"][name] = dict(rows=len(rs), grades=n, acc=acc)
        i += n
    ratios = {"answers per second": res["answers_per_s"], "slowest grade (s)": slowest}
    ratios.update({f"share graded 1.0: {name}": s["acc"] for name, s in res["sets"].items()})
    rows = [("one pass", dict(ms=seconds * 1e3, peak_mb=None),
             f"{len(texts)} grades (avg@{k} over {len(rows)} rows), runs {res['seconds_runs']} s")]
    return res, rows, ratios


# ==== trl-select: gmts_trl.py's selection pass in a TRL run =====================================
def trl_select_run(lr: float, num_iterations: int, steps: int) -> dict:
    """One TRL run of warm/cpu with gmts_trl's GMTSTrainer (countdown easy, per-device batch 8,
    grad-accum 4, G 8, 64 new tokens, rho 0.2): time in GMTSTrainer.select (the no-grad scoring
    forward and the selection), and at each later pass the kept tokens that differ from the mask
    the first pass wrote."""
    import gmts_trl
    from transformers import PrinterCallback

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
    return dict(lr=lr, num_iterations=num_iterations, steps=steps, total_s=total,
                select_s=clock[0], select_share=clock[0] / total,
                changed_share=1 - same[0] / kept[0] if kept[0] else None)


def trl_select_command(args, meter, dev) -> tuple:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        raise gmts.BadInput(f"trl-select needs trl ({e})") from None
    runs = [trl_select_run(3e-4, 1, args.trl_select_steps)]
    runs += [trl_select_run(lr, 2, args.trl_select_steps) for lr in (3e-4, 1e-3)]
    ratios = {}
    for r in runs:
        what = f"num_iterations {r['num_iterations']}, lr {r['lr']:g}"
        ratios[f"select / run time ({what})"] = r["select_share"]
        if r["changed_share"] is not None:
            ratios[f"later pass's kept tokens not kept by the first ({what})"] = r["changed_share"]
    rows = [(f"run mu {r['num_iterations']} lr {r['lr']:g}", dict(ms=r["total_s"] * 1e3,
                                                                  peak_mb=None),
             f"select {r['select_s']:.2f} s of {r['total_s']:.2f} s") for r in runs]
    return dict(runs=runs), rows, ratios


# ==== CLI [plumbing]: one error handler (gmts.run_cli), each command's table and JSON ==========
# Each measuring command: (args, Meter, device) -> (its results, its table's rows as (what,
# {ms, peak_mb}, a note), its ratios by name); bench() prints the rows and the ratios, and writes
# the results and the ratios.
COMMANDS = {"memory": memory_command, "stats": stats_command, "step": step_command,
            "rollout": rollout_command, "grading": grading_command,
            "trl-select": trl_select_command}


def parse_args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gmts.py", allow_abbrev=False,
                                description="What GMTS costs (see the module docstring). "
                                            "`bench_gmts.py plan [gmts.py's flags]`: the memory "
                                            "plan of that run.")
    p.error = gmts.bad_flag
    p.add_argument("command", choices=["plan", *COMMANDS])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if there is one")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (medians)")
    p.add_argument("--quick", action="store_true", help="seconds: tiny sizes everywhere")
    p.add_argument("--json", default="", help="the measurements (default: bench_COMMAND.json)")
    p.add_argument("--tokens", type=int, default=0,
                   help="stats: rows of logits (0: 4096 on the CPU, 32768 on CUDA)")
    p.add_argument("--vocab", type=int, default=151936, help="stats: the head's vocabulary")
    p.add_argument("--chunk", type=int, default=128, help="stats: rows per chunk for trl and ours")
    p.add_argument("--head-repeats", type=int, default=0,
                   help="stats: runs of the head variants (0: 2 on the CPU, where one 4096-row "
                        "pass takes ~30 s on a core; --repeats on CUDA)")
    p.add_argument("--rho", type=float, default=0.2, help="stats: the kept share")
    p.add_argument("--shape", default="", choices=["", "tiny", "small", "qwen0.5b"],
                   help="step, rollout: the model (default: qwen0.5b on CUDA, tiny on the CPU, "
                        "small with --quick)")
    p.add_argument("--trl-steps", type=int, default=-1,
                   help="step: TRL GRPOTrainer steps, median of 2..n (-1: 4, --quick 2; 0: none)")
    p.add_argument("--plan-hidden", type=int, default=256, help="memory: the tiny model's width")
    p.add_argument("--grade-data", default=gmts.PRESETS["paper-math"]["eval_data"],
                   help="grading: NAME=DATA,... files or hub sets (default: --preset "
                        "paper-math's five benchmarks, from the hub)")
    p.add_argument("--grade-samples", type=int, default=0,
                   help="grading: answers per row (0: 16, --quick 2)")
    p.add_argument("--trl-select-steps", type=int, default=0,
                   help="trl-select: optimizer steps per run (0: 12, --quick 2)")
    a = p.parse_args(argv)
    for flag in ("threads", "tokens", "head_repeats", "grade_samples", "trl_select_steps"):
        if getattr(a, flag) < 0:
            raise gmts.BadInput(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(a, flag)}")
    for flag in ("repeats", "vocab", "chunk", "plan_hidden"):
        if getattr(a, flag) < 1:
            raise gmts.BadInput(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if not 0 < a.rho <= 1:
        raise gmts.BadInput(f"--rho must be in (0, 1], got {a.rho}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise gmts.BadInput("--device cuda but torch sees no CUDA device")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = a.device == "cuda"
    a.json = a.json or f"bench_{a.command.replace('-', '_')}.json"
    a.tokens = a.tokens or (256 if a.quick else 32768 if cuda else 4096)
    a.head_repeats = a.head_repeats or (a.repeats if cuda or a.quick else 2)
    a.select_sizes = [2 ** 14, 2 ** 16] if a.quick else [2 ** 20, 2 ** 25]
    a.shape = a.shape or ("small" if a.quick else "qwen0.5b" if cuda else "tiny")
    a.trl_steps = (2 if a.quick else 4) if a.trl_steps < 0 else a.trl_steps
    a.grade_samples = a.grade_samples or (2 if a.quick else 16)
    a.trl_select_steps = a.trl_select_steps or (2 if a.quick else 12)
    if a.quick:
        a.vocab, a.repeats = min(a.vocab, 8192), min(a.repeats, 2)
    return a


def check_json(path: str):
    """BadInput before any work unless `path` can be written as a file (its folder exists)."""
    if path and (os.path.isdir(path) or not os.path.isdir(os.path.dirname(path) or ".")):
        raise gmts.BadInput(f"--json {path}: not a file in an existing folder")


def write_json(path: str, value):
    gmts.write_file(path, json.dumps(value, indent=1))


def meta(args, dev: torch.device) -> dict:
    """Where the numbers were measured: device, torch and its CPU kernels, threads, commit."""
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], text=True,
                                capture_output=True).stdout.strip() or None
    except OSError:  # no git
        commit = None
    return dict(command=args.command, quick=args.quick, repeats=args.repeats,
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                torch=torch.__version__, cpu_kernels=torch.backends.cpu.get_cpu_capability(),
                threads=torch.get_num_threads(), cpus=os.cpu_count(),
                commit=commit, trl=selective_log_softmax is not None)


def show(R: dict, rows: list):
    """A command's table (what, median ms, median peak MB, a note) and its ratios, printed."""
    m = R["meta"]
    print(f"bench_gmts.py {m['command']} | device {m['device']} | torch {m['torch']} "
          f"({m['cpu_kernels']} kernels, {m['threads']} thread(s) of {m['cpus']} CPUs) | "
          f"commit {m['commit']} | medians of {m['repeats']} | {m['seconds']:.0f} s", flush=True)

    def cell(x, width):
        return f"{x:{width}.1f}" if x is not None else f"{'-':>{width}}"
    print(f"{'':<38} {'ms':>10} {'peak MB':>9}  note")
    for name, r, note in rows:
        print(f"{name:<38} {cell(r.get('ms'), 10)} {cell(r.get('peak_mb'), 9)}  {note}")
    print("ratios")
    for name, value in R["ratios"].items():
        print(f"  {name:<62} {value:.3g}")


def bench(argv: list) -> dict:
    args = parse_args(argv)
    check_json(args.json)
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    t0 = time.time()
    res, rows, ratios = COMMANDS[args.command](args, Meter(dev), dev)
    R = dict(meta=meta(args, dev), ratios=ratios, results=res)
    R["meta"]["seconds"] = round(time.time() - t0, 1)
    show(R, rows)
    write_json(args.json, R)
    return R


def main(argv=None):
    """`plan [gmts.py's flags]`: the memory plan of that run; else a measuring command. Errors:
    one line (gmts.run_cli)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return gmts.run_cli("bench_gmts", lambda: plan(argv[1:]))
    return gmts.run_cli("bench_gmts", lambda: bench(argv))


if __name__ == "__main__":
    main()
