"""`python manage.py train_demo`: GRPO on the CPU, end to end, through the real job's code path.

The task: add two single-digit numbers. Prompt "3+4=", the completion must be exactly "7" and
stop; the reward is the registry's `exact_match` (1.0 or 0.0, nothing in between).

The policy is a randomly initialised tiny Qwen2 (trainer.tiny). A random policy essentially never
emits "<digits><end-of-text>", so an exact-match reward would be zero for every sample and GRPO
would get no signal. Before GRPO the demo therefore runs a short *format* warm-up: supervised
steps on "a+b=" followed by a uniformly random number from 0..18 — the output format, never the
answer (a warmed-up policy is right about 1 time in 19). Everything above that chance level is
learned by GRPO from the reward alone; the summary reports greedy exact-match accuracy over
all 100 sums before and after GRPO next to the sampled reward.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.config import GRPOConfig
from trainer.loop import Task, train
from trainer.rollout import HFRollout
from trainer.tiny import build_tiny, save_tiny

DEFAULT_STEPS = 600


def addition_tasks(tokenizer: Any) -> list[Task]:
    return [Task(tokenizer(f"{a}+{b}=")["input_ids"], {"answer": str(a + b)}, f"{a}+{b}")
            for a in range(10) for b in range(10)]


def format_warmup(model: torch.nn.Module, tokenizer: Any, steps: int, seed: int,
                  lr: float = 3e-3, batch: int = 64) -> float:
    """Teach the output format with random answers: '<a>+<b>=' -> '<random 0..18><eos>'.
    Returns the last cross-entropy per token. Its floor is the entropy of the random answers,
    log(19) nats spread over ~2.47 tokens per answer (digits + end-of-text) ~ 1.19: no policy
    can beat it, since the targets carry no information about the sum — a policy at ~1.19 has
    learned the format and nothing else."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            a, b = rng.randrange(10), rng.randrange(10)
            prompt = tokenizer(f"{a}+{b}=")["input_ids"]
            answer = tokenizer(str(rng.randrange(19)))["input_ids"] + [tokenizer.eos_token_id]
            rows.append((prompt, answer))
        L = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch, L), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, L), dtype=torch.long)
        labels = torch.full((batch, L), -100, dtype=torch.long)  # loss on the answer only
        for i, (p, c) in enumerate(rows):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            mask[i, :len(p) + len(c)] = 1
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, tasks: list[Task]) -> float:
    """Exact-match accuracy of (near-)greedy decoding over all tasks."""
    backend = HFRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    rollouts = backend.generate([t.prompt_ids for t in tasks], n=1, max_new_tokens=3,
                                temperature=1e-5, seed=0)
    texts = tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=True)
    return sum(t.strip() == task.reference["answer"]
               for t, task in zip(texts, tasks, strict=True)) / len(tasks)


@torch.no_grad()
def expected_reward(model: torch.nn.Module, tokenizer: Any, tasks: list[Task]) -> float:
    """The policy's exact expected exact-match reward at temperature 1, averaged over all tasks:
    p(answer tokens + end-of-text | prompt), teacher-forced. No sampling noise, so a short run
    can show a real (if small) gain that the sampled reward would hide in noise. (Exact
    because every other completion scores 0; "07" or " 7" are other token strings.)"""
    was_training = model.training
    model.eval()
    total = 0.0
    for t in tasks:
        answer = tokenizer(t.reference["answer"])["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([t.prompt_ids + answer])
        logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1:-1]   # [len(answer), V]
        logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(answer)[:, None])
        total += float(logp.sum().exp())
    model.train(was_training)
    return total / len(tasks)


def demo_config(steps: int, seed: int, out_dir: str) -> GRPOConfig:
    return GRPOConfig(
        output_dir=out_dir,
        train_batch_size=16, group_size=8,
        max_prompt_length=8, max_response_length=3,
        temperature=1.0, lr=1e-3, weight_decay=0.0,
        ppo_mini_batch_size=4,          # 4 optimizer steps per rollout batch
        loss_agg_mode="token-mean",
        seed=seed, total_steps=steps, save_every=max(steps // 2, 1),
        device="cpu",
    )


def run_demo(steps: int = DEFAULT_STEPS, seed: int = 0, out_dir: str | None = None,
             warmup_steps: int = 100, log: Callable[[str], None] = print,
             resume: bool = False) -> dict[str, Any]:
    """Build, warm up, train; returns the summary (also the command's last output line)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bars would drown the progress lines
    out = Path(out_dir or tempfile.mkdtemp(prefix="steward-train-demo-"))
    torch.manual_seed(seed)
    t_start = time.perf_counter()

    model, tokenizer = build_tiny(seed)
    tasks = addition_tasks(tokenizer)
    warm_loss = format_warmup(model, tokenizer, warmup_steps, seed) if warmup_steps else None
    base = save_tiny(model, tokenizer, out / "base")  # the initial policy: lineage parent
    acc_before = greedy_accuracy(model, tokenizer, tasks)
    exp_before = expected_reward(model, tokenizer, tasks)
    log(f"format warm-up: {warmup_steps} steps, loss {warm_loss}, "
        f"greedy accuracy {acc_before:.2f}, expected reward {exp_before:.3f} "
        f"(chance ~{1 / 19:.2f})")

    config = demo_config(steps, seed, str(out))
    config.model_path = str(base)
    config.extra = {"demo": "addition", "warmup_steps": warmup_steps}
    every = max(steps // 20, 1)

    def on_step(m: dict[str, Any]) -> None:
        if m["step"] % every == 0 or m["step"] == steps or "checkpoint" in m:
            log(f"step {m['step']:4d}  reward {m['reward_mean']:.3f}  loss {m['loss']:+.4f}  "
                f"entropy {m['entropy']:.3f}  clip {m['clip_frac']:.3f}  "
                f"groups {m['groups_kept']}/{m['groups']}  {m['tokens_per_s']:.0f} tok/s"
                + (f"  -> {m['checkpoint']}" if "checkpoint" in m else ""))

    history = train(config, model, tokenizer, tasks, "exact_match", on_step=on_step,
                    resume_from="auto" if resume else None)
    acc_after = greedy_accuracy(model, tokenizer, tasks)
    exp_after = expected_reward(model, tokenizer, tasks)
    rewards = [m["reward_mean"] for m in history]
    window = max(len(rewards) // 10, 1)
    summary = {
        "reward_first": sum(rewards[:window]) / window if rewards else None,
        "reward_last": sum(rewards[-window:]) / window if rewards else None,
        "reward_window_steps": window,
        "steps": history[-1]["step"] if history else steps,
        "steps_run": len(history),
        "greedy_accuracy_before": acc_before,
        "greedy_accuracy_after": acc_after,
        "expected_reward_before": exp_before,
        "expected_reward_after": exp_after,
        "seed": seed,
        "seconds": round(time.perf_counter() - t_start, 1),
        "checkpoint": history[-1].get("checkpoint") if history else None,
        "output_dir": str(out),
    }
    log(json.dumps(summary))
    return summary
