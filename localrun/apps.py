from django.apps import AppConfig


class LocalRunConfig(AppConfig):
    """What ``make up``, the end-to-end tests and the benchmarks use to run the
    platform on one machine: process helpers, seeding, a private PostgreSQL, the
    vLLM and SGLang CPU helpers. Nothing in production imports it."""

    name = "localrun"
    verbose_name = "Local run"
