"""One usage row per team, model, version, region and minute (see 0006)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("metering", "0006_usage_region")]

    operations = [
        migrations.AddConstraint(
            model_name="usage",
            constraint=models.UniqueConstraint(
                fields=("team", "model", "version", "region", "minute"),
                name="usage_team_model_region_minute",
            ),
        ),
    ]
