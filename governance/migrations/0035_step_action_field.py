"""Step.action becomes governance.models.ActionField (decision 55): a Responses API action is
stored without the chat-style `messages` that its `output` items determine, and reads them back.
No SQL: the column stays JSONB, and rows stored whole before are read as they are.

The state names a plain JSONField: ActionField is a bytea field since 0036 (decision 60), and a
migration that named the live class would turn the column into one here."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0034_trajectory_source_window'),
    ]

    operations = [
        migrations.AlterField(
            model_name='step',
            name='action',
            field=models.JSONField(default=dict),
        ),
    ]
