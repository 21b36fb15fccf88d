"""
gmts_trl.py: GMTS token selection inside TRL's GRPOTrainer, for multi-GPU and vLLM runs.

gmts.py is the reference, to be read beside the papers. This file reuses its tasks, verifiers, prompts, scores
(gmts.token_scores, gmts.omega) and selection (gmts.select_tokens) and leaves rollout (HF generate or vLLM), loss,
optimiser and distribution (accelerate, DeepSpeed) to TRL. No TRL loss code is copied: the subclass only hooks in.

TRL versions: tested with trl 1.16.0 only. GMTSTrainer raises RuntimeError at construction if a method it overrides
is missing or has another signature, warns on any other version, and raises at the first loss if TRL did not call
the mask hook, so a run never goes on without selection unnoticed.

The hook (trl 1.16.0, GRPOTrainer._compute_loss):
  1. TRL calls self.get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile) when top_entropy_quantile < 1 and
     multiplies the per-token loss by the mask it returns. GMTSTrainer sets top_entropy_quantile = 0 only to get that
     call, and overrides the method with gmts.select_tokens over gmts.token_scores. H is TRL's entropy, from the same
     forward as the loss's log-probs, at the sampling temperature.
  2. A _compute_loss override (calls super) hands the hook the micro-batch's inputs: "advantages" (B,),
     "old_per_token_logps" when TRL has them, "importance_sampling_ratio" with vLLM; a
     _get_per_token_logps_and_entropies override (calls super) the current log-probs. omega is -dloss/dlogp_t of
     the loss TRL runs (gmts.py's derivation step 1): ratio * A, 0 where the clip is active (gmts.omega with
     TRL's epsilon_low / epsilon_high; ratio = 1 without old log-probs, as in TRL's loss), times the vLLM
     importance ratio when TRL applies it, plus with beta > 0 the k3 KL term's beta (pi_ref / pi_theta - 1)
     (with use_bias_correction_kl, TRL's default, k3 * ratio's: beta r (pi_ref / pi_theta - 1 - k3); with
     importance_sampling_level="sequence" the ratio's spread over the row is not modelled), times the loss type's
     per-token normaliser: 1 / |o_i| for grpo and sapo, 1 / (this process's valid tokens) for bnpo; the other
     types' normalisers are one constant for every token of the step, which no ranking sees, and are left out.
  3. gradnorm needs sum_j p_j^2 too. TRL's fused LM head can return log sum_j p_j^2 ("log_sum_sq_probs") but
     GRPOTrainer doesn't ask for it, so with token_selection="gradnorm" the head is added again with that output and
     the forward is wrapped to keep it (one more vocabulary reduction per token).

Across processes: TRL's get_high_entropy_mask gathers the micro-batch's valid-token entropies from every process and
keeps the tokens at or above one global quantile. Here every process gathers all valid-token scores (accelerate
pad_across_processes + gather), runs gmts.select_tokens on the whole pool (the same result everywhere) and keeps its
own slice. The scope (token_scope, as gmts.py's --scope; auto: group for gmts) is either the pool: exactly
ceil(rho * n) of its n valid tokens (ties: lower process first, then earlier position; TRL's quantile keeps every
tie), or each prompt's group, by the GMTS authors' rule. A group is the num_generations answers of one prompt:
_generate_and_score_completions labels every row with its group (global row // num_generations, the order TRL's
advantages are grouped in), and the labels travel through TRL's shuffle with the rows. TRL's shuffle spreads a
group's rows over the micro-batches of a step, so a group is ranked among its rows in the micro-batch at hand. The
pool is one micro-batch per process, not gmts.py's whole rollout batch. As in gmts.train, gmts and gradnorm then drop
kept tokens whose score is 0 (A = 0 or clipped).

Loss normalisation: TRL multiplies the per-token loss by the mask and never divides by the kept-token count: the
normaliser is the completion mask (or a constant), for every loss type. With the default loss_type="dapo" that is the
sum over kept tokens / all valid completion tokens of the generation batch on all processes (the optimizer step's
batch with the default steps_per_generation = gradient_accumulation_steps), i.e. gmts.py's default --loss-norm all:
at rho = 0.2 a step is about 1/5 of an unmasked one. gmts.py's --loss-norm selected has no TRL counterpart.

Run:  python gmts_trl.py --model tiny --short-prompt --steps 20                  (offline, CPU)
      accelerate launch --num_processes 8 gmts_trl.py --model Qwen2.5-1.5B-Instruct --task math --use-vllm
"""
import os
import signal

if __name__ == "__main__":  # a stop signal while torch and TRL import (seconds): one line, not a traceback
    def _stopped_while_starting(*_):
        os.write(2, b"gmts_trl: error: interrupted while starting\n")
        os._exit(130)
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _stopped_while_starting)

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse
import functools
import inspect
import json
import math
import re
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass, field

import torch
import trl
from trl import GRPOConfig, GRPOTrainer

import gmts

TESTED_TRL = ("1.16.0",)
METHODS = gmts.CHOICES["select"]  # all, random, entropy, gmts, gradnorm
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's PPO-clip losses; for the others omega = ratio * A
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")

# ---------------------------------------------------------------------------------------------------------------
# Config and version guard [plumbing]
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GMTSConfig(GRPOConfig):
    """GRPOConfig plus gmts.py's token selection. token_rho replaces TRL's top_entropy_quantile (leave that at 1)."""
    token_selection: str = field(default="gmts", metadata={"help": "all, random, entropy, gmts or gradnorm"})
    token_rho: float = field(default=0.2, metadata={"help": "share of the valid tokens kept, in (0, 1]"})
    token_scope: str = field(default="auto", metadata={"help": "group (each prompt's answers), batch (the pool) or "
                                                               "auto (group for gmts), as gmts.py's --scope"})

    def __post_init__(self):
        super().__post_init__()
        if self.token_selection not in METHODS:
            raise ValueError(f"token_selection {self.token_selection!r} is not one of: {', '.join(METHODS)}")
        if self.token_scope not in gmts.CHOICES["scope"]:
            raise ValueError(f"token_scope {self.token_scope!r} is not one of: {', '.join(gmts.CHOICES['scope'])}")
        if not 0.0 < self.token_rho <= 1.0:
            raise ValueError(f"token_rho must be in (0, 1], got {self.token_rho}")
        if self.top_entropy_quantile < 1.0:
            raise ValueError("top_entropy_quantile is TRL's own entropy selection; with GMTSConfig use "
                             "token_selection='entropy' and token_rho instead")


def check_trl():
    """RuntimeError if a hook this file overrides is gone or changed; a warning on an untested TRL version."""
    want = {"get_high_entropy_mask": ["self", "entropies", "mask", "threshold"],
            "_compute_loss": ["self", "model", "inputs"],
            "_get_per_token_logps_and_entropies": None}
    for name, params in want.items():
        fn = getattr(GRPOTrainer, name, None)
        if fn is None or (params and list(inspect.signature(fn).parameters) != params):
            raise RuntimeError(f"trl {trl.__version__}: GRPOTrainer.{name} is missing or changed; gmts_trl.py needs "
                               f"the hooks of trl 1.16 (tested: {', '.join(TESTED_TRL)})")
    if trl.__version__ not in TESTED_TRL:
        warnings.warn(f"gmts_trl.py was tested with trl {', '.join(TESTED_TRL)}, not {trl.__version__}")

# ---------------------------------------------------------------------------------------------------------------
# Scores and global top-rho selection [paper: GMTS score, over the processes' micro-batches]
# ---------------------------------------------------------------------------------------------------------------


def grad_norm_from(logp: torch.Tensor, log_sum_sq: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """||d log p_y / d logits|| = (1/T) sqrt((1 - p_y)^2 + sum_{j != y} p_j^2) (gmts.py derivation step 3) from
    log p_y and log sum_j p_j^2, the two numbers TRL's fused head gives, instead of the (V,) distribution.
    sum_{j != y} p_j^2 = S - p_y^2 loses digits as p_y -> 1 (clamped at 0); fine for ranking. (B, T) -> (B, T)."""
    p = logp.float().exp()
    rest = (log_sum_sq.float().exp() - p.square()).clamp_min(0.0)
    return (torch.expm1(logp.float()).square() + rest).sqrt() / temperature


def select_global(method: str, scores: torch.Tensor, mask: torch.Tensor, rho: float, accelerator, groups=None):
    """gmts.select_tokens (nonzero for gmts/gradnorm) over the valid tokens of ALL processes; with groups (B,), each
    row's group label, within each group instead of over the pool. Returns (this process's (B, T) bool mask, the
    kept share of the global pool). Every process must call it (two gathers, three with groups), as with TRL's
    get_high_entropy_mask."""
    local = scores[mask].float()  # (n,) this process's valid tokens, row-major
    counts = accelerator.gather(torch.tensor([local.numel()], device=local.device))  # (W,)
    pool = accelerator.gather(accelerator.pad_across_processes(local, dim=0)).view(counts.numel(), -1)  # (W, L)
    valid = torch.arange(pool.shape[1], device=pool.device)[None, :] < counts[:, None]  # (W, L)
    labels = None
    if groups is not None:  # each token's group, gathered as the scores are
        local_groups = groups[:, None].expand(mask.shape)[mask]  # (n,)
        labels = accelerator.gather(accelerator.pad_across_processes(local_groups, dim=0)).view(pool.shape)
    keep = gmts.select_tokens(pool, valid, 1.0 if method == "all" else rho, nonzero=method in ("gmts", "gradnorm"),
                              groups=labels)  # (W, L), the same on every process
    sel = torch.zeros_like(mask)
    sel[mask] = keep[accelerator.process_index, :local.numel()]
    return sel, float(keep.sum()) / max(int(valid.sum()), 1)

# ---------------------------------------------------------------------------------------------------------------
# The trainer [hooks into trl 1.16 GRPOTrainer._compute_loss; see the module docstring]
# ---------------------------------------------------------------------------------------------------------------


class GMTSTrainer(GRPOTrainer):
    """GRPOTrainer whose token mask is gmts.py's selection (args must be a GMTSConfig)."""

    def __init__(self, *args, **kwargs):
        check_trl()
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, GMTSConfig):
            raise TypeError("GMTSTrainer needs args=GMTSConfig(...)")
        self.token_selection, self.token_rho = self.args.token_selection, self.args.token_rho
        rule = gmts.Config(select=self.token_selection, scope=self.args.token_scope, group_size=self.num_generations)
        self.token_groups = gmts.selection_rule(rule)[1] > 0  # rank within each prompt's group
        # Any value < 1 makes TRL call get_high_entropy_mask; 'all' (gmts.py: rho = 1) leaves TRL's path unmasked.
        self.top_entropy_quantile = 1.0 if self.token_selection == "all" else 0.0
        self._live = None  # what the hook needs from the _compute_loss call in progress
        self._noise = torch.Generator().manual_seed(self.args.seed + 7919 * self.accelerator.process_index)
        if self.token_selection == "gradnorm":
            self._keep_sum_sq()

    def _keep_sum_sq(self):
        """gradnorm: add TRL's fused head again with log_sum_sq_probs too, and keep that during _compute_loss."""
        from trl.trainer.utils import add_fused_lm_head

        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # as TRL: PEFT
        add_fused_lm_head(model, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy", "log_sum_sq_probs"))
        fused = model.forward

        @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
        def forward(module, *args, **kwargs):
            out = fused(*args, **kwargs)
            if kwargs.get("fused_lm_head") and self._live is not None:
                self._live["sum_sq"].append(out.log_sum_sq_probs.detach())
            return out

        model.forward = types.MethodType(forward, model)

    def _compute_loss(self, model, inputs):
        self._live = dict(inputs=inputs, logps=[], sum_sq=[], called=False)
        try:
            loss = super()._compute_loss(model, inputs)
            called = self._live["called"]
        finally:
            self._live = None
        if self.top_entropy_quantile < 1.0 and not called:
            raise RuntimeError(f"trl {trl.__version__} did not call get_high_entropy_mask: no token selection; "
                               f"gmts_trl.py supports trl {', '.join(TESTED_TRL)}")
        return loss

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout, plus each row's group: the global row index // num_generations (the rows of a generation
        batch are the processes' slices in order, as TRL groups the advantages). TRL shuffles it with the rows."""
        out = super()._generate_and_score_completions(inputs)
        n = out["completion_ids"].shape[0]
        rows = self.accelerator.process_index * n + torch.arange(n, device=out["completion_ids"].device)
        out["gmts_group"] = rows // self.num_generations  # (n,)
        return out

    def _loss_weight(self, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        """The per-token normaliser TRL's loss type puts on a token, up to one constant of the step: 1 / |o_i| for
        grpo and sapo, 1 / (this process's valid tokens) for bnpo, else 1. -> (B, 1) or a number."""
        m = mask.float()
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / m.sum(-1, keepdim=True).clamp(min=1.0)
        if self.loss_type == "bnpo":
            return 1.0 / float(m.sum().clamp(min=1.0))
        return 1.0

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._live is not None:
            self._live["logps"].append(out[0].detach())
        return out

    def _ratio(self, inputs: dict, logp, mask: torch.Tensor) -> torch.Tensor:
        """pi_theta / pi_old as TRL's loss uses it: 1 without old log-probs; per token, or per answer with
        importance_sampling_level='sequence' (exp of the mean log-ratio over its valid tokens). -> (B, T)."""
        old = inputs.get("old_per_token_logps")
        if old is None or logp is None:
            return torch.ones(mask.shape, device=mask.device)
        log_ratio = (logp - old).float()  # (B, T)
        if self.importance_sampling_level == "sequence":
            m = mask.float()
            log_ratio = ((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
            log_ratio = log_ratio.expand(mask.shape)
        return log_ratio.exp()

    def omega(self, inputs: dict, logp, mask: torch.Tensor) -> torch.Tensor:
        """-dloss/dlogp_t of TRL's loss for a kept token, up to one constant of the step (module docstring, 2).
        logp (B, T) the current log-probs (None: ratio 1, no KL), mask (B, T) bool -> (B, T)."""
        adv = inputs["advantages"].float()  # (B,)
        if adv.dim() != 1:
            raise ValueError("GMTSTrainer needs one advantage per answer, shape (B,)")
        clip = (self.epsilon_low, self.epsilon_high) if self.loss_type in CLIPPED_LOSSES else (math.inf, math.inf)
        ratio = self._ratio(inputs, logp, mask)  # (B, T)
        om = gmts.omega(adv, ratio, *clip)  # (B, T)
        is_ratio = inputs.get("importance_sampling_ratio")
        if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo" \
                and is_ratio is not None:
            om = om * is_ratio  # TRL scales the token loss by it, so the token's gradient too
        if self.beta != 0.0 and logp is not None:  # the KL term's weight: -dk3/dlogp = pi_ref / pi_theta - 1
            d = inputs["ref_per_token_logps"] - logp
            kl_w = torch.exp(d) - 1
            if self.args.use_bias_correction_kl:  # TRL's k3 * ratio: -d(r k3)/dlogp = r (e^d - 1 - k3)
                kl_w = ratio * (kl_w - gmts.k3_kl(logp, inputs["ref_per_token_logps"]))
            om = om + self.beta * kl_w
        return om * self._loss_weight(inputs, mask)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's mask hook, answered with gmts.py's selection; threshold (1 - top_entropy_quantile) is not used.
        entropies, mask (B, T) -> (B, T) bool."""
        if self._live is None:
            raise RuntimeError("GMTSTrainer.get_high_entropy_mask needs the inputs of a _compute_loss call")
        self._live["called"] = True
        inputs, mask, T = self._live["inputs"], mask.bool(), entropies.shape[1]
        logp = torch.cat(self._live["logps"])[:, -T:] if self._live["logps"] else None  # (B, T)
        om = self.omega(inputs, logp, mask)  # (B, T)
        gn = torch.zeros_like(om)
        if self.token_selection == "gradnorm":
            gn = grad_norm_from(logp, torch.cat(self._live["sum_sq"])[:, -T:], self.temperature)
        scores = gmts.token_scores(self.token_selection, entropies.detach().float(), gn, om, self._noise)  # (B, T)
        groups = inputs.get("gmts_group") if self.token_groups else None
        if self.token_groups and groups is None:
            raise RuntimeError("GMTSTrainer: the micro-batch carries no group labels (gmts_group) for the group scope")
        sel, kept = select_global(self.token_selection, scores, mask, self.token_rho, self.accelerator, groups)
        self._metrics["train" if self.model.training else "eval"]["gmts/kept_frac"].append(kept)
        return sel

# ---------------------------------------------------------------------------------------------------------------
# Tasks as TRL data and reward functions [plumbing]
# ---------------------------------------------------------------------------------------------------------------


def make_reward(task: str):
    """A TRL reward function from a gmts.py verifier; TRL passes the dataset's 'row' column (JSON) as a kwarg."""
    score = gmts.get_task(task)["reward"]

    def reward(prompts, completions, row, **kwargs):
        return [score(c, json.loads(r)) for c, r in zip(completions, row)]

    reward.__name__ = f"{task}_reward"  # TRL logs it as rewards/<name>/mean
    return reward


def make_dataset(tok, task: str, rows: list, chat: bool, short: bool = False):
    """Rows -> datasets.Dataset with 'prompt' (gmts.build_prompts: a plain string ending inside <think>, which TRL
    tokenizes as is) and 'row' (the row as JSON, for make_reward)."""
    import datasets

    prompts = gmts.checked_prompts(tok, gmts.get_task(task), rows, chat, short)  # a failing template: ValueError
    return datasets.Dataset.from_list([{"prompt": p, "row": json.dumps(r)} for p, r in zip(prompts, rows)])

# ---------------------------------------------------------------------------------------------------------------
# CLI [plumbing]
# ---------------------------------------------------------------------------------------------------------------


ROWS_CAP = 65_536  # problems built up front at most (gen: ~6 s); TRL then goes over them again, epoch by epoch
LOWER = "--per-device-batch-size or --max-completion-length"  # the flags that take less memory


def die(msg, code: int = 2):
    """Bad input: one line on stderr (gmts.error_line of msg, a message or an exception) and a non-zero exit (2:
    input, 1: a model that cannot be loaded, memory), no traceback."""
    print(f"gmts_trl: error: {gmts.error_line(msg)}", file=sys.stderr)
    sys.exit(code)


def fail(e: Exception, code: int, keeps: str):
    """die for an exception: memory first (exit 1, then `keeps`: what the run keeps), else its one line and `code`."""
    why = gmts.memory_fault(e, LOWER)
    die(why + keeps if why else e, 1 if why else code)


def kept(out: str) -> str:
    """What a run stopped early leaves in `out`: TRL's newest checkpoint-N folder, if any."""
    found = [n for n in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", n)] if os.path.isdir(out) else []
    if not found:
        return f"{out} holds no checkpoint-N folder of TRL's yet"
    return f"{out} keeps {max(found, key=lambda n: int(n.split('-')[1]))}"


def check_out(out: str, overwrite: bool = False, model: str = ""):
    """ValueError unless --out is (or can be made) a writable folder holding no earlier run (unless overwrite), and
    gmts.check_out allows it: no file there that this run writes unless from an earlier gmts_trl.py run, no other
    live writer, not the --model folder nor in warm/."""
    if not out.strip():
        raise ValueError("--out must not be empty")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is an existing file, not a folder")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):  # the nearest folder that exists: it must be a folder we can write in
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out}: {parent} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=parent):  # a real write (os.access says yes to root on a read-only mount)
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {parent} ({e.strerror or gmts.error_line(e, 200)})") from None
    gmts.check_out(out, "trl", model, overwrite)  # its own earlier run needs --overwrite; any other output refused


def parse_args(argv=None) -> argparse.Namespace:
    """Flags -> Namespace; every range is checked here, before any work (one line and exit 2 otherwise)."""
    p = argparse.ArgumentParser(prog="gmts_trl.py",
                                description="GRPO + GMTS token selection on TRL (see the docstring).")
    p.error = die  # one line and exit 2, no usage dump
    a = p.add_argument
    a("--model", default="tiny", help="'tiny' (built offline), a short Qwen name, a hub id or a local folder")
    a("--task", default="countdown", choices=sorted(gmts.TASKS))
    a("--data", default="gen", help="gen, easy, hf, hf:test or a .jsonl path (as gmts.py)")
    a("--short-prompt", action="store_true", help="terse prompts, no system line (for the tiny model)")
    a("--select", default="gmts", choices=METHODS, help="token selection method")
    a("--rho", type=float, default=0.2, help="share of the valid tokens kept")
    a("--scope", default="auto", choices=gmts.CHOICES["scope"], help="group, batch or auto (group for gmts)")
    a("--steps", type=int, default=200, help="optimizer steps")
    a("--out", default="out/trl", help="output folder (checkpoints every 50 steps, the final model)")
    a("--overwrite", action="store_true", help="write into an --out that already holds a run")
    a("--num-generations", type=int, default=8, help="G, answers per prompt")
    a("--per-device-batch-size", type=int, default=8, help="answers per process per micro-batch (the selection pool)")
    a("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    a("--max-completion-length", type=int, default=256, help="new tokens per answer at most")
    a("--lr", type=float, default=1e-6)
    a("--loss-type", default="dapo", choices=LOSS_TYPES, help="TRL loss_type")
    a("--use-vllm", action="store_true", help="generate with vLLM colocated with training (vllm_mode='colocate')")
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag, ok, need in [("rho", 0 < args.rho <= 1, "in (0, 1]"), ("steps", args.steps >= 1, ">= 1"),
                           ("num-generations", args.num_generations >= 2, ">= 2 (an advantage needs a group)"),
                           ("per-device-batch-size", args.per_device_batch_size >= 1, ">= 1"),
                           ("grad-accum", args.grad_accum >= 1, ">= 1"),
                           ("lr", math.isfinite(args.lr) and args.lr > 0, "finite and > 0"),
                           ("max-completion-length", args.max_completion_length >= 1, ">= 1"),
                           ("seed", 0 <= args.seed < 2**32, "in [0, 2**32)")]:  # numpy's seed range (TRL seeds it)
        if not ok:
            die(f"--{flag} must be {need}, got {getattr(args, flag.replace('-', '_'))}")
    try:
        check_out(args.out, args.overwrite, args.model)
    except ValueError as e:
        die(str(e))
    return args


def load_hub_model(path: str, cfg: GMTSConfig):
    """A local folder or hub id -> (tokenizer, max positions or None, a loader for the model), as TRL would load it
    from the name (fp32; no device_map when distributed). OSError with one line if any part cannot be loaded."""
    from transformers import AutoConfig, AutoTokenizer
    from trl.trainer.utils import create_model_from_path

    def why(e: Exception) -> Exception:
        if gmts.memory_fault(e):  # not the model's fault: raised as it is
            return e
        hint = "" if os.path.isdir(path) else "; try --model tiny for an offline run"
        return OSError(f"cannot load model '{path}': {gmts.error_line(e, 200).rstrip('.')}{hint}")

    try:
        tok = AutoTokenizer.from_pretrained(path)
        gmts.check_tokenizer(tok)
        positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except Exception as e:  # OSError, ValueError, a damaged json, ...: whatever it is, the folder is unusable
        raise why(e) from None
    kw = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kw["device_map"] = None

    def load():
        try:
            return create_model_from_path(path, **kw)
        except Exception as e:  # no weights, truncated safetensors, an unknown architecture
            raise why(e) from None

    return tok, positions, load


def build_trainer(args: argparse.Namespace) -> GMTSTrainer:
    """Flags -> a GMTSTrainer. ValueError: bad input (data, lengths, TRL's own checks); OSError: a model that cannot
    be loaded. Cheap checks first: the config, the data, the tokenizer and positions, then the weights."""
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():  # TRL's default gradient_checkpointing=True trips a transformers deprecation
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        cfg = GMTSConfig(
            output_dir=args.out, seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=args.per_device_batch_size, gradient_accumulation_steps=args.grad_accum,
            num_generations=args.num_generations, max_completion_length=args.max_completion_length,
            loss_type=args.loss_type, epsilon=0.2, epsilon_high=0.28,  # gmts.py's clip (TRL: epsilon_high = epsilon)
            lr_scheduler_type="linear", warmup_steps=10,  # as gmts.py: 10 warm-up steps, then a linear decay
            use_vllm=args.use_vllm, vllm_mode="colocate", token_selection=args.select, token_rho=args.rho,
            token_scope=args.scope,
            use_cpu=not cuda, bf16=cuda and torch.cuda.is_bf16_supported(), report_to=[], logging_steps=1,
            save_strategy="steps", save_steps=50)
    per_step = cfg.generation_batch_size // cfg.num_generations  # prompts per optimizer step, all processes
    task = gmts.get_task(args.task)
    rows = task["load"](args.data, min(max(2000, args.steps * per_step), ROWS_CAP), args.seed)
    distinct = len({task["prompt"](r) for r in rows})
    if distinct < per_step:  # TRL's sampler drops an incomplete batch: it would train 0 steps and exit 0
        raise ValueError(f"--data {args.data}: {distinct} distinct problem(s), but one step takes {per_step} "
                         "(--per-device-batch-size x --grad-accum x processes / --num-generations)")
    if args.model == "tiny":
        model, tok = gmts.build_tiny(seed=args.seed)
        positions, load = model.config.max_position_embeddings, lambda: model
    else:
        tok, positions, load = load_hub_model(gmts.resolve_model_name(args.model), cfg)
    data = make_dataset(tok, args.task, rows, gmts.use_chat(tok), args.short_prompt)
    if positions:  # the longest prompts by characters, in tokens (tokenizing every row costs seconds)
        longest = max(len(ids) for ids in tok(sorted(data["prompt"], key=len)[-16:])["input_ids"])
        if longest + args.max_completion_length > positions:
            raise ValueError(f"--max-completion-length {args.max_completion_length} plus the longest prompt "
                             f"({longest} tokens) is more than the model's {positions} positions")
    return GMTSTrainer(model=load(), reward_funcs=make_reward(args.task), args=cfg, train_dataset=data,
                       processing_class=tok)


def main(argv=None):
    with gmts.handling_signals():  # SIGINT, SIGTERM, SIGHUP: one line, exit 130
        _main(argv)


def _main(argv):
    try:
        args = parse_args(argv)
        trainer = build_trainer(args)
        gmts.claim_out(args.out, "trl")  # this process is the folder's one writer until it ends
    except KeyboardInterrupt:
        die("interrupted before training; nothing was written", 130)
    except (ValueError, OSError, RuntimeError, ImportError, MemoryError) as e:
        # ValueError (exit 2): flags TRL rejects (a batch not divisible by G), data files, lengths, a chat template
        # that fails; else (1): memory, a model that can't be loaded, an unsupported TRL, no vLLM
        fail(e, 2 if isinstance(e, ValueError) else 1, "; nothing was written")
    try:
        trainer.train()
        if trainer.state.global_step < args.steps:  # never a silent exit 0 after fewer steps than asked
            die(f"trained {trainer.state.global_step} of {args.steps} steps: TRL ran out of batches; nothing saved", 1)
        trainer.save_model(args.out)
    except KeyboardInterrupt:
        die(f"interrupted; {kept(args.out)}", 130)
    except (OSError, RuntimeError, ValueError, MemoryError) as e:  # memory, a full disk, a tokenizer failing at once
        fail(e, 1, f"; {kept(args.out)}")
    finally:
        gmts.release_all()


if __name__ == "__main__":
    main()
