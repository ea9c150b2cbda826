"""Usage and cost reports: the admin API (JSON and CSV), the reports token, the
finance role in the console, and a team's own usage and cost with its key."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.contrib.auth.models import Group, User
from django.db.models import Sum
from django.test import Client
from rest_framework.test import APIClient

from accounts import services as accounts_services
from accounts.models import Team
from engine_nodes.models import Replica
from metering.domain.cost import TokenWeights
from metering.models import Usage
from metering.reports import TOKEN_FIELDS, report_query, usage_report
from metering.roles import FINANCE_GROUP
from models_registry import services as registry_services
from models_registry.models import ModelVersion
from tests.factories import VERSION_BODY, ReplicaFactory, accept

pytestmark = pytest.mark.django_db

NOV = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)
NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


@pytest.fixture
def month(chat_v1: ModelVersion) -> dict[str, Any]:
    """November: one chat replica (1 GPU, measured at 2,500 tokens/s) serving one
    hour, made half busy by two teams; and a stray minute in December."""
    assert chat_v1.gpus_per_replica == 1
    ModelVersion.objects.filter(pk=chat_v1.pk).update(load_test_tokens_per_s=2500.0)
    search = accounts_services.create_team(team_id="search", name="Search")
    ads = accounts_services.create_team(team_id="ads", name="Ads")
    with time_machine.travel(NOV, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="serving")
    with time_machine.travel(NOV + timedelta(hours=1), tick=False):
        Replica.objects.filter(pk=replica.pk).update(state="gone")

    def use(team: Team, minute: datetime, **counts: int) -> None:
        Usage.objects.create(
            team=team,
            model_id=chat_v1.model_id,
            version=chat_v1,
            region="local",  # the replica's (ReplicaFactory's)
            minute=minute,
            **counts,
        )

    use(
        search,
        NOV,
        requests=10,
        prompt_tokens=1_000_000,
        cached_tokens=600_000,
        output_tokens=3_000_000,
        rate_limited=2,
    )
    use(search, NOV + timedelta(minutes=5), requests=5, output_tokens=0, shed=1)
    use(
        ads,
        NOV + timedelta(minutes=9),
        requests=4,
        prompt_tokens=400_000,
        output_tokens=1_500_000,
        batch_requests=4,
        batch_prompt_tokens=400_000,
        batch_output_tokens=1_500_000,
    )
    use(ads, datetime(2026, 12, 1, 8, 0, tzinfo=UTC), requests=1, output_tokens=7)
    return {"version": chat_v1, "search": search, "ads": ads}


def reports_client(scope: str) -> APIClient:
    _, secret = accounts_services.create_admin_token(name="finance", scope=scope)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def november_totals() -> dict[str, int]:
    rows = Usage.objects.filter(minute__lt=datetime(2026, 12, 1, tzinfo=UTC))
    return {f: rows.aggregate(n=Sum(f))["n"] or 0 for f in TOKEN_FIELDS}


def test_the_month_is_priced_by_the_cost_model(month: dict[str, Any]) -> None:
    query = report_query({"from": "2026-11", "to": "2026-11"}, now=NOW)
    report = usage_report(query, now=NOW).as_dict()
    (version,) = report["versions"]
    # One GPU-hour at 2.50 USD, 4.5 of 9 million output tokens: 0.56 per million.
    assert version["usd"] == pytest.approx(2.50)
    assert round(version["usd_per_million_tokens"], 2) == 0.56
    assert round(version["usd_per_million_tokens_at_full"], 2) == 0.28
    # The split is the cost model's: each team pays 2.50 USD per 9 million weighted
    # tokens (a full hour's), the rest is idle.
    weights = TokenWeights()
    search_w = weights.of(
        prompt_tokens=1_000_000, cached_tokens=600_000, output_tokens=3_000_000
    )
    ads_w = weights.of(prompt_tokens=400_000, cached_tokens=0, output_tokens=1_500_000)
    usd = {r["team"]: r["usd"] for r in report["data"]}
    assert usd["search"] == pytest.approx(2.50 * search_w / 9e6, abs=1e-6)
    assert usd["ads"] == pytest.approx(2.50 * ads_w / 9e6, abs=1e-6)
    assert version["utilisation"] == pytest.approx((search_w + ads_w) / 9e6, abs=1e-6)
    assert report["totals"]["usd"] == pytest.approx(usd["search"] + usd["ads"])
    assert report["totals"]["idle_usd"] == pytest.approx(2.50 - report["totals"]["usd"])
    assert report["totals"]["gpu_usd"] == pytest.approx(2.50)
    assert report["totals"] | {} == report["totals"]  # a plain dict
    for field in TOKEN_FIELDS:
        assert report["totals"][field] == november_totals()[field]


def test_a_chat_and_an_embedding_team_are_each_priced_by_their_tokens(
    month: dict[str, Any],
) -> None:
    """GIVEN November's chat month and an embedding model's replica (1 GPU,
    measured at 50,000 input tokens/s) serving the same hour, half busy with a
    RAG team's 90 million input tokens (0 output tokens, as every embedding
    request) WHEN the month is reported THEN the embedding version is priced per
    input token: the RAG team pays half the GPU-hour, its cost per million is
    over input tokens, and the chat version's figures are as before."""
    registry_services.create_model(
        model_id="embed-small", kind="embedding", dimensions=384, max_input_tokens=512
    )
    embed = accept(
        registry_services.register_version(
            model_id="embed-small",
            **{**VERSION_BODY, "engine_config": {"runner": "pooling"}},
        )
    )
    ModelVersion.objects.filter(pk=embed.pk).update(load_test_tokens_per_s=50_000.0)
    rag = accounts_services.create_team(team_id="rag", name="RAG")
    with time_machine.travel(NOV, tick=False):
        replica = ReplicaFactory.create(version=embed, state="serving")
    with time_machine.travel(NOV + timedelta(hours=1), tick=False):
        Replica.objects.filter(pk=replica.pk).update(state="gone")
    Usage.objects.create(
        team=rag,
        model_id="embed-small",
        version=embed,
        region="local",
        minute=NOV + timedelta(minutes=3),
        requests=1000,
        prompt_tokens=90_000_000,
        output_tokens=0,
    )

    query = report_query({"from": "2026-11", "to": "2026-11"}, now=NOW)
    report = usage_report(query, now=NOW).as_dict()

    versions = {v["model"]: v for v in report["versions"]}
    chat, embedding = versions["chat-7b"], versions["embed-small"]
    assert (chat["priced_by"], chat["priced_tokens"]) == ("output", 4_500_000)
    assert round(chat["usd_per_million_tokens"], 2) == 0.56
    assert (embedding["priced_by"], embedding["priced_tokens"]) == (
        "input",
        90_000_000,
    )
    assert embedding["output_tokens"] == 0
    assert embedding["utilisation"] == pytest.approx(0.5)
    # 2.50 USD / (50,000 x 3600 x 0.5 / 1e6): 0.0278 per million input tokens.
    assert embedding["usd_per_million_tokens"] == pytest.approx(2.50 / 90, abs=1e-6)
    assert embedding["usd_per_million_tokens_at_full"] == pytest.approx(
        2.50 / 180, abs=1e-6
    )
    rows = {(r["team"], r["model"]): r for r in report["data"]}
    assert rows[("rag", "embed-small")]["usd"] == pytest.approx(1.25)
    assert rows[("rag", "embed-small")]["weighted_tokens"] == 90_000_000
    assert {p["model"]: p["priced_by"] for p in report["pools"]} == {
        "chat-7b": "output",
        "embed-small": "input",
    }
    idle = {r["model"]: r["usd"] for r in report["idle"]}
    assert idle["embed-small"] == pytest.approx(1.25)
    assert report["totals"]["gpu_usd"] == pytest.approx(5.00)
    assert report["totals"]["usd"] + report["totals"]["idle_usd"] == pytest.approx(5.00)


def test_a_finance_token_downloads_the_month_as_csv(month: dict[str, Any]) -> None:
    client = reports_client("reports")
    with time_machine.travel(NOW, tick=False):
        answer = client.get("/admin/reports/usage?from=2026-11&to=2026-11&format=csv")
    assert answer.status_code == 200, answer.content
    assert answer["Content-Type"].startswith("text/csv")
    assert 'filename="usage-2026-11-01-2026-12-01.csv"' in answer["Content-Disposition"]
    lines = list(csv.DictReader(io.StringIO(answer.content.decode())))
    teams = [line for line in lines if line["line"] == "team"]
    idle = [line for line in lines if line["line"] == "idle"]
    assert {line["team"] for line in teams} == {"search", "ads"}
    for field in TOKEN_FIELDS:
        assert sum(int(line[field]) for line in teams) == november_totals()[field]
    # Teams and idle lines add up to what the GPU-hour cost.
    assert sum(float(line["usd"]) for line in lines) == pytest.approx(2.50, abs=1e-5)
    assert [line["model"] for line in idle] == [month["version"].model_id]

    # The reports token opens reports and nothing else.
    assert client.get("/admin/teams").status_code == 403
    assert client.get("/admin/teams/search/keys").status_code == 403
    assert client.get("/admin/teams/search/limits").status_code == 403


def test_one_team_and_days(month: dict[str, Any], admin_client: APIClient) -> None:
    with time_machine.travel(NOW, tick=False):
        answer = admin_client.get(
            "/admin/reports/usage",
            {
                "from": "2026-11-01",
                "to": "2026-12-01T09:00:00Z",
                "group_by": "day",
                "team": "ads",
            },
        )
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert {r["team"] for r in body["data"]} == {"ads"}
    assert [r["period"] for r in body["data"]] == ["2026-11-10", "2026-12-01"]
    assert body["idle"] == []  # a team's report has its own lines only
    # December's tokens have no GPU history: they appear, at no cost.
    assert body["data"][1]["output_tokens"] == 7
    assert body["data"][1]["usd"] == 0


OCT = datetime(2026, 10, 5, 12, 0, tzinfo=UTC)
OCT_START = int(datetime(2026, 10, 5, tzinfo=UTC).timestamp())


@pytest.fixture
def two_regions(chat_v1: ModelVersion, settings: Any) -> Team:
    """October: one chat replica an hour in east (2.00 USD a GPU-hour) made half
    busy by search, and one in west (4.00 USD) kept full by search."""
    settings.PLATFORM_GPU_HOUR_USD_BY_REGION = {"east": 2.0, "west": 4.0}
    ModelVersion.objects.filter(pk=chat_v1.pk).update(load_test_tokens_per_s=2500.0)
    search = accounts_services.create_team(team_id="search", name="Search")
    for region, output in (("east", 4_500_000), ("west", 9_000_000)):
        with time_machine.travel(OCT, tick=False):
            replica = ReplicaFactory.create(
                version=chat_v1, state="serving", region=region
            )
        with time_machine.travel(OCT + timedelta(hours=1), tick=False):
            Replica.objects.filter(pk=replica.pk).update(state="gone")
        Usage.objects.create(
            team=search,
            model_id=chat_v1.model_id,
            version=chat_v1,
            region=region,
            minute=OCT + timedelta(minutes=1),
            requests=3,
            output_tokens=output,
        )
    return search


def test_each_region_is_priced_at_its_own_gpu_hour_price(
    two_regions: Team, admin_client: APIClient
) -> None:
    """East's half-used 2.00 USD bills 1.00, west's full 4.00 USD bills 4.00: 5.00.

    Priced as one version over both regions (6.00 USD for 18 million tokens of
    capacity, 13.5 million used) the same tokens would bill 4.50.
    """
    with time_machine.travel(NOW, tick=False):
        body = admin_client.get(
            "/admin/reports/usage", {"from": "2026-10", "to": "2026-10"}
        ).json()
        west = admin_client.get(
            "/admin/reports/usage",
            {"from": "2026-10", "to": "2026-10", "region": "west", "format": "csv"},
        )
    usd = {(r["team"], r["region"]): r["usd"] for r in body["data"]}
    assert usd == {("search", "east"): 1.0, ("search", "west"): 4.0}
    assert body["totals"]["usd"] == 5.0
    assert [(i["region"], i["usd"]) for i in body["idle"]] == [("east", 1.0)]
    assert body["totals"]["gpu_usd"] == 6.0
    assert {(p["region"], p["gpu_hour_usd"]) for p in body["pools"]} == {
        ("east", 2.0),
        ("west", 4.0),
    }
    assert {(v["region"], v["utilisation"]) for v in body["versions"]} == {
        ("east", 0.5),
        ("west", 1.0),
    }

    assert west.status_code == 200, west.content
    lines = list(csv.DictReader(io.StringIO(west.content.decode())))
    assert [(line["region"], line["output_tokens"], line["usd"]) for line in lines] == [
        ("west", "9000000", "4.0")
    ]


def test_a_team_filters_its_usage_and_cost_by_region(two_regions: Team) -> None:
    client = team_client("search")

    def get(path: str, **params: str) -> list[dict[str, Any]]:
        with time_machine.travel(NOW, tick=False):
            answer = client.get(
                f"/v1/organization/{path}",
                {"start_time": str(OCT_START), "limit": "1", **params},
            )
        assert answer.status_code == 200, answer.content
        return answer.json()["data"][0]["results"]

    def output(**params: str) -> int:
        (result,) = get("usage/completions", **params)
        return int(result["output_tokens"])

    def cost(**params: str) -> float:
        (result,) = get("costs", **params)
        return float(result["amount"]["value"])

    assert output() == 13_500_000
    assert output(regions="west") == 9_000_000
    assert output(regions="east,west") == 13_500_000
    assert get("usage/completions", regions="north") == []
    assert cost() == pytest.approx(5.0)
    assert cost(regions="east") == pytest.approx(1.0)
    assert cost(regions="west") == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ({"region": "East Coast"}, 400, "region"),
        ({"region": ""}, 400, "region"),
        ({"group_by": "week"}, 400, "group_by"),
        ({"from": "last tuesday"}, 400, "from"),
        ({"from": "2026-11", "to": "2026-10"}, 400, "to"),
        ({"from": "2000-01", "to": "2026-11", "group_by": "day"}, 400, "from"),
        ({"team": "Not A Slug!"}, 400, "team"),
        ({"team": "nobody"}, 404, "team"),
        ({"model": "nothing"}, 404, "model"),
        ({"format": "xml"}, 400, "format"),
        ({"to": "9999-12-31"}, 400, "to"),
        ({"from": "9001-12-01", "to": "9001-12-31T12:00"}, 400, "from"),
        ({"from": "0001-01-01T00:00+01:00", "to": "0001-02"}, 400, "from"),
        ({"from": "2026-13"}, 400, "from"),
        ({"from": ""}, 400, "from"),
    ],
)
def test_bad_queries_are_refused_in_the_error_shape(
    month: dict[str, Any],
    admin_client: APIClient,
    query: dict[str, str],
    status: int,
    param: str,
) -> None:
    answer = admin_client.get("/admin/reports/usage", query)
    assert answer.status_code == status, answer.content
    assert answer["Content-Type"].startswith("application/json")
    assert answer.json()["error"]["param"] == param


def test_who_may_read_reports(month: dict[str, Any]) -> None:
    assert APIClient().get("/admin/reports/usage").status_code == 401
    assert team_client("search").get("/admin/reports/usage").status_code == 403
    assert reports_client("admin").get("/admin/reports/usage").status_code == 200


# -- the console ------------------------------------------------------------------------


def finance_user() -> Client:
    user = User.objects.create_user("fin", password="pw-finance-1", is_staff=True)
    user.groups.add(Group.objects.get(name=FINANCE_GROUP))
    client = Client()
    client.force_login(user)
    return client


def test_finance_sees_reports_and_nothing_else(month: dict[str, Any]) -> None:
    client = finance_user()
    with time_machine.travel(NOW, tick=False):
        page = client.get("/console/reports/?from=2026-11&to=2026-11")
        download = client.get("/console/reports/usage.csv?from=2026-11&to=2026-11")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-team="search" data-month="2026-11"' in html
    assert 'id="download-csv"' in html
    assert download.status_code == 200
    assert 'filename="usage-2026-11.csv"' in download["Content-Disposition"]
    lines = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert (
        sum(int(r["output_tokens"] or 0) for r in lines)
        == november_totals()["output_tokens"]
    )
    assert sum(float(r["usd"]) for r in lines) == pytest.approx(2.50, abs=1e-5)
    for path in (
        "/console/accounts/apikey/",
        "/console/accounts/teamlimit/",
        "/console/accounts/team/",
        "/console/engine_nodes/replica/",
        "/console/accounts/admintoken/",
    ):
        assert client.get(path).status_code == 403, path
    assert client.get("/console/metering/usage/").status_code == 200


def test_the_console_page_shows_and_filters_regions(two_regions: Team) -> None:
    client = finance_user()
    with time_machine.travel(NOW, tick=False):
        every = client.get("/console/reports/?from=2026-10&to=2026-10").content
        west = client.get("/console/reports/?from=2026-10&to=2026-10&region=west")
    html = every.decode()
    for region in ("east", "west"):
        assert f'data-model="chat-7b" data-region="{region}"' in html
        assert f'<option value="{region}">{region}</option>' in html
    assert 'data-idle="chat-7b" data-month="2026-10" data-region="east"' in html
    assert west.status_code == 200
    assert 'data-region="east"' not in west.content.decode()
    assert '<option value="west" selected>west</option>' in west.content.decode()


def test_the_console_page_refuses_staff_without_the_permission(
    month: dict[str, Any],
) -> None:
    user = User.objects.create_user("ops", password="pw-ops-1", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get("/console/reports/").status_code == 403
    assert client.get("/console/reports/usage.csv").status_code == 403


def test_a_bad_console_query_shows_a_message(month: dict[str, Any]) -> None:
    client = finance_user()
    page = client.get("/console/reports/?from=yesterday")
    assert page.status_code == 200
    assert "from must be" in page.content.decode().lower()
    assert client.get("/console/reports/?to=9999-12-31").status_code == 200
    download = client.get("/console/reports/usage.csv?to=9999-12-31")
    assert download.status_code == 400


# -- a team's own usage ------------------------------------------------------------------


def team_client(team: str) -> APIClient:
    _, secret = accounts_services.issue_key(team_id=team)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_a_team_reads_its_usage_in_openai_shape(month: dict[str, Any]) -> None:
    start = int(datetime(2026, 11, 9, tzinfo=UTC).timestamp())
    with time_machine.travel(NOW, tick=False):
        answer = team_client("search").get(
            "/v1/organization/usage/completions",
            {"start_time": str(start), "limit": "3", "group_by": "model"},
        )
    assert answer.status_code == 200, answer.content
    page = answer.json()
    assert page["object"] == "page"
    assert [b["start_time"] for b in page["data"]] == [
        start + i * 86400 for i in range(3)
    ]
    assert page["has_more"] is True
    assert page["next_page"] == f"page_{start + 3 * 86400}"
    (result,) = page["data"][1]["results"]
    assert result["object"] == "organization.usage.completions.result"
    assert result["model"] == month["version"].model_id
    assert result["output_tokens"] == 3_000_000
    assert result["input_tokens"] == 1_000_000
    assert result["input_cached_tokens"] == 600_000
    assert result["num_model_requests"] == 15
    assert result["rate_limited_requests"] == 2
    assert page["data"][0]["results"] == []


def test_a_team_splits_batch_work_and_sees_no_other_team(month: dict[str, Any]) -> None:
    start = int(datetime(2026, 11, 10, tzinfo=UTC).timestamp())
    client = team_client("ads")
    with time_machine.travel(NOW, tick=False):
        page = client.get(
            "/v1/organization/usage/completions",
            {
                "start_time": str(start),
                "end_time": str(start + 86400),
                "group_by": "batch",
            },
        ).json()
        costs = client.get(
            "/v1/organization/costs",
            {
                "start_time": str(start),
                "end_time": str(start + 86400),
                "group_by": "line_item",
            },
        ).json()
    results = page["data"][0]["results"]
    assert {r["batch"]: r["output_tokens"] for r in results} == {
        False: 0,
        True: 1_500_000,
    }
    (cost,) = costs["data"][0]["results"]
    assert cost["line_item"] == month["version"].model_id
    report = usage_report(
        report_query(
            {
                "from": "2026-11-10",
                "to": "2026-11-10",
                "group_by": "day",
                "team": "ads",
            },
            now=NOW,
        ),
        now=NOW,
    )
    assert cost["amount"] == {
        "value": pytest.approx(report.rows[0]["usd"]),
        "currency": "usd",
    }


@pytest.mark.parametrize(
    ("path", "query", "param"),
    [
        ("usage/completions", {}, "start_time"),
        ("usage/completions", {"start_time": "soon"}, "start_time"),
        ("usage/completions", {"start_time": 0, "bucket_width": "1w"}, "bucket_width"),
        ("usage/completions", {"start_time": 0, "limit": 99}, "limit"),
        ("usage/completions", {"start_time": 0, "group_by": "api_key_id"}, "group_by"),
        ("usage/completions", {"start_time": 9, "end_time": 5}, "end_time"),
        ("usage/completions", {"start_time": 0, "page": "x"}, "page"),
        ("costs", {"start_time": 0, "bucket_width": "1h"}, "bucket_width"),
        ("usage/completions", {"start_time": 0, "page": "page_\u00b2"}, "page"),
        ("usage/completions", {"start_time": 0, "page": "page_99999999999999"}, "page"),
        ("usage/completions", {"start_time": 253402300000}, "start_time"),
        ("costs", {"start_time": 253402300000}, "start_time"),
        ("usage/completions", {"start_time": 0, "regions": "East!"}, "regions"),
        ("costs", {"start_time": 0, "regions": "-west"}, "regions"),
    ],
)
def test_bad_usage_queries(
    month: dict[str, Any], path: str, query: dict[str, Any], param: str
) -> None:
    answer = team_client("ads").get(f"/v1/organization/{path}", query)
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["param"] == param


def test_usage_needs_a_team_key(month: dict[str, Any], admin_client: APIClient) -> None:
    assert APIClient().get("/v1/organization/costs?start_time=0").status_code == 401
    assert admin_client.get("/v1/organization/costs?start_time=0").status_code == 401
