from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Export batches running and at risk at /metrics (read at scrape time)."""
        from batches.figures import batch_figures
        from metering.metrics import register_batches

        register_batches(batch_figures)
