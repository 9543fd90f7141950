"""Decoding methods under benchmark: a registry of name -> runner factory.

A runner takes prompt ids and a seed and returns the new token ids with the wall time measured the
same way for every method: from prompt ids in hand to the last new token (prefill included). Add a
method with `@register("name")` on a factory `(ctx, arg) -> Runner`; a name may carry an argument
after a colon (`chain:target+quant+head` calls the `chain` factory with arg "target+quant+head").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polybasic.errors import ConfigError
from polybasic.runtime.context import timed
from polybasic.runtime.sampling import SamplingConfig, make_generator


@dataclass
class Output:
    tokens: list[int]  # new tokens only
    wall_s: float
    tau: float | None = None  # new tokens per target forward (chain methods)
    accepted: list[int] | None = None  # chain methods: the bottom link's accepted drafts per verification


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
    source: str = ""  # the target's model source (chain specs may say 'target@DTYPE')
    max_prompt_tokens: int = 0  # the longest prompt of the run (compiled runners size caches once)
    gguf: Path | None = None  # the GGUF the target was expanded from (compiled steps read its codes)
    hf_loader: Callable[[], object] | None = None  # loads the transformers model on first use
    bundle: object = None  # a runtime.bundle.BundleDecoder: method `chain` runs its chain
    _hf: object = field(default=None, repr=False)

    def hf_model(self):
        if self._hf is None:
            if self.hf_loader is None:
                raise ConfigError("methods: transformers baselines need a model source; pass --model")
            self._hf = self.hf_loader()
        return self._hf


METHODS: dict[str, Callable[[BenchContext, str | None], Runner]] = {}
TAKES_ARG: set[str] = set()  # methods that accept `name:arg`


def register(name: str, takes_arg: bool = False):
    def deco(factory):
        METHODS[name] = factory
        if takes_arg:
            TAKES_ARG.add(name)
        return factory
    return deco


def parse_methods(spec: str) -> list[str]:
    """'vanilla,hf,pld' -> names, checked against the registry; vanilla always first (the reference)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n.split(":", 1)[0] not in METHODS]
    if unknown:
        raise ConfigError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods: '{spec}' names a method twice; list each once")
    for n in names:
        base, colon, arg = n.partition(":")
        if colon and (base not in TAKES_ARG or not arg):
            raise ConfigError(f"methods: '{n}': " + (f"empty argument after '{base}:'" if base in TAKES_ARG
                                                    else f"'{base}' takes no ':' argument"))
    return ["vanilla"] + [n for n in names if n != "vanilla"]


def make_runner(name: str, ctx: BenchContext) -> Runner:
    base, _, arg = name.partition(":")
    return METHODS[base](ctx, arg or None)


def _generate_runner(ctx: BenchContext, model) -> Runner:
    from polybasic.runtime.generate import generate_tokens

    def run(prompt_ids: list[int], seed: int) -> Output:
        gen = make_generator(seed, model.device)
        with timed(model.device) as t:
            tokens = list(generate_tokens(model, prompt_ids, ctx.max_new_tokens, ctx.sampling, ctx.eos, gen))
        return Output(tokens, t.seconds)
    return run


@register("vanilla")
def _vanilla(ctx: BenchContext, arg: str | None) -> Runner:
    """Our lean decoder, one token per forward."""
    return _generate_runner(ctx, ctx.model)


def _compiled_runner(ctx: BenchContext, gguf: Path | None) -> Runner:
    import copy

    from polybasic.models.prepare import compile_for_device

    model = copy.deepcopy(ctx.model)
    compile_for_device(model, gguf, "--methods vanilla-compiled")
    if ctx.max_prompt_tokens:
        model.setup_caches(min(model.args.max_seq_len, ctx.max_prompt_tokens + ctx.max_new_tokens))
    return _generate_runner(ctx, model)


@register("vanilla-compiled")
def _vanilla_compiled(ctx: BenchContext, arg: str | None) -> Runner:
    """Our lean decoder with its one-token step torch.compiled (a separate copy of the target; it
    compiles during warm-up, with caches sized once for the longest prompt of the run). With a GGUF
    source, the step reads the file's block codes, expanded in registers to the same fp32 weights."""
    return _compiled_runner(ctx, ctx.gguf)


@register("vanilla-compiled-dense")
def _vanilla_compiled_dense(ctx: BenchContext, arg: str | None) -> Runner:
    """As vanilla-compiled, reading the expanded fp32 weights (4 bytes per weight)."""
    return _compiled_runner(ctx, None)


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


def _chain_runner(ctx: BenchContext, make_levels: Callable[[], list], thresholds: list[int] | None = None,
                  k: int | None = None, adaptive_k: bool | None = None) -> Runner:
    from polybasic.runtime.chain import Chain

    def run(prompt_ids: list[int], seed: int) -> Output:
        gen = make_generator(seed, ctx.model.device)  # the chain samples on the target's device
        with timed(ctx.model.device) as t:
            chain = Chain(make_levels(), k=k or ctx.draft_tokens, thresholds=thresholds, eos=ctx.eos,
                          adaptive_k=ctx.adaptive_k if adaptive_k is None else adaptive_k)
            tokens, stats = chain.generate(prompt_ids, ctx.max_new_tokens, sampling=ctx.sampling,
                                           generator=gen)
        return Output(list(tokens), t.seconds, float(stats.tau) if stats.tau is not None else None,
                      list(stats.links[-1].accepted))
    return run


@register("pld")
def _pld(ctx: BenchContext, arg: str | None) -> Runner:
    """Our chain with two levels: the target verifies drafts from an n-gram prompt-lookup level."""
    from polybasic.runtime.levels import ModelLevel, NGramLevel

    return _chain_runner(ctx, lambda: [ModelLevel(ctx.model, name="target"),
                                       NGramLevel(max_ngram=3, min_ngram=1, name="ngram")])


@register("chain", takes_arg=True)
def _chain(ctx: BenchContext, arg: str | None) -> Runner:
    """A chain spelled out below the target, e.g. chain:target+target@bfloat16+ngram
    (see polybasic.runtime.spec), or with no spec the bundle's chain with its k and thresholds.
    Lower levels are loaded once and reused for every prompt."""
    if arg is None:
        if ctx.bundle is None:
            raise ConfigError("methods: 'chain' without a spec runs a bundle's chain; pass --bundle")
        d = ctx.bundle.manifest.decoding
        levels = ctx.bundle.chain.levels
        return _chain_runner(ctx, lambda: levels, None if d.thresholds is None else list(d.thresholds), d.k,
                             d.adaptive_k)
    from polybasic.models.loader import LoadedModel
    from polybasic.runtime.spec import parse_chain

    target = LoadedModel(ctx.model, ctx.tokenizer, ctx.model.args, ctx.source, None)
    levels = parse_chain(arg, target, flag=f"--methods chain:{arg}")
    return _chain_runner(ctx, lambda: levels)
