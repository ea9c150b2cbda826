from django.apps import AppConfig


class EngineNodesConfig(AppConfig):
    name = "engine_nodes"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Export the autoscaler's figures, and the pools' GPUs and cost, at /metrics
        (read at scrape time)."""
        from engine_nodes.autoscaling import pool_figures
        from engine_nodes.pool_costs import pool_cost_figures
        from metering.metrics import register_pool_costs, register_pool_scaling

        register_pool_scaling(pool_figures)
        register_pool_costs(pool_cost_figures)
