"""Benchmark outputs: machine description, JSON document, markdown report, stdout table."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

from polybasic.artifacts import write_text
from polybasic.bench.identity import identity_lines
from polybasic.bench.plots import plot_speedup


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(dtype: str, command: str, device: str | torch.device = "cpu") -> dict:
    """The machine record of a benchmark; on a CUDA device it names the GPU and the CUDA build."""
    import transformers

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "dtype": dtype, "device": str(device), "command": command}
    if torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def peak_rss_mib() -> float | None:
    """The peak resident memory of this process so far, in MiB (None where `resource` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1024 / (1024 if sys.platform == "darwin" else 1)


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _links(links: dict[str, float | None] | None) -> str:
    """'target<-a 3.10, a<-ngram 1.80': every link's mean accepted length."""
    return ", ".join(f"{n} {_f(v, '.2f')}" for n, v in links.items()) if links else "-"


def _rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    compiled = any("identical_to_vanilla_compiled" in v for v in doc["methods"].values())
    head = ["method", "tokens/s", "speedup", "vs fastest", "median", "tau", "accept", "links", "identical",
            *(["= compiled"] if compiled else []), "predicted"]
    rows = [[m, _f(v["tokens_per_s"], ".2f"), _f(v["speedup"], ".2f") + "x",
             _f(v.get("speedup_vs_fastest_vanilla"), ".2f") + "x", _f(v.get("median_speedup"), ".2f") + "x",
             _f(v["tau"], ".2f"), _f(v.get("accept_len"), ".2f"), _links(v.get("links")),
             v["identical_to_vanilla"] or "n/a",
             *([v.get("identical_to_vanilla_compiled") or "n/a"] if compiled else []),
             _f(v["predicted_speedup"], ".2f")]
            for m, v in doc["methods"].items()]
    rows += [[m, "FAILED", *["-"] * (len(head) - 2)] for m in doc.get("failed", {})]
    return head, rows


def _failures(doc: dict) -> list[tuple[str, list[str]]]:
    """Per failed method: (what ended it and where, its last stderr lines)."""
    out = []
    for m, f in doc.get("failed", {}).items():
        where = ("while loading" if f["stage"] == "load" else
                 f"{'in warm-up ' if f['stage'] == 'warm-up' else ''}on question {f['question_id']} ({f['category']})")
        out.append((f"{m} FAILED: {f['reason']} {where}; not run on later prompts (every other method's figures "
                    "stand)" + ("; its last stderr lines:" if f["stderr"] else ""), f["stderr"]))
    return out


def failure_lines(doc: dict) -> list[str]:
    return [ln for head, tail in _failures(doc) for ln in [head, *[f"    {t}" for t in tail]]]


def _cat_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    methods = list(doc["methods"])
    cats = list(next(iter(doc["methods"].values()))["per_category"]) if methods else []
    drafts = [m for m in methods if doc["methods"][m].get("accept_len") is not None]
    head = ["category", "n"] + [f"{m} speedup" for m in methods] + [f"{m} accept" for m in drafts]
    rows = []
    for c in cats:
        per = [doc["methods"][m]["per_category"][c] for m in methods]
        rows.append([c, str(per[0]["prompts"])] + [_f(p["speedup"], ".2f") + "x" for p in per]
                    + [_f(doc["methods"][m]["per_category"][c].get("accept_len"), ".2f") for m in drafts])
    return head, rows


def _plain(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda r: "  ".join(x.ljust(n) if i == 0 else x.rjust(n) for i, (x, n) in enumerate(zip(r, w)))
    return "\n".join([line(head), "  ".join("-" * n for n in w)] + [line(r) for r in rows])


def _md(head: list[str], rows: list[list[str]]) -> str:
    cell = lambda c: c.replace("|", "\\|")  # noqa: E731  a chain's 'LEVEL|ngram' inside a cell
    out = ["| " + " | ".join(map(cell, head)) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def text_table(doc: dict) -> str:
    """The methods' table (with a FAILED row per failed method and why), the per-category table, then a
    warning per lossless method that is not identical to its reference."""
    warnings = identity_lines(doc)
    return "\n".join([_plain(*_rows(doc)), *failure_lines(doc), *_compile_lines(doc), "", _plain(*_cat_rows(doc)),
                      *([""] + warnings if warnings else [])])


def _compile_lines(doc: dict) -> list[str]:
    """One line per compiled method: the seconds spent compiling (or loading from inductor's cache) and
    warming its steps, before and apart from the timed prompts."""
    return [f"{m}: compiled steps ready in {v['compile_s']:.1f} s (before the timed prompts, not in tokens/s)"
            for m, v in doc["methods"].items() if v.get("compile_s") is not None]


def _fastest_sentence(doc: dict) -> list[str]:
    name = doc.get("fastest_vanilla")
    if not name:
        return []
    return [f"Fastest vanilla decoder of this run: {name} ({doc['methods'][name]['tokens_per_s']:.2f} tokens/s); "
            "vs fastest = a method's tokens/s / its tokens/s.", ""]


def markdown(doc: dict) -> str:
    m, c = doc["machine"], doc.get("config", {})
    rss = m.get("peak_rss_mib")
    parts = [
        "# polybasic bench (Spec-Bench)", "",
        f"Command: `{m['command']}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}, "
        f"transformers {m['transformers']}, dtype {m['dtype']}"
        + (f", GPU {m['gpu']} (CUDA {m.get('cuda')})" if m.get("gpu") else "") + ".", "",
        *([f"Peak RSS: {rss:.0f} MiB, of the whole process (every method's models loaded together), "
           "not of one method.", ""] if rss is not None else []),
        f"Model {c.get('model')}, {c.get('prompts')} prompts, max {c.get('max_new_tokens')} new tokens, "
        f"temperature {c.get('temperature')}, seed {c.get('seed')}, warm-up {c.get('warmup')}"
        + (f", best of {c['repeat']} interleaved runs per prompt and method" if (c.get("repeat") or 1) > 1 else "")
        + ".", "",
        "tokens/s = total new tokens / total wall time (prefill included); speedup against vanilla "
        "(our decoder on the target in its dtype) on the same prompts; vs fastest = against the fastest "
        "vanilla decoder of the run (vanilla, vanilla:DTYPE, vanilla-compiled...); median = median over "
        "prompts of the per-prompt speedup (robust to machine noise); tau = new tokens per target forward; "
        "accept = the bottom drafter's mean accepted length per draft verified by the level above (accepted "
        "drafts + 1; verifications of an empty draft, such as the budget's last token, left out); links = that length for every link of a chain (verifier<-drafter); identical = prompts "
        "whose tokens equal vanilla's (greedy only); = compiled = prompts whose tokens equal vanilla-compiled's, when "
        "the run has it (a compiled chain's own reference); predicted = the planner's speedup over plain decoding "
        "run the same way (eager, or compiled for a *-compiled method: compare it with vs fastest). Methods that run "
        "the target in another dtype "
        "(vanilla:DTYPE) or with other numerics (vanilla-dense without a codes kernel, transformers, compiled steps) "
        "are not expected to be "
        "identical: a different kernel or rounding can flip a near-tie.", "",
        *_fastest_sentence(doc),
        _md(*_rows(doc)), "", *[f"- {line}" for line in _compile_lines(doc)], "", *_md_notes(doc),
        "## Per category", "", _md(*_cat_rows(doc)), "",
    ]
    return "\n".join(parts)


def _md_notes(doc: dict) -> list[str]:
    """The failed methods (stderr quoted) and the identity warnings, as markdown sections."""
    out = []
    if doc.get("failed"):
        out += ["## Failed methods", ""]
        for head, tail in _failures(doc):  # the stderr lines as an indented code block
            out += [head, "", *[f"    {t}" for t in tail], ""]
    if lines := identity_lines(doc):
        out += ["## Identity of the lossless methods", "", *[f"- {ln}" for ln in lines], ""]
    return out


def write_outputs(doc: dict, json_path: str | Path | None, report_dir: str | Path | None) -> None:
    text = json.dumps(doc, indent=2) + "\n"
    if json_path:
        write_text(json_path, text)
    if report_dir:
        write_text(Path(report_dir) / "bench.json", text)
        plot_speedup(doc, Path(report_dir) / "speedup.png")
        write_text(Path(report_dir) / "report.md", markdown(doc) + "\n![speedup per category](speedup.png)\n")
