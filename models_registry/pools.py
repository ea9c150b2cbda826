"""Looking a pool up: a version's pool in a region, or a 404 that names what is
missing (the model, else the pool's region).

Public surface: ``get_pool``.
"""

from __future__ import annotations

from config.errors import NotFound
from models_registry.models import Pool
from models_registry.services import get_model

__all__ = ["get_pool"]


def get_pool(
    *, model_id: str, version: str, region: str, for_update: bool = False
) -> Pool:
    """Return the pool of ``model@version`` in ``region`` (its model and version
    loaded) or raise NotFound."""
    queryset = Pool.objects.select_related("model", "version")
    if for_update:
        queryset = queryset.select_for_update(no_key=True, of=("self",))
    pool = queryset.filter(
        model_id=model_id, version__version=version, region=region
    ).first()
    if pool is None:
        get_model(model_id)  # names the model when that is what is missing
        raise NotFound(
            f"{model_id}@{version} has no pool in {region!r}", param="region"
        )
    return pool
