"""Console roles from an identity provider's claims (``console.domain.sso_roles``)."""

from __future__ import annotations

from console.domain.sso_roles import ConsoleRoles, RoleMapping, roles_from_claims

MAPPING = RoleMapping(
    groups_claim="groups",
    admin_groups=frozenset({"platform-admins"}),
    finance_groups=frozenset({"finance", "controllers"}),
    team_viewer_prefix="team-viewer:",
)


def test_roles_from_claims_maps_each_role() -> None:
    claims = {"groups": ["controllers", "team-viewer:alpha", "team-viewer:beta", "x"]}

    assert roles_from_claims(claims, MAPPING) == ConsoleRoles(
        is_admin=False, is_finance=True, viewer_of=frozenset({"alpha", "beta"})
    )


def test_roles_from_claims_gives_none_for_unknown_groups() -> None:
    roles = roles_from_claims({"groups": ["engineering", "team-viewer:"]}, MAPPING)

    assert roles == ConsoleRoles(
        is_admin=False, is_finance=False, viewer_of=frozenset()
    )
    assert not roles.has_any


def test_roles_from_claims_reads_a_lone_string_and_ignores_other_shapes() -> None:
    assert roles_from_claims({"groups": "platform-admins"}, MAPPING).is_admin
    assert not roles_from_claims({"groups": {"platform-admins": 1}}, MAPPING).has_any
    assert not roles_from_claims({"groups": [1, None]}, MAPPING).has_any
    assert not roles_from_claims({}, MAPPING).has_any


def test_roles_from_claims_reads_the_configured_claim_and_prefix() -> None:
    mapping = RoleMapping(
        groups_claim="roles",
        admin_groups=frozenset(),
        finance_groups=frozenset(),
        team_viewer_prefix="",
    )
    claims = {"roles": ["team-viewer:alpha"], "groups": ["platform-admins"]}

    assert not roles_from_claims(claims, mapping).has_any
