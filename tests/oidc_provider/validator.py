"""The test provider's token rules: groups in the ID token, and tokens spoiled on
purpose for the refusal tests.

``ProviderValidator`` puts the user's Django groups (in the provider's database)
into the ``groups`` claim, which the platform maps to console roles. When the
file ``$OIDC_PROVIDER_DIR/tamper`` names a defect, the next ID tokens carry it,
still signed by the provider (except ``signature``, signed by a key it never
published): ``expired``, ``audience`` (another client's), ``nonce`` (not the
one the client sent), ``issuer`` (another issuer), ``signature``, and
``audience-for-us`` (another client's audience, our client id as ``azp``: Authlib's
defaults alone accept it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from jwcrypto import jwk, jwt
from oauth2_provider.oauth2_validators import OAuth2Validator


def _tamper_mode() -> str:
    # The provider's own settings (tests.oidc_provider.settings), not the platform's.
    path = Path(getattr(settings, "DATA_DIR")) / "tamper"  # noqa: B009
    return path.read_text().strip() if path.exists() else ""


class ProviderValidator(OAuth2Validator):
    """DOT's validator with a groups claim and test-only defects."""

    # Every claim below goes into the ID token, whatever the scopes.
    oidc_claim_scope = None

    def get_additional_claims(self, request: Any) -> dict[str, Any]:
        user = request.user
        return {
            "groups": sorted(user.groups.values_list("name", flat=True)),
            "email": user.email,
            "preferred_username": user.username,
            "given_name": user.first_name,
            "family_name": user.last_name,
        }

    def finalize_id_token(
        self, id_token: Any, token: Any, token_handler: Any, request: Any
    ) -> str:
        signed: str = super().finalize_id_token(id_token, token, token_handler, request)
        mode = _tamper_mode()
        if not mode:
            return signed
        key = request.client.jwk_key
        parsed = jwt.JWT(jwt=signed, key=key)
        header = json.loads(parsed.header)
        claims = json.loads(parsed.claims)
        now = int(time.time())
        if mode == "expired":
            claims.update(iat=now - 7200, exp=now - 3600, auth_time=now - 7200)
        elif mode == "audience":
            claims["aud"] = "another-client"
        elif mode == "audience-for-us":
            # Issued to another client "for" us (azp): still not our token.
            claims["azp"] = claims["aud"]
            claims["aud"] = ["another-client"]
        elif mode == "nonce":
            claims["nonce"] = "not-the-nonce-the-client-sent"
        elif mode == "issuer":
            claims["iss"] = "http://issuer.invalid/o"
        elif mode == "signature":
            # The same key id, another key: only the signature tells them apart.
            key = jwk.JWK.generate(kty="RSA", size=2048)
        else:
            raise ValueError(f"unknown tamper mode {mode!r}")
        spoiled = jwt.JWT(header=json.dumps(header), claims=json.dumps(claims))
        spoiled.make_signed_token(key)
        return str(spoiled.serialize())
