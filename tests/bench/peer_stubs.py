"""A peer engine for tests, loaded by polybasic.bench.peer_worker in the child process: it echoes the
prompt's first tokens, and after `ok` decodes it crashes (mode "segv"), hangs ("hang") or exits 3 ("exit")."""
from __future__ import annotations

import itertools
import os
import signal
import sys
import time

ENGINE = "tests.bench.peer_stubs:engine"


def engine(settings: dict):
    calls = itertools.count(1)
    print("stub peer: loaded", flush=True)  # stdout: must land on stderr, not in the protocol

    def decode(prompt_ids: list[int], seed: int) -> tuple[list[int], float]:
        if next(calls) > settings["ok"]:
            print(f"stub peer: giving up ({settings['mode']})", file=sys.stderr, flush=True)
            if settings["mode"] == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if settings["mode"] == "hang":
                time.sleep(3600)
            sys.exit(3)
        t0 = time.perf_counter()
        tokens = prompt_ids[:settings["max_new_tokens"]]
        return tokens, time.perf_counter() - t0 + 1e-6
    return decode
