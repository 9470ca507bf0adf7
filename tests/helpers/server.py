"""Runs `tserve serve` as a real server process for HTTP tests."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import runpy
import signal
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
        argv = ["serve", "--port", str(self.port), *args]
        if _forkable(full_env):
            self.proc: subprocess.Popen | ForkedServer = ForkedServer(entry[1], argv, full_env, log_file)
        else:
            self.proc = subprocess.Popen([sys.executable, *entry, *argv], cwd=ROOT, env=full_env, stdout=self._log,
                                         stderr=subprocess.STDOUT)

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


# Server processes are forked from one that has imported the service already (multiprocessing's fork server,
# one per test process): a server then starts in about half a second instead of three (the imports, torch's
# most of all), and the suite starts some seventy. The child is `python -m MODULE ARGV...` as a fresh process
# would run it, with the test's environment, working directory and log; only variables the service reads when
# it runs (TSERVE_*) may differ from the test process's, since the imports read theirs already.
# Only in a test (bench/ scripts start theirs as new interpreters); TSERVE_TEST_FORK_SERVERS=0 starts every
# server as a new interpreter.
_PRELOAD = ["tserve.service.cli", "tserve.service.app", "tests.helpers.hooked_server", "tests.helpers.server"]
_FORK_SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # read when torch is imported
_fork_context: multiprocessing.context.BaseContext | None = None


def _forkable(env: dict[str, str]) -> bool:
    """Whether a server with `env` may be forked: only TSERVE_* variables differ from the fork server's own."""
    if os.environ.get("TSERVE_TEST_FORK_SERVERS", "1") == "0" or "PYTEST_CURRENT_TEST" not in os.environ:
        return False  # (a script's fork server would import the script, its `__main__`, again)
    ours = {**os.environ, **_FORK_SERVER_ENV}
    return all(key.startswith("TSERVE_") for key in env.keys() | ours.keys() if env.get(key) != ours.get(key))


def _run_module(module: str, argv: list[str], env: dict[str, str], log_file: str) -> None:
    """In the forked child: `python -m module *argv` with `env`, from the repository root, into `log_file`."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_file, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedServer:
    """`subprocess.Popen`'s interface (pid, poll, wait, send_signal, terminate, kill, returncode) over a server
    forked from the fork server."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], log_file: Path) -> None:
        global _fork_context
        if _fork_context is None:
            _fork_context = multiprocessing.get_context("forkserver")
            _fork_context.set_forkserver_preload(_PRELOAD)
        self._process = _fork_context.Process(target=_run_module, args=(module, argv, env, str(log_file)),
                                              daemon=True)
        saved = {key: os.environ.get(key) for key in _FORK_SERVER_ENV}
        os.environ.update(_FORK_SERVER_ENV)  # the fork server, started by the first server, imports with these
        try:
            self._process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
