"""Findings' `spans` in format 2 (governance/capture/findings.py, decision 40): every packed row
is re-encoded, under the system scope (row-level security). No schema change.

The codec is imported, as 0026 imports its own: it reads every format it ever wrote (MAGIC tells
them apart) and still writes format 1 (`pack_v1`), which is all this migration needs of it in
either direction. The reverse is exact: both formats hold the same detail, and 0020's reverse
reads format 1 only."""

from django.db import migrations

from governance.capture.findings import MAGIC, pack, pack_v1, unpack

BATCH = 500


def _system(schema_editor) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.system', 'on', true)")


def _repack(schema_editor, encode, needs) -> None:
    """Re-encode, BATCH rows at a time through a server-side cursor, every row whose spans
    `needs(spans)` says are in the other format. The partition key (created_at) is in the
    WHERE so each update goes straight to its partition."""
    _system(schema_editor)
    conn = schema_editor.connection
    with conn.connection.cursor(name="steward_0029_findings") as rows, conn.cursor() as cur:
        rows.itersize = BATCH
        rows.execute("SELECT id, created_at, spans FROM governance_finding "
                     "WHERE length(spans) > 0 ORDER BY id")
        while chunk := rows.fetchmany(BATCH):
            updates = [(encode(unpack(spans)), pk, created)
                       for pk, created, spans in chunk if needs(bytes(spans))]
            cur.executemany("UPDATE governance_finding SET spans = %s "
                            "WHERE id = %s AND created_at = %s", updates)


def to_format2(apps, schema_editor) -> None:
    _repack(schema_editor, pack, lambda spans: not spans.startswith(MAGIC))


def to_format1(apps, schema_editor) -> None:
    _repack(schema_editor, pack_v1, lambda spans: spans.startswith(MAGIC))


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0028_conversation_item_indexes"),
    ]

    operations = [
        migrations.RunPython(to_format2, to_format1),
    ]
