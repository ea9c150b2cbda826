"""The monitoring in platform/monitoring/: rules, their unit tests, the dashboard.

promtool (Debian's ``prometheus`` package) checks the recording and alert rules,
runs their unit tests (tests/*.yml: each alert fires on its series and not on its
neighbours) and checks platform/prometheus/prometheus.yml. Every metric name an
expression reads, in the rules and in the dashboard, must be a recording rule or a
series the platform exports (the collectors registered once Django has set up), so
a misspelt name fails here instead of drawing an empty panel.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "platform" / "monitoring"
RULE_FILES = (MONITORING / "recording-rules.yml", MONITORING / "alert-rules.yml")
DASHBOARD = MONITORING / "grafana" / "serving-platform.json"
PROMETHEUS_YML = ROOT / "platform" / "prometheus" / "prometheus.yml"


def promtool(binary: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, *map(str, args)], capture_output=True, text=True, timeout=60
    )


# -- promtool ------------------------------------------------------------------------


def test_rules_pass_promtool_check(promtool_binary: str) -> None:
    result = promtool(promtool_binary, "check", "rules", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass(promtool_binary: str) -> None:
    tests = sorted((MONITORING / "tests").glob("*.yml"))
    assert {t.name for t in tests} >= {"alerts.yml", "recording.yml"}
    result = promtool(promtool_binary, "test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_tests_catch_a_changed_threshold(
    promtool_binary: str, tmp_path: Path
) -> None:
    """The unit tests can fail: with the TTFT target at 5 s, the test that expects
    the alert at a p95 of 2.4 s does."""
    copy = tmp_path / "monitoring"
    shutil.copytree(MONITORING, copy)
    alerts = copy / "alert-rules.yml"
    text = alerts.read_text()
    assert "pool:platform_ttft_seconds:p95_5m > 1\n" in text
    alerts.write_text(text.replace("p95_5m > 1\n", "p95_5m > 5\n"))

    result = promtool(promtool_binary, "test", "rules", copy / "tests" / "alerts.yml")
    assert result.returncode != 0
    assert "PlatformTTFTOverTarget" in result.stdout + result.stderr


def test_prometheus_config_passes_promtool_check(
    promtool_binary: str, tmp_path: Path
) -> None:
    """The config as shipped, but for the token file it names (Prometheus' own,
    in /etc/prometheus/), which is a temporary file here; its rule files are found
    relative to it, as Prometheus finds them."""
    token = tmp_path / "platform-metrics-token"
    token.write_text("not-a-secret")
    config = PROMETHEUS_YML.read_text()
    assert "/etc/prometheus/platform-metrics-token" in config
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "monitoring").symlink_to(MONITORING)
    copied = tmp_path / "prometheus" / "prometheus.yml"
    copied.write_text(
        config.replace("/etc/prometheus/platform-metrics-token", str(token))
    )

    result = promtool(promtool_binary, "check", "config", copied)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout


# -- the metric names every expression reads -------------------------------------------

# Words of PromQL that are not metric names (aggregations and functions are told
# apart by the parenthesis that follows them).
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "offset"}
    | {"bool", "and", "or", "unless", "inf", "nan", "atan2"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)"
)
_IDENTIFIER = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(?!\w)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Return the metric names a PromQL expression reads.

    Strings, label matchers, ranges and label lists go first (their words are not
    metrics), then every remaining word not followed by "(" (a function or an
    aggregation) and not a keyword is a metric name.
    """
    bare = _STRING.sub('""', expr)
    bare = _MATCHERS.sub("", bare)
    bare = _RANGE.sub("", bare)
    bare = _LABEL_LIST.sub("", bare)
    return {
        m.group(1)
        for m in _IDENTIFIER.finditer(bare)
        if m.group(2) is None and m.group(1) not in _KEYWORDS
    }


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.95, sum by (model, le) (rate(a_bucket{le="1"}[5m])))',
            {"a_bucket"},
        ),
        ("x:y:rate5m / (b_total > 0) * 3600 / 1e6", {"x:y:rate5m", "b_total"}),
        (
            'a unless a offset 5m or on (job) group_left (team) c{m=~"$model"}',
            {"a", "c"},
        ),
        ("time() - max by (model) (last_seconds) < 900", {"last_seconds"}),
        ('count(up{job="x"}) or vector(0)', {"up"}),
    ],
)
def test_metric_names_reads_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def rule_groups() -> Iterator[dict[str, Any]]:
    for path in RULE_FILES:
        yield from yaml.safe_load(path.read_text())["groups"]


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def exported_names() -> set[str]:
    """Every sample name the platform's processes export at /metrics.

    The default registry once Django has set up (the apps' ready() register the
    collectors read at scrape time): counters as ``_total``, histograms as their
    ``_bucket``, ``_sum`` and ``_count``.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    names = set()
    for family in REGISTRY.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def dashboard_exprs() -> list[str]:
    """Every panel target's expression, and the series the variables list labels of
    (``label_values(series, label)``)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert found, variable["name"]
            exprs.append(found.group(1))
    return exprs


def unknown_names(exprs: list[str], known: set[str]) -> dict[str, set[str]]:
    return {e: metric_names(e) - known for e in exprs if metric_names(e) - known}


@pytest.mark.django_db
def test_every_expression_reads_a_recorded_or_exported_metric() -> None:
    known = recorded_names() | exported_names()
    # What the figures read from the database at scrape time add (the apps' ready()
    # registered them), so the check above covers them.
    assert {
        "platform_pool_gpu_usd_per_hour",
        "platform_pool_silent_replicas",
        "platform_rollout_guard_last_trip_timestamp_seconds",
        "platform_batches_at_risk",
        "platform_ttft_seconds_bucket",
        "platform_team_shed_total",
    } <= known
    rule_exprs = [r["expr"] for g in rule_groups() for r in g["rules"]]
    assert unknown_names(rule_exprs, known) == {}
    assert unknown_names(dashboard_exprs(), known) == {}
    # And the check can fail: a misspelt name is caught.
    assert unknown_names(["rate(platform_output_token_total[5m])"], known) == {
        "rate(platform_output_token_total[5m])": {"platform_output_token_total"}
    }


@pytest.mark.usefixtures("postgres")
def test_a_scrape_with_the_database_down_goes_on_without_its_figures(
    django_db_blocker: DjangoDbBlocker, caplog: pytest.LogCaptureFixture
) -> None:
    """The collectors read at scrape time meet a real refused connection: the
    scrape answers, their families are described with no sample, and the log
    names the error's type, not its text."""
    from django.db import connections
    from django.db.backends.postgresql.base import DatabaseWrapper

    connection = connections["default"]
    assert isinstance(connection, DatabaseWrapper)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = connection.settings_dict
    # Without the connection pool, whose waits for a connection (seconds) would
    # only slow the test; the pool is set up again on the real address after.
    options = {k: v for k, v in saved.get("OPTIONS", {}).items() if k != "pool"}
    with django_db_blocker.unblock():
        connection.close()
        connection.close_pool()
        connection.settings_dict = {
            **saved,
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "OPTIONS": options,
        }
        try:
            text = generate_latest(REGISTRY).decode()
        finally:
            connection.close()
            connection.settings_dict = saved

    for family in (
        "platform_pool_desired_replicas",
        "platform_pool_gpu_usd_per_hour",
        "platform_rollout_open",
        "platform_batches_at_risk",
    ):
        assert f"# TYPE {family} gauge" in text
        assert f"{family}{{" not in text
    for what in ("pool cost figures", "rollout figures", "batch figures"):
        assert f"{what} unreadable: OperationalError" in caplog.text
    assert str(port) not in caplog.text


def test_every_recording_rule_is_read_by_an_alert_or_the_dashboard() -> None:
    """A recording rule nothing reads costs Prometheus for nothing."""
    read = set()
    for group in rule_groups():
        for rule in group["rules"]:
            read |= metric_names(rule["expr"])
    for expr in dashboard_exprs():
        read |= metric_names(expr)
    assert recorded_names() - read == set()


# -- the dashboard -------------------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard_on_a_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model", "region"} <= set(variables)

    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_shows_what_the_seed_asks_for() -> None:
    """Per pool: tokens per second, in flight, queue, p95 and p99 TTFT, time per
    output token, prefix hit rate, utilisation, USD per million tokens; per team:
    tokens, 429s, shed. Each is a panel reading its series."""
    read: dict[str, set[str]] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                read.setdefault(name, set()).add(panel["title"])
    for name in (
        "pool:platform_output_tokens:rate5m",
        "pool:platform_tokens_in_flight:sum",
        "pool:platform_queue_depth:sum",
        "pool:platform_ttft_seconds:p95_5m",
        "pool:platform_ttft_seconds:p99_5m",
        "pool:platform_time_per_output_token_seconds:p95_5m",
        "pool:platform_prefix_hit:ratio_rate5m",
        "pool:platform_pool_utilisation:max",
        "pool:platform_usd_per_million_output_tokens:rate5m",
        "team_model:platform_team_tokens:rate5m",
        "team_model:platform_team_rate_limited:rate5m",
        "team_model:platform_team_shed:rate5m",
    ):
        assert name in read, name


def test_every_alert_says_what_to_do() -> None:
    alerts = [r for g in rule_groups() for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} == {
        "PlatformInteractiveRequestsShed",
        "PlatformTTFTOverTarget",
        "PlatformReplicasSilent",
        "PlatformCanaryGuardTripped",
        "PlatformControlPlaneDown",
        "PlatformBatchAtRisk",
        "PlatformTeamBudgetSoftThreshold",
    }
    docs = (ROOT / "docs" / "monitoring.md").read_text()
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning"}
        assert {"summary", "description", "runbook"} <= set(alert["annotations"])
        anchor = re.search(
            r"docs/monitoring\.md#([\w-]+)", alert["annotations"]["runbook"]
        )
        assert anchor, alert["alert"]
        # The anchor is a heading of docs/monitoring.md (GitHub's slugs).
        headings = {
            re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", docs, flags=re.M)
        }
        assert anchor.group(1) in headings, alert["alert"]
