"""Single sign-on for the console against a real OIDC provider in its own process.

The provider is django-oauth-toolkit's (``tests.oidc_provider``), started once for
the module; the platform is this test process's Django, driven by the test client,
and finds the provider by discovery. The provider's side of the browser (its login
form, the authorization redirect) is played with httpx.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from accounts import services as accounts_services
from console.team_viewers import team_viewer_group
from localrun.processes import free_port
from metering.roles import FINANCE_GROUP
from tests.oidc_provider.process import OidcProvider, ProviderUser, run_provider

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as ConsoleResponse
    from pytest_django import Settings

CALLBACK = "http://testserver/console/sso/callback/"
ADMIN = ProviderUser("ada", "ada-Pa55", ("platform-admins", "staff"), "ada@example.com")
FINANCE = ProviderUser("fin", "fin-Pa55", ("finance",), "fin@example.com")
VIEWER = ProviderUser("vic", "vic-Pa55", ("team-viewer:alpha", "engineering"))
NOBODY = ProviderUser("nob", "nob-Pa55", ("engineering",))


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    with run_provider(
        tmp_path_factory.mktemp("sso"),
        users=[ADMIN, FINANCE, VIEWER, NOBODY],
        redirect_uris=[CALLBACK],
    ) as running:
        yield running


@pytest.fixture
def sso(provider: OidcProvider, settings: Settings) -> Iterator[OidcProvider]:
    """Point the console at the provider, with good tokens."""
    for name, value in provider.platform_env().items():
        setattr(settings, name, value)
    provider.tamper("")
    try:
        yield provider
    finally:
        provider.tamper("")


@pytest.fixture
def teams(db: None) -> dict[str, str]:
    """Teams alpha and beta with one key each; return each key's prefix."""
    prefixes = {}
    for team in ("alpha", "beta"):
        accounts_services.create_team(team_id=team)
        key, _ = accounts_services.issue_key(team_id=team, name=f"{team} key")
        prefixes[team] = key.prefix
    return prefixes


def provider_authorizes(authorize_url: str, user: ProviderUser) -> str:
    """Play the browser at the provider: log ``user`` in, return where the
    provider sends the browser back to (the platform's callback with a code)."""
    with httpx.Client(follow_redirects=False, timeout=10) as browser:
        to_login = browser.get(authorize_url)
        assert to_login.status_code == 302, to_login.text
        login_url = urljoin(authorize_url, to_login.headers["location"])
        form = browser.get(login_url)
        assert form.status_code == 200
        next_path = parse_qs(urlsplit(login_url).query)["next"][0]
        logged_in = browser.post(
            login_url,
            data={
                "username": user.username,
                "password": user.password,
                "next": next_path,
                "csrfmiddlewaretoken": browser.cookies["provider_csrftoken"],
            },
        )
        assert logged_in.status_code == 302, logged_in.text
        back = browser.get(urljoin(login_url, logged_in.headers["location"]))
        assert back.status_code == 302, back.text
        return str(back.headers["location"])


def sso_log_in(
    client: Client, user: ProviderUser, *, next_path: str = "/console/"
) -> ConsoleResponse:
    """Log ``user`` in through the provider; return the callback's answer."""
    start = client.get("/console/sso/login/", {"next": next_path})
    assert start.status_code == 302
    callback = provider_authorizes(start["Location"], user)
    assert callback.startswith(CALLBACK), callback
    return client.get(callback.removeprefix("http://testserver"))


def is_logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.django_db
def test_sso_finance_reads_reports_and_nothing_else(
    sso: OidcProvider, teams: dict[str, str], client: Client
) -> None:
    answer = sso_log_in(client, FINANCE, next_path="/console/reports/")

    assert answer.status_code == 302
    assert answer["Location"] == "/console/reports/"
    user = get_user_model().objects.get(email=FINANCE.email)
    assert user.username.startswith("sso:")
    assert user.is_staff and not user.is_superuser
    assert not user.has_usable_password()
    assert set(user.groups.values_list("name", flat=True)) == {FINANCE_GROUP}
    assert client.get("/console/reports/").status_code == 200
    assert client.get("/console/metering/usage/").status_code == 200
    for path in (
        "/console/accounts/apikey/",
        "/console/accounts/teamlimit/",
        "/console/teams/",
        "/console/teams/alpha/",
        "/console/rollouts/",
        "/console/auth/user/",
    ):
        assert client.get(path).status_code == 403, path


@pytest.mark.django_db
def test_sso_team_viewer_sees_its_team_and_keys_only(
    sso: OidcProvider, teams: dict[str, str], client: Client
) -> None:
    sso_log_in(client, VIEWER)

    assert is_logged_in(client)
    own = client.get("/console/teams/alpha/")
    assert own.status_code == 200
    page = own.content.decode()
    assert f'data-key-prefix="{teams["alpha"]}"' in page
    assert teams["beta"] not in page
    listing = client.get("/console/teams/").content.decode()
    assert 'data-team="alpha"' in listing
    assert 'data-team="beta"' not in listing
    # Another team, existing or not, answers the same: nothing of it shows.
    assert client.get("/console/teams/beta/").status_code == 403
    assert client.get("/console/teams/no-such-team/").status_code == 403
    for path in (
        "/console/accounts/apikey/",
        "/console/accounts/team/",
        "/console/reports/",
        "/console/metering/usage/",
        "/console/fleet/pools/chat-7b/v1/east/",
    ):
        assert client.get(path).status_code == 403, path


@pytest.mark.django_db
def test_sso_platform_admin_is_a_superuser(
    sso: OidcProvider, teams: dict[str, str], client: Client
) -> None:
    sso_log_in(client, ADMIN)

    user = get_user_model().objects.get(email=ADMIN.email)
    assert user.is_superuser and user.is_staff
    assert client.get("/console/accounts/apikey/").status_code == 200
    assert client.get("/console/teams/beta/").status_code == 200


@pytest.mark.django_db
def test_sso_refuses_a_user_the_claims_give_no_role(
    sso: OidcProvider, client: Client
) -> None:
    answer = sso_log_in(client, NOBODY)

    assert answer["Location"] == "/console/login/"
    assert not is_logged_in(client)
    assert not get_user_model().objects.filter(username__startswith="sso:").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("defect", "why"),
    [
        ("signature", "bad_signature"),
        ("expired", "expired_token"),
        ("audience", "'aud'"),
        ("audience-for-us", "'aud'"),
        ("nonce", "'nonce'"),
        ("issuer", "'iss'"),
    ],
)
def test_sso_refuses_a_defective_id_token(
    sso: OidcProvider,
    client: Client,
    caplog: pytest.LogCaptureFixture,
    defect: str,
    why: str,
) -> None:
    """GIVEN a provider that signs (or forges) ID tokens with ``defect``,
    WHEN a finance user logs in through it,
    THEN the console refuses the login and makes no user."""
    sso.tamper(defect)

    answer = sso_log_in(client, FINANCE)

    assert answer.status_code == 302
    assert answer["Location"] == "/console/login/"
    assert not is_logged_in(client)
    assert not get_user_model().objects.filter(username__startswith="sso:").exists()
    assert client.get("/console/reports/").status_code == 302  # to the login
    refusals = [r.getMessage() for r in caplog.records if r.name == "console.sso"]
    assert len(refusals) == 1 and why in refusals[0], refusals


@pytest.mark.django_db
def test_sso_refuses_a_replayed_callback(sso: OidcProvider, client: Client) -> None:
    start = client.get("/console/sso/login/")
    callback = provider_authorizes(start["Location"], FINANCE)
    path = callback.removeprefix("http://testserver")
    assert client.get(path)["Location"] == "/console/"
    client.logout()

    again = Client().get(path)  # another browser with the same code and state

    assert again["Location"] == "/console/login/"
    assert "_auth_user_id" not in again.client.session


@pytest.mark.django_db
def test_sso_roles_follow_the_claims_at_each_login(
    sso: OidcProvider, client: Client
) -> None:
    """A role the provider no longer gives is taken away; a group given by hand
    that is no role stays."""
    sso_log_in(client, VIEWER)
    user = get_user_model().objects.get(username__startswith="sso:")
    stale = [FINANCE_GROUP, team_viewer_group("beta"), "on-call"]
    user.groups.add(*(Group.objects.get_or_create(name=g)[0] for g in stale))
    user.is_superuser = True
    user.save()
    client.logout()

    sso_log_in(client, VIEWER)

    user.refresh_from_db()
    assert not user.is_superuser
    assert set(user.groups.values_list("name", flat=True)) == {
        team_viewer_group("alpha"),
        "on-call",
    }


@pytest.mark.django_db
def test_login_page_offers_sso_and_password_login_can_be_turned_off(
    sso: OidcProvider, settings: Settings, client: Client
) -> None:
    get_user_model().objects.create_superuser("root", password="root-Pa55-word")
    page = client.get("/console/login/?next=/console/").content.decode()
    assert 'id="sso-login-link"' in page
    assert 'id="login-form"' in page

    settings.PLATFORM_CONSOLE_PASSWORD_LOGIN = False
    settings.AUTHENTICATION_BACKENDS = [
        "console.sso.SsoBackend",
        "console.team_viewers.TeamViewerBackend",
    ]

    page = client.get("/console/login/?next=/console/").content.decode()
    assert 'id="sso-login-link"' in page
    assert 'id="login-form"' not in page
    posted = client.post(
        "/console/login/?next=/console/",
        {"username": "root", "password": "root-Pa55-word"},
    )
    assert posted.status_code == 200  # the form again, refused
    assert "Password login is turned off" in posted.content.decode()
    assert not is_logged_in(client)


@pytest.mark.django_db
def test_password_sessions_end_when_password_login_is_turned_off(
    settings: Settings, client: Client
) -> None:
    get_user_model().objects.create_superuser("root", password="root-Pa55-word")
    assert client.login(username="root", password="root-Pa55-word")
    assert client.get("/console/accounts/apikey/").status_code == 200

    settings.AUTHENTICATION_BACKENDS = ["console.sso.SsoBackend"]

    assert client.get("/console/accounts/apikey/").status_code == 302


@pytest.mark.django_db
def test_sso_login_says_so_when_the_provider_is_unreachable(
    settings: Settings, client: Client
) -> None:
    settings.PLATFORM_OIDC_DISCOVERY_URL = (
        f"http://127.0.0.1:{free_port()}/.well-known/openid-configuration"
    )
    settings.PLATFORM_OIDC_CLIENT_ID = "platform-console"

    answer = client.get("/console/sso/login/", follow=True)

    assert answer.redirect_chain[-1][0].startswith("/console/login/")
    assert "Single sign-on is unavailable" in answer.content.decode()


def test_sso_pages_are_404_without_a_provider(client: Client) -> None:
    assert client.get("/console/sso/login/").status_code == 404
    assert client.get("/console/sso/callback/?code=x&state=y").status_code == 404


@pytest.mark.django_db
def test_sso_goes_back_only_to_the_console_itself(
    sso: OidcProvider, client: Client
) -> None:
    answer = sso_log_in(client, FINANCE, next_path="https://evil.example/console/")

    assert answer["Location"] == "/console/"
