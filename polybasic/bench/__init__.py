"""Spec-Bench harness: questions.py (load/select), methods.py (name -> runner registry), peers.py and
peer_worker.py (peer engines such as llama.cpp, llama_peer.py, each in its own process), runner.py
(interleaved timing, aggregation), records.py (every measurement appended as it comes; --resume),
identity.py (lossless methods against their reference), suite.py (a whole run from its options),
report.py (JSON, markdown, tables), plots.py (speedup per category). The flags: polybasic.cli.bench.

The method names live here, free of torch, for the command line's help."""

DEFAULT_METHODS = "vanilla,hf,hf-pld,pld"
BUNDLE_METHODS = "vanilla,chain"  # with --bundle
PEER_TIMEOUT_S = 600.0  # --peer-timeout: seconds a peer's process may take per request (load, prompt)
METHOD_NAMES = ("vanilla", "vanilla:DTYPE", "vanilla-dense", "vanilla-dense:DTYPE", "vanilla-compiled",
                "vanilla-compiled:DTYPE", "vanilla-compiled-dense", "vanilla-compiled-dense:DTYPE", "hf", "hf-pld",
                "hf-assisted:SOURCE[@DTYPE]", "pld", "pld-compiled", "chain:SPEC", "chain", "chain-compiled:SPEC",
                "chain-compiled", "chain-drafts-compiled:SPEC", "llamacpp", "llamacpp-pld")
