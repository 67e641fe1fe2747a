"""Optional API keys (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients
send it) and the per-key concurrency limit.

Keys come from `--api-keys` (comma-separated) and/or `--api-key-file` (one per line). Only
their SHA-256 digests are kept, and a presented key is compared with every one of them by
`hmac.compare_digest`, without stopping at a match, so neither the keys' contents nor which
one matched leaks through timing. No keys configured: no authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import Counter
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from app.errors import ApiError
from app.settings import Settings

ANONYMOUS = "anonymous"  # the client identity when authentication is off


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The accepted keys, as digests."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        keys = [k.strip() for k in (settings.api_keys or "").split(",")]
        if settings.api_key_file is not None:
            lines = Path(settings.api_key_file).read_text().splitlines()
            keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
        return cls([k for k in keys if k])

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def internal_key(self) -> str | None:
        """A new key for the server's own calls of its routes (the batch runner's), accepted
        from now on and never written anywhere; None when keys are off."""
        if not self.enabled:
            return None
        key = secrets.token_urlsafe(32)
        self._digests.append(_digest(key))
        return key

    def identify(self, key: str) -> str | None:
        """A stable, non-secret id of `key` (its digest's prefix) if it is accepted, else None."""
        presented = _digest(key)
        matched = False
        for digest in self._digests:  # no early exit: every key costs the same
            matched |= hmac.compare_digest(presented, digest)
        return presented.hex()[:16] if matched else None


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401, message, param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


# Documents the scheme in the OpenAPI schema; the checks below decide (and answer 401 themselves).
bearer = HTTPBearer(
    auto_error=False, description="An API key, when the server is started with keys"
)
api_key_header = APIKeyHeader(
    name="x-api-key",
    auto_error=False,
    description="An API key, as Anthropic's clients send it (instead of the bearer token)",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
HeaderKey = Annotated[str | None, Depends(api_key_header)]


def _identify(
    request: Request, credentials: HTTPAuthorizationCredentials | None, header_key: str | None
) -> str:
    keys: ApiKeys = request.app.state.api_keys
    if not keys.enabled:
        return ANONYMOUS
    key = (credentials.credentials if credentials is not None else header_key or "").strip()
    if not key:
        raise _unauthorized(
            "You didn't provide an API key: send `Authorization: Bearer YOUR_KEY` "
            "(or `x-api-key: YOUR_KEY`)."
        )
    identity = keys.identify(key)
    if identity is None:
        raise _unauthorized("Incorrect API key provided.")
    return identity


def client_identity(request: Request, credentials: Credentials, header_key: HeaderKey) -> str:
    """The caller's key id, or 401; `anonymous` when auth is off."""
    return _identify(request, credentials, header_key)


def metrics_identity(request: Request, credentials: Credentials, header_key: HeaderKey) -> str:
    """/metrics asks for a key only when `--metrics-auth` is set."""
    settings: Settings = request.app.state.settings
    return _identify(request, credentials, header_key) if settings.metrics_auth else ANONYMOUS


ClientDep = Annotated[str, Depends(client_identity)]


class ConcurrencyLimit:
    """Requests in flight per client; beyond `limit` (0 = none) a new one gets 429."""

    def __init__(self, limit: int, retry_after: int) -> None:
        self.limit, self.retry_after = limit, retry_after
        self.in_flight: Counter[str] = Counter()

    def acquire(self, client: str) -> None:
        if self.limit and self.in_flight[client] >= self.limit:
            raise ApiError(
                429,
                f"too many concurrent requests for this API key (at most {self.limit}); "
                "retry when one ends",
                "rate_limit_exceeded",
                code="concurrency_limit_exceeded",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.in_flight[client] += 1

    def release(self, client: str) -> None:
        self.in_flight[client] -= 1
        if self.in_flight[client] <= 0:
            del self.in_flight[client]
