"""GRPO formulas: hand-computed values on small tensors, then equality with TRL's GRPOTrainer
(the pinned test-only dependency) on the same batch — advantages through TRL's own
_generate_and_score_completions, loss and gradients through its _compute_loss."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import GRPOConfig
from trainer.grpo import (
    agg_loss,
    clipped_ratio_loss,
    drop_zero_spread_groups,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    kl_k3,
    loss_mask_from_segments,
    response_mask_from_lists,
    token_logprobs,
)

# ------------------------------------------------------------------------- hand-computed values


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2: no spread
    a = 0.5 / math.sqrt(1 / 3)
    adv = group_advantages(rewards, 4, norm_by_std=True, eps=0.0)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    # Dr.GRPO: mean only
    adv = group_advantages(rewards, 4, norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # eps is added to the std
    adv = group_advantages(torch.tensor([2.0, 0.0]), 2, eps=0.5)
    std = math.sqrt(2.0)
    assert torch.allclose(adv, torch.tensor([1 / (std + 0.5), -1 / (std + 0.5)]))


def test_group_advantages_edge_cases():
    # a group of one has no baseline: mean 0, std 1 (verl)
    assert torch.allclose(group_advantages(torch.tensor([0.3, 0.7]), 1), torch.tensor([0.3, 0.7]))
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_drop_zero_spread_groups():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    keep = drop_zero_spread_groups(rewards, 2)
    assert keep.tolist() == [True, True, False, False, False, False]


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # [1, 2, 2]
    ids = torch.tensor([[1, 0]])
    lp = token_logprobs(logits, ids)
    assert torch.allclose(lp, torch.tensor([[math.log(0.75), math.log(0.5)]]))
    ent = entropy_from_logits(torch.zeros(1, 1, 4))
    assert torch.allclose(ent, torch.tensor([[math.log(4.0)]]))
    # against log_softmax on random logits
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, ids), ref, atol=1e-6)


def test_clipped_ratio_loss_by_hand():
    # ratios 1.5, 0.5, 4.0, 1.1 against advantages +1, -1, -1, +1 (clip 0.2, dual clip 3)
    ratio = torch.tensor([[1.5, 0.5, 4.0, 1.1]])
    logprobs, old = torch.log(ratio), torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    pg, stats = clipped_ratio_loss(logprobs, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    #   +1 * 1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    #   -1 * 0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    #   -1 * 4.0 -> max(4.0, 1.2) = 4.0, dual clip min(4.0, 3.0) = 3.0
    #   +1 * 1.1 -> -1.1 (inside the range)
    assert torch.allclose(pg, torch.tensor([[-1.2, 0.8, 3.0, -1.1]]))
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert stats["ppo_kl"].item() == pytest.approx(-torch.log(ratio).mean().item())
    pg, _ = clipped_ratio_loss(logprobs, old, adv, mask, 0.2, 0.2, clip_ratio_c=None)
    assert pg[0, 2].item() == pytest.approx(4.0)
    # asymmetric clipping (DAPO clip-higher): 1.5 is clipped at 1.28, not 1.2
    pg, _ = clipped_ratio_loss(logprobs, old, adv, mask, 0.2, 0.28)
    assert pg[0, 0].item() == pytest.approx(-1.28)
    with pytest.raises(ValueError):
        clipped_ratio_loss(logprobs, old, adv, mask, clip_ratio_c=1.0)


def test_agg_loss_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=7).item() == \
        pytest.approx(1.0)
    with pytest.raises(ValueError):
        agg_loss(loss, mask, "sum")


def test_kl_k3_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k3 = exp(ref - lp) - (ref - lp) - 1 = 0.5 - ln 0.5 - 1
    assert kl_k3(lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_k3(lp, lp).item() == 0.0
    assert kl_k3(torch.tensor([0.0]), torch.tensor([30.0])).item() == 10.0  # verl's clamp


def test_grpo_loss_composes_terms():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(2, 3, generator=g)
    old = lp + 0.05 * torch.randn(2, 3, generator=g)
    ref = lp + 0.1 * torch.randn(2, 3, generator=g)
    ent = torch.rand(2, 3, generator=g)
    adv = torch.tensor([0.7, -1.3])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = grpo_loss(lp, old, adv, mask, loss_agg_mode="token-mean", ref_logprobs=ref,
                        kl_loss_coef=0.1, entropy=ent, entropy_coeff=0.01)
    pg, _ = clipped_ratio_loss(lp, old, adv, mask)
    expected = (agg_loss(pg, mask, "token-mean") + 0.1 * agg_loss(kl_k3(lp, ref), mask,
                "token-mean") - 0.01 * agg_loss(ent, mask, "token-mean"))
    assert loss.item() == pytest.approx(expected.item())
    assert m["loss"] == pytest.approx(expected.item())
    assert {"pg_loss", "kl", "entropy", "pg_clipfrac", "ppo_kl"} <= set(m)


def test_loss_mask_leaves_out_tokens_the_policy_did_not_generate():
    # assistant text (2), a tool result the environment inserted (3), assistant again (1)
    m = loss_mask_from_segments([(2, True), (3, False), (1, True)])
    assert m == [1, 1, 0, 0, 0, 1]
    mask = response_mask_from_lists([m, [1, 1]], 7)
    assert mask.tolist() == [[1, 1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0]]
    # whatever the log-probs of masked tokens are, loss and gradient do not see them
    lp = torch.zeros(2, 7, requires_grad=True)
    old = torch.zeros(2, 7)
    adv = torch.tensor([1.0, -1.0])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                 "seq-mean-token-sum-norm"):
        loss, _ = grpo_loss(lp, old, adv, mask, loss_agg_mode=mode)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.all(grad[mask == 0] == 0)
        assert torch.all(grad[mask == 1] != 0)
        shifted = lp.detach().clone()
        shifted[mask == 0] = -5.0
        assert grpo_loss(shifted, old, adv, mask, loss_agg_mode=mode)[0].item() == \
            pytest.approx(loss.item())


def test_config_round_trip_and_strictness(tmp_path):
    cfg = GRPOConfig(model_path="m", group_size=4, clip_ratio_high=0.28, seed=7,
                     extra={"job": 3})
    cfg.save(tmp_path / "config.json")
    assert GRPOConfig.load(tmp_path / "config.json") == cfg
    assert GRPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GRPOConfig keys: grup_size"):
        GRPOConfig.from_dict({"grup_size": 4})
    with pytest.raises(ValueError):
        GRPOConfig(loss_agg_mode="mean")
    overrides = cfg.to_verl_overrides()
    assert "actor_rollout_ref.rollout.n=4" in overrides
    assert "actor_rollout_ref.actor.clip_ratio_high=0.28" in overrides
    assert "algorithm.norm_adv_by_std_in_grpo=true" in overrides


# ------------------------------------------------------------------------------ TRL equivalence

TRL_MAX_COMPLETION = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trainer.tiny import build_tiny, save_tiny

    model, tok = build_tiny(seed=3)
    return str(save_tiny(model, tok, tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def trl_trainer(tiny_dir, tmp_path_factory):
    """make(**GRPOConfig kwargs) -> a TRL GRPOTrainer over the tiny model (CPU, offline)."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from trainer.tiny import load_tiny

    def rewards_from_column(prompts, completions, **columns):
        return [float(r) for r in columns["r"]]

    def make(**kwargs):
        _, tok = load_tiny(tiny_dir)
        # bf16=False: TRL defaults to bf16 autocast; the comparison is in float32
        args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False,
                         report_to=[], save_strategy="no", per_device_train_batch_size=12,
                         num_generations=4, max_completion_length=TRL_MAX_COMPLETION,
                         **kwargs)
        ds = Dataset.from_list([{"prompt": "1+2=", "r": 0.0}] * 12)
        return GRPOTrainer(model=tiny_dir, reward_funcs=rewards_from_column, args=args,
                           train_dataset=ds, processing_class=tok)

    return make


@pytest.mark.parametrize("scale_rewards,norm_by_std", [("group", True), ("none", False)])
def test_advantages_equal_trl(trl_trainer, scale_rewards, norm_by_std):
    """Rewards injected through a reward function; TRL computes the advantages in its own
    _generate_and_score_completions (it generates for real, the rewards ignore the text)."""
    trainer = trl_trainer(scale_rewards=scale_rewards, beta=0.0)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, -0.5]
    out = trainer._generate_and_score_completions([{"prompt": "1+2=", "r": r} for r in rewards])
    ours = group_advantages(torch.tensor(rewards), 4, norm_by_std=norm_by_std, eps=1e-4)
    assert torch.allclose(out["advantages"].float(), ours, atol=1e-6)


def _batch(tok, g: torch.Generator):
    """Prompts of two lengths (left padding), completions of different lengths (right padding),
    one with an environment-inserted middle segment (loss mask 0)."""
    from trainer.loop import collate
    from trainer.rollout import Rollout

    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+7=", "9+9=")]
    rollouts = []
    for i in range(12):
        n = 2 + (i * 3) % (TRL_MAX_COMPLETION - 1)        # 2..6 completion tokens
        ids = torch.randint(3, len(tok), (n,), generator=g).tolist()
        mask = [1] * n
        if i == 5:
            mask = loss_mask_from_segments([(1, True), (n - 2, False), (1, True)])
        rollouts.append(Rollout(prompts[i // 4], ids, [0.0] * n, "length", "0", mask))
    return collate(rollouts, tok.pad_token_id, torch.device("cpu"))


@pytest.mark.parametrize("loss_type,agg_mode,beta,entropy_coef,eps_high", [
    ("grpo", "seq-mean-token-mean", 0.0, 0.0, 0.2),
    ("bnpo", "token-mean", 0.0, 0.0, 0.28),
    ("dr_grpo", "seq-mean-token-sum-norm", 0.0, 0.0, 0.2),
    ("grpo", "seq-mean-token-mean", 0.04, 0.0, 0.2),
    ("bnpo", "token-mean", 0.04, 0.01, 0.28),
])
def test_loss_and_gradients_equal_trl(trl_trainer, loss_type, agg_mode, beta, entropy_coef,
                                      eps_high):
    """The same batch (old and reference log-probs perturbed so ratios clip and the KL is not
    0) through TRL's _compute_loss and through ours: equal loss, equal gradients."""
    from trainer.loop import policy_logprobs

    temperature = 0.7
    trainer = trl_trainer(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high,
                          entropy_coef=entropy_coef, temperature=temperature,
                          use_bias_correction_kl=False)  # verl's KL has no IS correction
    model = trainer.model
    model.eval()  # eval: TRL does not divide by gradient-accumulation steps
    g = torch.Generator().manual_seed(0)
    batch = _batch(trainer.processing_class, g)
    P = int(batch["prompt_len"])
    with torch.no_grad():
        lp, _ = policy_logprobs(model, batch, temperature)
    old = lp + 0.3 * torch.randn(lp.shape, generator=g)    # ratios well outside [0.8, 1.28]
    ref = lp + 0.2 * torch.randn(lp.shape, generator=g)
    adv = torch.randn(12, generator=g)
    mask = batch["response_mask"]

    trl_inputs = {
        "prompt_ids": batch["input_ids"][:, :P], "prompt_mask": batch["attention_mask"][:, :P],
        "completion_ids": batch["responses"],
        # TRL: completion_mask = real tokens, tool_mask = tokens the policy generated
        "completion_mask": batch["attention_mask"][:, P:],
        "tool_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }
    if beta:
        trl_inputs["ref_per_token_logps"] = ref
    model.zero_grad()
    trl_loss = trainer._compute_loss(model, trl_inputs)
    trl_loss.backward()
    trl_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    logprobs, entropy = policy_logprobs(model, batch, temperature, with_entropy=True,
                                        entropy_grad=True)
    loss, _ = grpo_loss(logprobs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=eps_high,
                        clip_ratio_c=None, loss_agg_mode=agg_mode,
                        ref_logprobs=ref if beta else None, kl_loss_coef=beta,
                        entropy=entropy, entropy_coeff=entropy_coef,
                        norm_length=TRL_MAX_COMPLETION)
    if loss_type == "dr_grpo":
        # TRL divides the token sum by batch * max_completion_length; verl (and we) by the
        # length only — the Dr.GRPO paper's constant; the batch is a constant factor.
        loss = loss / 12
    loss.backward()

    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    for ours, theirs in zip((p.grad for p in model.parameters()), trl_grads, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-7)
    clipped = ((torch.exp(lp - old) - 1).abs() > 0.2) & (mask > 0)
    assert clipped.any()  # the batch exercises clipping
