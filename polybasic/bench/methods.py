"""Decoding methods under benchmark: a registry of name -> runner factory.

A runner takes prompt ids and a seed and returns the new token ids with the wall time measured the
same way for every method: from prompt ids in hand to the last new token (prefill included). Add a
method with `@register("name")` on a factory `(ctx, arg) -> Runner`; a name may carry an argument
after a colon (`chain:target+quant+head` calls the `chain` factory with arg "target+quant+head"),
declared with `register(name, MethodArg(...))`, whose cheap check runs before any model loads. Peer
engines (llama.cpp) run in a child process each (PeerRunner, polybasic.bench.peers).
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polybasic.bench import PEER_TIMEOUT_S
from polybasic.bench.peers import PeerProcess
from polybasic.config import SamplingConfig, check_dtype
from polybasic.errors import ConfigError
from polybasic.models import load_hf_model
from polybasic.models.loader import LoadedModel
from polybasic.models.preflight import check_source, split_kernel
from polybasic.models.static import covering, decode_sizes
from polybasic.quant.api import load_any_model
from polybasic.runtime.chain import Chain, scored_rows
from polybasic.runtime.chain_builder import build_chain, parse_chain
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.context import timed
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from polybasic.runtime.sampling import make_generator


@dataclass
class Output:
    tokens: list[int]  # new tokens only
    wall_s: float
    tau: float | None = None  # new tokens per target forward (chain methods)
    accepted: list[int] | None = None  # chain methods: the bottom link's accepted drafts per non-empty draft
    links: dict[str, list[int]] | None = None  # chain methods: every link's, by name 'verifier<-drafter'


Runner = Callable[[list[int], int], Output]  # (prompt_ids, seed) -> Output


@dataclass
class BenchContext:
    """What runners share: the loaded target (lean), its tokenizer, and the request settings."""
    model: object  # polybasic.models.Transformer
    tokenizer: object
    eos: set[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    draft_tokens: int = 8  # k of the n-gram / prompt-lookup drafters
    adaptive_k: bool = False  # chains adapt the bottom draft length (Chain.adaptive_k)
    draft_confidence: float | None = None  # chains end drafts below this confidence (Chain.draft_confidence;
    # None: the bundle's for its chain, else 0)
    thresholds: list[int] | None = None  # chain:SPEC's middle levels (Chain.thresholds; None: k + 1 each)
    step_sizes: list[int] | None = None  # token counts the *-compiled methods compile (None: models.static's)
    compile_mode: str = "layers"  # the *-compiled methods' graphs on a CPU (models.prepare.compile_for_device)
    source: str = ""  # the target's model source (chain specs may say 'target@DTYPE')
    dtype: str = "float32"  # the target's dtype (--dtype): hf-assisted's assistant defaults to it
    prompt_tokens: tuple[int, ...] = ()  # every prompt's length in the run (compiled runners warm each one's
    # cache size; llama.cpp's context fits the longest)
    gguf: Path | None = None  # the GGUF the target was expanded from (compiled steps read its codes)
    hf_loader: Callable[[], object] | None = None  # loads the transformers model on first use
    bundle: object = None  # a runtime.bundle.BundleDecoder: method `chain` runs its chain
    levels: dict = field(default_factory=dict)  # chain levels by spelling, shared by the chain:SPEC methods
    compiled_levels: dict = field(default_factory=dict)  # the same for the compiled methods (their own copies)
    drafts_compiled_levels: dict = field(default_factory=dict)  # chain-drafts-compiled's: the eager target over compiled copies
    compiled_target: object = None  # the target's compiled copy, shared by the compiled chain methods
    compile_s: dict = field(default_factory=dict)  # method -> seconds its models took to compile and warm
    peer_timeout: float = PEER_TIMEOUT_S  # seconds a peer's process may take per request before it counts as hung
    _hf: object = field(default=None, repr=False)

    @property
    def max_prompt_tokens(self) -> int:
        """The run's longest prompt (0: none given)."""
        return max(self.prompt_tokens, default=0)

    def hf_model(self):
        if self._hf is None:
            if self.hf_loader is None:
                raise ConfigError("methods: transformers baselines need a model source; pass --model")
            self._hf = self.hf_loader()
        return self._hf


@dataclass(frozen=True)
class MethodArg:
    """The `name:ARG` argument a method takes: its spelling in help texts, whether the method needs
    one, and a cheap check (no torch, no model load) raising ConfigError that starts with `field`."""
    form: str  # e.g. "DTYPE"
    required: bool = False
    check: Callable[[str, str], None] = lambda arg, field: None  # (arg, field) -> None


METHODS: dict[str, Callable[[BenchContext, str | None], Runner]] = {}
ARGS: dict[str, MethodArg] = {}  # methods that accept `name:arg`
NEEDS: dict[str, Callable[[], str | None]] = {}  # methods that need an optional package: why they can't run, or None


def register(name: str, arg: MethodArg | None = None, needs: Callable[[], str | None] | None = None):
    def deco(factory):
        METHODS[name] = factory
        if arg is not None:
            ARGS[name] = arg
        if needs is not None:
            NEEDS[name] = needs
        return factory
    return deco


def parse_methods(spec: str) -> list[str]:
    """'vanilla,hf,pld' -> names, checked against the registry with their arguments (before any model
    loads); vanilla always first (the reference)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n.split(":", 1)[0] not in METHODS]
    if unknown:
        raise ConfigError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods: '{spec}' names a method twice; list each once")
    for n in names:
        base, colon, arg = n.partition(":")
        if colon and (base not in ARGS or not arg):
            raise ConfigError(f"methods: '{n}': " + (f"empty argument after '{base}:'" if base in ARGS
                                                    else f"'{base}' takes no ':' argument"))
        if base in ARGS and ARGS[base].required and not colon:
            raise ConfigError(f"methods: '{n}' needs an argument; spell it {base}:{ARGS[base].form}")
        if arg:
            ARGS[base].check(arg, f"methods: '{n}'")
    missing = {n: why for n in names if (why := NEEDS.get(n.split(":", 1)[0], lambda: None)())}
    for n, why in missing.items():
        print(f"[methods: {n} skipped: {why}]", file=sys.stderr)
    return ["vanilla"] + [n for n in names if n != "vanilla" and n not in missing]


def split_source_dtype(text: str) -> tuple[str, str | None]:
    """'SOURCE@DTYPE' -> (SOURCE, DTYPE); no '@' (or a '/' after it, a path) -> (text, None)."""
    source, at, dtype = text.rpartition("@")
    return (text, None) if not at or "/" in dtype else (source, dtype)


def make_runner(name: str, ctx: BenchContext) -> Runner:
    base, _, arg = name.partition(":")
    return METHODS[base](ctx, arg or None)


def _generate_runner(ctx: BenchContext, model) -> Runner:
    def run(prompt_ids: list[int], seed: int) -> Output:
        gen = make_generator(seed, model.device)
        with timed(model.device) as t:
            tokens = list(generate_tokens(model, prompt_ids, ctx.max_new_tokens, ctx.sampling, ctx.eos, gen))
        return Output(tokens, t.seconds)
    return run


def _check_dtype_arg(arg: str, field: str) -> None:
    check_dtype(arg, field)


@register("vanilla", MethodArg("DTYPE", check=_check_dtype_arg))
def _vanilla(ctx: BenchContext, arg: str | None) -> Runner:
    """Our lean decoder, one token per forward: on the target (the reference), or with vanilla:DTYPE
    on the target loaded again in DTYPE (a second copy in memory)."""
    return _generate_runner(ctx, ctx.model if arg is None else _target_in(ctx, arg, f"vanilla:{arg}"))


def _target_in(ctx: BenchContext, dtype: str | None, method: str, source: str | None = None):
    """A separate copy of the target: in `dtype` loaded again from its source (or from `source`), or a
    deep copy."""
    if dtype is None:
        import copy

        return copy.deepcopy(ctx.model)

    if not ctx.source:
        raise ConfigError(f"methods: '{method}' loads the target again; pass --model")
    return load_any_model(source or ctx.source, dtype, ctx.model.device).model


@register("vanilla-dense", MethodArg("DTYPE", check=_check_dtype_arg))
def _vanilla_dense(ctx: BenchContext, arg: str | None) -> Runner:
    """Our lean decoder on the target without a codes kernel: for a 'NAME@w4a8' target, NAME's weights
    expanded into DTYPE (default --dtype), the dense model that kernel is measured against (the same
    file's weights, activations not quantized); for any other target, the target loaded again."""
    return _generate_runner(ctx, _target_in(ctx, arg or ctx.dtype, "vanilla-dense", split_kernel(ctx.source)[0]))


def _compiled_runner(ctx: BenchContext, gguf: Path | None, dtype: str | None, method: str) -> Runner:
    model = _target_in(ctx, dtype, f"{method}:{dtype}")
    _compile_levels(ctx, [ModelLevel(model)], gguf, f"{method}:{dtype}" if dtype else method,
                    decode_sizes(ctx.step_sizes, model.device), decode=True)
    return _generate_runner(ctx, model)


def _compile_levels(ctx: BenchContext, levels: list, gguf: Path | None, method: str, sizes=None,
                    decode: bool = False, rows: list[int] = ()) -> None:
    """Compile `levels` (target first) for the run's requests, every step size they use (`sizes`, default the run's
    --step-sizes; with `decode`, a lone model's two plain-decoding steps; plus `rows`, the most rows a chain's
    levels score in one call, runtime.chain.scored_rows, each level's sizes up to its own) and cache size at once
    (no compile lands in a timed prompt), and record the time it took in ctx.compile_s[method]."""
    cap = ctx.model.args.max_seq_len
    lengths = [min(cap, n + ctx.max_new_tokens + 1) for n in ctx.prompt_tokens] or [min(cap, 256)]
    say = lambda msg: print(f"[{method}: {msg}]", file=sys.stderr)  # noqa: E731
    given = covering(sizes or ctx.step_sizes, (), ctx.model.device)  # checked, the device's default if none
    sizes = covering(given, rows, ctx.model.device)
    if added := sorted(set(sizes) - set(given)):
        say(f"step sizes {','.join(map(str, sizes))}: with {','.join(map(str, added))}, "
            "the most rows a level verifies in a call, which would run padded to the largest size")
    ctx.compile_s[method] = compile_levels(levels, max(lengths), gguf, sizes, say, f"--methods {method}",
                                           lengths, decode, rows, ctx.compile_mode)


@register("vanilla-compiled", MethodArg("DTYPE", check=_check_dtype_arg))
def _vanilla_compiled(ctx: BenchContext, arg: str | None) -> Runner:
    """Our lean decoder with its one-token step torch.compiled (a separate copy of the target, in
    DTYPE with vanilla-compiled:DTYPE; it compiles during warm-up, for every prompt's cache size).
    With a GGUF source and fp32 weights, the step reads the file's block codes, expanded in registers
    to the same fp32 weights (other dtypes read their dense weights)."""
    return _compiled_runner(ctx, ctx.gguf, arg, "vanilla-compiled")


@register("vanilla-compiled-dense", MethodArg("DTYPE", check=_check_dtype_arg))
def _vanilla_compiled_dense(ctx: BenchContext, arg: str | None) -> Runner:
    """As vanilla-compiled, reading the expanded weights (4 bytes per weight in fp32)."""
    return _compiled_runner(ctx, None, arg, "vanilla-compiled-dense")


def _hf_runner(ctx: BenchContext, **extra) -> Runner:
    hf = ctx.hf_model()
    s = ctx.sampling
    kw = dict(max_new_tokens=ctx.max_new_tokens, do_sample=not s.greedy, eos_token_id=sorted(ctx.eos),
              pad_token_id=min(ctx.eos) if ctx.eos else None, **extra)
    if s.greedy:  # neutralise sampling defaults a generation_config may carry
        kw.update(temperature=None, top_k=None, top_p=None)
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p)

    @torch.inference_mode()
    def run(prompt_ids: list[int], seed: int) -> Output:
        torch.manual_seed(seed)  # transformers samples from the global generators (every device's)
        with timed(hf.device) as t:
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=hf.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        return Output(_cut_at_eos(out[0, len(prompt_ids):].tolist(), ctx.eos), t.seconds)
    return run


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Keep up to the first EOS (inclusive), as our decoders do; assisted generation may overshoot."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


@register("hf")
def _hf(ctx: BenchContext, arg: str | None) -> Runner:
    """transformers `generate` on the same checkpoint."""
    return _hf_runner(ctx)


@register("hf-pld")
def _hf_pld(ctx: BenchContext, arg: str | None) -> Runner:
    """transformers prompt-lookup decoding (n-gram drafts from the prompt)."""
    return _hf_runner(ctx, prompt_lookup_num_tokens=ctx.draft_tokens, max_matching_ngram_size=3)


def _check_assistant(arg: str, field: str) -> None:
    source, dtype = split_source_dtype(arg)
    if dtype is not None:
        check_dtype(dtype, field)
    if check_source(source, field) == "quantized":
        raise ConfigError(f"{field}: a quantized copy has no transformers model; pass a short name, .gguf "
                          "file, Hugging Face folder or Hub id")


@register("hf-assisted", MethodArg("SOURCE[@DTYPE]", required=True, check=_check_assistant))
def _hf_assisted(ctx: BenchContext, arg: str | None) -> Runner:
    """transformers assisted generation (`generate(assistant_model=...)`) with the assistant SOURCE
    (any source --model accepts) in DTYPE (default: the target's --dtype). The assistant must share
    the target's tokenizer; only transformers' own checks apply."""
    source, dtype = split_source_dtype(arg)
    hf = ctx.hf_model()
    return _hf_runner(ctx, assistant_model=load_hf_model(source, dtype or ctx.dtype, hf.device))


def _chain_runner(ctx: BenchContext, make_levels: Callable[[], list], thresholds: list[int] | None = None,
                  k: int | None = None, adaptive_k: bool | None = None, draft_confidence: float = 0.0) -> Runner:
    """draft_confidence: the chain's own (a bundle's); --draft-confidence overrides it."""
    confidence = draft_confidence if ctx.draft_confidence is None else ctx.draft_confidence

    def run(prompt_ids: list[int], seed: int) -> Output:
        gen = make_generator(seed, ctx.model.device)  # the chain samples on the target's device
        with timed(ctx.model.device) as t:
            chain = Chain(make_levels(), k=k or ctx.draft_tokens, thresholds=thresholds, eos=ctx.eos,
                          adaptive_k=ctx.adaptive_k if adaptive_k is None else adaptive_k,
                          draft_confidence=confidence)
            tokens, stats = chain.generate(prompt_ids, ctx.max_new_tokens, sampling=ctx.sampling,
                                           generator=gen)
        # per draft: a verification of an empty draft (the budget's last token, or the token the target
        # commits from its prefill) says nothing of the drafter; tau still counts its target forward
        links = {f"{ln.verifier}<-{ln.drafter}": [a for a, d in zip(ln.accepted, ln.drafted) if d]
                 for ln in stats.links}
        return Output(list(tokens), t.seconds, float(stats.tau) if stats.tau is not None else None,
                      links[f"{stats.links[-1].verifier}<-{stats.links[-1].drafter}"], links)
    run.chain = (make_levels, k or ctx.draft_tokens, thresholds, confidence)  # what bench.predict profiles
    return run


@register("pld")
def _pld(ctx: BenchContext, arg: str | None) -> Runner:
    """Our chain with two levels: the target verifies drafts from an n-gram prompt-lookup level."""
    return _chain_runner(ctx, lambda: [ModelLevel(ctx.model, name="target"),
                                       NGramLevel(max_ngram=3, min_ngram=1, name="ngram")])


@register("chain", MethodArg("SPEC"))
def _chain(ctx: BenchContext, arg: str | None) -> Runner:
    """A chain spelled out below the target, e.g. chain:target+target@bfloat16+ngram
    (see polybasic.runtime.chain_builder), or with no spec the bundle's chain with its k and thresholds.
    Lower levels are loaded once and reused for every prompt."""
    if arg is None:
        if ctx.bundle is None:
            raise ConfigError("methods: 'chain' without a spec runs a bundle's chain; pass --bundle")
        d = ctx.bundle.manifest.decoding
        levels = ctx.bundle.chain.levels
        return _chain_runner(ctx, lambda: levels, None if d.thresholds is None else list(d.thresholds), d.k,
                             d.adaptive_k, d.draft_confidence)

    target = LoadedModel(ctx.model, ctx.tokenizer, ctx.model.args, ctx.source, None)
    levels = parse_chain(arg, target, flag=f"--methods chain:{arg}", cache=ctx.levels)
    return _chain_runner(ctx, lambda: levels, _thresholds(ctx, levels))


def _thresholds(ctx: BenchContext, levels: list) -> list[int] | None:
    """--thresholds for a chain of these levels: the first one per middle level (a two-level chain has none)."""
    return None if ctx.thresholds is None else ctx.thresholds[:len(levels) - 2]


def _compiled_target(ctx: BenchContext, method: str) -> LoadedModel:
    """A copy of the target, shared by the compiled chain methods (its steps are compiled with the first)."""
    if ctx.compiled_target is None:
        ctx.compiled_target = LoadedModel(_target_in(ctx, None, method), ctx.tokenizer, ctx.model.args, ctx.source, None)
    return ctx.compiled_target


@register("pld-compiled")
def _pld_compiled(ctx: BenchContext, arg: str | None) -> Runner:
    """pld with the target's steps compiled (models.static; a separate copy of the target)."""
    levels = [ModelLevel(_compiled_target(ctx, "pld-compiled").model, name="target"),
              NGramLevel(max_ngram=3, min_ngram=1, name="ngram")]
    _compile_levels(ctx, levels, ctx.gguf, "pld-compiled", rows=scored_rows(ctx.draft_tokens, None, 2))
    return _chain_runner(ctx, lambda: levels)


@register("chain-compiled", MethodArg("SPEC"))
def _chain_compiled(ctx: BenchContext, arg: str | None) -> Runner:
    """As chain (a spec, or the bundle's chain without one), every model level and head running compiled
    static-shape steps (models.static): its own copies of the target and of the levels below it. Their
    compile time is spent before the timed prompts and reported apart."""
    method = f"chain-compiled:{arg}" if arg else "chain-compiled"
    target = _compiled_target(ctx, method)
    if arg is None:
        if ctx.bundle is None:
            raise ConfigError("methods: 'chain-compiled' without a spec runs a bundle's chain; pass --bundle")
        d = ctx.bundle.manifest.decoding
        levels = build_chain(ctx.bundle.manifest.chain, target, flag=f"--methods {method}", cache=ctx.compiled_levels)
        thresholds, k, adaptive = None if d.thresholds is None else list(d.thresholds), d.k, d.adaptive_k
        confidence = d.draft_confidence
    else:
        levels = parse_chain(arg, target, flag=f"--methods {method}", cache=ctx.compiled_levels)
        thresholds, k, adaptive, confidence = _thresholds(ctx, levels), None, None, 0.0
    _compile_levels(ctx, levels, ctx.gguf, method, rows=scored_rows(k or ctx.draft_tokens, thresholds, len(levels),
                                                                      levels[-1].tree_width))
    return _chain_runner(ctx, lambda: levels, thresholds, k, adaptive, confidence)


@register("chain-drafts-compiled", MethodArg("SPEC", required=True))
def _chain_drafts_compiled(ctx: BenchContext, arg: str | None) -> Runner:
    """As chain:SPEC with the levels below the target compiled (their own copies) and the target eager:
    its tokens are eager vanilla's to the bit, in any dtype (a compiled bf16 target rounds otherwise),
    while the drafting levels, which run most steps, lose Python's per-op overhead."""
    method = f"chain-drafts-compiled:{arg}"
    target = LoadedModel(ctx.model, ctx.tokenizer, ctx.model.args, ctx.source, None)
    levels = parse_chain(arg, target, flag=f"--methods {method}", cache=ctx.drafts_compiled_levels)
    _compile_levels(ctx, levels[1:], None, method, rows=scored_rows(ctx.draft_tokens, _thresholds(ctx, levels),
                                                                    len(levels), levels[-1].tree_width)[1:])
    return _chain_runner(ctx, lambda: levels, _thresholds(ctx, levels))


# -- peers: llama.cpp on the target's own GGUF file (the optional extra [peers]), each in its own process ----
LLAMA_CPP_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON '
                       '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install "llama-cpp-python>=0.3"')


def _llama_cpp_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama.cpp's Python binding is not installed: pip install 'polybasic[peers]' (llama-cpp-python "
                "builds llama.cpp from source with cmake and a C++ compiler, ~11 min on 2 cores); on an Intel Xeon "
                f"with AMX, where a native build segfaults in llama_decode, build it with: {LLAMA_CPP_AMX_BUILD}")
    return None


class PeerRunner:
    """A Runner whose engine decodes in a child process (polybasic.bench.peers): the same prompt ids,
    budget, EOS ids, sampler settings and seed as our methods; the wall time the child measured around its
    decode. A crash, exit or hang of the child raises MethodFailed."""

    def __init__(self, ctx: BenchContext, method: str, engine: str, settings: dict) -> None:
        self.process = PeerProcess(method, engine, {**_peer_settings(ctx), **settings}, ctx.peer_timeout)

    def __call__(self, prompt_ids: list[int], seed: int) -> Output:
        reply = self.process.request({"prompt": list(prompt_ids), "seed": seed})
        return Output(reply["tokens"], reply["wall_s"])

    def close(self) -> None:
        self.process.close()


def _peer_settings(ctx: BenchContext) -> dict:
    """The request settings every peer engine gets (JSON)."""
    s = ctx.sampling
    return {"max_new_tokens": ctx.max_new_tokens, "eos": sorted(ctx.eos), "temperature": s.temperature,
            "top_k": s.top_k, "top_p": s.top_p, "draft_tokens": ctx.draft_tokens,
            "threads": torch.get_num_threads(), "gpu": ctx.model.device.type == "cuda"}


def _llama_settings(ctx: BenchContext, method: str) -> dict:
    """llama.cpp's: the target's GGUF and a context for the run's longest prompt."""
    if ctx.gguf is None:
        raise ConfigError(f"methods: '{method}' runs the target's GGUF file in llama.cpp, but the target was not "
                          "loaded from one; pass a packaged short name or a .gguf file as --model")
    return {"gguf": str(ctx.gguf), "n_ctx": ctx.max_prompt_tokens + ctx.max_new_tokens + 8}


@register("llamacpp", needs=_llama_cpp_missing)
def _llamacpp(ctx: BenchContext, arg: str | None) -> Runner:
    """llama.cpp (through llama-cpp-python) decoding the target's own GGUF file: the CPU engine a user
    already has, side by side in the same run. Other kernels than ours: its greedy output agrees with
    vanilla's on most prompts, not all (the report's `identical` column counts them)."""
    return PeerRunner(ctx, "llamacpp", "polybasic.bench.llama_peer:llamacpp", _llama_settings(ctx, "llamacpp"))


@register("llamacpp-pld", needs=_llama_cpp_missing)
def _llamacpp_pld(ctx: BenchContext, arg: str | None) -> Runner:
    """llama.cpp with its prompt-lookup drafts (llama-cpp-python's LlamaPromptLookupDecoding, k =
    --draft-tokens, n-grams up to 3), the peer of our `pld`. Not bitwise lossless: llama.cpp's batched
    verification rounds otherwise than its one-token step, so its output may drift from `llamacpp`'s."""
    return PeerRunner(ctx, "llamacpp-pld", "polybasic.bench.llama_peer:llamacpp_pld",
                      _llama_settings(ctx, "llamacpp-pld"))
