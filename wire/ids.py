"""Identifiers the proxy hands out before anything reaches the database."""

from __future__ import annotations

import os
import uuid

# Fixed forever: trajectory ids of sessions are uuid5 under this namespace, so every proxy
# instance (and any tool) maps the same tenant/agent/session to the same trajectory.
STEWARD_NAMESPACE = uuid.UUID("6f1c1d2e-5b0a-4c59-9b6e-3e7a2d1f0c42")


def session_trajectory_id(tenant_id: int, agent_id: int, session: str) -> str:
    """The trajectory id of an `X-Steward-Session` value, scoped to one tenant and agent."""
    return str(uuid.uuid5(STEWARD_NAMESPACE, f"{tenant_id}:{agent_id}:{session}"))


def new_id() -> str:
    """A random (version 4) UUID in canonical text form, as `str(uuid.uuid4())` but without
    building a UUID object: the proxy takes two per request and uuid.UUID's constructor is
    pure Python (~4 µs)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
