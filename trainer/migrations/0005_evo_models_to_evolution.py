"""The evolution control plane's models moved to the evolution app (evolution 0001): removed
from this app's state only. Their tables (trainer_candidate, trainer_gateresult, ...) stay as
they are, now owned by the evolution models through their `db_table`."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('trainer', '0004_evolution_push_states'),
        ('evolution', '0001_evo_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
            # Those that point at another first (Proposal -> Candidate, FailureCluster).
            migrations.DeleteModel(name='Proposal'),
            migrations.DeleteModel(name='GateResult'),
            migrations.DeleteModel(name='FailureCluster'),
            migrations.DeleteModel(name='Candidate'),
            migrations.DeleteModel(name='EvolutionPolicy'),
        ]),
    ]
