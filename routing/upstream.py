"""The gateway's HTTP client to its engine replicas.

Public surface: ``Upstream``.

One aiohttp ``ClientSession`` per gateway process, opened at start and closed at
stop, with no connection limit (every stream holds one connection) and a connect
timeout (a replica that does not accept in time is failed over before the first
token). The engine API key, when one is set, is sent with every request; an
engine that refuses it is the platform's failure, not the client's.
"""

from __future__ import annotations

import aiohttp

__all__ = ["Upstream"]


class Upstream:
    """POST chat completions to replicas over one pooled session."""

    def __init__(self, *, connect_timeout_s: float, engine_api_key: str = "") -> None:
        self.connect_timeout_s = connect_timeout_s
        self.headers = {"content-type": "application/json"}
        if engine_api_key:
            self.headers["authorization"] = f"Bearer {engine_api_key}"
        self._session: aiohttp.ClientSession | None = None

    @property
    def is_open(self) -> bool:
        """True between ``open`` and ``close``."""
        return self._session is not None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Return the open session.

        Raises:
            RuntimeError: the upstream is not open.
        """
        if self._session is None:
            raise RuntimeError("the upstream session is not open")
        return self._session

    async def open(self) -> None:
        """Open the session (on the running event loop); a no-op when open."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=4.0, enable_cleanup_closed=True
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s),
            auto_decompress=False,
        )

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def chat(self, base_url: str, payload: bytes) -> aiohttp.ClientResponse:
        """POST ``payload`` to a replica's ``/v1/chat/completions``; return the
        response once its headers arrived (the body streams from ``.content``)."""
        return await self.session.post(
            f"{base_url}/v1/chat/completions", data=payload, headers=self.headers
        )
