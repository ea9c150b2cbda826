from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the console's system checks (``console.checks``)."""
        from console import checks  # noqa: F401
