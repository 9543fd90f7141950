"""The README.md model card of a chain bundle, in Hugging Face conventions (YAML front matter, then
what it is, how to load it, the measured figures and the command that measures them again)."""
from __future__ import annotations

import json


def _front_matter(m) -> str:
    base = m.target.get("source", "")
    lines = ["---", "library_name: polybasic", "tags:", "- speculative-decoding", "- polybasic",
             "- text-generation"]
    if base.count("/") == 1:  # a Hub id
        lines.append(f"base_model: {base}")
    return "\n".join(lines + ["---", ""])


def _levels_table(m) -> list[str]:
    rows = ["| level | kind | weights |", "|---|---|---|",
            f"| target | {m.target.get('source')} ({m.target.get('dtype')}) | by reference, sha256 "
            f"`{str(m.target.get('sha256'))[:16]}...` |"]
    files = {v.get("level"): k for k, v in m.files.items()}
    for lv in m.chain.levels:
        where = files.get(lv.name) or (lv.path if lv.kind in ("quantized", "eagle") else "")
        if lv.kind == "model":
            where = f"{lv.source} by reference"
        rows.append(f"| {lv.name} | {lv.kind} | {where or '-'} |")
    return rows


def _figures(m) -> list[str]:
    plan = m.plan or {}
    out = []
    if plan.get("predicted_speedup") is not None:
        how = ", both on compiled steps" if plan.get("compiled") else ""
        out.append(f"- Predicted speedup over the target's own decoding: **{plan['predicted_speedup']:.2f}x** "
                   f"({plan.get('model', 'planner')}{how}).")
    for key, label in (("predicted_tokens_per_s", "Predicted tokens/s"), ("tau", "Tokens per target forward")):
        if plan.get(key) is not None:
            out.append(f"- {label}: {plan[key]:.2f}.")
    if m.machine:
        out.append(f"- Measured on: {json.dumps(m.machine, sort_keys=True)}.")
    return out or ["- No profile was recorded in this bundle."]


def _serving(m) -> list[str]:
    """How to serve the target with the bundle's eagle3 head in vLLM, when the bundle has its speculators folder."""
    if not any(k.startswith("speculators/") for k in m.files):
        return []
    spec = json.dumps({"method": "eagle3", "model": "THIS_FOLDER/speculators",
                       "num_speculative_tokens": m.decoding.k})
    source = m.target.get("source", "")
    target = source if source.count("/") == 1 else "TARGET_HF_FOLDER"
    return ["## Serve with vLLM", "", "The level right under the target is an EAGLE-3 head, also stored in the "
            "speculators format in `speculators/`: vLLM serves it as the target's drafter (that link only; "
            "longer chains run in polybasic). The target's folder: `speculators_config.verifier.name_or_path` "
            "in `speculators/config.json`.", "", "```bash",
            f"vllm serve {target} --speculative-config '{spec}'", "```", ""]


def render_model_card(m) -> str:
    """Markdown text of the card for a bundle.Manifest."""
    d = m.decoding
    spelling = m.chain.spelling
    lines = [_front_matter(m),
             f"# polybasic chain bundle: {m.target.get('source')} <- {spelling}", "",
             "A lossless speculative-decoding chain for the target model: the levels below it draft, the "
             "level above verifies, and every link applies speculative sampling, so the output follows "
             "the target's own distribution exactly (greedy output is the target's greedy output). "
             "The target's weights are not in this bundle; it names them by source and sha256.", "",
             "## Levels", "", *_levels_table(m), "",
             f"Decoding defaults: k = {d.k}, thresholds = {list(d.thresholds) if d.thresholds else 'k + 1'}, "
             f"temperature = {d.temperature}, top_k = {d.top_k}, top_p = {d.top_p}.", "",
             "## Use", "", "```python", "import polybasic.runtime as rt", "",
             'dec = rt.load("THIS_FOLDER_OR_HUB_ID")', 'print(dec.generate("Name three rivers in Europe.", 128))',
             "print(dec.stats.tau, dec.stats.tokens_per_s)", "```", "", "```bash",
             "polybasic generate --bundle THIS_FOLDER_OR_HUB_ID --prompt \"Name three rivers in Europe.\"",
             "polybasic bench --bundle THIS_FOLDER_OR_HUB_ID --per-category 2   # predicted vs measured speedup",
             "```", "", *_serving(m), "## Measured", "", *_figures(m), "",
             f"Written by polybasic {m.polybasic_version} on {m.created} (bundle schema {m.schema_version}).", ""]
    return "\n".join(lines)
