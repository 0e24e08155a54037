"""Findings packed one row per place (decision 37, governance/capture/findings.py): a row per
(step, item, side, sanitizer version) with `counts`, `total` and the detail in `spans`, instead
of a row per finding.

Forward groups the existing rows; each packed row keeps its group's lowest id and earliest
created_at (so it stays in its month's partition). Backward expands every packed row again,
the first finding keeping the row's id. Both directions run under the system scope (row-level
security) and repeat the codec of capture/findings.py on purpose: a migration must not depend
on app code that may change.
"""

import zlib

import orjson
from django.db import migrations, models

OLD_COLUMNS = (
    # name, SQL type, the default the backward step adds while it refills them
    ("entity_type", "varchar(32)", "''"),
    ("path", "varchar(512)", "''"),
    ("value_path", "varchar(512)", "''"),
    ("start", "integer", "0"),
    ("end", "integer", "0"),
    ("score", "double precision", "0"),
    ("recognizer", "varchar(64)", "''"),
    ("operator", "varchar(16)", "''"),
)
CHECKED = ("start", "end")  # PositiveIntegerField: CHECK (x >= 0), named as Django names it
BATCH = 2000


def _system(cursor) -> None:
    cursor.execute("SELECT set_config('steward.system', 'on', true)")


def _pack_group(found: list) -> tuple[str, int, bytes]:
    strings: dict[str, int] = {}
    rows, counts = [], {}
    for etype, path, vpath, rec, op, start, end, score in found:
        rows.append([strings.setdefault(x, len(strings))
                     for x in (etype, path or "$", vpath or "", rec or "", op or "")]
                    + [int(start), int(end), round(float(score) * 1000)])
        counts[etype] = counts.get(etype, 0) + 1
    spans = zlib.compress(orjson.dumps({"v": 1, "s": list(strings), "f": rows}), 6)
    return orjson.dumps(dict(sorted(counts.items()))).decode(), len(rows), spans


def pack_rows(apps, schema_editor) -> None:
    """Group the old rows into a temporary table, BATCH groups at a time through a
    server-side cursor (memory stays bounded on a large installation), then swap them in."""
    conn = schema_editor.connection
    with conn.cursor() as cur:
        _system(cur)
        cur.execute(
            "CREATE TEMP TABLE finding_packed (id bigint, tenant_id bigint, step_id uuid, "
            "item_id bigint, side varchar(8), sanitizer_version varchar(64), "
            "created_at timestamptz, counts jsonb, total integer, spans bytea) ON COMMIT DROP")
    with conn.connection.cursor(name="steward_0020_groups") as groups, \
            conn.cursor() as cur:
        groups.itersize = BATCH
        groups.execute(
            'SELECT min(id), tenant_id, step_id, item_id, side, sanitizer_version, '
            'min(created_at), json_agg(json_build_array(entity_type, path, value_path, '
            'recognizer, operator, start, "end", score) ORDER BY id)::text '
            'FROM governance_finding WHERE total = 0 '
            'GROUP BY tenant_id, step_id, item_id, side, sanitizer_version')
        while chunk := groups.fetchmany(BATCH):
            cur.executemany(
                "INSERT INTO finding_packed VALUES (%s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s, "
                "%s)", [(pk, tenant_id, step_id, item_id, side, version, created,
                         *_pack_group(orjson.loads(found)))
                        for pk, tenant_id, step_id, item_id, side, version, created, found
                        in chunk])
    with conn.cursor() as cur:
        cur.execute("DELETE FROM governance_finding WHERE total = 0")
        # The old columns are still there (dropped next) and NOT NULL: blanks for them.
        cur.execute(
            "INSERT INTO governance_finding (id, tenant_id, step_id, item_id, side, "
            "sanitizer_version, created_at, counts, total, spans, "
            + ", ".join(f'"{name}"' for name, _, _ in OLD_COLUMNS) + ") SELECT id, tenant_id, "
            "step_id, item_id, side, sanitizer_version, created_at, counts, total, spans, "
            + ", ".join(default for _, _, default in OLD_COLUMNS) + " FROM finding_packed")
        cur.execute("DROP TABLE finding_packed")
        # Check the deferred foreign keys now: ALTER TABLE (next) refuses pending trigger events.
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")


def expand_rows(apps, schema_editor) -> None:
    """Every packed row back as one row per finding (the first keeping the row's id), BATCH
    packed rows at a time through a server-side cursor."""
    conn = schema_editor.connection
    columns = ("tenant_id, step_id, item_id, side, sanitizer_version, created_at, entity_type, "
               'path, value_path, recognizer, operator, start, "end", score, counts, total, '
               "spans")
    with conn.cursor() as cur:
        _system(cur)
        cur.execute(
            "CREATE TEMP TABLE finding_expanded (id bigint, tenant_id bigint, step_id uuid, "
            "item_id bigint, side varchar(8), sanitizer_version varchar(64), "
            "created_at timestamptz, entity_type varchar(32), path varchar(512), "
            "value_path varchar(512), recognizer varchar(64), operator varchar(16), "
            'start integer, "end" integer, score double precision, counts jsonb, '
            "total integer, spans bytea) ON COMMIT DROP")
    with conn.connection.cursor(name="steward_0020_packed") as packed, conn.cursor() as cur:
        packed.itersize = BATCH
        packed.execute("SELECT id, tenant_id, step_id, item_id, side, sanitizer_version, "
                       "created_at, spans FROM governance_finding WHERE total > 0 ORDER BY id")
        while chunk := packed.fetchmany(BATCH):
            first, rest = [], []
            for pk, tenant_id, step_id, item_id, side, version, created, spans in chunk:
                doc = (orjson.loads(zlib.decompress(bytes(spans))) if spans
                       else {"s": [], "f": []})
                s = doc["s"]
                for n, (t, p, vp, r, o, start, end, score) in enumerate(doc["f"]):
                    values = (tenant_id, step_id, item_id, side, version, created, s[t], s[p],
                              s[vp], s[r], s[o], start, end, score / 1000)
                    if n == 0:
                        first.append((pk, *values))
                    else:
                        rest.append(values)
            placeholders = ", ".join(["%s"] * 14) + ", '{}'::jsonb, 0, ''::bytea"
            cur.executemany(f"INSERT INTO finding_expanded (id, {columns}) VALUES "
                            f"(%s, {placeholders})", first)
            # The rest take new ids from the table's identity when they are copied back.
            cur.executemany(f"INSERT INTO finding_expanded (id, {columns}) VALUES "
                            f"(NULL, {placeholders})", rest)
    with conn.cursor() as cur:
        cur.execute("DELETE FROM governance_finding WHERE total > 0")
        cur.execute(f"INSERT INTO governance_finding (id, {columns}) SELECT id, {columns} "
                    "FROM finding_expanded WHERE id IS NOT NULL")
        cur.execute(f"INSERT INTO governance_finding ({columns}) SELECT {columns} "
                    "FROM finding_expanded WHERE id IS NULL")
        cur.execute("DROP TABLE finding_expanded")
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")


DROP_OLD = "ALTER TABLE governance_finding " + ", ".join(
    f'DROP COLUMN "{name}"' for name, _, _ in OLD_COLUMNS)
ADD_OLD = "ALTER TABLE governance_finding " + ", ".join(
    f'ADD COLUMN "{name}" {sql} NOT NULL DEFAULT {default}'
    + (f' CONSTRAINT "governance_finding_{name}_check" CHECK ("{name}" >= 0)'
       if name in CHECKED else "")
    for name, sql, default in OLD_COLUMNS)
OLD_DEFAULTS_OFF = "ALTER TABLE governance_finding " + ", ".join(
    f'ALTER COLUMN "{name}" DROP DEFAULT' for name, _, _ in OLD_COLUMNS)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0019_placeholder_deltas"),
    ]

    operations = [
        migrations.AddField(model_name="finding", name="counts",
                            field=models.JSONField(default=dict)),
        migrations.AddField(model_name="finding", name="total",
                            field=models.PositiveIntegerField(default=0)),
        migrations.AddField(model_name="finding", name="spans",
                            field=models.BinaryField(default=b"")),
        # Backward, after the rows are expanded again: the old columns as they were.
        migrations.RunSQL(migrations.RunSQL.noop, OLD_DEFAULTS_OFF),
        migrations.RunPython(pack_rows, expand_rows),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(DROP_OLD, ADD_OLD)],
            state_operations=[migrations.RemoveField(model_name="finding", name=name)
                              for name, _, _ in OLD_COLUMNS],
        ),
    ]
