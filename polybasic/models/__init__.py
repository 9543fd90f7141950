"""Lean decoders, model args, and loaders (packaged GGUF, local HF folder, Hub id)."""
from polybasic.models.args import ModelArgs
from polybasic.models.llama import Transformer, build_model, hf_to_lean_state_dict
from polybasic.models.loader import LoadedModel, load_hf_model, load_model, parse_dtype

__all__ = ["ModelArgs", "Transformer", "build_model", "hf_to_lean_state_dict", "LoadedModel",
           "load_model", "load_hf_model", "parse_dtype"]
