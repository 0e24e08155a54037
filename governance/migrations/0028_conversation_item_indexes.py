"""Conversation items lose their own tenant and trajectory indexes (decision 39): every lookup
by trajectory (the step builder's, erasure's and retention's deletes) uses the unique
(trajectory, digest, sanitizer_version) index, which leads with it, and nothing looks items up
by tenant. Each was a B-tree entry written for every distinct message. Reversible."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0027_pending_interactions"),
    ]

    operations = [
        migrations.AlterField(
            model_name="conversationitem",
            name="tenant",
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE,
                                    related_name="conversation_items", to="governance.tenant"),
        ),
        migrations.AlterField(
            model_name="conversationitem",
            name="trajectory",
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE,
                                    related_name="conversation_items",
                                    to="governance.trajectory"),
        ),
    ]
