"""The evolution app's models, moved from governance (ContextUpdate, PolicyRoute) and trainer
(EvolutionPolicy, Candidate, GateResult, FailureCluster, Proposal) in Django's state only: every
model keeps its table, so the database does not change at all (the RLS policies, the NOTIFY
triggers of governance 0007 and the SECURITY DEFINER functions of trainer 0003 name those
tables). governance 0013 and trainer 0005 drop the models from their apps' state after this."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


# The tables exist already (created by governance 0007 and trainer 0003/0004).
STATE_OPERATIONS = [
    migrations.CreateModel(
        name='ContextUpdate',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('kind', models.CharField(choices=[('system_prompt', 'System prompt snippet'), ('tool_schema', 'Tool schema rewrite')], max_length=16)),
            ('content', models.JSONField(default=dict)),
            ('version', models.PositiveIntegerField()),
            ('status', models.CharField(choices=[('draft', 'Draft'), ('canary', 'Canary'), ('active', 'Active'), ('rolled_back', 'Rolled back'), ('rejected', 'Rejected')], db_index=True, default='draft', max_length=16)),
            ('content_hash', models.CharField(max_length=64)),
            ('reason', models.TextField(blank=True, default='')),
            ('created_at', models.DateTimeField(auto_now_add=True)),
            ('activated_at', models.DateTimeField(blank=True, null=True)),
            ('rolled_back_at', models.DateTimeField(blank=True, null=True)),
            ('updated_at', models.DateTimeField(auto_now=True)),
            ('agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='context_updates', to='governance.agent')),
            ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='context_updates', to='governance.tenant')),
        ],
        options={
            'db_table': 'governance_contextupdate',
        },
    ),
    migrations.CreateModel(
        name='Candidate',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('kind', models.CharField(choices=[('weights', 'Weight update'), ('memory', 'Memory insertion'), ('skill', 'Skill patch'), ('harness', 'Harness edit'), ('tool_schema', 'Tool-schema change')], max_length=16)),
            ('upstream_url', models.CharField(blank=True, default='', max_length=500)),
            ('model', models.CharField(blank=True, default='', max_length=256)),
            ('stage', models.CharField(choices=[('shadow_eval', 'Shadow eval'), ('replay', 'Replay check'), ('safety', 'Regression & safety'), ('canary', 'Canary'), ('promote', 'Promote')], default='shadow_eval', max_length=16)),
            ('status', models.CharField(choices=[('pending', 'Pending'), ('running', 'Running'), ('passed', 'Passed'), ('failed', 'Failed'), ('promoted', 'Promoted'), ('rolled_back', 'Rolled back'), ('promoting', 'Promoting (pushing weights)'), ('rolling_back', 'Rolling back (pushing weights)'), ('push_failed', 'Promote failed (weights not pushed)')], db_index=True, default='pending', max_length=16)),
            ('reason', models.TextField(blank=True, default='')),
            ('thresholds', models.JSONField(blank=True, default=dict)),
            ('baseline', models.JSONField(blank=True, default=dict)),
            ('serving', models.JSONField(blank=True, default=dict)),
            ('attempts', models.PositiveIntegerField(default=0)),
            ('task_id', models.CharField(blank=True, default='', max_length=64)),
            ('heartbeat_at', models.DateTimeField(blank=True, null=True)),
            ('created_at', models.DateTimeField(auto_now_add=True)),
            ('updated_at', models.DateTimeField(auto_now=True)),
            ('finished_at', models.DateTimeField(blank=True, null=True)),
            ('agent', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='candidates', to='governance.agent')),
            ('checkpoint', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='candidates', to='trainer.checkpoint')),
            ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ('eval_version', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='governance.datasetversion')),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='candidates', to='governance.tenant')),
            ('context_update', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='candidates', to='evolution.contextupdate')),
        ],
        options={
            'db_table': 'trainer_candidate',
        },
    ),
    migrations.CreateModel(
        name='EvolutionPolicy',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('shadow_margin', models.FloatField(blank=True, null=True)),
            ('replay_tolerance', models.FloatField(blank=True, null=True)),
            ('refusal_max_drop', models.FloatField(blank=True, null=True)),
            ('over_refusal_max_increase', models.FloatField(blank=True, null=True)),
            ('degenerate_max_increase', models.FloatField(blank=True, null=True)),
            ('canary_share', models.FloatField(blank=True, null=True)),
            ('min_sessions_per_arm', models.PositiveIntegerField(blank=True, null=True)),
            ('max_error_rate_increase', models.FloatField(blank=True, null=True)),
            ('low_reward_threshold', models.FloatField(blank=True, null=True)),
            ('min_cluster_size', models.PositiveIntegerField(blank=True, null=True)),
            ('reward_name', models.CharField(blank=True, default='', max_length=64)),
            ('baseline_upstream_url', models.CharField(blank=True, default='', max_length=500)),
            ('baseline_model', models.CharField(blank=True, default='', max_length=256)),
            ('updated_at', models.DateTimeField(auto_now=True)),
            ('eval_version', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='governance.datasetversion')),
            ('tenant', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='evolution_policy', to='governance.tenant')),
            ('updated_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
        ],
        options={
            'db_table': 'trainer_evolutionpolicy',
        },
    ),
    migrations.CreateModel(
        name='FailureCluster',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('key', models.CharField(max_length=64)),
            ('agents', models.JSONField(blank=True, default=list)),
            ('tool', models.CharField(blank=True, default='', max_length=200)),
            ('signature', models.CharField(max_length=32)),
            ('size', models.PositiveIntegerField(default=0)),
            ('mean_reward', models.FloatField(default=0.0)),
            ('sample', models.JSONField(blank=True, default=list)),
            ('first_seen', models.DateTimeField(auto_now_add=True)),
            ('last_seen', models.DateTimeField(auto_now=True)),
            ('agent', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='governance.agent')),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='governance.tenant')),
        ],
        options={
            'db_table': 'trainer_failurecluster',
        },
    ),
    migrations.CreateModel(
        name='GateResult',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('gate', models.CharField(choices=[('shadow_eval', 'Shadow eval'), ('replay', 'Replay check'), ('safety', 'Regression & safety'), ('canary', 'Canary'), ('promote', 'Promote')], max_length=16)),
            ('passed', models.BooleanField()),
            ('metrics', models.JSONField(blank=True, default=dict)),
            ('thresholds', models.JSONField(blank=True, default=dict)),
            ('reason', models.TextField(blank=True, default='')),
            ('created_at', models.DateTimeField(auto_now_add=True)),
            ('candidate', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='gate_results', to='evolution.candidate')),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='governance.tenant')),
        ],
        options={
            'db_table': 'trainer_gateresult',
        },
    ),
    migrations.CreateModel(
        name='PolicyRoute',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('candidate_ref', models.CharField(blank=True, default='', max_length=200)),
            ('candidate_upstream_url', models.CharField(blank=True, default='', max_length=500)),
            ('candidate_model', models.CharField(blank=True, default='', max_length=256)),
            ('share', models.FloatField()),
            ('status', models.CharField(choices=[('canary', 'Canary'), ('promoted', 'Promoted'), ('rolled_back', 'Rolled back'), ('stopped', 'Stopped')], db_index=True, default='canary', max_length=16)),
            ('min_sessions_per_arm', models.PositiveIntegerField(default=30)),
            ('max_error_rate_increase', models.FloatField(default=0.05)),
            ('decision_reason', models.TextField(blank=True, default='')),
            ('decided_at', models.DateTimeField(blank=True, null=True)),
            ('created_at', models.DateTimeField(auto_now_add=True)),
            ('updated_at', models.DateTimeField(auto_now=True)),
            ('agent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='policy_routes', to='governance.agent')),
            ('context_update', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='routes', to='evolution.contextupdate')),
            ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='policy_routes', to='governance.tenant')),
        ],
        options={
            'db_table': 'governance_policyroute',
        },
    ),
    migrations.AddField(
        model_name='candidate',
        name='route',
        field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='candidates', to='evolution.policyroute'),
    ),
    migrations.CreateModel(
        name='Proposal',
        fields=[
            ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
            ('kind', models.CharField(choices=[('memory', 'Memory insertion'), ('skill', 'Skill patch'), ('harness', 'Harness edit'), ('tool_schema', 'Tool-schema change'), ('weights', 'Weight update'), ('no_op', 'No-op')], max_length=16)),
            ('rationale', models.TextField()),
            ('evidence', models.JSONField(blank=True, default=dict)),
            ('status', models.CharField(choices=[('open', 'Open'), ('accepted', 'Accepted'), ('dismissed', 'Dismissed')], db_index=True, default='open', max_length=16)),
            ('decided_at', models.DateTimeField(blank=True, null=True)),
            ('decision_reason', models.TextField(blank=True, default='')),
            ('created_at', models.DateTimeField(auto_now_add=True)),
            ('candidate', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='proposals', to='evolution.candidate')),
            ('cluster', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='proposals', to='evolution.failurecluster')),
            ('decided_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='governance.tenant')),
        ],
        options={
            'db_table': 'trainer_proposal',
        },
    ),
    migrations.AddConstraint(
        model_name='contextupdate',
        constraint=models.UniqueConstraint(fields=('tenant', 'agent', 'version'), name='contextupdate_agent_version'),
    ),
    migrations.AddConstraint(
        model_name='contextupdate',
        constraint=models.UniqueConstraint(condition=models.Q(('status', 'active')), fields=('tenant', 'agent', 'kind'), name='contextupdate_one_active_per_kind'),
    ),
    migrations.AddConstraint(
        model_name='failurecluster',
        constraint=models.UniqueConstraint(fields=('tenant', 'key'), name='failurecluster_tenant_key'),
    ),
    migrations.AddIndex(
        model_name='gateresult',
        index=models.Index(fields=['candidate', 'gate', '-created_at'], name='gateresult_candidate_gate'),
    ),
    migrations.AddConstraint(
        model_name='policyroute',
        constraint=models.UniqueConstraint(condition=models.Q(('status__in', ['canary', 'promoted'])), fields=('tenant', 'agent'), name='policyroute_one_live_per_agent'),
    ),
    migrations.AddConstraint(
        model_name='policyroute',
        constraint=models.CheckConstraint(condition=models.Q(('share__gte', 0), ('share__lte', 1)), name='policyroute_share_range'),
    ),
    migrations.AddIndex(
        model_name='candidate',
        index=models.Index(fields=['tenant', '-created_at'], name='candidate_tenant_created'),
    ),
    migrations.AddConstraint(
        model_name='proposal',
        constraint=models.UniqueConstraint(condition=models.Q(('status', 'open')), fields=('cluster',), name='proposal_one_open_per_cluster'),
    ),
]


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('governance', '0012_webhard_sanitizer_policy_change'),
        ('trainer', '0004_evolution_push_states'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=STATE_OPERATIONS),
    ]
