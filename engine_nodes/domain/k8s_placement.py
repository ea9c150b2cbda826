"""Where a pool's pods run: GPU type, spread over nodes, nodes that hold the weights.

Every pool pod (``engine_nodes.domain.k8s.render_deployment``) gets:

- a *required* node affinity on ``GPU_PRODUCT_LABEL`` (the label NVIDIA's GPU
  feature discovery sets, e.g. ``NVIDIA-H100-80GB-HBM3``) when its version has a
  GPU type, so it never lands on another card;
- a *preferred* node affinity for nodes labelled with its weights
  (``weights_label``): the weights DaemonSet (``manage.py prefetch_weights``)
  sets that label once the tree verified in the node's cache;
- a topology spread over ``kubernetes.io/hostname`` with ``maxSkew`` 1 and
  ``ScheduleAnyway``. ``DoNotSchedule`` would leave a replica Pending whenever an
  eligible node with fewer of the pool's pods has no free GPU (a node busy with
  other pools still counts in the skew), and a Pending replica is lost capacity;
  with ``ScheduleAnyway`` the scheduler still ranks the least-loaded nodes first.

``weights_label_patch`` is what the DaemonSet patches onto its node's labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "GPU_PRODUCT_LABEL",
    "HOSTNAME_LABEL",
    "WEIGHTS_LABEL_PREFIX",
    "WEIGHTS_LABEL_VALUE",
    "is_label_value",
    "pod_affinity_fields",
    "weights_label",
    "weights_label_patch",
]

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_LABEL = "kubernetes.io/hostname"
WEIGHTS_LABEL_PREFIX = "weights.platform"
WEIGHTS_LABEL_VALUE = "verified"
# A label's name part holds 63 characters, a SHA-256 64 hex digits: 128 bits of
# it name a tree as surely as a version does.
WEIGHTS_LABEL_HEX = 32
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")


def is_label_value(text: str) -> bool:
    """Return True when ``text`` is a valid Kubernetes label value."""
    return _LABEL_VALUE.fullmatch(text) is not None


def weights_label(weights_hash: str) -> str:
    """Return the node label key that says a node holds these verified weights.

    Raises:
        ValueError: ``weights_hash`` is not 64 lowercase hex digits.
    """
    if _SHA256_HEX.fullmatch(weights_hash) is None:
        raise ValueError("weights_hash must be 64 lowercase hex digits")
    return f"{WEIGHTS_LABEL_PREFIX}/{weights_hash[:WEIGHTS_LABEL_HEX]}"


def weights_label_patch(
    labels: Mapping[str, str], present: Iterable[str], pending: Iterable[str] = ()
) -> dict[str, str | None]:
    """Return the merge-patch of a node's labels for the weights it holds now.

    ``present``: the hashes verified in the node's cache; ``pending``: those being
    pulled or verified again (a restarted DaemonSet pod verifies every tree it
    finds), whose labels stay as they are meanwhile. Adds the missing labels,
    removes (``None``) this platform's other labels, and leaves every other label
    alone. Empty when nothing changes.
    """
    wanted = {weights_label(h) for h in present}
    kept = wanted | {weights_label(h) for h in pending}
    patch: dict[str, str | None] = {
        key: WEIGHTS_LABEL_VALUE
        for key in sorted(wanted)
        if labels.get(key) != WEIGHTS_LABEL_VALUE
    }
    for key in sorted(labels):
        if key.startswith(f"{WEIGHTS_LABEL_PREFIX}/") and key not in kept:
            patch[key] = None
    return patch


def pod_affinity_fields(
    *, selector: Mapping[str, str], gpu_product: str | None, weights_hash: str
) -> dict[str, Any]:
    """Return the pod spec's ``affinity`` and ``topologySpreadConstraints``.

    ``selector``: the pool's pod labels (the spread counts the pool's pods only);
    ``gpu_product``: required, when set; ``weights_hash``: preferred, when set.
    """
    node_affinity: dict[str, Any] = {}
    if gpu_product:
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {
                            "key": GPU_PRODUCT_LABEL,
                            "operator": "In",
                            "values": [gpu_product],
                        }
                    ]
                }
            ]
        }
    if weights_hash:
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {
                "weight": 100,
                "preference": {
                    "matchExpressions": [
                        {
                            "key": weights_label(weights_hash),
                            "operator": "In",
                            "values": [WEIGHTS_LABEL_VALUE],
                        }
                    ]
                },
            }
        ]
    fields: dict[str, Any] = {
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": HOSTNAME_LABEL,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": dict(selector)},
            }
        ]
    }
    if node_affinity:
        fields["affinity"] = {"nodeAffinity": node_affinity}
    return fields
