"""``python -m minillm serve`` in a process of its own, as it runs in production: what the benchmarks
that must not share a process with the server start (bench-http, bench-server, bench-deceptions).

A free port unless one is given; the API key passed in the environment (a key in argv would show
in ``ps``); ready when ``GET /health`` answers 200; stopped with SIGINT (uvicorn's clean shutdown),
killed if it has not exited in time. A server that exits while starting raises with the end of its
stderr, so the cause is on screen.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class ServeProcess:
    """``with ServeProcess(["--model", "tiny"]) as srv:`` → ``srv.url``, ``srv.key``, ``srv.proc``."""

    def __init__(self, args: Sequence[str], api_key: str | None = None, port: int | None = None,
                 torch_threads: int | None = None, auth: bool = True,
                 stderr_path: str | Path | None = None) -> None:
        """``auth=False``: an open server (no key); ``stderr_path``: the server's log goes to that file
        (else it is kept in a pipe, for the error message of a server that fails to start)."""
        # the server's own module imports fastapi: loaded only when a server is started
        from minillm.serving.server import free_port
        self.port = port or free_port()
        self.key = (api_key or "sk-minillm-" + os.urandom(6).hex()) if auth else None
        self.stderr_path = Path(stderr_path) if stderr_path is not None else None
        self.url = f"http://127.0.0.1:{self.port}"
        threads = ["--torch-threads", str(torch_threads)] if torch_threads else []
        self.cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(self.port), *args, *threads]
        self.proc: subprocess.Popen | None = None

    def launch(self) -> ServeProcess:
        """Start the process and return at once (:meth:`wait_ready` then waits for it), so the
        caller can prepare its requests while the server loads its model."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.key:
            env["MINILLM_API_KEY"] = self.key
        else:
            env.pop("MINILLM_API_KEY", None)
        if self.stderr_path is not None:
            with open(self.stderr_path, "w") as err:           # the child keeps its own copy of the file
                self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                             text=True)
        else:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True)
        return self

    def _stderr_tail(self) -> str:
        if self.stderr_path is not None:
            return self.stderr_path.read_text()[-2000:]
        return self.proc.stderr.read()[-2000:]

    def start(self, timeout: float = 180.0) -> ServeProcess:
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        import httpx
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self._stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not come up in {timeout:g} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
