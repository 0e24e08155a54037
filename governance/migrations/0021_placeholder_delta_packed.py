"""Placeholder deltas as zlib over their JSON (decision 37): PlaceholderDelta.state (jsonb)
becomes PlaceholderDelta.data (bytea). Both directions convert every row, under the system
scope (row-level security); the codec is repeated here on purpose (a migration must not depend
on app code that may change)."""

import zlib

import orjson
from django.db import migrations, models


def _system(schema_editor) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.system', 'on', true)")


def _chunks(qs, size: int = 500):
    """The rows in lists of `size`, read through a server-side cursor: memory stays bounded
    however many deltas an installation holds."""
    chunk = []
    for row in qs.iterator(chunk_size=size):
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def pack(apps, schema_editor) -> None:
    _system(schema_editor)
    PlaceholderDelta = apps.get_model("governance", "PlaceholderDelta")
    for rows in _chunks(PlaceholderDelta.objects.only("pk", "state").order_by("pk")):
        for row in rows:
            row.data = zlib.compress(orjson.dumps(row.state), 6)
        PlaceholderDelta.objects.bulk_update(rows, ["data"])


def unpack(apps, schema_editor) -> None:
    _system(schema_editor)
    PlaceholderDelta = apps.get_model("governance", "PlaceholderDelta")
    for rows in _chunks(PlaceholderDelta.objects.only("pk", "data").order_by("pk")):
        for row in rows:
            row.state = orjson.loads(zlib.decompress(bytes(row.data)))
        PlaceholderDelta.objects.bulk_update(rows, ["state"])


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0020_findings_packed"),
    ]

    operations = [
        migrations.AddField(model_name="placeholderdelta", name="data",
                            field=models.BinaryField(default=b"")),
        # A default while both columns exist, so that going back can re-add `state` to a
        # table with rows before `unpack` fills it.
        migrations.AlterField(model_name="placeholderdelta", name="state",
                              field=models.JSONField(default=dict)),
        migrations.RunPython(pack, unpack),
        migrations.RemoveField(model_name="placeholderdelta", name="state"),
        migrations.AlterField(model_name="placeholderdelta", name="data",
                              field=models.BinaryField()),
    ]
