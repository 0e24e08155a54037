"""Raw payload encryption at rest: which data key a payload uses, how it is sealed and opened.

One AES-256-GCM data key per (tenant, subject hash) — per tenant when the call named no subject
(`subject_hash` ""). The data key is stored only wrapped by the master key, with the tenant and
subject hash as associated data, so a wrapped key copied to another row does not open. A raw
payload is sealed under its data key with the flow id as associated data, so a ciphertext copied
to another interaction does not open either. Destroying the DataKey row's key (erasure) makes
every payload it sealed unreadable, wherever copies of it live (crypto-shredding).

The plaintext is the JSON of the exchange exactly as the proxy spooled it: request and response
headers, and the bodies as base64 of the exact bytes.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
from django.db import connection

from governance.keyring import unwrap_data_key, wrap_data_key
from governance.models import DataKey, Interaction
from wire.crypto import new_data_key, open_sealed, seal
from wire.spool import json_form

# `routing`: the canary route/arm and context updates the proxy applied (proxy/routing.py);
# the step builder copies it into the step's `versions`.
RAW_FIELDS = ("method", "path", "request_headers", "request_body", "request_is_json",
              "response_status", "response_headers", "response_body", "is_stream", "error",
              "routing", "response_truncated")


INSERT_CHUNK = 1000


class RawPayloadUnavailable(RuntimeError):
    """The payload cannot be opened: no ciphertext (expired/purged) or the key is destroyed."""


def data_key_aad(tenant_id: int, subject_hash: str) -> bytes:
    return f"steward-datakey-v1:{tenant_id}:{subject_hash}".encode()


def raw_aad(flow_id: str) -> bytes:
    return f"steward-raw-v1:{flow_id}".encode()


def raw_plaintext(record: dict[str, Any]) -> bytes:
    """The exchange part of a spool record (no routing metadata), as JSON bytes. Bodies a
    binary spool frame carried as bytes are base64 here, as format-1 records had them."""
    record = json_form(record)
    return orjson.dumps({"v": 1, **{k: record.get(k) for k in RAW_FIELDS}})


def decode_body(value: str | None) -> bytes | None:
    if value is None:
        return None
    return base64.b64decode(value, validate=True)


def data_keys_for(pairs: set[tuple[int, str]]) -> dict[tuple[int, str], DataKey]:
    """The DataKey rows of these (tenant, subject hash) pairs, creating the missing ones.
    Concurrent shippers may race: INSERT ... ON CONFLICT DO NOTHING, then read back, so both
    end up with the one row that won."""
    if not pairs:
        return {}

    def fetch() -> dict[tuple[int, str], DataKey]:
        from django.db.models import Q

        q = Q()
        for tenant_id, subject in pairs:
            q |= Q(tenant_id=tenant_id, subject_hash=subject)
        return {(k.tenant_id, k.subject_hash): k for k in DataKey.objects.filter(q)}

    found = fetch()
    missing = [p for p in pairs if p not in found]
    if missing:
        DataKey.objects.bulk_create(
            [DataKey(tenant_id=t, subject_hash=s,
                     wrapped_key=wrap_data_key(new_data_key(), data_key_aad(t, s)))
             for t, s in missing],
            ignore_conflicts=True,
        )
        found = fetch()
    return found


def key_is_destroyed(key: DataKey | None) -> bool:
    return key is None or key.destroyed_at is not None or not key.wrapped_key


def unwrap(key: DataKey) -> bytes:
    if key_is_destroyed(key):
        raise RawPayloadUnavailable("the data key is destroyed (subject erased)")
    return unwrap_data_key(bytes(key.wrapped_key), data_key_aad(key.tenant_id, key.subject_hash))


def seal_raw(plain_key: bytes, flow_id: str, plaintext: bytes) -> bytes:
    return seal(plain_key, plaintext, raw_aad(flow_id))


def dead_letter_aad(tenant_id: int, flow_id: str) -> bytes:
    return f"steward-deadletter-v1:{tenant_id}:{flow_id}".encode()


def seal_dead_letter(plain_key: bytes, tenant_id: int, flow_id: str, record_json: bytes) -> bytes:
    """A dead-lettered spool record (governance.models.DeadLetter), sealed like a raw payload
    under its subject's data key; the tenant and flow id bind it to its row."""
    return seal(plain_key, record_json, dead_letter_aad(tenant_id, flow_id))


def open_dead_letter(dead_letter: Any) -> dict[str, Any]:
    """The spool record of a DeadLetter row (callers showing it to a person audit the read)."""
    if dead_letter.record_ciphertext is None or dead_letter.data_key is None:
        raise RawPayloadUnavailable("no record stored (expired, purged or subject erased)")
    plain_key = unwrap(dead_letter.data_key)
    return orjson.loads(open_sealed(plain_key, bytes(dead_letter.record_ciphertext),
                                    dead_letter_aad(dead_letter.tenant_id, dead_letter.flow_id)))


def open_raw(interaction: Interaction) -> dict[str, Any]:
    """Decrypt an interaction's raw payload. Callers that show it to a person must audit the
    read (governance.audit.record_event "raw.read"); the step builder reads it as the system."""
    if interaction.raw_ciphertext is None:
        raise RawPayloadUnavailable("no raw payload stored (expired or purged)")
    key = interaction.data_key
    if key is None:
        raise RawPayloadUnavailable("the data key is gone (subject erased)")
    plain_key = unwrap(key)
    return orjson.loads(open_sealed(plain_key, bytes(interaction.raw_ciphertext),
                                    raw_aad(interaction.flow_id)))


def insert_ignore_conflicts(objs: list, returning: tuple[str, ...]) -> list[tuple]:
    """Multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING <cols>: the rows that were really
    inserted (Django's bulk_create(ignore_conflicts=True) cannot say which)."""
    if not objs:
        return []
    if len(objs) > INSERT_CHUNK:  # keep under PostgreSQL's 65535 bind parameters
        return [row for i in range(0, len(objs), INSERT_CHUNK)
                for row in insert_ignore_conflicts(objs[i:i + INSERT_CHUNK], returning)]
    model = type(objs[0])
    meta = model._meta
    fields = [f for f in meta.concrete_fields if not (f.primary_key and f.auto_created)]
    qn = connection.ops.quote_name
    cols = ", ".join(qn(f.column) for f in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    params: list[Any] = []
    for obj in objs:
        for f in fields:
            params.append(f.get_db_prep_save(f.pre_save(obj, True), connection))
    sql = (f"INSERT INTO {qn(meta.db_table)} ({cols}) VALUES "
           + ", ".join([row] * len(objs))
           + " ON CONFLICT DO NOTHING RETURNING "
           + ", ".join(qn(meta.get_field(c).column) for c in returning))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
