"""Placeholder deltas in binary with 64-bit keys (format 2, governance/capture/delta_codec.py,
decision 39): every row is re-encoded, under the system scope (row-level security). No schema
change.

The codec is imported, not repeated here as 0021 repeats its own: it reads every format it ever
wrote (its MAGIC tells them apart), which is all this migration needs of it in either direction.

The reverse writes format 1 again, but its keys stay 64 bits: the release before this one looks
labels up by 128-bit keys, so in every trajectory that goes on after the downgrade it would number
known values again (`<PERSON_1>` becomes `<PERSON_7>` for the same person from then on). It
therefore refuses while deltas exist, unless STEWARD_MIGRATION_ACCEPT_LOSS names
`placeholder-keys`."""

import os
import zlib

import orjson
from django.db import migrations

from governance.capture.delta_codec import pack, unpack

ACCEPT = "placeholder-keys"


def _system(schema_editor) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.system', 'on', true)")


def _chunks(qs, size: int = 500):
    """The rows in lists of `size`, read through a server-side cursor (bounded memory)."""
    chunk = []
    for row in qs.iterator(chunk_size=size):
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def to_binary(apps, schema_editor) -> None:
    _system(schema_editor)
    PlaceholderDelta = apps.get_model("governance", "PlaceholderDelta")
    for rows in _chunks(PlaceholderDelta.objects.only("pk", "data").order_by("pk")):
        for row in rows:
            row.data = pack(unpack(row.data))
        PlaceholderDelta.objects.bulk_update(rows, ["data"])


def to_json(apps, schema_editor) -> None:
    _system(schema_editor)
    PlaceholderDelta = apps.get_model("governance", "PlaceholderDelta")
    if PlaceholderDelta.objects.exists() and ACCEPT not in os.environ.get(
            "STEWARD_MIGRATION_ACCEPT_LOSS", "").split(","):
        raise RuntimeError(
            "governance 0026 cannot be reversed without loss: placeholder deltas keep 64-bit "
            "keys, which the previous release (128-bit) does not match, so it would number "
            "known values again in every live trajectory. To reverse anyway, set "
            f"STEWARD_MIGRATION_ACCEPT_LOSS={ACCEPT}.")
    for rows in _chunks(PlaceholderDelta.objects.only("pk", "data").order_by("pk")):
        for row in rows:
            delta = unpack(row.data)
            row.data = zlib.compress(orjson.dumps({**delta, "v": 1}), 6)
        PlaceholderDelta.objects.bulk_update(rows, ["data"])


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0025_subject_keys_leakproof"),
    ]

    operations = [
        migrations.RunPython(to_binary, to_json),
    ]
