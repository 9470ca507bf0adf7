"""API keys (`Authorization: Bearer ...`, compared in constant time), a per-key limit on requests in flight,
and whose each request is (its key, else its address) with its default priority, for the engines' fair
admission (`service.engine.admission`). Plain ASGI middleware, so streaming responses pass through untouched."""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from tserve.service.engine import Admission, admission
from tserve.service.errors import error_response


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyChecker:
    """Compares digests (equal length, whatever the key) with `hmac.compare_digest` against every key,
    without stopping at the first match, so the time taken says nothing about how much of a key matched."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(k) for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def match(self, presented: str) -> int | None:
        """Index of the matching key, or None."""
        candidate = _digest(presented)
        found = None
        for i, d in enumerate(self._digests):
            if hmac.compare_digest(candidate, d):
                found = i
        return found


def bearer_token(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def key_priority(entry: str) -> tuple[str, int | None]:
    """`KEY:N` in TSERVE_API_KEYS: the key and its requests' priority N (lower is admitted first; a request's
    body may ask for a later one, not an earlier one); a key without an integer after its last colon is the
    whole entry, with no priority of its own (None: 0, and the body's as asked)."""
    key, sep, number = entry.rpartition(":")
    if sep and key and number.lstrip("-").isdigit():
        return key, int(number)
    return entry, None


class KeyGate:
    """The API keys, each one's default priority, and how many requests each has in flight: shared by the
    middleware (Bearer keys) and the routes whose clients send the key in the body (LibreTranslate's `api_key`)."""

    def __init__(self, keys: list[str], max_in_flight_per_key: int) -> None:
        entries = [key_priority(k) for k in keys if k]
        self.checker, self.limit = KeyChecker([k for k, _ in entries]), max_in_flight_per_key
        self.priorities = [p for _, p in entries]
        self.in_flight: Counter[int] = Counter()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.checker.enabled

    def match(self, presented: str) -> int | None:
        return self.checker.match(presented)

    def enter(self, key: int) -> bool:
        """Count one more request of `key` in flight; False (and nothing counted) when it has its limit."""
        with self._lock:
            if self.limit and self.in_flight[key] >= self.limit:
                return False
            self.in_flight[key] += 1
            return True

    def leave(self, key: int) -> None:
        with self._lock:
            self.in_flight[key] -= 1

    def admit_as(self, key: int) -> None:
        """The current request is this key's, at its priority (for the engines' admission order)."""
        priority = self.priorities[key]
        admission.set(Admission(("key", key), priority or 0, priority))

    def busy_message(self) -> str:
        return f"this API key has {self.limit} requests in flight; retry later"


class APIKeyMiddleware:
    """Bearer keys on every path but the public ones and those whose routes check the key themselves."""

    def __init__(self, app: ASGIApp, gate: KeyGate, public_paths: list[str], self_checked_paths: frozenset[str],
                 self_checked_prefixes: tuple[str, ...] = ()) -> None:
        self.app, self.gate = app, gate
        self.public = set(public_paths)
        self.self_checked, self.self_checked_prefixes = self_checked_paths, self_checked_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http":  # until a key says whose it is: the client's address
            admission.set(Admission(("address", (scope.get("client") or ("",))[0]), 0))
        if (scope["type"] != "http" or not self.gate.enabled or path in self.public
                or path in self.self_checked or path.startswith(self.self_checked_prefixes)):
            await self.app(scope, receive, send)
            return
        key = self.gate.match(bearer_token(scope))
        if key is None:
            response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"},
                                      path=path)
            await response(scope, receive, send)
            return
        if not self.gate.enter(key):
            response = error_response(429, self.gate.busy_message(), "server_overloaded", "rate_limit_exceeded",
                                      {"Retry-After": "1"}, path=path)
            await response(scope, receive, send)
            return
        self.gate.admit_as(key)
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave(key)
