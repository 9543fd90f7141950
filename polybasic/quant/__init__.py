"""Quantization: config, pure rounding primitives, real low-bit linear kernels, quantize_()."""
from polybasic.config import QuantConfig
from polybasic.quant.api import (
                                 load_any_model,
                                 load_quantized,
                                 load_quantized_model,
                                 quantize_,
                                 quantized_modules,
                                 save_quantized,
)
from polybasic.quant.linear import DequantLinear, Int4PackLinear, Int8MMLinear, QuantLinear

__all__ = ["QuantConfig", "quantize_", "save_quantized", "load_quantized", "quantized_modules", "load_quantized_model", "load_any_model",
           "QuantLinear", "DequantLinear", "Int4PackLinear", "Int8MMLinear"]
