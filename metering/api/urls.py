"""A team's own usage and cost under /v1/organization/ (OpenAI's paths)."""

from django.urls import path

from metering.api import organization

urlpatterns = [
    path(
        "usage/completions",
        organization.CompletionsUsageView.as_view(),
        name="v1-organization-usage-completions",
    ),
    path("costs", organization.CostsView.as_view(), name="v1-organization-costs"),
]
