"""Use-cases for usage: reading hit rates (recording arrives with the gateway)."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Sum

from metering.domain.usage import prefix_hit_rate
from metering.models import Usage


def prefix_hit_rate_since(*, model_id: str, since: datetime) -> float | None:
    """Return cached / prompt tokens of a model's usage since ``since``; None if idle."""
    totals = Usage.objects.filter(model_id=model_id, minute__gte=since).aggregate(
        prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens")
    )
    return prefix_hit_rate(totals["prompt"] or 0, totals["cached"] or 0)
