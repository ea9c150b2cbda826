from django.apps import AppConfig


class DrillsConfig(AppConfig):
    name = "drills"
    verbose_name = "Drills"
    default_auto_field = "django.db.models.BigAutoField"
