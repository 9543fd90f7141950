"""polybasic: lossless multi-model (polybasic) speculative decoding.

    from polybasic import load_model, Chain, ModelLevel, NGramLevel, SamplingConfig
    lm = load_model("smollm2-135m")
    chain = Chain([ModelLevel(lm.model, "target"), NGramLevel()], k=5)
"""
from polybasic.models import load_model
from polybasic.quant import QuantConfig, quantize_
from polybasic.runtime import Chain, ModelLevel, NGramLevel, SamplingConfig, generate_tokens

__version__ = "0.1.0"
__all__ = ["Chain", "ModelLevel", "NGramLevel", "QuantConfig", "SamplingConfig", "generate_tokens",
           "load_model", "quantize_", "__version__"]
