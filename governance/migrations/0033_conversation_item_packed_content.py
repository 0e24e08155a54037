"""Conversation items' `content` as zlib'd JSON in a bytea (governance.models.PackedJSONField,
decision 40) instead of JSONB: ~30 % fewer bytes of the messages themselves, small ones
included (pglz only compresses a row past ~2 KB). Every row is converted, BATCH at a time,
under the system scope (row-level security), into a new column that then takes the old one's
place; the reverse converts back the same way. Exact both ways: the same JSON values."""

import zlib

import orjson
from django.db import migrations

import governance.models

BATCH = 500


def _convert(schema_editor, column_type: str, read_sql: str, encode) -> None:
    conn = schema_editor.connection
    with conn.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
        cur.execute(f"ALTER TABLE governance_conversationitem ADD COLUMN content_new {column_type}")
    with conn.connection.cursor(name="steward_0033_items") as rows, conn.cursor() as cur:
        rows.itersize = BATCH
        rows.execute(f"SELECT id, {read_sql} FROM governance_conversationitem ORDER BY id")
        while chunk := rows.fetchmany(BATCH):
            cur.executemany(f"UPDATE governance_conversationitem SET content_new = "
                            f"%s::{column_type} WHERE id = %s",
                            [(encode(value), pk) for pk, value in chunk])
    with conn.cursor() as cur:
        # The updates queued deferred foreign-key checks; ALTER TABLE refuses to run with
        # trigger events pending.
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cur.execute("ALTER TABLE governance_conversationitem DROP COLUMN content")
        cur.execute("ALTER TABLE governance_conversationitem "
                    "RENAME COLUMN content_new TO content")
        cur.execute("ALTER TABLE governance_conversationitem ALTER COLUMN content SET NOT NULL")


def to_packed(apps, schema_editor) -> None:
    # JSONB read as its text, so the values are the stored ones, whatever psycopg would load.
    _convert(schema_editor, "bytea", "content::text",
             lambda text: zlib.compress(orjson.dumps(orjson.loads(text)), 6))


def to_jsonb(apps, schema_editor) -> None:
    _convert(schema_editor, "jsonb", "content",
             lambda blob: zlib.decompress(bytes(blob)).decode())


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0032_short_digests"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(to_packed, to_jsonb)],
            state_operations=[
                migrations.AlterField(model_name="conversationitem", name="content",
                                      field=governance.models.PackedJSONField()),
            ],
        ),
    ]
