"""The GRPO training loop — one function, read top to bottom.

    history = train(config, policy, tokenizer, tasks, "exact_match", backend,
                    on_step=report, should_stop=cancelled, resume_from="auto")

Each step: take train_batch_size prompts -> sample group_size completions of each (rollout
backend) -> score them (reward function) -> group-relative advantages -> drop groups with no
reward spread -> PPO-clipped policy update (optional k3 KL to a frozen reference) -> push the new
weights to the rollout engine -> metrics -> checkpoint every save_every steps.

Everything random is a function of (config.seed, step): the prompts of step s and the sampling
seed of step s. Together with the weights and the optimizer state in the checkpoint, a resumed
run continues exactly where the interrupted one would have gone.

Checkpoint layout (output_dir/global_step_{step}/, verl's naming):
    model/               save_pretrained weights + HF config + tokenizer (loadable by SGLang)
    config.json          GRPOConfig.to_dict()
    optimizer.pt         AdamW state
    rng_state.pt         torch / python RNG states
    trainer_state.json   step, weight_version, parent checkpoint, last metrics, file sha256s
output_dir/latest_checkpoint.txt names the newest complete one; metrics.jsonl has every step.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config import GRPOConfig
from trainer.grpo import (
    drop_zero_spread_groups,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    response_mask_from_lists,
    token_logprobs,
)
from trainer.rewards import RewardFn, get_reward_fn
from trainer.rollout import HFRollout, Rollout, RolloutBackend

CKPT_PREFIX = "global_step_"
LATEST = "latest_checkpoint.txt"


@dataclass
class Task:
    """One prompt and the ground truth its reward function checks completions against."""
    prompt_ids: list[int]
    reference: dict[str, Any] = field(default_factory=dict)
    uid: str = ""


StepCallback = Callable[[dict[str, Any]], None]
StopCallback = Callable[[], bool]


def train(config: GRPOConfig, policy: torch.nn.Module, tokenizer: Any, tasks: Sequence[Task],
          reward_fn: RewardFn | str, backend: RolloutBackend | None = None, *,
          on_step: StepCallback | None = None, should_stop: StopCallback | None = None,
          resume_from: str | Path | None = None,
          ref_policy: torch.nn.Module | None = None) -> list[dict[str, Any]]:
    """Run GRPO from the current step to config.total_steps; returns this call's step metrics.

    backend      defaults to HFRollout over `policy` itself (same device, no weight copies)
    on_step      called with each step's metrics (after its checkpoint, if one was written)
    should_stop  polled after every step; True -> write a checkpoint and return early
    resume_from  a checkpoint dir, an output dir (its latest checkpoint), or "auto" (the latest
                 in config.output_dir if there is one, else a fresh start)
    ref_policy   frozen reference for the KL loss; default: a copy of the initial policy (on
                 resume: loaded from config.model_path)"""
    # ---- 0. set-up ---------------------------------------------------------------------------
    if not tasks:
        raise ValueError("no tasks to train on")
    for t in tasks:
        if not t.prompt_ids or len(t.prompt_ids) > config.max_prompt_length:
            raise ValueError(f"task {t.uid or '?'}: prompt has {len(t.prompt_ids)} tokens "
                             f"(1..max_prompt_length={config.max_prompt_length})")
    reward = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
    device = _device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    policy.to(device)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=(0.9, 0.999),
                                  weight_decay=config.weight_decay)
    G = config.group_size
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend is None:
        backend = HFRollout(policy, tokenizer.eos_token_id, tokenizer.pad_token_id)

    start_step, parent = 0, None
    ckpt = find_checkpoint(resume_from, out_dir) if resume_from is not None else None
    if ckpt is not None:
        start_step = load_checkpoint(ckpt, policy, optimizer)["step"]
        parent = str(ckpt)
    backend.sync_weights(policy, str(start_step))  # the engine samples from what we train

    ref = None
    if config.use_kl_loss:
        ref = ref_policy if ref_policy is not None else _initial_reference(policy, config, ckpt)
        ref.to(device).eval().requires_grad_(False)

    history: list[dict[str, Any]] = []
    for step in range(start_step, config.total_steps):
        t0 = time.perf_counter()

        # ---- 1. prompts: a pure function of (seed, step) ------------------------------------
        batch_tasks = sample_tasks(tasks, config.train_batch_size, config.seed, step)

        # ---- 2. rollout: G completions per prompt, group-contiguous ---------------------------
        rollouts = backend.generate([t.prompt_ids for t in batch_tasks], n=G,
                                    max_new_tokens=config.max_response_length,
                                    temperature=config.temperature,
                                    seed=config.seed * 1_000_003 + step)
        t_rollout = time.perf_counter() - t0

        # ---- 3. rewards ----------------------------------------------------------------------
        texts = tokenizer.batch_decode([r.completion_ids for r in rollouts],
                                       skip_special_tokens=True)
        rewards = torch.tensor([float(reward(text, batch_tasks[i // G].reference))
                                for i, text in enumerate(texts)])            # [B*G]

        # ---- 4. advantages; groups with no spread carry no signal ----------------------------
        advantages = group_advantages(rewards, G, config.norm_adv_by_std_in_grpo)  # [B*G]
        keep = drop_zero_spread_groups(rewards, G) if config.drop_zero_spread_groups \
            else torch.ones_like(rewards, dtype=torch.bool)

        # ---- 5. policy update ----------------------------------------------------------------
        t1 = time.perf_counter()
        update: dict[str, float] = {}
        if bool(keep.any()):
            kept = [r for r, k in zip(rollouts, keep.tolist(), strict=True) if k]
            batch = collate(kept, tokenizer.pad_token_id, device)
            update = _update_policy(policy, ref, optimizer, batch, advantages[keep].to(device),
                                    config)
        t_update = time.perf_counter() - t1

        # ---- 6. the rollout engine gets the new weights --------------------------------------
        weight_version = str(step + 1)
        backend.sync_weights(policy, weight_version)

        # ---- 7. metrics ----------------------------------------------------------------------
        dt = time.perf_counter() - t0
        gen_tokens = sum(len(r.completion_ids) for r in rollouts)
        metrics: dict[str, Any] = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "loss": update.get("loss", 0.0),
            "pg_loss": update.get("pg_loss", 0.0),
            "kl": update.get("kl", 0.0),
            "entropy": update.get("entropy", 0.0),
            "clip_frac": update.get("pg_clipfrac", 0.0),
            "clip_frac_lower": update.get("pg_clipfrac_lower", 0.0),
            "ppo_kl": update.get("ppo_kl", 0.0),
            "grad_norm": update.get("grad_norm", 0.0),
            "groups_kept": int(keep.sum().item()) // G,
            "groups": len(batch_tasks),
            "response_length_mean": gen_tokens / len(rollouts),
            "stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / len(rollouts),
            "tokens": gen_tokens,
            "tokens_per_s": gen_tokens / dt,
            "rollout_s": t_rollout,
            "update_s": t_update,
            "step_s": dt,
            "weight_version": weight_version,
            "lr": config.lr,
        }

        # ---- 8. checkpoint, callbacks, cancellation ------------------------------------------
        stop = bool(should_stop and should_stop())
        last = step + 1 == config.total_steps
        if stop or last or (config.save_every and (step + 1) % config.save_every == 0):
            path = save_checkpoint(out_dir, step + 1, policy, tokenizer, optimizer, config,
                                   metrics, parent)
            parent = str(path)
            metrics["checkpoint"] = str(path)
        with open(out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        history.append(metrics)
        if on_step:
            on_step(metrics)
        if stop:
            metrics["stopped"] = True
            break
    return history


# ------------------------------------------------------------------------------------ batches

def sample_tasks(tasks: Sequence[Task], batch_size: int, seed: int, step: int) -> list[Task]:
    """Epoch-wise shuffled pass over the tasks (each epoch a fresh permutation seeded by
    (seed, epoch)); step s takes the s-th batch of that endless stream."""
    n = len(tasks)
    out: list[Task] = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(seed * 7919 + epoch).shuffle(order)
        take = min(batch_size - len(out), n - offset)
        out.extend(tasks[i] for i in order[offset:offset + take])
        pos += take
    return out


def collate(rollouts: Sequence[Rollout], pad_id: int, device: torch.device
            ) -> dict[str, torch.Tensor]:
    """[left-padded prompt | right-padded completion] rows for one forward pass.

    input_ids, attention_mask, position_ids: [n, P + T]; responses, response_mask: [n, T]
    The logits that predict completion token t sit at column P - 1 + t."""
    n = len(rollouts)
    P = max(len(r.prompt_ids) for r in rollouts)
    T = max(max(len(r.completion_ids) for r in rollouts), 1)
    input_ids = torch.full((n, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, P + T), dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, P - p:P] = torch.tensor(r.prompt_ids)
        attention_mask[i, P - p:P + c] = 1
        if c:
            input_ids[i, P:P + c] = torch.tensor(r.completion_ids)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "position_ids": position_ids.to(device),
        "responses": input_ids[:, P:].to(device),
        "response_mask": response_mask_from_lists([r.loss_mask() for r in rollouts], T, device),
        "prompt_len": torch.tensor(P),
    }


def _slice(batch: dict[str, torch.Tensor], idx: slice) -> dict[str, torch.Tensor]:
    return {k: (v if k == "prompt_len" else v[idx]) for k, v in batch.items()}


def policy_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                    with_entropy: bool = False, entropy_grad: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under `model` at `temperature` (the sampling distribution):
    [n, T], and the per-token entropy [n, T] when asked (without a graph unless entropy_grad:
    a metric must not keep a second [n, T, V] activation alive through backward)."""
    P, T = int(batch["prompt_len"]), batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False,
                logits_to_keep=T + 1)                             # only the logits we score
    logits = out.logits[:, :-1, :] / temperature                  # [n, T, V] predicts tokens P..
    assert logits.shape[1] == T and batch["input_ids"].shape[1] == P + T
    logprobs = token_logprobs(logits, batch["responses"])         # [n, T]
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


# ------------------------------------------------------------------------------------- update

def _update_policy(policy: torch.nn.Module, ref: torch.nn.Module | None,
                   optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                   advantages: torch.Tensor, config: GRPOConfig) -> dict[str, float]:
    """ppo_epochs passes over the batch in mini-batches (one optimizer step each), each split
    into micro-batches whose losses are weighted so the sum equals the mini-batch loss."""
    n = advantages.shape[0]
    G = config.group_size
    mini = (config.ppo_mini_batch_size * G) if config.ppo_mini_batch_size else n
    micro = config.ppo_micro_batch_size or mini
    single_pass = config.ppo_epochs == 1 and mini >= n

    with torch.no_grad():
        # Old log-probs: on a single pass the policy has not moved since the rollout, so the
        # detached current log-probs ARE the old ones (ratio 1, as verl and TRL do). Otherwise
        # recompute them once with the trainer's own numerics (not the engine's: SGLang's
        # kernels differ slightly, and the ratio must start at exactly 1).
        old = None if single_pass else _chunked_logprobs(policy, batch, micro, config)
        ref_lp = _chunked_logprobs(ref, batch, micro, config) if ref is not None else None

    totals: dict[str, float] = {}
    weight_sum = 0.0
    for _ in range(config.ppo_epochs):
        for m0 in range(0, n, mini):
            mb = slice(m0, min(m0 + mini, n))
            mb_mask = batch["response_mask"][mb]
            optimizer.zero_grad(set_to_none=True)
            for u0 in range(mb.start, mb.stop, micro):
                ub = slice(u0, min(u0 + micro, mb.stop))
                part = _slice(batch, ub)
                logprobs, entropy = policy_logprobs(policy, part, config.temperature,
                                                    with_entropy=True,
                                                    entropy_grad=config.entropy_coeff != 0.0)
                old_lp = logprobs.detach() if old is None else old[ub]
                loss, m = grpo_loss(
                    logprobs, old_lp, advantages[ub], part["response_mask"],
                    clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                    clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
                    ref_logprobs=None if ref_lp is None else ref_lp[ub],
                    kl_loss_coef=config.kl_loss_coef if config.use_kl_loss else 0.0,
                    entropy=entropy, entropy_coeff=config.entropy_coeff,
                    norm_length=config.max_response_length)
                w = _micro_weight(config.loss_agg_mode, part["response_mask"], mb_mask)
                (loss * w).backward()
                for k, v in m.items():
                    totals[k] = totals.get(k, 0.0) + v * w
                weight_sum += w
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
            if not math.isfinite(float(grad_norm)):  # skip a step that would poison the weights
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm)
    steps = config.ppo_epochs * math.ceil(n / mini)
    out = {k: v / max(weight_sum, 1e-12) for k, v in totals.items() if k != "grad_norm"}
    out["grad_norm"] = totals["grad_norm"] / steps
    return out


def _micro_weight(mode: str, micro_mask: torch.Tensor, mini_mask: torch.Tensor) -> float:
    """Share of the mini-batch loss one micro-batch carries: by tokens for token-mean, by
    sequences for the seq-mean modes; the Dr.GRPO sum over a constant needs no reweighting."""
    if mode == "token-mean":
        return float(micro_mask.sum()) / max(float(mini_mask.sum()), 1.0)
    if mode == "seq-mean-token-sum-norm":
        return 1.0
    return micro_mask.shape[0] / mini_mask.shape[0]


def _chunked_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], micro: int,
                      config: GRPOConfig) -> torch.Tensor:
    n = batch["responses"].shape[0]
    parts = [policy_logprobs(model, _slice(batch, slice(i, min(i + micro, n))),
                             config.temperature)[0] for i in range(0, n, micro)]
    return torch.cat(parts, 0)


def _initial_reference(policy: torch.nn.Module, config: GRPOConfig,
                       resumed: Path | None) -> torch.nn.Module:
    if resumed is None:
        return copy.deepcopy(policy)  # the policy has not been updated yet
    if not config.model_path:
        raise ValueError("use_kl_loss on resume needs config.model_path (the initial weights "
                         "the KL is measured against) or an explicit ref_policy")
    return type(policy).from_pretrained(config.model_path, local_files_only=True)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# -------------------------------------------------------------------------------- checkpoints

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(out_dir: Path, step: int, policy: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, config: GRPOConfig,
                    metrics: dict[str, Any], parent: str | None) -> Path:
    """Write global_step_{step}/ atomically (a temp dir renamed into place), then point
    latest_checkpoint.txt at it. A crash mid-save leaves the previous checkpoint the latest."""
    final = out_dir / f"{CKPT_PREFIX}{step}"
    tmp = out_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_pretrained(tmp / "model")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    config.save(tmp / "config.json")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng_state.pt")
    files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    state = {
        "step": step,
        "weight_version": str(step),
        "model_dir": "model",
        "optimizer_state": "optimizer.pt",
        "rng_state": "rng_state.pt",
        "parent": parent,
        "seed": config.seed,
        "metrics": metrics,
        "files": files,  # sha256 of every file above (this one excluded)
        "created_at": time.time(),
    }
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = out_dir / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, out_dir / LATEST)
    if config.max_checkpoints_to_keep:
        for old in list_checkpoints(out_dir)[:-config.max_checkpoints_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints (trainer_state.json written last), oldest first."""
    found = [p for p in Path(out_dir).glob(f"{CKPT_PREFIX}*")
             if (p / "trainer_state.json").is_file() and p.name[len(CKPT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CKPT_PREFIX):]))


def find_checkpoint(resume_from: str | Path, out_dir: Path) -> Path | None:
    """Resolve resume_from to a checkpoint dir. "auto": the latest in out_dir or None."""
    if str(resume_from) == "auto":
        found = list_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if (path / "trainer_state.json").is_file():
        return path
    found = list_checkpoints(path) if path.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no checkpoint at {path}")
    return found[-1]


def load_checkpoint(path: Path, policy: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Weights, optimizer and RNG state back from `path`; returns its trainer_state."""
    state = json.loads((path / "trainer_state.json").read_text())
    loaded = type(policy).from_pretrained(path / state["model_dir"], local_files_only=True)
    policy.load_state_dict(loaded.state_dict())
    device = next(policy.parameters()).device
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / state["optimizer_state"],
                                             map_location=device, weights_only=True))
    rng = torch.load(path / state["rng_state"], weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state
