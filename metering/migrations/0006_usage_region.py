"""Usage rows per region: each region flushes its own Redis into rows of its own.

A team served by two regions in one minute (a failover) had one row, which the
two regions' flushes overwrote (the larger total won). Rows written before this
release were written by the region that runs this migration (one row per key
held one region's totals): they become its rows, so that its next flush of a
minute still in Redis updates them rather than adding a second row. The new
unique constraint comes in 0007: no ALTER TABLE after this update in one
transaction (PostgreSQL refuses one with trigger events pending).
"""

from django.apps.registry import Apps as StateApps
from django.conf import settings
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor


def name_the_region(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor | None
) -> None:
    Usage = apps.get_model("metering", "Usage")
    Usage.objects.filter(region="").update(region=settings.PLATFORM_REGION)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0003_admin_token_scope"),
        ("metering", "0005_open_spans_of_live_replicas"),
        ("models_registry", "0005_rollout_plans"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="usage",
            name="usage_team_model_minute",
        ),
        migrations.AddField(
            model_name="usage",
            name="region",
            field=models.CharField(default="", max_length=64),
        ),
        migrations.RunPython(name_the_region, migrations.RunPython.noop),
    ]
