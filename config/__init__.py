"""The Django project package: the roof (settings, urls, asgi, celery) over its
ground (names, fields, env readers, errors, the API base, ASGI types), which
imports no app.

Named ``config`` and not ``platform``: a top-level ``platform`` package would shadow
the standard library module that attrs, packaging and Twisted import.

Importing it loads nothing: the Celery app (``config.celery``, found by
``celery -A config``) is loaded when Django starts (``control.apps``), so the
ground stays free of frameworks for the pure modules that use it.
"""
