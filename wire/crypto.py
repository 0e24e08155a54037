"""Keys and AEAD: the master key, data keys, keyed hashes, token hashes (primitives only).

Layering: the master key (32 bytes, from STEWARD_MASTER_KEY or a file) wraps data keys with
AES-256-GCM; data keys encrypt raw payloads with AES-256-GCM. Subject identifiers are stored
only as HMAC-SHA256 under a key derived from the master key, so the same subject maps to the
same hash in a tenant but cannot be reversed or looked up in another tenant.

Django-free: every function takes the key it uses. The configured master key of the web and
worker processes, and the functions bound to it, are in governance/keyring.py; the proxy loads
its own with `load_master_key` from its environment.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

NONCE_BYTES = 12


class MasterKeyError(RuntimeError):
    pass


def load_master_key(env_value: str = "", file_path: str = "", create: bool = False) -> bytes:
    """Master key from the env value (base64) or the file (base64); with `create`, a missing
    file is generated (mode 0600) — the embedded appliance does this on first start."""
    if env_value:
        key = base64.b64decode(env_value)
    else:
        path = Path(file_path)
        if not path.exists():
            if not create:
                raise MasterKeyError(
                    f"no master key: set STEWARD_MASTER_KEY or create {path} "
                    "(32 random bytes, base64)"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
        key = base64.b64decode(path.read_text().strip())
    if len(key) != 32:
        raise MasterKeyError("the master key must be 32 bytes, base64-encoded")
    return key


def derive_key(master: bytes, purpose: str) -> bytes:
    """A 32-byte sub-key for one purpose (spool encryption, subject hashing, ...)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=f"steward/{purpose}".encode()).derive(master)


def seal(key: bytes | AESGCM, plaintext: bytes, associated_data: bytes | None = None) -> bytes:
    """`key` may be a prepared AESGCM, for a caller sealing many records under one long-lived
    key (the spool writer: building the cipher costs more than sealing a record). Data keys
    are not kept that way: a crypto-shredded key must not live on in a cache."""
    nonce = os.urandom(NONCE_BYTES)
    aead = key if isinstance(key, AESGCM) else AESGCM(key)
    return nonce + aead.encrypt(nonce, plaintext, associated_data)


def open_sealed(key: bytes | AESGCM, sealed: bytes, associated_data: bytes | None = None
                ) -> bytes:
    """`key` may be a prepared AESGCM (as for `seal`: the spool reader opens many records)."""
    aead = key if isinstance(key, AESGCM) else AESGCM(key)
    return aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated_data)


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def subject_hasher(master: bytes, tenant_id: int) -> Callable[[str], str]:
    """The keyed hash of a data subject identifier in one tenant, with the key derived once
    (erasure hashes many candidates). Normalised (trimmed, casefolded) so `Alice@Example.com`
    and `alice@example.com ` are the same person."""
    key = derive_key(master, "subject-hash")
    prefix = f"{tenant_id}:"

    def digest(subject: str) -> str:
        msg = (prefix + subject.strip().casefold()).encode("utf-8", "backslashreplace")
        return hmac.new(key, msg, hashlib.sha256).hexdigest()

    return digest


def content_hasher(master: bytes, tenant_id: int) -> Callable[[bytes], str]:
    """The keyed hash of exact content bytes in one tenant (the conversation store's message
    digests): unlike `subject_hasher`, nothing is normalised — one changed byte is another
    message. Keyed, so a digest in the database cannot be checked against a guessed text by
    anyone without the master key."""
    key = derive_key(master, "content-digest")
    prefix = f"{tenant_id}:".encode()

    def digest(content: bytes) -> str:
        return hmac.new(key, prefix + content, hashlib.sha256).hexdigest()

    return digest


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(30)
