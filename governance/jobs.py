"""The one claim rule of long Celery tasks (training jobs, erasure, candidate gates).

A long task takes ids, is delivered at least once (acks_late: a worker that dies mid-run has
its message delivered again) and must never run twice at the same time. So the task first
*claims* its row with one conditional UPDATE, and the row keeps a heartbeat (`heartbeat_at`)
while the task runs. The UPDATE succeeds only when

- the row is in its waiting status (`queued`, `pending`): the first delivery; or
- the row is `running` and this delivery is a Celery *retry* of the same task id (the attempt
  before ended by raising Retry, so it is not alive); or
- the row is `running` and its heartbeat is older than `stale_after` (the worker that held it
  died; a redelivered message takes over).

A redelivered message of a *live* run (same task id, fresh heartbeat, not a retry) claims
nothing: that is the whole point of the heartbeat. A finished row is never claimed again.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from governance.tenancy import tenant_context

RUNNING = "running"


def claim(model: type[models.Model], pk: int, tenant_id: int, task_id: str, *,
          waiting: str, is_retry: bool, stale_after: timedelta,
          running_filter: Q | None = None, **fields: Any) -> bool:
    """Claim row `pk` of `model` for the task `task_id` (rule in the module docstring): sets
    status=running, task_id, heartbeat_at=now and `fields`. `running_filter` narrows which
    running rows may be taken over (e.g. a candidate only at an offline gate). True when this
    delivery owns the row now."""
    now = timezone.now()
    running = Q(status=RUNNING) & (running_filter or Q())
    takeover = Q(task_id=task_id) if is_retry else Q(heartbeat_at__lt=now - stale_after)
    with tenant_context(tenant_id):
        updated = (model._default_manager.filter(pk=pk)
                   .filter(Q(status=waiting) | (running & takeover))
                   .update(status=RUNNING, task_id=task_id, heartbeat_at=now, **fields))
    return bool(updated)


def heartbeat(model: type[models.Model], pk: int, tenant_id: int, **fields: Any) -> None:
    """The run is alive: heartbeat_at=now (and `fields`, e.g. progress), in the caller's
    transaction when there is one. Call it at least once per `stale_after`."""
    with tenant_context(tenant_id):
        model._default_manager.filter(pk=pk).update(heartbeat_at=timezone.now(), **fields)
