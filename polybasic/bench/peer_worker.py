"""The child process of a peer method (polybasic.bench.peers): `python -m polybasic.bench.peer_worker`.

Protocol, one JSON object a line on stdin / stdout:

    -> {"engine": "module:function", "settings": {...}}     load once: function(settings) -> decode
    <- {"ready": true}
    -> {"prompt": [token ids], "seed": N}                    one per prompt (warm-up included)
    <- {"tokens": [new token ids], "wall_s": seconds}        decode(prompt, seed); wall time of the decode alone
    (EOF on stdin: the child exits 0)

`decode(prompt_ids, seed) -> (tokens, wall_s)` measures its own wall time around the decoding (process
start and model load are never in it). Anything the engine or its native library prints goes to stderr:
stdout carries the protocol alone. An engine error ends the child (traceback on stderr, exit code 1).
"""
from __future__ import annotations

import importlib
import json
import os
import sys


def load_engine(spec: str):
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(requests, replies) -> None:
    """Answer the load request, then every prompt request, until `requests` ends."""
    first = requests.readline()
    if not first:
        return
    load = json.loads(first)
    decode = load_engine(load["engine"])(load["settings"])
    _reply(replies, {"ready": True})
    for line in requests:
        req = json.loads(line)
        tokens, wall_s = decode(req["prompt"], req["seed"])
        _reply(replies, {"tokens": [int(t) for t in tokens], "wall_s": wall_s})


def _reply(replies, msg: dict) -> None:
    replies.write(json.dumps(msg) + "\n")
    replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # everything else printed to stdout (native libraries too) lands on stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
