"""URL map: the control plane at /admin/, the console at /console/, metrics at /metrics."""

from django.contrib import admin
from django.http import HttpResponseRedirect
from django.urls import include, path
from django_prometheus import exports

import config.checks  # noqa: F401  (registers the project's system checks)

urlpatterns = [
    path("", lambda request: HttpResponseRedirect("/console/")),
    path("console/", admin.site.urls),
    path("admin/", include("config.admin_api_urls")),
    path("metrics", exports.ExportToDjangoView, name="prometheus-django-metrics"),
]

handler404 = "config.errors.handler404"
handler500 = "config.errors.handler500"
