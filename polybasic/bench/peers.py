"""Peer engines in their own process: a crash, an abort or a hang of another engine (llama.cpp through its
Python binding) ends that method, not the bench.

The parent starts `python -m polybasic.bench.peer_worker` and talks JSON lines over its stdin/stdout
(polybasic.bench.peer_worker has the protocol); the child's stderr goes to a temp file whose last lines a
failure quotes. Every request waits at most `timeout` seconds for its reply; a child that dies or does not
answer in time raises MethodFailed with its signal or exit code.
"""
from __future__ import annotations

import atexit
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field

WORKER = (sys.executable, "-m", "polybasic.bench.peer_worker")
STDERR_LINES = 12  # how many of a failed child's last stderr lines a failure keeps


@dataclass
class Failure:
    """Why a method stopped: the reason in words, its signal or exit code, where it was, its stderr's end."""
    method: str
    reason: str  # e.g. "killed by SIGSEGV", "exited with code 3", "no reply within 600 s (killed)"
    signal: str | None = None  # e.g. "SIGSEGV"
    exit_code: int | None = None
    stage: str = "prompt"  # "load", "warm-up" or "prompt"
    question_id: int | str | None = None  # the prompt it was on (None while loading)
    category: str | None = None
    stderr: list[str] = field(default_factory=list)  # the child's last stderr lines


class MethodFailed(Exception):
    """A method that cannot go on (its process crashed, exited or hung); run_all drops it for later prompts."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.method}: {failure.reason}")
        self.failure = failure


def exit_reason(returncode: int) -> tuple[str, str | None, int | None]:
    """A child's return code -> (reason, signal name, exit code); a negative code is the signal that killed it."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}", name, None
    return f"exited with code {returncode}", None, returncode


class PeerProcess:
    """One child process running one peer engine: `request(msg)` -> its reply, or MethodFailed."""

    def __init__(self, method: str, engine: str, settings: dict, timeout: float) -> None:
        """Start the worker and load `engine` ('module:function') with `settings`; waits for it to be ready."""
        self.method, self.timeout = method, timeout
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)
        self.request({"engine": engine, "settings": settings}, stage="load")

    def _read(self) -> None:
        for line in self._proc.stdout:  # one JSON object a line; None at EOF (the child ended)
            self._replies.put(line)
        self._replies.put(None)

    def request(self, msg: dict, stage: str = "prompt") -> dict:
        """Send one request and wait for its reply (at most `timeout` s)."""
        try:
            self._proc.stdin.write((json.dumps(msg) + "\n").encode())
            self._proc.stdin.flush()
            line = self._replies.get(timeout=self.timeout)
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            self._proc.kill()
            self._proc.wait()
            raise MethodFailed(self._failure(f"no reply within {self.timeout:g} s (killed)", stage)) from None
        if line is None:
            reason, sig, code = exit_reason(self._proc.wait())
            raise MethodFailed(self._failure(reason, stage, sig, code))
        try:
            return json.loads(line)
        except ValueError:
            self._proc.kill()
            self._proc.wait()
            raise MethodFailed(self._failure(f"an unreadable reply {line[:80]!r} (killed)", stage)) from None

    def _failure(self, reason: str, stage: str, sig: str | None = None, code: int | None = None) -> Failure:
        return Failure(self.method, reason, sig, code, stage, stderr=self._stderr_tail())

    def _stderr_tail(self) -> list[str]:
        self._stderr.seek(0, 2)
        self._stderr.seek(max(0, self._stderr.tell() - 16384))
        lines = self._stderr.read().decode(errors="replace").splitlines()
        return [ln for ln in lines if ln.strip()][-STDERR_LINES:]

    def close(self) -> None:
        """End the child: EOF on its stdin (it exits), killed if it has not within 10 s."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()
        atexit.unregister(self.close)
