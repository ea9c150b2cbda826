"""The console's figures in templates (``console.domain.formats``)."""

from __future__ import annotations

from django import template

from console.domain import formats

register = template.Library()

register.filter("pct", formats.percent)
register.filter("ms", formats.milliseconds)
register.filter("tokens_per_s", formats.per_second)
register.filter("raw", formats.attribute)
