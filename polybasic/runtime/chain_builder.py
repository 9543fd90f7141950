"""Chains from their specs: build the levels a `ChainSpec` names (see runtime.chainspec).

`build_chain(spec, target)` checks every file first (headers only), then builds each level with
its kind's builder; `parse_chain(text, target)` is the `--chain` spelling parsed and built.
"""
from __future__ import annotations

import torch

from polybasic._lazy import load_entry
from polybasic.errors import ConfigError
from polybasic.models.decoder import Transformer
from polybasic.models.eagle_head import load_head
from polybasic.models.loader import LoadedModel, load_model
from polybasic.models.tokenizer_check import check_same_tokenizer
from polybasic.quant import load_quantized
from polybasic.quant.api import load_quantized_model, quant_header, quantize_head
from polybasic.quant.linear import keep_dense_for_prefill
from polybasic.runtime.chainspec import LEVEL_KINDS, ChainSpec, LevelSpec, check_chain_files, named, parse_chain_spec
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import Level, ModelLevel, NGramLevel
from polybasic.runtime.with_lookup import LOOKUP_MIN_NGRAM, WithLookup


def build_ngram(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    return NGramLevel(max_ngram=spec.max_ngram, name=spec.name, tree_width=spec.tree_width)


def build_eagle(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    """A head on the features of the level above; with spec.kernel its decoder block on 4-bit weights."""
    head = load_head(spec.path, above.model)
    if spec.kernel:
        quantize_head(head, spec.kernel)
    return EagleLevel(head, above, name=spec.name)


def build_quantized(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    """A quantized copy of the target, or of another model with the target's tokenizer (a sibling,
    e.g. `quantize.siblings`): that one is built from its own model's config. In the kernels recorded
    at save time, or in spec.kernel for every quantized layer."""
    source, kernel = quant_header(spec.path).get("source", ""), spec.kernel or None
    if source and source != target.name:
        lm = load_quantized_model(spec.path, device, kernel)
        check_same_tokenizer(target.tokenizer, lm.tokenizer, spec.name)
        model, tokenizer = lm.model, lm.tokenizer
    else:
        model = load_quantized(spec.path, lambda: Transformer(target.args), device=device, kernel=kernel)
        tokenizer = target.tokenizer
    keep_dense_for_prefill(model)  # a level prefills every prompt: at dense speed, for memory
    return ModelLevel(model, name=spec.name, tokenizer=tokenizer)


def _model_level(source: str, spec: LevelSpec, device: torch.device) -> Level:
    lm = load_model(source, spec.dtype, device)
    return ModelLevel(lm.model, name=spec.name, tokenizer=lm.tokenizer)


def build_target(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    return _model_level(target.name, spec, device)


def build_model(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    """Another model (e.g. a smaller sibling of the target): its tokenizer must be the target's."""
    level = _model_level(spec.source, spec, device)
    check_same_tokenizer(target.tokenizer, level.tokenizer, spec.name)
    return level


def build_level(spec: LevelSpec, target: LoadedModel, above: Level, device: torch.device) -> Level:
    """One level by its kind's builder, drafting token trees of spec.tree_width as a bottom level
    (Level.propose_tree), with prompt lookup's continuation merged in where spec.lookup is set; `above`: the
    level it sits under (an EAGLE head reads its features)."""
    level = load_entry(LEVEL_KINDS[spec.kind].builder)(spec, target, above, device)
    level.tree_width = spec.tree_width
    if spec.lookup:  # its trees also hold prompt lookup's continuation (with_lookup.LOOKUP_MIN_NGRAM)
        lookup = NGramLevel(max_ngram=spec.lookup, min_ngram=min(LOOKUP_MIN_NGRAM, spec.lookup),
                            name=f"ngram:{spec.lookup}")
        level = WithLookup(level, lookup, name=spec.name)
    return level


def build_chain(spec: ChainSpec, target: LoadedModel, device: str | torch.device | None = None,
                flag: str = "chain", cache: dict[str, Level] | None = None) -> list[Level]:
    """Target level first, then the spec's levels, every one on `device` (default: the target's, where
    its verification reads their drafts); every file is checked before any level loads.

    cache: levels built by earlier calls, reused when the same level appears again (chains that run
    one after another, as a benchmark's do, share one copy of each model). A level that reads the
    features of the one above it is keyed by the whole chain down to it."""
    check_chain_files(spec, flag)
    device = torch.device(target.model.device if device is None else device)
    if device != torch.device(target.model.device):
        raise ConfigError(f"{flag}: levels asked for on {device}, but the target is on {target.model.device}; "
                          "load the target on the same device")
    cache = {} if cache is None else cache
    if "target" not in cache:  # shared too: a cached head reads the features of this very level
        cache["target"] = ModelLevel(target.model, name="target", tokenizer=target.tokenizer)
    levels: list[Level] = [cache["target"]]
    for i, lv in enumerate(spec.levels):
        key = "+".join(x.name for x in spec.levels[:i + 1]) if LEVEL_KINDS[lv.kind].drafts_on_features else lv.name
        if key not in cache:
            with named(f"{flag}: level '{lv.name}'"):
                cache[key] = build_level(lv, target, levels[-1], device)
        levels.append(cache[key])
    return levels


def parse_chain(text: str, target: LoadedModel, device: str | torch.device | None = None,
                flag: str = "chain", cache: dict[str, Level] | None = None) -> list[Level]:
    """The levels `text` spells (see runtime.chainspec), the target's first. May start with 'target+'."""
    return build_chain(parse_chain_spec(text, flag), target, device, flag, cache)
