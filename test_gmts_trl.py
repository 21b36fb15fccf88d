"""Tests for gmts_trl.py (GMTS inside TRL's GRPOTrainer). Offline, CPU:
    python -m pytest -q test_gmts_trl.py

The kept mask of real tiny TRL runs (groups cut by TRL's shuffle into micro-batches, and across two
gloo processes) is checked against gmts.select_tokens over the generation batch with group_size=G,
the scores against gmts.token_stats and gmts.omega computed apart; omega against the autograd
gradient of TRL's own _compute_loss for every loss type; and through TRL's real loss that every
unselected token gets exactly zero gradient (with a control that fails when nothing is masked).
The CLI: every bad input and fault ends in one stderr line with gmts.run_cli's exit code, naming
TRL's newest checkpoint where one is kept; --out's own rule (only a gmts_trl run is replaced, with
--overwrite and only its files; one writing process, also under torchrun).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import importlib.util
import json
import math
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import gmts
import gmts_trl
from gmts_trl import GMTSConfig, GMTSTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: several threads spin-wait on each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def length_reward(prompts, completions, **kwargs):
    """A toy second reward so that the tiny random model gets non-zero advantages (countdown
    alone gives 0)."""
    return [sum(map(ord, c)) % 7 / 6 for c in completions]


def make_trainer(tmp, select="gmts", rho=0.25, reward=None, **kw):
    model, tok = gmts.build_tiny(hidden=32, layers=2)
    rows = gmts.load_rows("countdown", "easy", n=8, seed=0)
    data = gmts_trl.make_dataset(tok, "countdown", rows, chat=True, short=True)
    kw = {"per_device_train_batch_size": 4, "num_generations": 4, "max_steps": 2, **kw}
    cfg = GMTSConfig(output_dir=str(tmp), use_cpu=True, report_to=[], bf16=False,
                     max_completion_length=16, logging_steps=1, save_strategy="no",
                     gradient_checkpointing=False, learning_rate=1e-2, token_selection=select,
                     token_rho=rho, disable_tqdm=True, **kw)
    rewards = [gmts_trl.make_reward("countdown")] + ([reward] if reward else [])
    return GMTSTrainer(model=model, reward_funcs=rewards, args=cfg, train_dataset=data,
                       processing_class=tok)


def in_generation_order(calls: list) -> list:
    """Each selection's recorded micro-batches (one list per process) -> (rows, scores, mask, keep)
    of the whole generation batch, rows in generation order, T padded to the longest."""
    out = []
    for parts in calls:
        T = max(p["mask"].shape[1] for p in parts)
        pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))  # noqa: E731
        rows = torch.cat([p["rows"] for p in parts])
        order = torch.argsort(rows)
        assert torch.equal(rows[order], torch.arange(len(rows)))
        cat = lambda k: torch.cat([pad(p[k]) for p in parts])[order]  # noqa: E731
        out.append((rows[order], cat("scores"), cat("mask"), cat("keep")))
    return out


def record(tr, check=None):
    """Wrap tr.select: every selection's micro-batches as written (rows, scores, mask, keep), and
    `check(b)` of each micro-batch before it (at the policy it is scored at)."""
    calls, select = [], tr.select

    def wrapped(batches, group_size):
        before = [check(b) for b in batches] if check else []
        select(batches, group_size)
        cat = lambda k: torch.cat([b[k] for b in batches]).detach().cpu()  # noqa: E731
        calls.append(dict(rows=cat("gmts_row"), scores=cat("gmts_score"), keep=cat("gmts_keep"),
                          mask=torch.cat([tr.loss_mask(b) for b in batches]).cpu(),
                          micro=[b["gmts_row"].tolist() for b in batches], before=before,
                          group_size=group_size, step=tr._step))

    tr.select = wrapped
    return calls


def selection_rule(select, scope, G):
    """The group_size gmts.selection_rule gives a run of this select and scope."""
    return gmts.selection_rule(gmts.Config(select=select, scope=scope, group_size=G))[1]


# ---- end to end ---------------------------------------------------------------------------------


@pytest.mark.parametrize("select", ["gmts", "gradnorm"])
def test_two_trl_steps_end_to_end(tmp_path, select):
    tr = make_trainer(tmp_path, select, reward=length_reward)
    calls = []
    hook = tr.get_high_entropy_mask
    tr.get_high_entropy_mask = lambda *a: calls.append(dict(tr._live["inputs"])) or hook(*a)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr.state.global_step == 2 and len(calls) == 2  # one mask per micro-batch
    for inputs in calls:  # the row indices came through TRL's shuffle with their rows
        groups, prompts = (inputs["gmts_row"] // 4).tolist(), inputs["prompt_ids"].tolist()
        assert len({(g, tuple(p)) for g, p in zip(groups, prompts)}) == len(set(groups))
    logs = [h for h in tr.state.log_history if "gmts/kept_frac" in h]
    assert len(logs) == 2 and all(0 < h["gmts/kept_frac"] <= 0.3 for h in logs)
    assert all("rewards/countdown_reward/mean" in h for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def independent_scores(tr, b, select):
    """A micro-batch's scores without gmts_trl: the model's logits, gmts.token_stats, gmts.omega
    (dapo: no per-token normaliser), gmts.token_scores. -> (scores, ratio != 1 somewhere, clip
    active somewhere)."""
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    T = b["completion_ids"].shape[1]
    with torch.no_grad():
        logits = tr.model(input_ids=ids, attention_mask=torch.cat(
            [b["prompt_mask"], b["completion_mask"]], 1)).logits[:, -T - 1:-1]
    logp, ent, gn = gmts.token_stats(logits, b["completion_ids"], tr.temperature)
    old = b.get("old_per_token_logps")
    ratio = torch.ones_like(logp) if old is None else torch.exp(logp - old)
    adv, mask = b["advantages"], b["completion_mask"].bool()
    om = gmts.omega(adv, ratio, tr.epsilon_low, tr.epsilon_high)
    dead = gmts.clip_active(adv[:, None], ratio, tr.epsilon_low, tr.epsilon_high)[mask].any()
    moved = ((ratio - 1).abs()[mask] > 1e-3).any()
    return gmts.token_scores(select, ent, gn, om), bool(moved), bool(dead)


@pytest.mark.parametrize("select, scope", [("gmts", "auto"), ("gmts", "batch"),
                                           ("gradnorm", "group"), ("entropy", "auto")])
def test_real_run_keeps_select_tokens_over_whole_groups(tmp_path, select, scope):
    """A tiny TRL run whose groups TRL's shuffle cuts into micro-batches of 2 (G = 4, grad-accum
    2, steps_per_generation 4, num_iterations 2): at every pass the kept mask of the generation
    batch equals gmts.select_tokens on its scores in generation order with group_size=G (0 for
    the batch scope), and the scores equal gmts's, computed apart from the same model, with the
    policy moved (ratio != 1, some clipped) on the second pass."""
    G = 4
    tr = make_trainer(tmp_path, select, rho=0.3, reward=length_reward, token_scope=scope,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      steps_per_generation=4, num_iterations=2, max_steps=4, epsilon_high=0.28)
    calls = record(tr, lambda b: independent_scores(tr, b, select))
    tr.train()
    assert [c["step"] for c in calls] == [0, 4]  # once per pass over the generation batch
    group_size = selection_rule(select, scope, G)
    assert group_size == (G if select == "gmts" and scope == "auto" or scope == "group" else 0)
    for call, (rows, scores, mask, keep) in zip(calls, in_generation_order([[c] for c in calls])):
        split = [len({i for i, mb in enumerate(call["micro"]) for r in mb if r // G == g})
                 for g in range(len(rows) // G)]
        assert max(split) > 1  # a group's answers sit in several micro-batches
        want = gmts.select_tokens(scores, mask, 0.3, nonzero=select in ("gmts", "gradnorm"),
                                  group_size=group_size)
        assert torch.equal(keep, want) and keep.any()
        ref = torch.cat([s for s, _, _ in call["before"]])
        m = call["mask"]
        assert torch.allclose(call["scores"][m], ref[m], rtol=1e-4, atol=1e-5)
    assert not any(moved for _, moved, _ in calls[0]["before"])  # pass 1: the sampling policy
    assert any(moved for _, moved, _ in calls[1]["before"])  # pass 2: scored at the moved policy
    assert any(dead for _, _, dead in calls[1]["before"])


def test_reward_function_uses_our_verifier():
    row = {"nums": [3, 5, 2], "target": 16, "expr": "(3 + 5) * 2"}
    rew = gmts_trl.make_reward("countdown")
    out = rew(prompts=["p"] * 3, row=[json.dumps(row)] * 3, completion_ids=None,
              completions=["x</think><answer>(3 + 5) * 2</answer>", "<answer>3+5+2</answer>", "no"],
              trainer_state=None)
    assert out == [1.0, 0.1, 0.0]


# ---- the selection is gmts.py's, over the generation batch ---------------------------------------


def stats(B=8, T=7, V=11, seed=0):
    """Hand-made token statistics of 2 groups of 4: entropy, log p_y and log sum p^2 from random
    logits, a ragged mask, advantages with a zero one and ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    y = torch.randint(V, (B, T), generator=g)
    logp, ent, gn = gmts.token_stats(logits, y)
    log_sum_sq = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 6, 2, 7, 4, 6])[:, None]
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0, 0.7, 0.7, -0.7, -0.7])
    return ent, logp, log_sum_sq, gn, mask, adv


def shuffled_micro_batches(tr, monkeypatch, perm, sizes, off_policy=False, seed=0):
    """stats() as TRL leaves a generation batch: rows permuted by `perm`, split into micro-batches
    of `sizes`; token_statistics answers from the stats. -> (batches, stats, old log-probs)."""
    ent, logp, log_sum_sq, gn, mask, adv = stats(seed=seed)
    old = None
    if off_policy:  # old log-probs from TRL: ratio != 1 and some tokens clipped (omega = 0)
        old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    batches, start = [], 0
    for n in sizes:
        i = perm[start:start + n]
        b = dict(advantages=adv[i], completion_mask=mask[i].int(), gmts_row=i,
                 _stats=(logp[i], ent[i], log_sum_sq[i]))
        if off_policy:
            b["old_per_token_logps"] = old[i]
        batches.append(b)
        start += n
    monkeypatch.setattr(tr, "token_statistics", lambda b: b["_stats"])
    return batches, (ent, logp, log_sum_sq, gn, mask, adv), old


@pytest.mark.parametrize("select", gmts_trl.SELECT)  # top-rho methods: rsi is gmts.py's only
@pytest.mark.parametrize("off_policy, rho", [(False, 0.3), (True, 0.3), (False, 0.9)])
def test_select_equals_select_tokens_in_generation_order(tmp_path, monkeypatch, select,
                                                         off_policy, rho):
    """Micro-batches of 3, 3 and 2 shuffled rows: the kept mask is gmts.select_tokens over the
    whole generation batch in generation order (group_size=G for gmts), not per micro-batch.
    rho = 0.9 is more than the tokens with a non-zero score: gmts and gradnorm must still keep
    none of those."""
    tr = make_trainer(tmp_path, select, rho=rho)
    perm = torch.tensor([5, 0, 7, 2, 4, 1, 6, 3])
    batches, (ent, logp, _, gn, mask, adv), old = shuffled_micro_batches(
        tr, monkeypatch, perm, [3, 3, 2], off_policy)
    tr._noise.manual_seed(5)
    tr.select(batches, 4)
    got = torch.zeros_like(mask)
    got[perm] = torch.cat([b["gmts_keep"] for b in batches])
    ratio = torch.ones_like(ent) if old is None else torch.exp(logp - old)
    om = gmts.omega(adv, ratio, tr.epsilon_low, tr.epsilon_high)
    scores = torch.zeros_like(ent)
    scores[perm] = torch.cat([b["gmts_score"] for b in batches])
    if select != "random":  # random draws in micro-batch order: its scores are checked as drawn
        assert torch.allclose(scores, gmts.token_scores(select, ent, gn, om), atol=1e-5)
    want = gmts.select_tokens(scores, mask, 1.0 if select == "all" else rho,
                              nonzero=select in ("gmts", "gradnorm"),
                              group_size=4 if select == "gmts" else 0)
    assert got.dtype == torch.bool and torch.equal(got, want)
    if select in ("entropy", "random"):
        assert int(got.sum()) == math.ceil(rho * int(mask.sum()))
    if select == "gmts" and rho < 0.5:  # the group scope is not the pool's
        assert not torch.equal(got, gmts.select_tokens(scores, mask, rho, nonzero=True))


# ---- omega is minus the gradient of TRL's own loss -----------------------------------------------


@pytest.fixture(scope="module")
def loss_trainer(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("loss"), "gmts", rho=0.4)


OPTIONS = ["ratio 1", "away", "away beta", "away vllm", "away delta"]
CASES = [(lt, o) for lt in gmts_trl.LOSS_TYPES for o in OPTIONS
         if o != "away delta" or lt in gmts_trl.CLIPPED_LOSSES]


@pytest.mark.parametrize("loss_type, option", CASES)
def test_omega_is_minus_the_gradient_of_trls_loss(loss_trainer, monkeypatch, loss_type, option):
    """TRL's own _compute_loss on a micro-batch whose log-probs are a leaf: its gradient w.r.t.
    each token's log-prob is -c * omega on the kept tokens and -c * (the KL part of omega) on the
    dropped ones, one constant c for the whole micro-batch (TRL's normaliser up to what the
    ranking cannot see). Rows of different lengths make grpo's and sapo's 1 / |o_i| visible; old
    log-probs away from the current ones put some tokens under the clip (cispo: above
    epsilon_high; delta: above it); vllm: TRL's importance ratio per token."""
    import trl
    tr = loss_trainer
    for name, value in [("loss_type", loss_type), ("beta", 0.2 if "beta" in option else 0.0),
                        ("use_vllm", "vllm" in option), ("vllm_importance_sampling_correction",
                                                         "vllm" in option),
                        ("epsilon_high", 1.0 if loss_type == "cispo" else 0.28),
                        ("current_gradient_accumulation_steps", 1)]:
        monkeypatch.setattr(tr, name, value, raising=False)
    monkeypatch.setattr(tr.args, "delta", 1.25 if "delta" in option else None)
    ent, logp, log_sum_sq, gn, mask, adv = stats(seed=2)
    B, T = mask.shape
    g = torch.Generator().manual_seed(4)
    scale = 0.1 if loss_type == "vespo" else 0.4  # vespo's phi of a far sequence ratio is ~0
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
              "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": adv,
              "num_items_in_batch": mask.sum(),
              "gmts_keep": torch.rand(B, T, generator=g) < 0.5}
    if option != "ratio 1":
        inputs["old_per_token_logps"] = logp + scale * torch.randn(logp.shape, generator=g)
    if "beta" in option:
        inputs["ref_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    if "vllm" in option:
        inputs["importance_sampling_ratio"] = torch.exp(0.2 * torch.randn(logp.shape, generator=g))
    x = logp.clone().requires_grad_()
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (x, ent, None))
    grad, = torch.autograd.grad(tr._compute_loss(tr.model, inputs), x)
    keep = inputs["gmts_keep"] & mask
    om = tr.omega(inputs, logp, mask)
    kl = om - tr.omega(dict(inputs, ref_per_token_logps=logp), logp, mask)  # the KL part alone
    want = torch.where(keep, om, kl)
    i = int((want.abs() * mask).flatten().argmax())
    c = float(-grad.flatten()[i] / want.flatten()[i])
    assert c > 0 and torch.allclose(-grad[mask], c * want[mask], rtol=1e-4, atol=1e-7)
    assert (kl[mask & ~keep] != 0).any() == ("beta" in option)
    ratio = torch.exp(logp - inputs.get("old_per_token_logps", logp))
    live = mask & (adv != 0)[:, None]
    if option == "ratio 1":
        assert torch.equal(ratio, torch.ones_like(ratio))
    elif loss_type in gmts_trl.CLIPPED_LOSSES:
        assert gmts.clip_active(adv[:, None], ratio, tr.epsilon_low, tr.epsilon_high)[live].any()
        if "delta" in option:  # tokens the delta clip alone zeroes (A < 0 above 1 + eps_high)
            assert (live & (ratio > 1 + tr.epsilon_high) & (adv < 0)[:, None]).any()
    elif loss_type == "cispo":
        assert (ratio > tr.epsilon_high)[live].any() and (ratio < tr.epsilon_high)[live].any()


RATIOS = [0.5, 0.85, 1.0, 1.05, 1.15, 1.2, 1.27, 1.3, 1.5, 1.9, 2.1, 3.0]  # none on a boundary


@pytest.mark.parametrize("loss_type", gmts_trl.CLIPPED_LOSSES)
@pytest.mark.parametrize("delta", [1.1, 1.25, 2.0, None])
def test_omega_under_delta_is_minus_the_gradient_of_trls_loss(loss_trainer, monkeypatch,
                                                                loss_type, delta):
    """TRL's two-sided clip -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A) on
    ratios laid out on purpose across every region: for A < 0 and delta < r <= 1 + epsilon_high
    the min takes the clip(r) A = r A branch, whose gradient is alive (omega r A, not 0); only
    r > max(delta, 1 + epsilon_high) is flat for A < 0, and r > delta for A > 0. omega against
    autograd of TRL's own _compute_loss, every token kept."""
    import trl
    tr = loss_trainer
    for name, value in [("loss_type", loss_type), ("beta", 0.0), ("use_vllm", False),
                        ("vllm_importance_sampling_correction", False), ("epsilon_high", 0.28),
                        ("current_gradient_accumulation_steps", 1)]:
        monkeypatch.setattr(tr, name, value, raising=False)
    monkeypatch.setattr(tr.args, "delta", delta)
    ent, logp, log_sum_sq, gn, mask, adv = stats(seed=2)
    B, T = mask.shape
    want_ratio = torch.tensor([[RATIOS[(t + 7 * b) % len(RATIOS)] for t in range(T)]
                               for b in range(B)])
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
              "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": adv,
              "num_items_in_batch": mask.sum(), "gmts_keep": mask.clone(),
              "old_per_token_logps": logp - want_ratio.log()}
    x = logp.clone().requires_grad_()
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (x, ent, None))
    grad, = torch.autograd.grad(tr._compute_loss(tr.model, inputs), x)
    om = tr.omega(inputs, logp, mask)
    i = int((om.abs() * mask).flatten().argmax())
    c = float(-grad.flatten()[i] / om.flatten()[i])
    assert c > 0 and torch.allclose(-grad[mask], c * om[mask], rtol=1e-4, atol=1e-7)
    assert torch.equal(grad[mask] == 0, om[mask] == 0)  # flat exactly where omega is 0
    ratio = torch.exp(logp - inputs["old_per_token_logps"])
    assert torch.allclose(ratio, want_ratio, rtol=1e-5)
    high = 1 + tr.epsilon_high
    neg, pos = mask & (adv < 0)[:, None], mask & (adv > 0)[:, None]
    top = high if delta is None else max(delta, high)
    assert (om[neg & (ratio > high) & (ratio <= top)] != 0).all()
    if delta is not None and delta < high:  # the tokens a zero above delta got wrong
        band = neg & (ratio > delta) & (ratio <= high)
        assert band.sum() >= 2 and (om[band] != 0).all()
    if delta is not None and delta > high:  # alive for A < 0 above 1 + epsilon_high, to delta
        assert (neg & (ratio > high) & (ratio <= delta)).sum() >= 2
    if delta is not None:
        assert (om[neg & (ratio > top)] == 0).all() and (neg & (ratio > top)).any()
        assert (om[pos & (ratio > delta)] == 0).all() and (pos & (ratio > delta)).any()
    assert (om[pos & (ratio > high)] == 0).all() and (om[neg & (ratio < 1 - 0.2)] == 0).all()


def test_refused_options_one_line(tmp_path):
    """Where no per-token omega is the gradient, GMTSConfig refuses before training, naming it."""
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'"):
        GMTSConfig(importance_sampling_level="sequence", token_selection="entropy", **kw)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        GMTSConfig(off_policy_mask_threshold=0.5, **kw)
    with pytest.raises(ValueError, match="entropy bonus"):
        GMTSConfig(entropy_coef=0.01, token_selection="gradnorm", **kw)
    GMTSConfig(importance_sampling_level="sequence", token_selection="all", **kw)  # no selection
    GMTSConfig(off_policy_mask_threshold=0.5, token_selection="entropy", **kw)  # no omega


def test_grad_norm_from_head_outputs_matches_gmts():
    ent, logp, log_sum_sq, gn, mask, adv = stats()
    assert torch.allclose(gmts_trl.dz_norm_from(logp, log_sum_sq), gn, atol=1e-5)
    assert torch.allclose(gmts_trl.dz_norm_from(logp, log_sum_sq, 0.7), gn / 0.7, atol=1e-5)


# ---- across processes ---------------------------------------------------------------------------


class FakeAccelerator:
    """accelerate's gather / pad_across_processes for `world` threads: a real all-gather through a
    barrier."""

    def __init__(self, rank, world, box, barrier):
        self.process_index, self.num_processes, self.box, self.barrier = rank, world, box, barrier

    def gather(self, t):
        self.box[self.process_index] = t
        self.barrier.wait()
        out = torch.cat(list(self.box))
        self.barrier.wait()
        return out

    def pad_across_processes(self, t, dim=0):
        n = int(self.gather(torch.tensor([t.shape[dim]])).max())
        pad = [0, 0] * (t.dim() - 1 - dim) + [0, n - t.shape[dim]]
        return torch.nn.functional.pad(t, pad)


def run_processes(fn, *per_rank, timeout=60):
    """fn(rank, accelerator, *args) in one thread per rank, gathering through a barrier with a
    timeout. A thread that raises aborts the barrier, so the others fail at once instead of
    waiting; its exception is raised here (the first that is not just the broken barrier).
    -> [fn's result per rank]."""
    world = len(per_rank)
    box, barrier = [None] * world, threading.Barrier(world, timeout=timeout)
    out, errors = [None] * world, []

    def proc(rank, args):
        try:
            out[rank] = fn(rank, FakeAccelerator(rank, world, box, barrier), *args)
        except BaseException as e:  # noqa: B036  (re-raised in the test's thread below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=proc, args=(r, a), daemon=True)
               for r, a in enumerate(per_rank)]
    [t.start() for t in threads]
    [t.join(timeout + 10) for t in threads]
    assert not any(t.is_alive() for t in threads), "a process thread is stuck past the barrier"
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                   errors[0])
    return out


@pytest.mark.parametrize("select, group_size", [("entropy", 0), ("gmts", 3)])
def test_selection_is_over_all_processes(select, group_size):
    """Two processes with different completion lengths and shuffled rows; group 1 (rows 3-5) sits
    on both: the union of their slices is gmts.select_tokens over the whole generation batch in
    row order, not a selection per process."""
    g = torch.Generator().manual_seed(3)
    s0, s1 = torch.rand(3, 5, generator=g), torch.rand(3, 8, generator=g) + 0.3
    m0, m1 = torch.rand(3, 5, generator=g) > 0.2, torch.rand(3, 8, generator=g) > 0.2
    s0[0, :2] = s1[1, :2] = 0.9  # ties across processes
    r0, r1 = torch.tensor([4, 0, 2]), torch.tensor([5, 1, 3])
    out = run_processes(lambda rank, acc, s, m, r: gmts_trl.select_generation_batch(
        select, s, m, r, 0.3, group_size, acc), (s0, m0, r0), (s1, m1, r1))
    pad = lambda x: torch.cat([x, x.new_zeros(3, 3)], 1)  # noqa: E731  (3, 5) -> (3, 8)
    order = torch.argsort(torch.cat([r0, r1]))
    scores, mask = torch.cat([pad(s0), s1])[order], torch.cat([pad(m0), m1])[order]
    want = gmts.select_tokens(scores, mask, 0.3, nonzero=select == "gmts", group_size=group_size)
    assert torch.equal(torch.cat([pad(out[0][0]), out[1][0]])[order], want)
    assert out[0][1] == out[1][1] == int(want.sum()) / int(mask.sum())
    alone = gmts.select_tokens(s1, m1, 0.3, nonzero=select == "gmts")
    assert not torch.equal(out[1][0], alone)  # not a selection per process


def test_a_failing_process_fails_fast():
    """One process raises before its gather: the test gets that error within seconds, not a hang
    on the barrier."""
    def fn(rank, acc, s, m, r):
        if rank == 1:
            raise ValueError("process 1 broke")
        return gmts_trl.select_generation_batch("entropy", s, m, r, 0.3, 0, acc)

    s, m = torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="process 1 broke"):
        run_processes(fn, (s, m, torch.arange(2)), (s, m, torch.arange(2, 4)), timeout=30)
    assert time.monotonic() - t0 < 10


def two_process_worker(out: str):
    """One of two gloo processes (torchrun): a tiny TRL run, per-device batch 2, G = 4,
    steps_per_generation 3 (6 rows a process: group 1 has rows on both); saves its selections."""
    torch.set_num_threads(1)
    tr = make_trainer(out, "gmts", rho=0.3, reward=length_reward, per_device_train_batch_size=2,
                      steps_per_generation=3, max_steps=3, num_iterations=1)
    calls = record(tr)
    tr.train()
    calls[0]["backend"] = torch.distributed.get_backend()
    torch.save(calls, os.path.join(out, f"rank{tr.accelerator.process_index}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_select_over_whole_groups(tmp_path):
    """Two real processes (torchrun, gloo, CPU): the union of their kept masks is
    gmts.select_tokens(group_size=G) over the generation batch of both, a group split between
    them included."""
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\nimport test_gmts_trl\n"
                      "test_gmts_trl.two_process_worker(sys.argv[1])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(free_port()), str(script), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 1 and ranks[0][0]["backend"] == "gloo"
    rows, scores, mask, keep = in_generation_order([[ranks[0][0], ranks[1][0]]])[0]
    assert len(rows) == 12 and {int(r) // 4 for r in ranks[0][0]["rows"]} & \
        {int(r) // 4 for r in ranks[1][0]["rows"]}
    assert torch.equal(keep, gmts.select_tokens(scores, mask, 0.3, nonzero=True, group_size=4))
    assert keep.any()


# ---- through TRL's real loss: unselected tokens get zero gradient -------------------------------


def loss_inputs(tok, B=4, P=5, T=9):
    g = torch.Generator().manual_seed(0)
    comp_mask = (torch.arange(T)[None, :] < torch.tensor([9, 4, 7, 2])[:, None]).int()
    return dict(prompt_ids=torch.randint(256, (B, P), generator=g),
                prompt_mask=torch.ones(B, P, dtype=torch.int),
                completion_ids=torch.randint(256, (B, T), generator=g), completion_mask=comp_mask,
                advantages=torch.tensor([1.2, -0.7, 0.0, 0.4]), num_items_in_batch=comp_mask.sum(),
                gmts_row=torch.tensor([3, 0, 2, 1]))  # one group of 4, shuffled


@pytest.mark.parametrize("select", ["gmts", "entropy", "random", "gradnorm", "all"])
def test_unselected_tokens_get_zero_gradient(tmp_path, select):
    tr = make_trainer(tmp_path, select, rho=0.25)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the dapo normaliser
    inputs = loss_inputs(tr.processing_class)
    if select != "all":
        tr.select([inputs], 4)  # as _prepare_inputs does at the start of a pass
    box = {}
    logps_fn, hook = tr._get_per_token_logps_and_entropies, tr.get_high_entropy_mask

    def leaf_logps(*a, **k):  # the loss's log-probs become a leaf: .grad is d loss / d log p_t
        logps, ent, aux = logps_fn(*a, **k)
        box["leaf"] = logps.detach().requires_grad_(True)
        return box["leaf"], ent, aux

    tr._get_per_token_logps_and_entropies = leaf_logps
    tr.get_high_entropy_mask = lambda *a: box.setdefault("sel", hook(*a))
    tr._compute_loss(tr.model, inputs).backward()
    has_grad = box["leaf"].grad != 0
    mask = inputs["completion_mask"].bool()
    live = mask & (inputs["advantages"] != 0)[:, None]  # tokens whose unmasked loss has a gradient
    if select == "all":  # the control: TRL's path unmasked, every live token has a gradient
        assert "sel" not in box and torch.equal(has_grad, live)
        return
    sel = box["sel"]
    assert torch.equal(sel, inputs["gmts_keep"])
    assert 0 < int(sel.sum()) <= math.ceil(0.25 * int(mask.sum())) < int(live.sum())
    assert torch.equal(has_grad, sel & live)  # exactly the selected tokens, none of the others
    if select == "gmts":
        assert not (sel & ~live).any()  # gmts never spends budget on A = 0


def test_unsupported_trl_fails_loudly(tmp_path, monkeypatch):
    """A TRL whose loss no longer calls the hook, or lacks it, raises instead of training without
    selection."""
    tr = make_trainer(tmp_path, "gmts")
    monkeypatch.setattr(gmts_trl.GRPOTrainer, "_compute_loss",
                        lambda self, model, inputs: torch.tensor(0.0))
    with pytest.raises(RuntimeError, match="did not call get_high_entropy_mask"):
        tr._compute_loss(tr.model, {})
    monkeypatch.delattr(gmts_trl.GRPOTrainer, "get_high_entropy_mask")
    with pytest.raises(RuntimeError, match="missing or changed"):
        gmts_trl.check_trl()


def test_every_trl_method_gmts_trl_overrides_is_listed_in_trl_hooks():
    """TRL_HOOKS is the one list a TRL upgrade checks: every GRPOTrainer method GMTSTrainer overrides is in it with
    its parameters, and every hook it names exists in the installed TRL."""
    overridden = {n for n in vars(GMTSTrainer) if not n.startswith("__") and hasattr(gmts_trl.GRPOTrainer, n)}
    assert overridden == {h.name for h in gmts_trl.TRL_HOOKS if h.params}
    for hook in gmts_trl.TRL_HOOKS:
        assert hook.owner is None or getattr(hook.owner, hook.name, None) is not None, hook.name
        assert hook.why and hook.breaks
    gmts_trl.check_trl()


def test_hook_outside_compute_loss_and_bad_config_fail_loudly(tmp_path):
    tr = make_trainer(tmp_path, "gmts")
    with pytest.raises(RuntimeError, match="_compute_loss"):
        tr.get_high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), 0.8)
    tr._live = dict(inputs={}, called=False)  # a micro-batch that was never selected
    with pytest.raises(RuntimeError, match="gmts_keep"):
        tr.get_high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), 0.8)
    tr._live = None
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(ValueError, match="token_selection"):
        GMTSConfig(token_selection="top", **kw)
    with pytest.raises(ValueError, match="token_rho"):
        GMTSConfig(top_entropy_quantile=0.2, **kw)


# ---- CLI -------------------------------------------------------------------------------------------------------

FAST = ["--short-prompt", "--steps", "1", "--num-generations", "2", "--per-device-batch-size", "2", "--grad-accum", "1",
        "--max-completion-length", "8"]  # a case whose check is missing trains 1 tiny step and fails, not 200


def files_under(folder) -> dict:
    """Every file under folder (relative path -> bytes) and every folder (-> None)."""
    out = {}
    for here, dirs, names in os.walk(folder):
        for n in dirs:
            out[os.path.relpath(os.path.join(here, n), folder)] = None
        for n in names:
            with open(os.path.join(here, n), "rb") as f:
                out[os.path.relpath(os.path.join(here, n), folder)] = f.read()
    return out


def one_error_line(capsys) -> str:
    """stderr, which must be exactly one line 'gmts_trl: error: ...' and no traceback: that line's text after it."""
    err = capsys.readouterr().err
    assert err.startswith("gmts_trl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("gmts_trl: error: "):-1]


@pytest.fixture
def no_bars(monkeypatch):
    """No progress bar on stderr (the Trainer's tqdm; its log lines go to stdout instead): a test that trains
    reads stderr line by line."""
    import transformers.trainer
    monkeypatch.setattr(transformers.trainer, "DEFAULT_PROGRESS_CALLBACK", transformers.trainer.PrinterCallback)


def locked_elsewhere(lock: str) -> bool:
    """Whether another process finds `lock` (a filelock file) held."""
    probe = "import filelock, sys\ntry:\n    filelock.FileLock(sys.argv[1], timeout=0).acquire()\n" \
            "except filelock.Timeout:\n    sys.exit(3)\n"
    return subprocess.run([sys.executable, "-c", probe, lock]).returncode == 3


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Bad data files, model folders and output folders, built once."""
    d = tmp_path_factory.mktemp("bad")
    row = json.dumps({"nums": [1, 2, 3], "target": 6})
    files = {"one.jsonl": row + "\n", "dup.jsonl": (row + "\n") * 20, "empty.jsonl": "",
             "schema.jsonl": json.dumps({"nums": [1, 2]}) + "\n", "afile": "x",
             "user/README.md": "mine", "user/checkpoint-2/precious.bin": "mine",  # named like TRL's, not TRL's
             "hasrun/checkpoint-3/trainer_state.json": "{}", "hasrun/model.safetensors": ""}  # an earlier run
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    model, tok = gmts.build_tiny(hidden=16, layers=1)
    for name in ("good", "cfgonly", "trunc", "template"):
        model.save_pretrained(d / name)
        tok.save_pretrained(d / name)
    for n in os.listdir(d / "cfgonly"):  # then only config.json (and generation_config.json) stays
        if n != "config.json" and n != "generation_config.json":
            os.remove(d / "cfgonly" / n)
    weights = (d / "trunc" / "model.safetensors").read_bytes()
    (d / "trunc" / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    tok.save_pretrained(d / "template")
    return d


BAD_INPUTS = [  # (argv, exit code, part of the message); {d}: the `bad` folder
    (["--lr", "inf"], 2, "--lr must be finite and > 0"), (["--lr", "0"], 2, "--lr"), (["--lr", "nan"], 2, "--lr"),
    (["--rho", "0"], 2, "--rho must be in (0, 1]"), (["--rho", "1.5"], 2, "--rho"), (["--rho", "nan"], 2, "--rho"),
    (["--steps", "0"], 2, "--steps must be >= 1"), (["--steps", "x"], 2, "invalid int value"),
    (["--num-generations", "1"], 2, "--num-generations"), (["--per-device-batch-size", "0"], 2, "--per-device"),
    (["--grad-accum", "0"], 2, "--grad-accum"), (["--max-completion-length", "0"], 2, "--max-completion-length"),
    (["--seed", "-1"], 2, "--seed"), (["--seed", str(2**32)], 2, "--seed"), (["--task", "chess"], 2, "--task"),
    (["--select", "bogus"], 2, "--select"), (["--select", "rsi"], 2, "--select"),  # rsi: gmts.py only
    (["--loss-type", "ppo"], 2, "--loss-type"), (["--per-device-batch-size", "3"], 2, "divisible"),
    (["--use-vllm"], 2, "vLLM is not installed"),
    (["--data", "{d}/missing.jsonl"], 2, "cannot read"), (["--data", "{d}/empty.jsonl"], 2, "cannot read"),
    (["--data", "{d}/schema.jsonl"], 2, 'has no "target"'),
    (["--data", "{d}/one.jsonl", "--per-device-batch-size", "4"], 2, "1 distinct problem(s), but one step takes 2"),
    (["--data", "{d}/dup.jsonl", "--per-device-batch-size", "4"], 2, "1 distinct problem(s)"),
    (["--out", "{d}/afile"], 2, "must name a folder"), (["--out", ""], 2, "must name a folder"),
    (["--out", "{d}/afile/sub"], 1, "Not a directory"),
    (["--out", "{d}/hasrun"], 2, "holds a gmts_trl run: replace it with --overwrite"),
    (["--out", "{d}/user"], 2, "holds files that are not a gmts_trl run"),
    (["--model", "{d}/good", "--out", "{d}/good"], 2, "is or holds the --model folder"),
    (["--model", "{d}/good", "--out", "{d}"], 2, "is or holds the --model folder"),
    (["--model", "{d}/cfgonly"], 2, "cannot load model"), (["--model", "{d}/trunc"], 2, "cannot load model"),
    (["--model", "{d}/template"], 2, "chat template fails on the prompts (System role not supported)"),
]


@pytest.mark.parametrize("argv, code, msg", BAD_INPUTS, ids=[" ".join(c[0]).replace("{d}/", "") for c in BAD_INPUTS])
def test_cli_bad_input_one_line(capsys, tmp_path, bad, argv, code, msg):
    """Each bad input: exactly one stderr line 'gmts_trl: error: ...', no traceback, the exit code (2: input; 1: a
    folder that cannot be made), before any training, and every file that was there as it was."""
    if "--use-vllm" in argv and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    before = files_under(bad)
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(tmp_path / "run")] + [a.format(d=bad) for a in argv])
    line = one_error_line(capsys)
    assert e.value.code == code and msg in line, line
    assert files_under(bad) == before and not os.path.exists(tmp_path / "run")


def after_training(error):
    """GMTSTrainer.train that trains (TRL saves checkpoint-1 at the last step), then raises error: a stop or a fault
    late in train()."""
    real = GMTSTrainer.train

    def train(self, *a, **k):
        real(self, *a, **k)
        raise error
    return train


def raising(error):
    def boom(*a, **k):
        raise error
    return boom


OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
LOWER = "lower --per-device-batch-size or --max-completion-length"
TRAIN = "gmts_trl:GMTSTrainer.train"
FAULTS = [  # (id, argv, the patched "module:attribute", its stand-in, exit code, the whole line after 'error: ')
    ("Ctrl-C in train after a checkpoint", [], TRAIN, after_training(KeyboardInterrupt), 130,
     "interrupted; {out} keeps checkpoint-1"),
    ("Ctrl-C in train before a checkpoint", [], TRAIN, raising(KeyboardInterrupt), 130,
     "interrupted; {out} holds no checkpoint of TRL's yet"),
    ("OOM in train", [], TRAIN, raising(OOM), 1, f"out of GPU memory: {LOWER}; {{out}} holds no checkpoint of TRL's yet"),
    ("MemoryError in train", [], TRAIN, raising(MemoryError), 1,
     f"out of CPU memory: {LOWER}, or use a smaller model; {{out}} holds no checkpoint of TRL's yet"),
    ("full disk after a checkpoint", [], TRAIN, after_training(OSError(28, "No space left on device")), 1,
     "[Errno 28] No space left on device; {out} keeps checkpoint-1"),
    ("OOM while the weights load", ["--model", "{d}/good"], "transformers:AutoModelForCausalLM.from_pretrained",
     raising(OOM), 1, f"out of GPU memory: {LOWER}; {{out}} holds no checkpoint of TRL's yet"),
    ("a TRL whose hook changed", [], "gmts_trl:GRPOTrainer._prepare_inputs", lambda self, batch, extra: batch, 1,
     f"trl {gmts_trl.trl.__version__}: _prepare_inputs is missing or changed; gmts_trl.py needs the hooks of trl "
     f"{', '.join(gmts_trl.TESTED_TRL)} (TRL_HOOKS); {{out}} holds no checkpoint of TRL's yet"),
]


@pytest.mark.parametrize("argv, where, value, code, line", [c[1:] for c in FAULTS], ids=[c[0] for c in FAULTS])
def test_cli_fault_one_line_naming_what_is_kept(capsys, monkeypatch, no_bars, tmp_path, bad, argv, where, value, code, line):
    """A stop (Ctrl-C: 130) or a fault (memory, naming the flags that take less; a full disk; an unsupported TRL: 1)
    ends the run with exactly this one line, which names TRL's newest checkpoint if there is one; the final model
    is not saved."""
    module, attr = where.split(":")
    owner, _, name = attr.rpartition(".")
    target = importlib.import_module(module)
    monkeypatch.setattr(getattr(target, owner) if owner else target, name, value)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(out)] + [a.format(d=bad) for a in argv])
    assert one_error_line(capsys) == line.format(out=out) and e.value.code == code
    assert not os.path.exists(out / "model.safetensors")


def test_cli_a_second_writer_is_refused(capsys, monkeypatch, no_bars, tmp_path):
    """Another live process holds --out's lock: one line, exit 2, the folder as it was. Once it is gone the same
    command runs (the control: it was the lock that refused it), holding the lock itself while TRL trains and
    letting it go at the end."""
    out = tmp_path / "run"
    out.mkdir()
    lock = str(out / gmts_trl.LOCK)
    code = "import filelock, sys, time\nheld = filelock.FileLock(sys.argv[1])\nheld.acquire()\n" \
           "print('held', flush=True)\ntime.sleep(120)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as e:
            gmts_trl.main(FAST + ["--out", str(out)])
    finally:
        holder.kill()
        holder.wait()
    assert one_error_line(capsys) == f"--out {out}: another process writes there now" and e.value.code == 2
    assert os.listdir(out) == [gmts_trl.LOCK]
    seen, train = [], GMTSTrainer.train
    monkeypatch.setattr(GMTSTrainer, "train", lambda self: seen.append(locked_elsewhere(lock)) or train(self))
    gmts_trl.main(FAST + ["--out", str(out)])
    assert seen == [True] and not locked_elsewhere(lock)
    assert os.path.exists(out / "model.safetensors")


NEAR_MISSES = ("checkpoint-notes.txt", "tokenizer_notes.md", "checkpoint-5.txt", "checkpoint-3",
               "model.safetensors.bak", "my_tokens.json", "README.md.bak", "config.json.orig", "notes.txt")


def test_cli_overwrite_replaces_only_a_runs_files(capsys, no_bars, tmp_path):
    """A run writes only RUN_NAMES (every name TRL wrote is one), and --overwrite removes only those: without it a
    folder holding a gmts_trl run and a user's files is refused as it is; with it, the earlier run's names go (a
    stale checkpoint, another tokenizer's vocab.json), the user's stay, those named like TRL's too (a file
    checkpoint-3, checkpoint-notes.txt, tokenizer_notes.md), and the new run is saved."""
    out = tmp_path / "run"
    gmts_trl.main(FAST + ["--out", str(out)])
    assert gmts_trl.checkpoints(str(out)) == ["checkpoint-1"] and os.path.exists(out / "model.safetensors")
    assert gmts_trl.run_names(str(out)) == sorted(set(os.listdir(out)) - {gmts_trl.LOCK})
    os.rename(out / "checkpoint-1", out / "checkpoint-7")  # an earlier run's last checkpoint
    (out / "vocab.json").write_text("{}")
    for name in NEAR_MISSES:
        (out / name).write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "data.jsonl").write_text("mine")
    before = files_under(out)
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(out)])
    assert e.value.code == 2 and "holds a gmts_trl run: replace it with --overwrite" in one_error_line(capsys)
    assert files_under(out) == before
    gmts_trl.main(FAST + ["--out", str(out), "--overwrite"])
    after = files_under(out)
    assert gmts_trl.checkpoints(str(out)) == ["checkpoint-1"] and "vocab.json" not in after
    assert all(after[name] == b"mine" for name in NEAR_MISSES)
    assert after[os.path.join("mine", "data.jsonl")] == b"mine"


def test_cli_out_rule(tmp_path, bad):
    """A run is recognised by TRL's complete checkpoints (trainer_state.json, written last), newest by number; a
    new folder is not made by the check."""
    gmts_trl.check_out(str(bad / "hasrun"), "tiny", overwrite=True)  # the deliberate case
    gmts_trl.check_out(str(tmp_path / "new" / "deeper"), "tiny", overwrite=False)
    assert not os.path.exists(tmp_path / "new")
    for n in (9, 10, 11):
        os.makedirs(tmp_path / f"checkpoint-{n}")
        if n < 11:  # checkpoint-11: half written
            (tmp_path / f"checkpoint-{n}" / "trainer_state.json").write_text("{}")
    assert gmts_trl.checkpoints(str(tmp_path)) == ["checkpoint-9", "checkpoint-10"]
    assert gmts_trl.kept(str(tmp_path)) == f"; {tmp_path} keeps checkpoint-10"


def test_cli_one_row_file_is_an_error_not_zero_steps(capsys, tmp_path, bad):
    """TRL's sampler drops an incomplete batch: a 1-row file used to 'train' 0 steps and exit 0. With the default
    8 prompts per step it is an error; with 1 prompt per step the same file trains its step."""
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(["--data", str(bad / "one.jsonl"), "--out", str(tmp_path / "a"), "--steps", "1"])
    assert e.value.code == 2 and "1 distinct problem(s), but one step takes 8" in one_error_line(capsys)
    gmts_trl.main(FAST + ["--data", str(bad / "one.jsonl"), "--out", str(tmp_path / "b")])
    assert os.path.exists(tmp_path / "b" / "model.safetensors")


def test_cli_fewer_steps_than_asked_is_an_error(capsys, tmp_path, monkeypatch):
    """Whatever the cause, a run that ends before --steps exits 1 with one line and saves nothing."""
    monkeypatch.setattr(GMTSTrainer, "train", lambda self: None)
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(tmp_path / "run")])
    assert e.value.code == 1 and "trained 0 of 1 steps" in one_error_line(capsys)
    assert not os.path.exists(tmp_path / "run" / "model.safetensors")


def test_cli_huge_steps_builds_at_once(tmp_path):
    """--steps far beyond the data: at most ROWS_CAP problems are built (TRL repeats them), no hang up front."""
    args = gmts_trl.parse_args(FAST + ["--data", "easy", "--steps", str(10**20), "--out", str(tmp_path / "run")])
    t0 = time.monotonic()
    tr = gmts_trl.build_trainer(args)
    assert len(tr.train_dataset) == gmts_trl.ROWS_CAP and tr.args.max_steps == 10**20
    assert time.monotonic() - t0 < 60


def test_cli_two_processes_write_one_run(tmp_path):
    """accelerate launch (torchrun) starts one CLI process per device: only the one that saves takes --out's lock,
    so two gloo processes train and save one run (when each took it, the second refused the first)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), os.path.join(HERE, "gmts_trl.py"), *FAST, "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert gmts_trl.checkpoints(str(out)) == ["checkpoint-1"] and os.path.exists(out / "model.safetensors")


def test_cli_real_command_line_one_line(bad):
    """The real command line, for an error raised after TRL's config is built: one stderr line (no traceback, no
    import or deprecation noise), exit status 2."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "gmts_trl.py"), "--model", str(bad / "cfgonly"),
                        "--steps", "1", "--out", str(bad / "cli-run")], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gmts_trl: error: cannot load model")
