"""A mutation pass over gmts.py's reading part (issue 30): each mutant is one textual change to one
line of the method, and the suite must fail on every one. A developer tool, not a test: pytest does
not collect it (the name does not match test_*.py) and CI does not run it.

    python dev/mutants.py                    every mutant against the suite (test_gmts.py,
                                             test_rewards.py, test_gmts_lab.py) with -x; a table at
                                             the end; exit 1 if one survives
    python dev/mutants.py --killer           each mutant against only its named killer test
                                             (MUTANTS, and the table in dev/LOG.md; the killers
                                             first pass on the unmutated copy)
    python dev/mutants.py --only a,b --list  some mutants; --list prints them and runs nothing

The mutants are applied to a copy of this checkout in a temporary folder, never to the checkout
itself. Every anchor must occur exactly once in gmts.py, or the driver stops before running anything
(a refactor that moves the text must move the mutant too); so does a mutant that does not compile
(it would count as killed). Each mutant's failure line (pytest -rf) is printed, to check that the
test fails for the right reason.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = ["test_gmts.py", "test_rewards.py", "test_gmts_lab.py"]
T = "test_gmts.py::"
R = "test_rewards.py::"

# name -> (anchor, replacement, what it breaks, the test that kills it)
MUTANTS = {
    # ---- rollouts
    "mask_drops_end": (
        "resp_mask = torch.arange(T, device=device)[None, :] <= first_end[:, None]",
        "resp_mask = torch.arange(T, device=device)[None, :] < first_end[:, None]",
        "completion_mask drops the end token itself from the valid positions",
        T + "test_completion_mask_by_position"),
    "sampler_logp_first_draw": (
        "self.read.append(self.pending.gather(1, drawn[:, -1:]))",
        "self.read.append(self.pending.gather(1, drawn[:, :1]))",
        "SamplerLogp reads the kept distribution at the first drawn id, not the newest",
        T + "test_sampler_logp_equals_the_learner_recompute_in_fp32"),
    "sampler_logp_no_temperature": (
        "self.pending = torch.log_softmax(logits.float() / self.temperature, dim=-1)",
        "self.pending = torch.log_softmax(logits.float(), dim=-1)",
        "the sampler's log-probs ignore the temperature",
        T + "test_sampler_logp_equals_the_learner_recompute_in_fp32"),
    # ---- rewards: the verifiers' tag handling and parsing
    "answer_first_open_tag": (
        'start = text.rfind("<answer>", 0, max(end, 0))',
        'start = text.find("<answer>", 0, max(end, 0))',
        "_last_answer takes the FIRST <answer> before the last </answer>",
        R + "test_countdown_reward"),
    "answer_open_after_close": (
        'start = text.rfind("<answer>", 0, max(end, 0))',
        'start = text.rfind("<answer>")',
        "_last_answer pairs the last </answer> with an unclosed <answer> after it",
        R + "test_countdown_reward"),
    "answer_no_open_check": (
        "if end < 0 or start < 0:",
        "if end < 0:",
        "_last_answer accepts a </answer> without any <answer>",
        R + "test_countdown_reward"),
    "countdown_numbers_as_set": (
        "return value if sorted(lits) == sorted(nums) else None",
        "return value if set(lits) == set(nums) else None",
        "countdown_value lets a number be reused (compares sets, not multisets)",
        R + "test_countdown_reward"),
    "countdown_newline_breaks": (
        'value = _cd_eval(ast.parse(" ".join(ans.split()), mode="eval").body, lits)',
        'value = _cd_eval(ast.parse(ans, mode="eval").body, lits)',
        "a newline inside a countdown answer breaks the expression "
        "(ast reads it as a statement end)",
        R + "test_whitespace_inside_answers_is_ignored"),
    "countdown_no_format_reward": (
        "return 1.0 if countdown_value(completion, nums) == target else 0.1",
        "return 1.0 if countdown_value(completion, nums) == target else 0.0",
        "countdown_reward drops TinyZero's 0.1 format reward",
        R + "test_countdown_reward"),
    "parse_keeps_trailing_point": (
        's = s.removesuffix(".").removesuffix("\\\\%").removesuffix("%").strip()',
        's = s.removesuffix("\\\\%").removesuffix("%").strip()',
        "parse_number no longer reads '18.' (the docstring's own example)",
        R + "test_parse_number_reads_its_docstring_examples"),
    "parse_several_slashes": (
        'elif s.count("/") == 1:',
        'elif s.count("/") >= 1:',
        "parse_number reads '1/2/3' as the fraction 1/2",
        R + "test_parse_number_reads_its_docstring_examples"),
    "fraction_unsigned_denominator": (
        "bottom = _decimal(parts[1].strip(), signed=True)",
        "bottom = _decimal(parts[1].strip(), signed=False)",
        "parse_number refuses \\frac{20}{-2}",
        R + "test_math_reward"),
    "fraction_drops_outer_sign": (
        "    return sign * top / bottom",
        "    return top / bottom",
        "parse_number drops the sign in front of a fraction (-\\frac{1}{2})",
        R + "test_math_reward"),
    "last_number_unsigned": (
        'if first > 0 and text[first - 1] == "-":',
        'if False:',
        "math's last bare number loses its minus sign",
        R + "test_math_reward"),
    "logic_named_twice": (
        "if len({name for name, _ in got}) < len(got):  # someone named twice",
        "if False:  # someone named twice",
        "logic_reward accepts an answer that names someone twice",
        R + "test_logic_reward"),
    "logic_entries_unsplit": (
        "(knight|knave)(?![a-z])",
        "(knight|knave)",
        "logic_reward reads entries run together ('Alice: knightBob: knave') as split",
        R + "test_logic_reward"),
    "logic_no_answer_gets_format": (
        "    ans = _last_answer(completion)\n    if ans is None:\n        return 0.0",
        "    ans = _last_answer(completion)\n    if ans is None:\n        return 0.1",
        "logic_reward gives 0.1 to a completion without answer tags",
        R + "test_logic_reward"),
    # ---- group advantages and dynamic sampling
    "adv_no_zero_mask": (
        "return adv.masked_fill(same, 0.0).view(-1)",
        "return adv.view(-1)",
        "group_advantages leaves float noise (about 0.007 at G = 8, rewards 0.1) "
        "in all-equal groups",
        T + "test_group_advantages_all_equal_groups_are_exactly_zero"),
    "adv_unbiased_std": (
        "adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)",
        "adv = adv / (r.std(dim=1, unbiased=True, keepdim=True) + eps)",
        "group_advantages divides by the sample std (G - 1), not the population std",
        T + "test_group_advantages_hand_computed"),
    "adv_batch_mean": (
        "adv = r - r.mean(dim=1, keepdim=True)  # (B, G)",
        "adv = r - r.mean()  # (B, G)",
        "group_advantages centres on the batch mean, not the group's",
        T + "test_group_advantages_hand_computed"),
    "informative_by_std": (
        "return r.max(dim=1).values != r.min(dim=1).values",
        "return r.std(dim=1, unbiased=False) > 0",
        "informative() calls a group informative when its std is not exactly 0 "
        "(float noise at 0.1 x 8)",
        T + "test_group_advantages_all_equal_groups_are_exactly_zero"),
    "filter_groups_too_many": (
        "taken = informative(rewards, group_size).nonzero().squeeze(1)[:B]",
        "taken = informative(rewards, group_size).nonzero().squeeze(1)[:B + 1]",
        "filter_groups takes one informative group more than B",
        T + "test_filter_groups_keeps_the_first_b_informative_groups"),
    "filter_groups_none_last_batch": (
        "    if taken.numel() == 0:\n        return parts[0]",
        "    if taken.numel() == 0:\n        return parts[-1]",
        "with no informative group filter_groups returns the LAST rollout batch, not the first",
        T + "test_filter_groups_keeps_the_first_b_informative_groups"),
    "join_prompts_right_padded": (
        'side = "left" if key in LEFT_PADDED else "right"',
        'side = "right" if key in LEFT_PADDED else "right"',
        "_join_rows pads prompts on the right (they are left padded)",
        T + "test_filter_groups_keeps_the_first_b_informative_groups"),
    # ---- token statistics
    "dz_norm_no_temperature": (
        "return logp, entropy, sq.sqrt() / temperature",
        "return logp, entropy, sq.sqrt()",
        "token_stats' dz_norm misses the 1/T of the chain rule",
        T + "test_token_stats_against_autograd_and_loop"),
    "dz_norm_cancelling_form": (
        "sq = torch.expm1(logp).square() + torch.linalg.vector_norm(p_rest, dim=-1).square()"
        "  # (...)",
        "sq = 1 - 2 * p_y + logp_all.exp().square().sum(-1)  # (...)",
        "dz_norm by 1 - 2 p_y + sum p^2, which cancels catastrophically at p_y ~ 1",
        T + "test_dz_norm_at_near_certain_tokens_does_not_cancel"),
    "stats_in_bf16": (
        "    z = logits.float()\n    if temperature != 1.0:",
        "    z = logits\n    if temperature != 1.0:",
        "token_stats computes in the logits' dtype (bf16 under CUDA autocast), not fp32",
        T + "test_token_stats_on_bf16_logits_is_fp32"),
    "entropy_counts_py_twice": (
        "p_rest = logp_all.exp().scatter(-1, y, 0.0)  # (..., V)",
        "p_rest = logp_all.exp()  # (..., V)",
        "token_stats' sums over j != y include y (entropy and norm count p_y twice)",
        T + "test_token_stats_against_autograd_and_loop"),
    "head_logp_no_temperature": (
        "z = F.linear(h, head.weight, head.bias).float() / temperature  # (C, V)",
        "z = F.linear(h, head.weight, head.bias).float()  # (C, V)",
        "the loss's log-probs (head_logp) ignore the temperature",
        T + "test_update_equals_full_reinforce_gradient"),
    "hidden_off_by_one": (
        "return h[:, P - 1:P + T - 1]  # (n, T, d)",
        "return h[:, P:P + T]  # (n, T, d)",
        "response_hidden takes the state AT each token, not the one that predicts it",
        T + "test_recomputed_logp_equals_generate_scores"),
    "positions_ignore_padding": (
        "pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (n, P + T)",
        "pos = torch.arange(attn.shape[1], device=attn.device).expand_as(attn)  # (n, P + T)",
        "response_hidden's position ids ignore the left padding (no effect on rotary models)",
        T + "test_left_padding_positions_on_absolute_position_embeddings"),
    # ---- scores and selection
    "clip_high_uses_low": (
        "above = (adv > 0) & (ratio > 1 + clip_high)",
        "above = (adv > 0) & (ratio > 1 + clip_low)",
        "the upper clip bound uses eps_low",
        T + "test_loss_clips_each_side_at_its_own_bound"),
    "clip_zero_adv_above": (
        "above = (adv > 0) & (ratio > 1 + clip_high)",
        "above = (adv >= 0) & (ratio > 1 + clip_high)",
        "an A = 0 token above 1 + eps_h counts as clipped (clip_frac)",
        T + "test_derivation_logit_gradient_of_clipped_loss"),
    "clip_zero_adv_below": (
        "below = (adv < 0) & (ratio < 1 - clip_low)",
        "below = (adv <= 0) & (ratio < 1 - clip_low)",
        "an A = 0 token below 1 - eps_l counts as clipped (clip_frac)",
        T + "test_derivation_logit_gradient_of_clipped_loss"),
    "omega_ignores_clip": (
        "om = torch.where(dead, torch.zeros_like(ratio), ratio * a) * w / denom"
        "  # the policy term's",
        "om = ratio * a * w / denom  # the policy term's",
        "omega is ratio * A where the clip is active too",
        T + "test_derivation_logit_gradient_of_clipped_loss"),
    "omega_without_ratio": (
        "om = torch.where(dead, torch.zeros_like(ratio), ratio * a) * w / denom"
        "  # the policy term's",
        "om = torch.where(dead, torch.zeros_like(ratio), a.expand_as(ratio)) * w / denom"
        "  # the policy term's",
        "omega = A, not ratio * A, off the first inner update",
        T + "test_derivation_logit_gradient_of_clipped_loss"),
    "gmts_score_signed": (
        '"gmts": Method(lambda logp, H, dz_norm, om, gen=None: (H * om).abs(), False, "group"),',
        '"gmts": Method(lambda logp, H, dz_norm, om, gen=None: H * om, False, "group"),',
        "gmts's score without |.|: negative-advantage answers rank last",
        T + "test_scores_definitions"),
    "gradnorm_ignores_omega": (
        '"gradnorm": Method(lambda logp, H, dz_norm, om, gen=None: om.abs() * dz_norm, False),',
        '"gradnorm": Method(lambda logp, H, dz_norm, om, gen=None: dz_norm, False),',
        "gradnorm scores by the logit-gradient norm alone, without |omega|",
        T + "test_scores_definitions"),
    "select_k_float_product": (
        "return [min(n, max(1, math.ceil(r * n))) for n in counts]",
        "return [min(n, max(1, math.ceil(float(rho) * n))) for n in counts]",
        "select_tokens rounds rho * n in floats (0.07 * 100 keeps 8)",
        T + "test_select_tokens_edges"),
    "select_nan_first": (
        "vals = torch.nan_to_num(vals, nan=-math.inf)",
        "vals = vals",
        "NaN scores rank first (torch sorts NaN above everything)",
        T + "test_select_tokens_edges"),
    "select_unstable_ties": (
        "        order = torch.sort(vals, descending=True, stable=True).indices  # (n,)",
        "        order = torch.sort(-vals, descending=False, stable=False).indices  # (n,)",
        "ties are not guaranteed to go to the earlier token",
        T + "test_select_tokens_matches_slow_reference"),
    "select_nonzero_keeps_zeros": (
        "keep &= vals > 0",
        "keep &= vals >= 0",
        "nonzero=True keeps score-0 tokens (gmts spends budget on A = 0)",
        T + "test_gmts_spends_nothing_on_zero_advantage_groups"),
    "step_selection_no_nonzero": (
        "return select_tokens(scores, mask, rho, not method.zero_kept, group_size)",
        "return select_tokens(scores, mask, rho, False, group_size)",
        "train's gmts/gradnorm fill rho with score-0 tokens (deviation 9)",
        T + "test_constant_reward_every_method_ends_identical_and_unchanged"),
    "rsi_open_interval": (
        "return mask & (scores >= cfg.rsi_low) & (scores <= cfg.rsi_high)",
        "return mask & (scores > cfg.rsi_low) & (scores < cfg.rsi_high)",
        "rsi drops a token on a bound of its interval (the interval is closed)",
        T + "test_rsi_keeps_its_interval_against_a_slow_loop"),
    "rsi_zero_entropy_kept": (
        "return torch.where(entropy > 0, -logp / entropy, math.inf)",
        "return torch.where(entropy > 0, -logp / entropy, 1.0)",
        "a token with H = 0 (a zero logit gradient) counts as RSI 1, inside the default interval",
        T + "test_relative_surprisal_by_hand"),
    # ---- loss and update
    "loss_max_not_min": (
        "loss = -torch.min(ratio * adv, clipped * adv)",
        "loss = -torch.max(ratio * adv, clipped * adv)",
        "the PPO objective takes the optimistic branch",
        T + "test_loss_clips_each_side_at_its_own_bound"),
    "loss_clamp_high_uses_low": (
        "clipped = ratio.clamp(1 - clip_low, 1 + clip_high)",
        "clipped = ratio.clamp(1 - clip_low, 1 + clip_low)",
        "the loss clamps above at 1 + eps_low",
        T + "test_loss_clips_each_side_at_its_own_bound"),
    "k3_reversed": (
        "    d = ref_logp - logp\n    return torch.exp(d) - d - 1",
        "    d = logp - ref_logp\n    return torch.exp(d) - d - 1",
        "k3 estimates the reverse KL",
        T + "test_k3_kl"),
    "kl_normalised_by_denom": (
        "loss = loss + o.kl_beta * (kl * w).sum() / o.kl_denom  # D_kl ignores the selection",
        "loss = loss + o.kl_beta * (kl * w).sum() / o.denom  # D_kl ignores the selection",
        "the KL term is divided by the kept-token count under --loss-norm selected",
        T + "test_kl_gradient_matches_autograd_and_ignores_the_selection"),
    "kl_only_kept_tokens": (
        "    need = sel_mask | valid if objective.kl_beta > 0 else sel_mask",
        "    need = sel_mask",
        "with KL only the kept tokens enter the KL term",
        T + "test_kl_gradient_matches_autograd_and_ignores_the_selection"),
    "live_counts_zero_adv": (
        "live = kept & ~clip_m & (adv != 0)  # (M,)",
        "live = kept & ~clip_m  # (M,)",
        "a kept token with A = 0 counts as live: an all-zero batch steps",
        T + "test_all_zero_advantage_batch_makes_no_update"),
    "step_without_live": (
        'stepped=int(stats["live"] > 0 and finite))',
        'stepped=int(finite))',
        "the step rule steps on a batch with no live token (AdamW moves on zero gradients)",
        T + "test_all_zero_advantage_batch_makes_no_update"),
    "step_on_nonfinite": (
        'finite = math.isfinite(grad_norm) and math.isfinite(stats["loss"])',
        "finite = True",
        "a NaN gradient reaches the weights and the Adam moments",
        T + "test_nonfinite_gradient_skips_the_step"),
    # ---- training loop
    "warmup_off_by_one": (
        "up = (i + 1) / max(warmup, 1)",
        "up = i / max(warmup, 1)",
        "the warm-up starts at lr 0 (slot 0 is lost)",
        T + "test_lr_schedule_hand_computed"),
    "lr_slot_ignores_inner": (
        "slot = (step - 1) * cfg.inner_updates + inner",
        "slot = (step - 1) + inner",
        "step_lr counts GRPO steps, not update slots, with --inner-updates > 1",
        T + "test_step_lr_counts_update_slots"),
    "resample_same_key": (
        "rows = run.data.draw(B, step, len(parts))",
        "rows = run.data.draw(B, step, 0)",
        "every resample of a step draws the same prompts (key (step, 0))",
        T + "test_filter_groups_resamples_new_prompts_until_b_groups_are_informative"),
    "resample_stops_at_one_group": (
        "while len(parts) < max_batches and n_informative < B:",
        "while len(parts) < max_batches and n_informative < 1:",
        "dynamic sampling stops at the first informative group, not at B",
        T + "test_filter_groups_resamples_new_prompts_until_b_groups_are_informative"),
    "reward_wrong_prompt": (
        'answered = [rows[n // G] for n in range(len(batch["texts"]))]',
        'answered = [rows[n % B] for n in range(len(batch["texts"]))]',
        "answer n is scored against prompt n % B, not n // G",
        T + "test_every_method_honours_select_and_loss_norm"),
    "inner_stats_not_recomputed": (
        "            if inner > 0:  # the policy has moved: its statistics again",
        "            if inner > 1:  # the policy has moved: its statistics again",
        "the second inner update reuses the first one's statistics",
        T + "test_inner_updates_recompute_scores_and_move_the_ratio"),
    "loss_temperature_one": (
        "objective = Objective(cfg.clip_low, cfg.clip_high, cfg.kl_beta, cfg.temperature,\n",
        "objective = Objective(cfg.clip_low, cfg.clip_high, cfg.kl_beta, 1.0,\n",
        "the loss's log-probs at T = 1 while the sampler and the statistics use --temperature",
        T + "test_training_at_a_temperature_is_on_policy"),
    "stats_temperature_one": (
        "            logp, entropy, dz_norm = batch_token_stats(model, batch, cfg.temperature, mb, "
        "chunk)\n            old_logp = logp",
        "            logp, entropy, dz_norm = batch_token_stats(model, batch, 1.0, mb, chunk)\n"
        "            old_logp = logp",
        "pi_old's statistics at T = 1 while the sampler and the loss use --temperature",
        T + "test_training_at_a_temperature_is_on_policy"),
    "loss_norm_selected_ignored": (
        'denom = float(max(n_kept, 1)) if loss_norm == "selected" else n_valid',
        "denom = n_valid",
        "--loss-norm selected divides by the valid tokens, as 'all' does",
        T + "test_every_method_honours_select_and_loss_norm"),
    "ref_logp_other_path": (
        "ref_logp = response_logp(run.ref, batch, valid, cfg.temperature, mb, chunk)",
        "ref_logp = batch_token_stats(run.ref, batch, cfg.temperature, mb, chunk)[0]",
        "the KL reference's log-probs off the loss's code path (float noise steps a KL run)",
        T + "test_kl_run_with_constant_reward_never_moves"),
    "overlong_selects_truncated": (
        "sel_mask = step_selection(cfg, logp, entropy, dz_norm, om, valid, method)",
        "sel_mask = step_selection(cfg, logp, entropy, dz_norm, om, batch[\"resp_mask\"], method)",
        "--overlong-filter: truncated answers can still be kept",
        T + "test_overlong_filter_trains_nothing_on_truncated_answers"),
    # ---- issue 35: the authors' scope, budget and omega
    "scope_group_ranks_batch": (
        '    if scope == "group":\n        return cfg.rho, cfg.group_size',
        '    if scope == "group":\n        return cfg.rho, 0',
        "--scope group (gmts's default) ranks over the whole batch",
        T + "test_scope_flag_and_each_methods_default"),
    "groups_pooled_into_one": (
        "groups = (rows // group_size)[:, None].expand(mask.shape)  # (N, T)",
        "groups = (rows * 0)[:, None].expand(mask.shape)  # (N, T)",
        "select_tokens' group scope pools every group into one (the authors' rule over the batch)",
        T + "test_select_tokens_per_group_matches_the_literal_reference"),
    "group_budget_no_minimum_drop": (
        "return [max(0, n - max(1, math.ceil((1 - r) * n))) for n in counts]",
        "return [max(0, n - math.ceil((1 - r) * n)) for n in counts]",
        "a group drops nothing at rho = 1 (the authors drop at least one)",
        T + "test_select_tokens_per_group_matches_the_literal_reference"),
    "group_ties_to_the_earlier": (
        "order = len(vals) - 1 - torch.sort(vals.flip(0), descending=True, stable=True).indices",
        "order = torch.sort(vals, descending=True, stable=True).indices",
        "of equal scores in a group the earlier is kept "
        "(the authors' stable ascending sort keeps the later)",
        T + "test_select_tokens_per_group_matches_the_literal_reference"),
    "omega_without_normaliser": (
        "om = torch.where(dead, torch.zeros_like(ratio), ratio * a) * w / denom"
        "  # the policy term's",
        "om = torch.where(dead, torch.zeros_like(ratio), ratio * a)  # the policy term's",
        "omega leaves out the loss's normaliser (w / D)",
        T + "test_omega_is_minus_the_gradient_of_the_loss"),
    "omega_without_kl_weight": (
        "om = om + kl_beta * w * (ref_ratio - 1) / kl_denom  # the KL term's",
        "om = om  # the KL term's",
        "omega leaves out the KL term's weight",
        T + "test_omega_is_minus_the_gradient_of_the_loss"),
    "omega_kl_without_w": (
        "om = om + kl_beta * w * (ref_ratio - 1) / kl_denom  # the KL term's",
        "om = om + kl_beta * (ref_ratio - 1) / kl_denom  # the KL term's",
        "omega's KL weight leaves out seq's 1 / |o_i|",
        T + "test_omega_is_minus_the_gradient_of_the_loss"),
    "seq_without_length": (
        "return dict(w=w / valid.sum(1, keepdim=True).clamp_min(1), denom=n, kl_denom=n)",
        "return dict(w=w, denom=n, kl_denom=n)",
        "--loss-norm seq without GRPO's 1 / |o_i|",
        T + "test_loss_weights_hand_computed"),
    "train_omega_without_kl": (
        "om = omega(adv, ratio, cfg.clip_low, cfg.clip_high, cfg.kl_beta, ref_ratio,",
        "om = omega(adv, ratio, cfg.clip_low, cfg.clip_high, 0.0, ref_ratio,",
        "train's omega leaves out the KL weight",
        T + "test_train_scores_with_the_kl_weight"),
    "overlong_denom_all_tokens": (
        "weights = loss_weights(cfg.loss_norm, valid, n_kept, cfg.group_size)  # w, D, D_kl",
        "weights = loss_weights(cfg.loss_norm, mask, n_kept, cfg.group_size)  # w, D, D_kl",
        "--overlong-filter: the loss is divided by the valid tokens of the truncated answers too",
        T + "test_overlong_filter_trains_nothing_on_truncated_answers"),
    # ---- issue 43: one budget, the method table, the step rule's count
    "normaliser_own_count": (
        "n_kept = int(scope_budget(valid, rho, group_size)[1].sum())",
        "n_kept = max(1, math.ceil(rho * int(valid.sum())))",
        "--loss-norm selected divides by a count of its own, not the one the mask keeps",
        T + "test_one_budget_feeds_the_mask_and_the_selected_normaliser"),
    "live_counted_twice": (
        "        live = live | (torch.exp(ref_logp - logp.detach()) != 1)",
        "        live = torch.cat([live, torch.exp(ref_logp - logp.detach()) != 1])",
        "live counts a kept token with a policy and a KL gradient twice",
        T + "test_live_counts_a_token_once_under_kl"),
    "row_scope_ignored": (
        "    scope = method.scope if cfg.scope",
        "    scope = METHODS[cfg.select].scope if cfg.scope",
        "a user's method row (train(score_fn=Method(...))) ranks at --select's scope, not its own",
        T + "test_a_users_method_row_sets_its_score_zero_rule_and_scope"),
}


def check_anchors(src: str, names: list):
    """Every anchor occurs exactly once in gmts.py (the reading part, and the rollout plumbing it
    relies on: SamplerLogp, _join_rows); every mutant changes the text and compiles."""
    bad = []
    for name in names:
        anchor, repl, _, _ = MUTANTS[name]
        n = src.count(anchor)
        if n != 1:
            bad.append(f"{name}: anchor found {n} times: {anchor[:70]!r}")
        elif anchor == repl:
            bad.append(f"{name}: the replacement is the anchor")
        else:
            try:
                compile(src.replace(anchor, repl), "gmts.py", "exec")
            except SyntaxError as e:
                bad.append(f"{name}: the mutant does not compile: {e}")
    if bad:
        sys.exit("dev/mutants.py: stale mutants (gmts.py changed?):\n  " + "\n  ".join(bad))


def copy_checkout(dest: str):
    """The tracked and untracked-but-not-ignored files of this checkout, into dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        src = os.path.join(REPO, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, f))


def pytest(where: str, tests: list, timeout: int, one_process=False) -> tuple:
    """(passed?, the FAILED/ERROR lines or, if it passed, pytest's summary line, seconds) of
    pytest -x on tests in the copy; one_process: without pytest.ini's two xdist workers (their
    start costs more than one test takes)."""
    t = time.time()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    xdist = ["-o", "addopts=", "-p", "no:xdist"] if one_process else []
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rfE",
                            "-p", "no:cacheprovider", *xdist, *tests],
                           cwd=where, capture_output=True, text=True, timeout=timeout, env=env)
        out, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired:
        return False, ["TIMEOUT"], time.time() - t
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    # 5: nothing collected, 2: interrupted (a syntax error, a collection error)
    if code not in (0, 1):
        failed = failed or [f"pytest exit {code}: " + " | ".join(out.strip().splitlines()[-3:])]
    if code == 0:  # a survivor: what ran (the count shows that the whole suite did)
        failed = [ln for ln in out.strip().splitlines()[-1:]]
    return code == 0, failed, time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    ap.add_argument("--killer", action="store_true",
                    help="run only each mutant's named killer test")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per mutant")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        sys.exit(f"dev/mutants.py: unknown mutants: {', '.join(unknown)}")
    src = open(os.path.join(REPO, "gmts.py")).read()
    check_anchors(src, names)
    if args.list:
        for n in names:
            print(f"{n:32} {MUTANTS[n][2]}\n{'':32} killed by {MUTANTS[n][3]}")
        return
    rows = []
    # a kill still removes the copy (and stops pytest)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="gmts-mutants-") as tmp:
        copy_checkout(tmp)
        target = os.path.join(tmp, "gmts.py")
        if args.killer:  # the killers must pass without a mutant, or their failure proves nothing
            killers = sorted({MUTANTS[n][3] for n in names})
            ok, failed, dt = pytest(tmp, killers, args.timeout)
            print(f"unmutated: {'pass' if ok else 'FAIL'} "
                  f"({len(killers)} killer tests, {dt:.0f} s)", flush=True)
            if not ok:
                sys.exit("dev/mutants.py: a killer fails without a mutant:\n  "
                         + "\n  ".join(failed))
        for i, name in enumerate(names, 1):
            anchor, repl, what, killer = MUTANTS[name]
            with open(target, "w") as f:
                f.write(src.replace(anchor, repl))
            try:
                if args.killer:
                    survived, failed, dt = pytest(tmp, [killer], args.timeout, one_process=True)
                else:
                    survived, failed, dt = pytest(tmp, SUITE, args.timeout)
            finally:
                with open(target, "w") as f:  # the next mutant starts from the original again
                    f.write(src)
            result = "SURVIVED" if survived else "TIMEOUT" if failed == ["TIMEOUT"] else "killed"
            rows.append((name, result, failed, dt))
            print(f"[{i}/{len(names)}] {name}: {result} in {dt:.0f} s", flush=True)
            for ln in failed[:3]:
                print("    " + ln[:220], flush=True)
    print("\n| mutant | what it breaks | killed by | result |\n|---|---|---|---|")
    for name, result, failed, _ in rows:
        by = "-"
        if result == "killed":
            by = ", ".join(sorted({re.sub(r"^(FAILED|ERROR) (\S+).*", r"\2", ln) for ln in failed}))
        print(f"| `{name}` | {MUTANTS[name][2]} | {by} | {result} |")
    # a timeout is not a kill: the suite may have been about to pass (a loaded machine), so it is
    # reported apart
    not_killed = [f"{name} ({result})" for name, result, _, _ in rows if result != "killed"]
    killed = len(rows) - len(not_killed)
    print(f"\n{killed} of {len(rows)} killed"
          + (f"; not killed: {', '.join(not_killed)}" if not_killed else ""))
    sys.exit(1 if not_killed else 0)


if __name__ == "__main__":
    main()
