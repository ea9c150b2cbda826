from django.apps import AppConfig


class EngineNodesConfig(AppConfig):
    name = "engine_nodes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Export the autoscaler's figures at /metrics (read at scrape time)."""
        from engine_nodes.autoscaling import pool_figures
        from metering.metrics import register_pool_scaling

        register_pool_scaling(pool_figures)
