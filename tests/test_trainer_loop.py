"""The training loop: `manage.py train_demo` learns, checkpoints carry config and state, a resumed
run continues exactly where the interrupted one would have gone, cancellation checkpoints."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import torch

from trainer.config import GRPOConfig
from trainer.loop import Task, list_checkpoints, train
from trainer.rollout import HFRollout
from trainer.tiny import build_tiny, load_tiny

STEP_KEYS = {"step", "reward_mean", "reward_std", "loss", "kl", "entropy", "tokens_per_s",
             "clip_frac", "grad_norm", "weight_version"}


@pytest.mark.timeout(1800)  # ~2 CPU-minutes, far more on a shared machine
def test_train_demo_command_raises_the_reward(tmp_path):
    """A short `manage.py train_demo` (60 GRPO steps after the format warm-up). Over so few steps
    the sampled reward is noise, so the check is on the policy's exact expected reward over all
    100 sums (teacher-forced probability of the right answer), which sampling cannot fake,
    measured before, at the mid-run checkpoint and at the end: it must rise by a meaningful
    absolute amount, and keep rising through the run (seed 0 measures 0.050 -> 0.067 -> 0.079;
    a policy that learned nothing stays at the warm-up's 1-in-19 chance level, ~0.05)."""
    from django.core.management import call_command

    from trainer.demo import addition_tasks, expected_reward

    out = io.StringIO()
    call_command("train_demo", "--steps", "60", "--seed", "0", "--out", str(tmp_path),
                 stdout=out)
    lines = out.getvalue().strip().splitlines()
    assert any(line.startswith("step ") for line in lines)   # progress lines
    summary = json.loads(lines[-1])                            # the JSON summary is last
    assert summary["steps"] == 60 and summary["steps_run"] == 60
    assert {"reward_first", "reward_last"} <= set(summary)
    before, after = summary["expected_reward_before"], summary["expected_reward_after"]
    assert before < 0.1                                        # the warm-up taught no answers
    mid_model, mid_tok = load_tiny(tmp_path / "global_step_30" / "model")
    mid = expected_reward(mid_model, mid_tok, addition_tasks(mid_tok))
    # GRPO did: +0.015 absolute at least (a 30 % gain over chance), and rising through the
    # run rather than one lucky end point.
    assert after - before >= 0.015, summary
    assert before + 0.005 < mid < after, (before, mid, after)

    ckpt = Path(summary["checkpoint"])
    assert ckpt == tmp_path / "global_step_60"
    cfg = GRPOConfig.load(ckpt / "config.json")
    assert cfg.seed == 0 and cfg.total_steps == 60 and cfg.extra["demo"] == "addition"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 60 and state["parent"] == str(tmp_path / "global_step_30")
    assert set(state["files"]) >= {"config.json", "optimizer.pt", "model/model.safetensors"}
    model, _ = load_tiny(ckpt / "model")                       # loadable as a plain HF model
    assert model.config.model_type == "qwen2"
    assert (tmp_path / "latest_checkpoint.txt").read_text().strip() == "global_step_60"


def _setup(seed: int = 0):
    policy, tok = build_tiny(seed=seed)
    tasks = [Task(tok(f"{a}+{b}=")["input_ids"], {"answer": str(a + b)}, f"{a}+{b}")
             for a in range(4) for b in range(4)]
    return policy, tok, tasks


def _reward(text: str, reference: dict) -> float:
    # dense, so every group has spread and every step updates
    return -abs(len(text) - 2) + float(reference["answer"] in text)


def _config(tmp_path: Path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path), train_batch_size=4, group_size=4, max_prompt_length=8,
                max_response_length=4, lr=1e-3, total_steps=4, save_every=2, seed=5,
                device="cpu", ppo_mini_batch_size=2)
    base.update(kw)
    return GRPOConfig(**base)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _comparable(m: dict) -> dict:
    timing = {"tokens_per_s", "rollout_s", "update_s", "step_s", "checkpoint"}
    return {k: v for k, v in m.items() if k not in timing}


def test_resume_continues_the_step_count_and_the_same_trajectory(tmp_path):
    # uninterrupted: 4 steps
    policy, tok, tasks = _setup()
    seen: list[dict] = []
    straight = train(_config(tmp_path / "a"), policy, tok, tasks, _reward, on_step=seen.append)
    assert [m["step"] for m in straight] == [1, 2, 3, 4] and seen == straight
    assert STEP_KEYS <= set(straight[0])
    assert [c.name for c in list_checkpoints(tmp_path / "a")] == ["global_step_2",
                                                                  "global_step_4"]
    # interrupted after 2, then a fresh process (new objects, other init) resumes
    policy2, tok2, tasks2 = _setup()
    first = train(_config(tmp_path / "b", total_steps=2), policy2, tok2, tasks2, _reward)
    assert [m["step"] for m in first] == [1, 2]
    policy3, tok3, tasks3 = _setup(seed=123)       # different weights: the checkpoint wins
    rest = train(_config(tmp_path / "b"), policy3, tok3, tasks3, _reward, resume_from="auto")
    assert [m["step"] for m in rest] == [3, 4]
    assert [_comparable(m) for m in rest] == [_comparable(m) for m in straight[2:]]
    assert torch.equal(_flat(policy3), _flat(policy))
    state = json.loads((tmp_path / "b" / "global_step_4" / "trainer_state.json").read_text())
    assert state["parent"] == str(tmp_path / "b" / "global_step_2")
    assert GRPOConfig.load(tmp_path / "b" / "global_step_4" / "config.json") == \
        _config(tmp_path / "b")
    # nothing left to do: resuming a finished run runs no step
    assert train(_config(tmp_path / "b"), policy3, tok3, tasks3, _reward,
                 resume_from=tmp_path / "b") == []


def test_should_stop_checkpoints_and_resume_picks_up(tmp_path):
    policy, tok, tasks = _setup()
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) == 3                       # cancelled during step 3

    hist = train(_config(tmp_path, total_steps=10, save_every=0), policy, tok, tasks, _reward,
                 should_stop=should_stop)
    assert [m["step"] for m in hist] == [1, 2, 3] and hist[-1]["stopped"] is True
    assert hist[-1]["checkpoint"] == str(tmp_path / "global_step_3")
    policy2, tok2, tasks2 = _setup()
    more = train(_config(tmp_path, total_steps=5, save_every=0), policy2, tok2, tasks2, _reward,
                 resume_from=tmp_path)
    assert [m["step"] for m in more] == [4, 5]
    with pytest.raises(FileNotFoundError):
        train(_config(tmp_path / "x"), policy2, tok2, tasks2, _reward,
              resume_from=tmp_path / "nothing-here")


def test_micro_batches_give_the_same_update(tmp_path):
    """Gradient accumulation over micro-batches is weighted so the step equals one big batch."""
    results = []
    for micro in (0, 3):
        policy, tok, tasks = _setup()
        train(_config(tmp_path / str(micro), total_steps=1, ppo_mini_batch_size=0,
                      ppo_micro_batch_size=micro, save_every=0), policy, tok, tasks, _reward)
        results.append(_flat(policy))
    assert torch.allclose(results[0], results[1], atol=1e-6)
    assert not torch.equal(results[0], _flat(_setup()[0]))  # the step did change the weights


class RecordingRollout(HFRollout):
    """The loop's own HF backend, also keeping each step's rollouts and the weights each
    step sampled (and scored the update's log-probs) with."""

    def __init__(self, policy: torch.nn.Module, tok) -> None:
        super().__init__(policy, tok.eos_token_id, tok.pad_token_id)
        self.rollouts: list[list] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def sync_weights(self, policy: torch.nn.Module, weight_version: str) -> None:
        super().sync_weights(policy, weight_version)
        self.weights.append(copy.deepcopy(policy.state_dict()))

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        self.rollouts.append(out)
        return out


def k3_kl_by_hand(model: torch.nn.Module, ref: torch.nn.Module, rollouts, temperature: float
                  ) -> float:
    """Schulman's k3 estimate of KL(pi || pi_ref), token-mean over every completion token,
    computed without the trainer's code: one unpadded forward per rollout, log-softmax at
    the positions that predict the completion."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            targets = torch.tensor(r.completion_ids)
            start = len(r.prompt_ids) - 1
            stop = start + len(r.completion_ids)
            lp = torch.log_softmax(model(ids).logits[0, start:stop] / temperature, -1)
            ref_lp = torch.log_softmax(ref(ids).logits[0, start:stop] / temperature, -1)
            d = (ref_lp.gather(1, targets[:, None]) - lp.gather(1, targets[:, None]))[:, 0]
            total += float((torch.exp(d) - d - 1.0).sum())
            count += len(r.completion_ids)
    return total / count


def test_kl_loss_to_the_reference_and_checkpoint_retention(tmp_path):
    """The logged KL is the k3 KL of the weights each step scored with against the initial
    weights, on that step's rollouts: exactly 0 at step 1 (nothing moved yet), then equal to
    an independent computation at every step."""
    policy, tok, tasks = _setup()
    reference = copy.deepcopy(policy).eval()
    backend = RecordingRollout(policy, tok)
    # One pass over the whole batch: the update's log-probs are the pre-step weights'.
    config = _config(tmp_path, use_kl_loss=True, kl_loss_coef=0.1, total_steps=3,
                     save_every=1, max_checkpoints_to_keep=2, ppo_epochs=1,
                     ppo_mini_batch_size=0, drop_zero_spread_groups=False)
    hist = train(config, policy, tok, tasks, _reward, backend=backend)
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    scorer = copy.deepcopy(reference)
    for step, metrics in enumerate(hist):
        scorer.load_state_dict(backend.weights[step])  # what step `step + 1` scored with
        by_hand = k3_kl_by_hand(scorer, reference, backend.rollouts[step], config.temperature)
        assert metrics["kl"] == pytest.approx(by_hand, rel=1e-3, abs=1e-7), step
    assert hist[-1]["kl"] > 1e-5                           # the policy moved away from the ref
    assert [c.name for c in list_checkpoints(tmp_path)] == ["global_step_2", "global_step_3"]


def test_bad_inputs_are_refused(tmp_path):
    policy, tok, tasks = _setup()
    with pytest.raises(ValueError, match="no tasks"):
        train(_config(tmp_path), policy, tok, [], _reward)
    with pytest.raises(ValueError, match="max_prompt_length"):
        train(_config(tmp_path, max_prompt_length=2), policy, tok, tasks, _reward)
    with pytest.raises(ValueError, match="unknown reward function"):
        train(_config(tmp_path), policy, tok, tasks, "no_such_reward")
