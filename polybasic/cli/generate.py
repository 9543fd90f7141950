"""`polybasic generate`: text from a prompt, plainly, through a chain, or through a chain bundle.

The parser and every check of the input (prompt, --model, --chain files by their headers, --bundle's
manifest) import no torch; the command imports the runtime when it runs (start-up time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from polybasic.config import COMPILE_MODES, DEFAULT_MODEL, SamplingConfig, check_draft_confidence, int_list
from polybasic.errors import ConfigError, DataNotFoundError
from polybasic.models.preflight import check_source, default_dtype
from polybasic.runtime.chainspec import CHAIN_HELP, check_chain_files, parse_chain_spec


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streams to stdout)",
                       description="Generate text from a prompt, plainly or through a chain of levels.\n\n"
                                   + CHAIN_HELP)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the target: short name, .gguf file, Hugging Face folder, Hub id or a quantized "
                        ".safetensors copy")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt text (as --prompt)")
    prompt.add_argument("--prompt", help="the prompt text; '-' reads it from stdin (for long prompts)")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 text file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    p.add_argument("--bundle", default=None, metavar="PATH|HUB_ID",
                   help="decode with a chain bundle (`polybasic export` / `polybasic run`): its target, chain, "
                        "k, thresholds and sampling defaults; a folder or a Hub id (through the HF cache)")
    p.add_argument("--reprofile", action="store_true",
                   help="with --bundle: re-measure its levels' costs on this machine and re-plan k, thresholds "
                        "and levels (its pair acceptances are kept); by default the bundle's plan runs as is")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 0, or the bundle's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest tokens, 0 = off (default: 0, or the bundle's)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass, 1.0 = off (default: 1.0, or the bundle's)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--dtype", default=None, help="dtype of the target's weights (default: float32; bfloat16 for a "
                                                 "NAME@w4a8 target)")
    add_device_flag(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--chain", default=None, metavar="SPEC",
                   help="decode through a chain: the levels below the target, '+'-separated (forms above)")
    p.add_argument("--k", type=int, default=5, help="tokens the bottom level proposes per round")
    p.add_argument("--adaptive-k", action="store_true", help="adapt the bottom draft length (1..k)")
    p.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="a drafting level (model or EAGLE head) ends its draft (a tree's path) after a token it "
                        "gave a probability below P (lossless), so a long --k or threshold costs little where drafts "
                        "are unsure (default: 0, off, or the bundle's)")
    p.add_argument("--thresholds", default=None,
                   help="comma-separated hand-up threshold per middle level (default: k+1 each)")
    p.add_argument("--compile", nargs="?", const="layers", default=None, choices=COMPILE_MODES,
                   help="run every level's forwards (the target's, a chain's models and heads) as compiled "
                        "static-shape steps, the time printed apart; on a CPU 'layers' (the default) compiles one "
                        "graph per layer and size, shared by every layer (under a minute the first time, seconds "
                        "once inductor has cached it), 'whole' one graph of the whole model per size (minutes, "
                        "steps ~5%% faster)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=_cmd_generate)


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",
                   help="where every level runs and samples: cpu, cuda or cuda:N (checked before anything loads)")


def read_prompt(a: argparse.Namespace) -> str:
    """The prompt from PROMPT or --prompt TEXT, --prompt - (stdin) or --prompt-file PATH."""
    prompt = a.text if a.prompt is None else a.prompt
    if a.prompt_file is not None:
        path = Path(a.prompt_file).expanduser()
        if not path.is_file():
            raise DataNotFoundError(f"--prompt-file: {path} does not exist; pass a UTF-8 text file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompt-file: {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              "save it as UTF-8") from None
        where = f"--prompt-file: {path}"
    elif prompt == "-":
        text, where = sys.stdin.read(), "--prompt -: stdin"
    else:
        return prompt
    if not text.strip():
        raise ConfigError(f"{where} is empty; pass a prompt")
    return text


def _precheck_generate(a: argparse.Namespace):
    """Every check that needs no torch and no model: prompt, --model, --chain (files by headers)."""
    prompt = read_prompt(a)
    if a.reprofile and not a.bundle:
        raise ConfigError("--reprofile: re-plans a bundle's chain; pass --bundle")
    if a.bundle:
        if a.chain or a.model != DEFAULT_MODEL:
            raise ConfigError("--bundle: the bundle names its target and chain; drop --model and --chain")
        a.dtype = a.dtype or "float32"  # unused: the bundle names its target's dtype
        from polybasic.runtime.bundle import check_bundle
        from polybasic.runtime.hub import resolve_bundle

        return prompt, check_bundle(resolve_bundle(a.bundle)), None
    check_source(a.model, "--model")
    a.dtype = a.dtype or default_dtype(a.model)
    spec = check_chain_files(parse_chain_spec(a.chain, "--chain"), "--chain") if a.chain else None
    return prompt, spec, int_list(a.thresholds, "--thresholds")


def _cmd_generate(a: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    prompt, spec, thresholds = _precheck_generate(a)
    # the runtime, imported when the command runs (start-up time: `--help` and argument errors stay free of torch)
    from polybasic.models.prepare import check_compilable
    from polybasic.models.static import covering, decode_sizes
    from polybasic.quant.api import load_any_model
    from polybasic.runtime.chain import Chain, check_k
    from polybasic.runtime.chain_builder import build_chain
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.context import ExecutionContext
    from polybasic.runtime.generate import GenerationStats, check_request, generate_tokens
    from polybasic.runtime.levels import ModelLevel
    from polybasic.runtime.text import encode_prompt, eos_ids, stream_text

    check_request([0], a.max_new_tokens, 2)
    check_k(a.k)
    check_draft_confidence(_or(a.draft_confidence, 0.0), "draft_confidence")
    ctx = ExecutionContext(a.device, a.dtype, a.seed)
    if a.compile:
        check_compilable(ctx.device)
    if a.bundle:
        from polybasic.runtime.bundle import load

        dec = load(a.bundle, ctx.device, verify_target=False)  # _precheck_generate checked the target
        if a.reprofile:
            from polybasic.planner.replan import reprofile

            reprofile(dec)
            print(f"[re-planned here: {dec.manifest.plan['chain']}, k={dec.manifest.decoding.k}, predicted "
                  f"{dec.predicted_speedup:.2f}x]", file=sys.stderr)
        lm, chain, sampling = dec.target, dec.chain, dec.sampling(temperature=a.temperature, top_k=a.top_k,
                                                                  top_p=a.top_p)
        chain.draft_confidence = _or(a.draft_confidence, chain.draft_confidence)
    else:
        sampling = SamplingConfig(_or(a.temperature, 0.0), _or(a.top_k, 0), _or(a.top_p, 1.0))
        lm = load_any_model(a.model, ctx.dtype, ctx.device)
        chain = None if spec is None else Chain(build_chain(spec, lm, ctx.device, "--chain"), k=a.k,
                                                thresholds=thresholds,
                                                eos=eos_ids(lm.tokenizer), adaptive_k=a.adaptive_k,
                                                draft_confidence=_or(a.draft_confidence, 0.0))
    ids = encode_prompt(lm.tokenizer, prompt, chat=not a.no_chat)
    check_request(ids, a.max_new_tokens, lm.args.max_seq_len)  # an over-long prompt: a clear error
    times = {"load": time.perf_counter() - t_start}
    if a.compile:
        say = lambda msg: print(f"[{msg}]", file=sys.stderr)  # noqa: E731
        say("compiling every level's steps: minutes the first time on a small CPU, seconds once cached")
        if chain is not None:  # each level the step sizes up to the most rows it verifies in a call
            levels, sizes, rows = chain.levels, covering(None, chain.scored_rows, lm.model.device), chain.scored_rows
        else:  # plain decoding: the one-token step and the prefill chunk
            levels, sizes, rows = [ModelLevel(lm.model)], decode_sizes(None, lm.model.device), ()
        times["compile"] = compile_levels(levels, min(lm.args.max_seq_len, len(ids) + a.max_new_tokens + 1),
                                          lm.gguf_file, sizes, notify=say, decode=chain is None, rows=rows,
                                          mode=a.compile)
    generator = ctx.generator()
    if chain is not None:
        token_iter = chain.stream(ids, a.max_new_tokens, sampling, generator)
        get_stats = lambda: chain.stats  # noqa: E731
    else:
        stats = GenerationStats()
        token_iter = generate_tokens(lm.model, ids, a.max_new_tokens, sampling, eos_ids(lm.tokenizer),
                                     generator, stats)
        get_stats = lambda: stats  # noqa: E731

    pieces = []
    t_ready = time.perf_counter()
    for piece in stream_text(lm.tokenizer, token_iter):
        if not pieces:
            times["first_token"] = time.perf_counter() - t_ready
        pieces.append(piece)
        if not a.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    stats = get_stats()
    if a.json:
        print(json.dumps({"text": "".join(pieces), "new_tokens": stats.new_tokens,
                          "tokens_per_s": stats.tokens_per_s, "stats": stats.to_dict(),
                          "times_s": times}))
    else:
        sys.stdout.write("\n")
        extra = f", tau {stats.tau:.2f}" if chain is not None else ""
        print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{extra}, stop: {stats.stop_reason}; "
              + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in times.items()) + "]", file=sys.stderr)
    return 0


def _or(value, default):
    return default if value is None else value
