"""The console's own pages, under /console/ before the admin's tables.

URL names: ``console-home`` (/console/, the admin's index), ``console-pool``,
``console-rollouts``, ``console-rollout``, ``console-teams``, ``console-team``,
``console-reports`` and ``console-reports-csv`` (``console.reports``),
``console-judge-labels`` (``console.judge_labels``), ``console-sso-login`` and
``console-sso-callback`` (``console.sso``).

/console/rollouts/ is also where the admin puts the rollouts app's index; the
console's list of rollouts takes its place (the admin's tables stay one click
away, on the home page and in the sidebar). Below it the admin's own pages
(/console/rollouts/rollout/ and the like) keep their paths: a model name that is
one of them is no rollout page (``_RolloutModel``).
"""

from django.contrib import admin
from django.urls import path, register_converter

from console import judge_labels, reports, sso, views


class _RolloutModel:
    """A model name in /console/rollouts/<model>/, except the admin's own pages
    under /console/rollouts/ (its model admins of the ``rollouts`` app)."""

    regex = "[^/]+"

    def to_python(self, value: str) -> str:
        taken = {
            m._meta.model_name
            for m in admin.site._registry
            if m._meta.app_label == "rollouts"
        }
        if value in taken:
            raise ValueError(f"{value} is an admin page")
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(_RolloutModel, "rollout_model")

urlpatterns = [
    # Single sign-on (console.sso): outside admin_view, which would demand a login.
    path("login/", sso.console_login, name="console-login"),
    path("sso/login/", sso.sso_login, name="console-sso-login"),
    path("sso/callback/", sso.sso_callback, name="console-sso-callback"),
    path("", admin.site.admin_view(views.home), name="console-home"),
    path(
        "fleet/pools/<str:model>/<str:version>/<str:region>/",
        admin.site.admin_view(views.pool),
        name="console-pool",
    ),
    path("rollouts/", admin.site.admin_view(views.rollouts), name="console-rollouts"),
    path(
        "rollouts/<rollout_model:model>/",
        admin.site.admin_view(views.rollout),
        name="console-rollout",
    ),
    path(
        "reports/", admin.site.admin_view(reports.report_page), name="console-reports"
    ),
    path(
        "reports/usage.csv",
        admin.site.admin_view(reports.report_csv),
        name="console-reports-csv",
    ),
    path("teams/", admin.site.admin_view(views.teams), name="console-teams"),
    path(
        "judge-labels/",
        admin.site.admin_view(judge_labels.label_page),
        name="console-judge-labels",
    ),
    path("teams/<str:team>/", admin.site.admin_view(views.team), name="console-team"),
]
