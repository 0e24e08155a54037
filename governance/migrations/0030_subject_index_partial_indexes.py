"""The subject index's step and interaction indexes only over rows that have one (decision 40):
item rows, about two in three, have neither, and every lookup by them is an equality or IN (which
implies IS NOT NULL). Plain schema operations, reversible as they are."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0029_findings_format2'),
    ]

    operations = [
        migrations.AlterField(
            model_name='subjectindex',
            name='interaction',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='subject_index', to='governance.interaction'),
        ),
        migrations.AlterField(
            model_name='subjectindex',
            name='step',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='subject_index', to='governance.step'),
        ),
        migrations.AddIndex(
            model_name='subjectindex',
            index=models.Index(condition=models.Q(('step__isnull', False)), fields=['step'], name='subjectindex_step'),
        ),
        migrations.AddIndex(
            model_name='subjectindex',
            index=models.Index(condition=models.Q(('interaction__isnull', False)), fields=['interaction'], name='subjectindex_interaction'),
        ),
    ]
