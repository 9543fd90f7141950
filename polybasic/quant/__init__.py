"""Quantization: config, pure rounding primitives, real low-bit linear kernels, quantize_()."""
from polybasic.quant.api import load_quantized, quantize_, quantized_modules, save_quantized
from polybasic.quant.config import QuantConfig
from polybasic.quant.linear import DequantLinear, Int4PackLinear, Int8MMLinear, QuantLinear

__all__ = ["QuantConfig", "quantize_", "save_quantized", "load_quantized", "quantized_modules",
           "QuantLinear", "DequantLinear", "Int4PackLinear", "Int8MMLinear"]
