"""The labelling page: people grade the eval judge's verdicts, blind.

``/console/judge-labels/`` shows one item nobody has labelled yet (the question
and two answers, A and B, in an order drawn for the reviewer; never which
version wrote which, nor the judge's verdict) with three buttons (A better, B
better, tie), how many items are labelled, and each judge's agreement with
people: Cohen's kappa with its 95% interval, held to the default floor
(``GateConfig``'s ``min_kappa`` over at least ``min_labels`` labels; a model's
own gate settings may set another, which the gates endpoint shows). A POST
records the label and the reviewer (``models_registry.judge_labels``; the audit
trail records it too), then comes back for the next item. Needs ``models_registry.change_judgeitem``.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from audit.models import Source
from audit.services import audited
from config.api import admin_name
from console.views import _context
from models_registry import judge_labels
from models_registry.models import JudgeItem

__all__ = ["label_page"]

PERMISSION = "models_registry.change_judgeitem"


@never_cache
@require_http_methods(["GET", "POST"])
def label_page(request: HttpRequest) -> HttpResponse:
    """One unlabelled judge item with its three buttons; POST labels one."""
    if not request.user.has_perm(PERMISSION):
        raise PermissionDenied(f"needs {PERMISSION}")
    if request.method == "POST":
        return _label(request)
    labelled, total = judge_labels.label_progress()
    return TemplateResponse(
        request,
        "console/judge_labels.html",
        _context(
            request,
            "Judge labels",
            item=judge_labels.next_item(),
            labelled=labelled,
            total=total,
            agreements=[a.as_dict() for a in judge_labels.agreements()],
        ),
    )


def _label(request: HttpRequest) -> HttpResponse:
    try:
        item_id = int(request.POST.get("item", ""))
        # A label moves the judge's agreement, and so whether it may gate: audited.
        with audited(
            request,
            source=Source.CONSOLE,
            scope=[JudgeItem.objects.filter(pk=item_id)],
        ):
            done = judge_labels.label_item(
                item_id=item_id,
                label=request.POST.get("label", ""),
                reviewer=admin_name(request),
                now=timezone.now(),
            )
    except ValueError as exc:
        messages.error(request, f"label refused: {exc}")
    else:
        if not done:
            messages.warning(request, "someone labelled that item first")
    return redirect("console-judge-labels")
