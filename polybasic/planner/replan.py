"""Re-plan a loaded chain bundle for this machine: its levels' costs re-measured here, its pair
acceptances kept (`polybasic generate|bench --bundle B --reprofile`)."""
from __future__ import annotations

from polybasic.errors import ConfigError
from polybasic.planner.measure import cost_curve
from polybasic.planner.profile import LevelProfile, Profile
from polybasic.planner.search import SearchSpace, plan
from polybasic.runtime.bundle import MANIFEST, BundleDecoder, Decoding
from polybasic.runtime.chain import Chain


def reprofile(dec: BundleDecoder, reps: int = 5, k_values: tuple[int, ...] = tuple(range(1, 9)),
              thresholds: tuple[int, ...] = (2, 4, 6, 8, 10, 12)) -> dict:
    """Re-measure the levels' forward costs of a loaded bundle on this machine, keep its measured pair
    acceptances (they do not depend on the machine), re-plan among its levels (any sub-chain, k,
    thresholds) and make `dec` decode with the new best. Returns the new plan row."""
    m = dec.manifest
    names = (m.plan or {}).get("levels")
    if not m.profile or not names:
        raise ConfigError(f"bundle: {dec.folder}: {MANIFEST} holds no profile and plan to re-plan from; "
                          "export the bundle with `polybasic run` (profile, plan, export)")
    old = Profile.from_dict(m.profile, "manifest profile")
    by_name = dict(zip(names, dec.chain.levels))
    fresh = []
    for name, level in by_name.items():
        lp = old.level(name)
        curve = cost_curve(level, lp.cost.tokens, lp.cost.context, reps)
        fresh.append(LevelProfile(name, lp.kind, curve, lp.base))
    profile = Profile(old.target, fresh, [p for p in old.pairs if {p.verifier, p.drafter} <= set(names)],
                      dec.device, old.sampling)
    best = plan(profile, SearchSpace(list(k_values), list(thresholds), len(names),
                                     (m.plan or {}).get("new_tokens", 128))).best
    d = m.decoding
    dec.chain = Chain([by_name[n] for n in best.chain], k=best.k, thresholds=best.thresholds or None,
                      eos=dec.chain.eos, adaptive_k=d.adaptive_k, draft_confidence=d.draft_confidence)
    dec.manifest.plan = {**(m.plan or {}), "chain": best.spec, "levels": best.chain, "k": best.k,
                         "thresholds": best.thresholds, "predicted_speedup": best.speedup,
                         "predicted_speedup_lemma": best.speedup_lemma, "tau": best.tau,
                         "reprofiled": True, "compiled": False}  # cost_curve timed the levels as loaded: eager
    dec.manifest.decoding = Decoding(best.k, tuple(best.thresholds) or None, d.adaptive_k, d.temperature,
                                     d.top_k, d.top_p, d.draft_confidence)
    dec.manifest.profile = profile.to_dict()
    return dec.manifest.plan
