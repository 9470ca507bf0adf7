"""Server processes forked from one that has imported the service already (multiprocessing's fork server,
one per test process), for `tserve.testing.server.ServerProcess` inside a test: a server then starts in about
half a second instead of three (the imports, torch's most of all), and the test suite starts some seventy. The
child is `python -m MODULE ARGV...` as a fresh process would run it, with the test's environment, working
directory and log; only variables the service reads when it runs (TSERVE_*) may differ from the test process's,
since the imports read theirs already. Only inside a test (a script's fork server would import the script, its
`__main__`, again): elsewhere, and everywhere under TSERVE_TEST_FORK_SERVERS=0, a server is a new interpreter."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

TSERVE_PARENT = Path(__file__).resolve().parents[2]  # where `python -m tserve` finds this tserve
PRELOAD = ["tserve.service.cli", "tserve.service.app", "tserve.testing.forked"]
_FORK_SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # read when torch is imported
_fork_context: multiprocessing.context.BaseContext | None = None


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too (a launcher of the tests' own) when it starts."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def forkable(env: dict[str, str]) -> bool:
    """Whether a server with `env` may be forked: inside a test, and only TSERVE_* variables differ from the
    fork server's own."""
    if os.environ.get("TSERVE_TEST_FORK_SERVERS", "1") == "0" or "PYTEST_CURRENT_TEST" not in os.environ:
        return False
    ours = {**os.environ, **_FORK_SERVER_ENV}
    return all(key.startswith("TSERVE_") for key in env.keys() | ours.keys() if env.get(key) != ours.get(key))


def _run_module(module: str, argv: list[str], env: dict[str, str], log_file: str) -> None:
    """In the forked child: `python -m module *argv` with `env`, from the repository root, into `log_file`."""
    os.chdir(TSERVE_PARENT)
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
            _fork_context.set_forkserver_preload(PRELOAD)
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
