"""The HTTP tests' `tserve serve` processes: `tserve.testing.server`'s, forked from a process that has imported
the service, and with the test-only hooks of hooked_server.py when a test asks for them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tserve.testing import forked
from tserve.testing import server as testing_server

forked.preload("tests.helpers.hooked_server")  # the launcher of the test-only hooks, forked like the service

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess(testing_server.ServerProcess):
    """The tests' server process (forked inside a test, `tserve.testing.forked`), started with the test-only
    hooks when a test asks for them."""

    def __init__(self, args: list[str], log_file: Path, env: dict[str, str] | None = None,
                 step_delay_s: float = 0.0, hooks: dict[str, str] | None = None) -> None:
        """`hooks`: TSERVE_TEST_* variables of the test-only launcher hooked_server.py, which then starts the
        server; `step_delay_s`: its step delay (every engine step sleeps this long first)."""
        hooks = {**(hooks or {}), **({"TSERVE_TEST_STEP_DELAY_S": str(step_delay_s)} if step_delay_s else {})}
        super().__init__(args, log_file, {**(env or {}), **hooks},
                         module="tests.helpers.hooked_server" if hooks else "tserve")


def rss_kib(pid: int) -> int:
    """A process's resident memory (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def concurrently(server: ServerProcess, path: str, bodies: list[dict]) -> list[dict]:
    """POST every body to `path` at once (one connection each); their JSON answers, all required to be 200."""
    import asyncio  # noqa: PLC0415

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(server.url + path, json=b) for b in bodies))

    answers = asyncio.run(run())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    return [r.json() for r in answers]


def streamed_completion_text(url: str, body: dict) -> str:
    """The text of a streamed `/v1/completions` answer to `body`, its chunks joined."""
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text
