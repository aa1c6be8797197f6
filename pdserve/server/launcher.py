"""Run `pdserve serve` as a child process on a free local port and wait until it answers: what tests and
benchmarks need to talk to a real server over real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pdserve serve <args>` (or `pdserve router <args>`) in a subprocess. Its output goes to a log file
    (`log_text()`)."""

    def __init__(
        self,
        args: Sequence[str],
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        command: str = "serve",
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.args = [
            sys.executable,
            "-m",
            "pdserve.cli",
            command,
            "--host",
            host,
            "--port",
            str(self.port),
            *args,
        ]
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        # Kept open for the child's output; closed and removed by close().
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="pdserve-server-", suffix=".log", delete=False
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Block until GET /health answers 200; raise RuntimeError (with the log) if the process exits or
        the timeout passes first."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.log_text()}")

    def engine_pids(self) -> list[int]:
        """Process ids of the server's engine core children (Linux: read from /proc)."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            return []
        pids = []
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        pids.append(pid)
            except OSError:
                pass
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Send `sig` and wait; kill the process if it does not exit in time. Returns its exit code
        (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in self.engine_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()
            return None

    def log_text(self) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def close(self) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)

    def __enter__(self) -> ServerProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.close()
