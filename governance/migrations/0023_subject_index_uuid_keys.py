"""The subject index keys each identifier by the first 128 bits of its keyed hash, in a uuid[]
(16 bytes an element, no length word), and drops the parallel entity types nobody read
(decision 38): 58 % fewer heap bytes and 35 % less GIN index than the 32-byte bytea[] they
replace. One ALTER TABLE rewrites the table (under its exclusive lock, as any column type change
does); the GIN index is rebuilt with it, fastupdate off as before.

The reverse gives back bytea[] columns and entity types (`SUBJECT_HEADER` and `ERASURE_SCAN`
where the source says so, else `UNKNOWN`), but the keys stay 128 bits: the release before this
one looks subjects up by all 256 bits, so its erasures would miss every identifier indexed from
content until the next upgrade, which truncates both kinds of key alike again. The reverse
therefore refuses while the index holds rows, unless STEWARD_MIGRATION_ACCEPT_LOSS names
`subject-index-keys` (then re-file, after upgrading again, any erasure run meanwhile)."""

import os

import django.contrib.postgres.fields
from django.db import migrations, models

ACCEPT = "subject-index-keys"

FORWARD = [
    "CREATE FUNCTION pg_temp.steward_subject_keys(bytea[]) RETURNS uuid[] LANGUAGE sql "
    "IMMUTABLE AS $$ SELECT coalesce(array_agg(encode(substring(h FROM 1 FOR 16), 'hex')::uuid "
    "ORDER BY o), '{}') FROM unnest($1) WITH ORDINALITY AS u(h, o) "
    "WHERE octet_length(h) >= 16 $$",
    "ALTER TABLE governance_subjectindex DROP COLUMN entity_types, "
    "ALTER COLUMN hashes TYPE uuid[] USING pg_temp.steward_subject_keys(hashes)",
    "DROP FUNCTION pg_temp.steward_subject_keys(bytea[])",
]

REVERSE = [
    "CREATE FUNCTION pg_temp.steward_subject_bytes(uuid[]) RETURNS bytea[] LANGUAGE sql "
    "IMMUTABLE AS $$ SELECT coalesce(array_agg(decode(replace(k::text, '-', ''), 'hex') "
    "ORDER BY o), '{}') FROM unnest($1) WITH ORDINALITY AS u(k, o) $$",
    "ALTER TABLE governance_subjectindex "
    "ALTER COLUMN hashes TYPE bytea[] USING pg_temp.steward_subject_bytes(hashes), "
    "ADD COLUMN entity_types varchar(32)[] NOT NULL DEFAULT '{}'",
    "DROP FUNCTION pg_temp.steward_subject_bytes(uuid[])",
    # Parallel to `hashes`, as the packed layout (0018) had them; under the system scope
    # (row-level security is forced on the table, for its owner too).
    "SELECT set_config('steward.system', 'on', true)",
    "UPDATE governance_subjectindex SET entity_types = array_fill(CASE source "
    "WHEN 'header' THEN 'SUBJECT_HEADER' WHEN 'scan' THEN 'ERASURE_SCAN' ELSE 'UNKNOWN' END"
    "::varchar(32), ARRAY[cardinality(hashes)]) WHERE cardinality(hashes) > 0",
    # The update queued the deferred foreign-key checks; ALTER TABLE refuses to run with
    # trigger events pending.
    "SET CONSTRAINTS ALL IMMEDIATE",
    "ALTER TABLE governance_subjectindex ALTER COLUMN entity_types DROP DEFAULT",
]


def refuse_lossy_reverse(apps, schema_editor):
    accepted = ACCEPT in os.environ.get("STEWARD_MIGRATION_ACCEPT_LOSS", "").split(",")
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', true)")
        cur.execute("SELECT EXISTS (SELECT 1 FROM governance_subjectindex)")
        has_rows = cur.fetchone()[0]
    if has_rows and not accepted:
        raise RuntimeError(
            "governance 0023 cannot be reversed without loss: the subject index keeps 128-bit "
            "keys, which the previous release's erasure lookups (256-bit) do not match, so its "
            "erasures would miss identifiers found in content. To reverse anyway, set "
            f"STEWARD_MIGRATION_ACCEPT_LOSS={ACCEPT}; after upgrading again, re-file any "
            "erasure request run meanwhile.")


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0022_prune_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD, REVERSE)],
            state_operations=[
                migrations.RemoveField(model_name="subjectindex", name="entity_types"),
                migrations.AlterField(
                    model_name="subjectindex", name="hashes",
                    field=django.contrib.postgres.fields.ArrayField(
                        base_field=models.UUIDField(), default=list, size=None)),
            ],
        ),
        # Last, so that its reverse runs first: nothing is converted once it refuses.
        migrations.RunPython(migrations.RunPython.noop, refuse_lossy_reverse),
    ]
