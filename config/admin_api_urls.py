"""The control-plane REST API, at the seed's paths under /admin/."""

from django.urls import path
from drf_spectacular.views import SpectacularJSONAPIView
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from accounts.api import views as accounts
from audit.api import views as audit
from control.api import views as engine_nodes
from metering.api import views as metering
from models_registry.api import views as registry
from rollouts.api import views as rollouts


class SchemaView(SpectacularJSONAPIView):
    """The OpenAPI schema (JSON); its refusals use the API's JSON error shape."""

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = "application/json"
        return response


urlpatterns = [
    path("schema", SchemaView.as_view(), name="admin-schema"),
    path("audit", audit.AuditView.as_view(), name="admin-audit"),
    path("models", rollouts.ModelListView.as_view(), name="admin-models"),
    path("models/<str:model>", rollouts.ModelDetailView.as_view(), name="admin-model"),
    path(
        "models/<str:model>/versions",
        registry.VersionListView.as_view(),
        name="admin-model-versions",
    ),
    path(
        "models/<str:model>/versions/<str:version>/gates",
        registry.VersionGatesView.as_view(),
        name="admin-model-version-gates",
    ),
    path(
        "models/<str:model>/gate_config",
        registry.GateConfigView.as_view(),
        name="admin-model-gate-config",
    ),
    path(
        "models/<str:model>/rollout",
        rollouts.RolloutView.as_view(),
        name="admin-model-rollout",
    ),
    path(
        "models/<str:model>/rollout_plan",
        rollouts.RolloutPlanView.as_view(),
        name="admin-model-rollout-plan",
    ),
    path(
        "models/<str:model>/alias",
        rollouts.AliasView.as_view(),
        name="admin-model-alias",
    ),
    path(
        "pools/<str:model>/state",
        engine_nodes.PoolStateView.as_view(),
        name="admin-pool-state",
    ),
    path(
        "pools/<str:model>/<str:version>/<str:region>/autoscaling",
        engine_nodes.PoolAutoscalingView.as_view(),
        name="admin-pool-autoscaling",
    ),
    path(
        "pools/<str:model>/<str:version>/<str:region>/traffic",
        engine_nodes.PoolTrafficView.as_view(),
        name="admin-pool-traffic",
    ),
    path(
        "reports/usage",
        metering.UsageReportView.as_view(),
        name="admin-reports-usage",
    ),
    path("teams", accounts.TeamListView.as_view(), name="admin-teams"),
    path("teams/<str:team>", accounts.TeamDetailView.as_view(), name="admin-team"),
    path(
        "teams/<str:team>/limits",
        accounts.LimitView.as_view(),
        name="admin-team-limits",
    ),
    path(
        "teams/<str:team>/entitlements",
        accounts.EntitlementView.as_view(),
        name="admin-team-entitlements",
    ),
    path(
        "teams/<str:team>/budgets",
        accounts.BudgetView.as_view(),
        name="admin-team-budgets",
    ),
    path(
        "teams/<str:team>/keys", accounts.KeyListView.as_view(), name="admin-team-keys"
    ),
    path(
        "teams/<str:team>/keys/<int:key_id>",
        accounts.KeyDetailView.as_view(),
        name="admin-team-key",
    ),
]
