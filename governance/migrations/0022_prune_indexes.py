"""Indexes nothing needs, dropped (decision 37): each cost bytes and a write on every captured
call. Django's varchar_pattern_ops twins of indexed text columns (nothing runs LIKE on them),
tenant and trajectory indexes that a composite index already leads with, the interactions'
subject-hash index (erasure's lookup is per tenant: the partial interaction_subject_traj) and
the subject index's plain item index (the unique partial subjectindex_item serves the same
lookups). Explicit SQL, because steps and interactions are partitioned (migration 0017): a
partitioned index is dropped and created on the parent, its partitions follow. Reversible."""

import django.db.models.deletion
from django.db import migrations, models

# name, table, columns: what the reverse creates again, as Django had created it.
DROPPED = (
    ("governance_interaction_flow_id_147ebb46_like", "governance_interaction",
     "(flow_id varchar_pattern_ops)"),
    ("governance_interaction_raw_base_flow_5971ef1c_like", "governance_interaction",
     "(raw_base_flow varchar_pattern_ops)"),
    ("governance_interaction_state_8f7893d0_like", "governance_interaction",
     "(state varchar_pattern_ops)"),
    ("governance_interaction_subject_hash_d80cad92", "governance_interaction",
     "(subject_hash)"),
    ("governance_interaction_subject_hash_d80cad92_like", "governance_interaction",
     "(subject_hash varchar_pattern_ops)"),
    ("governance_interaction_tenant_id_1ad6bdd2", "governance_interaction", "(tenant_id)"),
    ("governance_step_response_id_59861a79_like", "governance_step",
     "(response_id varchar_pattern_ops)"),
    ("governance_step_tenant_id_786bf2b7", "governance_step", "(tenant_id)"),
    ("governance_step_trajectory_id_7af4f29d", "governance_step", "(trajectory_id)"),
    ("governance_subjectindex_item_id_33daa0d6", "governance_subjectindex", "(item_id)"),
    ("governance_subjectindex_tenant_id_e1b6d59f", "governance_subjectindex", "(tenant_id)"),
)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0021_placeholder_delta_packed"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(f"DROP INDEX IF EXISTS {name}",
                                  f"CREATE INDEX IF NOT EXISTS {name} ON {table} {columns}")
                for name, table, columns in DROPPED
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="interaction", name="subject_hash",
                    field=models.CharField(blank=True, default="", max_length=64)),
                migrations.AlterField(
                    model_name="interaction", name="tenant",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="interactions",
                                            to="governance.tenant")),
                migrations.AlterField(
                    model_name="step", name="tenant",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="steps", to="governance.tenant")),
                migrations.AlterField(
                    model_name="step", name="trajectory",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="steps", to="governance.trajectory")),
                migrations.AlterField(
                    model_name="subjectindex", name="item",
                    field=models.ForeignKey(blank=True, db_index=False, null=True,
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="subject_index",
                                            to="governance.conversationitem")),
                migrations.AlterField(
                    model_name="subjectindex", name="tenant",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="subject_index",
                                            to="governance.tenant")),
            ],
        ),
    ]
