"""Governance test data written straight into the tables: trajectories with sanitized (or not)
steps and their interactions. The sanitizer is not wired into the pipeline yet, so nothing the
real pipeline builds is training-eligible; dataset and retention tests create such steps here."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.utils import timezone

from governance.models import Interaction, PendingInteraction, Step, Trajectory


def make_trajectory(tenant, agent, *, steps: int = 2, sanitized: bool = True,
                    consent: str = "train", step_consent: str | None = None,
                    classification: str = "internal", state: str = "processed",
                    started: datetime | None = None, raw: bytes | None = b"ciphertext",
                    raw_expires_at: datetime | None = None, response_ids: list[str] | None = None,
                    subject_hash: str = "") -> Trajectory:
    """A trajectory with `steps` steps, each with its interaction (state `state`). The first
    step's interaction gets state `state`; the others are processed."""
    started = started or timezone.now() - timedelta(hours=1)
    traj = Trajectory.objects.create(
        id=uuid.uuid4(), tenant=tenant, agent=agent, consent=consent, started_at=started,
        last_step_at=started + timedelta(seconds=max(steps - 1, 0)), step_count=steps,
        subject_hash=subject_hash)
    for i in range(steps):
        at = started + timedelta(seconds=i)
        step_id = uuid.uuid4()
        ia = Interaction.objects.create(
            flow_id=uuid.uuid4().hex, tenant=tenant, agent=agent, trajectory=traj,
            step_id=step_id, endpoint="chat.completions", method="POST",
            path="/v1/chat/completions", status_code=200, consent=consent, started_at=at,
            ended_at=at, raw_ciphertext=raw, raw_expires_at=raw_expires_at,
            subject_hash=subject_hash)
        if i == 0 and state != "processed":
            # A quarantined (or not yet built) interaction has no step, and a pending row.
            PendingInteraction.objects.create(
                interaction=ia, tenant=tenant, trajectory=traj, started_at=at, state=state)
            continue
        Step.objects.create(
            id=step_id, tenant=tenant, trajectory=traj, interaction=ia,
            endpoint="chat.completions", started_at=at, ended_at=at, status_code=200,
            response_id=(response_ids[i] if response_ids and i < len(response_ids) else ""),
            observation={"messages": [{"role": "user", "content": "hi"}]},
            action={"messages": [{"role": "assistant", "content": "hello"}]},
            classification=classification, consent=step_consent or consent,
            sanitizer_version="test-1" if sanitized else "", training_eligible=sanitized)
    return traj


def add_findings(tenant, step, entity_types: list[str], *, side: str = "request",
                 path: str = "$.messages[0].content", item=None, version: str = "test-1"):
    """One packed Finding row (decision 37) holding a finding of each of `entity_types`, at
    offsets 0, 1, 2, ... of `path` in the step's `side`."""
    from governance.capture.findings import packed_rows

    found = [{"side": side, "entity_type": etype, "path": path, "start": i, "end": i + 1,
              "score": 0.9, "recognizer": "test", "operator": "placeholder"}
             for i, etype in enumerate(entity_types)]
    (row,) = packed_rows(tenant.pk if hasattr(tenant, "pk") else tenant, step.pk, found,
                         version, item.pk if item is not None else None)
    row.save()
    return row
