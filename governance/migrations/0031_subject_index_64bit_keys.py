"""The subject index keys each identifier by the first 64 bits of its keyed hash, in a bigint[]
(decision 40): 8 bytes less an identifier in the row and in its GIN entry. One ALTER TABLE
rewrites the table (under its exclusive lock, as any column type change does); the GIN index is
rebuilt after it, with the leakproof bigint[] operator class of governance/subject_keys.py when
it exists (this migration creates it when it runs as a superuser, as 0025 does for uuid[]),
fastupdate off as before. A key is the first 64 bits of the 128 the uuid held: the same hash,
so every identifier indexed before is found after.

The reverse gives back uuid[] keys, the 64 bits followed by zeros: the release before this one
looks subjects up by 128 bits, so its erasures would miss every identifier indexed before the
reverse. It therefore refuses while the index holds rows, unless STEWARD_MIGRATION_ACCEPT_LOSS
names `subject-index-keys64` (then re-file, after upgrading again, any erasure run meanwhile)."""

import os

import django.contrib.postgres.fields
from django.db import migrations, models

from governance.subject_keys import INT8_CREATE_SQL, INT8_DROP_SQL, OPCLASS, UUID_OPCLASS

ACCEPT = "subject-index-keys64"
INDEX = ("CREATE INDEX subjectindex_hashes ON governance_subjectindex USING gin (hashes{}) "
         "WITH (fastupdate = off)")

TO_BIGINT = [
    "DROP INDEX IF EXISTS subjectindex_hashes",
    "CREATE FUNCTION pg_temp.steward_keys64(uuid[]) RETURNS bigint[] LANGUAGE sql IMMUTABLE "
    "AS $$ SELECT coalesce(array_agg(('x' || left(replace(k::text, '-', ''), 16))::bit(64)"
    "::bigint ORDER BY o), '{}') FROM unnest($1) WITH ORDINALITY AS u(k, o) $$",
    "ALTER TABLE governance_subjectindex "
    "ALTER COLUMN hashes TYPE bigint[] USING pg_temp.steward_keys64(hashes)",
    "DROP FUNCTION pg_temp.steward_keys64(uuid[])",
]
TO_UUID = [
    "DROP INDEX IF EXISTS subjectindex_hashes",
    "CREATE FUNCTION pg_temp.steward_keys128(bigint[]) RETURNS uuid[] LANGUAGE sql IMMUTABLE "
    "AS $$ SELECT coalesce(array_agg((lpad(to_hex(k), 16, '0') || repeat('0', 16))::uuid "
    "ORDER BY o), '{}') FROM unnest($1) WITH ORDINALITY AS u(k, o) $$",
    "ALTER TABLE governance_subjectindex "
    "ALTER COLUMN hashes TYPE uuid[] USING pg_temp.steward_keys128(hashes)",
    "DROP FUNCTION pg_temp.steward_keys128(bigint[])",
]


def _superuser(cur) -> bool:
    cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    row = cur.fetchone()
    return bool(row and row[0])


def _index(cur, opclass: str) -> None:
    cur.execute("SELECT 1 FROM pg_opclass WHERE opcname = %s", [opclass])
    cur.execute(INDEX.format(f" {opclass}" if cur.fetchone() is not None else ""))


def forward(apps, schema_editor) -> None:
    with schema_editor.connection.cursor() as cur:
        for statement in TO_BIGINT:
            cur.execute(statement)
        if _superuser(cur):
            cur.execute(INT8_CREATE_SQL)
        _index(cur, OPCLASS)


def backward(apps, schema_editor) -> None:
    with schema_editor.connection.cursor() as cur:
        for statement in TO_UUID:
            cur.execute(statement)
        _index(cur, UUID_OPCLASS)
        if _superuser(cur):
            for statement in INT8_DROP_SQL:
                cur.execute(statement)


def refuse_lossy_reverse(apps, schema_editor) -> None:
    accepted = ACCEPT in os.environ.get("STEWARD_MIGRATION_ACCEPT_LOSS", "").split(",")
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
        cur.execute("SELECT EXISTS (SELECT 1 FROM governance_subjectindex)")
        has_rows = cur.fetchone()[0]
    if has_rows and not accepted:
        raise RuntimeError(
            "governance 0031 cannot be reversed without loss: the subject index keeps 64-bit "
            "keys, which the previous release's erasure lookups (128-bit) do not match, so its "
            "erasures would miss every identifier indexed so far. To reverse anyway, set "
            f"STEWARD_MIGRATION_ACCEPT_LOSS={ACCEPT}; after upgrading again, re-file any "
            "erasure request run meanwhile.")


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0030_subject_index_partial_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forward, backward)],
            state_operations=[
                migrations.AlterField(
                    model_name="subjectindex", name="hashes",
                    field=django.contrib.postgres.fields.ArrayField(
                        base_field=models.BigIntegerField(), default=list, size=None)),
            ],
        ),
        # Last, so that its reverse runs first: nothing is converted once it refuses.
        migrations.RunPython(migrations.RunPython.noop, refuse_lossy_reverse),
    ]
