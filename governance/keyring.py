"""The appliance's configured master key (Django settings) and the operations bound to it: data
key wrapping and the per-tenant subject hash. The primitives are in wire/crypto.py (Django-free,
shared with the proxy); this module only supplies them the key."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from django.conf import settings

from wire import crypto


@lru_cache(maxsize=1)
def master_key() -> bytes:
    return crypto.load_master_key(settings.STEWARD_MASTER_KEY,
                                  settings.STEWARD_MASTER_KEY_FILE, create=True)


def wrap_data_key(data_key: bytes, aad: bytes) -> bytes:
    return crypto.seal(master_key(), data_key, aad)


def unwrap_data_key(wrapped: bytes, aad: bytes) -> bytes:
    return crypto.open_sealed(master_key(), bytes(wrapped), aad)


def subject_hash(tenant_id: int, subject: str) -> str:
    """Keyed hash of a data subject identifier, per tenant (wire.crypto.subject_hasher)."""
    return subject_hasher(tenant_id)(subject)


def subject_hasher(tenant_id: int) -> Callable[[str], str]:
    """`subject_hash` for one tenant with the key derived once: for hashing many candidates
    (erasure's scan of payloads that were never indexed)."""
    return crypto.subject_hasher(master_key(), tenant_id)


def content_hasher(tenant_id: int) -> Callable[[bytes], str]:
    """Keyed digest of exact content bytes, per tenant (wire.crypto.content_hasher): the
    conversation store's message addresses."""
    return crypto.content_hasher(master_key(), tenant_id)
