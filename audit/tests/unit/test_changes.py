"""The diff between two snapshots: created, updated, deleted; secrets left out."""

from __future__ import annotations

from audit.domain.changes import Change, diff_rows, redact

KEY = ("accounts.apikey", "7")


def test_diff_rows_names_a_created_row_with_its_fields() -> None:
    after = {KEY: {"id": 7, "prefix": "sk-ab", "key_hash": "f" * 64}}
    assert diff_rows({}, after) == [
        Change(
            object_type="accounts.apikey",
            object_id="7",
            action="create",
            before=None,
            after={"id": 7, "prefix": "sk-ab"},
            changed_fields=("id", "prefix"),
        )
    ]


def test_diff_rows_names_a_deleted_row_with_what_it_was() -> None:
    (change,) = diff_rows({KEY: {"id": 7, "name": "ci"}}, {})
    assert (change.action, change.before, change.after) == (
        "delete",
        {"id": 7, "name": "ci"},
        None,
    )


def test_diff_rows_lists_only_the_fields_that_changed() -> None:
    before = {KEY: {"id": 7, "revoked_at": None, "name": "ci"}}
    after = {KEY: {"id": 7, "revoked_at": "2026-12-06T09:00:00Z", "name": "ci"}}
    (change,) = diff_rows(before, after)
    assert change.action == "update"
    assert change.changed_fields == ("revoked_at",)
    assert change.before == before[KEY]
    assert change.after == after[KEY]


def test_diff_rows_skips_rows_that_did_not_change() -> None:
    rows = {KEY: {"id": 7, "name": "ci"}}
    assert diff_rows(rows, dict(rows)) == []


def test_diff_rows_skips_a_change_of_platform_written_fields_alone() -> None:
    before = {KEY: {"id": 7, "last_used_at": None, "updated_at": "a"}}
    after = {KEY: {"id": 7, "last_used_at": "b", "updated_at": "c"}}
    assert diff_rows(before, after) == []


def test_diff_rows_names_a_changed_secret_without_its_values() -> None:
    before = {KEY: {"id": 7, "key_hash": "a" * 64}}
    after = {KEY: {"id": 7, "key_hash": "b" * 64}}
    assert diff_rows(before, after) == [
        Change(
            object_type="accounts.apikey",
            object_id="7",
            action="update",
            before={"id": 7},
            after={"id": 7},
            changed_fields=("key_hash",),
        )
    ]


def test_diff_rows_skips_a_secret_that_did_not_change() -> None:
    before = {KEY: {"id": 7, "password": "x", "last_login": None}}
    after = {KEY: {"id": 7, "password": "x", "last_login": "t"}}
    assert diff_rows(before, after) == []


def test_diff_rows_orders_changes_by_type_and_id() -> None:
    after = {("b.x", "2"): {"id": 2}, ("a.y", "9"): {"id": 9}, ("b.x", "1"): {}}
    assert [(c.object_type, c.object_id) for c in diff_rows({}, after)] == [
        ("a.y", "9"),
        ("b.x", "1"),
        ("b.x", "2"),
    ]


def test_redact_leaves_secret_fields_out() -> None:
    assert redact({"password": "pbkdf2$...", "username": "op"}) == {"username": "op"}
