"""Static-shape compiled steps: one `torch.compile`d function per fixed token count.

A compiled step sees only fixed shapes: M, padded up to the next of a few sizes (`STEP_SIZES`; past the
second largest, to the largest: a prefill's chunk), the positions of its rows as a tensor [M] (not an
int, so a new position is new data, not a new graph),
and the whole preallocated KV cache [B, G, S, D] with a mask [M, S] of the rows each may see. Padding
rows sit at the positions after the real ones: they write cache rows no real row sees yet, which the
next call overwrites before reading (rollback is a smaller start; nothing is reallocated). A run
longer than the largest size goes in chunks of it (a long prefill). A row-invariant model on the CPU runs
calls past the second largest size eagerly instead (Transformer.compile_steps). A key's calls after its first
skip dynamo's guards (`unguarded`).

So each size compiles once, inductor caches it on disk (TORCHINDUCTOR_CACHE_DIR, by default
/tmp/torchinductor_$USER) and the next process loads it in seconds; on CUDA the same graphs are
captured as CUDA graphs (mode "reduce-overhead") and replayed, and their outputs are copied out
before the next replay overwrites them. The CPU runs the same code path without the capture.

Regions (the CPU): a step can instead run its own code eagerly and compile only named regions of it, each called
through `region` (a decoder layer: one graph per size, which every layer of the model runs, instead of one graph of
all the layers). A 1.5B model's step then compiles in ~3-6 s a size instead of ~40-75 s on 2 cores, and a process
that finds the graphs in inductor's cache traces one layer, not 28; each layer's call costs ~30-40 us of Python and
dispatch with dynamo's guards skipped, ~4-6% of a 1.5B or 0.5B W4 model's step, until two calls of a key have shown
that its compiled code can be called straight (GraphCall): then ~3% more than a whole-model graph called straight
(docs/results.md).
"""
from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable

import torch
from torch import Tensor

from polybasic.errors import check

log = logging.getLogger(__name__)

STEP_SIZES = (1, 2, 4, 6, 8, 12, 16, 64)  # token counts a step is compiled for (sizes=None); the largest: prefill chunks
# (a chain compiles only those its verifications take: runtime.compiled). 6: a `@w4a8` 1.5B target's 5-6-row
# verification (a head's draft of 3 plus prompt lookup's nodes) costs ~1.08x its one-row step at 6 rows and
# 1.25-1.36x at 8 on a 2-core AMD EPYC (docs/results.md)
# On CUDA a step is a graph replay whose cost hardly grows with M (SmolLM2-shaped, H200: 2.08 ms at M=1,
# 3.06 ms at M=16) while each size costs ~25 s to compile and capture: fewer sizes, and longer prefill
# chunks (docs/history.md, H200 2026-11-26: 352 -> 375 tok/s with 1,16 -> 1,16,128)
CUDA_STEP_SIZES = (1, 16, 128)


def default_sizes(device: torch.device) -> tuple[int, ...]:
    """The step sizes compiled when none are given, read at call time (a test suite may shrink them)."""
    return CUDA_STEP_SIZES if device.type == "cuda" else STEP_SIZES


def decode_sizes(sizes, device: torch.device) -> tuple[int, ...]:
    """The sizes plain (one token at a time) decoding runs, of `sizes` (None: the device's default): the
    one-token step and the prefill chunk, the largest. No draft is verified, so the others would be compiled
    for nothing (on a 2-core CPU, minutes per cache size for a 1.5B model)."""
    s = check_sizes(sizes or default_sizes(device))
    return (1, s[-1]) if len(s) > 1 else s


def covering(sizes, rows, device: torch.device) -> tuple[int, ...]:
    """`sizes` (None: the device's default) plus each of `rows` that no size but the largest (the prefill chunk)
    holds, so that a call of that many rows runs at its own size instead of padded up to the chunk; rows that
    a smaller size holds already are left (a size more costs a compile per model and cache size)."""
    s = check_sizes(sizes or default_sizes(device))
    below = s[-2] if len(s) > 1 else 0  # the largest size short of the chunk
    return tuple(sorted(set(s) | {int(r) for r in rows if below < r < s[-1]}))


def up_to(sizes, rows: int) -> tuple[int, ...]:
    """`sizes` less those no call of at most `rows` rows uses: every size up to the smallest that holds `rows`,
    and the largest (the prefill chunk). A chain's level compiles only the steps its verifications take."""
    s = check_sizes(sizes)
    fits = next((x for x in s if x >= rows), s[-1])
    return tuple(x for x in s if x <= fits or x == s[-1])


def cache_dir() -> str:
    """Where inductor keeps compiled steps across runs ($TORCHINDUCTOR_CACHE_DIR, torch's default
    /tmp/torchinductor_$USER when unset)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir  # start-up time

    return inductor_cache_dir()


def check_sizes(sizes, field: str = "step sizes") -> tuple[int, ...]:
    """The sorted distinct sizes; a ConfigError naming `field` unless they are positive and include 1."""
    sizes = tuple(sorted(set(int(s) for s in sizes)))
    check(bool(sizes) and sizes[0] == 1, field, f"{list(sizes)} must include 1 (the one-token step)",
          "e.g. 1,2,4,8,16,64")
    return sizes


def compile_mode(device: torch.device) -> str | None:
    """torch.compile's mode for a step on `device`: CUDA graphs on CUDA, plain inductor elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class StaticSteps:
    """`fn(*args)` compiled for fixed shapes, with the first call of each shape timed as compile time.

    fn's first argument has the padded token count M in dim 1; `key` (any hashable naming the shapes,
    e.g. (B, M, last_only)) decides when a call is the first of its kind. `notify(message)` is told
    before each first call (a user's first generate says it is compiling). `eager_long`: the caller runs calls
    of more rows than the second largest size eagerly, unpadded (`runs_eager`; see Transformer.compile_steps).
    `regions` ({name: function}, not on CUDA): fn runs eagerly and compiles only these, which it calls through
    `region` (see the module's docstring); CUDA compiles fn whole, for one CUDA graph a step.
    """

    skip_guards = True  # a key's calls after its guards passed once skip them (unguarded); False: every call checks
    skip_wrappers = True  # then, once two calls agree, call inductor's compiled code straight (GraphCall; not CUDA)

    def __init__(self, fn: Callable, name: str, sizes=None, device: torch.device | None = None,
                 options: dict | None = None, notify: Callable[[str], None] | None = None,
                 eager_long: bool = False, regions: dict[str, Callable] | None = None) -> None:
        for knob in ("recompile_limit", "accumulated_recompile_limit"):  # one graph per size, batch,
            limit = getattr(torch._dynamo.config, knob, None)  # variant, cache size class (Transformer.
            if limit is not None and limit < 512:  # setup_caches) and model: more than dynamo's 8 and 256
                setattr(torch._dynamo.config, knob, 512)
        self.device = torch.device(device or "cpu")
        self.sizes = check_sizes(sizes or default_sizes(self.device))
        self.name = name
        self.mode = compile_mode(self.device)
        self.raw = fn
        self.regions = regions if regions and self.mode is None else None
        compile_ = functools.partial(torch.compile, dynamic=False, mode=self.mode,
                                     options=None if self.mode else options)
        self.fn = fn if self.regions else compile_(fn)
        self.compiled = {name: compile_(f) for name, f in (self.regions or {}).items()}
        self.direct: dict = {}  # (key, grad mode, inference mode) -> unguarded(...) or None (see _call)
        self.guarded: set = set()  # the states (see _call) called through dynamo's guards so far
        self.straight: dict = {}  # state -> GraphCall, or None where the compiled code cannot be called straight
        self.probes: dict = {}  # state -> the first recorded call of its unguarded code (see _call)
        self.notify = notify or log.info
        # whether the caches take each request's size class, smaller ones too (Transformer.setup_caches): on
        # the CPU a step's attention over rows it never reads costs more than compiling the class (a 1.5B W4
        # copy: 3.6 ms at 1,088 rows, 1.9 at 320); on CUDA attention over a longer cache costs next to nothing
        # and each class costs a compile and a graph capture per step (~15 s each on an H100), so the caches
        # only grow there and a run compiles its largest class alone (runtime.compiled.compile_levels)
        self.shrink = self.device.type != "cuda"
        self.seen: set = set()
        self.eager_above = self.sizes[-2] if eager_long and len(self.sizes) > 1 else None  # see runs_eager
        self.compile_s = 0.0  # wall time of first calls (compile + one run)
        self.compiles = 0
        self.calls = 0

    def __deepcopy__(self, memo) -> None:
        """A deep copy of a compiled model is eager (its steps here are bound to the original's forward)."""
        return None

    @property
    def warm_runs(self) -> int:
        """Calls per shape that make it steady: CUDA graph trees run a new graph eagerly once, record it on
        the second call and replay it from the third; elsewhere the first call compiles and that is all."""
        return 3 if self.mode == "reduce-overhead" else 1

    def runs_eager(self, m: int) -> bool:
        """Whether a call of m rows runs eagerly, unpadded, instead of through the compiled steps."""
        return self.eager_above is not None and m > self.eager_above

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def cache_rows(self, n: int, limit: int | None = None) -> tuple[int, int]:
        """Sequences of up to n tokens -> (the usable length: a power of two >= 256, at most `limit`; the
        rows to allocate: that plus the padding rows of the largest step). Few sizes, few graphs."""
        usable = max(256, 1 << (n - 1).bit_length())
        usable = usable if limit is None else min(limit, usable)
        return usable, usable + self.largest

    def size_class(self, n: int, limit: int | None = None, current: int = 0) -> int:
        """The usable length caches of `current` usable rows take for sequences of up to n tokens: n's class
        (cache_rows), or `current` where that holds more and the caches only grow (shrink False)."""
        usable = self.cache_rows(n, limit)[0]
        return current if usable < current and not self.shrink else usable

    def chunks(self, m: int, start: int, device):
        """The steps that run m tokens from position `start`: (offset, real rows n, padded size, positions
        [size]) per chunk of at most the largest size."""
        for a in range(0, m, self.largest):
            n = min(self.largest, m - a)
            size = self.bucket(n)
            yield a, n, size, positions(start + a, size, device)

    def bucket(self, m: int) -> int:
        """The padded token count for m <= largest real tokens: the next size up, except that a run
        longer than the second largest size (a prefill's last chunk) takes the largest, so that prefills
        of any length use one graph."""
        return next(s for s in self.sizes if s >= m) if len(self.sizes) < 2 or m <= self.sizes[-2] else self.sizes[-1]

    def __call__(self, key, *args):
        self.calls += 1
        first = key not in self.seen
        if first:
            self.notify(f"compiling {self.name}'s {key} step (first use; cached in {cache_dir()})")
            t0 = time.perf_counter()
        out = self.fn(*args) if self.regions else self._call(key, self.fn, self.raw, args)
        if first:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.compile_s += time.perf_counter() - t0
            self.compiles += 1
            self.seen.add(key)
        if self.mode == "reduce-overhead":  # the next replay overwrites a graph's outputs
            out = out.clone() if isinstance(out, Tensor) else tuple(t.clone() for t in out)
        return out

    def region(self, name: str, key, index: int, *args):
        """Region `name`'s compiled code on args, from a step's fn: `key` names the shapes its graph depends on,
        `index` the caller (e.g. a layer), whose own guards are checked once before its calls skip them."""
        return self._call((name, key, index), self.compiled[name], self.regions[name], args)

    def forget(self) -> None:
        """Drop the straight calls (GraphCall): they hold the tensors the model had (its caches, once reallocated,
        are others). The model calls this whenever it replaces a tensor its steps read."""
        self.straight.clear()
        self.probes.clear()

    def _call(self, key, compiled: Callable, raw: Callable, args: tuple):
        """compiled(*args); a key's calls after its guards passed once skip them (unguarded), and after two of
        those were recorded alike, dynamo's and AOT autograd's Python wrappers too (GraphCall)."""
        state = (key, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        straight = self.straight.get(state) if self.skip_wrappers else None
        if straight is not None:
            return straight(args)
        direct = self.direct.get(state) if self.skip_guards else None
        if direct is not None:  # the compiled code of this key, its guards passed once (unguarded)
            if not self.skip_wrappers or self.mode is not None or state in self.straight:
                return direct(*args)
            out, record = recorded(direct, args)  # the wrappers' inputs and outputs of the compiled code
            first = self.probes.pop(state, None)
            if first is None:
                self.probes[state] = record
            else:
                self.straight[state] = GraphCall.of(first, record) if record is not None else None
            return out
        out = compiled(*args)
        if self.skip_guards and state not in self.direct:
            if state in self.guarded:  # its second call: torch's cache holds the code its guards pass
                self.direct[state] = unguarded(raw, args)  # None where torch keeps none: stays guarded
            self.guarded.add(state)
        return out


def unguarded(fn: Callable, args: tuple) -> Callable | None:
    """The code torch.compile made for fn(*args), as a plain function that calls the compiled graph without
    evaluating its guards again; None where torch keeps no entry whose guards these arguments pass.

    Dynamo checks a step's guards at every call: ~2,700 of them for a 24-layer model, over its modules'
    types, dicts and tensors, ~1 ms a call on a 2-core AMD EPYC (a 0.5B W4 copy's 14 ms step), host time that
    a CUDA graph replay waits for. A StaticSteps key names everything a step's graph depends on (batch, M,
    logits kind, cache size, the layers whose features it returns), and the model's modules do not change
    between calls, so once a key's guards have passed, its later calls with the same grad and inference modes
    can skip them."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # torch internals: else guarded
    except ImportError:
        return None
    func, bound = getattr(fn, "__func__", fn), (fn.__self__,) if hasattr(fn, "__self__") else ()
    code = func.__code__
    f_locals = dict(zip(code.co_varnames[:code.co_argcount], bound + tuple(args)))
    try:
        for entry in _debug_get_cache_entry_list(code):
            if entry.guard_manager.check(f_locals):
                plain = types.FunctionType(entry.code, func.__globals__, func.__name__, func.__defaults__,
                                           func.__closure__)
                return functools.partial(plain, *bound)
    except (AttributeError, TypeError, RuntimeError):  # another torch's cache entries: stay guarded
        return None
    return None


def _tensors(args) -> list[Tensor]:
    """The tensors of args, those inside tuples too, in order."""
    out = []
    for a in args:
        out += [t for t in a if isinstance(t, Tensor)] if isinstance(a, tuple) else [a] if isinstance(a, Tensor) else []
    return out


def recorded(fn: Callable, args: tuple) -> tuple:
    """fn(*args) -> (its output, the record of the one compiled graph it ran: (graph, its inputs, its outputs, args,
    output)), the record None where it ran no inductor graph or several, or torch lacks the internals."""
    try:
        from torch._inductor.output_code import CompiledFxGraph  # torch internals: else no record
    except ImportError:
        return fn(*args), None
    calls, call = [], CompiledFxGraph.__call__

    def record(graph, inputs):
        seen = list(inputs)  # the compiled code empties the list it is given
        res = call(graph, inputs)
        calls.append((graph, seen, res))
        return res
    CompiledFxGraph.__call__ = record
    try:
        out = fn(*args)
    finally:
        CompiledFxGraph.__call__ = call
    return out, ((*calls[0], args, out) if len(calls) == 1 else None)


class GraphCall:
    """A step's (or region's) compiled code called straight: inductor's callable on the inputs its wrappers gave it,
    the call's own tensors put in their places. Dynamo's bytecode (which reads every weight and cache tensor off the
    modules at each call) and AOT autograd's runtime wrappers cost a 2-core AMD EPYC ~25-35 us a call: ~3% of a
    1.5B `@w4a8` step run as 28 layer regions, ~1.5% of one run as a whole-model graph (docs/results.md).

    Built from two recorded calls (`recorded`) of a key's unguarded code, only where they show it safe: every input
    of the compiled code is either one of the call's own tensors (by identity) or the same tensor in both calls (a
    weight, a cache), and its outputs are exactly what the step returned (no mutation or alias the wrappers apply
    after the graph). The tensors it holds are the model's of that moment: StaticSteps.forget drops it."""

    def __init__(self, fn: Callable, template: list, slots: list[tuple[int, int]], single: bool) -> None:
        self.fn, self.template, self.slots, self.single = fn, template, slots, single

    @classmethod
    def of(cls, first: tuple, second: tuple) -> "GraphCall | None":
        """From two records of one key's calls, or None where they do not show the call safe (see the class)."""
        (graph, in1, _, args1, _), (graph2, in2, res, args2, out) = first, second
        fn = getattr(graph, "current_callable", None)
        if graph is not graph2 or fn is None or len(in1) != len(in2) or not isinstance(res, (list, tuple)):
            return None
        own1, own2 = _tensors(args1), _tensors(args2)
        where, first_own = {id(t): i for i, t in enumerate(own2)}, {id(t) for t in own1}
        slots = []
        for j, (a, b) in enumerate(zip(in1, in2)):
            i = where.get(id(b))
            if i is not None and i < len(own1) and a is own1[i]:
                slots.append((j, i))
            elif a is not b or id(a) in first_own:
                return None  # neither the call's own tensor nor one both calls share
        outs = [out] if isinstance(out, Tensor) else list(out) if isinstance(out, tuple) else None
        if outs is None or len(outs) != len(res) or any(o is not r for o, r in zip(outs, res)):
            return None
        template = list(in2)
        for j, _ in slots:
            template[j] = None  # filled per call; the template holds no call's tensors
        return cls(fn, template, slots, isinstance(out, Tensor))

    def __call__(self, args: tuple):
        own, inputs = _tensors(args), list(self.template)
        for j, i in self.slots:
            inputs[j] = own[i]
        res = self.fn(inputs)
        return res[0] if self.single else tuple(res)


def positions(start: int, n: int, device) -> Tensor:
    """[n] long: start, start+1, ..."""
    return torch.arange(start, start + n, dtype=torch.long, device=device)


def pad_rows(x: Tensor, n: int) -> Tensor:
    """x [B, M, ...] -> a new [B, n, ...] with zero rows appended (n >= M), always freshly laid out: a
    compiled step is specialised on its inputs' strides, and a slice of a longer prompt has its own
    (a new graph per prompt length)."""
    out = x.new_zeros(x.shape[0], n, *x.shape[2:])
    out[:, :x.shape[1]] = x
    return out
