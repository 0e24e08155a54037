"""Conversation items that point at the answer they repeat (governance.models.AnswerRef,
decision 62). Forward changes no row: the column stays a bytea, and new items that are an
answer sent back are written in format 3. The reverse gives every such item the message it
points at, packed as 0037 packs items (format 2), BATCH rows at a time under the system
scope (row-level security), so 0037's reverse and the code before it read only what they
know. Exact both ways: the same JSON values on every read."""

from django.db import migrations

import governance.models

BATCH = 500


def give_answers_back(apps, schema_editor) -> None:
    conn = schema_editor.connection
    unpack_ref = governance.models.ItemJSONField.unpack
    unpack_action = governance.models.ActionField.unpack
    pack = governance.models.ItemJSONField.pack
    with conn.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
    with conn.connection.cursor(name="steward_0038_items") as rows, conn.cursor() as cur:
        rows.itersize = BATCH
        rows.execute("SELECT id, content FROM governance_conversationitem "
                     "WHERE get_byte(content, 0) = 3 ORDER BY id")
        while chunk := rows.fetchmany(BATCH):
            refs = {pk: unpack_ref(content) for pk, content in chunk}
            cur.execute("SELECT id, action FROM governance_step WHERE id = ANY(%s::uuid[])",
                        [sorted({str(r.step_id) for r in refs.values()})])
            actions = {step: unpack_action(action) for step, action in cur.fetchall()}
            cur.executemany(
                "UPDATE governance_conversationitem SET content = %s WHERE id = %s",
                [(pack(actions[r.step_id]["messages"][r.index]), pk) for pk, r in refs.items()])


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0037_conversation_item_dictionary"),
    ]

    operations = [
        migrations.RunPython(migrations.RunPython.noop, give_answers_back),
    ]
