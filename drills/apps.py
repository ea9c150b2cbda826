from django.apps import AppConfig


class DrillsConfig(AppConfig):
    name = "drills"
    default_auto_field = "django.db.models.BigAutoField"
