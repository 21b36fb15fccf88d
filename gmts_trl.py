"""
gmts_trl.py: GMTS token selection inside TRL's GRPOTrainer, for multi-GPU and vLLM runs.

gmts.py is the reference, to be read beside the papers. This file reuses its tasks, verifiers,
prompts, scores (gmts.token_scores, gmts.omega) and selection (gmts.select_tokens) and leaves
rollout (HF generate or vLLM), loss, optimiser and distribution (accelerate, DeepSpeed) to TRL.
No TRL loss code is copied: the subclass only hooks in, at the places TRL_HOOKS lists (below the
imports): a TRL upgrade is that checklist. Tested with trl 1.16.0 only.

What is selected, over which rows:
  1. TRL generates a generation batch (per-device batch x steps_per_generation answers per
     process), labels nothing, shuffles its rows and splits them into steps_per_generation
     micro-batches, which it reuses for num_iterations passes (GRPOTrainer._prepare_inputs).
     _generate_and_score_completions here adds each row's global index ("gmts_row": process
     index x rows per process + row), which TRL's shuffle carries with the row.
  2. At the start of every pass over a generation batch (_prepare_inputs here, after TRL's), one
     no-grad forward over all its micro-batches gives each token's log-prob, entropy H (TRL's
     fused head, at the sampling temperature) and, for gradnorm, log sum_j p_j^2. Every process
     gathers the scores, masks and row indices of the whole generation batch (accelerate
     pad_across_processes + gather), puts the rows back in generation order (the G answers of a
     prompt are G consecutive rows, as TRL groups the advantages) and runs
     gmts.select_tokens(scores, mask, rho, nonzero=..., group_size=G) on it: the same result on
     every process, each keeps its rows. group_size is G for --scope group (auto: gmts, the
     authors' rule) and 0 for batch (the whole generation batch of all processes). The kept mask
     is written into each micro-batch ("gmts_keep", with "gmts_score"), so it is the mask of the
     row wherever the shuffle put it.
  3. TRL's _compute_loss calls self.get_high_entropy_mask(entropies, mask, ...) when
     top_entropy_quantile < 1 and multiplies the per-token loss by the mask it returns.
     GMTSTrainer sets top_entropy_quantile = 0 only to get that call, and returns gmts_keep.
  4. The score's policy: the statistics are those of the policy at the start of the pass, so
     with num_iterations > 1 each pass is scored again from the moved policy (ratio != 1, some
     tokens under the clip), as gmts.py's inner updates are. Within a pass (steps_per_generation
     > gradient_accumulation_steps: several optimizer steps per pass) the later steps use the
     pass's mask. Cost: one no-grad forward of the generation batch per pass (docs/design.md, TRL).

omega is -dloss/dlogp_t of the loss TRL runs (gmts.py's derivation step 1), from TRL's own inputs
(advantages, old_per_token_logps, importance_sampling_ratio, ref_per_token_logps), per loss type:
  PPO-clip (grpo, bnpo, dr_grpo, dapo, luspo): r A where the clip leaves the gradient alive
  (gmts.omega with TRL's epsilon_low / epsilon_high), 0 also where TRL's two-sided clip
  min(r, delta) leaves the loss flat: r > delta for A > 0, r > max(delta, 1 + epsilon_high) for
  A < 0 (up to 1 + epsilon_high its min takes the live clip(r) A = r A branch); cispo:
  min(r, epsilon_high) A; sapo: 4 s (1 - s) r A, s = sigmoid(tau (r - 1)), tau by the sign of A;
  vespo: phi A, phi TRL's own get_gamma_weights (no gradient through it).
  r = exp(logp - old logp) per token (1 without old log-probs). Then times the vLLM importance
  ratio where TRL applies it (not vespo), plus with beta > 0 the k3 KL term's
  beta (pi_ref / pi_theta - 1), with use_bias_correction_kl (TRL's default) beta r (pi_ref /
  pi_theta - 1 - k3); times the loss type's per-token normaliser: 1 / |o_i| for grpo and sapo,
  1 / (the micro-batch's valid tokens on its process) for bnpo; the others' are one constant for
  every token of the step, which no ranking sees. Refused before training (GMTSConfig raises
  gmts.BadInput; the CLI: one line, exit 2), because no per-token omega is the gradient then:
  importance_sampling_level="sequence" (the ratio is a mean over all of an answer's tokens, so
  dropped tokens still get a gradient), and for gmts / gradnorm off_policy_mask_threshold and
  the entropy bonus (entropy_coef, use_adaptive_entropy).
gradnorm needs sum_j p_j^2 too: TRL's fused LM head can return log sum_j p_j^2
("log_sum_sq_probs") but GRPOTrainer doesn't ask for it, so with token_selection="gradnorm" the
head is added again with that output and the forward is wrapped to keep it during the scoring pass.

Ties and budgets are gmts.select_tokens': per group the authors' group_keep (ties: the later
kept), over the batch ceil(rho n) (ties: the earlier row of the generation order). gmts and
gradnorm then drop kept tokens whose score is 0 (A = 0 or clipped), as in gmts.train.

Loss normalisation: TRL multiplies the per-token loss by the mask and never divides by the
kept-token count: the normaliser is the completion mask (or a constant), for every loss type.
With the default loss_type="dapo" that is the sum over kept tokens / all valid completion tokens
of the generation batch on all processes, i.e. gmts.py's default --loss-norm all: at rho = 0.2
a step is about 1/5 of an unmasked one. gmts.py's --loss-norm selected has no TRL counterpart.

Run:  python gmts_trl.py --model tiny --short-prompt --steps 20                  (offline, CPU)
      accelerate launch --num_processes 8 gmts_trl.py --model Qwen2.5-1.5B-Instruct --task math \\
          --use-vllm
"""
import argparse
import contextlib
import functools
import inspect
import json
import math
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import filelock
import torch

import gmts  # before trl: its HF environment defaults are read when transformers is imported

import trl  # noqa: E402
import trl.models.utils  # noqa: E402
import trl.trainer.utils  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.import_utils import is_vllm_available  # noqa: E402

# -------------------------------------------------------------------------------------------------
# The TRL hooks [plumbing]: every place this file touches TRL's code, as trl 1.16.0 has it
# -------------------------------------------------------------------------------------------------

TESTED_TRL = ("1.16.0",)


class Hook(NamedTuple):
    owner: object  # the class or module that holds it
    name: str
    params: tuple  # its parameters, checked at construction (check_trl); None: only its presence
    why: str  # why gmts_trl.py needs it
    breaks: str  # what breaks if TRL changes it, and what notices


# A TRL upgrade: read each hook's code in the new version against its line here.
TRL_HOOKS = (
    Hook(GRPOTrainer, "get_high_entropy_mask", ("self", "entropies", "mask", "threshold"),
         why="overridden: TRL's _compute_loss asks it for the token mask when "
             "top_entropy_quantile < 1 and multiplies the per-token loss by it; GMTSTrainer "
             "answers with the micro-batch's gmts_keep",
         breaks="no selection: check_trl refuses a changed signature; a loss that no longer "
                "calls it raises RuntimeError at the first step (GMTSTrainer._compute_loss)"),
    Hook(GRPOTrainer, "_compute_loss", ("self", "model", "inputs"),
         why="wrapped: hands the micro-batch being scored (its gmts_keep) to the mask hook and "
             "checks that the hook ran",
         breaks="the hook finds no inputs: RuntimeError at the first step"),
    Hook(GRPOTrainer, "_prepare_inputs", ("self", "generation_batch"),
         why="wrapped: at the start of each pass over a generation batch (TRL's _step, "
             "_buffered_inputs, steps_per_generation) scores and selects over all of it",
         breaks="selection over the wrong rows or a stale mask; "
                "test_select_equals_select_tokens_in_generation_order fails"),
    Hook(GRPOTrainer, "_generate_and_score_completions", ("self", "inputs"),
         why="wrapped: adds gmts_row, each row's index in the generation batch, which TRL's "
             "shuffle carries with the row (row // G is the prompt's group)",
         breaks="groups cut by the shuffle: select_generation_batch raises RuntimeError "
                "(the gathered rows are not one generation batch)"),
    Hook(GRPOTrainer, "_get_per_token_logps_and_entropies", None,
         why="called: the scoring pass's no-grad forward through TRL's own fused head, at the "
             "sampling temperature (model, ids, attention, T, batch_size=, compute_entropy=)",
         breaks="a TypeError at the first selection, or scores of other statistics; "
                "test_two_trl_steps_end_to_end fails"),
    Hook(GRPOTrainer, "get_gamma_weights", None,
         why="called: vespo's phi, so that omega is minus the gradient of TRL's vespo loss",
         breaks="vespo's omega; test_omega_is_minus_the_gradient_of_trls_loss[vespo] fails"),
    Hook(trl.trainer.utils, "add_fused_lm_head", None,
         why="called for gradnorm: the fused head again, with outputs=(..., "
             "'log_sum_sq_probs'), which GRPOTrainer does not ask for",
         breaks="gradnorm's score (dz_norm); test_two_trl_steps_end_to_end[gradnorm] fails"),
    Hook(trl.models.utils, "disable_gradient_checkpointing", None,
         why="called: the scoring pass runs without gradient checkpointing, as TRL's own "
             "no-grad passes do",
         breaks="an ImportError at the first selection"),
    Hook(None, "GRPOTrainer's loss: loss_type, epsilon_low/high, beta, delta", None,
         why="read, not called: omega (GMTSTrainer.omega) restates the gradient of TRL's loss "
             "per loss_type, with its clip, delta, vLLM importance ratio and k3 KL term; the "
             "micro-batch keys it reads (advantages, old_per_token_logps, "
             "importance_sampling_ratio, ref_per_token_logps, completion_mask, tool_mask)",
         breaks="a changed loss makes omega another gradient: "
                "test_omega_is_minus_the_gradient_of_trls_loss fails (autograd of TRL's loss)"),
)


def check_trl():
    """gmts.RunError (a RuntimeError; the CLI: one line, exit 1) if a TRL_HOOKS method is gone or
    its parameters changed; a warning on a TRL version not tested."""
    for hook in TRL_HOOKS:
        if hook.owner is None:  # read, not called: the tests pin it
            continue
        fn = getattr(hook.owner, hook.name, None)
        if fn is None or (hook.params and tuple(inspect.signature(fn).parameters) != hook.params):
            raise gmts.RunError(f"trl {trl.__version__}: {hook.name} is missing or changed; "
                                f"gmts_trl.py needs the hooks of trl {', '.join(TESTED_TRL)} "
                                "(TRL_HOOKS)")
    if trl.__version__ not in TESTED_TRL:
        warnings.warn(f"gmts_trl.py was tested with trl {', '.join(TESTED_TRL)}, "
                      f"not {trl.__version__}")

# all, random, entropy, gmts, gradnorm (gmts.METHODS); not rsi, whose interval rule (a band
# method) only gmts.py runs: selection here is select_tokens' top token_rho
SELECT = [m for m in gmts.METHODS if not gmts.METHODS[m].band]
SCOPES = typing.get_args(gmts.Config.__annotations__["scope"])  # auto, group, batch
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's PPO-clip losses
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")

# -------------------------------------------------------------------------------------------------
# Config [plumbing]
# -------------------------------------------------------------------------------------------------


def refusal(cfg) -> str:
    """Why GMTS selection cannot be exact with this GRPOConfig (module docstring), or ''."""
    if cfg.token_selection == "all":
        return ""
    if cfg.importance_sampling_level != "token":
        return (f"importance_sampling_level={cfg.importance_sampling_level!r}: the ratio is a mean "
                "over all of an answer's tokens, so dropped tokens still get a gradient; "
                "use 'token'")
    if cfg.token_selection not in ("gmts", "gradnorm"):
        return ""
    if cfg.off_policy_mask_threshold is not None:
        return (f"off_policy_mask_threshold with token_selection={cfg.token_selection!r}: omega "
                "does not model TRL's off-policy sequence mask")
    if cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy:
        return (f"the entropy bonus (entropy_coef, use_adaptive_entropy) with token_selection="
                f"{cfg.token_selection!r}: its gradient is not in omega")
    return ""


@dataclass
class GMTSConfig(GRPOConfig):
    """GRPOConfig plus gmts.py's token selection. token_rho replaces TRL's top_entropy_quantile
    (leave that at 1)."""
    token_selection: str = field(
        default="gmts",
        metadata={"help": "all, random, entropy, gmts or gradnorm"})
    token_rho: float = field(
        default=0.2,
        metadata={"help": "share of the valid tokens kept, in (0, 1]"})
    token_scope: str = field(
        default="auto",
        metadata={"help": "group (each prompt's answers), batch (the generation batch) or auto "
                          "(group for gmts), as gmts.py's --scope"})

    def __post_init__(self):
        super().__post_init__()
        if self.token_selection not in SELECT:
            raise gmts.BadInput(f"token_selection {self.token_selection!r} is not one of: "
                                f"{', '.join(SELECT)}")
        if self.token_scope not in SCOPES:
            raise gmts.BadInput(f"token_scope {self.token_scope!r} is not one of: "
                                f"{', '.join(SCOPES)}")
        if not 0.0 < self.token_rho <= 1.0:
            raise gmts.BadInput(f"token_rho must be in (0, 1], got {self.token_rho}")
        if self.top_entropy_quantile < 1.0:
            raise gmts.BadInput("top_entropy_quantile is TRL's own entropy selection; with "
                                "GMTSConfig use token_selection='entropy' and token_rho instead")
        why = refusal(self)
        if why:
            raise gmts.BadInput(f"not supported by gmts_trl.py: {why}")


# -------------------------------------------------------------------------------------------------
# Scores and selection over the generation batch [paper: GMTS score, each prompt's G answers]
# -------------------------------------------------------------------------------------------------


def dz_norm_from(logp: torch.Tensor, log_sum_sq: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """||d log p_y / d logits|| = (1/T) sqrt((1 - p_y)^2 + sum_{j != y} p_j^2) (gmts.py derivation
    step 3) from log p_y and log sum_j p_j^2, the two numbers TRL's fused head gives, instead of
    the (V,) distribution. sum_{j != y} p_j^2 = S - p_y^2 loses digits as p_y -> 1 (clamped at
    0); fine for ranking. (B, T) -> (B, T)."""
    p = logp.float().exp()
    rest = (log_sum_sq.float().exp() - p.square()).clamp_min(0.0)
    return (torch.expm1(logp.float()).square() + rest).sqrt() / temperature


def select_generation_batch(method: str, scores: torch.Tensor, mask: torch.Tensor,
                            rows: torch.Tensor, rho: float, group_size: int, accelerator) -> tuple:
    """gmts.select_tokens (nonzero for gmts and gradnorm) over the generation batch of ALL
    processes, its rows put back in generation order by their global index `rows`: group_size G
    ranks each prompt's G answers (rows G k .. G k + G - 1), 0 the whole batch. scores, mask
    (n, T) and rows (n,) are this process's rows in any order (TRL's shuffle). Returns (this
    process's (n, T) bool keep, the kept share of all valid tokens). Every process must call it
    (three gathers and their pads), as with TRL's get_high_entropy_mask."""
    n, T = mask.shape
    pad = functools.partial(accelerator.pad_across_processes, dim=1)  # to the longest T
    all_scores = accelerator.gather(pad(scores.float().contiguous()))  # (W n, T_max)
    all_mask = accelerator.gather(pad(mask.int().contiguous())).bool()  # (W n, T_max), pads False
    all_rows = accelerator.gather(rows.contiguous())  # (W n,)
    order = torch.argsort(all_rows)  # generation order: a group's G rows next to each other
    if not torch.equal(all_rows[order], torch.arange(len(order), device=order.device)):
        raise RuntimeError("GMTSTrainer: the gathered rows are not one generation batch")
    keep_ordered = gmts.select_tokens(all_scores[order], all_mask[order],
                                      1.0 if method == "all" else rho,
                                      nonzero=not gmts.METHODS[method].zero_kept,
                                      group_size=group_size)  # (W n, T_max)
    keep = torch.empty_like(keep_ordered)
    keep[order] = keep_ordered
    mine = keep[accelerator.process_index * n:(accelerator.process_index + 1) * n, :T]
    return mine, float(keep.sum()) / max(int(all_mask.sum()), 1)

# -------------------------------------------------------------------------------------------------
# The trainer [hooks into trl 1.16 GRPOTrainer; see the module docstring]
# -------------------------------------------------------------------------------------------------


class GMTSTrainer(GRPOTrainer):
    """GRPOTrainer whose token mask is gmts.py's selection (args must be a GMTSConfig)."""

    def __init__(self, *args, **kwargs):
        check_trl()
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, GMTSConfig):
            raise TypeError("GMTSTrainer needs args=GMTSConfig(...)")
        self.token_selection, self.token_rho = self.args.token_selection, self.args.token_rho
        rule = gmts.Config(select=self.token_selection, scope=self.args.token_scope,
                           group_size=self.num_generations)
        self.token_groups = gmts.selection_rule(rule)[1] > 0  # rank within each prompt's group
        # Any value < 1 makes TRL call get_high_entropy_mask; 'all' (gmts.py: rho = 1) leaves
        # TRL's path unmasked.
        self.top_entropy_quantile = 1.0 if self.token_selection == "all" else 0.0
        self._live = None  # what the hook needs from the _compute_loss call in progress
        self._selected = None  # the buffered micro-batches the last selection wrote into
        seed = self.args.seed + 7919 * self.accelerator.process_index
        self._noise = torch.Generator().manual_seed(seed)
        if self.token_selection == "gradnorm":
            self._keep_sum_sq()

    def _keep_sum_sq(self):
        """gradnorm: add TRL's fused head again with log_sum_sq_probs too, and keep that during
        the scoring pass."""
        model = self.model  # as TRL: the base model under PEFT
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        trl.trainer.utils.add_fused_lm_head(model, temperature=self.temperature,
                                            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                                            outputs=("log_probs", "entropy", "log_sum_sq_probs"))
        fused = model.forward

        @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
        def forward(module, *args, **kwargs):
            out = fused(*args, **kwargs)
            if kwargs.get("fused_lm_head") and self._live is not None and "sum_sq" in self._live:
                self._live["sum_sq"].append(out.log_sum_sq_probs.detach())
            return out

        model.forward = types.MethodType(forward, model)

    def _compute_loss(self, model, inputs):
        self._live = dict(inputs=inputs, called=False)
        try:
            loss = super()._compute_loss(model, inputs)
            called = self._live["called"]
        finally:
            self._live = None
        if self.top_entropy_quantile < 1.0 and not called:
            raise RuntimeError(f"trl {trl.__version__} did not call get_high_entropy_mask: no "
                               f"token selection; gmts_trl.py supports trl {', '.join(TESTED_TRL)}")
        return loss

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout, plus each row's global index in the generation batch ("gmts_row"): the
        processes' slices in order, as TRL groups the advantages (row // G is the prompt's group).
        TRL shuffles it with the rows."""
        out = super()._generate_and_score_completions(inputs)
        n = out["completion_ids"].shape[0]
        first = self.accelerator.process_index * n
        out["gmts_row"] = first + torch.arange(n, device=out["completion_ids"].device)  # (n,)
        return out

    def _prepare_inputs(self, generation_batch):
        """TRL's micro-batch; at the start of each pass over a generation batch, the selection
        over all of it (module docstring, 2), written into every buffered micro-batch."""
        inputs = super()._prepare_inputs(generation_batch)
        if self.token_selection == "all":
            return inputs
        if not self.model.training:  # eval: the batch is its own generation batch
            self.select([inputs], self.num_generations_eval)
        elif self._buffered_inputs is not self._selected or \
                self._step % self.args.steps_per_generation == 0:
            self.select(self._buffered_inputs, self.num_generations)
            self._selected = self._buffered_inputs
        return inputs

    def token_statistics(self, inputs: dict) -> tuple:
        """One no-grad forward of a micro-batch through TRL's own path: (logp, entropy, log
        sum_j p_j^2 or None), each (B, T), at the sampling temperature."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        T = inputs["completion_ids"].shape[1]
        self._live = dict(sum_sq=[])
        try:
            with torch.no_grad(), trl.models.utils.disable_gradient_checkpointing(
                    self.model, self.args.gradient_checkpointing_kwargs):
                logp, entropy, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention, T, batch_size=self.args.per_device_train_batch_size,
                    compute_entropy=True)
            sum_sq = torch.cat(self._live["sum_sq"])[:, -T:] if self._live["sum_sq"] else None
        finally:
            self._live = None
        return logp, entropy, sum_sq

    def scores(self, inputs: dict, logp, entropy, sum_sq) -> torch.Tensor:
        """gmts.token_scores of one micro-batch from its statistics. -> (B, T)."""
        mask = self.loss_mask(inputs)
        om = self.omega(inputs, logp, mask)  # (B, T)
        dz_norm = torch.zeros_like(om)
        if self.token_selection == "gradnorm":
            dz_norm = dz_norm_from(logp, sum_sq, self.temperature)
        return gmts.token_scores(self.token_selection, entropy.float(), dz_norm, om, self._noise)

    def select(self, batches: list, group_size: int):
        """Score every micro-batch of a generation batch, select over all of it on all processes
        (select_generation_batch), write "gmts_keep" and "gmts_score" into each micro-batch."""
        scores = [self.scores(b, *self.token_statistics(b)) for b in batches]
        rows = torch.cat([b["gmts_row"] for b in batches])
        mask = torch.cat([self.loss_mask(b) for b in batches])
        keep, kept = select_generation_batch(self.token_selection, torch.cat(scores), mask, rows,
                                             self.token_rho, group_size if self.token_groups else 0,
                                             self.accelerator)
        start = 0
        for b, s in zip(batches, scores):
            b["gmts_keep"], b["gmts_score"] = keep[start:start + len(s)], s
            start += len(s)
        self._metrics["train" if self.model.training else "eval"]["gmts/kept_frac"].append(kept)

    @staticmethod
    def loss_mask(inputs: dict) -> torch.Tensor:
        """The tokens TRL's loss uses: completion_mask (times tool_mask). -> (B, T) bool."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        return mask.bool()

    def _loss_weight(self, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        """The per-token normaliser TRL's loss type puts on a token, up to one constant of the
        step: 1 / |o_i| for grpo and sapo, 1 / (this process's valid tokens of the micro-batch)
        for bnpo, else 1. -> (B, 1) or a number."""
        m = mask.float()
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / m.sum(-1, keepdim=True).clamp(min=1.0)
        if self.loss_type == "bnpo":
            return 1.0 / float(m.sum().clamp(min=1.0))
        return 1.0

    def policy_weight(self, adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                      is_ratio) -> torch.Tensor:
        """-d(per-token policy loss)/dlogp_t of TRL's loss type, before the vLLM ratio, the KL
        term and the normaliser. adv (B, 1), log_ratio (B, T), mask (B, T) bool -> (B, T)."""
        ratio = log_ratio.exp()
        if self.loss_type in CLIPPED_LOSSES:
            om = gmts.omega(adv[:, 0], ratio, self.epsilon_low, self.epsilon_high)
            delta = self.args.delta
            if delta is not None:  # -min(min(r, delta) A, clip(r) A): flat where min(r, delta) wins
                flat = ((adv > 0) & (ratio > delta)) | (
                    (adv < 0) & (ratio > max(delta, 1 + self.epsilon_high)))
                om = torch.where(flat, torch.zeros_like(om), om)
            return om
        if self.loss_type == "cispo":  # -min(r, eps_high).detach() A logp
            return ratio.clamp(max=self.epsilon_high) * adv
        if self.loss_type == "sapo":  # -sigmoid(tau (r - 1)) 4 / tau A
            tau = torch.where(adv > 0, self.args.sapo_temperature_pos,
                              self.args.sapo_temperature_neg)
            s = torch.sigmoid(tau * (ratio - 1))
            return 4 * s * (1 - s) * ratio * adv
        if self.loss_type == "vespo":  # -phi A logp, phi TRL's own (no gradient through it)
            phi = self.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mask.float(),
                importance_sampling_ratio=is_ratio, k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos, k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg)  # (B, 1)
            return phi * adv
        raise ValueError(f"gmts_trl.py has no omega for loss_type {self.loss_type!r}")

    def omega(self, inputs: dict, logp, mask: torch.Tensor) -> torch.Tensor:
        """-dloss/dlogp_t of TRL's loss for a kept token, up to one constant of the step (module
        docstring). logp (B, T) the current log-probs, mask (B, T) bool -> (B, T)."""
        adv = inputs["advantages"].float()  # (B,)
        if adv.dim() != 1:
            raise ValueError("GMTSTrainer needs one advantage per answer, shape (B,)")
        old = inputs.get("old_per_token_logps")
        log_ratio = torch.zeros_like(logp.float()) if old is None else (logp - old).float()
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        is_ratio = inputs.get("importance_sampling_ratio") if vllm_is else None
        om = self.policy_weight(adv[:, None], log_ratio, mask, is_ratio).expand(mask.shape)
        if is_ratio is not None and self.loss_type != "vespo":
            om = om * is_ratio  # TRL scales the token loss by it, so the token's gradient too
        if self.beta != 0.0:  # the KL term's weight: -dk3/dlogp = pi_ref / pi_theta - 1
            ref = inputs["ref_per_token_logps"]
            kl_w = torch.exp(ref - logp) - 1
            if self.args.use_bias_correction_kl:  # TRL's k3 r: -d(r k3)/dlogp = r (e^d - 1 - k3)
                kl_w = log_ratio.exp() * (kl_w - gmts.k3_kl(logp, ref))
            om = om + self.beta * kl_w
        return om * self._loss_weight(inputs, mask)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor,
                              threshold: float) -> torch.Tensor:
        """TRL's mask hook, answered with the micro-batch's gmts_keep (the selection over its
        generation batch); entropies and threshold are not used. mask (B, T) -> (B, T) bool."""
        if self._live is None:
            raise RuntimeError("GMTSTrainer.get_high_entropy_mask needs the inputs of a "
                               "_compute_loss call")
        self._live["called"] = True
        keep = self._live["inputs"].get("gmts_keep")
        if keep is None or keep.shape != mask.shape:
            raise RuntimeError("GMTSTrainer: the micro-batch carries no kept mask (gmts_keep) of "
                               "its shape: was it selected in _prepare_inputs?")
        return keep & mask.bool()

# -------------------------------------------------------------------------------------------------
# Tasks as TRL data and reward functions [plumbing]
# -------------------------------------------------------------------------------------------------


def make_reward(task: str):
    """A TRL reward function from a gmts.py verifier; TRL passes the dataset's 'row' column (JSON)
    as a keyword argument."""
    score = gmts.get_task(task)["reward"]

    def reward(prompts, completions, row, **kwargs):
        return [score(c, json.loads(r)) for c, r in zip(completions, row)]

    reward.__name__ = f"{task}_reward"  # TRL logs it as rewards/<name>/mean
    return reward


def make_dataset(tok, task: str, rows: list, chat: bool, short: bool = False):
    """Rows -> datasets.Dataset with 'prompt' (gmts.build_prompts: a plain string ending inside
    <think>, which TRL tokenizes as is) and 'row' (the row as JSON, for make_reward)."""
    import datasets
    import jinja2

    try:
        prompts = gmts.build_prompts(tok, gmts.get_task(task), rows, chat, short)
    except jinja2.TemplateError as e:  # the model's own template refuses them (a system role)
        raise gmts.BadInput(f"the model's chat template fails on the prompts "
                            f"({gmts.error_line(e, 300)})") from None
    return datasets.Dataset.from_list([{"prompt": p, "row": json.dumps(r)}
                                       for p, r in zip(prompts, rows)])

# -------------------------------------------------------------------------------------------------
# The output folder [plumbing]: a gmts_trl run is TRL's checkpoints; --overwrite removes RUN_NAMES
# -------------------------------------------------------------------------------------------------


LOCK = ".gmts_trl.lock"  # filelock's file: one process writes an --out at a time
# Exactly the names TRL 1.16.0's Trainer writes into output_dir (checkpoints every save_steps,
# then save_model: the model, its tokenizer, training_args.bin, the model card README.md): the
# only entries --overwrite removes. checkpoint-N is a folder, every other name a file.
RUN_NAMES = re.compile(
    r"checkpoint-\d+|README\.md|training_args\.bin|config\.json|generation_config\.json"
    r"|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|tokenizer\.model|chat_template\.jinja"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt")


def run_names(out: str) -> list:
    """The entries of out that a gmts_trl run writes: RUN_NAMES, checkpoints as folders only."""
    return sorted(n for n in os.listdir(out) if RUN_NAMES.fullmatch(n)
                  and os.path.isdir(os.path.join(out, n)) == n.startswith("checkpoint-"))


def checkpoints(out: str) -> list:
    """TRL's complete checkpoint-N folders in out (trainer_state.json, saved last), oldest
    first."""
    names = os.listdir(out) if os.path.isdir(out) else []
    done = [n for n in names if re.fullmatch(r"checkpoint-\d+", n)
            and os.path.isfile(os.path.join(out, n, "trainer_state.json"))]
    return sorted(done, key=lambda n: int(n.split("-")[1]))


def check_out(out: str, model: str, overwrite: bool):
    """BadInput unless a run may write in out: not a file, not (nor holding) the --model folder;
    new, empty, or holding a gmts_trl run (a TRL checkpoint), which only --overwrite replaces."""
    real = os.path.realpath(out)
    if not out or os.path.exists(out) and not os.path.isdir(out):
        raise gmts.BadInput(f"--out {out!r} must name a folder")
    if os.path.isdir(model) and os.path.commonpath([real, os.path.realpath(model)]) == real:
        raise gmts.BadInput(f"--out {out} is or holds the --model folder {model}: the run "
                            "would replace it")
    if os.path.isdir(out) and set(os.listdir(out)) - {LOCK} and not checkpoints(out):
        raise gmts.BadInput(f"--out {out} holds files that are not a gmts_trl run; choose "
                            "another --out")
    if checkpoints(out) and not overwrite:
        raise gmts.BadInput(f"--out {out} holds a gmts_trl run: replace it with --overwrite, or "
                            "choose another --out")


def claim_out(out: str, model: str, overwrite: bool):
    """out locked for this process (filelock) -> the held lock (a context manager); checked again
    under the lock (a run may have ended there meanwhile), and with --overwrite cleared of
    run_names, nothing else."""
    os.makedirs(out, exist_ok=True)
    try:
        held = filelock.FileLock(os.path.join(out, LOCK), timeout=0).acquire()
    except filelock.Timeout:
        raise gmts.BadInput(f"--out {out}: another process writes there now") from None
    check_out(out, model, overwrite)
    if overwrite:
        gmts.remove_names(out, run_names(out))  # exact names: fnmatch patterns of themselves
    return held


def kept(out: str) -> str:
    """What a run stopped early leaves in out, for run_cli's line."""
    done = checkpoints(out)
    return f"; {out} keeps {done[-1]}" if done else f"; {out} holds no checkpoint of TRL's yet"

# -------------------------------------------------------------------------------------------------
# CLI [plumbing]
# -------------------------------------------------------------------------------------------------


ROWS_CAP = 65_536  # problems built up front at most (gen: ~6 s); TRL goes over them epoch by epoch
LOWER = "--per-device-batch-size or --max-completion-length"  # the flags that take less memory


def parse_args(argv=None) -> argparse.Namespace:
    """Flags -> Namespace; every range and the output folder are checked here, before any
    work."""
    p = argparse.ArgumentParser(prog="gmts_trl.py", description="GRPO + GMTS token selection on "
                                                                "TRL (see the docstring).")
    p.error = gmts.bad_flag
    a = p.add_argument
    a("--model", default="tiny",
      help="'tiny' (built offline), a short Qwen name, a hub id or a local folder")
    a("--task", default="countdown", choices=sorted(gmts.TASKS))
    a("--data", default="gen", help="gen, easy, hf:ID[:CONFIG][:SPLIT] or a data file (as gmts.py)")
    a("--short-prompt", action="store_true",
      help="terse prompts, no system line (for the tiny model)")
    a("--select", default="gmts", choices=SELECT, help="token selection method")
    a("--rho", type=float, default=0.2, help="share of the valid tokens kept")
    a("--scope", default="auto", choices=SCOPES, help="group, batch or auto (group for gmts)")
    a("--steps", type=int, default=200, help="optimizer steps")
    a("--out", default="out/trl",
      help="output folder (checkpoints every 50 steps, the final model)")
    a("--overwrite", action="store_true",
      help="replace the gmts_trl run in --out (only the files a run writes)")
    a("--num-generations", type=int, default=8, help="G, answers per prompt")
    a("--per-device-batch-size", type=int, default=8,
      help="answers per process per micro-batch (the selection pool)")
    a("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    a("--max-completion-length", type=int, default=256, help="new tokens per answer at most")
    a("--lr", type=float, default=1e-6)
    a("--loss-type", default="dapo", choices=LOSS_TYPES, help="TRL loss_type")
    a("--use-vllm", action="store_true",
      help="generate with vLLM colocated with training (vllm_mode='colocate')")
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ranges = [("rho", 0 < args.rho <= 1, "in (0, 1]"), ("steps", args.steps >= 1, ">= 1"),
              ("num-generations", args.num_generations >= 2, ">= 2 (an advantage needs a group)"),
              ("per-device-batch-size", args.per_device_batch_size >= 1, ">= 1"),
              ("grad-accum", args.grad_accum >= 1, ">= 1"),
              ("lr", math.isfinite(args.lr) and args.lr > 0, "finite and > 0"),
              ("max-completion-length", args.max_completion_length >= 1, ">= 1"),
              ("seed", 0 <= args.seed < 2**32, "in [0, 2**32)")]  # numpy's range (TRL seeds it)
    for flag, ok, need in ranges:
        if not ok:
            value = getattr(args, flag.replace("-", "_"))
            raise gmts.BadInput(f"--{flag} must be {need}, got {value}")
    if args.use_vllm and not is_vllm_available():  # else TRL's ImportError, a traceback
        raise gmts.BadInput("--use-vllm: vLLM is not installed (pip install vllm)")
    check_out(args.out, args.model, args.overwrite)
    return args


def build_trainer(args: argparse.Namespace) -> GMTSTrainer:
    """Flags -> a GMTSTrainer. ValueError: bad input (data, the model, TRL's own checks). Cheap
    checks first: the config, the data, then the model."""
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():  # TRL's gradient_checkpointing=True: a transformers warning
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        cfg = GMTSConfig(
            output_dir=args.out, seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=args.per_device_batch_size,
            gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
            max_completion_length=args.max_completion_length, loss_type=args.loss_type,
            epsilon=0.2, epsilon_high=0.28,  # gmts.py's clip (TRL: epsilon_high = epsilon)
            lr_scheduler_type="linear", warmup_steps=10,  # as gmts.py: 10 warm-up steps, decay
            use_vllm=args.use_vllm, vllm_mode="colocate", token_selection=args.select,
            token_rho=args.rho, token_scope=args.scope, use_cpu=not cuda,
            bf16=cuda and torch.cuda.is_bf16_supported(), report_to=[], logging_steps=1,
            save_strategy="steps", save_steps=50)
    per_step = cfg.generation_batch_size // cfg.num_generations  # prompts a step, all processes
    n = min(max(2000, args.steps * per_step), ROWS_CAP)
    rows = gmts.load_rows(args.task, args.data, n, args.seed)
    distinct = len({gmts.get_task(args.task)["prompt"](r) for r in rows})
    if distinct < per_step:  # TRL's sampler drops an incomplete batch: 0 steps, exit 0
        raise gmts.BadInput(f"--data {args.data}: {distinct} distinct problem(s), but one step "
                            f"takes {per_step} (--per-device-batch-size x --grad-accum x "
                            "processes / --num-generations)")
    # on the CPU in fp32, as TRL loads a path when distributed; accelerate moves it to the device
    model, tok = gmts.load_model(args.model, torch.device("cpu"), seed=args.seed)
    data = make_dataset(tok, args.task, rows, gmts.use_chat(tok), args.short_prompt)
    return GMTSTrainer(model=model, reward_funcs=make_reward(args.task), args=cfg,
                       train_dataset=data, processing_class=tok)


def main(argv=None):
    args = None

    def command():
        nonlocal args
        args = parse_args(argv)
        trainer = build_trainer(args)  # every input loaded before anything is written in --out
        # the one writing process claims --out (accelerate launch starts one process per GPU)
        held = claim_out(args.out, args.model, args.overwrite) if trainer.args.should_save else None
        with held or contextlib.nullcontext():
            trainer.train()
            if trainer.state.global_step < args.steps:  # never a silent exit 0 after fewer steps
                raise gmts.RunError(f"trained {trainer.state.global_step} of {args.steps} steps: "
                                    "TRL ran out of batches; the final model was not saved")
            trainer.save_model(args.out)

    gmts.run_cli("gmts_trl", command, kept=lambda: kept(args.out) if args else "", lower=LOWER)


if __name__ == "__main__":
    main()
