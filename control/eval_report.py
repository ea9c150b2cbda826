"""The eval gate's report: JSON for machines, a self-contained page for people.

Public surface: ``render_html``, ``precision_html``, ``write_report``,
``report_uris``, ``ReportLocationError``.

``render_html`` turns ``EvalReport.as_dict()`` into one HTML page with no outside
resources: the verdict and its reasons at the top, then the run (versions, judge
and prompt version, counts, timings), the judge's trust (and its agreement with
human labels, ``judge_agreement``, where the gate read it), and a table per
category (each metric's means, difference, confidence interval, threshold,
pass or fail, and the ids of the items where the candidate did worst); a run
that changed precision starts with the precisions side by side
(``precision_html``). Every
value from the report is escaped: item ids and model names are the team's text.

``write_report`` writes both next to each other through fsspec (``file://`` and
local paths, ``s3://`` and the rest when their fsspec backend is installed and
configured). A version's ``eval_report_uri`` may name either file, or a folder
(ending in ``/``, which gets ``eval-report.json`` and ``eval-report.html``); both
must lie under the storage roots (``PLATFORM_STORAGE_ROOTS``), checked as every
other URI is (``models_registry.domain.identity.uri_errors``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from models_registry.domain.identity import uri_errors

__all__ = [
    "ReportLocationError",
    "precision_html",
    "render_html",
    "report_uris",
    "write_report",
]

_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:72rem;
padding:0 1rem;color:#1d1d1f}
h1{font-size:1.6rem;margin:0 0 .5rem}h2{font-size:1.2rem;margin:2rem 0 .5rem}
.verdict{padding:1rem 1.25rem;border-radius:.5rem;margin-bottom:1.5rem}
.passed{background:#e6f4ea;border:1px solid #34a853}
.failed{background:#fce8e6;border:1px solid #d93025}
table{border-collapse:collapse;margin:.5rem 0 1rem;min-width:40rem}
th,td{border:1px solid #d0d0d5;padding:.3rem .6rem;text-align:left}
th{background:#f3f3f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#137333;font-weight:600}.fail{color:#c5221f;font-weight:600}
code{background:#f3f3f6;padding:0 .25rem;border-radius:.2rem}
"""


_NONE = "n/a"


class ReportLocationError(ValueError):
    """The report's URI may not be written: outside the storage roots, or malformed."""


def _text(value: Any) -> str:
    return escape("" if value is None else str(value))


def _number(value: Any, spec: str = ".3f") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _text(value if value is not None else _NONE)
    return escape(format(value, spec))


def _pass_cell(passed: Any) -> str:
    if passed is True:
        return '<td class="pass">pass</td>'
    if passed is False:
        return '<td class="fail">fail</td>'
    return "<td>" + _NONE + "</td>"


def _rows(pairs: Sequence[tuple[str, Any]]) -> str:
    return "".join(f"<tr><th>{_text(k)}</th><td>{_text(v)}</td></tr>" for k, v in pairs)


def _category_table(
    category: str,
    results: Sequence[Mapping[str, Any]],
    worst: Sequence[Any],
    *,
    baseline: str,
) -> str:
    rows = []
    for r in results:
        interval = r.get("interval") or [None, None]
        low, high = [*interval, None, None][:2]
        confidence = r.get("confidence", 0.95)
        rows.append(
            "<tr>"
            f"<td>{_text(r.get('metric'))}</td>"
            f'<td class="num">{_number(r.get("items"), "d")}</td>'
            f'<td class="num">{_number(r.get("candidate_mean"))}</td>'
            f'<td class="num">{_number(r.get("live_mean"))}</td>'
            f'<td class="num">{_number(r.get("difference"), "+.3f")}</td>'
            f'<td class="num">{_number(low, "+.3f")} to {_number(high, "+.3f")}'
            f" ({_number(confidence, '.0%')})</td>"
            f'<td class="num">{_number(r.get("threshold"))}</td>'
            f"{_pass_cell(r.get('passed'))}"
            "</tr>"
            f'<tr><td colspan="8">{_text(r.get("reason"))}</td></tr>'
        )
    worst_line = (
        "<p>Worst items: "
        + ", ".join(f"<code>{_text(i)}</code>" for i in worst)
        + "</p>"
        if worst
        else "<p>No item where the candidate did worse.</p>"
    )
    return (
        f"<h3>{_text(category)}</h3>"
        "<table><thead><tr><th>metric</th><th>items</th><th>candidate</th>"
        f"<th>{_text(baseline)}</th><th>difference</th><th>interval</th>"
        "<th>threshold</th><th>result</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{worst_line}"
    )


def _precision_tables(report: Mapping[str, Any]) -> list[tuple[Any, Mapping[str, Any]]]:
    """Return the report's precision tables: its own, or each eval set's."""
    found: list[tuple[Any, Mapping[str, Any]]] = []
    own = report.get("precision")
    if isinstance(own, Mapping):
        found.append((None, own))
    for one in report.get("sets") or []:
        table = one.get("precision") if isinstance(one, Mapping) else None
        if isinstance(table, Mapping):
            found.append((one.get("eval_set"), table))
    return found


def precision_html(eval_set: Any, table: Mapping[str, Any]) -> str:
    """Return one precision table: each precision's score per category, the
    drops from live, the candidate's interval and margin, and the verdict."""
    columns = [c for c in table.get("columns") or [] if isinstance(c, Mapping)]
    head = "".join(
        f"<th>{_text(c.get('precision'))} ({_text(c.get('role'))})<br>"
        f"<small>{_text(c.get('version') or c.get('note') or '')}</small></th>"
        for c in columns
    )
    rows = []
    for row in table.get("categories") or []:
        scores, drops = row.get("scores") or {}, row.get("drops") or {}
        cells = "".join(
            f'<td class="num">{_number(scores.get(c.get("precision")))}'
            f" (drop {_number(drops.get(c.get('precision')), '+.3f')})</td>"
            for c in columns
        )
        low, high = [*(row.get("interval") or []), None, None][:2]
        rows.append(
            f"<tr><td>{_text(row.get('category'))}</td>{cells}"
            f'<td class="num">{_number(low, "+.3f")} to {_number(high, "+.3f")}</td>'
            f'<td class="num">{_number(row.get("margin"))}</td>'
            f"{_pass_cell(row.get('passed'))}</tr>"
        )
    where = f"<p>Eval set <code>{_text(eval_set)}</code></p>" if eval_set else ""
    return (
        f"{where}<p>{_text(table.get('reason'))}</p>"
        f"<table><thead><tr><th>category</th>{head}"
        "<th>candidate minus live, interval</th><th>margin</th><th>result</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        f"<p><small>{_text(table.get('statistic'))}</small></p>"
    )


def render_html(report: Mapping[str, Any]) -> str:
    """Return the report as one self-contained HTML page (module docstring)."""
    passed = report.get("passed") is True
    verdict = "PASSED" if passed else "FAILED"
    candidate, live = report.get("candidate"), report.get("live")
    title = f"Eval gate {verdict}: {candidate}" + (f" against {live}" if live else "")
    reasons = "".join(f"<li>{_text(r)}</li>" for r in report.get("reasons") or [])
    run = _rows(
        [
            ("candidate", candidate),
            ("live", live or "none (first version: held to the floors)"),
            ("judge", report.get("judge_model") or "not asked"),
            ("judge prompt", report.get("judge_prompt")),
            ("mode", report.get("mode")),
            ("finished at", report.get("finished_at")),
            *[(f"count: {k}", v) for k, v in (report.get("counts") or {}).items()],
            *[
                (f"time: {k}", f"{v} s")
                for k, v in (report.get("timings_s") or {}).items()
            ],
        ]
    )
    judge = report.get("judge")
    if isinstance(judge, Mapping):
        kappa = judge.get("kappa")
        judge_part = (
            "<table><tbody>"
            + _rows(
                [
                    ("trusted", "yes" if judge.get("trusted") else "no"),
                    ("Cohen's kappa", _NONE if kappa is None else f"{kappa:.3f}"),
                    ("labelled pairs", judge.get("labelled")),
                    ("agreed", judge.get("agreed")),
                    ("unreadable replies", judge.get("unparsed")),
                    ("least kappa", judge.get("min_kappa")),
                    ("least labels", judge.get("min_labels")),
                ]
            )
            + f"</tbody></table><p>{_text(judge.get('reason'))}</p>"
        )
    else:
        judge_part = "<p>The judge was not checked.</p>"
    people = report.get("judge_agreement")
    if isinstance(people, Mapping):
        # The judge's agreement with human labels (models_registry.judge_labels).
        judge_part += f'<p class="people">People: {_text(people.get("reason"))}</p>'
    categories = report.get("categories") or []
    worst = report.get("worst") or {}
    baseline = "floor" if report.get("mode") == "floor" else "live"
    names = list(dict.fromkeys(r.get("category") for r in categories))
    tables = (
        "".join(
            _category_table(
                str(name),
                [r for r in categories if r.get("category") == name],
                worst.get(name) or [],
                baseline=baseline,
            )
            for name in names
        )
        or "<p>No category was scored.</p>"
    )
    found = _precision_tables(report)
    precision = (
        "<h2>Precisions side by side</h2>"
        + "".join(precision_html(where, table) for where, table in found)
        if found
        else ""
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_text(title)}</title><style>{_STYLE}</style></head><body>"
        f'<div class="verdict {"passed" if passed else "failed"}">'
        f"<h1>{_text(title)}</h1><ul>{reasons}</ul></div>"
        f"{precision}"
        f"<h2>Categories</h2>{tables}"
        f"<h2>Judge</h2>{judge_part}"
        f"<h2>Run</h2><table><tbody>{run}</tbody></table>"
        "</body></html>\n"
    )


def report_uris(uri: str) -> tuple[str, str]:
    """Return the (JSON, HTML) URIs for ``uri``: a folder or either file."""
    if uri.endswith("/"):
        base = uri + "eval-report"
    elif uri.endswith((".json", ".html")):
        base = uri[: -len(".json")]
    else:
        base = uri
    return base + ".json", base + ".html"


def _write_text(uri: str, text: str) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fsspec.open(uri, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_report(
    uri: str, report: Mapping[str, Any], *, storage_roots: Sequence[str]
) -> tuple[str, str]:
    """Write the report as JSON and HTML; return their URIs (JSON, HTML).

    Raises:
        ReportLocationError: either URI lies outside ``storage_roots`` (or climbs
            out of one), before anything is written.
    """
    json_uri, html_uri = report_uris(uri)
    for target in (json_uri, html_uri):
        errors = uri_errors(target, storage_roots)
        if errors:
            raise ReportLocationError(f"eval report {target}: {'; '.join(errors)}")
    body = json.dumps(report, indent=2, sort_keys=True, allow_nan=False)
    _write_text(json_uri, body + "\n")
    _write_text(html_uri, render_html(report))
    return json_uri, html_uri
