"""The method's claims in gmts.py, in the order of its reading part. Offline, CPU:  python -m pytest -q test_gmts.py

Config and presets, rollouts, group advantages and dynamic sampling, token statistics (the derivation, against
autograd and a slow loop), scores and selection (against the literal references of the authors' rule and ours),
loss and update (against autograd and REINFORCE), the training loop (the lr schedule and short runs through
gmts.main in this process), model and evaluation, trackers, RSI-S, the fast rollout path and the bf16 sampler,
and the paper-math preset: Framework1's values and one step against a literal reading of their update.
The verifiers and data: test_rewards.py; the seven promises of a run: test_promises.py.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import itertools
import json
import math
import re
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

import gmts
from gmts import completion_mask, group_advantages, omega, select_tokens, token_scores, token_stats

HERE = os.path.dirname(os.path.abspath(__file__))
ENV1 = dict(os.environ, OMP_NUM_THREADS="1")  # every subprocess runs on one thread


def run_gmts(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(HERE, "gmts.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE, env=ENV1)


@pytest.fixture(scope="module")
def tiny():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


# ---- Config and presets (Config, PRESETS: every field a --flag, --preset first) --------------------------------------


def test_preset_then_explicit_flag_wins():
    cfg = gmts.parse_args(["--preset", "cpu", "--lr", "1e-5"])
    assert cfg.lr == 1e-5 and cfg.model == gmts.WARM_CPU and cfg.data == "easy" and cfg.steps == 80
    assert gmts.WARM_CPU == os.path.join(HERE, "warm", "cpu")
    assert gmts.parse_args([]).rho == 0.2 and gmts.parse_args(["--no-std-normalize"]).std_normalize is False
    assert gmts.parse_args(["--preset", "smoke"]).model == gmts.WARM_CPU


def test_every_config_field_is_a_flag_with_help(capsys):
    """HfArgumentParser makes each field a flag (--a-b and --a_b) whose help is the field's own text."""
    with pytest.raises(SystemExit):
        gmts.parse_args(["--help"])
    out = capsys.readouterr().out
    entries = re.split(r"\n  (?=--)", out[out.index("options:"):])  # one entry per flag, wrapped lines and all
    for f in gmts.dataclasses.fields(gmts.Config):
        flag = "--" + f.name.replace("_", "-")
        entry = next((e for e in entries if re.search(rf"{flag}[ ,\n]|{flag}$", e.split("  ")[0] + " ")), None)
        assert entry, flag
        help_ = f.metadata["help"]  # compared without whitespace: argparse wraps lines, also after a hyphen
        assert len(help_.split()) >= 2 and re.sub(r"\s", "", help_) in re.sub(r"\s", "", entry), flag
    assert gmts.parse_args(["--max_new_tokens", "7"]).max_new_tokens == gmts.parse_args(["--max-new-tokens", "7"]).max_new_tokens == 7


# ---- rollouts --------------------------------------------------------------------------------------------------------


def test_chat_decision(tiny):
    _, tok = tiny
    assert gmts.use_chat(tok) is True and gmts.use_chat(tok, "auto") is True  # eos <|im_end|> + a template
    assert gmts.use_chat(tok, "no") is False and gmts.use_chat(tok, "yes") is True
    prompt = gmts.render_prompt(tok, "Q?", chat=True)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith(gmts.ASSISTANT_PREFIX)
    assert gmts.render_prompt(tok, "Q?", chat=False).endswith("Assistant: " + gmts.ASSISTANT_PREFIX)
    assert gmts.parse_args(["--chat-template", "no"]).chat_template == "no"
    assert gmts.Config().chat_template == "auto"


def test_completion_mask_by_position():
    end = [7, 9]  # 9 doubles as the pad id, as <|endoftext|> does for Qwen
    comp = torch.tensor([[1, 2, 7, 9, 9],   # ends at 2: the end token is kept, pads after it dropped
                         [9, 3, 3, 3, 3],   # ends at once: only the end token
                         [1, 2, 3, 4, 5],   # never ends: truncated, all valid
                         [1, 7, 2, 7, 9]])  # only the FIRST end counts
    mask, trunc = completion_mask(comp, end)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert trunc.tolist() == [False, False, True, False]


def test_recomputed_logp_equals_generate_scores(tiny):
    """Left-padded prompts, position ids from the mask: a forward pass reproduces the sampler's distribution."""
    model, tok = tiny
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "Hi"]]  # different lengths
    T = 0.7
    torch.manual_seed(0)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"].repeat_interleave(3, 0), enc["attention_mask"].repeat_interleave(3, 0)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=True, temperature=T,
                         top_k=0, top_p=1.0, repetition_penalty=1.0, eos_token_id=gmts.end_token_ids(tok),
                         pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
    comp = out.sequences[:, ids.shape[1]:]
    mask, _ = completion_mask(comp, gmts.end_token_ids(tok))
    batch = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=mask)
    logp, ent, _ = gmts.batch_token_stats(model, batch, T, micro_batch=4, chunk=5)
    scores = torch.stack(out.scores, 1).float()  # (N, T, V), temperature already applied, nothing filtered
    assert torch.isfinite(scores).all()  # top_k = 0 / top_p = 1: the full distribution
    ref = torch.log_softmax(scores, -1).gather(-1, comp[..., None]).squeeze(-1)
    assert torch.allclose(logp[mask], ref[mask], atol=1e-5)
    p = torch.softmax(scores, -1)
    assert torch.allclose(ent[mask], -(p * torch.log_softmax(scores, -1)).sum(-1)[mask], atol=1e-4)


def test_rollout_shapes_and_flags(tiny):
    model, tok = tiny
    torch.manual_seed(1)
    b = gmts.rollout(model, tok, ["a", "bbb"], group_size=3, max_new_tokens=6)
    assert b["comp_ids"].shape[0] == 6 and b["resp_mask"].shape == b["comp_ids"].shape
    assert len(b["texts"]) == 6 and b["truncated"].dtype == torch.bool
    assert (b["resp_mask"][:, 0]).all()  # every answer has at least one token


def test_rollout_passes_no_logits_processor_whatever_the_checkpoint_sets(tmp_path, monkeypatch):
    """A checkpoint's generation_config (Qwen instruct: top_k 20, top_p 0.8, repetition_penalty 1.1, ...) must not
    reach rollout's sampling: at T = 1 generate() builds an EMPTY logits-processor list, so answers are drawn from
    the policy whose log-probs are trained on. Spied on generate's own processor builder, through rollout."""
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    model, tok = gmts.build_tiny(hidden=32, layers=1, seed=0)
    knobs = dict(top_k=20, top_p=0.8, repetition_penalty=1.1, min_p=0.05, typical_p=0.9, no_repeat_ngram_size=3,
                 temperature=0.7)
    model.generation_config = GenerationConfig(do_sample=True, **knobs)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok = gmts.load_model(str(tmp_path), torch.device("cpu"))
    assert all(getattr(model.generation_config, k) == v for k, v in knobs.items())  # the checkpoint sets them all
    seen, real = [], GenerationMixin._get_logits_processor

    def spy(self, *a, **k):
        procs = real(self, *a, **k)
        seen.append(sorted(type(p).__name__ for p in procs))
        return procs
    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    model.generate(**tok(["a"], return_tensors="pt"), max_new_tokens=2)  # the knobs do act when left to leak
    assert len(seen[-1]) >= 6, seen[-1]
    for kw, want in [({}, []), (dict(greedy=True), []), (dict(temperature=0.7), ["TemperatureLogitsWarper"]),
                     (dict(top_k=5), ["TopKLogitsWarper"]), (dict(top_p=0.9), ["TopPLogitsWarper"])]:
        seen.clear()
        b = gmts.rollout(model, tok, ["a", "bb"], 2, 4, **kw)
        assert seen == [want], (kw, seen)
        assert len(b["texts"]) == 4
    assert all(getattr(model.generation_config, k) == v for k, v in knobs.items())  # restored afterwards


# ---- group advantages and dynamic sampling ---------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0] + [0.0] * 7 + [0.0] * 8 + [1.0] * 8)  # one of 8 correct, none, all
    a = group_advantages(r, 8)
    assert a[0].item() == pytest.approx(math.sqrt(7), abs=1e-5)  # +sqrt((G-k)/k)
    assert a[1].item() == pytest.approx(-math.sqrt(1 / 7), abs=1e-5)  # -sqrt(k/(G-k))
    assert (a[8:] == 0).all()  # all-equal groups: exactly 0, not NaN
    assert group_advantages(r, 8, std_normalize=False)[:2].tolist() == pytest.approx([0.875, -0.125])
    same = group_advantages(torch.tensor([0.1] * 16), 8)  # fp32: r - mean = 7.45e-9; unmasked, A would be ~0.0074
    assert (same == 0).all() and not torch.isnan(same).any()
    mixed = group_advantages(torch.tensor([1.0, 0.1, 0.0, 0.1]), 4)
    assert mixed.sum().abs() < 1e-6 and (mixed.std(unbiased=False) - 1).abs() < 1e-4
    assert gmts.informative(r, 8).tolist() == [True, False, False]


def test_group_advantages_all_equal_groups_are_exactly_zero():
    """The float trap behind "exactly 0": at the default G = 8 the fp32 mean of eight 0.1s (0.2, 0.3, 0.7, 0.9, 1/3)
    is not the value itself, so r - mean is ~1e-8 and the population std the same size (or 0, as the reduction
    falls): (r - mean) / (std + eps) would be an advantage of 0.007-0.06 for answers that all earned the same. The
    test checks that its data reaches the trap, then that group_advantages gives exactly 0, with and without the
    std, and that informative() calls none of these groups informative, in one batch and one group at a time. A
    mixed group of inexact rewards keeps the binary values."""
    G = 8
    values = [0.1, 0.2, 0.3, 0.7, 0.9, 1 / 3, 0.5, 1.0]  # six inexact in fp32, two exact
    r = torch.tensor([v for v in values for _ in range(G)])
    for batch in [r] + [torch.full((G,), v) for v in values]:  # the whole batch, and each group alone (B = 1)
        groups = batch.view(-1, G)
        centred = groups - groups.mean(dim=1, keepdim=True)
        raw = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + 1e-6)  # the formula without its mask
        inexact = (groups[:, 0] != 0.5) & (groups[:, 0] != 1.0)
        assert (raw.abs().amin(dim=1)[inexact] > 5e-3).all()  # the data reaches the trap: noise / std is 0.007-0.06
        for std in (True, False):
            a = group_advantages(batch, G, std_normalize=std)
            assert (a == 0).all() and a.dtype == torch.float32, (batch, std)
        assert not gmts.informative(batch, G).any(), batch
    one_right = group_advantages(torch.tensor([1.0] + [0.1] * 7), G)  # countdown: one right, seven tagged but wrong
    assert one_right.tolist() == pytest.approx([math.sqrt(7)] + [-math.sqrt(1 / 7)] * 7, abs=1e-5)
    assert gmts.informative(torch.tensor([1.0] + [0.1] * 7 + [0.1] * 8), G).tolist() == [True, False]


PAD = 258


def _part(tag, P, T, rewards, G=2):
    """A hand-built rollout part: prompts of width P (first column padding), responses of width T (last column
    invalid), every entry tagged so that each row can be recognised after filter_groups."""
    N = len(rewards)
    prompt_mask = torch.ones(N, P, dtype=torch.bool)
    prompt_mask[:, 0] = False
    resp_mask = torch.ones(N, T, dtype=torch.bool)
    resp_mask[:, -1] = False
    r = torch.tensor(rewards)
    return (dict(prompt_ids=torch.arange(N * P).view(N, P) + 1000 * tag, prompt_mask=prompt_mask,
                 comp_ids=torch.arange(N * T).view(N, T) + 100 * tag, resp_mask=resp_mask,
                 truncated=torch.arange(N) % 3 == tag, texts=[f"{tag}-{i}" for i in range(N)]),
            r, group_advantages(r, G))


def test_filter_groups_keeps_the_first_b_informative_groups():
    a = _part(1, 3, 4, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups: equal, informative, equal
    b = _part(2, 5, 2, [1.0, 0.0, 1.0, 1.0, 0.1, 1.0])  # informative, equal, informative
    # B = 2: a's group 1, then b's group 0
    batch, rewards, adv = gmts.filter_groups([a, b], 2, 2, PAD)
    (ba, ra, aa), (bb, rb, ab) = a, b
    assert batch["texts"] == ["1-2", "1-3", "2-0", "2-1"]
    assert rewards.tolist() == [0.0, 1.0, 1.0, 0.0] and adv.tolist() == aa[2:4].tolist() + ab[0:2].tolist()
    pad2 = torch.full((2, 2), PAD)
    assert torch.equal(batch["prompt_ids"], torch.cat([torch.cat([pad2, ba["prompt_ids"][2:4]], 1),
                                                       bb["prompt_ids"][0:2]]))  # prompts: padded on the LEFT
    no2 = torch.zeros(2, 2, dtype=torch.bool)
    assert torch.equal(batch["prompt_mask"], torch.cat([torch.cat([no2, ba["prompt_mask"][2:4]], 1),
                                                        bb["prompt_mask"][0:2]]))
    assert torch.equal(batch["comp_ids"], torch.cat([ba["comp_ids"][2:4],
                                                     torch.cat([bb["comp_ids"][0:2], pad2], 1)]))  # on the RIGHT
    assert torch.equal(batch["resp_mask"], torch.cat([ba["resp_mask"][2:4], torch.cat([bb["resp_mask"][0:2], no2], 1)]))
    assert batch["truncated"].tolist() == ba["truncated"][2:4].tolist() + bb["truncated"][0:2].tolist()
    all_three = ["1-2", "1-3", "2-0", "2-1", "2-4", "2-5"]
    assert gmts.filter_groups([a, b], 2, 3, PAD)[0]["texts"] == all_three
    assert gmts.filter_groups([a, b], 2, 10, PAD)[0]["texts"] == all_three
    dead, dead2 = _part(3, 2, 2, [1.0, 1.0, 0.0, 0.0]), _part(4, 3, 2, [0.1, 0.1, 0.0, 0.0])
    # nothing informative: the FIRST batch as is (two distinct ones)
    first = gmts.filter_groups([dead, dead2], 2, 2, PAD)
    assert first[0] is dead[0] and first[1] is dead[1] and first[2] is dead[2] and (first[2] == 0).all()


# ---- token statistics: the derivation, pinned ------------------------------------------------------------------------


@pytest.mark.parametrize("V", [2, 17, 1000])
@pytest.mark.parametrize("T", [1.0, 0.7, 1.3])
def test_token_stats_against_autograd_and_loop(V, T):
    torch.manual_seed(V)
    z = (torch.randn(6, V) * 3).requires_grad_(True)
    y = torch.randint(0, V, (6,))
    logp, ent, gn = token_stats(z, y, T)
    (-logp.sum()).backward()  # each row's gradient only touches its own logits
    assert torch.allclose(gn, z.grad.norm(dim=-1), atol=1e-5)  # (1/T) sqrt(1 - 2 p_y + sum p^2)
    for i in range(6):  # slow loop over the definitions
        p = [math.exp(v / T) for v in z[i].tolist()]
        s = sum(p)
        p = [v / s for v in p]
        assert logp[i].item() == pytest.approx(math.log(p[y[i]]), abs=1e-5)
        assert ent[i].item() == pytest.approx(-sum(v * math.log(v) for v in p if v > 0), abs=1e-4)


def test_token_stats_on_bf16_logits_is_fp32():
    """CUDA autocast hands the head bf16 logits: the statistics come out in fp32, equal to an fp64 reference on the
    bf16-rounded logits (only the input rounding remains, nothing is computed in bf16)."""
    torch.manual_seed(0)
    z = (torch.randn(64, 300) * 4).bfloat16()
    y = torch.randint(0, 300, (64,))
    T = 0.7
    out = token_stats(z, y, T)
    lp = torch.log_softmax(z.double() / T, -1)
    p = lp.exp()
    py = p.gather(-1, y[:, None]).squeeze(1)
    ref = (lp.gather(-1, y[:, None]).squeeze(1), -(p * lp).sum(-1), (1 - 2 * py + (p * p).sum(-1)).sqrt() / T)
    for got, want in zip(out, ref):
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5), (got.double() - want).abs().max()


def test_dz_norm_at_near_certain_tokens_does_not_cancel():
    """token_stats' comment: (1 - p_y)^2 + sum_{j != y} p_j^2 "does not cancel catastrophically when p_y ~ 1", unlike
    1 - 2 p_y + sum_j p_j^2. At sampled tokens with 1 - p_y = 1e-2, 1e-3, 1e-4 (the rest spread over 1 or 49 other
    tokens) the norm is within 0.5% of an fp64 reference; the data reaches the trap: there the textbook form in fp32
    is off by more than 50% (or NaN). What is left is log_softmax's own fp32 rounding of log p_y."""
    for V in (2, 50):
        for d in (1e-2, 1e-3, 1e-4):
            z = torch.full((1, V), -math.log((V - 1) * (1 - d) / d))  # token 0 at logit 0: p_0 = 1 - d exactly
            z[0, 0] = 0.0
            y = torch.tensor([0])
            _, _, gn = token_stats(z, y)
            p = torch.softmax(z.double(), -1)
            want = ((1 - p[0, 0]) ** 2 + (p[0, 1:] ** 2).sum()).sqrt()
            assert want.item() == pytest.approx(math.sqrt(d * d + d * d / (V - 1)), rel=1e-5)  # fp32 logits
            assert torch.isfinite(gn).all() and abs(gn.item() / want.item() - 1) < 5e-3, (V, d, gn.item(), want.item())
            if d == 1e-4:
                pf = torch.softmax(z, -1)
                textbook = (1 - 2 * pf[0, 0] + (pf * pf).sum()).sqrt()  # fp32, as the cancelling form computes it
                assert not abs(textbook.item() / want.item() - 1) < 0.5, (V, textbook.item())


def test_derivation_logit_gradient_of_clipped_loss():
    """dl/dz = -(omega/T) (onehot(y) - p), and 0 exactly where the clip is active (derivation steps 1-3). The last
    three tokens have A = 0 at ratios inside, above and below the clip range: never "clipped", just zero."""
    torch.manual_seed(0)
    V, T = 11, 0.7
    z = torch.randn(10, V, requires_grad=True)
    y = torch.randint(0, V, (10,))
    old = torch.log_softmax(z.detach() / T, -1).gather(-1, y[:, None]).squeeze(-1) + torch.tensor(
        [0.0, 0.5, -0.5, 0.1, 0.0, 0.5, -0.5, -0.1, -0.5, 0.5])  # ratios 1, e^-.5, e^.5, ...
    adv = torch.tensor([1.5, 1.5, 1.5, -0.7, -0.7, -0.7, -0.7, 0.0, 0.0, 0.0])
    logp, _, gn = token_stats(z, y, T)
    loss, clipped = gmts.grpo_token_loss(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    ratio = torch.exp(logp.detach() - old)
    om = omega(adv, ratio[:, None], 0.2, 0.28).squeeze(1)
    p = torch.softmax(z.detach() / T, -1)
    expect = -(om / T)[:, None] * (torch.nn.functional.one_hot(y, V) - p)
    assert torch.allclose(z.grad, expect, atol=1e-5)
    # = |omega| * dz_norm
    assert torch.allclose(z.grad.norm(dim=-1), om.abs() * gn.detach(), atol=1e-5)
    assert clipped.tolist() == (om == 0).tolist()[:7] + [False] * 3  # A = 0 is not "clipped", just zero
    assert clipped.tolist() == [False, False, True, False, False, True, False, False, False, False]
    assert ratio[8] > 1 + 0.28 and ratio[9] < 1 - 0.2 and (om[7:] == 0).all()  # the A = 0 cases are reached


def rank_corr(a, b):
    """Spearman's rank correlation for values without ties (continuous data)."""
    ra, rb = (x.flatten().argsort().argsort().double() for x in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def test_derivation_bounds_and_entropy_link():
    """Derivation step 4 on gmts's own numbers: token_stats' norm G and entropy H, and E_y[G^2] taken over y ~ p by
    calling token_stats for EVERY token y (no formula of the test's own)."""
    torch.manual_seed(0)
    R, V = 2000, 50
    z = torch.randn(R, V) * torch.rand(R, 1) * 6
    p = torch.softmax(z, -1)
    y = torch.multinomial(p, 1).squeeze(1)
    _, H, G = token_stats(z, y)
    py = p.gather(-1, y[:, None]).squeeze(1)
    assert ((1 - py) ** 2 <= G ** 2 + 1e-6).all() and (G ** 2 <= 2 * (1 - py) ** 2 + 1e-6).all()  # pointwise bounds
    _, H_all, G_all = token_stats(z[:, None, :].expand(R, V, V), torch.arange(V).expand(R, V))  # (R, V): y = 0..V-1
    assert torch.allclose(H_all, H[:, None].expand(R, V), atol=1e-5)  # H does not depend on the sampled token
    EG2 = (p * G_all ** 2).sum(-1)  # E_{y ~ p}[G^2]
    assert torch.allclose(EG2, 1 - (p * p).sum(-1), atol=1e-5)  # = 1 - sum p^2 (the Renyi-2 form)
    assert (EG2 <= 1 - torch.exp(-H) + 1e-6).all()  # <= 1 - exp(-H): in expectation, low entropy = small norm
    assert rank_corr(H, G) > 0.5  # within one "answer" (a fixed omega), entropy tracks the sampled token's norm
    # ... but not pointwise: the module's counterexample, a rare token sampled at a near-certain position
    p1 = torch.tensor([0.999] + [2e-5] * 50)
    _, h1, g1 = token_stats(p1.log()[None], torch.tensor([1]))
    assert h1.item() == pytest.approx(0.012, abs=5e-4) and g1.item() == pytest.approx(1.414, abs=1e-3)


def _batch_from(model, tok, seed=0, n_prompts=3, G=4, new=10):
    torch.manual_seed(seed)
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "x", "Use 9 9 to make 81."]]
    b = gmts.rollout(model, tok, prompts[:n_prompts], G, new)
    adv = group_advantages(torch.tensor([float(i % 3 == 0) for i in range(n_prompts * G)]), G)
    return b, adv


def _full_logits_stats(model, b, T):
    """token_stats on the full logits of one plain forward of the whole batch (the reference). 3 x (N, T)."""
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    P = b["prompt_ids"].shape[1]
    return token_stats(logits[:, P - 1:-1], b["comp_ids"], T)


def test_batch_token_stats_chunks_and_micro_batches_change_nothing(tiny):
    """batch_token_stats (hidden-state gather, the head applied `chunk` tokens at a time) equals token_stats on the
    full logits of a plain forward, for every chunk and micro-batch size; head_logp (autograd, recomputed chunks)
    gives the same log-probs and the same head gradient."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=4)
    m = b["resp_mask"]
    full = _full_logits_stats(model, b, 0.9)
    for mb, chunk in [(1, 1), (5, 7), (12, 1024)]:
        got = gmts.batch_token_stats(model, b, 0.9, mb, chunk)
        for g, f in zip(got, full):
            assert torch.allclose(g[m], f[m], atol=1e-5) and (g[~m] == 0).all()
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    h, y = torch.randn(50, 16), torch.randint(0, 300, (50,))
    lp = gmts.head_logp(h.requires_grad_(True), head, y, 0.9, chunk=7)
    assert torch.allclose(lp, token_stats(head(h), y, 0.9)[0].detach(), atol=1e-6)
    lp.sum().backward()
    g_chunked = head.weight.grad.clone()
    head.weight.grad = None
    token_stats(head(h), y, 0.9)[0].sum().backward()
    assert torch.allclose(g_chunked, head.weight.grad, atol=1e-5)


def test_token_stats_on_another_architecture():
    """response_hidden reaches the decoder through get_decoder(), not Qwen's `model.model`: on a GPT-NeoX (its
    decoder is `gpt_neox`, its head `embed_out`), batch_token_stats equals token_stats on a plain forward's full
    logits, and response_logp equals the log-probs."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    _, tok = gmts.build_tiny(hidden=32, layers=1)
    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).eval()
    assert not hasattr(model, "model")  # the attribute the old code called
    b, _ = _batch_from(model, tok, seed=2)
    m = b["resp_mask"]
    full = _full_logits_stats(model, b, 0.9)
    for g, f in zip(gmts.batch_token_stats(model, b, 0.9, 5, 7), full):
        assert torch.allclose(g[m], f[m], atol=1e-5) and (g[~m] == 0).all()
    ref = gmts.response_logp(model, b, m, 0.9, 5, 7)
    assert torch.allclose(ref[m], full[0][m], atol=1e-5) and (ref[~m] == 0).all()


def test_left_padding_positions_on_absolute_position_embeddings():
    """Rotary models (Qwen2, GPT-NeoX) see only differences of positions, so they cannot tell whether
    response_hidden's position ids follow the left padding. GPT-2's learned absolute positions can (checked: a
    forward with plain 0..P+T-1 positions is off): on left-padded prompts of two lengths, batch_token_stats and
    response_logp reproduce generate()'s own distribution, whose positions come from the attention mask."""
    from transformers import GPT2Config, GPT2LMHeadModel
    _, tok = gmts.build_tiny(hidden=32, layers=1)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tok), n_positions=256, bos_token_id=None,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 1.0)  # positions that matter
    prompts = [gmts.render_prompt(tok, q, True) for q in ["Use 1 2 3 to make 6.", "Hi"]]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    assert attn.sum(1).unique().numel() == 2  # the rows are left padded by different amounts
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0,
                         eos_token_id=gmts.end_token_ids(tok), pad_token_id=tok.pad_token_id, output_scores=True,
                         return_dict_in_generate=True)
    comp = out.sequences[:, ids.shape[1]:]
    mask, _ = completion_mask(comp, gmts.end_token_ids(tok))
    b = dict(prompt_ids=ids, prompt_mask=attn.bool(), comp_ids=comp, resp_mask=mask)
    want = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    logp = gmts.batch_token_stats(model, b, 1.0, 3, 5)[0]
    assert torch.allclose(logp[mask], want[mask], atol=1e-5)
    assert torch.allclose(gmts.response_logp(model, b, mask, 1.0, 3, 5)[mask], want[mask], atol=1e-5)
    with torch.no_grad():  # the data reaches the case: positions that ignore the padding give other log-probs
        full = torch.cat([ids, comp], 1)
        plain = model(input_ids=full, attention_mask=torch.cat([attn, mask.long()], 1)).logits[:, ids.shape[1] - 1:-1]
    off = torch.log_softmax(plain.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    assert (off - want)[mask].abs().max() > 1e-2


# ---- scores and selection --------------------------------------------------------------------------------------------


def slow_select(scores, mask, rho, nonzero=False):
    """Reference: sort valid tokens by (-score, flat index) and keep the first ceil(rho * n); nonzero: then keep
    only positive scores. NaN ranks lowest (and is not positive)."""
    flat = [(math.inf if math.isnan(s) else -float(s), i) for i, (s, m) in
            enumerate(zip(scores.reshape(-1).tolist(), mask.reshape(-1).tolist())) if m]
    k = math.ceil(rho * len(flat) - 1e-9)
    keep = {i for s, i in sorted(flat)[:k] if not nonzero or -s > 0}
    return torch.tensor([i in keep for i in range(mask.numel())]).view_as(mask)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 0.5, 1.0, 0.01])
def test_select_tokens_matches_slow_reference(seed, rho):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (7, 9), generator=g).float()  # many ties, and zeros
    scores[0, seed] = float("nan")
    mask = torch.rand(7, 9, generator=g) > 0.3
    sel = select_tokens(scores, mask, rho)
    assert sel.tolist() == slow_select(scores, mask, rho).tolist()
    assert int(sel.sum()) == math.ceil(rho * int(mask.sum()) - 1e-9)
    assert not (sel & ~mask).any()
    assert select_tokens(scores, mask, rho, nonzero=True).tolist() == slow_select(scores, mask, rho, True).tolist()


def test_select_tokens_edges():
    s = torch.tensor([[3.0, float("nan"), 1.0], [2.0, 5.0, 0.0]])
    m = torch.ones(2, 3, dtype=torch.bool)
    assert select_tokens(s, m, 1.0).all()
    assert not select_tokens(s, torch.zeros_like(m), 0.5).any()  # empty mask
    assert select_tokens(s, m, 0.5).tolist() == [[True, False, False], [True, True, False]]  # NaN ranks last
    assert select_tokens(s, m, 0.2).sum() == 2  # ceil(0.2 * 6) = 2
    assert select_tokens(torch.ones(10), torch.ones(10, dtype=torch.bool), 0.2).sum() == 2  # ceil(0.2 * 10) = 2
    # any rho in (0, 1] keeps at least one valid token: ceil(1e-10 * 5) = 1, the highest score
    assert select_tokens(torch.arange(5.).view(1, -1), torch.ones(1, 5, dtype=torch.bool), 1e-10).tolist() == \
        [[False, False, False, False, True]]
    assert 0.07 * 100 > 7  # floats put this product above 7 ...
    assert select_tokens(torch.arange(100.), torch.ones(100, dtype=torch.bool), 0.07).sum() == 7  # ... k stays 7


def test_select_tokens_beyond_2_pow_24_elements():
    """Above 2^24 elements torch.quantile refuses and an fp32 count of the tied values stalls at 2^24 (and would
    keep every tie). Hand-computed: 2^24 + 5 tokens, index 1 masked out, three 1.0s at the end, zeros elsewhere;
    keeping all valid tokens but one leaves out exactly the LAST valid zero (ties go to earlier positions)."""
    n = 2 ** 24 + 5
    scores = torch.zeros(n)
    scores[-3:] = 1.0
    mask = torch.ones(n, dtype=torch.bool)
    mask[1] = False
    valid = n - 1
    sel = select_tokens(scores, mask, (valid - 1) / valid)
    assert int(sel.sum()) == valid - 1
    assert not sel[1] and not sel[n - 4] and sel[-3:].all() and sel[:1].all() and sel[2:n - 4].all()
    del sel
    assert select_tokens(scores, mask, 0.5, nonzero=True).nonzero().squeeze(1).tolist() == [n - 3, n - 2, n - 1]


def literal_group_select(scores, mask, rho, G, nonzero=False):
    """The authors' per-group rule as gmts-official.md states it, one token at a time: each group of G rows pools
    its valid tokens in (row, position) order, sorts them by score ascending (Python's stable sort; NaN lowest),
    drops the lowest max(1, ceil((1 - rho) * n)) and keeps the rest; nonzero: then only positive scores."""
    keep = torch.zeros(mask.shape, dtype=torch.bool)
    for g in range(mask.shape[0] // G):
        entries = []
        for i in range(g * G, (g + 1) * G):
            for t in range(mask.shape[1]):
                if mask[i, t]:
                    v = float(scores[i, t])
                    entries.append(((0, 0.0) if math.isnan(v) else (1, v), i, t))
        entries.sort(key=lambda e: e[0])
        drop = max(1, math.ceil((1 - Fraction(str(rho))) * len(entries)))
        for (_, v), i, t in entries[drop:]:
            keep[i, t] = not nonzero or v > 0
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rho", [0.2, 0.5, 0.01, 0.99, 1.0])
def test_select_tokens_per_group_matches_the_literal_reference(seed, rho):
    """group_size=G against the literal loop: ties (few distinct scores), zeros (a zero-entropy token or A = 0),
    a group whose scores are all 0 (its advantages all 0: nonzero keeps nothing of it), rows of unequal lengths
    (random masks, one empty row), NaN, rho near 0 and 1 (at rho = 1 a group still drops its lowest token)."""
    g = torch.Generator().manual_seed(seed)
    G, N, T = 4, 16, 7
    scores = torch.randint(0, 4, (N, T), generator=g).float()
    scores[G:2 * G] = 0.0  # the all-zero group
    scores[0, seed] = float("nan")
    mask = torch.rand(N, T, generator=g) > 0.3
    mask[3] = False
    for nonzero in (False, True):
        sel = select_tokens(scores, mask, rho, nonzero=nonzero, group_size=G)
        assert sel.tolist() == literal_group_select(scores, mask, rho, G, nonzero).tolist(), nonzero
        assert not (sel & ~mask).any()
    sel = select_tokens(scores, mask, rho, nonzero=True, group_size=G)
    assert not sel[G:2 * G].any()
    budget = [gmts.kept_count([int(mask[i:i + G].sum())], rho, "drop")[0] for i in range(0, N, G)]
    assert gmts.scope_budget(mask, rho, G)[1].tolist() == budget
    assert [int(x) for x in select_tokens(scores, mask, rho, group_size=G).view(-1, G * T).sum(1)] == budget
    # the same rule through the labels gmts_trl passes: rows in any order, each row labelled by its group
    distinct = torch.rand(N, T, generator=g)  # no ties, so the rows' order cannot matter
    perm = torch.randperm(N, generator=g)  # row k of the shuffled batch is row perm[k]
    labels = (perm // G)[:, None].expand(N, T)
    by_label = select_tokens(distinct[perm], mask[perm], rho, groups=labels)
    assert torch.equal(by_label, select_tokens(distinct, mask, rho, group_size=G)[perm])


def test_group_budget_and_scope_hand_computed():
    """One group of 10 tokens, scores 0..9: rho 0.2 drops ceil(0.8 * 10) = 8 and keeps 8, 9; rho 0.25 drops
    ceil(7.5) = 8 too (the batch scope keeps ceil(2.5) = 3); rho 1 drops one. Ties: of equal scores the later is
    kept (the batch scope keeps the earlier). A scope that ranks over the whole batch keeps the highest scores
    of the high-scoring group only; per group, each group keeps its own top."""
    s = torch.arange(10.).view(2, 5)
    m = torch.ones(2, 5, dtype=torch.bool)
    assert select_tokens(s, m, 0.2, group_size=2).view(-1).nonzero().view(-1).tolist() == [8, 9]
    assert int(select_tokens(s, m, 0.25, group_size=2).sum()) == 2 and int(select_tokens(s, m, 0.25).sum()) == 3
    assert int(select_tokens(s, m, 1.0, group_size=2).sum()) == 9 and not select_tokens(s, m, 1.0, group_size=2)[0, 0]
    tie = torch.ones(1, 10)
    one = torch.ones(1, 10, dtype=torch.bool)
    assert select_tokens(tie, one, 0.2, group_size=1).view(-1).nonzero().view(-1).tolist() == [8, 9]
    assert select_tokens(tie, one, 0.2).view(-1).nonzero().view(-1).tolist() == [0, 1]
    two = torch.cat([torch.arange(10.).view(2, 5), torch.arange(10.).view(2, 5) + 100])  # group 1 scores higher
    mm = torch.ones(4, 5, dtype=torch.bool)
    per_group = select_tokens(two, mm, 0.2, group_size=2)
    assert per_group[:2].sum() == 2 and per_group[2:].sum() == 2
    assert select_tokens(two, mm, 0.2)[:2].sum() == 0  # the batch scope spends it all on group 1
    with pytest.raises(ValueError, match="not groups of 3"):
        select_tokens(two, mm, 0.2, group_size=3)


def test_scope_flag_and_each_methods_default():
    """--scope auto: group for gmts (its authors), batch for entropy (their ETS baseline), random and gradnorm;
    'all' keeps everything over the batch; --scope overrides either way; --loss-norm seq exists."""
    rule = {}
    for m in list(gmts.METHODS):
        rule[m] = gmts.selection_rule(gmts.parse_args(["--select", m, "--group-size", "6"]))
    assert rule == {"all": (1.0, 0), "random": (0.2, 0), "entropy": (0.2, 0), "gmts": (0.2, 6), "gradnorm": (0.2, 0),
                    "rsi": (1.0, 0)}  # an interval: no budget
    assert gmts.selection_rule(gmts.parse_args(["--scope", "batch"])) == (0.2, 0)
    assert gmts.selection_rule(gmts.parse_args(["--select", "entropy", "--scope", "group"])) == (0.2, 8)
    assert gmts.selection_rule(gmts.parse_args(["--select", "all", "--scope", "group"])) == (1.0, 0)
    assert gmts.parse_args(["--loss-norm", "seq"]).loss_norm == "seq" and gmts.Config().scope == "auto"


def test_scores_definitions():
    H = torch.tensor([[0.5, 2.0], [1.0, 0.1]])
    G = torch.tensor([[0.3, 0.9], [0.6, 0.2]])
    om = omega(torch.tensor([-2.0, 0.5]), torch.ones(2, 2), 0.2, 0.28)
    assert token_scores("entropy", H, G, om).tolist() == H.tolist()
    assert torch.allclose(token_scores("gmts", H, G, om), torch.tensor([[1.0, 4.0], [0.5, 0.05]]))
    assert torch.allclose(token_scores("gradnorm", H, G, om), torch.tensor([[0.6, 1.8], [0.3, 0.1]]))
    assert token_scores("all", H, G, om).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    r = token_scores("random", H, G, om, generator=torch.Generator().manual_seed(0))
    assert r.shape == H.shape and torch.equal(r, token_scores("random", H, G, om, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="choose one of"):
        token_scores("nope", H, G, om)


def _constructed_batch():
    """3 groups of 2 answers x 4 tokens: group 0 all-equal rewards (A = 0) with the HIGHEST entropies."""
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0]), 2)  # (6,)
    H = torch.tensor([[3.0, 2.9, 2.8, 2.7], [2.6, 2.5, 2.4, 2.3]] + [[1.0, 0.5, 0.2, 0.1]] * 4)  # (6, 4)
    mask = torch.ones(6, 4, dtype=torch.bool)
    return adv, H, mask


def test_gmts_spends_nothing_on_zero_advantage_groups():
    adv, H, mask = _constructed_batch()
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    zero = (adv == 0)[:, None] & mask
    ent = select_tokens(token_scores("entropy", H, H, om), mask, 0.25)
    g_scores = token_scores("gmts", H, H, om)
    g = gmts.select_tokens(g_scores, mask, 0.25, nonzero=True)
    assert (ent & zero).sum() == 6  # entropy spends all 6 of its tokens on the A = 0 group
    assert (g & zero).sum() == 0 and g.sum() == 6
    g_big = gmts.select_tokens(g_scores, mask, 0.9, nonzero=True)  # budget 22 > the 16 live tokens: keeps just those
    assert g_big.sum() == 16 and (g_big & zero).sum() == 0
    assert gmts.select_tokens(g_scores, mask, 1.0).all()
    assert gmts.select_tokens(H, mask, 0.9).sum() == 22
    # (c) no token with A != 0 left out while one with A = 0 is kept, whatever the entropies
    for seed in range(20):
        Hr = torch.rand(6, 4, generator=torch.Generator().manual_seed(seed)) + 0.01
        s = token_scores("gmts", Hr, Hr, om)
        sel = select_tokens(s, mask, 0.5)
        assert not ((sel & zero).any() and (~sel & ~zero).any())


def test_gmts_and_gradnorm_keep_no_token_of_an_all_equal_group():
    """Step 6 as train() runs it (step_selection) on three G = 8 groups: countdown-like rewards (one answer right at
    1.0, seven tagged but wrong at 0.1), then all 0.1 and all 0.7: inexact floats whose unmasked advantage would be
    ~0.007-0.06, not 0. The all-equal groups have the HIGHEST entropies. gmts and gradnorm keep none of their
    tokens, even with a budget beyond the 40 live tokens (then they keep exactly those 40); entropy spends its
    whole budget on them."""
    G, T = 8, 5
    adv = group_advantages(torch.tensor([1.0] + [0.1] * 7 + [0.1] * 8 + [0.7] * 8), G)  # (24,)
    g = torch.Generator().manual_seed(0)
    H = torch.rand(24, T, generator=g) + 0.5
    H[G:] += 2.0  # the all-equal groups: the highest entropies
    gn = torch.rand(24, T, generator=g) + 0.1
    mask = torch.ones(24, T, dtype=torch.bool)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    dead = (torch.arange(24) >= G)[:, None] & mask
    for method, scope in (("gmts", "batch"), ("gradnorm", "auto"), ("gmts", "auto"), ("gradnorm", "group")):
        for rho in (0.2, 0.5, 0.9):
            sel = gmts.step_selection(gmts.Config(select=method, rho=rho, scope=scope), None, H, gn, om, mask)
            assert not (sel & dead).any(), (method, rho)
            want = min(math.ceil(rho * 120), 40)  # over the batch: the budget moves to the live group
            if gmts.selection_rule(gmts.Config(select=method, scope=scope))[1]:  # per group: each keeps its own
                want = 40 - math.ceil((1 - Fraction(str(rho))) * 40)
            assert int(sel.sum()) == want, (method, scope, rho)
    ent = gmts.step_selection(gmts.Config(select="entropy", rho=0.2), None, H, gn, om, mask)
    assert int((ent & dead).sum()) == int(ent.sum()) == 24


def test_gmts_orders_like_entropy_within_an_answer(tiny):
    """On a real batch (gmts's rollout, batch_token_stats, omega at the first update, token_scores, select_tokens):
    within one answer omega is constant, so gmts orders and keeps that answer's tokens exactly as entropy does,
    for positive AND negative advantages."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=2)
    assert (adv > 0).any() and (adv < 0).any()
    logp, H, gn = gmts.batch_token_stats(model, b, 1.0, 4, 64)
    g = token_scores("gmts", H, gn, omega(adv, torch.exp(logp - logp), 0.2, 0.28))
    m = b["resp_mask"]
    for i in range(len(adv)):
        assert torch.equal(g[i][m[i]].argsort(stable=True), H[i][m[i]].argsort(stable=True)), i
        for rho in (0.1, 0.3, 0.6):
            assert torch.equal(select_tokens(g[i:i + 1], m[i:i + 1], rho, nonzero=True),
                               select_tokens(H[i:i + 1], m[i:i + 1], rho))


# ---- loss and update -------------------------------------------------------------------------------------------------


def test_k3_kl():
    a = torch.randn(100)
    assert (gmts.k3_kl(a, a) == 0).all()
    assert (gmts.k3_kl(a, a + torch.randn(100)) >= 0).all()
    # E_{y ~ pi}[k3] = KL(pi || ref), exactly, on small categoricals (d**2, |d| or the reversed KL all fail this)
    g = torch.Generator().manual_seed(0)
    for V in (2, 5, 30):
        pi = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, 0)
        ref = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, 0)
        expected_k3 = (pi * gmts.k3_kl(pi.log(), ref.log())).sum()
        assert expected_k3.item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-12, abs=1e-15)


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def _plain_logp(model, b, T):
    """log p of every response token from one plain forward: full logits, full log_softmax. (N, T)."""
    ids = torch.cat([b["prompt_ids"], b["comp_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["resp_mask"]], 1).long()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    P = b["prompt_ids"].shape[1]
    return torch.log_softmax(logits[:, P - 1:-1].float() / T, -1).gather(-1, b["comp_ids"][..., None]).squeeze(-1)


def _objective(valid, denom, T=1.0, beta=0.0):
    """The loss's settings: clip 0.2 / 0.28, w = 1, the policy term divided by denom, KL's by the
    valid count."""
    n_valid = float(max(int(valid.sum()), 1))
    return gmts.Objective(0.2, 0.28, beta, T, torch.ones(valid.shape), denom, n_valid)


@pytest.mark.parametrize("loss_norm", ["all", "selected"])
def test_update_equals_full_reinforce_gradient(tiny, loss_norm):
    """policy_update (hidden-state gather, chunked head, micro-batches, ratio = 1) gives exactly the gradient of
    -sum_{selected} A * logp / denom computed the plain way: full logits, full log_softmax."""
    model, tok = tiny
    model.train()
    b, adv = _batch_from(model, tok)
    T = 0.9
    logp, H, gn = gmts.batch_token_stats(model, b, T, micro_batch=5, chunk=7)
    sel = select_tokens(token_scores("gmts", H, gn, omega(adv, torch.ones_like(H), .2, .28)), b["resp_mask"], 0.3)
    denom = float(b["resp_mask"].sum()) if loss_norm == "all" else float(sel.sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # step() is a no-op: the gradients stay for inspection
    objective = _objective(b["resp_mask"], denom, T)
    stats = gmts.policy_update(model, opt, b, adv, sel, logp, objective, micro_batch=2, chunk=3,
                               max_grad_norm=1e9)
    assert stats["stepped"] == 1 and stats["live"] == int(sel.sum())
    opt.zero_grad()
    # policy_update clears .grad after its step: loss_backward leaves it for us
    gmts.loss_backward(model, b, adv, sel, logp, objective, micro_batch=2, chunk=3)
    g_ours = _grads(model)
    model.zero_grad()
    (-(adv[:, None] * _plain_logp(model, b, T) * sel).sum() / denom).backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0
    assert torch.allclose(g_ours, g_ref, atol=1e-5), (g_ours - g_ref).abs().max()
    assert stats["grad_norm"] == pytest.approx(float(g_ref.norm()), rel=1e-4)
    model.zero_grad()
    model.eval()


@pytest.mark.parametrize("loss_norm", ["all", "selected", "seq", "seq-sum"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_omega_is_minus_the_gradient_of_the_loss(tiny, loss_norm, beta):
    """omega_t = -dL/dlogp_t of the objective policy_update minimises (derivation step 1), for every --loss-norm,
    with KL off and on, on tokens whose clip is active and inactive (ratios 0.5-1.6, both signs of A):
    (a) against autograd of micro_batch_loss over the batch's needed tokens (kept: the whole omega; dropped: the
    KL part alone); (b) the parameter gradient loss_backward accumulates equals -sum_t omega_t dlogp_t/dtheta,
    computed through a plain forward. A mutant that drops w, the normaliser or the KL weight fails (a)."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=5)
    ref_model, _ = gmts.build_tiny(hidden=32, layers=2, seed=3)
    T, m = 1.0, b["resp_mask"]
    g = torch.Generator().manual_seed(1)
    logp = gmts.batch_token_stats(model, b, T, 4, 64)[0]
    old = (logp + (torch.rand(m.shape, generator=g) - 0.5)).masked_fill(~m, 0.0)  # ratios e^-0.5 .. e^0.5
    ref = gmts.batch_token_stats(ref_model, b, T, 4, 64)[0]
    sel = select_tokens(torch.rand(m.shape, generator=g), m, 0.4, group_size=4)
    norm = gmts.loss_weights(loss_norm, m, int(gmts.scope_budget(m, 0.4, 4)[1].sum()), 4)
    objective = gmts.Objective(0.2, 0.28, beta, T, **norm)
    ratio = torch.exp(logp - old)
    dead = gmts.clip_active(adv[:, None], ratio, 0.2, 0.28) & m
    assert dead.any() and (sel & m & ~dead & (adv != 0)[:, None]).any()
    om = omega(adv, ratio, 0.2, 0.28, beta, torch.exp(ref - logp), **norm)
    need = sel | m if beta else sel
    x = logp[need].clone().requires_grad_()
    loss, _ = gmts.micro_batch_loss(x, old[need], adv[:, None].expand_as(m)[need], sel[need], ref[need],
                                    norm["w"][need], objective)
    grad, = torch.autograd.grad(loss, x)
    kept = sel[need]
    assert torch.allclose(-grad[kept], om[need][kept], atol=1e-7, rtol=1e-5)
    kl_part = om - omega(adv, ratio, 0.2, 0.28, **norm)  # the KL term's weight: on dropped tokens too
    assert torch.allclose(-grad[~kept], kl_part[need][~kept], atol=1e-7, rtol=1e-5)
    assert (kl_part[need][~kept] != 0).any() == (beta > 0)
    model.zero_grad()
    gmts.loss_backward(model, b, adv, sel, old, objective, micro_batch=5, chunk=7, ref_logp=ref)
    g_ours = _grads(model)
    model.zero_grad()
    lp = _plain_logp(model, b, T)
    om_plain = omega(adv, torch.exp(lp.detach() - old), 0.2, 0.28, beta, torch.exp(ref - lp.detach()), **norm)
    weight = torch.where(sel, om_plain, om_plain - omega(adv, torch.exp(lp.detach() - old), 0.2, 0.28, **norm))
    (-(weight * lp * need).sum()).backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0 and torch.allclose(g_ours, g_ref, atol=1e-6), (g_ours - g_ref).abs().max()
    model.zero_grad()


def test_live_counts_a_token_once_under_kl():
    """Hand-computed step-rule count on four tokens, on-policy (r = 1): token 0 kept with A = 1 and
    its log-prob off the reference's; token 1 kept with A = 0, at the reference; token 2 dropped,
    off the reference; token 3 dropped, at it. Live (a gradient): 0 (both terms) and 2 (KL only):
    2 tokens, token 0 counted once, not twice (an earlier version said 3)."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([1.0, 0.0, 1.0, 1.0])
    kept = torch.tensor([True, True, False, False])
    ref = logp + torch.tensor([0.1, 0.0, -0.2, 0.0])
    objective = gmts.Objective(0.2, 0.28, 0.1, 1.0, torch.ones(1, 4), 4.0, 4.0)
    _, counts = gmts.micro_batch_loss(logp, logp, adv, kept, ref, torch.ones(4), objective)
    assert counts["live"] == 2
    no_kl = gmts.Objective(0.2, 0.28, 0.0, 1.0, torch.ones(1, 4), 4.0, 4.0)
    assert gmts.micro_batch_loss(logp, logp, adv, kept, ref, torch.ones(4), no_kl)[1]["live"] == 1


def test_one_budget_feeds_the_mask_and_the_selected_normaliser(tmp_path, monkeypatch, parity):
    """A new budget rule given to the one function (kept_count: here n // 3 of each scope's n valid
    tokens) changes both what train's mask keeps and --loss-norm selected's divisor, in the group
    and the batch scope: they agree with the rule, and differ from the default rule's count."""
    real_count, real_update = gmts.kept_count, gmts.policy_update
    monkeypatch.setattr(gmts, "kept_count", lambda counts, rho, rule: [n // 3 for n in counts])
    seen = []

    def update(model, opt, batch, adv, sel_mask, old_logp, objective, **k):
        seen.append((sel_mask.clone(), objective.denom, k["valid"].clone()))
        return real_update(model, opt, batch, adv, sel_mask, old_logp, objective, **k)
    monkeypatch.setattr(gmts, "policy_update", update)
    for scope, G in (("group", 4), ("batch", 0)):
        seen.clear()
        train_main(*SMALL, "--steps", "1", "--select", "entropy", "--scope", scope,
                   "--loss-norm", "selected", "--out", tmp_path / scope)
        ((sel, denom, valid),) = seen
        per_scope = [int(valid.sum())]
        if G:
            per_scope = [int(valid[i:i + G].sum()) for i in range(0, len(valid), G)]
        want = sum(n // 3 for n in per_scope)
        assert int(sel.sum()) == denom == want
        assert want != sum(real_count(per_scope, 0.2, "drop" if G else "ceil"))


def test_a_users_method_row_sets_its_score_zero_rule_and_scope(tmp_path, monkeypatch, parity):
    """A method is one row: a Method (score, zero_kept, scope) added to METHODS is a --select method
    for token_scores and step_selection, and train(score_fn=Method(...)) trains a user's score with
    the row's properties. The score here is the entropy with every even position set to 0:
    zero_kept=False keeps none of those, and scope "group" ranks within each prompt's G answers by
    the authors' rule (select_tokens with group_size G, nonzero), where the default row (a bare
    function: zeros kept, --select gmts's group scope) and a batch row keep other tokens."""
    def score(logp, entropy, dz_norm, om, generator=None):
        s = entropy.clone()
        s[:, ::2] = 0.0
        return s
    row = gmts.Method(score, zero_kept=False, scope="group")
    monkeypatch.setitem(gmts.METHODS, "mine", row)
    H = torch.rand(8, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    mask = torch.ones(8, 6, dtype=torch.bool)
    assert torch.equal(gmts.token_scores("mine", H, H, H), score(None, H, H, H))
    # each group of 24 tokens keeps 18 by the budget, 12 of them non-zero
    cfg = gmts.Config(select="mine", group_size=4, rho=0.75)
    sel = gmts.step_selection(cfg, None, H, H, H, mask)
    want = select_tokens(score(None, H, H, H), mask, 0.75, nonzero=True, group_size=4)
    assert torch.equal(sel, want)
    assert not sel[:, ::2].any() and [int(sel[:4].sum()), int(sel[4:].sum())] == [12, 12]
    real_select = gmts.step_selection
    seen = []

    def spy(cfg, logp, entropy, dz_norm, om, mask, score_fn=None):
        sel = real_select(cfg, logp, entropy, dz_norm, om, mask, score_fn)
        seen.append((entropy, mask, sel))
        return sel
    monkeypatch.setattr(gmts, "step_selection", spy)
    kept = {}
    batch_row = gmts.Method(score, zero_kept=False, scope="batch")
    runs = {"mine": (row, 0.8), "bare": (score, 0.8), "mine@0.2": (row, 0.2),
            "batch": (batch_row, 0.2)}
    for name, (fn, rho) in runs.items():
        seen.clear()
        argv = [*map(str, SMALL), "--steps", "1", "--rho", str(rho), "--out", str(tmp_path / name)]
        gmts.train(gmts.parse_args(argv), log=lambda *a: None, score_fn=fn)
        ((entropy, mask, sel),) = seen
        s = score(None, entropy, None, None)
        nonzero, G = name != "bare", 4 if name != "batch" else 0
        assert torch.equal(sel, select_tokens(s, mask, rho, nonzero=nonzero, group_size=G)), name
        kept[name] = sel
    assert not kept["mine"][:, ::2].any() and kept["bare"][:, ::2].any()
    assert not torch.equal(kept["mine@0.2"], kept["batch"])


def test_loss_weights_hand_computed():
    """seq: w = 1 / |o_i| and both divisors N (GRPO's per-answer mean, averaged over the answers); all: the valid
    count; selected: the kept count for the policy term, the valid count for KL. A row with no valid token
    (--overlong-filter) gets a finite weight and counts in N."""
    valid = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    seq = gmts.loss_weights("seq", valid, 2)
    assert gmts.loss_weights("seq-sum", valid, 2, 2)["denom"] == 2.0  # (1/G) per group, summed
    assert seq["w"][:, 0].tolist() == pytest.approx([1 / 3, 1.0, 1.0], rel=1e-7)
    assert seq["denom"] == seq["kl_denom"] == 3.0
    assert (gmts.loss_weights("all", valid, 2)["denom"], gmts.loss_weights("all", valid, 2)["kl_denom"]) == (4., 4.)
    sel = gmts.loss_weights("selected", valid, 2)
    assert (sel["denom"], sel["kl_denom"]) == (2.0, 4.0) and sel["w"].eq(1).all()


def test_kl_gradient_matches_autograd_and_ignores_the_selection(tiny):
    """With kl_beta > 0 the loss is sum_kept l / denom + beta * sum_valid k3 / n_valid: the KL term's normaliser is
    the valid-token count whatever rho or --loss-norm, so its gradient is the same at rho 0.2 and 1.0."""
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=11)
    ref_model, _ = gmts.build_tiny(hidden=32, layers=2, seed=1)  # another model as pi_ref
    T, beta, m = 1.0, 0.1, b["resp_mask"]
    logp = gmts.batch_token_stats(model, b, T, 4, 64)[0]
    ref_logp = gmts.batch_token_stats(ref_model, b, T, 4, 64)[0]
    scores = torch.rand(m.shape, generator=torch.Generator().manual_seed(0))
    kw = dict(micro_batch=3, chunk=5, ref_logp=ref_logp)
    kl_only = []  # the KL term's gradient (A = 0) at each rho
    for rho in (0.2, 1.0):
        sel = select_tokens(scores, m, rho)
        denom = float(sel.sum())  # --loss-norm selected: the case whose KL used to scale by 1 / rho
        for a in (torch.zeros_like(adv), adv):
            model.zero_grad()
            stats = gmts.loss_backward(model, b, a, sel, logp, _objective(m, denom, T, beta), **kw)
            g_ours = _grads(model)
            model.zero_grad()
            lp = _plain_logp(model, b, T)
            k3 = gmts.k3_kl(lp, ref_logp) * m
            (-(a[:, None] * lp * sel).sum() / denom + beta * k3.sum() / m.sum()).backward()
            g_ref = _grads(model)
            assert torch.allclose(g_ours, g_ref, atol=1e-6), (rho, (g_ours - g_ref).abs().max())
            assert stats["kl"] == pytest.approx(float(k3.detach().sum() / m.sum()), rel=1e-5) and stats["kl"] > 0
            if not a.any():
                kl_only.append(g_ours)
    assert kl_only[0].abs().max() > 0 and torch.allclose(kl_only[0], kl_only[1], atol=1e-7)
    model.zero_grad()


def test_loss_clips_each_side_at_its_own_bound():
    """eps_l = 0.1 != eps_h = 0.3, ratios between the bounds, both signs of A (old_logp = 0, so r = exp(logp)).
    Hand-computed l = -min(r A, clip(r, 0.9, 1.3) A) and dl/dlogp (-A r where the clip is inactive, else 0):
      A = +1: r 1.2 -> -1.2, grad -1.2 (inside 1 + eps_h); r 1.35 -> -1.3, 0 (clipped at 1.3)
      A = -1: r 0.95 -> 0.95, grad 0.95; r 0.85 -> 0.9, 0 (clipped at 1 - eps_l); r 0.75 -> 0.9, 0;
              r 1.25 -> 1.25, grad 1.25 (A < 0 is never clipped above)
    Using eps_l for both bounds gives -1.1 at r 1.2; using eps_h below gives 0.85 and 0.75."""
    r = torch.tensor([1.2, 1.35, 0.95, 0.85, 0.75, 1.25], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    logp = r.log().requires_grad_(True)
    loss, active = gmts.grpo_token_loss(logp, torch.zeros_like(r), adv, 0.1, 0.3)
    assert loss.tolist() == pytest.approx([-1.2, -1.3, 0.95, 0.9, 0.9, 1.25], abs=1e-12)
    assert active.tolist() == [False, True, False, True, True, False]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.2, 0.0, 0.95, 0.0, 0.0, 1.25], abs=1e-12)


def test_kl_reference_on_the_loss_path_gives_equal_bits(tiny):
    """response_logp runs the loss's own code path: a reference whose weights equal the policy's gives the loss's
    log-probs bit for bit, so with A = 0 the KL is exactly 0, no token is live and nothing steps (the old path, via
    batch_token_stats, differed by float noise and stepped on it). A reference that differs makes every token live."""
    import copy
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=5)
    m, adv = b["resp_mask"], torch.zeros(b["comp_ids"].shape[0])
    same = copy.deepcopy(model)
    ref_logp = gmts.response_logp(same, b, m, 1.0, 3, 5)
    logp = gmts.batch_token_stats(model, b, 1.0, 3, 5)[0]
    kw = dict(micro_batch=3, chunk=5, max_grad_norm=1.0)
    objective = _objective(m, float(m.sum()), beta=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    stats = gmts.policy_update(model, opt, b, adv, m, logp, objective, ref_logp=ref_logp, **kw)
    assert stats["kl"] == 0.0 and stats["live"] == 0 and stats["stepped"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state
    other = gmts.response_logp(gmts.build_tiny(hidden=32, layers=2, seed=1)[0], b, m, 1.0, 3, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a no-op step: only the step rule is looked at
    stats = gmts.policy_update(model, opt, b, adv, m, logp, objective, ref_logp=other, **kw)
    assert stats["kl"] > 0 and stats["live"] == int(m.sum()) and stats["stepped"] == 1


def test_unselected_tokens_get_zero_logit_gradient():
    torch.manual_seed(0)
    z = torch.randn(3, 5, 13, requires_grad=True)
    y = torch.randint(0, 13, (3, 5))
    sel = torch.rand(3, 5) > 0.5
    logp, _, _ = token_stats(z, y)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 5)
    loss, _ = gmts.grpo_token_loss(logp, logp.detach(), adv, 0.2, 0.28)
    (loss * sel).sum().backward()
    assert (z.grad[~sel] == 0).all() and (z.grad[sel].abs().sum(-1) > 0).all()


def test_nonfinite_gradient_skips_the_step(tiny):
    model, tok = tiny
    b, adv = _batch_from(model, tok, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bad_old = torch.full(b["resp_mask"].shape, float("nan"))  # NaN ratios -> NaN loss and gradients
    objective = _objective(b["resp_mask"], 10.0)
    stats = gmts.policy_update(model, opt, b, adv, b["resp_mask"], bad_old, objective,
                               micro_batch=4, chunk=64, max_grad_norm=1.0)
    assert stats["skipped"] == 1 and stats["stepped"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # Adam moments untouched too


def test_all_zero_advantage_batch_makes_no_update(tiny):
    """The step rule: no kept token with a live gradient, no optimiser step, for every method (even 'all', which
    keeps every token: a zero gradient would still move AdamW's moments and, with weight decay, the weights)."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=7)
    adv = torch.zeros(b["comp_ids"].shape[0])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    H = torch.rand(b["resp_mask"].shape)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    assert not gmts.select_tokens(token_scores("gmts", H, H, om), b["resp_mask"], 0.2, nonzero=True).any()
    for sel in (gmts.select_tokens(token_scores("gmts", H, H, om), b["resp_mask"], 0.2, nonzero=True),
                b["resp_mask"]):  # gmts keeps nothing; 'all' keeps every token, all with A = 0
        objective = _objective(b["resp_mask"], 10.0)
        stats = gmts.policy_update(model, opt, b, adv, sel, torch.zeros_like(H), objective,
                                   micro_batch=4, chunk=64, max_grad_norm=1.0)
        assert stats["stepped"] == 0 and stats["skipped"] == 0 and stats["live"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state


def test_a_batch_of_only_all_equal_groups_does_not_step(tiny):
    """The step rule on a real batch of two G = 8 groups whose rewards are all 0.1 and all 0.7 (inexact floats: the
    unmasked advantage would be ~0.007 and ~0.06). A is exactly 0, so for every method (train's step_selection) no
    kept token is live, policy_update does not step, and neither the weights nor AdamW's moments move (weight decay
    on: a step on a zero gradient would still move them)."""
    model, tok = tiny
    b, _ = _batch_from(model, tok, seed=7, n_prompts=2, G=8)
    adv = group_advantages(torch.tensor([0.1] * 8 + [0.7] * 8), 8)
    m = b["resp_mask"]
    logp, H, gn = gmts.batch_token_stats(model, b, 1.0, 4, 64)
    om = omega(adv, torch.ones_like(H), 0.2, 0.28)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for method in list(gmts.METHODS):
        sel = gmts.step_selection(gmts.Config(select=method), logp, H, gn, om, m)
        assert sel.any() == (method in ("all", "random", "entropy", "rsi")), method
        objective = _objective(m, float(m.sum()))
        stats = gmts.policy_update(model, opt, b, adv, sel, logp, objective, micro_batch=4,
                                   chunk=64, max_grad_norm=1.0)
        assert stats["stepped"] == 0 and stats["live"] == 0 and stats["grad_norm"] == 0.0, (method, stats)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state


# ---- training loop: the lr schedule, then runs in this process through gmts.main -------------------------------------


def test_lr_schedule_hand_computed():
    f = [gmts.lr_factor(i, total=6, warmup=2) for i in range(6)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])  # up over 2 steps, then (6 - i) / 4
    assert [gmts.lr_factor(i, 6, 2, decay=False) for i in range(6)] == [0.5] + [1.0] * 5
    assert gmts.lr_factor(0, 1, 10) == 0.1 and gmts.lr_factor(99, 100, 0) == pytest.approx(0.01)


def test_step_lr_counts_update_slots():
    """--warmup-steps and the decay count update slots, steps x --inner-updates (the flag's help): with 3 steps of 2
    inner updates, warm-up 2, the six slots get lr_factor's 0.5, 1, 1, 0.75, 0.5, 0.25, in order."""
    cfg = gmts.Config(lr=2.0, steps=3, inner_updates=2, warmup_steps=2)
    got = [gmts.step_lr(cfg, step, inner) for step in (1, 2, 3) for inner in (0, 1)]
    assert got == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5])


SMALL = ["--model", "tiny", "--task", "countdown", "--data", "easy", "--short-prompt", "--prompts-per-step", "2",
         "--group-size", "4", "--max-new-tokens", "16", "--eval-size", "2", "--max-resample", "2",
         "--eval-every", "0", "--save-every", "0"]
VOLATILE = ("step_time_s", "tokens_per_s", "rollout_time_s", "grade_time_s")
STEP_KEYS = ("step", "reward_mean", "acc", "selected_frac", "entropy_mean", "entropy_selected_mean",
             "zero_adv_selected_frac", "grad_norm", "loss", "clip_frac", "kl", "completion_len", "truncated_frac", "lr",
             "skipped_steps", "groups_filtered_frac", "rollout_batches", "rollout_time_s", "step_time_s",
             "tokens_per_s", "grade_time_s", "grade_timeouts")


def parity_reward(text, row):
    """A reward that splits almost every group of the random tiny model: the parity of the answer's characters.
    (The SIGKILL driver below spells out the same rule.)"""
    return float(sum(map(ord, text)) % 2)


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)


@pytest.fixture
def one_thread():
    """Runs compared bit for bit with a subprocess (OMP_NUM_THREADS=1) must use one thread here too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_main(*argv):
    """A run through gmts.main in this process; returns the metrics (the volatile timings dropped)."""
    argv = [str(a) for a in argv]
    gmts.main(argv)
    out = argv[argv.index("--resume") + 1] if "--resume" in argv else argv[len(argv) - argv[::-1].index("--out")]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in gmts.read_metrics(out)]


def _metrics(path):
    lines = path.read_text().splitlines()
    recs = [json.loads(x) for x in lines]  # a torn line would raise here
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in recs]


def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_method_honours_select_and_loss_norm(tmp_path, monkeypatch):
    """Each --select method, 2 steps, no dynamic sampling, on batches of one live group (parity reward) and one dead
    group (reward 0: A = 0). 'all' keeps every token; random/entropy keep ceil(rho * n) and spend some on the dead
    group; gmts/gradnorm never keep an A = 0 token. --loss-norm selected divides the same step-1 loss (and gradient)
    by the kept count instead of the valid count: n_valid / n_kept times larger."""
    from transformers import AutoModelForCausalLM

    real_read = gmts.read_data

    def read(cfg):  # every step: the first prompt live, the second dead
        data = real_read(cfg)
        draw = data.draw
        data.draw = lambda n, *key: [dict(r, live=i % 2 == 0) for i, r in enumerate(draw(n, *key))]
        return data
    monkeypatch.setattr(gmts, "read_data", read)
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: parity_reward(t, row) if row.get("live")
                        else 0.0)
    base = [*SMALL, "--group-size", "8", "--steps", "2", "--no-filter-groups"]
    runs = {m: train_main(*base, "--select", m, "--out", tmp_path / m)
            for m in ("all", "random", "entropy", "gmts", "gradnorm")}
    for method, recs in runs.items():
        steps = recs[1:]
        assert [r["step"] for r in recs] == [0, 1, 2] and "eval_acc" in recs[0] and "eval_acc" in steps[-1]
        for r in steps:
            assert set(STEP_KEYS) - set(VOLATILE) <= set(r), set(STEP_KEYS) - set(r)
            assert r["groups_filtered_frac"] == 0.5 and r["rollout_batches"] == 1  # the setup: one dead group
            n_valid = round(r["completion_len"] * 16)
            n_kept = round(r["selected_frac"] * n_valid)
            budget = math.ceil(0.2 * n_valid - 1e-9)
            if method == "all":
                assert r["selected_frac"] == 1.0 and r["zero_adv_selected_frac"] > 0
            elif method in ("random", "entropy"):
                assert n_kept == budget and r["zero_adv_selected_frac"] > 0, (method, r)
            else:
                assert r["zero_adv_selected_frac"] == 0.0 and 0 < n_kept <= budget, (method, r)
        assert AutoModelForCausalLM.from_pretrained(tmp_path / method).config.model_type == "qwen2"
    batch = [*base, "--select", "gmts", "--scope", "batch", "--rho", "0.9"]  # a budget beyond the live group
    sel = train_main(*batch, "--loss-norm", "selected", "--out", tmp_path / "gmts-selected")[1]
    ref = train_main(*batch, "--out", tmp_path / "gmts-batch")[1]  # the same step 1: same model, batch, kept tokens
    assert sel["selected_frac"] == ref["selected_frac"] < 1 and ref["loss"] != 0
    n_valid = round(ref["completion_len"] * 16)
    budget = math.ceil(0.9 * n_valid - 1e-9)  # what selected divides by: the budget, zero scores included
    assert round(ref["selected_frac"] * n_valid) < budget  # gmts dropped the dead group's zero scores
    assert sel["loss"] == pytest.approx(ref["loss"] * n_valid / budget, rel=1e-4)
    assert sel["grad_norm"] == pytest.approx(ref["grad_norm"] * n_valid / budget, rel=1e-4)


def test_constant_reward_every_method_ends_identical_and_unchanged(tmp_path, monkeypatch):
    """The one step rule (deviation 6): with a constant reward (every advantage 0) no method steps its optimiser, so all
    five end with the starting weights, the same (empty) Adam state and the same lr, which follows GRPO steps.
    Weight decay is on: an optimiser step on a zero gradient would still move the weights. The reward is 0.1 at
    G = 8 (every answer tagged but wrong): an inexact float whose unmasked group advantage would be ~0.007."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: 0.1)
    ends = {}
    for m in ("all", "random", "entropy", "gmts", "gradnorm"):
        out = tmp_path / m
        recs = train_main(*SMALL, "--group-size", "8", "--prompts-per-step", "1", "--steps", "2", "--select", m,
                          "--weight-decay", "0.1", "--lr", "1e-3", "--out", out)
        steps = recs[1:]
        assert [r["lr"] for r in steps] == pytest.approx([1e-4, 2e-4])  # warm-up 10: lr * 1/10, 2/10
        assert all(r["groups_filtered_frac"] == 1.0 and r["rollout_batches"] == 2 for r in steps)  # resampled to cap
        assert all(r["grad_norm"] == 0 and r["loss"] == 0 for r in steps)
        for r in steps:  # 'all' keeps everything, random/entropy rho of it, gmts/gradnorm nothing (all scores 0)
            want = {"all": 1.0, "gmts": 0.0, "gradnorm": 0.0}.get(m)
            assert r["selected_frac"] == want if want is not None else 0 < r["selected_frac"] < 0.5, (m, r)
        assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000000", "ckpt-000002"]
        assert _same_weights(out, out / "ckpt-000000")  # unchanged from the start
        state = torch.load(out / "ckpt-000002" / "state.pt", weights_only=True)
        ends[m] = (_weights(out), state["opt"], [r["lr"] for r in steps])
    w0, opt0, lr0 = ends["all"]
    assert opt0["state"] == {}
    for m, (w, opt, lr) in ends.items():
        assert all(torch.equal(w[k], w0[k]) for k in w0) and opt == opt0 and lr == lr0, m


def test_kl_run_with_constant_reward_never_moves(tmp_path, monkeypatch):
    """A KL run on a constant reward: the warm start, --kl-beta 0.05, lr 1e-4 and a constant reward (every A = 0). The true KL
    gradient is 0; the weights stay bit for bit those of the start and the KL is exactly 0 at every step (the old
    code measured a 1e-8 gradient between two log-prob paths and AdamW turned it into 0.1-0.9 lr moves)."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: 0.5)
    out = tmp_path / "kl"
    recs = train_main("--preset", "smoke", "--steps", "3", "--kl-beta", "0.05", "--lr", "1e-4", "--warmup-steps",
                      "0", "--no-filter-groups", "--save-every", "0", "--out", out)
    assert [r["kl"] for r in recs[1:]] == [0.0, 0.0, 0.0]
    assert all(r["grad_norm"] == 0.0 for r in recs[1:])
    assert _same_weights(out, out / "ckpt-000000")


def test_filter_groups_cli_writes_its_metrics(tmp_path):
    """The real CLI, at small sizes. The random tiny model never answers, so no group is
    informative: every step draws --max-resample (4) rollout batches and reports all groups filtered."""
    out = tmp_path / "f"
    r = run_gmts("--model", "tiny", "--task", "countdown", "--steps", "2", "--filter-groups", "--prompts-per-step", "2",
                "--group-size", "4", "--max-new-tokens", "12", "--eval-size", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _metrics(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == [0, 1, 2]
    assert all(x["groups_filtered_frac"] == 1.0 and x["rollout_batches"] == 4 for x in recs[1:])
    assert (out / "metrics.png").stat().st_size > 1000


def test_kl_run_loads_a_reference_and_logs_kl(tmp_path, monkeypatch, parity):
    loaded, real = [], gmts.load_model
    monkeypatch.setattr(gmts, "load_model", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    recs = train_main(*SMALL, "--steps", "2", "--kl-beta", "0.1", "--lr", "1e-2", "--warmup-steps", "0",
                      "--out", tmp_path / "kl")
    assert loaded == ["tiny", "tiny"]  # the policy and pi_ref
    assert recs[1]["kl"] < 1e-6 < recs[2]["kl"]  # step 1: the policy is still pi_ref; step 2: it has moved
    assert recs[1]["grad_norm"] > 0
    loaded.clear()
    train_main(*SMALL, "--steps", "1", "--out", tmp_path / "nokl")
    assert loaded == ["tiny"]  # beta = 0: no reference model


def test_train_scores_with_the_kl_weight(tmp_path, monkeypatch, parity):
    """Step 6 as train() runs it with --kl-beta and --loss-norm seq: the omega handed to the selection is the loss's
    own (loss_weights, and the KL weight from the reference's log-probs), recomputed from the tensors train passes
    to policy_update; at step 2 the policy has left its reference, so the KL weight is not 0."""
    seen = []
    real_select, real_update = gmts.step_selection, gmts.policy_update
    monkeypatch.setattr(gmts, "step_selection", lambda cfg, logp, H, gn, om, mask, fn=None: seen.append(
        dict(logp=logp, om=om, mask=mask)) or real_select(cfg, logp, H, gn, om, mask, fn))
    def update(model, opt, batch, adv, sel, old, objective, **k):
        seen[-1].update(adv=adv, old=old, ref=k["ref_logp"], denom=objective.denom)
        return real_update(model, opt, batch, adv, sel, old, objective, **k)
    monkeypatch.setattr(gmts, "policy_update", update)
    train_main(*SMALL, "--steps", "2", "--kl-beta", "0.1", "--loss-norm", "seq", "--lr", "1e-2",
               "--warmup-steps", "0", "--out", tmp_path / "kl")
    last = seen[-1]
    rho, g = gmts.selection_rule(gmts.parse_args(["--group-size", "4"]))
    n_kept = int(gmts.scope_budget(last["mask"], rho, g)[1].sum())
    norm = gmts.loss_weights("seq", last["mask"], n_kept)
    ratio = torch.exp(last["logp"] - last["old"])
    want = omega(last["adv"], ratio, 0.2, 0.28, 0.1, torch.exp(last["ref"] - last["logp"]), **norm)
    assert torch.equal(last["om"], want) and norm["denom"] == last["denom"] == 8.0
    assert not torch.allclose(last["om"], omega(last["adv"], ratio, 0.2, 0.28, **norm), atol=1e-9)


def test_inner_updates_recompute_scores_and_move_the_ratio(tmp_path, monkeypatch, parity):
    """--inner-updates 2: the statistics and scores are recomputed before the second update, whose ratio
    pi_theta / pi_old has moved off 1 (the first is exactly 1)."""
    ratios, entropies = [], []
    real_omega, real_select = gmts.omega, gmts.step_selection
    monkeypatch.setattr(gmts, "omega", lambda adv, ratio, *a, **k: ratios.append(ratio.clone()) or
                        real_omega(adv, ratio, *a, **k))
    def select(cfg, logp, H, *a):
        entropies.append(H.clone())
        return real_select(cfg, logp, H, *a)
    monkeypatch.setattr(gmts, "step_selection", select)
    recs = train_main(*SMALL, "--steps", "1", "--inner-updates", "2", "--lr", "1e-2", "--warmup-steps", "0",
                      "--out", tmp_path / "mu")
    assert len(ratios) == len(entropies) == 2
    assert (ratios[0] == 1).all() and (ratios[1] - 1).abs().max() > 1e-3
    assert not torch.equal(entropies[0], entropies[1])
    assert recs[1]["grad_norm"] > 0


def test_filter_groups_resamples_new_prompts_until_b_groups_are_informative(tmp_path, monkeypatch):
    """Dynamic sampling (sample_groups, B = 2): the k-th rollout batch of step s draws its prompts with the key
    (s, k), and batches are drawn until B groups are informative. Here batch 0 has one live prompt, batch 1 none,
    batch 2 two: the step draws exactly 3 batches (keys (1, 0), (1, 1), (1, 2)), reports half of its 6 groups
    filtered and trains on the first 2 informative groups, both split 1, 0, 1, 0 (reward mean 0.5)."""
    live = {0: [True, False], 1: [False, False], 2: [True, True]}  # resample k -> which of its 2 prompts is live
    keys, real_read = [], gmts.read_data

    def read(cfg):
        data = real_read(cfg)
        draw = data.draw

        def tagged(n, *key):
            keys.append(key)
            return [dict(r, live=live.get(key[1], [False] * n)[i]) for i, r in enumerate(draw(n, *key))]
        data.draw = tagged
        return data
    monkeypatch.setattr(gmts, "read_data", read)
    it = itertools.cycle([1.0, 0.0])
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda t, row: next(it) if row.get("live") else 0.0)
    recs = train_main(*SMALL, "--steps", "1", "--filter-groups", "--max-resample", "4", "--out", tmp_path / "f")
    assert keys == [(1, 0), (1, 1), (1, 2)]
    step = recs[1]
    assert step["rollout_batches"] == 3 and step["groups_filtered_frac"] == 0.5
    assert step["reward_mean"] == 0.5 and step["grad_norm"] > 0


def test_training_at_a_temperature_is_on_policy(tmp_path, monkeypatch, parity):
    """--temperature 0.7 reaches every log-prob of a step: the sampler's (rollout), pi_old's statistics and the
    loss's. So the sampler and the learner agree (sampler_logp_gap < 1e-5) and the first update's ratio
    pi_theta / pi_old is 1 on every kept token ('all' keeps them all)."""
    ratios, real = [], gmts.grpo_token_loss
    monkeypatch.setattr(gmts, "grpo_token_loss", lambda logp, old, *a: ratios.append(torch.exp(logp - old).detach())
                        or real(logp, old, *a))
    recs = train_main(*SMALL, "--steps", "1", "--temperature", "0.7", "--select", "all", "--no-filter-groups",
                      "--out", tmp_path / "t")
    assert recs[1]["sampler_logp_gap_max"] < 1e-5 and recs[1]["clip_frac"] == 0.0
    r = torch.cat(ratios)
    assert r.numel() == round(recs[1]["completion_len"] * 8) and (r - 1).abs().max() < 1e-5


def test_a_truncated_answer_adds_nothing_to_the_gradient(tiny):
    """loss_backward with --overlong-filter's `valid` (resp_mask minus truncated answers), KL on: the gradient is the
    plain one of the kept tokens and the k3 terms of the other answers only, truncated rows contributing nothing
    though they are kept and have A != 0 (their advantage and their log-probs could move the weights otherwise)."""
    model, tok = tiny
    model.train()
    b, adv = _batch_from(model, tok, seed=5, n_prompts=3)
    trunc = torch.arange(len(adv)) % 3 == 0  # (N,): these answers count as cut at the length limit
    assert (adv[trunc] != 0).any()
    valid = b["resp_mask"] & ~trunc[:, None]
    logp = gmts.batch_token_stats(model, b, 1.0, 4, 7)[0]
    ref = logp - 0.3 * b["resp_mask"]  # a reference that differs everywhere: KL pulls on every valid token
    model.zero_grad()
    objective = _objective(valid, float(valid.sum()), beta=0.5)
    gmts.loss_backward(model, b, adv, valid, logp, objective, micro_batch=2, chunk=3, ref_logp=ref,
                       valid=valid)
    g_ours = _grads(model)
    model.zero_grad()
    lp = _plain_logp(model, b, 1.0)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    loss = (-(adv[:, None] * lp * valid).sum() + 0.5 * (k3 * valid).sum()) / valid.sum()
    loss.backward()
    g_ref = _grads(model)
    assert g_ref.abs().max() > 0 and torch.allclose(g_ours, g_ref, atol=1e-5), (g_ours - g_ref).abs().max()
    model.zero_grad()
    objective = _objective(b["resp_mask"], float(valid.sum()), beta=0.5)
    gmts.loss_backward(model, b, adv, b["resp_mask"], logp, objective, micro_batch=2, chunk=3,
                       ref_logp=ref)  # no filter
    assert not torch.allclose(_grads(model), g_ref, atol=1e-4)  # the truncated rows would have moved it
    model.zero_grad()


def test_overlong_filter_trains_nothing_on_truncated_answers(tmp_path, monkeypatch, parity):
    """--overlong-filter (DAPO): an answer flagged truncated trains nothing. Every other answer of train's rollouts
    is flagged here; policy_update must get valid = resp_mask minus those rows, a selection inside it ('all': all
    of it; gmts: part of it) and --loss-norm all's denominator = the valid count; with KL the same `valid`; the
    logged selected_frac is kept / valid."""
    real_rollout, real_update = gmts.rollout, gmts.policy_update
    seen = []

    def rollout(*a, **k):
        b = real_rollout(*a, **k)
        if k.get("sampler_logp"):  # train's rollouts, not evaluate's
            b["truncated"] = torch.arange(len(b["texts"])) % 2 == 1
        return b

    def update(model, opt, batch, adv, sel_mask, old_logp, objective, **k):
        seen.append((batch, sel_mask.clone(), objective.denom, k["valid"].clone()))
        return real_update(model, opt, batch, adv, sel_mask, old_logp, objective, **k)
    monkeypatch.setattr(gmts, "rollout", rollout)
    monkeypatch.setattr(gmts, "policy_update", update)
    for method, kl in (("all", "0"), ("gmts", "0.1")):
        seen.clear()
        recs = train_main(*SMALL, "--steps", "1", "--overlong-filter", "--select", method, "--kl-beta", kl,
                          "--no-filter-groups", "--out", tmp_path / method)
        ((batch, sel, denom, valid),) = seen
        trunc = batch["truncated"][:, None]
        assert trunc.any() and (~trunc).any()
        assert torch.equal(valid, batch["resp_mask"] & ~trunc) and not (sel & trunc).any()
        assert denom == float(valid.sum()) < float(batch["resp_mask"].sum())
        assert torch.equal(sel, valid) if method == "all" else (sel.any() and not (sel & ~valid).any())
        # selected_frac is a share of the valid tokens: 1 for 'all', not valid / resp_mask
        assert recs[-1]["selected_frac"] == float(sel.sum()) / float(valid.sum())


def test_cpu_preset_with_a_tiny_budget(tmp_path):
    out = tmp_path / "cpu"
    recs = train_main("--preset", "cpu", "--steps", "2", "--prompts-per-step", "2", "--eval-size", "4",
                      "--eval-every", "1", "--out", out)
    assert recs[0]["step"] == 0 and "eval_acc" in recs[0]  # the warm start's accuracy is the first eval_acc
    assert [x["step"] for x in recs] == [0, 1, 2] and (out / "metrics.png").stat().st_size > 1000
    assert json.loads((out / "run_config.json").read_text())["model"] == gmts.WARM_CPU


# ######################################################################################################################
# Below gmts.py's "Supporting code" banner, in its order.
# ######################################################################################################################


# ---- model and tokenizer ---------------------------------------------------------------------------------------------


def test_tiny_tokenizer_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = gmts.build_tiny()
    text = "Use 7 1 5 to make 35.\n<|im_start|>assistant\né <answer>(1 + 2) / 3</answer><|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids  # the v5 reload trap (env.md)
    assert tok.decode(ids) == text
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "Qwen2ForCausalLM"


def test_model_name_resolution():
    assert gmts.resolve_model_name("Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert gmts.resolve_model_name("Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert gmts.resolve_model_name("someone/model") == "someone/model"


# ---- evaluation ------------------------------------------------------------------------------------------------------


def test_evaluate_greedy_accuracy_length_and_sample(tiny, monkeypatch):
    """evaluate = greedy rollouts in batches: the share of rows whose answer scores exactly 1.0, the mean number of
    valid response tokens, the first answer (at most 200 characters); nothing else (well-formedness: gmts_lab)."""
    model, tok = tiny
    task = dict(gmts.get_task("countdown"), reward=lambda text, row: 1.0 if row["target"] == 16 else 0.1)
    rows = [{"nums": [3, 5, 2], "target": 16}, {"nums": [1, 2], "target": 3}, {"nums": [4, 4], "target": 16}]
    want = gmts.rollout(model, tok, gmts.build_prompts(tok, task, rows, True, True), 1, 9, greedy=True)
    for bs in (64, 2, 1):
        got = gmts.evaluate(model, tok, task, rows, True, True, 9, batch_size=bs)
        assert set(got) == {"eval_acc", "eval_len", "eval_sample"}
        assert got["eval_acc"] == pytest.approx(2 / 3) and got["eval_sample"] == want["texts"][0][:200]
        assert got["eval_len"] == pytest.approx(float(want["resp_mask"].sum()) / 3)


# ---- step lines, the progress bar and trackers -----------------------------------------------------------------------


def _wandb_history(folder):
    """The history records of the one offline wandb run under folder: its .wandb file is a LevelDB-style log (a
    7-byte file header, 32 KiB blocks, records with a 7-byte header: crc, length, type 1 full / 2 first / 3 middle
    / 4 last) of wandb's protobuf Records. -> [{key: value}]"""
    import glob
    import struct
    from wandb.proto import wandb_internal_pb2
    (path,) = glob.glob(os.path.join(str(folder), "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    pos, pending, history = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return history


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_report_to_sends_every_step_record(tmp_path, monkeypatch, tracker):
    """--report-to: every number of every metrics.jsonl record (step 0's evaluation included) reaches the tracker at
    its step: read back from tensorboard's event file, or from wandb's offline run file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    recs = train_main("--preset", "smoke", "--report-to", tracker, "--out", out)
    want = {}  # (key, step) -> value
    for r in gmts.read_metrics(str(out)):
        for k, v in r.items():
            if k != "step" and type(v) in (int, float):
                want[k, r["step"]] = v
    got = {}
    if tracker == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        for k in acc.Tags()["scalars"]:
            for e in acc.Scalars(k):
                got[k, e.step] = e.value
    else:
        for h in _wandb_history(out):
            for k, v in h.items():
                if not k.startswith("_"):
                    got[k, h["_step"]] = v
    assert got.keys() == want.keys() and ("eval_acc", 0) in got and len(recs) == 3
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-30), k  # tensorboard stores float32


def test_report_to_without_its_package_is_one_line(tmp_path, monkeypatch, capsys):
    """A tracker whose package is missing: one line, exit 2, before any work (nothing written to --out)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError
    monkeypatch.setattr(gmts.importlib.util, "find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(SystemExit) as e:
        gmts.main(["--preset", "smoke", "--report-to", "wandb", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "pip install wandb" in err
    assert not (tmp_path / "r").exists()


# ---- RSI-S: the interval rule (--select rsi) --------------------------------------------------------------------------

def test_relative_surprisal_by_hand():
    """p = (1/2, 1/4, 1/4): H = 1.5 ln 2, so RSI = ln 2 / H = 2/3 for the likeliest token and 2 ln 2 / H = 4/3 for
    the others; a one-hot p (H = 0) has RSI inf; over y ~ p the mean RSI is 1 (E[-log p_y] = H), for any p."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]] * 3 + [[1.0, 1.0, 1.0]]))
    logits[3] = torch.tensor([0.0, -200.0, -200.0])  # e^-200 is 0 in float32: p is one-hot
    logp, H, _ = token_stats(logits, torch.tensor([0, 1, 2, 0]))
    rsi = gmts.relative_surprisal(logp, H)
    assert H[3] == 0 and rsi[3] == math.inf
    assert torch.allclose(rsi[:3], torch.tensor([2 / 3, 4 / 3, 4 / 3]), rtol=1e-6)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 50, generator=g) * 3  # five random distributions over 50 tokens
    p = torch.softmax(z, -1)
    every_y = torch.arange(50).expand(5, 50)  # (5, 50): each token of each distribution
    lp, ent, _ = token_stats(z[:, None, :].expand(5, 50, 50), every_y)
    mean = (p * gmts.relative_surprisal(lp, ent)).sum(-1)  # sum_y p_y RSI(y)
    assert torch.allclose(mean, torch.ones(5), atol=1e-5), mean


@pytest.mark.parametrize("low, high", [(0.5, 2.0), (0.0, 1.0), (1.0, 1.0), (0.9, 50.0)])
def test_rsi_keeps_its_interval_against_a_slow_loop(low, high):
    """step_selection with --select rsi equals a Python loop over the tokens that computes p, H and -log p_y in
    float64 from the logits and keeps a valid token iff low <= RSI <= high (a closed interval, so no ties: a token on
    a bound is kept); omega does not enter; the kept share is what selected_frac logs."""
    g = torch.Generator().manual_seed(3)
    N, T, V = 6, 9, 11
    logits = torch.randn(N, T, V, generator=g) * 2.5
    logits[0, 0] = torch.tensor([30.0] + [0.0] * (V - 1))  # near one-hot: RSI far below 1
    logits[1, 1] = torch.tensor([0.0, 0.0] + [-200.0] * (V - 2))  # a fair coin (e^-200 is 0 in float32)
    tokens = torch.randint(0, V, (N, T), generator=g)
    tokens[1, 1] = 0
    mask = torch.rand(N, T, generator=g) > 0.2
    mask[1, 1] = True
    logp, H, dz = token_stats(logits, tokens)
    assert gmts.relative_surprisal(logp, H)[1, 1] == 1.0  # -log p_y = H = ln 2 in float32: on a bound below
    cfg = gmts.Config(select="rsi", rsi_low=low, rsi_high=high)
    for om in (torch.randn(N, T, generator=g), torch.zeros(N, T)):  # omega does not matter
        sel = gmts.step_selection(cfg, logp, H, dz, om, mask)
        want = torch.zeros(N, T, dtype=torch.bool)
        for i in range(N):
            for t in range(T):
                p = [math.exp(v) for v in logits[i, t].double().tolist()]
                p = [v / sum(p) for v in p]
                ent = -sum(v * math.log(v) for v in p if v > 0)
                rsi = -math.log(p[tokens[i, t]]) / ent if ent > 0 else math.inf
                # a float32 RSI within 1e-5 of a bound may land on either side of it: skip those
                if min(abs(rsi - low), abs(rsi - high)) < 1e-5 and not (i, t) == (1, 1):
                    want[i, t] = sel[i, t]
                    continue
                want[i, t] = bool(mask[i, t]) and low <= rsi <= high
        assert torch.equal(sel, want), (low, high)
    assert sel[1, 1] == (low <= 1.0 <= high)  # (1.0, 1.0): kept, as the interval is closed


def test_rsi_trains_and_logs_its_kept_share(tmp_path, capsys):
    """A short real run with --select rsi from the cpu preset's warm start (the tiny random model's near-uniform p
    puts every RSI near 1): every step logs selected_frac, the share inside the interval, here neither 0 nor 1
    (test_gmts_trl: the TRL wrapper refuses rsi, its selection being a top rho)."""
    out = tmp_path / "rsi"
    gmts.main(["--preset", "smoke", "--select", "rsi", "--out", str(out)])
    recs = gmts.read_metrics(str(out))
    shares = [r["selected_frac"] for r in recs if "selected_frac" in r]
    assert shares and all(0.0 < f < 1.0 for f in shares), shares


# ---- the fast rollout path and the bf16 sampler ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_prompts():
    model, tok = gmts.build_tiny(96, 3, seed=0)
    task = gmts.get_task("countdown")
    prompts = gmts.build_prompts(tok, task, gmts.load_rows("countdown", "easy", 3, 0), False, short=True)
    prompts[1] += " (a longer prompt, so the others are left-padded)"
    return model.eval(), tok, prompts


def draw(tiny_prompts, fast, seed=0, **kw):
    model, tok, prompts = tiny_prompts
    torch.manual_seed(seed)
    return gmts.rollout(model, tok, prompts, 8, 40, fast=fast, sampler_logp=True, **kw)


def test_static_cache_draws_what_the_dynamic_cache_draws(tiny_prompts):
    greedy = [draw(tiny_prompts, fast, greedy=True) for fast in (False, True)]
    assert torch.equal(greedy[0]["comp_ids"], greedy[1]["comp_ids"])
    for temperature in (1.0, 0.7):  # T = 1 with top_k 0 / top_p 1 (no warper at all), and a temperature warper
        dyn, static = (draw(tiny_prompts, fast, seed=3, temperature=temperature) for fast in (False, True))
        assert torch.equal(dyn["comp_ids"], static["comp_ids"])  # the same tokens under the same seed
        assert torch.equal(dyn["resp_mask"], static["resp_mask"]) and torch.equal(dyn["truncated"], static["truncated"])
        assert (~dyn["truncated"]).any() and dyn["truncated"].any()  # eos handling is covered: some answers end
        # the same per-position distribution: the sampler's log-probs of the drawn tokens agree
        assert (dyn["sampler_logp"] - static["sampler_logp"]).abs().max() < 1e-5
        assert dyn["prompt_mask"].sum(1).unique().numel() > 1  # left padding is covered


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logp_equals_the_learner_recompute_in_fp32(tiny_prompts, fast, temperature):
    b = draw(tiny_prompts, fast, seed=5, temperature=temperature)
    N, T = b["comp_ids"].shape
    assert b["sampler_logp"].shape == (N, T) and (b["sampler_logp"][~b["resp_mask"]] == 0).all()
    logp = gmts.batch_token_stats(tiny_prompts[0], b, temperature, micro_batch=64, chunk=1024)[0]
    gap = (b["sampler_logp"] - logp).abs()[b["resp_mask"]]
    assert gap.max() < 1e-5, float(gap.max())
    assert (b["sampler_logp"][b["resp_mask"]] < 0).all()  # real log-probs, not a zero fill


def reward_cycle(monkeypatch):
    """A random-init model earns no reward: 1, 0, 1, 0, ... gives every group unequal rewards, so steps happen."""
    it = itertools.cycle([1.0, 0.0])
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", lambda text, row: next(it))


def tiny_cfg(tmp_path, **kw):
    return gmts.Config(**{**dict(model="tiny", tiny_hidden=64, tiny_layers=2, task="countdown", data="easy",
                                 short_prompt=True, steps=2, prompts_per_step=2, group_size=4, max_new_tokens=12,
                                 eval_every=0, eval_size=2, save_every=0, lr=1e-2, warmup_steps=0,
                                 out=str(tmp_path / "run")), **kw})


def test_bf16_copy_equals_bf16_of_the_master_after_each_step(tmp_path, monkeypatch):
    reward_cycle(monkeypatch)
    seen, master = [], []  # (the model rollout sampled from, its weights), and the master model at each update
    real_rollout, real_update = gmts.rollout, gmts.policy_update

    def spy_rollout(model, *a, **k):
        if k.get("sampler_logp"):  # train's rollouts (evaluate's greedy ones read the master)
            seen.append((model, [(p.detach().clone(), p.data_ptr()) for p in model.parameters()]))
        return real_rollout(model, *a, **k)

    def spy_update(model, *a, **k):
        out = real_update(model, *a, **k)
        master.append((model, [p.detach().clone() for p in model.parameters()], out["stepped"]))
        return out

    monkeypatch.setattr(gmts, "rollout", spy_rollout)
    monkeypatch.setattr(gmts, "policy_update", spy_update)
    out = gmts.train(tiny_cfg(tmp_path, sampler_dtype="bf16", fast_generate=True), log=lambda *a: None)
    assert len(seen) == 2 and len(master) == 2 and all(m[2] for m in master)  # both steps stepped
    sampler, model = seen[0][0], master[0][0]
    assert sampler is seen[1][0] and sampler is not model  # one copy, sampled from at every step
    assert all(p.dtype == torch.bfloat16 for p in sampler.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the update keeps fp32 master weights
    assert sampler.model.rotary_emb.inv_freq.dtype == torch.float32
    for (s_old, ptr_old), (s_new, ptr_new), m in zip(seen[0][1], seen[1][1], master[0][1]):
        assert ptr_old == ptr_new  # refreshed in place, no reallocation
        assert torch.equal(s_new, m.to(torch.bfloat16))  # exactly bf16(fp32 weights after step 1)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(seen[0][1], seen[1][1]))  # and it did move
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][1:]
    assert all(0 < r["sampler_logp_gap"] <= r["sampler_logp_gap_max"] < 1.0 for r in rows)  # bf16 vs fp32: small


@pytest.mark.parametrize("filter_groups", [True, False])
def test_train_logs_a_zero_gap_when_sampler_and_learner_share_fp32(tmp_path, monkeypatch, filter_groups):
    reward_cycle(monkeypatch)
    cfg = tiny_cfg(tmp_path, filter_groups=filter_groups)  # CPU: sampler_dtype auto -> fp32, no copy
    rows = [json.loads(x) for x in open(os.path.join(gmts.train(cfg, log=lambda *a: None), "metrics.jsonl"))][1:]
    assert len(rows) == 2
    assert all(0 <= r["sampler_logp_gap"] <= r["sampler_logp_gap_max"] < 1e-5 for r in rows), rows


def test_flags():
    cfg = gmts.parse_args(["--sampler-dtype", "bf16", "--fast-generate", "false"])
    assert cfg.sampler_dtype == "bf16" and cfg.fast_generate is False
    cfg = gmts.parse_args([])
    assert cfg.sampler_dtype == "auto" and cfg.fast_generate is None  # auto: bf16 and fast only where CUDA is
    with pytest.raises(ValueError, match="--sampler-dtype: invalid choice: 'fp16'"):
        gmts.parse_args(["--sampler-dtype", "fp16"])


# ---- the paper-math preset: Framework1's values and its update ------------------------------------------------
def test_the_preset_takes_framework1_s_values():
    """GMTS-Framework1/example/Qwen2.5-math-1.5b-grpo-GMTS.yaml and test.py (shared/notes/gmts-official.md)."""
    cfg = gmts.parse_args(["--preset", "paper-math"])
    framework1 = dict(model="Qwen/Qwen2.5-Math-1.5B", task="math", prompt_style="qwen-math", prompts_per_step=64,
                      group_size=16, max_new_tokens=2048, lr=3e-5, warmup_steps=0, lr_decay=False, weight_decay=0.0,
                      max_grad_norm=1.0, kl_beta=0.001, clip_low=0.2, clip_high=0.28, micro_batch=4, seed=0,
                      filter_groups=False, overlong_filter=False, temperature=1.0, top_p=1.0, top_k=0,
                      inner_updates=1, select="gmts", rho=0.2, eval_samples=16, steps=188)
    assert {k: getattr(cfg, k) for k in framework1} == framework1
    # GRPO's per-answer mean, summed over the 64 prompts, the norm clipped at 1.0: their update
    assert cfg.loss_norm == "seq-sum" and gmts.selection_rule(cfg) == (0.2, 16)  # GMTS per group
    assert cfg.adam_eps == 1e-8 and cfg.data_order == "epoch"  # torch's eps; one pass over the rows
    assert cfg.data == "hf:hiyouga/math12k:train" and [n for n, _ in gmts.eval_sets(cfg.eval_data)] == [
        "aime24", "amc23", "math500", "minerva", "olympiadbench"]




# ---- the preset's update is the authors' -----------------------------------------------------------------------------
def _preset_batch(tok, informative, B=64, G=16, seed=0):
    """A rollout batch as sample_groups returns it: B prompts x G answers of the byte-level tiny
    tokenizer, every answer 16 (an end token last) or 32 tokens (cut), rewards binary: half of each
    of the first `informative` groups right, the other groups all wrong."""
    g = torch.Generator().manual_seed(seed)
    N, P, T = B * G, 6, 32
    prompt_ids = torch.full((N, P), tok.pad_token_id)
    prompt_mask = torch.zeros(N, P, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(3, P + 1, (1,), generator=g))
        prompt_ids[b * G:(b + 1) * G, P - n:] = torch.randint(0, 256, (n,), generator=g)
        prompt_mask[b * G:(b + 1) * G, P - n:] = True
    comp = torch.randint(0, 256, (N, T), generator=g)
    short = torch.arange(N) % 3 == 0
    comp[short, 15] = tok.convert_tokens_to_ids("<|im_end|>")
    comp[short, 16:] = tok.pad_token_id
    resp_mask, truncated = gmts.completion_mask(comp, gmts.end_token_ids(tok))
    rewards = torch.zeros(N)
    for b in range(informative):
        rewards[b * G:b * G + G // 2] = 1.0
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, comp_ids=comp, resp_mask=resp_mask,
                 truncated=truncated, texts=[""] * N, sampler_logp=torch.zeros(N, T),
                 grade_s=torch.zeros(N, dtype=torch.float64),
                 grade_timeout=torch.zeros(N, dtype=torch.bool))
    return batch, rewards


def _authors_update(model, batch, rewards, kept, old_logp, ref_logp, G=16, micro=4, lr=3e-5,
                    beta=0.001, clip_low=0.2, clip_high=0.28, logp_of=gmts.head_logp, grads=None):
    """A literal reading of GMTS-Framework1's update_policy (grpo_tools/grpo.py), method grpo, one
    mini-batch of all the prompts: A' = (r - mean) / (population std + 1e-6) / (G |o_i|) in
    float64; micro answers at a time, the SUM over tokens of -min(r A', clip(r) A') on the kept
    tokens (A' = 0 elsewhere) plus beta k3 / (G |o_i|) on all, backward; the gradient norm clipped
    at 1.0; torch's AdamW(lr, (0.9, 0.999), eps 1e-8, weight decay 0). Given: the kept tokens
    (their GMTS(): pinned by test_gmts' test_select_tokens_per_group_matches_the_literal_reference),
    pi_old's and pi_ref's log-probs, and the forward (response_hidden, the head, the same rows per
    micro-batch): what is compared is the update, not two forwards' rounding. logp_of(h, head, y):
    the log-probs (gmts.head_logp's bits, or theirs: _cross_entropy_logp); grads: a list that gets
    each parameter's gradient before the clip. -> the norm."""
    import numpy as np
    mask = batch["resp_mask"]
    N = mask.shape[0]
    lengths = mask.sum(1).tolist()  # |o_i|
    adv = []
    for b in range(N // G):
        r = rewards[b * G:(b + 1) * G].double().numpy()
        for j in range(G):
            a = (r[j] - np.mean(r)) / (np.std(r) + 1e-6)
            adv.append(a / (lengths[b * G + j] * G))
    adv = torch.tensor(adv, dtype=torch.float32)  # A', (N,)
    head = model.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    for start in range(0, N, micro):
        rows = slice(start, start + micro)
        m = mask[rows]
        h = gmts.response_hidden(model, batch, rows)[m]
        logp = logp_of(h, head, batch["comp_ids"][rows][m])
        a = adv[rows][:, None].expand_as(m)[m] * kept[rows][m]
        ratio = (logp - old_logp[rows][m]).exp()
        surr = torch.min(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
        log_ratio = ref_logp[rows][m] - logp
        n = torch.tensor(lengths[start:start + micro], dtype=torch.float32)[:, None].expand_as(m)[m]
        kl = (log_ratio.exp() - log_ratio - 1) / (G * n)
        (-surr + beta * kl).sum().backward()
    if grads is not None:
        grads.extend(p.grad.clone() for p in model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
    opt.step()
    return norm


def _cross_entropy_logp(h, head, y):
    """log p_y as GMTS-Framework1 computes it: minus the cross-entropy of the float logits."""
    logits = torch.nn.functional.linear(h, head.weight, head.bias).float()
    return -torch.nn.functional.cross_entropy(logits, y, reduction="none")


def _math_file(path, n, first=0):
    """n MATH-500-layout rows (problem, answer) in a .jsonl file -> its path."""
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(first, first + n)))
    return str(path)


def _our_first_step(tmp_path, monkeypatch, informative):
    """--preset paper-math's first step (gmts.main, the real loop) on a fixed rollout batch of 64 x
    16 -> (batch, rewards, what step 1 used: kept tokens, pi_old's and pi_ref's log-probs, the
    weights before it, after it, the checkpoint folder)."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    _, tok = gmts.build_tiny()
    batch, rewards = _preset_batch(tok, informative)
    adv = gmts.group_advantages(rewards, 16)
    seen = {}

    def recording(name):
        real = getattr(gmts, name)

        def call(*a, **k):
            seen.setdefault(name, real(*a, **k))  # the first call: step 1's
            return seen[name]
        return call
    for name in ("batch_token_stats", "response_logp", "step_selection"):
        monkeypatch.setattr(gmts, name, recording(name))
    fixed = (batch, rewards, adv, [(batch, rewards, adv)])
    monkeypatch.setattr(gmts, "sample_groups", lambda *a, **k: fixed)
    gmts.main(["--preset", "paper-math", "--model", "tiny", "--data", _math_file(tmp_path / "train.jsonl", 64),
               "--eval-data", f"bench={_math_file(tmp_path / 'bench.jsonl', 2, 100)}", "--eval-samples", "1",
               "--max-new-tokens", "8", "--steps", "1", "--out", str(out)])
    start = AutoModelForCausalLM.from_pretrained(out / "ckpt-000000", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(out / "ckpt-000001", dtype=torch.float32)
    used = (seen["step_selection"], seen["batch_token_stats"][0], seen["response_logp"])
    return batch, rewards, used, start, ours, out


@pytest.mark.parametrize("informative", [1, 64])
def test_one_step_equals_the_authors_update(tmp_path, monkeypatch, informative):
    """--preset paper-math's first step (gmts.main, the real loop, a fixed rollout batch of 64 x 16)
    against _authors_update on the same batch from the same weights and the same log-prob bits:
    the parameters after the step are EQUAL (torch.equal): --loss-norm seq-sum is their sum over
    prompts, clipped at 1. With 1 informative group the clip does not act (their norm < 1); with
    64 it does. Measured before seq-sum, with our mean clipped at 1/64 and eps / 64: 799 of 90,880
    parameters differed where the clip acts (clip_grad_norm_'s 1e-6 is not scaled); with eps 1e-8
    (e3741a4) both cases."""
    import copy
    batch, rewards, used, start, ours, out = _our_first_step(tmp_path, monkeypatch, informative)
    theirs = copy.deepcopy(start).train()
    norm = _authors_update(theirs, batch, rewards, *used)
    assert (norm > 1.0) == (informative == 64), norm
    state = torch.load(out / "ckpt-000001" / "state.pt", weights_only=False)
    assert state["opt"]["param_groups"][0]["eps"] == 1e-8  # start_run's AdamW: torch's eps
    moved = 0
    for (name, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start.parameters()):
        p, q = p.detach(), q.detach()
        assert torch.equal(p, q), (name, float((p - q).abs().max()))
        moved += int((p != p0).sum())
    n = sum(p.numel() for p in start.parameters())
    assert moved > 0.9 * n  # a real step, not a no-op


def _logp_table(model, batch, logp_of, micro=4):
    """(N, T) log-probs of the answers' tokens by logp_of, no gradient (pi_old's, pi_ref's)."""
    mask = batch["resp_mask"]
    table = torch.zeros(mask.shape)
    with torch.no_grad():
        for start in range(0, mask.shape[0], micro):
            rows = slice(start, start + micro)
            h = gmts.response_hidden(model, batch, rows)[mask[rows]]
            table[rows][mask[rows]] = logp_of(h, model.get_output_embeddings(),
                                              batch["comp_ids"][rows][mask[rows]])
    return table


@pytest.mark.parametrize("informative", [1, 64])
def test_one_step_is_the_authors_update_with_their_log_probs_up_to_rounding(tmp_path, monkeypatch,
                                                                              informative):
    """Framework1 takes log p_y as -cross_entropy(logits) (pi_theta's, and pi_old's and pi_ref's:
    at step 1 all from the start weights); gmts.py as z_y - logsumexp(z). The values are the same
    bits here, their backward is not, so the update is theirs up to float rounding only: the
    gradient within 5e-7 of ours relative to its norm (measured: 3.6e-7 with 1 informative group,
    4.3e-7 with 64), the weights after the step within 5e-7 (measured: ~690 of 90,880 differ, by
    <= 1.4e-7). Ours: _authors_update on our log-probs, whose step is torch.equal to gmts.main's."""
    import copy
    batch, rewards, used, start, ours, _ = _our_first_step(tmp_path, monkeypatch, informative)
    ce = _logp_table(start, batch, _cross_entropy_logp)
    mine, theirs, g_mine, g_theirs = copy.deepcopy(start).train(), copy.deepcopy(start).train(), [], []
    _authors_update(mine, batch, rewards, *used, grads=g_mine)
    _authors_update(theirs, batch, rewards, used[0], ce, ce, logp_of=_cross_entropy_logp,
                    grads=g_theirs)
    norm = math.sqrt(sum(float((a.double() ** 2).sum()) for a in g_mine))
    off = math.sqrt(sum(float(((b - a).double() ** 2).sum()) for a, b in zip(g_mine, g_theirs)))
    assert off <= 5e-7 * norm, off / norm
    for p, q, r in zip(ours.parameters(), mine.parameters(), theirs.parameters()):
        p, q, r = p.detach(), q.detach(), r.detach()
        assert torch.equal(p, q)  # _authors_update on our log-probs is gmts.main's step
        assert float((p - r).abs().max()) <= 5e-7



def test_rollout_rows_samples_whole_groups_per_call(tmp_path, monkeypatch):
    """--rollout-rows 4 with 2 prompts x 4 answers: two generate() calls of one group each, joined
    as one batch of 8 answers (each answer's rows padded as dynamic sampling joins batches), and the
    evaluation rolls out 4 answers at a time; the run trains as before (every step logged)."""
    real, calls = gmts.rollout, []

    def counting(model, tok, prompts, group_size, *a, **k):
        calls.append(len(prompts) * group_size)
        return real(model, tok, prompts, group_size, *a, **k)
    monkeypatch.setattr(gmts, "rollout", counting)
    out = tmp_path / "o"
    gmts.main(["--preset", "smoke", "--rollout-rows", "4", "--no-filter-groups", "--steps", "1",
               "--eval-every", "0", "--out", str(out)])
    assert calls == [4] * (1 + 2 + 1), calls  # evaluation (4 rows), the step's 2 calls, evaluation
    assert [r["step"] for r in gmts.read_metrics(str(out))] == [0, 1]

