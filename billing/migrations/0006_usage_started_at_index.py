from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without holding up ingestion: the ledger may hold millions of records.
    atomic = False

    dependencies = [
        ('billing', '0005_rollup_in_batches'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='usagerecord',
            index=models.Index(fields=['started_at'], name='billing_usage_started_at'),
        ),
    ]
