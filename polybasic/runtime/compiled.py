"""Compile every level of a chain (or a lone model) into static-shape steps (models.static), and warm
them before the first request, so that the compile time is spent, and reported, apart from decoding."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from polybasic.models.prepare import compile_for_device
from polybasic.models.static import covering, up_to

from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import Level, ModelLevel
from polybasic.runtime.with_lookup import drafting


def compile_levels(levels: Sequence[Level], max_len: int, gguf: str | Path | None = None, sizes=None,
                   notify: Callable[[str], None] | None = None, flag: str = "--compile",
                   lengths: Sequence[int] = (), decode: bool = False, rows: Sequence[int] = (),
                   mode: str = "layers") -> float:
    """Compile the forwards of every model level and EAGLE head in `levels` (target first), with caches
    for sequences of up to `max_len` tokens, and run each step size until it is steady (StaticSteps.warm_runs).
    lengths: the longest sequence of each request to come (e.g. a benchmark's prompts plus their token
    budget); their caches' size classes are warmed too (Transformer.setup_caches; where the caches only grow,
    only the largest class), so that no request compiles. decode: a lone model for plain decoding,
    which runs two steps only (Transformer.warm_steps). rows: the most rows each level scores in one call
    (runtime.chain.scored_rows, target first; a model level below them, a bottom drafter, at most 2): each model
    level compiles the sizes its calls use only (models.static.up_to), and an EAGLE head those of the rows its
    base verifies. gguf: the file the target's fp32 weights were expanded from (its steps of up to
    gguf_codes.CODED_ROWS tokens read the block codes). notify is told before each step compiles, with how many are
    left and the time left at the pace so far. mode: the models' compile mode on the CPU
    (models.prepare.compile_for_device); a model's steps of more than one row serve paths and token trees alike
    (Transformer.paths_as_trees). Returns the seconds it took (compiling, or loading compiled steps from
    inductor's cache). Model-free levels are left as they are; a drafter with prompt lookup is its drafter."""
    t0 = time.perf_counter()
    drafters = [drafting(lvl) for lvl in levels]
    models, most = [], {}  # the model levels' models (target first), and the most rows each scores in a call
    for i, lvl in enumerate(drafters):
        if isinstance(lvl, ModelLevel):
            if all(lvl.model is not m for m in models):
                models.append(lvl.model)
            most[id(lvl.model)] = max(most.get(id(lvl.model), 0), rows[i] if i < len(rows) else 2)
    heads = [(i, lvl) for i, lvl in enumerate(drafters) if isinstance(lvl, EagleLevel)]
    progress = _Progress(notify, t0)
    for m in models:
        own = sizes if not rows or decode else _up_to_rows(sizes, most[id(m)], m.device)
        compile_for_device(m, gguf if m is models[0] else None, flag, own, progress, mode)
    for i, lvl in heads:  # binding sets the layers the base returns: before any base step compiles
        # a head feeds at most the rows its base verified since its last draft (then one a draft step), and a prompt
        own = sizes if not rows or i > len(rows) else _up_to_rows(sizes, rows[i - 1], lvl.head.device)
        compile_for_device(lvl.head, flag=flag, sizes=own, notify=progress)
        lvl.head.bind(lvl.base.model)
        lvl.head.setup_caches(max_len + 1)
    # each model's cache size classes, max_len's first (caches that only grow stay in it)
    classes = [(m, n) for m in models for n in m.cache_classes([max_len, *sorted(set(lengths))])]
    progress.total = sum(len(m.warm_calls(decode)) for m, _ in classes) + sum(
        len(lvl.head._static.sizes) * len(_widths(lvl)) for _, lvl in heads)
    for m, n in classes:
        m.setup_caches(n)
        m.warm_steps(decode)
    for m in models:
        m.setup_caches(max_len)  # the caches end in max_len's class
    for _, lvl in heads:
        lvl.head.warm_steps(_widths(lvl))
    return time.perf_counter() - t0


def _up_to_rows(sizes, rows: int, device) -> tuple[int, ...]:
    """The step sizes a forward of at most `rows` rows (and a prompt's chunks) takes: `sizes` with `rows` added where
    only the prefill chunk would hold it (covering), then those above it dropped (up_to)."""
    return up_to(covering(sizes, [rows], device), rows)


def _widths(lvl: EagleLevel) -> tuple[int, ...]:
    """The feature widths an EAGLE head's steps take: the base's [(n+1) E] and its own E."""
    return tuple({lvl.head.cfg.dim, lvl.base.model.args.dim * (1 + len(lvl.head.cfg.feature_layers))})


class _Progress:
    """notify for StaticSteps: each step's compile message with its count and the time left at the pace so far."""

    def __init__(self, notify: Callable[[str], None] | None, t0: float) -> None:
        self.notify, self.t0, self.done, self.total = notify, t0, 0, 0

    def __call__(self, message: str) -> None:
        if self.notify is None:
            return
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        if self.total and self.done > 1:
            left = max(0, self.total - self.done + 1) * elapsed / (self.done - 1)
            message += f" [{self.done}/{self.total}, {elapsed:.0f} s so far, ~{left:.0f} s left]"
        elif self.total:
            message += f" [{self.done}/{self.total}]"
        self.notify(message)
