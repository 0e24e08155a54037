"""ContextUpdate and PolicyRoute moved to the evolution app (evolution 0001): removed from this
app's state only, and Trajectory.route now names evolution.PolicyRoute. The database does not
change: the tables keep their names (the NOTIFY triggers and the SECURITY DEFINER functions of
0007 name them) and the foreign key from governance_trajectory.route_id stays as it is."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0012_webhard_sanitizer_policy_change'),
        ('evolution', '0001_evo_initial'),
        # trainer's Candidate pointed at PolicyRoute and ContextUpdate: gone from state first.
        ('trainer', '0005_evo_models_to_evolution'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
            migrations.AlterField(
                model_name='trajectory',
                name='route',
                field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='trajectories', to='evolution.policyroute'),
            ),
            migrations.DeleteModel(name='PolicyRoute'),
            migrations.DeleteModel(name='ContextUpdate'),
        ]),
    ]
