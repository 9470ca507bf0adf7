"""`tserve serve` as a real server process on a port of its own, for the HTTP tests and the benchmarks."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tserve.testing.forked import TSERVE_PARENT, ForkedServer, forkable


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
                 module: str = "tserve") -> None:
        """`python -m MODULE serve --port PORT ARGS` (`module`: tserve, or a launcher that takes its command
        line), with `env` over this process's environment, its output in `log_file`."""
        self.log_file = log_file
        self._log = open(log_file, "wb")  # noqa: SIM115 - closed in stop()
        self._launch = (module, args, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self._port_tries = 3  # launches on a port another process took first
        self._launch_on_a_free_port()

    def _launch_on_a_free_port(self) -> None:
        module, args, env = self._launch
        self.port = port_nobody_else_takes()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log.flush()
        self._log_from = self.log_file.stat().st_size  # this launch's part of the log starts here
        self._port_tries -= 1
        self.proc = self._start(module, ["serve", "--port", str(self.port), *args], env)

    def _start(self, module: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedServer:
        """The server's process: forked inside a test (`tserve.testing.forked`), else a new interpreter."""
        if forkable(env):
            return ForkedServer(module, argv, env, self.log_file)
        return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=TSERVE_PARENT, env=env, stdout=self._log,
                                stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_file, "rb") as f:
                    f.seek(self._log_from)
                    taken = b"address already in use" in f.read()
                if taken and self._port_tries > 0:  # another process bound the port between its choice and now
                    self._launch_on_a_free_port()
                    continue
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
