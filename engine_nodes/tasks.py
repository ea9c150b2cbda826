"""Celery tasks of the engine fleet."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from engine_nodes import services


@shared_task(
    name="engine_nodes.reap_silent_replicas", acks_late=True, ignore_result=True
)
def reap_silent_replicas() -> int:
    """Mark replicas that missed their heartbeats as gone; return how many."""
    return len(services.reap_silent_replicas(now=timezone.now()))
