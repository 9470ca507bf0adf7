"""An app served in the test's own process: its models loaded, requests answered through `httpx.ASGITransport`
(no server process, no sockets), so that a test of how options meet takes seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tserve.service.app import build_app
from tserve.service.settings import Settings


class InProcessApp:
    def __init__(self, models: dict[str, Path], **settings) -> None:  # noqa: ANN003 - Settings fields
        self.app = build_app(Settings(models=[f"{n}={d}" for n, d in models.items()], device="cpu", **settings))
        self.registry = self.app.state.registry
        self.registry.start_loading()
        self.registry.wait_loaded(120)
        assert self.registry.ready, self.registry.error

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:  # noqa: ANN003 - httpx's
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
                return await client.request(method, path, **kwargs)

        return asyncio.run(send())

    def post(self, path: str, body: dict | None = None, status: int = 200, **kwargs) -> httpx.Response:  # noqa: ANN003
        """POST `body` as JSON (or `kwargs` as httpx takes them: files, data) and expect `status`."""
        resp = self.request("POST", path, **({"json": body} if body is not None else {}), **kwargs)
        assert resp.status_code == status, resp.text
        return resp

    def stop(self) -> None:
        self.registry.stop()


async def asgi_request(app, method: str, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]],  # noqa: ANN001
                disconnect_first: bool = False) -> tuple[int, bytes]:
    """One request as the server would pass it: the body in `chunks` (more_body on all but the last), or
    the client gone before its body (`disconnect_first`)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    messages = [] if disconnect_first else [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    status, body = [0], []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status[0], b"".join(body)
