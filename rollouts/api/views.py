"""Control-plane endpoint for rollouts."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.api import validated
from models_registry.services import get_model, rollout_dict
from rollouts import services
from rollouts.api.serializers import RolloutSerializer
from rollouts.domain.plan import Decision
from rollouts.models import Rollout


class RolloutView(APIView):
    """Read the pending rollout, or set one (seed: PUT /admin/models/{model}/rollout)."""

    @extend_schema(responses={200: dict})
    def get(self, request: Request, model: str) -> Response:
        get_model(model)
        rows = Rollout.objects.filter(model_id=model).select_related("version")[:50]
        pending = next((r for r in rows if r.decision == Decision.PENDING), None)
        return Response(
            {
                "pending": rollout_dict(pending) if pending else None,
                "history": [rollout_dict(r) for r in rows],
            }
        )

    @extend_schema(request=RolloutSerializer, responses={200: dict})
    def put(self, request: Request, model: str) -> Response:
        body = validated(RolloutSerializer, request.data)
        rollout = services.set_rollout(model_id=model, now=timezone.now(), **body)
        return Response(rollout_dict(rollout))
