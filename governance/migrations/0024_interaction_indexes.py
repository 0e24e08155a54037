"""Three more interaction indexes dropped and the state index made partial (decision 38). Every
index on the interactions costs an entry per captured call and another when the step builder
marks the call processed (that update changes `state`, so it is never a HOT update):
- agent and data key: nothing looks interactions up by either; their foreign keys' checks
  need them only when an agent or a data-key row is deleted, which Steward never does;
- raw_base_flow: rawstore.rebase_dependents looks dependents up within the doomed flows'
  trajectories (a delta's base is always an earlier call of its own trajectory);
- state: only unprocessed calls are ever looked for (the sweeper, the console's backlog,
  erasure's scan), so the index holds only those: a processed call leaves it.
Explicit SQL on the partitioned parent (its partitions follow), as in 0022. Reversible."""

import django.db.models.deletion
from django.db import migrations, models

TABLE = "governance_interaction"
# name, columns: what the reverse creates again, as Django had created it.
DROPPED = (
    ("governance_interaction_agent_id_7de965db", "(agent_id)"),
    ("governance_interaction_data_key_id_0b9474bf", "(data_key_id)"),
    ("governance_interaction_raw_base_flow_5971ef1c", "(raw_base_flow)"),
    ("governance_interaction_state_8f7893d0", "(state)"),
)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0023_subject_index_uuid_keys"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                *(migrations.RunSQL(f"DROP INDEX IF EXISTS {name}",
                                    f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} {columns}")
                  for name, columns in DROPPED),
                migrations.RunSQL(
                    f"CREATE INDEX IF NOT EXISTS interaction_unbuilt ON {TABLE} (state) "
                    "WHERE NOT (state = 'processed')",
                    "DROP INDEX IF EXISTS interaction_unbuilt"),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="interaction", name="agent",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=django.db.models.deletion.PROTECT,
                                            related_name="interactions", to="governance.agent")),
                migrations.AlterField(
                    model_name="interaction", name="data_key",
                    field=models.ForeignKey(db_index=False, null=True,
                                            on_delete=django.db.models.deletion.SET_NULL,
                                            related_name="interactions",
                                            to="governance.datakey")),
                migrations.AlterField(
                    model_name="interaction", name="raw_base_flow",
                    field=models.CharField(blank=True, default="", max_length=64)),
                migrations.AlterField(
                    model_name="interaction", name="state",
                    field=models.CharField(
                        choices=[("captured", "Captured, step not built yet"),
                                 ("processed", "Step built"),
                                 ("quarantined", "Quarantined (processing failed)")],
                        default="captured", max_length=16)),
                migrations.AddIndex(
                    model_name="interaction",
                    index=models.Index(condition=~models.Q(state="processed"), fields=["state"],
                                       name="interaction_unbuilt")),
            ],
        ),
    ]
