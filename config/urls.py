"""URL map: the control plane at /admin/, the console at /console/, metrics at /metrics
(behind the metrics token, ``config.metrics``)."""

from django.contrib import admin
from django.http import HttpResponseRedirect
from django.urls import include, path

import config.checks  # noqa: F401  (registers the project's system checks)
from config.metrics import metrics_view
from config.v1_schema import v1_schema_view

urlpatterns = [
    path("", lambda request: HttpResponseRedirect("/console/")),
    # The console's own pages first: its home page replaces the admin's index.
    path("console/", include("console.urls")),
    path("console/", admin.site.urls),
    path("admin/", include("config.admin_api_urls")),
    # The team API's schema (the gateway's operations and Django's below).
    path("v1/openapi.json", v1_schema_view, name="v1-openapi"),
    # The Files and Batch APIs; config.asgi sends only these /v1 paths to Django.
    path("v1/", include("batches.api.urls")),
    # A team's own usage and cost (OpenAI's organization usage and costs shapes).
    path("v1/organization/", include("metering.api.urls")),
    path("metrics", metrics_view, name="prometheus-django-metrics"),
]

handler404 = "config.errors.handler404"
handler500 = "config.errors.handler500"
