"""`polybasic quantize RECIPE.yaml`: calibrate, evaluate a scheme x method grid, save the model.

Outputs in the out folder (all written atomically; a rerun resumes, removes the temp files of a
killed run and prints what it reused):
  model.safetensors   the recipe's model (calib.method at calib's bits, `kernel` in `exec_dtype`)
  recipe.yaml         the resolved recipe
  report.md/.json     perplexity and next-token top-1 agreement with the fp model on held-out text
                      for fp, and each method x scheme; per-forward latency for M=1 and k tokens
  work/<tag>/         per-block calibration state and per-cell results (the resume points)
  siblings/<name>/    the same outputs for each `quantize.siblings` model (e.g. a smaller model of
                      the target's family, a cheaper chain level), quantized with the same settings
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from polybasic.artifacts import announce, clean_and_announce, write_text
from polybasic.config import UNTRAINED, Recipe, dump_recipe, parse_scheme, to_dict
from polybasic.data import DataSource, Example, read_examples
from polybasic.errors import ConfigError
from polybasic.models import load_model
from polybasic.models.decoder import use_decode_layout
from polybasic.models.loader import parse_dtype
from polybasic.models.preflight import check_source
from polybasic.quant import QuantConfig, quantize_
from polybasic.quant.api import save_quantized
from polybasic.quant.calibrate import build_quantized_model, calibrate
from polybasic.quant.from_gguf import GGUFCodes

log = logging.getLogger(__name__)

GGUF_NOTES = {"smollm2-135m": (
    "SmolLM2-135M-Instruct is shipped as a 4-bit GGUF (Q4_1: blocks of 32 weights, w = d*q + m "
    "with an fp16 scale d and an fp16 offset m per block), dequantized to fp32 on load. The fp32 "
    "\"target\" therefore already sits on a 4-bit grid with group 32. For each scheme: w4a16 with "
    "group 32 aligned to those blocks could be nearly lossless with respect to the target only if "
    "the grid matched exactly; ours uses an integer zero point (0.0 exact), and Q4_1's offset m is "
    "not a multiple of d, so even g32 RTN re-rounds most weights (error up to d/2); with group 64 "
    "two Q4_1 blocks with different (d, m) share one scale, which adds error. Any learned transform "
    "(scales, affine matrices) moves the weights off the shipped grid, so for weight-only schemes "
    "clipping-only calibration is the natural choice. w4a8 and w4a4 add activation error that the "
    "shipped model never had; there the transforms (outlier migration) are what matters. The "
    "absolute perplexities are of a model that already lost some quality to Q4_1, which the table "
    "cannot show (we have no unquantized weights).")}
GGUF_NOTE = ("A model expanded from a GGUF file already sits on that file's block grids (e.g. Q4_K, Q6_K), "
             "so re-quantizing re-rounds its weights; the absolute perplexities are of a model that already "
             "lost some quality to the shipped quantization, which the table cannot show.")


def sibling_folder(out: Path, source: str) -> Path:
    """Where the quantize stage writes the copy of a `quantize.siblings` model."""
    return Path(out) / "siblings" / source.replace("/", "_")


def sibling_recipe(recipe: Recipe, source: str) -> Recipe:
    """The recipe with `source` as its model, for quantizing a sibling alike."""
    return replace(recipe, model=replace(recipe.model, source=source))


def load_records(source: DataSource) -> list[Example]:
    """The records of quantize.data, validated (Alpaca, ShareGPT or {text}) before any model loads."""
    return read_examples(source, "quantize.data")


def record_tokens(tokenizer, ex: Example) -> list[int]:
    """A text record as is; a chat record's turns (Alpaca: instruction + input as the user turn,
    output as the assistant turn) through the chat template, or joined by newlines without one."""
    if ex.text is not None:
        return tokenizer.encode(ex.text)
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(ex.messages(), tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer.encode("\n".join(c for _, c in ex.turns))


def token_windows(tokenizer, records: list[Example], seq_len: int, n: int) -> torch.Tensor:
    """Concatenate the records' tokens and cut up to n windows [n', seq_len] (n' <= n)."""
    stream: list[int] = []
    for rec in records:
        stream += record_tokens(tokenizer, rec)
        if len(stream) >= n * seq_len:
            break
    k = min(n, len(stream) // seq_len)
    return torch.tensor(stream[:k * seq_len], dtype=torch.long).view(k, seq_len)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, ref_argmax: torch.Tensor | None = None, batch: int = 4):
    """(perplexity, top-1 agreement with ref_argmax or None, argmax [W, L-1]) of next-token prediction."""
    w, l = windows.shape
    nll, agree, preds = 0.0, 0, []
    for i in range(0, w, batch):
        x = windows[i:i + batch]
        model.setup_caches(l, x.shape[0])
        logits, _ = model(x, 0)  # [b, L, V]
        logits = logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        preds.append(logits.argmax(-1))
    preds = torch.cat(preds)  # [W, L-1]
    ppl = math.exp(nll / preds.numel())
    agree = None if ref_argmax is None else (preds == ref_argmax).float().mean().item()
    return ppl, agree, preds


@torch.no_grad()
def latency(models: dict, ks: list[int], context: int, reps: int, warmup: int = 3) -> dict:
    """{name: {k: median ms}} per forward of k tokens after a context prefill; models interleaved
    rep by rep so machine noise hits them alike."""
    max_k = max(ks)
    vocab = next(iter(models.values())).args.vocab_size
    toks = torch.randint(0, vocab, (1, context + max_k), generator=torch.Generator().manual_seed(0))
    for m in models.values():
        m.setup_caches(context + max_k, 1)
        m(toks[:, :context], 0)
    times = {name: {k: [] for k in ks} for name in models}
    for r in range(warmup + reps):
        for name, m in models.items():
            for k in ks:
                t0 = time.perf_counter()
                m(toks[:, context:context + k], context)
                if r >= warmup:
                    times[name][k].append((time.perf_counter() - t0) * 1e3)
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in times.items()}


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]


def run_quantize(recipe: Recipe, out: Path, progress: bool = True, lm=None) -> dict:
    """lm: the fp32 target, when the caller has it loaded already."""
    q = recipe.quantize
    cal = q.calib
    check_inputs(recipe, out, set())  # before loading the model
    records = load_records(q.data)
    out.mkdir(parents=True, exist_ok=True)
    clean_and_announce(out)
    dump_recipe(recipe, out / "recipe.yaml")
    t_start = time.perf_counter()
    lm = lm or load_model(recipe.model.source, "float32")
    fp = lm.model
    calib_tok = token_windows(lm.tokenizer, records[:-q.holdout], cal.seq_len, cal.n_samples)  # [N, L]
    if calib_tok.shape[0] < cal.n_samples:
        raise ConfigError(f"quantize.calib.n_samples: only {calib_tok.shape[0]} windows of {cal.seq_len} "
                          f"tokens in the calibration records; lower n_samples / seq_len or add data")
    eval_tok = token_windows(lm.tokenizer, records[-q.holdout:], q.eval_seq_len, q.eval_windows)
    if eval_tok.shape[0] == 0:
        raise ConfigError("quantize.eval_seq_len: held-out text is shorter than one window; lower it")
    codes = gguf_codes(lm, recipe) if "gguf" in {*q.methods, cal.method} else None
    fp_ppl, _, fp_argmax = evaluate(fp, eval_tok)
    data_fp = _fingerprint(recipe.model.source, q.data, q.holdout, cal.seq_len, cal.n_samples)
    cells = [(s, m) for s in q.schemes for m in q.methods]
    rows: dict = {}
    main_key = (cal.w_bits, cal.a_bits, cal.group_size, cal.method)
    keys = [(*parse_scheme(s, cal.group_size), m) for s, m in cells]
    base = {"model": recipe.model.source, "fp_ppl": fp_ppl,
            "eval": {"windows": int(eval_tok.shape[0]), "seq_len": q.eval_seq_len,
                     "text": f"last {q.holdout} records of {q.data}"},
            "calibration": {"windows": int(calib_tok.shape[0]), "seq_len": cal.seq_len,
                            "text": f"first records of {q.data} (holdout excluded)"},
            "gguf_note": GGUF_NOTES.get(recipe.model.source, GGUF_NOTE), "recipe": to_dict(recipe)}
    report: dict = {}
    # the recipe's model first (saved, timed), then the rest of the grid; the report is rewritten
    # after every cell, so an interrupted run leaves a partial but consistent report
    for key in [main_key] + [k for k in keys if k != main_key]:
        w, a, g, method = key
        ccfg = replace(cal, method=method, w_bits=w, a_bits=a, group_size=g)
        # with the transforms off (a16), omniquant and affinequant are the same clipping-only run
        same = replace(ccfg, method="omniquant") if method not in UNTRAINED and not ccfg.uses_transforms else ccfg
        cell = out / "work" / f"w{w}a{a}-g{g}-{same.method}-{_fingerprint(same.to_dict(), data_fp)}"
        done, is_main = cell / "result.json", key == main_key
        row = json.loads(done.read_text()) if done.is_file() else None
        label = f"w{w}a{a}-g{g}/{method}"
        if row is not None and not is_main:
            announce(f"reused: cell {label} (result of {cell})")
        if row is None or is_main:  # the main model is rebuilt from its saved blocks
            t0 = time.perf_counter()
            res = calibrate(fp, calib_tok, ccfg, cell, progress)
            if reused := [i for i, r in enumerate(res) if r["resumed"]]:
                announce(f"resumed: blocks {_ranges(reused)} of {len(res)} of cell {label} from {cell}")
            if row is None:
                t_cal = time.perf_counter() - t0
                qm = build_quantized_model(fp, res, ccfg.quant_config("dequant"), codes=codes)
                ppl, agree, _ = evaluate(qm, eval_tok, fp_argmax)
                row = {"scheme": f"w{w}a{a}", "group_size": g, "ppl": ppl,
                       "top1_agree": agree, "calib_s": round(t_cal, 1)}
                write_text(done, json.dumps(row))
        row = {**row, "method": method}
        rows[key] = row
        log.info("w%da%d-g%d %s: ppl %.3f agree %.4f", w, a, g, method, row["ppl"], row["top1_agree"])
        if is_main:
            report = {**base, **_save_and_time(fp, res, recipe, out, row, eval_tok, fp_argmax, codes)}
        report.update(rows=[rows[k] for k in keys if k in rows], done_cells=f"{len(rows)}/{len(set(keys) | {main_key})}",
                      wall_s=round(time.perf_counter() - t_start, 1))
        write_text(out / "report.json", json.dumps(report, indent=2))
        write_text(out / "report.md", render_report(report))
    return report


def gguf_codes(lm, recipe: Recipe):
    """The GGUF codes of the model (method 'gguf'), or a ConfigError naming the field if it has none."""
    if lm.gguf_file is None:
        raise ConfigError(f"quantize.calib.method / quantize.methods: 'gguf' keeps the codes of the GGUF "
                          f"file a model was converted from; {recipe.model.source} has none; use rtn")
    announce(f"reading the 4-bit codes of {lm.gguf_file}")
    return GGUFCodes.read(lm.gguf_file)


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _save_and_time(fp, res, recipe: Recipe, out: Path, row: dict, eval_tok, fp_argmax, codes=None) -> dict:
    """Save the recipe's model with its execution kernel; evaluate it as deployed; time it against
    fp32 / bf16 (cached)."""
    import copy
    from dataclasses import replace

    q, cal = recipe.quantize, recipe.quantize.calib
    qconf = replace(cal.quant_config(q.kernel), quantize_lm_head=q.quantize_lm_head)
    main = build_quantized_model(fp, res, qconf, parse_dtype(q.exec_dtype), codes=codes)
    save_quantized(main, out / "model.safetensors", qconf, recipe.model.source)
    dep_ppl, dep_agree, _ = evaluate(main, eval_tok, fp_argmax)
    cached = out / "work" / f"latency-{_fingerprint(to_dict(recipe))}.json"
    if not q.latency_reps:
        lat = None
    elif cached.is_file():
        lat = json.loads(cached.read_text())
        announce(f"reused: latency table {cached}")
    else:
        emul = build_quantized_model(fp, res, cal.quant_config("dequant"), codes=codes)
        models = {"fp32": use_decode_layout(copy.deepcopy(fp)), "bf16": use_decode_layout(build_bf16(fp)),
                  f"{qconf.name} {q.kernel} ({q.exec_dtype})": main,
                  f"{cal.quant_config('dequant').name} dequant emulation (fp32)": emul}
        for bits in (4, 8):  # the real low-bit-activation kernel; its speed does not depend on calibration
            ic = QuantConfig(w_bits=bits, a_bits=bits, group_size=-1, kernel="int8mm")
            models[f"{ic.name} int8mm (fp32, real {bits}-bit activations)"] = quantize_(copy.deepcopy(fp), ic)
        lat = latency(models, q.latency_tokens, q.latency_context, q.latency_reps)
        write_text(cached, json.dumps(lat))
    return {"latency_ms": lat, "main": {"scheme": qconf.name, "method": cal.method, "kernel": q.kernel,
                                        "dtype": q.exec_dtype, "lm_head_quantized": q.quantize_lm_head,
                                        "ppl": row["ppl"], "top1_agree": row["top1_agree"],
                                        "deployed_ppl": dep_ppl, "deployed_top1_agree": dep_agree,
                                        "gguf_code_fraction": None if codes is None else round(codes.exact_fraction, 4)}}


def build_bf16(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def render_report(r: dict) -> str:
    lines = [f"# quantize report: {r['model']}", "",
             f"Held-out evaluation: {r['eval']['windows']} windows x {r['eval']['seq_len']} tokens from the "
             f"{r['eval']['text']}; calibration: {r['calibration']['windows']} x {r['calibration']['seq_len']} "
             f"tokens from the {r['calibration']['text']}. Quality is the scheme's own arithmetic "
             "(dequant kernel, fp32, activations fake-quantized per token).", "",
             "| scheme | group | method | perplexity | top-1 agreement with fp | calibration s |",
             "|---|---|---|---|---|---|",
             f"| fp32 | - | - | {r['fp_ppl']:.3f} | 1.0000 | - |"]
    for row in r["rows"]:
        lines.append(f"| {row['scheme']} | {row['group_size']} | {row['method']} | {row['ppl']:.3f} | "
                     f"{row['top1_agree']:.4f} | {row['calib_s'] if row.get('calib_s') is not None else '-'} |")
    by = {(x["scheme"], x["method"]): x for x in r["rows"]}
    aq, rtn = by.get(("w4a4", "affinequant")), by.get(("w4a4", "rtn"))
    if aq and rtn:
        ok = aq["ppl"] < rtn["ppl"] and aq["top1_agree"] > rtn["top1_agree"]
        lines += ["", f"AffineQuant vs RTN at w4a4: perplexity {aq['ppl']:.3f} vs {rtn['ppl']:.3f}, agreement "
                      f"{aq['top1_agree']:.4f} vs {rtn['top1_agree']:.4f}: "
                      f"{'beats RTN on both' if ok else 'does NOT beat RTN on both'}."]
    m = r["main"]
    if not r["latency_ms"]:
        lines += ["", f"Recipe model: {m['method']} {m['scheme']}, kernel {m['kernel']} in {m['dtype']}, LM head "
                      f"{'quantized too' if m.get('lm_head_quantized') else 'kept in ' + m['dtype']}: "
                      f"deployed perplexity {m['deployed_ppl']:.3f}, top-1 agreement {m['deployed_top1_agree']:.4f}. "
                      f"{_codes_note(m)}No latency table (quantize.latency_reps: 0).",
                  "", "## The shipped model", "", r["gguf_note"], "",
                  f"Cells done: {r['done_cells']}. Wall time of the stage so far: {r['wall_s']} s."]
        return "\n".join(lines) + "\n"
    lat = r["latency_ms"]
    lat = {n: {int(k): v for k, v in d.items()} for n, d in lat.items()}  # JSON keys are strings
    ks = list(next(iter(lat.values())).keys())
    lines += ["", "## Latency (ms per forward, medians, one run, context prefilled)", "",
              "| model | " + " | ".join(f"M={k}" for k in ks) + " | M=1 vs fp32 |",
              "|---|" + "---|" * (len(ks) + 1)]
    f1 = lat["fp32"][ks[0]]
    for name, d in lat.items():
        lines.append(f"| {name} | " + " | ".join(f"{d[k]:.1f}" for k in ks) + f" | {d[ks[0]] / f1:.2f}x |")
    main_name = next(n for n in lat if m["kernel"] in n and "emulation" not in n)
    ratio = lat[main_name][ks[0]] / f1
    lines += ["", f"Recipe model: {m['method']} {m['scheme']} (calibrated with its activation bits), executed "
                  f"with kernel {m['kernel']} in {m['dtype']} (weight-only at run time: activations are not "
                  f"quantized by this kernel), LM head "
                  f"{'quantized too' if m.get('lm_head_quantized') else 'kept in ' + m['dtype']}. "
                  f"As deployed it scores perplexity {m['deployed_ppl']:.3f} and top-1 agreement "
                  f"{m['deployed_top1_agree']:.4f} on the held-out text. {_codes_note(m)}Decode step (M={ks[0]}) = "
                  f"{ratio:.2f}x the fp32 step: {'<= 0.5x' if ratio <= 0.5 else 'NOT <= 0.5x'}.",
              *_int8mm_verdict(lat, ks[0], f1),
              "", "## The shipped model is already 4-bit", "", r["gguf_note"], "",
              f"Cells done: {r['done_cells']}. Wall time of the stage so far: {r['wall_s']} s."]
    return "\n".join(lines) + "\n"


def _codes_note(m: dict) -> str:
    """Method 'gguf': how many quantized weights keep the file's own codes (empty otherwise)."""
    f = m.get("gguf_code_fraction")
    return "" if f is None else (f"{100 * f:.1f}% of the quantized weights keep the GGUF file's own 4-bit "
                                 "codes; the rest are rounded to 4 bits (groups of 32, float zero points). ")


def _int8mm_verdict(lat: dict, k: int, fp: float) -> list[str]:
    """A sentence on the real low-bit-activation kernels, from the measured table."""
    rows = {n: d[k] / fp for n, d in lat.items() if "int8mm" in n}
    if not rows:
        return []
    parts = ", ".join(f"{n.split(' ')[0]} {v:.2f}x" for n, v in rows.items())
    faster = [n for n, v in rows.items() if v < 1]
    verdict = ("faster than fp32 for " + ", ".join(faster)) if faster else "no faster than fp32 on this machine"
    return ["", f"Real low-bit activations (int8mm, M={k}) relative to the fp32 step: {parts}: {verdict}."]


def check_inputs(recipe: Recipe, out: Path, upstream: set[str]) -> None:
    """The calibration data parses and has more records than the holdout, and every sibling model
    source exists (before any model loads)."""
    q = recipe.quantize
    for i, src in enumerate(q.siblings):
        check_source(src, f"quantize.siblings[{i}]")
    records = load_records(q.data)
    if len(records) <= q.holdout:
        raise ConfigError(f"quantize.holdout: {q.holdout} >= the {len(records)} records of {q.data}; "
                          "lower it or use more data")


def run_stage(ctx) -> list[Path]:
    """The stage in `polybasic quantize|run`: calibrate on the shared fp32 target (its own copy
    otherwise), save the model, write the report; then each sibling model alike, in its folder."""
    lm = ctx.target if ctx.recipe.model.dtype in ("float32", "fp32") else None
    outputs = []
    for recipe, out in [(ctx.recipe, ctx.out)] + [(sibling_recipe(ctx.recipe, s), sibling_folder(ctx.out, s))
                                                  for s in ctx.recipe.quantize.siblings]:
        report = run_quantize(recipe, out, lm=lm if out == ctx.out else None)
        print(f"wrote {out / 'model.safetensors'}, {out / 'report.md'} (wall {report['wall_s']} s)")
        outputs += [out / "model.safetensors", out / "report.json", out / "report.md"]
    return outputs
