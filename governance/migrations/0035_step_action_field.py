"""Step.action becomes governance.models.ActionField (decision 55): a Responses API action is
stored without the chat-style `messages` that its `output` items determine, and reads them back.
No SQL: the column stays JSONB, and rows stored whole before are read as they are."""

import governance.models
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0034_trajectory_source_window'),
    ]

    operations = [
        migrations.AlterField(
            model_name='step',
            name='action',
            field=governance.models.ActionField(default=dict),
        ),
    ]
