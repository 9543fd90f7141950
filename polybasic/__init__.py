"""polybasic: lossless multi-model (polybasic) speculative decoding.

    from polybasic import load_model, Chain, ModelLevel, NGramLevel, SamplingConfig
    lm = load_model("smollm2-135m")
    chain = Chain([ModelLevel(lm.model, "target"), NGramLevel()], k=5)

The public names are imported on first use, so `import polybasic` (and the command line's help
and argument errors) stay free of torch.
"""
from polybasic._lazy import lazy_exports

__version__ = "0.1.0"
_EXPORTS = {"load_model": "models", "QuantConfig": "quant", "quantize_": "quant", "Chain": "runtime",
            "ModelLevel": "runtime", "NGramLevel": "runtime", "SamplingConfig": "runtime",
            "generate_tokens": "runtime"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [*_EXPORTS, "__version__"]
