"""Step.action, usage, timings and versions as a bytea each (governance.models.StepJSONField,
decision 60): new rows are compressed against a preset dictionary; the rows already there become
their JSON text, which the field reads as it is (format "JSON text"), so the forward step is one
ALTER TABLE and converts nothing in Python. The reverse first rewrites each packed value as its
JSON text, BATCH rows at a time under the system scope (row-level security), then casts the
columns back to JSONB. Exact both ways: the same JSON values."""

import orjson
from django.db import migrations

import governance.models

COLUMNS = ("action", "usage", "timings", "versions")
BATCH = 500


def to_bytea(apps, schema_editor) -> None:
    with schema_editor.connection.cursor() as cur:
        # One rewrite of the (partitioned) table for the four columns.
        cur.execute("ALTER TABLE governance_step " + ", ".join(
            f"ALTER COLUMN {c} TYPE bytea USING convert_to({c}::text, 'UTF8')"
            for c in COLUMNS))


def to_jsonb(apps, schema_editor) -> None:
    conn = schema_editor.connection
    unpack = governance.models.StepJSONField.unpack
    packed = " OR ".join(f"get_byte({c}, 0) IN (1, 120)" for c in COLUMNS)
    with conn.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
    with conn.connection.cursor(name="steward_0036_steps") as rows, conn.cursor() as cur:
        rows.itersize = BATCH
        rows.execute(f"SELECT id, started_at, {', '.join(COLUMNS)} FROM governance_step "
                     f"WHERE {packed} ORDER BY id")
        while chunk := rows.fetchmany(BATCH):
            # Each value as its JSON text; ActionField's reading is not applied, so a
            # Responses action stays without the `messages` 0035's field reads back itself.
            cur.executemany(
                "UPDATE governance_step SET " + ", ".join(f"{c} = %s" for c in COLUMNS)
                + " WHERE id = %s AND started_at = %s",
                [(*(orjson.dumps(unpack(v)) for v in values), pk, started)
                 for pk, started, *values in chunk])
    with conn.cursor() as cur:
        # The updates queued deferred constraint checks; ALTER TABLE refuses to run with
        # trigger events pending.
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cur.execute("ALTER TABLE governance_step " + ", ".join(
            f"ALTER COLUMN {c} TYPE jsonb USING convert_from({c}, 'UTF8')::jsonb"
            for c in COLUMNS))


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0035_step_action_field"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(to_bytea, to_jsonb)],
            state_operations=[
                migrations.AlterField(model_name="step", name="action",
                                      field=governance.models.ActionField(default=dict)),
                migrations.AlterField(model_name="step", name="usage",
                                      field=governance.models.StepJSONField(default=dict)),
                migrations.AlterField(model_name="step", name="timings",
                                      field=governance.models.StepJSONField(default=dict)),
                migrations.AlterField(model_name="step", name="versions",
                                      field=governance.models.StepJSONField(default=dict)),
            ],
        ),
    ]
