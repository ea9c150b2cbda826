"""The finance role: a Django group whose members read reports and nothing else.

Public surface: ``FINANCE_GROUP``, ``FINANCE_PERMISSIONS``, ``ensure_finance_group``.

Made after every migrate (``metering.apps``), so a fresh database has it. A member
needs staff status to reach the console; the group gives the usage list and the
reports page (``metering.view_cost_report``), no keys, limits, teams or fleet.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FINANCE_GROUP", "FINANCE_PERMISSIONS", "ensure_finance_group"]

FINANCE_GROUP = "finance"
FINANCE_PERMISSIONS = ("metering.view_usage", "metering.view_cost_report")


def ensure_finance_group(**kwargs: Any) -> None:
    """Create the finance group, or set its permissions back to exactly these."""
    from django.contrib.auth.models import Group, Permission

    perms = []
    for name in FINANCE_PERMISSIONS:
        app_label, codename = name.split(".")
        perm = Permission.objects.filter(
            content_type__app_label=app_label, codename=codename
        ).first()
        if perm is None:
            return  # permissions are made by this same post_migrate: next time
        perms.append(perm)
    group, _ = Group.objects.get_or_create(name=FINANCE_GROUP)
    group.permissions.set(perms)
