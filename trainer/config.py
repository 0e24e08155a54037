"""GRPOConfig: every knob of a training run, saved as config.json into every checkpoint.

Field names are verl's where verl has one (the verl key is in the comment; `to_verl_overrides`
writes them out for a run at cluster scale on the exported parquet). Three names follow this
project's brief instead of verl's flat key: group_size (rollout.n), total_steps
(trainer.total_training_steps), save_every (trainer.save_freq).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# verl's loss_agg_mode values. Defined here, not in grpo.py, so validating a config (the web
# process does, when a job is launched) needs no torch.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


# "hf": HF transformers generate over the policy itself, in the worker (CPU or GPU).
# "sglang": an SGLang server (trainer.rollout.SGLangRollout); weights pushed after every step.
ROLLOUT_BACKENDS = ("hf", "sglang")


@dataclass
class GRPOConfig:
    # --- model / output
    model_path: str = ""                  # actor_rollout_ref.model.path (initial policy weights)
    output_dir: str = "var/train"         # trainer.default_local_dir
    # --- data
    train_batch_size: int = 8             # data.train_batch_size: prompts per step
    max_prompt_length: int = 512          # data.max_prompt_length (longer prompts are refused)
    max_response_length: int = 256        # data.max_response_length: new tokens per rollout
    # --- rollout
    group_size: int = 8                   # actor_rollout_ref.rollout.n: samples per prompt
    temperature: float = 1.0              # actor_rollout_ref.rollout.temperature
    rollout_backend: str = "hf"           # actor_rollout_ref.rollout.name: "hf" | "sglang"
    rollout_url: str = ""                 # an operator rollout engine (name or URL); "" = the
    #                                       first of STEWARD_ROLLOUT_ENGINES (trainer.services)
    # --- actor update
    lr: float = 1e-6                      # actor_rollout_ref.actor.optim.lr
    weight_decay: float = 0.01            # actor_rollout_ref.actor.optim.weight_decay
    grad_clip: float = 1.0                # actor_rollout_ref.actor.grad_clip
    ppo_epochs: int = 1                   # actor_rollout_ref.actor.ppo_epochs
    ppo_mini_batch_size: int = 0          # actor.ppo_mini_batch_size, in prompts; 0 = whole batch
    ppo_micro_batch_size: int = 0         # actor.ppo_micro_batch_size_per_gpu, in sequences;
    #                                       0 = no gradient accumulation
    clip_ratio_low: float = 0.2           # actor_rollout_ref.actor.clip_ratio_low
    clip_ratio_high: float = 0.2          # actor_rollout_ref.actor.clip_ratio_high (DAPO: 0.28)
    clip_ratio_c: float | None = 3.0      # actor_rollout_ref.actor.clip_ratio_c (dual-clip)
    loss_agg_mode: str = "token-mean"     # actor_rollout_ref.actor.loss_agg_mode
    use_kl_loss: bool = False             # actor_rollout_ref.actor.use_kl_loss
    kl_loss_coef: float = 0.001           # actor_rollout_ref.actor.kl_loss_coef
    kl_loss_type: str = "low_var_kl"      # actor_rollout_ref.actor.kl_loss_type (k3 only here)
    entropy_coeff: float = 0.0            # actor_rollout_ref.actor.entropy_coeff
    # --- algorithm
    adv_estimator: str = "grpo"           # algorithm.adv_estimator
    norm_adv_by_std_in_grpo: bool = True  # algorithm.norm_adv_by_std_in_grpo (False: Dr.GRPO)
    drop_zero_spread_groups: bool = True  # ~ algorithm.filter_groups (DAPO dynamic sampling)
    # --- trainer
    seed: int = 0                         # data.seed / trainer seed
    total_steps: int = 100                # trainer.total_training_steps
    save_every: int = 50                  # trainer.save_freq (the last step is always saved)
    max_checkpoints_to_keep: int = 0      # trainer.max_actor_ckpt_to_keep; 0 = keep all
    device: str = "auto"                  # "auto": cuda when available, else cpu
    # Free-form provenance the caller wants in every checkpoint (job id, dataset version...).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}")
        if self.adv_estimator != "grpo":
            raise ValueError("only adv_estimator='grpo' is implemented")
        if self.kl_loss_type not in ("low_var_kl", "k3"):
            raise ValueError("only kl_loss_type='low_var_kl' (k3) is implemented")
        for name in ("train_batch_size", "group_size", "max_response_length", "ppo_epochs",
                     "total_steps", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.ppo_mini_batch_size and self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError("train_batch_size must be a multiple of ppo_mini_batch_size")
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 for GRPO sampling")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GRPOConfig:
        """Strict: an unknown key is an error (a typo must not silently become a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GRPOConfig keys: {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GRPOConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_verl_overrides(self) -> list[str]:
        """Hydra overrides for verl's main_ppo with the same algorithm settings."""
        a = "actor_rollout_ref.actor"
        pairs = {
            "algorithm.adv_estimator": self.adv_estimator,
            "algorithm.norm_adv_by_std_in_grpo": self.norm_adv_by_std_in_grpo,
            "data.train_batch_size": self.train_batch_size,
            "data.max_prompt_length": self.max_prompt_length,
            "data.max_response_length": self.max_response_length,
            "data.seed": self.seed,
            "actor_rollout_ref.model.path": self.model_path,
            "actor_rollout_ref.rollout.n": self.group_size,
            "actor_rollout_ref.rollout.temperature": self.temperature,
            f"{a}.optim.lr": self.lr,
            f"{a}.optim.weight_decay": self.weight_decay,
            f"{a}.grad_clip": self.grad_clip,
            f"{a}.ppo_epochs": self.ppo_epochs,
            f"{a}.ppo_mini_batch_size": self.ppo_mini_batch_size or self.train_batch_size,
            f"{a}.clip_ratio_low": self.clip_ratio_low,
            f"{a}.clip_ratio_high": self.clip_ratio_high,
            f"{a}.loss_agg_mode": self.loss_agg_mode,
            f"{a}.use_kl_loss": self.use_kl_loss,
            f"{a}.kl_loss_coef": self.kl_loss_coef,
            f"{a}.kl_loss_type": self.kl_loss_type,
            f"{a}.entropy_coeff": self.entropy_coeff,
            "trainer.total_training_steps": self.total_steps,
            "trainer.save_freq": self.save_every,
        }
        if self.clip_ratio_c is not None:
            pairs[f"{a}.clip_ratio_c"] = self.clip_ratio_c

        def fmt(v: Any) -> str:
            return str(v).lower() if isinstance(v, bool) else str(v)

        return [f"{k}={fmt(v)}" for k, v in pairs.items()]
