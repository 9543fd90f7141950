"""`polybasic` command line: generate, bench, and the recipe stages (quantize, distill)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from polybasic.errors import ConfigError, PolybasicError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streams to stdout)")
    p.add_argument("--model", default="smollm2-135m", help="short name, .gguf file, HF folder or Hub id")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--chain", default=None,
                   help="levels below the target, '+'-separated: ngram[:N] | SOURCE[@DTYPE] | target@DTYPE")
    p.add_argument("--k", type=int, default=5, help="tokens the bottom level proposes per round")
    p.add_argument("--adaptive-k", action="store_true", help="adapt the bottom draft length (1..k)")
    p.add_argument("--thresholds", default=None,
                   help="comma-separated hand-up threshold per middle level (default k+1)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the one-token step (costs tens of seconds once, then cached)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(a: argparse.Namespace) -> int:

    from polybasic.models import load_model
    from polybasic.runtime.chain import Chain, check_k
    from polybasic.runtime.generate import GenerationStats, check_request, generate_tokens
    from polybasic.runtime.spec import parse_chain
    from polybasic.runtime.sampling import SamplingConfig, make_generator
    from polybasic.runtime.text import encode_prompt, eos_ids, stream_text

    sampling = SamplingConfig(a.temperature, a.top_k, a.top_p)  # validates before loading
    check_request([0], a.max_new_tokens, 2)
    thresholds = _int_list(a.thresholds, "--thresholds")
    check_k(a.k)
    lm = load_model(a.model, a.dtype)
    if a.compile:
        coded = lm.model.compile_decode(lm.gguf_file)
        print(f"[compiling the one-token step ({coded} linears read GGUF block codes); the first token "
              "waits ~90 s on a 2-core CPU the first time, ~20 s once inductor has cached it]", file=sys.stderr)
    ids = encode_prompt(lm.tokenizer, a.prompt, chat=not a.no_chat)
    generator = make_generator(a.seed)
    if a.chain:
        chain = Chain(parse_chain(a.chain, lm), k=a.k, thresholds=thresholds, eos=eos_ids(lm.tokenizer),
                      adaptive_k=a.adaptive_k)
        token_iter = chain.stream(ids, a.max_new_tokens, sampling, generator)
        get_stats = lambda: chain.stats  # noqa: E731
    else:
        stats = GenerationStats()
        token_iter = generate_tokens(lm.model, ids, a.max_new_tokens, sampling, eos_ids(lm.tokenizer),
                                     generator, stats)
        get_stats = lambda: stats  # noqa: E731

    pieces = []
    for piece in stream_text(lm.tokenizer, token_iter):
        pieces.append(piece)
        if not a.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    stats = get_stats()
    if a.json:
        print(json.dumps({"text": "".join(pieces), "new_tokens": stats.new_tokens,
                          "tokens_per_s": stats.tokens_per_s, "stats": stats.to_dict()}))
    else:
        sys.stdout.write("\n")
        extra = f", tau {stats.tau:.2f}" if a.chain else ""
        print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s{extra}, stop: {stats.stop_reason}]",
              file=sys.stderr)
    return 0


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag}: '{text}' is not a comma-separated list of integers, e.g. 8,6") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polybasic", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from polybasic.bench.cli import add_parser as add_bench
    from polybasic.pipelines.cli import add_parsers as add_stages

    add_bench(sub)
    add_stages(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PolybasicError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
