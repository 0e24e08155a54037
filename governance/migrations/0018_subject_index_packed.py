"""The subject index packed (issue 16, decision 34): one row per place identifiers were found
(a conversation item, a step's exchange, an interaction's X-Steward-Subject header, an erasure
scan hit) holding their keyed hashes as a bytea[] under a GIN index, instead of one row per
identifier holding its hash as 64 hex digits under three B-tree indexes.

The deferred foreign-key checks of the moved rows run at the end of each RunSQL (SET
CONSTRAINTS ALL IMMEDIATE): PostgreSQL refuses the ALTER TABLE that follows while they pend.
Reversible: the hashes are the whole 32-byte HMACs, so going back restores the rows exactly (one
per identifier, the hash as hex). A stored hash that is not 64 hex digits (none is written by the
product; tests and hand-made rows) is kept as its UTF-8 bytes and comes back as it was. Both directions run under the system scope (row-level
security is forced on the table, for its owner too).
"""

import django.contrib.postgres.fields
import django.contrib.postgres.indexes
from django.db import migrations, models

SYSTEM = "SELECT set_config('steward.system', 'on', true);\n"

PACK = SYSTEM + """
INSERT INTO governance_subjectindex
    (tenant_id, trajectory_id, step_id, interaction_id, item_id, source, entity_types, hashes,
     created_at, hash, entity_type)
SELECT tenant_id, trajectory_id, step_id, interaction_id, item_id, src,
       array_agg(entity_type ORDER BY entity_type, hash),
       array_agg(CASE WHEN hash ~ '^[0-9a-f]{64}$' THEN decode(hash, 'hex')
                      ELSE convert_to(hash, 'UTF8') END ORDER BY entity_type, hash),
       min(created_at), '', ''
FROM (
    SELECT id, tenant_id, trajectory_id, step_id, interaction_id, item_id, entity_type, hash,
           created_at, CASE
        WHEN entity_type = 'SUBJECT_HEADER' THEN 'header'
        WHEN entity_type = 'ERASURE_SCAN' THEN 'scan'
        WHEN item_id IS NOT NULL THEN 'item'
        ELSE 'step' END AS src
    FROM governance_subjectindex
    WHERE cardinality(hashes) = 0
) AS one
GROUP BY tenant_id, trajectory_id, step_id, interaction_id, item_id, src,
         CASE WHEN src = 'scan' THEN id END;
DELETE FROM governance_subjectindex WHERE cardinality(hashes) = 0;
SET CONSTRAINTS ALL IMMEDIATE;
"""

UNPACK = SYSTEM + """
INSERT INTO governance_subjectindex
    (tenant_id, trajectory_id, step_id, interaction_id, item_id, source, entity_types, hashes,
     created_at, hash, entity_type)
SELECT s.tenant_id, s.trajectory_id, s.step_id, s.interaction_id, s.item_id, '', '{}', '{}',
       s.created_at,
       CASE WHEN length(u.h) = 32 THEN encode(u.h, 'hex') ELSE convert_from(u.h, 'UTF8') END,
       u.t
FROM governance_subjectindex s, unnest(s.hashes, s.entity_types) AS u(h, t)
WHERE cardinality(s.hashes) > 0;
DELETE FROM governance_subjectindex WHERE cardinality(hashes) > 0;
SET CONSTRAINTS ALL IMMEDIATE;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0017_time_partitions"),
    ]

    operations = [
        migrations.AddField(
            model_name="subjectindex",
            name="source",
            field=models.CharField(choices=[("header", "X-Steward-Subject header"),
                                            ("step", "Found in the step's exchange"),
                                            ("item", "Found in a conversation item"),
                                            ("scan", "Found by an erasure scan")],
                                   default="", max_length=8),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="subjectindex",
            name="entity_types",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.CharField(max_length=32), default=list, size=None),
        ),
        migrations.AddField(
            model_name="subjectindex",
            name="hashes",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.BinaryField(), default=list, size=None),
        ),
        migrations.RemoveConstraint(
            model_name="subjectindex",
            name="subjectindex_interaction_type_hash",
        ),
        migrations.RemoveIndex(
            model_name="subjectindex",
            name="subjectindex_tenant_hash",
        ),
        migrations.RunSQL(
            "DROP INDEX IF EXISTS subjectindex_hash_traj;",
            "CREATE INDEX IF NOT EXISTS subjectindex_hash_traj ON governance_subjectindex "
            "(tenant_id, hash) INCLUDE (trajectory_id);"),
        # Defaults for the columns about to go, so that going back re-adds them to a table
        # that has rows (the reverse of RemoveField adds the field as it was here).
        migrations.AlterField(model_name="subjectindex", name="entity_type",
                              field=models.CharField(default="", max_length=32)),
        migrations.AlterField(model_name="subjectindex", name="hash",
                              field=models.CharField(default="", max_length=64)),
        migrations.RunSQL(PACK, UNPACK),
        migrations.RemoveField(model_name="subjectindex", name="entity_type"),
        migrations.RemoveField(model_name="subjectindex", name="hash"),
        migrations.AddIndex(
            model_name="subjectindex",
            index=django.contrib.postgres.indexes.GinIndex(fields=["hashes"], fastupdate=False,
                                                           name="subjectindex_hashes"),
        ),
        migrations.AddConstraint(
            model_name="subjectindex",
            constraint=models.UniqueConstraint(
                condition=models.Q(("interaction__isnull", False),
                                   ("source__in", ["header", "step"])),
                fields=("interaction", "source"), name="subjectindex_interaction_source"),
        ),
        migrations.AddConstraint(
            model_name="subjectindex",
            constraint=models.UniqueConstraint(
                condition=models.Q(("item__isnull", False)), fields=("item",),
                name="subjectindex_item"),
        ),
    ]
