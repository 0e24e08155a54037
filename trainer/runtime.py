"""What the launch of a training job (trainer/services.py) and its run (trainer/tasks.py) both
need, so that the task module never imports the services (which enqueue the task)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings

from governance.services import ServiceError

TINY_BASE = "tiny-qwen2"  # built offline by the task when missing (trainer/tiny.py)


def stale_after() -> timedelta:
    """A running job whose heartbeat (updated every step) is older than this has lost its
    worker (STEWARD_TRAIN_STALE_SECONDS, default 15 minutes: longer than any one step)."""
    return timedelta(seconds=settings.STEWARD_TRAIN_STALE_SECONDS)


def rollout_engine_for(config: Any) -> Any:
    """The operator's rollout engine a GRPOConfig names (its rollout_url: an engine's name or
    exact URL; "" the first listed), else ServiceError — checked at launch and again in the
    task, so a job stored before the rule, or an engine the operator removed or made a
    serving engine since, never gets a request."""
    from governance.engines import EngineError, engines

    if config.rollout_backend != "sglang":
        raise ServiceError("rollout_url is only for rollout_backend 'sglang'")
    try:
        return engines().rollout_engine(config.rollout_url, "rollout_url")
    except EngineError as exc:
        raise ServiceError(str(exc)) from None
