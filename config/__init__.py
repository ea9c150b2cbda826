"""The Django project package (settings, urls, asgi, celery).

Named ``config`` and not ``platform``: a top-level ``platform`` package would shadow
the standard library module that attrs, packaging and Twisted import.
"""

from config.celery import app as celery_app

__all__ = ["celery_app"]
