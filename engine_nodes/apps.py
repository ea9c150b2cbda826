from django.apps import AppConfig


class EngineNodesConfig(AppConfig):
    name = "engine_nodes"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"
