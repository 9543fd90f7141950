"""Decoding: vanilla generation, the lossless N-level chain, levels, sampling, statistics.

Names are imported on first use: `polybasic.runtime.chainspec` stays free of torch.
"""
from polybasic._lazy import lazy_exports

_EXPORTS = {"Chain": "chain", "GenerationStats": "generate", "generate_tokens": "generate",
            "Level": "levels", "ModelLevel": "levels", "NGramLevel": "levels", "SamplingConfig": "sampling",
            "make_generator": "sampling", "ChainStats": "stats", "load": "bundle", "BundleDecoder": "bundle",
            "push_bundle": "hub"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
