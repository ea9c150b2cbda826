"""Tests for the strict environment readers and ``parse_database_url``."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.env import (
    EnvError,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_networks,
    env_secret,
    env_str,
    parse_database_url,
)

BASE_DIR = Path("/srv/platform")


# env_str ---------------------------------------------------------------------


def test_env_str_returns_value_when_set() -> None:
    assert (
        env_str("PLATFORM_REGION", "local", environ={"PLATFORM_REGION": "eu"}) == "eu"
    )


def test_env_str_strips_surrounding_whitespace() -> None:
    environ = {"PLATFORM_REGION": "  eu-west \n"}
    assert env_str("PLATFORM_REGION", "local", environ=environ) == "eu-west"


@pytest.mark.parametrize(
    "environ", [{}, {"PLATFORM_REGION": ""}, {"PLATFORM_REGION": " "}]
)
def test_env_str_falls_back_to_default_when_unset_or_blank(
    environ: dict[str, str],
) -> None:
    assert env_str("PLATFORM_REGION", "local", environ=environ) == "local"


# env_int ---------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [("30", 30), (" 7 ", 7), ("-4", -4)])
def test_env_int_parses_integers(raw: str, expected: int) -> None:
    assert env_int("PLATFORM_X", 1, environ={"PLATFORM_X": raw}) == expected


@pytest.mark.parametrize("environ", [{}, {"PLATFORM_X": ""}, {"PLATFORM_X": "   "}])
def test_env_int_falls_back_to_default_when_unset_or_blank(
    environ: dict[str, str],
) -> None:
    assert env_int("PLATFORM_X", 30, environ=environ) == 30


@pytest.mark.parametrize("raw", ["3.0", "ten", "0x10", "1e3", "12abc"])
def test_env_int_rejects_non_integers_naming_the_variable(raw: str) -> None:
    with pytest.raises(EnvError, match="PLATFORM_X must be an integer"):
        env_int("PLATFORM_X", 1, environ={"PLATFORM_X": raw})


def test_env_int_accepts_value_equal_to_minimum() -> None:
    assert env_int("PLATFORM_X", 5, environ={"PLATFORM_X": "1"}, minimum=1) == 1


def test_env_int_rejects_value_below_minimum() -> None:
    with pytest.raises(EnvError, match="PLATFORM_X must be at least 1, got 0"):
        env_int("PLATFORM_X", 5, environ={"PLATFORM_X": "0"}, minimum=1)


def test_env_int_does_not_check_minimum_against_default() -> None:
    # The default is the programmer's choice; only operator input is validated.
    assert env_int("PLATFORM_X", 0, environ={}, minimum=1) == 0


def test_env_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        env_int("PLATFORM_X", 1, environ={"PLATFORM_X": "x"})


# env_float -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"), [("2.50", 2.5), ("1", 1.0), ("1e-3", 0.001), (" -0.5 ", -0.5)]
)
def test_env_float_parses_numbers(raw: str, expected: float) -> None:
    assert env_float("PLATFORM_F", 0.0, environ={"PLATFORM_F": raw}) == expected


def test_env_float_falls_back_to_default_when_unset() -> None:
    assert env_float("PLATFORM_F", 2.5, environ={}) == 2.5


@pytest.mark.parametrize("raw", ["cheap", "1,5", "2.5usd"])
def test_env_float_rejects_non_numbers(raw: str) -> None:
    with pytest.raises(EnvError, match="PLATFORM_F must be a number"):
        env_float("PLATFORM_F", 0.0, environ={"PLATFORM_F": raw})


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_env_float_rejects_non_finite_values(raw: str) -> None:
    with pytest.raises(EnvError, match="PLATFORM_F must be a finite number"):
        env_float("PLATFORM_F", 0.0, environ={"PLATFORM_F": raw})


def test_env_float_accepts_value_equal_to_minimum() -> None:
    environ = {"PLATFORM_F": "0.05"}
    assert env_float("PLATFORM_F", 1.0, environ=environ, minimum=0.05) == 0.05


def test_env_float_rejects_value_below_minimum() -> None:
    with pytest.raises(EnvError, match=r"PLATFORM_F must be at least 0\.05"):
        env_float("PLATFORM_F", 1.0, environ={"PLATFORM_F": "0.01"}, minimum=0.05)


# env_bool --------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "True", "yes", "on", " On "])
def test_env_bool_reads_true_spellings(raw: str) -> None:
    assert env_bool("PLATFORM_B", False, environ={"PLATFORM_B": raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "no", "off", " Off "])
def test_env_bool_reads_false_spellings(raw: str) -> None:
    assert env_bool("PLATFORM_B", True, environ={"PLATFORM_B": raw}) is False


@pytest.mark.parametrize("default", [True, False])
def test_env_bool_falls_back_to_default_when_unset_or_blank(default: bool) -> None:
    assert env_bool("PLATFORM_B", default, environ={}) is default
    assert env_bool("PLATFORM_B", default, environ={"PLATFORM_B": " "}) is default


@pytest.mark.parametrize("raw", ["maybe", "y", "n", "2", "enabled", "t"])
def test_env_bool_rejects_unknown_spellings(raw: str) -> None:
    with pytest.raises(EnvError, match="PLATFORM_B must be one of") as excinfo:
        env_bool("PLATFORM_B", False, environ={"PLATFORM_B": raw})
    assert repr(raw) in str(excinfo.value)


# env_networks ------------------------------------------------------------------


def test_env_networks_reads_cidrs_and_bare_addresses_in_normal_form() -> None:
    environ = {"PLATFORM_N": "10.0.0.0/8, 192.0.2.7, 2001:DB8::/32, 10.1.2.3/16"}
    assert env_networks("PLATFORM_N", [], environ=environ) == [
        "10.0.0.0/8",
        "192.0.2.7/32",
        "2001:db8::/32",
        "10.1.0.0/16",
    ]


def test_env_networks_refuses_what_is_no_network() -> None:
    with pytest.raises(EnvError, match="PLATFORM_N"):
        env_networks("PLATFORM_N", [], environ={"PLATFORM_N": "10.0.0.0/8,proxy"})


# env_list --------------------------------------------------------------------


def test_env_list_splits_on_commas_and_strips_items() -> None:
    environ = {"PLATFORM_L": " s3://a/ ,gs://b/,  file:///c/ "}
    assert env_list("PLATFORM_L", [], environ=environ) == [
        "s3://a/",
        "gs://b/",
        "file:///c/",
    ]


def test_env_list_drops_empty_items() -> None:
    environ = {"PLATFORM_L": "a,,b, ,c,"}
    assert env_list("PLATFORM_L", [], environ=environ) == ["a", "b", "c"]


def test_env_list_reads_single_item() -> None:
    assert env_list("PLATFORM_L", ["x"], environ={"PLATFORM_L": "only"}) == ["only"]


def test_env_list_falls_back_to_default_when_unset() -> None:
    assert env_list("PLATFORM_L", ["a", "b"], environ={}) == ["a", "b"]


def test_env_list_returns_a_copy_of_the_default() -> None:
    default = ["a"]
    result = env_list("PLATFORM_L", default, environ={})
    result.append("b")
    assert default == ["a"]


# env_secret ------------------------------------------------------------------


def test_env_secret_returns_direct_value() -> None:
    assert env_secret("SECRET_KEY", environ={"SECRET_KEY": " s3cret "}) == "s3cret"


def test_env_secret_returns_none_when_neither_is_set() -> None:
    assert env_secret("SECRET_KEY", environ={}) is None


def test_env_secret_reads_file_named_by_name_file(tmp_path: Path) -> None:
    path = tmp_path / "secret_key"
    path.write_text("from-file\n")
    environ = {"SECRET_KEY_FILE": str(path)}
    assert env_secret("SECRET_KEY", environ=environ) == "from-file"


def test_env_secret_rejects_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    environ = {"SECRET_KEY_FILE": str(missing)}
    with pytest.raises(EnvError, match=r"SECRET_KEY_FILE=.*cannot be read"):
        env_secret("SECRET_KEY", environ=environ)


def test_env_secret_rejects_directory_as_file(tmp_path: Path) -> None:
    environ = {"SECRET_KEY_FILE": str(tmp_path)}
    with pytest.raises(EnvError, match="cannot be read"):
        env_secret("SECRET_KEY", environ=environ)


@pytest.mark.parametrize("content", ["", "\n", "   \n\t"])
def test_env_secret_rejects_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "secret_key"
    path.write_text(content)
    environ = {"SECRET_KEY_FILE": str(path)}
    with pytest.raises(EnvError, match=r"SECRET_KEY_FILE=.* is empty"):
        env_secret("SECRET_KEY", environ=environ)


def test_env_secret_rejects_both_value_and_file(tmp_path: Path) -> None:
    path = tmp_path / "secret_key"
    path.write_text("from-file")
    environ = {"SECRET_KEY": "direct", "SECRET_KEY_FILE": str(path)}
    with pytest.raises(EnvError, match="set SECRET_KEY or SECRET_KEY_FILE, not both"):
        env_secret("SECRET_KEY", environ=environ)


def test_env_secret_treats_blank_direct_value_as_unset(tmp_path: Path) -> None:
    path = tmp_path / "secret_key"
    path.write_text("from-file")
    environ = {"SECRET_KEY": "  ", "SECRET_KEY_FILE": str(path)}
    assert env_secret("SECRET_KEY", environ=environ) == "from-file"


# parse_database_url: SQLite --------------------------------------------------


def test_parse_database_url_sqlite_relative_path_is_under_base_dir() -> None:
    config = parse_database_url("sqlite:///db.sqlite3", base_dir=BASE_DIR)
    assert config == {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(BASE_DIR / "db.sqlite3"),
    }


def test_parse_database_url_sqlite_relative_nested_path() -> None:
    config = parse_database_url("sqlite:///.local/db.sqlite3", base_dir=BASE_DIR)
    assert config["NAME"] == str(BASE_DIR / ".local" / "db.sqlite3")


def test_parse_database_url_sqlite_absolute_path_is_kept() -> None:
    config = parse_database_url(
        "sqlite:////var/lib/platform/db.sqlite3", base_dir=BASE_DIR
    )
    assert config == {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": "/var/lib/platform/db.sqlite3",
    }


def test_parse_database_url_sqlite_memory() -> None:
    config = parse_database_url("sqlite:///:memory:", base_dir=BASE_DIR)
    assert config == {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}


def test_parse_database_url_sqlite_rejects_host_part() -> None:
    with pytest.raises(EnvError, match=r"sqlite:///relative/path"):
        parse_database_url("sqlite://db.sqlite3", base_dir=BASE_DIR)


def test_parse_database_url_sqlite_requires_a_file_name() -> None:
    with pytest.raises(EnvError, match="SQLite must name a file"):
        parse_database_url("sqlite:///", base_dir=BASE_DIR)


# parse_database_url: PostgreSQL ----------------------------------------------


def test_parse_database_url_postgres_full_url() -> None:
    url = "postgresql://platform:pw@db.internal:6432/control?sslmode=require"
    assert parse_database_url(url, base_dir=BASE_DIR) == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "control",
        "USER": "platform",
        "PASSWORD": "pw",
        "HOST": "db.internal",
        "PORT": "6432",
        "OPTIONS": {"sslmode": "require"},
    }


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "pgsql", "PostgreSQL"])
def test_parse_database_url_postgres_scheme_spellings(scheme: str) -> None:
    config = parse_database_url(f"{scheme}://u@h/db", base_dir=BASE_DIR)
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert config["NAME"] == "db"


def test_parse_database_url_postgres_without_credentials_or_port() -> None:
    config = parse_database_url("postgresql://localhost/control", base_dir=BASE_DIR)
    assert config["USER"] == ""
    assert config["PASSWORD"] == ""
    assert config["HOST"] == "localhost"
    assert config["PORT"] == ""
    assert config["OPTIONS"] == {}


def test_parse_database_url_postgres_decodes_percent_encoded_password() -> None:
    url = "postgresql://platform:p%40ss%3Aw%2Frd%23@db:5432/control"
    config = parse_database_url(url, base_dir=BASE_DIR)
    assert config["PASSWORD"] == "p@ss:w/rd#"
    assert config["HOST"] == "db"


def test_parse_database_url_postgres_decodes_percent_encoded_user() -> None:
    config = parse_database_url(
        "postgresql://team%2Bops:pw@db/control", base_dir=BASE_DIR
    )
    assert config["USER"] == "team+ops"


def test_parse_database_url_postgres_query_becomes_options() -> None:
    url = "postgres://u:p@h/db?sslmode=verify-full&connect_timeout=5"
    config = parse_database_url(url, base_dir=BASE_DIR)
    assert config["OPTIONS"] == {"sslmode": "verify-full", "connect_timeout": "5"}


@pytest.mark.parametrize("url", ["postgresql://u:p@h:5432/", "postgresql://u:p@h:5432"])
def test_parse_database_url_postgres_requires_database_name(url: str) -> None:
    with pytest.raises(EnvError, match="PostgreSQL must name a database"):
        parse_database_url(url, base_dir=BASE_DIR)


@pytest.mark.parametrize(
    "url", ["postgresql://u:p@h:abc/db", "postgresql://u:p@h:99999/db"]
)
def test_parse_database_url_postgres_rejects_bad_port_with_env_error(url: str) -> None:
    # settings.py only turns EnvError into ImproperlyConfigured; a bare ValueError
    # from urllib would escape with a message that does not name DATABASE_URL.
    with pytest.raises(EnvError, match="DATABASE_URL"):
        parse_database_url(url, base_dir=BASE_DIR)


@pytest.mark.parametrize(
    "url", ["mysql://u:p@h/db", "redis://localhost:6379/0", "db.sqlite3", ""]
)
def test_parse_database_url_rejects_unsupported_scheme(url: str) -> None:
    with pytest.raises(EnvError, match="is not supported"):
        parse_database_url(url, base_dir=BASE_DIR)
