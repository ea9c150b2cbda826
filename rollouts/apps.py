from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "rollouts"
    default_auto_field = "django.db.models.BigAutoField"
