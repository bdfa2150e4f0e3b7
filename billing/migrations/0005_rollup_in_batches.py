from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0004_rollup_lines_without_key_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='RollupState',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('batch_hours', models.PositiveIntegerField(default=10000, help_text='Stale hours a batch takes at most.')),
                ('timed_out_at', models.DateTimeField(blank=True, help_text='When a batch last ran past the timeout.', null=True)),
                ('timeout_reason', models.TextField(blank=True, help_text='What ran past it, and what the rollup did then.')),
            ],
            options={
                'verbose_name': 'rollup state',
            },
        ),
        migrations.AlterField(
            model_name='staleusagehour',
            name='marked_at',
            field=models.DateTimeField(help_text='When the hour went stale: how long its records have waited for the rollup.'),
        ),
        # The new key first: marks stay unique throughout.
        migrations.AddConstraint(
            model_name='staleusagehour',
            constraint=models.UniqueConstraint(fields=('hour', 'endpoint'), name='billing_stale_usage_hour_key'),
        ),
        migrations.RemoveConstraint(
            model_name='staleusagehour',
            name='billing_stale_usage_hour_unique',
        ),
    ]
