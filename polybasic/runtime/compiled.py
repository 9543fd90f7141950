"""Compile every level of a chain (or a lone model) into static-shape steps (models.static), and warm
them before the first request, so that the compile time is spent, and reported, apart from decoding."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from polybasic.models.prepare import compile_for_device

from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import Level, ModelLevel


def compile_levels(levels: Sequence[Level], max_len: int, gguf: str | Path | None = None, sizes=None,
                   notify: Callable[[str], None] | None = None, flag: str = "--compile",
                   lengths: Sequence[int] = (), decode: bool = False) -> float:
    """Compile the forwards of every model level and EAGLE head in `levels` (target first), with caches
    for sequences of up to `max_len` tokens, and run each step size until it is steady (StaticSteps.warm_runs).
    lengths: the longest sequence of each request to come (e.g. a benchmark's prompts plus their token
    budget); their caches' size classes are warmed too (Transformer.setup_caches; on CUDA the caches only
    grow, so only the largest class), so that no request compiles. decode: a lone model for plain decoding,
    which runs two steps only (Transformer.warm_steps). gguf: the file the target's fp32 weights were
    expanded from (its steps of up to gguf_codes.CODED_ROWS tokens read the block codes). Returns the seconds it took
    (compiling, or loading compiled steps from inductor's cache). Model-free levels are left as they are."""
    t0 = time.perf_counter()
    models = []
    for lvl in levels:
        if isinstance(lvl, ModelLevel) and all(lvl.model is not m for m in models):
            models.append(lvl.model)
    heads = [lvl for lvl in levels if isinstance(lvl, EagleLevel)]
    for m in models:
        compile_for_device(m, gguf if m is models[0] else None, flag, sizes, notify)
    for lvl in heads:  # binding sets the layers the base returns: before any base step compiles
        compile_for_device(lvl.head, flag=flag, sizes=sizes, notify=notify)
        lvl.head.bind(lvl.base.model)
        lvl.head.setup_caches(max_len + 1)
    warmed = set()  # (model, cache size class)
    for n in [max_len, *sorted(set(lengths)), max_len]:  # max_len first (caches that only grow stay in its
        for m in models:  # class) and last (the caches end in its class)
            m.setup_caches(n)
            if (id(m), m.max_seq_len) not in warmed:
                m.warm_steps(decode)
                warmed.add((id(m), m.max_seq_len))
    for lvl in heads:
        lvl.head.warm_steps(tuple({lvl.head.cfg.dim, lvl.base.model.args.dim * (1 + len(lvl.head.cfg.feature_layers))}))
    return time.perf_counter() - t0
