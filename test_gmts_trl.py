"""Tests for gmts_trl.py (GMTS inside TRL's GRPOTrainer). Offline, CPU:  python -m pytest -q test_gmts_trl.py

The mask the hook returns is checked against gmts.select_tokens on the same tensors, and through TRL's real loss
that every unselected token gets exactly zero gradient (with a control that fails when nothing is masked).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import importlib.util
import json
import math
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
    """Tiny matmuls on a shared 2-core machine: several threads spin-wait on each other (100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_trainer(tmp, select="gmts", rho=0.25, reward=None, **kw):
    model, tok = gmts.build_tiny(hidden=32, layers=2)
    rows = gmts.load_rows("countdown", "easy", n=8, seed=0)
    data = gmts_trl.make_dataset(tok, "countdown", rows, chat=True, short=True)
    cfg = GMTSConfig(output_dir=str(tmp), use_cpu=True, report_to=[], bf16=False, per_device_train_batch_size=4,
                     num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1, save_strategy="no",
                     gradient_checkpointing=False, learning_rate=1e-2, token_selection=select, token_rho=rho,
                     disable_tqdm=True, **kw)
    rewards = [gmts_trl.make_reward("countdown")] + ([reward] if reward else [])
    return GMTSTrainer(model=model, reward_funcs=rewards, args=cfg, train_dataset=data, processing_class=tok)


# ---- end to end ------------------------------------------------------------------------------------------------


def length_reward(prompts, completions, **kwargs):
    """A toy second reward so that the tiny random model gets non-zero advantages (countdown alone gives 0)."""
    return [sum(map(ord, c)) % 7 / 6 for c in completions]


@pytest.mark.parametrize("select", ["gmts", "gradnorm"])
def test_two_trl_steps_end_to_end(tmp_path, select):
    tr = make_trainer(tmp_path, select, reward=length_reward)
    calls = []
    hook = tr.get_high_entropy_mask
    tr.get_high_entropy_mask = lambda *a: calls.append(dict(tr._live["inputs"])) or hook(*a)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr.state.global_step == 2 and len(calls) == 2  # one mask per micro-batch
    for inputs in calls:  # the group labels came through TRL's shuffle with their rows: one label, one prompt
        labels, prompts = inputs["gmts_group"].tolist(), inputs["prompt_ids"].tolist()
        assert {(lab, tuple(p)) for lab, p in zip(labels, prompts)} == {(lab, tuple(p)) for lab, p in
                                                                       dict(zip(labels, prompts)).items()}
    logs = [h for h in tr.state.log_history if "gmts/kept_frac" in h]
    assert len(logs) == 2 and all(0 < h["gmts/kept_frac"] <= 0.3 for h in logs)  # ceil(0.25 * n) / n at most
    assert all("rewards/countdown_reward/mean" in h for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_reward_function_uses_our_verifier():
    row = {"nums": [3, 5, 2], "target": 16, "expr": "(3 + 5) * 2"}
    rew = gmts_trl.make_reward("countdown")
    out = rew(prompts=["p"] * 3, completions=["x</think><answer>(3 + 5) * 2</answer>", "<answer>3+5+2</answer>", "no"],
              row=[json.dumps(row)] * 3, completion_ids=None, trainer_state=None)
    assert out == [1.0, 0.1, 0.0]


# ---- the hook's mask is gmts.py's selection ---------------------------------------------------------------------


def stats(B=4, T=7, V=11, seed=0):
    """Hand-made token statistics: entropy, log p_y and log sum p^2 from random logits, a ragged mask, advantages
    with a zero group and ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    y = torch.randint(V, (B, T), generator=g)
    logp, ent, gn = gmts.token_stats(logits, y)
    log_sum_sq = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 6])[:, None]
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    return ent, logp, log_sum_sq, gn, mask, adv


def run_hook(tr, ent, mask, inputs, logp, log_sum_sq):
    tr._live = dict(inputs=inputs, logps=[logp], sum_sq=[log_sum_sq], called=False)
    try:
        return tr.get_high_entropy_mask(ent, mask.int(), 0.8)  # TRL passes an int mask; threshold is ignored
    finally:
        tr._live = None


@pytest.mark.parametrize("select", gmts.CHOICES["select"])
@pytest.mark.parametrize("off_policy, rho", [(False, 0.3), (True, 0.3), (False, 0.9)])
def test_hook_mask_equals_select_tokens(tmp_path, select, off_policy, rho):
    """rho = 0.9 is more than the tokens with a non-zero score: gmts and gradnorm must still keep none of those."""
    tr = make_trainer(tmp_path, select, rho=rho)
    ent, logp, log_sum_sq, gn, mask, adv = stats()
    inputs = {"advantages": adv}
    ratio = torch.ones_like(ent)
    if off_policy:  # old log-probs from TRL: ratio != 1 and some tokens clipped (omega = 0)
        old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
        inputs["old_per_token_logps"], ratio = old, torch.exp(logp - old)
    om = gmts.omega(adv, ratio, tr.epsilon_low, tr.epsilon_high)
    inputs["gmts_group"] = torch.tensor([1, 0, 1, 0])  # rows as TRL's shuffle leaves them: two groups, interleaved
    tr._noise.manual_seed(5)
    got = run_hook(tr, ent, mask, inputs, logp, log_sum_sq)
    scores = gmts.token_scores(select, ent, gn, om, torch.Generator().manual_seed(5))
    groups = None
    if select == "gmts":  # its authors' scope by default: within each prompt's group
        groups = inputs["gmts_group"][:, None].expand(mask.shape)
    # as gmts.train: gmts and gradnorm never keep a zero-gradient token
    want = gmts.select_tokens(scores, mask, 1.0 if select == "all" else rho, nonzero=select in ("gmts", "gradnorm"),
                              groups=groups)
    assert got.dtype == torch.bool and torch.equal(got, want)
    if select in ("entropy", "random"):
        assert int(got.sum()) == math.ceil(rho * int(mask.sum()))
    if select == "gmts":  # the group scope is not the pool's: the batch-scope mask differs here
        assert not torch.equal(got, gmts.select_tokens(scores, mask, rho, nonzero=True))
        with pytest.raises(RuntimeError, match="no group labels"):
            run_hook(tr, ent, mask, {"advantages": adv}, logp, log_sum_sq)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_hook_omega_is_minus_the_gradient_of_trls_loss(tmp_path, monkeypatch, loss_type, beta):
    """TRL's own _compute_loss on a micro-batch whose log-probs are a leaf: its gradient w.r.t. each token's log-prob
    is -c * omega on the kept tokens and -c * (the KL part of omega) on the dropped ones, one constant c for the
    whole micro-batch (TRL's normaliser up to what the ranking cannot see). Rows of different lengths make
    grpo's 1 / |o_i| visible; old log-probs put some tokens under the clip."""
    import trl
    tr = make_trainer(tmp_path, "gmts", rho=0.4, loss_type=loss_type)
    tr.beta = beta  # set after construction: TRL would load a reference model by name for beta > 0
    tr.current_gradient_accumulation_steps = 1  # what TRL's training loop sets before a loss
    ent, logp, log_sum_sq, gn, mask, adv = stats(seed=2)
    B, T = mask.shape
    g = torch.Generator().manual_seed(4)
    old = logp + 0.4 * torch.randn(logp.shape, generator=g)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
              "gmts_group": torch.tensor([0, 0, 1, 1])}
    if beta:
        inputs["ref_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    x = logp.clone().requires_grad_()
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", lambda *a, **k: (x, ent, None))
    grad, = torch.autograd.grad(tr._compute_loss(tr.model, inputs), x)
    sel = run_hook(tr, ent, mask, inputs, logp, log_sum_sq)
    om = tr.omega(inputs, logp, mask)
    kl = om - tr.omega(dict(inputs, ref_per_token_logps=logp), logp, mask)  # the KL part alone
    want = torch.where(sel, om, kl)
    i = int((want.abs() * mask).flatten().argmax())
    c = float(-grad.flatten()[i] / want.flatten()[i])
    assert c > 0 and torch.allclose(-grad[mask], c * want[mask], rtol=1e-4, atol=1e-9)
    assert (kl[mask & ~sel] != 0).any() == (beta > 0)
    assert gmts.clip_active(adv[:, None], torch.exp(logp - old), tr.epsilon_low, tr.epsilon_high)[mask].any()
    assert tr.args.use_bias_correction_kl  # TRL's default: its KL gradient carries the ratio


def test_grad_norm_from_head_outputs_matches_gmts():
    ent, logp, log_sum_sq, gn, mask, adv = stats()
    assert torch.allclose(gmts_trl.grad_norm_from(logp, log_sum_sq), gn, atol=1e-5)
    assert torch.allclose(gmts_trl.grad_norm_from(logp, log_sum_sq, 0.7), gn / 0.7, atol=1e-5)


class FakeAccelerator:
    """accelerate's gather / pad_across_processes for `world` threads: a real all-gather through a barrier."""

    def __init__(self, rank, world, box, barrier):
        self.process_index, self.num_processes, self.box, self.barrier = rank, world, box, barrier

    def gather(self, t):
        self.box[self.process_index] = t
        self.barrier.wait()
        out = torch.cat(list(self.box))
        self.barrier.wait()
        return out

    def pad_across_processes(self, t, dim=0):
        n = int(self.gather(torch.tensor([t.shape[0]])).max())
        return torch.cat([t, t.new_zeros(n - t.shape[0])])


def run_processes(fn, *per_rank, timeout=60):
    """fn(rank, accelerator, *args) in one thread per rank, gathering through a barrier with a timeout. A thread
    that raises aborts the barrier, so the others fail at once instead of waiting; its exception is raised here
    (the first that is not just the broken barrier). -> [fn's result per rank]."""
    world = len(per_rank)
    box, barrier, out, errors = [None] * world, threading.Barrier(world, timeout=timeout), [None] * world, []

    def proc(rank, args):
        try:
            out[rank] = fn(rank, FakeAccelerator(rank, world, box, barrier), *args)
        except BaseException as e:  # noqa: B036  (re-raised in the test's thread below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=proc, args=(r, a), daemon=True) for r, a in enumerate(per_rank)]
    [t.start() for t in threads]
    [t.join(timeout + 10) for t in threads]
    assert not any(t.is_alive() for t in threads), "a process thread is stuck past the barrier timeout"
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out


def test_selection_is_global_across_processes():
    """Two processes with different completion lengths: the union of their slices is exactly gmts.select_tokens
    over both micro-batches together (one global top-rho, not a top-rho per process)."""
    g = torch.Generator().manual_seed(3)
    s0, s1 = torch.rand(3, 5, generator=g), torch.rand(3, 8, generator=g) + 0.3  # process 1 scores higher
    m0, m1 = torch.rand(3, 5, generator=g) > 0.2, torch.rand(3, 8, generator=g) > 0.2
    s0[0, :2] = s1[1, :2] = 0.9  # ties across processes
    out = run_processes(lambda rank, acc, s, m: gmts_trl.select_global("entropy", s, m, 0.3, acc),
                        (s0, m0), (s1, m1))
    pad = lambda x: torch.cat([x, x.new_zeros(3, 3)], 1)  # noqa: E731  (3, 5) -> (3, 8)
    want = gmts.select_tokens(torch.cat([pad(s0), s1]), torch.cat([pad(m0), m1]), 0.3)
    assert torch.equal(torch.cat([pad(out[0][0]), out[1][0]]), want)
    assert out[0][1] == out[1][1] == int(want.sum()) / int(m0.sum() + m1.sum())
    assert int(out[0][0].sum()) != math.ceil(0.3 * int(m0.sum()))  # not a per-process top-rho


def test_group_selection_across_processes_ranks_each_group_over_its_rows_everywhere():
    """Group 1's rows sit on both processes: its tokens are ranked together (the union of the slices equals
    gmts.select_tokens over both micro-batches with the labels), not per process."""
    g = torch.Generator().manual_seed(5)
    s0, s1 = torch.rand(3, 5, generator=g), torch.rand(3, 8, generator=g)
    m0, m1 = torch.rand(3, 5, generator=g) > 0.2, torch.rand(3, 8, generator=g) > 0.2
    g0, g1 = torch.tensor([0, 1, 0]), torch.tensor([1, 2, 1])
    out = run_processes(lambda rank, acc, s, m, lab: gmts_trl.select_global("gmts", s, m, 0.3, acc, lab),
                        (s0, m0, g0), (s1, m1, g1))
    pad = lambda x: torch.cat([x, x.new_zeros(3, 3)], 1)  # noqa: E731  (3, 5) -> (3, 8)
    labels = torch.cat([g0, g1])[:, None].expand(6, 8)
    want = gmts.select_tokens(torch.cat([pad(s0), s1]), torch.cat([pad(m0), m1]), 0.3, nonzero=True, groups=labels)
    assert torch.equal(torch.cat([pad(out[0][0]), out[1][0]]), want)
    per_process = gmts.select_tokens(s1, m1, 0.3, nonzero=True, groups=g1[:, None].expand(3, 8))
    assert not torch.equal(out[1][0], per_process)  # group 1 ranked with its rows on process 0 too


def test_a_failing_process_fails_fast():
    """One process raises before its gather: the test gets that error within seconds, not a hang on the barrier."""
    def fn(rank, acc, s, m):
        if rank == 1:
            raise ValueError("process 1 broke")
        return gmts_trl.select_global("entropy", s, m, 0.3, acc)

    s, m = torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="process 1 broke"):
        run_processes(fn, (s, m), (s, m), timeout=30)
    assert time.monotonic() - t0 < 10


# ---- through TRL's real loss: unselected tokens get zero gradient ---------------------------------------------


def loss_inputs(tok, B=4, P=5, T=9):
    g = torch.Generator().manual_seed(0)
    comp_mask = (torch.arange(T)[None, :] < torch.tensor([9, 4, 7, 2])[:, None]).int()
    return dict(prompt_ids=torch.randint(256, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.int),
                completion_ids=torch.randint(256, (B, T), generator=g), completion_mask=comp_mask,
                advantages=torch.tensor([1.2, -0.7, 0.0, 0.4]), num_items_in_batch=comp_mask.sum(),
                gmts_group=torch.tensor([0, 1, 1, 0]))  # as _generate_and_score_completions labels the rows


@pytest.mark.parametrize("select", ["gmts", "entropy", "random", "gradnorm", "all"])
def test_unselected_tokens_get_zero_gradient(tmp_path, select):
    tr = make_trainer(tmp_path, select, rho=0.25)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the dapo normaliser reads it
    inputs = loss_inputs(tr.processing_class)
    box = {}
    logps_fn, hook = tr._get_per_token_logps_and_entropies, tr.get_high_entropy_mask

    def leaf_logps(*a, **k):  # the loss's log-probs become a leaf, so their .grad is d loss / d log p_t
        logps, ent, aux = logps_fn(*a, **k)
        box["leaf"] = logps.detach().requires_grad_(True)
        return box["leaf"], ent, aux

    tr._get_per_token_logps_and_entropies = leaf_logps
    tr.get_high_entropy_mask = lambda *a: box.setdefault("sel", hook(*a))
    tr._compute_loss(tr.model, inputs).backward()
    has_grad = box["leaf"].grad != 0
    mask = inputs["completion_mask"].bool()
    live = mask & (inputs["advantages"] != 0)[:, None]  # tokens whose unmasked loss has a gradient
    if select == "all":  # the control: TRL's path unmasked, every token of a non-zero advantage has a gradient
        assert "sel" not in box and torch.equal(has_grad, live)
        return
    sel = box["sel"]
    assert 0 < int(sel.sum()) <= math.ceil(0.25 * int(mask.sum())) < int(live.sum())
    assert torch.equal(has_grad, sel & live)  # exactly the selected tokens, none of the others
    if select == "gmts":
        assert not (sel & ~live).any()  # gmts never spends budget on A = 0


def test_unsupported_trl_fails_loudly(tmp_path, monkeypatch):
    """A TRL whose loss no longer calls the hook, or lacks it, raises instead of training without selection."""
    tr = make_trainer(tmp_path, "gmts")
    monkeypatch.setattr(gmts_trl.GRPOTrainer, "_compute_loss", lambda self, model, inputs: torch.tensor(0.0))
    with pytest.raises(RuntimeError, match="did not call get_high_entropy_mask"):
        tr._compute_loss(tr.model, {})
    monkeypatch.delattr(gmts_trl.GRPOTrainer, "get_high_entropy_mask")
    with pytest.raises(RuntimeError, match="missing or changed"):
        gmts_trl.check_trl()


def test_hook_outside_compute_loss_and_bad_config_fail_loudly(tmp_path):
    tr = make_trainer(tmp_path, "gmts")
    with pytest.raises(RuntimeError, match="_compute_loss"):
        tr.get_high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), 0.8)
    with pytest.raises(ValueError, match="token_selection"):
        GMTSConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, token_selection="top")
    with pytest.raises(ValueError, match="token_rho"):
        GMTSConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, top_entropy_quantile=0.2)


# ---- CLI -------------------------------------------------------------------------------------------------------

FAST = ["--short-prompt", "--steps", "1", "--num-generations", "2", "--per-device-batch-size", "2", "--grad-accum", "1",
        "--max-completion-length", "8"]  # a case whose check is missing trains 1 tiny step and fails, not 200


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Bad data files, model folders and output folders, built once."""
    d = tmp_path_factory.mktemp("bad")
    row = json.dumps({"nums": [1, 2, 3], "target": 6})
    files = {"one.jsonl": row + "\n", "dup.jsonl": (row + "\n") * 20, "bad.jsonl": "not json\n", "empty.jsonl": "",
             "schema.jsonl": json.dumps({"nums": [1, 2]}) + "\n", "afile": "x"}
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "hasrun").mkdir()
    (d / "hasrun" / "model.safetensors").write_bytes(b"")
    (d / "hasrun" / ".gmts-run").write_text('{"kind": "trl"}\n')  # an earlier gmts_trl.py run's marker
    model, tok = gmts.build_tiny(hidden=16, layers=1)
    model.save_pretrained(d / "cfgonly")  # then only config.json (and generation_config.json) stays
    os.remove(d / "cfgonly" / "model.safetensors")
    model.save_pretrained(d / "trunc")
    tok.save_pretrained(d / "trunc")
    weights = (d / "trunc" / "model.safetensors").read_bytes()
    (d / "trunc" / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    return d


BAD_INPUTS = [  # (argv, exit code, part of the message); {d}: the `bad` folder
    (["--lr", "inf"], 2, "--lr must be finite and > 0"), (["--lr", "0"], 2, "--lr"), (["--lr", "nan"], 2, "--lr"),
    (["--rho", "0"], 2, "--rho must be in (0, 1]"), (["--rho", "1.5"], 2, "--rho"), (["--rho", "nan"], 2, "--rho"),
    (["--steps", "0"], 2, "--steps must be >= 1"), (["--steps", "x"], 2, "invalid int value"),
    (["--num-generations", "1"], 2, "--num-generations"), (["--per-device-batch-size", "0"], 2, "--per-device"),
    (["--grad-accum", "0"], 2, "--grad-accum"), (["--max-completion-length", "0"], 2, "--max-completion-length"),
    (["--max-completion-length", "5000"], 2, "the model's 4096 positions"), (["--seed", "-1"], 2, "--seed"),
    (["--seed", str(2**32)], 2, "--seed"), (["--task", "chess"], 2, "--task"),
    (["--select", "bogus"], 2, "--select"), (["--loss-type", "ppo"], 2, "--loss-type"),
    (["--per-device-batch-size", "3"], 2, "divisible"),
    (["--data", "{d}/missing.jsonl"], 2, "cannot read"), (["--data", "{d}/bad.jsonl"], 2, "invalid JSON"),
    (["--data", "{d}/empty.jsonl"], 2, "no rows"), (["--data", "{d}/schema.jsonl"], 2, 'missing key "target"'),
    (["--data", "{d}/one.jsonl", "--per-device-batch-size", "4"], 2, "1 distinct problem(s), but one step takes 2"),
    (["--data", "{d}/dup.jsonl", "--per-device-batch-size", "4"], 2, "1 distinct problem(s)"),
    (["--out", "{d}/afile"], 2, "is an existing file"), (["--out", "{d}/afile/sub"], 2, "is a file, not a folder"),
    (["--out", ""], 2, "--out must not be empty"), (["--out", "{d}/hasrun"], 2, "holds a run"),
    (["--model", "{d}/cfgonly"], 1, "cannot load model"), (["--model", "{d}/trunc"], 1, "cannot load model"),
]


@pytest.mark.parametrize("argv, code, msg", BAD_INPUTS, ids=[" ".join(c[0]).replace("{d}/", "") for c in BAD_INPUTS])
def test_cli_bad_input_one_line(capsys, tmp_path, bad, argv, code, msg):
    """Each bad input: exactly one stderr line 'gmts_trl: error: ...', no traceback, the exit code (2: input, 1: a
    model that cannot be loaded), before any training."""
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(tmp_path / "run")] + [a.format(d=bad) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert err.startswith("gmts_trl: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert msg in err


def test_cli_one_row_file_is_an_error_not_zero_steps(capsys, tmp_path, bad):
    """TRL's sampler drops an incomplete batch: a 1-row file used to 'train' 0 steps and exit 0. With the default
    8 prompts per step it is an error; with 1 prompt per step the same file trains its step."""
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(["--data", str(bad / "one.jsonl"), "--out", str(tmp_path / "a"), "--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "1 distinct problem(s), but one step takes 8" in err
    gmts_trl.main(FAST + ["--data", str(bad / "one.jsonl"), "--out", str(tmp_path / "b")])
    assert os.path.exists(tmp_path / "b" / "model.safetensors")


def test_cli_fewer_steps_than_asked_is_an_error(capsys, tmp_path, monkeypatch):
    """Whatever the cause, a run that ends before --steps exits 1 with one line and saves nothing."""
    monkeypatch.setattr(GMTSTrainer, "train", lambda self: None)
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(FAST + ["--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "trained 0 of 1 steps" in err
    assert not os.path.exists(tmp_path / "run" / "model.safetensors")


def test_cli_out_checks(tmp_path, bad):
    gmts_trl.check_out(str(bad / "hasrun"), overwrite=True)  # the deliberate case
    gmts_trl.check_out(str(tmp_path / "new" / "deeper"))  # created later, by TRL; nothing is made now
    assert not os.path.exists(tmp_path / "new")


def test_cli_huge_steps_builds_at_once(tmp_path):
    """--steps far beyond the data: at most ROWS_CAP problems are built (TRL repeats them), no hang up front."""
    args = gmts_trl.parse_args(FAST + ["--data", "easy", "--steps", str(10**20), "--out", str(tmp_path / "run")])
    t0 = time.monotonic()
    tr = gmts_trl.build_trainer(args)
    assert len(tr.train_dataset) == gmts_trl.ROWS_CAP and tr.args.max_steps == 10**20
    assert time.monotonic() - t0 < 60


def test_cli_model_folder_one_line_exit_1(bad):
    """The real command line, for an error raised after TRL's config is built: one stderr line (no traceback, no
    import or deprecation noise), exit status 1."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "gmts_trl.py"), "--model", str(bad / "cfgonly"),
                        "--steps", "1", "--out", str(bad / "cli-run")], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gmts_trl: error: cannot load model")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_cli_use_vllm_without_vllm_one_line_exit_1(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        gmts_trl.main(["--use-vllm", "--steps", "1", "--num-generations", "2", "--per-device-batch-size", "2",
                       "--grad-accum", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "vLLM is not available" in err and err.count("\n") == 1


def test_cli_runs_tiny_and_saves(tmp_path):
    out = str(tmp_path / "run")
    gmts_trl.main(["--model", "tiny", "--short-prompt", "--steps", "1", "--num-generations", "2",
                   "--per-device-batch-size", "2", "--grad-accum", "1", "--max-completion-length", "8", "--out", out])
    assert os.path.exists(os.path.join(out, "model.safetensors"))
