"""Lossless methods against their own reference (greedy runs only).

A lossless method (our chains: chain*, pld*, eagle*) must emit its target's plain greedy decoding token for
token. Its reference: vanilla-compiled for the methods whose target runs compiled steps (pld-compiled,
chain-compiled: compiled steps round otherwise than eager ones), vanilla for the rest (chain-drafts-compiled
keeps the target eager). Peers (llamacpp, hf) and other vanillas (vanilla:DTYPE, vanilla-dense) run other
kernels or weights and are never checked.
"""
from __future__ import annotations

from polybasic.bench.runner import COMPILED_REFERENCE, REFERENCE, Record

LOSSLESS = ("chain", "pld", "eagle")  # method name prefixes
TARGET_COMPILED = ("pld-compiled", "chain-compiled")  # methods whose target's steps are compiled


def is_lossless(method: str) -> bool:
    return method.split(":", 1)[0].startswith(LOSSLESS)


def reference_of(method: str) -> str:
    return COMPILED_REFERENCE if method.split(":", 1)[0] in TARGET_COMPILED else REFERENCE


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position (0 = the first new token) where a and b differ, a length counting; None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatches(records: list[Record], reference: list[Record]) -> list[dict]:
    """[{question_id, category, position}] for the records whose tokens differ from the reference's."""
    ref = {(r.question_id, r.category): r.tokens for r in reference}
    out = []
    for r in records:
        pos = first_difference(r.tokens, ref[(r.question_id, r.category)])
        if pos is not None:
            out.append({"question_id": r.question_id, "category": r.category, "position": pos})
    return out


def add_identity(summary: dict[str, dict], records: list[Record], greedy: bool) -> None:
    """For each lossless method of a greedy run: summary[m]["identity_reference"] (None: not in the run,
    not checked) and summary[m]["mismatches"] (None when not checked)."""
    if not greedy:
        return
    for m in [m for m in summary if is_lossless(m)]:
        ref = reference_of(m)
        have = ref in summary
        summary[m]["identity_reference"] = ref if have else None
        summary[m]["mismatches"] = mismatches([r for r in records if r.method == m],
                                              [r for r in records if r.method == ref]) if have else None


def not_identical(doc: dict) -> list[str]:
    """The lossless methods of a bench document that differ from their reference on some prompt."""
    return [m for m, v in doc["methods"].items() if v.get("mismatches")]


def identity_lines(doc: dict) -> list[str]:
    """A warning per lossless method that differs from its reference (its prompts and first differing
    positions), a note per one left unchecked."""
    lines = []
    for m, v in doc["methods"].items():
        if v.get("mismatches"):
            where = "; ".join(f"question {x['question_id']} ({x['category']}) at token {x['position']}"
                              for x in v["mismatches"])
            lines.append(f"WARNING: {m} is lossless but its tokens differ from {v['identity_reference']}'s on "
                         f"{len(v['mismatches'])}/{v['prompts']} prompts, first at: {where}")
        elif "mismatches" in v and v["mismatches"] is None:
            lines.append(f"note: {m}: identity not checked, its reference {reference_of(m)} is not in the run "
                         "(add it to --methods)")
    return lines
