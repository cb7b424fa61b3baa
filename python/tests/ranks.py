"""Ranks of a multi-process test: a free port on the loopback, and the ranks' processes started,
waited for with a timeout (a rank that hangs in a collective is a failure, not a stuck suite) and
never left running."""

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands, timeout: float, env=None) -> list:
    """Runs one process per command (a rank each), and returns their exit codes in order, or
    ``"hung"`` for a rank still running ``timeout`` seconds after the start (one deadline for
    all: then killed, as is every rank still running when this returns)."""
    deadline = time.monotonic() + timeout
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands]
    try:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append("hung")
        return codes
    finally:
        for proc in procs:  # a rank that hangs must not outlive the test
            if proc.poll() is None:
                proc.kill()
