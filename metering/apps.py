"""The metering app: usage, figures, cost and reports."""

from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    verbose_name = "Usage and cost"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Make the finance group after each migrate (``metering.roles``)."""
        from django.db.models.signals import post_migrate

        from metering.roles import ensure_finance_group

        post_migrate.connect(ensure_finance_group, sender=self)
