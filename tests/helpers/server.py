"""The HTTP tests' `tserve serve` processes: `tserve.testing.server`'s, forked from a process that has imported
the service, and with the test-only hooks of hooked_server.py when a test asks for them."""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tserve.testing import server as testing_server

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess(testing_server.ServerProcess):
    """The tests' server process: forked from a fork server inside a test (see below), and started with the
    test-only hooks when a test asks for them."""

    def __init__(self, args: list[str], log_file: Path, env: dict[str, str] | None = None,
                 step_delay_s: float = 0.0, hooks: dict[str, str] | None = None) -> None:
        """`hooks`: TSERVE_TEST_* variables of the test-only launcher hooked_server.py, which then starts the
        server; `step_delay_s`: its step delay (every engine step sleeps this long first)."""
        hooks = {**(hooks or {}), **({"TSERVE_TEST_STEP_DELAY_S": str(step_delay_s)} if step_delay_s else {})}
        super().__init__(args, log_file, {**(env or {}), **hooks},
                         module="tests.helpers.hooked_server" if hooks else "tserve")

    def _start(self, module: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedServer:
        if _forkable(env):
            return ForkedServer(module, argv, env, self.log_file)
        return super()._start(module, argv, env)


# Server processes are forked from one that has imported the service already (multiprocessing's fork server,
# one per test process): a server then starts in about half a second instead of three (the imports, torch's
# most of all), and the suite starts some seventy. The child is `python -m MODULE ARGV...` as a fresh process
# would run it, with the test's environment, working directory and log; only variables the service reads when
# it runs (TSERVE_*) may differ from the test process's, since the imports read theirs already.
# Only in a test (the benchmarks' servers, `tserve.testing.server`'s, are new interpreters);
# TSERVE_TEST_FORK_SERVERS=0 starts every server as a new interpreter.
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
