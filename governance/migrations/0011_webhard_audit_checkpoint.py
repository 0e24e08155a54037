from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0010_newcomer_worker_heartbeat'),
    ]

    operations = [
        migrations.CreateModel(
            name='AuditCheckpoint',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name='ID')),
                ('seq', models.BigIntegerField()),
                ('hash', models.CharField(max_length=64)),
                ('ok', models.BooleanField()),
                ('first_bad_seq', models.BigIntegerField(blank=True, null=True)),
                ('reason', models.CharField(blank=True, default='', max_length=200)),
                ('full', models.BooleanField(default=False)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
