"""Placeholder state as a base plus append-only deltas (decision 34,
governance/capture/placeholders.py): Trajectory.sanitizer_state_seq and PlaceholderDelta, behind
the tenant row-level security policy.

Forward needs no data step: a trajectory's existing state is its base (seq 0); the new table gets
the trajectory table's grants (the app role's). Backward folds
each trajectory's deltas into its base column before the table goes, so the numbering survives
the round trip.
"""

import django.db.models.deletion
from django.db import migrations, models

from governance.tenancy import tenant_rls_sql


def copy_grants(apps, schema_editor) -> None:
    """The new table gets the grants its trajectory table has (the app role's, as
    `grant_app_privileges` gave them after the last migrate), so that the app keeps working
    right after this migration — also when it runs again after going back past it."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END, "
            "a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
            "LEFT JOIN pg_roles r ON r.oid = a.grantee "
            "WHERE c.oid = 'governance_trajectory'::regclass AND a.grantee <> c.relowner")
        grants = cursor.fetchall()
    for grantee, privilege in grants:
        if privilege in ("SELECT", "INSERT", "UPDATE", "DELETE"):
            schema_editor.execute(f"GRANT {privilege} ON governance_placeholderdelta "
                                  f"TO {grantee}")


def fold_deltas(apps, schema_editor) -> None:
    Trajectory = apps.get_model("governance", "Trajectory")
    PlaceholderDelta = apps.get_model("governance", "PlaceholderDelta")
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT set_config('steward.system', 'on', true)")
    for traj in Trajectory.objects.filter(sanitizer_state_seq__gt=0).iterator(chunk_size=500):
        state = dict(traj.sanitizer_state or {})
        labels, aliases = dict(state.get("labels") or {}), dict(state.get("aliases") or {})
        counters = dict(state.get("counters") or {})
        for delta in (PlaceholderDelta.objects.filter(trajectory_id=traj.pk)
                      .order_by("seq").values_list("state", flat=True)):
            labels.update(delta.get("labels") or {})
            aliases.update(delta.get("aliases") or {})
            counters.update(delta.get("counters") or {})
        traj.sanitizer_state = {"v": 1, "counters": counters, "labels": labels,
                                "aliases": aliases}
        traj.save(update_fields=["sanitizer_state"])


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0018_subject_index_packed"),
    ]

    operations = [
        migrations.AddField(
            model_name="trajectory",
            name="sanitizer_state_seq",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.CreateModel(
            name="PlaceholderDelta",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("seq", models.PositiveIntegerField()),
                ("state", models.JSONField()),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("tenant", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                             related_name="+", to="governance.tenant",
                                             db_index=False)),
                ("trajectory", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                                 related_name="placeholder_deltas",
                                                 to="governance.trajectory", db_index=False)),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("trajectory", "seq"),
                                                        name="phdelta_traj_seq")],
            },
        ),
        migrations.RunSQL(*tenant_rls_sql("governance_placeholderdelta")),
        migrations.RunPython(copy_grants, migrations.RunPython.noop),
        migrations.RunPython(migrations.RunPython.noop, fold_deltas),
    ]
