"""Conversation items' content compressed against a preset dictionary (governance.models
.ItemJSONField, decision 61). Forward changes no row: the column stays a bytea, new items are
written in format 2 and the zlib'd items of migration 0033 are read as they are. The reverse
rewrites every item not in 0033's format (format 2, or JSON text) as zlib'd JSON (0033's
PackedJSONField), BATCH rows at a time under the system scope (row-level security), so 0033's
own reverse finds only what it reads. Exact both ways: the same JSON values."""

from django.db import migrations

import governance.models

BATCH = 500


def to_zlib(apps, schema_editor) -> None:
    conn = schema_editor.connection
    unpack = governance.models.ItemJSONField.unpack
    pack = governance.models.PackedJSONField.pack
    with conn.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
    with conn.connection.cursor(name="steward_0037_items") as rows, conn.cursor() as cur:
        rows.itersize = BATCH
        rows.execute("SELECT id, content FROM governance_conversationitem "
                     "WHERE get_byte(content, 0) <> 120 ORDER BY id")
        while chunk := rows.fetchmany(BATCH):
            cur.executemany("UPDATE governance_conversationitem SET content = %s WHERE id = %s",
                            [(pack(unpack(content)), pk) for pk, content in chunk])


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0036_step_json_packed"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(migrations.RunPython.noop, to_zlib)],
            state_operations=[
                migrations.AlterField(model_name="conversationitem", name="content",
                                      field=governance.models.ItemJSONField()),
            ],
        ),
    ]
