"""Lean decoders, model args, and loaders (packaged GGUF, local HF folder, Hub id).

Names are imported on first use: `polybasic.models.registry` and `.preflight` stay free of torch.
"""
from polybasic._lazy import lazy_exports

_EXPORTS = {"ModelArgs": "args", "Transformer": "decoder", "build_model": "decoder",
            "hf_to_lean_state_dict": "decoder", "LoadedModel": "loader", "load_model": "loader",
            "load_hf_model": "loader", "parse_dtype": "loader"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
