"""
bench_gmts.py: what GMTS costs, measured on gmts.py's own functions.

  a. token statistics (log p_y, entropy; ours also grad_norm) from the same hidden states (tokens, 896) and a
     random lm_head (151936 x 896, fp32), head matmul included for every variant:
       naive  full torch.log_softmax over (tokens, V) + gather + entropy
       trl    trl.trainer.utils.selective_log_softmax + entropy_from_logits (its default chunk is 128 rows), the
              head applied --chunk rows at a time and entropy_from_logits given the same chunk
       ours   gmts.head_stats at --chunk rows, and at its default 1024 (Config.stats_chunk)
  b. loss head forward + backward (d hidden and d lm_head): gmts.head_logp (chunk 1024) on all tokens vs on the
     rho share of rows gathered from the hidden states first, as policy_update does.
  c. gmts.select_tokens on 1M and 32M random scores with a mask, beside torch.quantile (TRL's threshold; it
     refuses inputs above 2^24 elements: "fails").
  d. one training step of the tiny model (gmts.build_tiny, PRESETS["cpu"] sizes): rollout (gmts.rollout on
     countdown prompts) + the update of train() steps 5-7 (batch_token_stats, token_scores, select_tokens,
     policy_update and the two selections train() logs) for --select all, random and gmts on one fixed
     batch. A random model earns no reward, so rewards are random 0/1 with one right and one wrong answer per
     group (no answer has A = 0). Its entropy is nearly flat, so gmts keeps whole answers of the largest |A| and
     the update runs few answers; random spreads the kept tokens over every answer: gmts' worst case.
  e. the same step for a random-init model with the Qwen2.5-0.5B config (--device cuda), rollouts forced to a
     fixed length (min_new_tokens); --small runs it with a tiny config so the path is exercised on CPU.
Method. Variants run interleaved (A B, then B A, ...) in one process; the table shows medians and ratios of
medians. Peak memory is the growth over the state before the call: CUDA: torch.cuda.max_memory_allocated after
reset_peak_memory_stats, minus memory_allocated before. CPU: torch's CPU allocations are invisible to
tracemalloc, so the process's resident set is used: gc, write "5" to /proc/self/clear_refs (resets VmHWM to
VmRSS), read VmRSS, run, read VmHWM from /proc/self/status; peak_mb = VmHWM - VmRSS_before. glibc is told
(mallopt M_MMAP_THRESHOLD = 1 MiB) to mmap every block >= 1 MiB, so freed tensors leave RSS and the next
measurement starts clean (repeats agree to ~1 MB). On CPU torch runs --threads 1 by default: on a shared,
oversubscribed 2-core machine two OpenMP threads wait on each other and small reductions slow down 100x.
--tokens defaults to 4096 on CPU with 2 interleaved runs per variant in the head sections (a, b): one 4096-row
head pass takes ~30 s on one core, so three runs would not fit in 10 minutes (--head-repeats 3 for more).

Run:  python bench_gmts.py --json bench.json        (CPU, ~8 minutes)
      python bench_gmts.py --device cuda --json gpu.json
      python bench_gmts.py --quick --json tmp.json  (seconds; tiny sizes, section e with --small)
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse
import ctypes
import functools
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import gmts

try:
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax
except ImportError:  # trl is optional: the trl rows and targets are skipped
    selective_log_softmax = entropy_from_logits = None

QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
              rope_theta=1000000.0)
SMALL = dict(QWEN05, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
HIDDEN = 896


class Meter:
    """meter(fn) -> (ms, peak_mb, fn's result); peak_mb is None where it cannot be measured (see docstring)."""

    def __init__(self, device: torch.device):
        self.device, self.process_peak_mb = device, 0.0  # the highest total (process RSS / CUDA allocated) seen
        self.cpu_rss = device.type == "cpu" and os.path.exists("/proc/self/clear_refs")
        if self.cpu_rss:
            try:
                ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks >= 1 MiB are mmap'd
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
    """Run every variant `repeats` times, reversing the order every other round; medians of ms and peak_mb."""
    runs, last = {k: [] for k in variants}, {}
    for r in range(repeats):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            ms, peak, last[k] = meter(variants[k])
            runs[k].append((ms, peak))
    med = lambda xs: statistics.median(xs) if None not in xs else None  # noqa: E731
    return {k: dict(ms=med([x[0] for x in v]), peak_mb=med([x[1] for x in v]), ms_runs=[round(x[0], 1) for x in v],
                    peak_mb_runs=[x[1] and round(x[1], 1) for x in v], out=last[k]) for k, v in runs.items()}


def head_inputs(M: int, V: int, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, HIDDEN, generator=g) * HIDDEN ** -0.5)  # logits ~ N(0, 1) per row
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

    fns = {"naive": naive, "trl": trl if selective_log_softmax else None,
           f"ours@{C}": lambda h, y: gmts.head_stats(h, head, y, 1.0, C),
           "ours@1024": (lambda h, y: gmts.head_stats(h, head, y, 1.0, 1024)) if args.extra else None}
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
    idx = torch.randperm(M, generator=g)[:math.ceil(args.rho * M)].sort().values.to(dev)  # the kept rows

    def run(rows, chunk):
        hh = h.detach().requires_grad_()  # stands for the transformer's output
        hs = hh if rows is None else hh[rows]  # gather the selected rows BEFORE the head, as policy_update does
        logp = gmts.head_logp(hs, head, y if rows is None else y[rows], 1.0, chunk)
        a = adv if rows is None else adv[rows]
        (-(logp * a).sum() / M).backward()
        head.weight.grad = None  # every run allocates its own d lm_head

    # all: the head over every token in one piece, as an implementation without selection holds it (logits for
    # all N*T positions); selected: the same head over the kept 20% only; all@1024: gmts.py's chunked head over all
    # tokens (chunking alone bounds the memory too, so it is shown beside them, not used in the target).
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
        mask = torch.arange(T, device=dev)[None, :] < lengths  # valid prefixes, ~62% of the positions

        def quantile():  # TRL's get_high_entropy_mask: the (1 - rho) quantile of the valid scores as threshold
            return (scores >= torch.quantile(scores[mask], 1 - args.rho)) & mask

        variants = {"select_tokens": lambda: gmts.select_tokens(scores, mask, args.rho), "quantile": quantile}
        try:
            quantile()
        except RuntimeError as e:
            del variants["quantile"]
            out[f"{n}/quantile"] = dict(ms=None, peak_mb=None, error=str(e).splitlines()[0][:120])
        for k, r in interleave(meter, variants, args.repeats).items():
            del r["out"]
            out[f"{n}/{k}"] = r
    return out


def qwen_batch(model, B: int, G: int, P: int, T: int, seed: int) -> dict:
    """A fixed-length rollout from random prompt ids, as gmts.rollout builds its batch (HF generate, bf16)."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (B, P), generator=g).repeat_interleave(G, 0).to(device)  # (N, P)
    attn = torch.ones_like(ids)
    model.eval()
    with torch.no_grad(), gmts.autocast(device):
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=T, min_new_tokens=T, do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    model.train()
    comp = out[:, P:]  # (N, T)
    return dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=torch.ones_like(comp).bool(),
                truncated=torch.ones(comp.shape[0], dtype=torch.bool, device=device))


def step_bench(model, make_batch, cfg, meter, repeats) -> dict:
    """Rollout + update (train() steps 5-7) for --select all, random and gmts on one fixed batch, interleaved."""
    dev, methods = meter.device, ("all", "random", "gmts")
    batch = make_batch(0)
    N, T = batch["comp_ids"].shape
    rewards = torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(4)).float()
    rewards[0::cfg.group_size], rewards[1::cfg.group_size] = 1.0, 0.0  # every group mixed: no answer has A = 0
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
        t0 = clock()  # the extra no-grad forward of the statistics (deviation 8 in gmts.py): its share of a step
        logp, ent, gn = gmts.batch_token_stats(model, batch, cfg.temperature, cfg.micro_batch, cfg.stats_chunk)
        stats_ms[method].append((clock() - t0) * 1e3)
        om = gmts.omega(adv, torch.exp(logp - logp), cfg.clip_low, cfg.clip_high)  # inner update 0: old = logp
        scores = gmts.token_scores(method, ent, gn, om)
        t = clock()
        sel = gmts.select_tokens(scores, mask, 1.0 if method == "all" else cfg.rho, nonzero=method in ("gmts", "gradnorm"))  # select_tokens + the keep rules, as train()
        dt = clock() - t
        gmts.policy_update(model, opt, batch, adv, sel, logp, float(mask.sum()), temperature=cfg.temperature,
                           clip_low=cfg.clip_low, clip_high=cfg.clip_high, micro_batch=cfg.micro_batch,
                           chunk=cfg.stats_chunk, max_grad_norm=cfg.max_grad_norm)
        t = clock()  # train() step 7 logs two more selections every step (entropy top-rho, gmts top-rho)
        gmts.select_tokens(ent, mask, cfg.rho)
        gmts.select_tokens(gmts.token_scores("gmts", ent, gn, om), mask, cfg.rho, nonzero=True)
        sel_ms[method].append((dt + clock() - t) * 1e3)
        return dict(kept_frac=int(sel.sum()) / int(mask.sum()), active_frac=float(sel.any(1).float().mean()))

    for m in methods:  # warm-up: Adam state, kernels
        update(m)
        sel_ms[m].clear()
        stats_ms[m].clear()
    seeds = iter(range(1, 10 ** 6))
    res = interleave(meter, {"rollout": lambda: make_batch(next(seeds)),
                             **{m: functools.partial(update, m) for m in methods}}, repeats)
    roll = res.pop("rollout")
    del roll["out"]
    out = dict(rollout=dict(roll, tokens_per_s=N * T / (roll["ms"] / 1e3)), N=N, T=T, valid_tokens=int(mask.sum()))
    for m in methods:  # a step = the median rollout + this update; select_ms = the 3 select_tokens calls
        r = res[m]
        r.update(r.pop("out"), step_ms=roll["ms"] + r["ms"], select_ms=statistics.median(sel_ms[m]))
        r["select_share"] = r["select_ms"] / r["step_ms"]
        r["stats_ms"] = statistics.median(stats_ms[m])
        r["stats_share"] = r["stats_ms"] / r["step_ms"]
        out[m] = r
    out["step_ratio_gmts_all"] = out["gmts"]["step_ms"] / out["all"]["step_ms"]
    out["process_peak_mb"] = meter.process_peak_mb  # CUDA: max allocated incl. weights and Adam; CPU: max RSS
    out["step_ratio_random_all"] = out["random"]["step_ms"] / out["all"]["step_ms"]
    return out


def sec_tiny_step(args, meter, dev) -> dict:
    cfg = gmts.Config(**gmts.PRESETS["smoke" if args.quick else "cpu"])
    model, tok = gmts.build_tiny(cfg.tiny_hidden, cfg.tiny_layers, seed=0)
    model.to(dev).train()
    task = gmts.get_task("countdown")
    prompts = gmts.build_prompts(tok, task, task["load"](cfg.data, cfg.prompts_per_step, 0), gmts.use_chat(tok),
                                 cfg.short_prompt)

    def make_batch(seed):
        gmts.set_seed(seed)
        return gmts.rollout(model, tok, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature)

    out = step_bench(model, make_batch, cfg, meter, args.repeats)
    out["model"] = f"tiny hidden {cfg.tiny_hidden}, {cfg.tiny_layers} layers"
    return out


def sec_model_step(args, meter, dev) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = args.small or dev.type != "cuda"
    cfg = gmts.Config(**(dict(prompts_per_step=2, group_size=2, max_new_tokens=8) if small else {}))
    torch.manual_seed(0)
    with torch.device(dev):  # random init directly on the device; fp32 master weights as gmts.load_model
        model = Qwen2ForCausalLM(Qwen2Config(**(SMALL if small else QWEN05), eos_token_id=151645,
                                             pad_token_id=151643, bos_token_id=None))
    P = 8 if small else 64
    out = step_bench(model, lambda s: qwen_batch(model, cfg.prompts_per_step, cfg.group_size, P,
                                                 cfg.max_new_tokens, s), cfg, meter, args.repeats)
    out["model"] = ("small Qwen2 (smoke)" if small else "Qwen2.5-0.5B config, random init") + \
        f", {cfg.prompts_per_step}x{cfg.group_size} prompts x {cfg.max_new_tokens} new tokens, prompt {P}"
    return out


def targets(R: dict, C: int) -> list:
    """PASS/FAIL of each target, computed from the measurements."""
    t = []

    def add(name, value, limit):
        t.append(dict(target=name, value=value, limit=limit, passed=value is not None and value <= limit))

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
    for key in ("step_tiny", "step_model"):
        if key in R:
            add(f"{key}: select_tokens share of a gmts step", R[key]["gmts"]["select_share"], 0.01)
            add(f"{key}: step time gmts / all", R[key]["step_ratio_gmts_all"], 1.05)
    return t


def table(R: dict) -> str:
    fmt = lambda x, f: format(max(x, 0.0), f) if x is not None else format("-", ">" + f.split(".")[0])  # noqa
    lines = [f"{'section':<12} {'variant':<26} {'ms':>10} {'peak_mb':>9}  note", "-" * 78]
    for sec, rows in (("a stats", R.get("stats", {})), ("b loss head", R.get("loss_head", {})),
                      ("c select", R.get("select", {}))):
        for k, r in rows.items():
            note = ("fails: " + r["error"]) if "error" in r else \
                (f"max|d logp| {r['max_abs_diff_logp']:.1e}, max|d H| {r['max_abs_diff_entropy']:.1e} vs naive"
                 if "max_abs_diff_logp" in r else "")
            lines.append(f"{sec:<12} {k:<26} {fmt(r['ms'], '10.1f')} {fmt(r['peak_mb'], '9.0f')}  {note}")
    for key, sec in (("step_tiny", "d step"), ("step_model", "e step")):
        if key in R:
            S = R[key]
            lines.append(f"{sec:<12} {'rollout':<26} {S['rollout']['ms']:10.1f} {fmt(S['rollout']['peak_mb'], '9.0f')}"
                         f"  {S['rollout']['tokens_per_s']:.0f} tok/s; {S['model']}; total peak "
                         f"{S['process_peak_mb']:.0f} MB")
            for m in ("all", "random", "gmts"):
                r = S[m]
                lines.append(f"{sec:<12} {'update --select ' + m:<26} {r['ms']:10.1f} {fmt(r['peak_mb'], '9.0f')}"
                             f"  step {r['step_ms']:.0f} ms, stats pass {r['stats_share']:.0%}, select "
                             f"{r['select_ms']:.1f} ms, kept {r['kept_frac']:.2f} in {r['active_frac']:.0%} of answers")
    lines += ["-" * 78, "targets"]
    for t in R["targets"]:
        lines.append(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['target']:<48} {t['value']:.3g}  (<= {t['limit']})")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="GMTS performance benchmark (see the module docstring)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=0, help="rows in sections a and b (0: 4096 on CPU, 32768 on CUDA)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=128, help="rows per chunk for trl and ours in section a")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (medians)")
    p.add_argument("--head-repeats", type=int, default=0,
                   help="runs per variant in the head sections a and b (0: 2 on CPU, where one 4096-row head pass "
                        "takes ~30 s on a core; --repeats on CUDA)")
    p.add_argument("--extra", action="store_true", help="also ours@1024 in a and all@1024 (chunked) in b")
    p.add_argument("--rho", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--sections", default="abcde", help="which sections to run (e runs on CUDA or with --small)")
    p.add_argument("--small", action="store_true", help="section e with a tiny Qwen2 config (CPU smoke of the path)")
    p.add_argument("--quick", action="store_true", help="seconds: tiny sizes everywhere, implies --small")
    p.add_argument("--json", default="", help="write all measurements here")
    a = p.parse_args(argv)
    a.tokens = a.tokens or (256 if a.quick else 32768 if a.device == "cuda" else 4096)
    a.head_repeats = a.head_repeats or (a.repeats if a.device == "cuda" or a.quick else 2)
    a.select_sizes = [2 ** 14, 2 ** 16] if a.quick else [2 ** 20, 2 ** 25]
    if a.quick:
        a.vocab, a.repeats, a.small, a.extra = min(a.vocab, 8192), min(a.repeats, 2), True, True
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gmts: --device cuda but torch sees no CUDA device")
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    meter = Meter(dev)
    t0 = time.time()
    R = dict(meta=dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
                       tokens=args.tokens, vocab=args.vocab, hidden=HIDDEN, chunk=args.chunk, rho=args.rho,
                       repeats=args.repeats, quick=args.quick, trl=selective_log_softmax is not None,
                       loadavg_start=os.getloadavg(), peak_method="cuda max_memory_allocated" if dev.type == "cuda"
                       else "VmHWM - VmRSS" if meter.cpu_rss else "none"))
    steps = [("a", "stats", sec_stats), ("b", "loss_head", sec_loss_head), ("c", "select", sec_select),
             ("d", "step_tiny", sec_tiny_step)]
    if dev.type == "cuda" or args.small:
        steps.append(("e", "step_model", sec_model_step))
    for letter, key, fn in steps:
        if letter in args.sections:
            t = time.time()
            R[key] = fn(args, meter, dev)
            print(f"[{letter}] {key}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    R["targets"] = targets(R, args.chunk)
    R["meta"].update(loadavg_end=os.getloadavg(), seconds=round(time.time() - t0, 1))
    m = R["meta"]
    print(f"device {m['device']} | torch {m['torch']} | {m['threads']} thread(s) of {m['cpus']} CPUs | tokens "
          f"{m['tokens']} x vocab {m['vocab']} x hidden {HIDDEN} | chunk {m['chunk']} | rho {m['rho']} | medians of "
          f"{m['repeats']} (a, b: {args.head_repeats}) | load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f} | {m['seconds']:.0f} s",
          flush=True)
    print(table(R), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1)
    return R


if __name__ == "__main__":
    main()
