"""Decoding: vanilla generation, the lossless N-level chain, levels, sampling, statistics."""
from polybasic.runtime.chain import Chain
from polybasic.runtime.generate import GenerationStats, generate_tokens
from polybasic.runtime.levels import Level, ModelLevel, NGramLevel
from polybasic.runtime.sampling import SamplingConfig, make_generator
from polybasic.runtime.stats import ChainStats

__all__ = ["Chain", "ChainStats", "GenerationStats", "Level", "ModelLevel", "NGramLevel",
           "SamplingConfig", "generate_tokens", "make_generator"]
