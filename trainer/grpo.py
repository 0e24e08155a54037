"""GRPO core: small pure functions, no state, no I/O.

Shapes: N = number of sequences in the batch (B prompts x G samples each, group-contiguous:
rows [g*G, (g+1)*G) belong to prompt g), T = response length (padded), V = vocabulary.
Names mirror verl (verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage,
compute_policy_loss, kl_penalty "low_var_kl", agg_loss) so a config reads the same in both.

    adv = group_advantages(rewards, group_size)                 # [N]
    logprobs = token_logprobs(logits / temperature, response)   # [N, T]
    loss, metrics = grpo_loss(logprobs, old_logprobs, adv, response_mask, ...)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trainer.config import LOSS_AGG_MODES  # noqa: E402  (defined torch-free for web hosts)

# --------------------------------------------------------------------------------- advantages

def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage: each reward minus its group's mean, divided by the group's std
    (unbiased, as verl and TRL) when `norm_by_std` (verl `norm_adv_by_std_in_grpo`). Without the
    division it is the Dr.GRPO variant, which does not up-weight low-spread groups.

    rewards: [N] with N = B * group_size  ->  advantages: [N]
    A group of one has no baseline: verl uses mean 0 and std 1 then, and so do we."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size} elements, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, group_size)            # [B, G]
    if group_size == 1:
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)               # [B, 1]
        std = grouped.std(dim=1, keepdim=True)                 # [B, 1], Bessel-corrected
    adv = grouped - mean
    if norm_by_std:
        # a group without spread has advantage 0 (not 0/0 when eps is 0)
        adv = torch.where(adv == 0, 0.0, adv / (std + eps))
    return adv.reshape(-1)                                     # [N]


def drop_zero_spread_groups(rewards: torch.Tensor, group_size: int,
                            atol: float = 1e-6) -> torch.Tensor:
    """Keep-mask of the rows whose group has some reward spread. A group whose rewards are all
    equal has zero advantage everywhere: it adds no gradient, only cost and (in token-mean)
    a smaller effective step for the others (DAPO's dynamic sampling drops them too).

    rewards: [N]  ->  keep: [N] bool"""
    grouped = rewards.view(-1, group_size)                     # [B, G]
    spread = grouped.max(dim=1).values - grouped.min(dim=1).values
    keep = spread > atol                                       # [B]
    return keep.repeat_interleave(group_size)                  # [N]


# ----------------------------------------------------------------------------------- masks

def loss_mask_from_segments(segments: Sequence[tuple[int, bool]]) -> list[int]:
    """Token loss mask of one completion region built from (length, generated_by_policy)
    segments, e.g. [(12, True), (30, False), (8, True)] for assistant text, a tool result the
    environment inserted, and the assistant's next turn. Only tokens the policy sampled are
    trained on; tool results and user turns are context, never targets."""
    mask: list[int] = []
    for length, generated in segments:
        if length < 0:
            raise ValueError("segment length must be >= 0")
        mask.extend([1 if generated else 0] * length)
    return mask


def response_mask_from_lists(masks: Sequence[Sequence[int]], length: int,
                             device: torch.device | str | None = None) -> torch.Tensor:
    """Right-pad per-sequence 0/1 masks to [N, length] (padding is 0: never in the loss)."""
    out = torch.zeros(len(masks), length, dtype=torch.float32, device=device)
    for i, m in enumerate(masks):
        if len(m) > length:
            raise ValueError(f"mask {i} is longer ({len(m)}) than the response length {length}")
        if m:
            out[i, : len(m)] = torch.as_tensor(m, dtype=torch.float32, device=device)
    return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# ------------------------------------------------------------------------------- log-probs

def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[n, t]) under logits[n, t]; logits [N, T, V], ids [N, T] -> [N, T].
    logsumexp + gather keeps memory at O(N*T) beyond the logits (no [N, T, V] log_softmax)."""
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [N, T]
    return picked - torch.logsumexp(logits, dim=-1)            # [N, T]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical at each position; logits [N, T, V] -> [N, T]."""
    logits = logits.float()
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# ------------------------------------------------------------------------------------ losses

def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
             norm_length: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss [N, T] to a scalar, as verl's agg_loss:
    token-mean               sum over all tokens / number of tokens (DAPO; verl's default)
    seq-mean-token-sum       per-sequence token sum, mean over sequences
    seq-mean-token-mean      per-sequence token mean, mean over sequences (original GRPO; TRL
                             loss_type="grpo")
    seq-mean-token-sum-norm  sum over all tokens / a constant length (Dr.GRPO); verl divides
                             by loss_mask.shape[-1], `norm_length` fixes it (e.g. to
                             max_response_length) so it stays constant across steps"""
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    seq_sums = (loss_mat * loss_mask).sum(dim=-1)              # [N]
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / loss_mask.sum(dim=-1).clamp(min=1.0)).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / float(norm_length or loss_mask.shape[-1])
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; one of {LOSS_AGG_MODES}")


def clipped_ratio_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, response_mask: torch.Tensor,
                       clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                       clip_ratio_c: float | None = 3.0
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (verl compute_policy_loss, before aggregation).

    logprobs, old_logprobs, response_mask: [N, T]; advantages: [N] or [N, T]
    ratio = exp(logprobs - old_logprobs)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
    dual-clip (A < 0 only): min(loss, -A * clip_ratio_c); None switches it off (TRL has none).
    Returns pg_losses [N, T] and masked statistics: pg_clipfrac (share of tokens where the
    clipped term is the active one), pg_clipfrac_lower (dual-clip active), ppo_kl (mean of
    old - new, the drift since the rollout)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)                  # [N, 1] broadcasts over T
    log_ratio = logprobs - old_logprobs
    # Clamping the log-ratio only guards exp() against overflow; inside the clip range it is
    # never active.
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))            # [N, T]
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)   # [N, T]
    stats = {
        "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    if clip_ratio_c is None:
        stats["pg_clipfrac_lower"] = torch.zeros((), device=logprobs.device)
        return clip_pg_losses1, stats
    if clip_ratio_c <= 1.0:
        raise ValueError("clip_ratio_c must be > 1.0 (dual-clip lower bound of the ratio)")
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    stats["pg_clipfrac_lower"] = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token (verl "low_var_kl"; TRL's beta
    term): exp(ref - lp) - (ref - lp) - 1, always >= 0, clamped to [-10, 10] as verl.
    [N, T] -> [N, T]"""
    kl = ref_logprobs - logprobs
    return (torch.exp(kl) - kl - 1.0).clamp(min=-10.0, max=10.0)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, *, clip_ratio_low: float = 0.2,
              clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
              loss_agg_mode: str = "token-mean", ref_logprobs: torch.Tensor | None = None,
              kl_loss_coef: float = 0.0, entropy: torch.Tensor | None = None,
              entropy_coeff: float = 0.0, norm_length: int | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor loss of one (micro-)batch, as verl's dp_actor composes it:

        loss = agg(pg_losses) + kl_loss_coef * agg(k3(logprobs, ref)) - entropy_coeff * agg(H)

    Every term is aggregated with the same `loss_agg_mode` over `response_mask` (1 where the
    policy generated the token). Aggregation is linear, so this equals TRL's
    agg(pg + beta * kl). Returns the scalar loss (with grad) and detached float metrics."""
    pg_losses, stats = clipped_ratio_loss(logprobs, old_logprobs, advantages, response_mask,
                                          clip_ratio_low, clip_ratio_high, clip_ratio_c)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm_length)
    loss = pg_loss
    metrics: dict[str, float] = {"pg_loss": pg_loss.item()}
    metrics.update({k: v.item() for k, v in stats.items()})
    if ref_logprobs is not None:
        kl_loss = agg_loss(kl_k3(logprobs, ref_logprobs), response_mask, loss_agg_mode,
                           norm_length)
        metrics["kl"] = kl_loss.item()
        if kl_loss_coef != 0.0:
            loss = loss + kl_loss_coef * kl_loss
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode, norm_length)
        metrics["entropy"] = entropy_loss.item()
        if entropy_coeff != 0.0:
            loss = loss - entropy_coeff * entropy_loss
    metrics["loss"] = loss.item()
    return loss, metrics
