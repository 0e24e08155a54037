import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from governance.tenancy import tenant_rls_sql


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0011_webhard_audit_checkpoint'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='SanitizerPolicyChange',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name='ID')),
                ('policy', models.JSONField()),
                ('base', models.JSONField(default=dict)),
                ('weakenings', models.JSONField(default=list)),
                ('status', models.CharField(choices=[('pending', 'Pending approval'),
                                                     ('approved', 'Approved'),
                                                     ('rejected', 'Rejected')],
                                            db_index=True, default='pending', max_length=16)),
                ('requested_at', models.DateTimeField(auto_now_add=True)),
                ('decided_at', models.DateTimeField(blank=True, null=True)),
                ('decided_by', models.ForeignKey(blank=True, null=True,
                                                 on_delete=django.db.models.deletion.SET_NULL,
                                                 related_name='+',
                                                 to=settings.AUTH_USER_MODEL)),
                ('requested_by', models.ForeignKey(null=True,
                                                   on_delete=django.db.models.deletion.SET_NULL,
                                                   related_name='+',
                                                   to=settings.AUTH_USER_MODEL)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                             related_name='sanitizer_policy_changes',
                                             to='governance.tenant')),
            ],
        ),
        migrations.RunSQL(*tenant_rls_sql("governance_sanitizerpolicychange")),
    ]
