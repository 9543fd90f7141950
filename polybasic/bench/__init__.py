"""Spec-Bench harness: questions.py (load/select), methods.py (name -> runner registry), runner.py
(interleaved timing, aggregation), suite.py (a whole run from its options), report.py (JSON,
markdown, tables), plots.py (speedup per category). The flags: polybasic.cli.bench.

The method names live here, free of torch, for the command line's help."""

DEFAULT_METHODS = "vanilla,hf,hf-pld,pld"
BUNDLE_METHODS = "vanilla,chain"  # with --bundle
METHOD_NAMES = ("vanilla", "vanilla:DTYPE", "vanilla-dense", "vanilla-dense:DTYPE", "vanilla-compiled",
                "vanilla-compiled:DTYPE", "vanilla-compiled-dense", "vanilla-compiled-dense:DTYPE", "hf", "hf-pld",
                "hf-assisted:SOURCE[@DTYPE]", "pld", "pld-compiled", "chain:SPEC", "chain", "chain-compiled:SPEC",
                "chain-compiled", "chain-drafts-compiled:SPEC", "llamacpp", "llamacpp-pld")
