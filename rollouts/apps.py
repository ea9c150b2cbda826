from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "rollouts"
    verbose_name = "Traffic and rollouts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Export open rollouts and guard trips at /metrics (read at scrape time)."""
        from metering.metrics import register_rollouts
        from rollouts.figures import rollout_figures

        register_rollouts(rollout_figures)
