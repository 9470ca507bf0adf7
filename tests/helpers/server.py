"""Runs `tserve serve` as a real server process for HTTP tests."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def port_nobody_else_takes(low: int = 20000, high: int = 32767) -> int:
    """A free port outside the kernel's ephemeral range (where `bind(0)` and outgoing connections draw theirs)
    and outside Ray's worker ports (10002-19999): between choosing it and binding it later, no other process
    picks it at random (Ray Serve's proxy binds its port long after it was chosen)."""
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = [p for p in range(low, high + 1) if not lo <= p <= hi]
    for port in random.Random().sample(candidates, len(candidates)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


class ServerProcess:
    def __init__(self, args: list[str], log_file: Path, env: dict[str, str] | None = None,
                 step_delay_s: float = 0.0, hooks: dict[str, str] | None = None) -> None:
        """`hooks`: TSERVE_TEST_* variables of the test-only launcher hooked_server.py, which then starts the
        server; `step_delay_s`: its step delay (every engine step sleeps this long first)."""
        self.port = port_nobody_else_takes()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        hooks = {**(hooks or {}), **({"TSERVE_TEST_STEP_DELAY_S": str(step_delay_s)} if step_delay_s else {})}
        entry = ["-m", "tests.helpers.hooked_server"] if hooks else ["-m", "tserve"]
        full_env.update(hooks)
        self._log = open(log_file, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "serve", "--port", str(self.port), *args],
            cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_file.read_text(errors="replace")[-5000:]

    def metric(self, name: str, model: str, default: float | None = None) -> float:
        """Current value of a gauge/counter sample with label model=... (`default` when it has none yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        prefix = f'{name}{{model="{model}"}} '
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix):])
        if default is not None:
            return default
        raise KeyError(f"{name} for {model} not in /metrics")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


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
