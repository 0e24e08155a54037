"""What is not built yet, or quarantined, moves from Interaction.state to PendingInteraction
(decision 39): building a step deletes a small row there instead of updating the interaction,
whose update wrote a new version of the whole row and of each of its index entries on every
captured call.

Forward copies every interaction that is not processed (its state and reason) into the new
table, behind the tenant policy with the interactions' grants, then drops the state columns and
their partial index. The reverse adds the columns back as `processed` (a constant default: no
table rewrite), sets the rows the table holds back to their state, and drops it."""

import django.db.models.deletion
from django.db import migrations, models

from governance.tenancy import tenant_rls_sql

SYSTEM = "SELECT set_config('steward.system', 'on', true)"


def copy_grants(apps, schema_editor) -> None:
    """The new table gets the grants the interactions table has (the app role's, as
    `grant_app_privileges` gave them after the last migrate)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END, "
            "a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
            "LEFT JOIN pg_roles r ON r.oid = a.grantee "
            "WHERE c.oid = 'governance_interaction'::regclass AND a.grantee <> c.relowner")
        grants = cursor.fetchall()
    for grantee, privilege in grants:
        if privilege in ("SELECT", "INSERT", "UPDATE", "DELETE"):
            schema_editor.execute(f"GRANT {privilege} ON governance_pendinginteraction "
                                  f"TO {grantee}")


FORWARD_DATA = [
    SYSTEM,
    "INSERT INTO governance_pendinginteraction (interaction_id, tenant_id, trajectory_id, "
    "started_at, state, reason) SELECT id, tenant_id, trajectory_id, started_at, state, "
    "state_reason FROM governance_interaction WHERE state <> 'processed'",
]
REVERSE_DATA = [
    SYSTEM,
    "UPDATE governance_interaction i SET state = p.state, state_reason = p.reason "
    "FROM governance_pendinginteraction p WHERE p.interaction_id = i.id",
]
DROP_COLUMNS = ["ALTER TABLE governance_interaction DROP COLUMN state, "
                "DROP COLUMN state_reason"]
ADD_COLUMNS = [
    "ALTER TABLE governance_interaction "
    "ADD COLUMN state varchar(16) NOT NULL DEFAULT 'processed', "
    "ADD COLUMN state_reason text NOT NULL DEFAULT ''",
    # As Django made them: no default in the database (rows keep the value they got).
    "ALTER TABLE governance_interaction ALTER COLUMN state DROP DEFAULT, "
    "ALTER COLUMN state_reason DROP DEFAULT",
]


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0026_placeholder_delta_binary"),
    ]

    operations = [
        migrations.CreateModel(
            name="PendingInteraction",
            fields=[
                ("interaction", models.OneToOneField(
                    db_constraint=False, on_delete=django.db.models.deletion.CASCADE,
                    primary_key=True, related_name="pending", serialize=False,
                    to="governance.interaction")),
                ("started_at", models.DateTimeField()),
                ("state", models.CharField(
                    choices=[("captured", "Captured, step not built yet"),
                             ("quarantined", "Quarantined (processing failed)")],
                    default="captured", max_length=16)),
                ("reason", models.TextField(blank=True, default="")),
                ("tenant", models.ForeignKey(
                    db_index=False, on_delete=django.db.models.deletion.CASCADE,
                    related_name="+", to="governance.tenant")),
                ("trajectory", models.ForeignKey(
                    db_index=False, on_delete=django.db.models.deletion.CASCADE,
                    related_name="+", to="governance.trajectory")),
            ],
            options={
                "indexes": [models.Index(fields=["tenant", "state", "interaction"],
                                         name="pending_tenant_state")],
            },
        ),
        migrations.RunSQL(*tenant_rls_sql("governance_pendinginteraction")),
        migrations.RunPython(copy_grants, migrations.RunPython.noop),
        migrations.RunSQL(FORWARD_DATA, REVERSE_DATA),
        migrations.RemoveIndex(model_name="interaction", name="interaction_unbuilt"),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(DROP_COLUMNS, ADD_COLUMNS)],
            state_operations=[
                migrations.RemoveField(model_name="interaction", name="state"),
                migrations.RemoveField(model_name="interaction", name="state_reason"),
            ],
        ),
    ]
