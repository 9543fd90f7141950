"""The `profile` stage: every candidate level's forward cost and every verifier <- drafter pair's
acceptance, on the device the chain will run on, written as `<out>/profile.json` (planner.Profile).

Candidates are chain-level spellings (config.ProfileSection); the recipe's own outputs are named
`quantized`, `eagle:target`, `eagle:quantized`, and the profile names levels as the recipe does
(`chain_spelling` turns a profiled chain into the files of a run). Pairs: a model verifies every other model level
but the target, the n-gram proposer, and the EAGLE head trained on it. Acceptance is measured on
the last `profile.prompts` records of `profile.data` (never the benchmark, never the distill
stage's training prompts). Each measurement is cached in `<out>/profile/work/` as it finishes, so
an interrupted stage resumes with the ones left.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from polybasic.artifacts import announce, fault_point, write_json
from polybasic.config import SIBLING, ProfileSection, SamplingConfig
from polybasic.drafters.data import load_pairs
from polybasic.errors import ConfigError
from polybasic.models.prepare import check_compilable
from polybasic.models.static import covering
from polybasic.pipelines.quantize import sibling_folder
from polybasic.planner.measure import confidence_cut, cost_curve, level_profile, pair_acceptance, profile_tokens
from polybasic.planner.profile import CostCurve, PairProfile, Profile
from polybasic.runtime.chain_builder import build_level
from polybasic.runtime.chainspec import LEVEL_KINDS, named, parse_level_spec
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.levels import ModelLevel, kv_compatible
from polybasic.runtime.text import encode_prompt, eos_ids


OWN_HEADS = ("eagle:target", "eagle:quantized")


def own_head(name: str) -> tuple[str, str]:
    """'eagle:target@w4a8#2' -> ('eagle:target', '@w4a8#2') (a recipe head on a kernel, drafting trees; '|ngram':
    with prompt lookup); other names -> (name, '')."""
    base = re.split(r"[@#|]", name)[0]
    return (base, name[len(base):]) if base in OWN_HEADS else (name, "")


def own_level(name: str, out: Path) -> str:
    """The spelling of a recipe output's level name; other spellings as they are."""
    if name.startswith(SIBLING):
        return str(sibling_folder(out, name[len(SIBLING):]) / "model.safetensors")
    name, kernel = own_head(name)
    return {"quantized": str(out / "model.safetensors"),
            "eagle:target": f"eagle:{out / 'distill' / 'target' / 'head.safetensors'}{kernel}",
            "eagle:quantized": f"eagle:{out / 'distill' / 'quantized' / 'head.safetensors'}{kernel}"}.get(name, name)


def chain_spelling(names: list[str], out: Path) -> str:
    """The `--chain` spelling of a profiled chain (target first, recipe names) for the run in `out`."""
    return "+".join(own_level(n, Path(out)) for n in names[1:])


def _writer(name: str) -> str | None:
    """The stage that writes a recipe output level, if it is one."""
    if name.startswith(SIBLING):
        return "quantize"
    return {"quantized": "quantize", "eagle:target": "distill", "eagle:quantized": "distill"}.get(own_head(name)[0])


def _base_of(name: str) -> str:
    """The profile name of the level an EAGLE candidate drafts on."""
    return "quantized" if own_head(name)[0] == "eagle:quantized" else "target"


def candidates(recipe, out: Path) -> list[str]:
    """The recipe's candidate level names that apply to it: own outputs only when its stages make
    them (an eagle head only when its base is a candidate too)."""
    drafters = set(recipe.distill.drafters)
    names = []
    for name in recipe.profile.levels:
        head = own_head(name)[0]
        if head == "eagle:target" and "target" not in drafters:
            continue
        if head == "eagle:quantized" and ("quantized" not in drafters or "quantized" not in recipe.profile.levels):
            continue
        if name.startswith(SIBLING) and name[len(SIBLING):] not in recipe.quantize.siblings:
            raise ConfigError(f"profile.levels: '{name}' names a quantized sibling, but quantize.siblings "
                              f"{recipe.quantize.siblings} does not list {name[len(SIBLING):]!r}; add it there")
        names.append(name)
    return names


def held_out_prompts(recipe) -> list[str]:
    """The last `profile.prompts` prompts of profile.data; an error if the distill stage trains on them."""
    sec: ProfileSection = recipe.profile
    pairs = load_pairs(sec.data)
    if len(pairs) <= sec.prompts:
        raise ConfigError(f"profile.prompts: {sec.prompts} >= the {len(pairs)} records of {sec.data.path}; "
                          "lower it or use more data")
    start = len(pairs) - sec.prompts
    d = recipe.distill
    if "distill" in recipe.stages and d.data.path == sec.data.path and d.data.split == sec.data.split \
            and d.limit > start:
        raise ConfigError(f"profile.prompts: the last {sec.prompts} records of {sec.data.path} are among the "
                          f"distill stage's first {d.limit} training records; lower distill.limit to {start} "
                          "or profile on other data")
    return [q for q, _ in pairs[start:]]


def check_inputs(recipe, out: Path, upstream: set[str]) -> None:
    """Candidate spellings parse, their files exist unless an earlier stage of this run writes
    them, and the held-out prompts do not overlap the training prompts."""
    for name in candidates(recipe, Path(out)):
        with named(f"profile.levels: '{name}'"):
            spec = parse_level_spec(own_level(name, Path(out)))
            if _writer(name) not in upstream:
                LEVEL_KINDS[spec.kind].check_files(spec)
    held_out_prompts(recipe)
    if recipe.profile.compile:
        check_compilable(recipe.model.device, "profile.compile")


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _files(spelling: str) -> list:
    """(path, bytes, mtime) of every file a level spelling names, so a cached measurement of a level
    is not reused after its file was rewritten (a re-quantized copy, a retrained head)."""
    specs = [parse_level_spec(piece) for piece in spelling.split("+")]  # a head's file behind @KERNEL, #W, |ngram
    parts = {p for spec in specs for p in (spec.path, spec.source) if p}
    return sorted((p, Path(p).stat().st_size, Path(p).stat().st_mtime_ns) for p in parts if Path(p).is_file())


def _cached(work: Path, key: str, what: str, measure, to_dict, from_dict):
    """A measurement from its cache file, or measured now and cached (atomically)."""
    path = work / f"{key}.json"
    if path.is_file():
        announce(f"reused: {what} ({path})")
        return from_dict(json.loads(path.read_text()))
    announce(f"measuring: {what}")
    value = measure()
    write_json(path, to_dict(value))
    fault_point("profile.measure")
    return value


def run_stage(ctx) -> list[Path]:
    from dataclasses import asdict, replace

    recipe, out, lm = ctx.recipe, ctx.out, ctx.target
    sec: ProfileSection = recipe.profile
    sampling = SamplingConfig(temperature=sec.temperature, top_p=sec.top_p)
    prompts = [encode_prompt(lm.tokenizer, p) for p in held_out_prompts(recipe)]
    names = candidates(recipe, out)
    levels = {"target": ModelLevel(lm.model, name="target", tokenizer=lm.tokenizer)}
    for name in names:  # bases first: an eagle head drafts on a level built before it
        spec = parse_level_spec(own_level(name, out))
        above = levels[_base_of(name)] if spec.kind == "eagle" else levels["target"]
        levels[name] = build_level(spec, lm, above, lm.model.device)
        if levels[name].vocab_size is None:
            levels[name].vocab_size = levels["target"].vocab_size
    for n, lv in levels.items():  # profiled under the recipe's names: portable, unlike their file paths
        lv.name = n
    spell = {n: own_level(n, out) for n in levels}
    k_max = max([sec.k, *recipe.plan.k_values])
    tokens = list(profile_tokens(k_max))
    if sec.compile:
        _compile(list(levels.values()), lm, tokens, [sec.context + tokens[-1] + 2]
                 + [len(p) + sec.max_new_tokens + 1 for p in prompts])
    work = out / "profile" / "work"
    settings = {"context": sec.context, "reps": sec.reps, "tokens": tokens, "compile": sec.compile}
    profiled = {}
    for n, lv in levels.items():
        curve = _cached(work, "cost-" + _key(spell[n], _files(spell[n]), settings), f"cost curve of {spell[n]}",
                        lambda lv=lv: cost_curve(lv, tokens, sec.context, sec.reps), asdict,
                        lambda d: CostCurve(**d))
        if n != "target" and isinstance(lv, ModelLevel) and kv_compatible(lv.model, lm.model):
            # a chain hands it the target's K/V of the prompt (Chain.share_prompt_kv): no prefill of its own
            curve = replace(curve, prefill_ms=0.0)
        profiled[n] = level_profile(lv, curve)
    pairs = []
    eos = eos_ids(lm.tokenizer)
    for v, d in _pairs(profiled):
        cut = confidence_cut(levels[d], recipe.export.draft_confidence)  # the bundle's, as it drafts
        for k in (sec.measured_k_values or [sec.k]) if levels[d].tree_width > 1 or cut else [sec.k]:
            acc = {"k": k, "prompts": prompts, "sampling": asdict(sampling), "max_new_tokens": sec.max_new_tokens,
                   "compile": sec.compile, "draft_confidence": cut}  # compiled: the chain's overhead differs
            key = _key(spell[v], spell[d], _files(spell[v]), _files(spell[d]), acc)
            pairs.append(_cached(work, "pair-" + key, f"acceptance {spell[v]} <- {spell[d]} at k={k}",
                                 lambda v=v, d=d, k=k, cut=cut: pair_acceptance(
                                     levels[v], levels[d], prompts, k, sampling, sec.max_new_tokens, eos,
                                     draft_confidence=cut),
                                 asdict, lambda x: PairProfile(**x)))
    profile = Profile("target", list(profiled.values()), pairs, str(lm.model.device),
                      {"temperature": sec.temperature, "top_k": 0, "top_p": sec.top_p}, compiled=sec.compile)
    profile.save(out / "profile.json")
    for p in pairs:
        announce(f"  {p.verifier} <- {p.drafter}: mean accepted length {p.mean_accepted_length:.2f} at k={p.k}, "
                 f"rate {p.rate:.3f}")
    return [out / "profile.json"]


def _compile(levels: list, lm, tokens: list[int], lengths: list[int]) -> None:
    """Compile every level's steps (profile.compile), each size a forward of `tokens` rows takes as a bundle's
    compiled chain would run it (the device's step sizes, a call between them padded up), caches for `lengths`."""
    dev = lm.model.device
    sizes = covering(None, [tokens[-1]], dev)
    announce(f"compiling the levels' steps for the profile (sizes {','.join(map(str, sizes))}; profile.compile)")
    seconds = compile_levels(levels, max(lengths), lm.gguf_file, sizes, notify=announce, flag="profile.compile",
                             lengths=lengths)
    announce(f"compiled steps ready in {seconds:.1f} s")


def _pairs(profiled: dict) -> list[tuple[str, str]]:
    """(verifier, drafter) names to measure: a model verifies every other model level but the
    target, the n-gram proposer, and the head trained on it (the planner judges what pays)."""
    return [(v, d) for v, vp in profiled.items() if vp.kind == "model"
            for d, dp in profiled.items() if d not in (v, "target") and (dp.kind != "eagle" or _base_of(d) == v)]
