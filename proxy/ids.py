"""Identifiers the proxy hands out before anything reaches the database."""

from __future__ import annotations

import uuid

# Fixed forever: trajectory ids of sessions are uuid5 under this namespace, so every proxy
# instance (and any tool) maps the same tenant/agent/session to the same trajectory.
STEWARD_NAMESPACE = uuid.UUID("6f1c1d2e-5b0a-4c59-9b6e-3e7a2d1f0c42")


def session_trajectory_id(tenant_id: int, agent_id: int, session: str) -> str:
    """The trajectory id of an `X-Steward-Session` value, scoped to one tenant and agent."""
    return str(uuid.uuid5(STEWARD_NAMESPACE, f"{tenant_id}:{agent_id}:{session}"))


def new_id() -> str:
    return str(uuid.uuid4())
