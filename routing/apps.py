from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"
    default_auto_field = "django.db.models.BigAutoField"
