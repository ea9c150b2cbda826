from django.apps import AppConfig


class ControlConfig(AppConfig):
    """Every control loop's live tick, its Celery task and its API; no models."""

    name = "control"
    verbose_name = "Control loops"

    def ready(self) -> None:
        """Export the autoscaler's figures, the pools' GPUs, cost and live figures, at /metrics
        (read at scrape time); load the Celery app, so every process that runs
        Django sends tasks through the platform's broker, not Celery's default."""
        import config.celery  # noqa: F401
        from control.autoscaling import pool_figures, pool_live_figures
        from control.pool_costs import pool_cost_figures
        from metering.metrics import (
            register_pool_costs,
            register_pool_live,
            register_pool_scaling,
        )

        register_pool_scaling(pool_figures)
        register_pool_costs(pool_cost_figures)
        register_pool_live(pool_live_figures)
