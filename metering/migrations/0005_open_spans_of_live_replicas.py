"""Open a span for every replica that is live when the state history begins.

Without it a replica serving since before this release would hold its GPUs unbilled
until its next move. Its span starts now: the time before the history is unknown.
"""

from django.apps.registry import Apps as StateApps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.utils import timezone

HOLDING = ("starting", "loading", "serving", "stalled", "draining")


def open_spans(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor | None) -> None:
    Replica = apps.get_model("engine_nodes", "Replica")
    ReplicaSpan = apps.get_model("metering", "ReplicaSpan")
    now = timezone.now()
    already = set(
        ReplicaSpan.objects.filter(ended_at__isnull=True).values_list(
            "replica_id", flat=True
        )
    )
    ReplicaSpan.objects.bulk_create(
        ReplicaSpan(
            replica_id=r.replica_id,
            model=r.model_id,
            version=r.version.version,
            region=r.region,
            gpus=r.version.gpus_per_replica,
            state=r.state,
            started_at=now,
        )
        for r in Replica.objects.filter(state__in=HOLDING).select_related("version")
        if r.replica_id not in already
    )


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0004_replica_spans"),
        ("engine_nodes", "0004_scalingdecision"),
    ]

    operations = [migrations.RunPython(open_spans, migrations.RunPython.noop)]
