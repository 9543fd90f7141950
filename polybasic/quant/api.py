"""quantize_(model, config) swaps nn.Linear modules in place; save/load quantized checkpoints.

Checkpoint = one safetensors file whose metadata carries the versioned QuantConfig JSON and the
list of quantized module names (the recipe lives in the checkpoint, never in the file name).
Tensors that share storage (a tied embedding / LM head) are written once and re-tied on load.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from polybasic.artifacts import save_safetensors
from polybasic.config import QuantConfig
from polybasic.errors import ConfigError, ModelNotFoundError
from polybasic.models.decoder import Transformer
from polybasic.models.loader import (LoadedModel, folder_and_args, load_model, load_tokenizer, parse_dtype,
                                     source_gguf)
from polybasic.models.preflight import (CODES_KERNEL, FIX_QUANTIZED, QUANT_FORMAT, corrupt_safetensors,
                                        safetensors_metadata, split_kernel)
from polybasic.models.prepare import prepare_for_device
from polybasic.models.native import cpu_flags
from polybasic.models.registry import cache_root
import polybasic.quant.gguf_w4a8 as gguf_w4a8
import polybasic.quant.linear as quant_linear
import polybasic.quant.w4a8 as w4a8
from polybasic.quant.linear import KERNEL_CLASSES, QuantLinear, choose_kernel

FORMAT = QUANT_FORMAT
log = logging.getLogger(__name__)
LM_HEAD = "output"

FilterFn = Callable[[nn.Module, str], bool]


def default_filter(config: QuantConfig) -> FilterFn:
    """Every nn.Linear, except the LM head `output` unless config.quantize_lm_head."""
    return lambda mod, fqn: isinstance(mod, nn.Linear) and (fqn != LM_HEAD or config.quantize_lm_head)


def _targets(model: nn.Module, keep: FilterFn) -> list[tuple[str, nn.Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, QuantLinear) and keep(m, fqn)]


def quantize_(model: nn.Module, config: QuantConfig, filter_fn: FilterFn | None = None,
              device: str | torch.device | None = None, empty: bool = False) -> nn.Module:
    """Replace the selected nn.Linear modules by quantized ones (round-to-nearest), in place.

    Every layer is checked (group size, kernel fit) before any weight is touched. 'auto' kernels
    are resolved per layer from its shape, device and weight dtype (the activation dtype).
    The LM head is replaced as a module only, so a tied embedding keeps its own weight.
    device: where the kernels will run (default: each weight's device).
    empty: swap in empty modules of the right shapes and kernels instead (load_state_dict(assign=True) fills them).
    """
    plan = {}
    for fqn, lin in _targets(model, filter_fn or default_filter(config)):
        dev = torch.device(device) if device is not None else lin.weight.device
        plan[fqn] = choose_kernel(config, lin.in_features, lin.out_features, dev, fqn, lin.weight.dtype)
    return _swap(model, config, plan, device, empty)


def _swap(model: nn.Module, config: QuantConfig, plan: dict[str, str], device=None, empty: bool = False) -> nn.Module:
    """Swap the Linear named by each key of plan for a module of its kernel; a Linear on the
    meta device (every one with `empty`) becomes an empty module of the right shapes (filled by load_quantized)."""
    linears = {fqn: model.get_submodule(fqn) for fqn in plan}
    for fqn, lin in linears.items():  # validate everything first (cheap, on meta)
        if not isinstance(lin, nn.Linear) or isinstance(lin, QuantLinear):
            raise ConfigError(f"{fqn}: is a {type(lin).__name__}, not an nn.Linear; build the "
                              "architecture the checkpoint was saved from")
        dev = torch.device(device) if device is not None else lin.weight.device
        why = KERNEL_CLASSES[plan[fqn]].check_shape(lin.in_features, lin.out_features, config, dev, fqn)
        if why:
            raise ConfigError(f"{fqn}: kernel '{plan[fqn]}' {why}; use another kernel")
        KERNEL_CLASSES[plan[fqn]](lin.in_features, lin.out_features, config, device="meta", name=fqn)
    for fqn, lin in linears.items():
        cls = KERNEL_CLASSES[plan[fqn]]
        if empty or lin.weight.is_meta:
            bias = lin.bias is not None
            new = cls(lin.in_features, lin.out_features, config, bias,
                      lin.bias.dtype if bias else torch.float32, "meta", fqn)
        else:
            new = cls.from_float(lin, config, fqn)
        parent, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


HEAD_ROUNDED = ("layers.", "fc", "lm_head")  # the linears quantize_head rounds (in its cache key): "x." a prefix


def _head_linear(m: nn.Module, fqn: str) -> bool:
    return any(fqn.startswith(n) if n.endswith(".") else fqn == n for n in HEAD_ROUNDED)


def quantize_head(head: nn.Module, kernel: str, cache: bool = True) -> nn.Module:
    """A bound drafter head (models.eagle_head) on 4-bit weights in groups of 32 (round-to-nearest) on `kernel`, in
    place: fc, its decoder blocks and its draft vocabulary's LM head rows (an eagle3 head's own `lm_head`, an eagle1
    head's rows of the base's), so a draft step reads about a quarter of the bytes. fc was kept as trained before
    2026-11-29: rounded, it reads 2.6 MB a feed instead of 9.4 MB in bf16 on Qwen2.5-Coder-1.5B, and the recipe's
    head drafted 1.9-3.5% faster with the same acceptance (docs/drafters.md, heads on 4-bit weights).
    Lossless all the same: a chain verifies the head's drafts against the distributions it sampled them from.
    cache: keep the 4-bit tensors under $POLYBASIC_CACHE/quantized-heads, keyed by the head's tensors (and an eagle1
    head's base LM head), the kernel and this code; a later call loads them instead of rounding again (~2 s for
    Qwen2.5-Coder-1.5B's head, whose draft rows come dequantized from the target's GGUF codes). A cached file that
    cannot be read is rounded again and replaced; one that cannot be written only costs the next call the rounding."""
    config = QuantConfig(w_bits=4, group_size=32, kernel=kernel)
    eagle1 = not hasattr(head, "lm_head")  # its draft rows are the base LM head's, as base_logits would run them
    rows = nn.ModuleDict()
    path = cache_root() / "quantized-heads" / f"{_head_key(head, config, eagle1)}.safetensors" if cache else None
    if path is None or not _load_quantized_head(head, rows, config, _head_linear, eagle1, path):
        quantize_(head, config, _head_linear)
        if eagle1:
            w = head.draft_rows(head.dtype)  # [N, E]
            rows["rows"] = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            rows["rows"].weight.data = w
            quantize_(rows, config)
        if path is not None:
            try:
                save_safetensors(path, {k: t.contiguous() for k, t in _quantized_state(head, rows).items()})
            except OSError as e:
                log.warning("could not cache the 4-bit head in %s (%s)", path, e)
    if eagle1:
        head.use_rows(rows["rows"])
    return head


def _quantized_state(head: nn.Module, rows: nn.ModuleDict) -> dict[str, Tensor]:
    """The state of the head's quantized modules ('head.' names) and of its draft rows' ('rows.')."""
    return {f"{where}.{fqn}.{k}": t for where, mod in (("head", head), ("rows", rows))
            for fqn in quantized_modules(mod) for k, t in mod.get_submodule(fqn).state_dict().items()}


def _load_quantized_head(head: nn.Module, rows: nn.ModuleDict, config: QuantConfig, keep: FilterFn, eagle1: bool,
                         path: Path) -> bool:
    """quantize_head's work from its cached file: empty modules of the kernels quantize_head picks, filled from
    `path`. False (nothing changed) where the file is missing, unreadable or holds other tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        return False
    dev = head.device
    try:
        sd = load_file(str(path), device=str(dev))
    except (SafetensorError, OSError) as e:
        log.warning("rounding the head to 4 bits again: its cached copy %s cannot be read (%s)", path, e)
        return False
    originals = dict(_targets(head, keep))
    quantize_(head, config, keep, device=dev, empty=True)
    if eagle1:
        n = head.cfg.vocab_size if head.d2t is None else head.d2t.shape[0]
        rows["rows"] = nn.Linear(head.cfg.dim, n, bias=False, device="meta", dtype=head.dtype)
        quantize_(rows, config, device=dev, empty=True)
    if set(sd) != set(_quantized_state(head, rows)):
        log.warning("rounding the head to 4 bits again: its cached copy %s holds other tensors", path)
        for fqn, lin in originals.items():
            parent, _, attr = fqn.rpartition(".")
            setattr(head.get_submodule(parent) if parent else head, attr, lin)
        rows.clear()
        return False
    head.load_state_dict({k.removeprefix("head."): t for k, t in sd.items() if k.startswith("head.")}, strict=False,
                         assign=True)
    if eagle1:
        rows.load_state_dict({k.removeprefix("rows."): t for k, t in sd.items() if k.startswith("rows.")}, assign=True)
    return True


def _head_key(head: nn.Module, config: QuantConfig, eagle1: bool) -> str:
    """What quantize_head's output depends on: the head's tensors, what an eagle1 head's draft rows are read from,
    the config, the device (a CPU's flags pick the kernels), torch's version and the code of the quantized kernels."""
    dev = head.device
    where = cpu_flags() if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    h = hashlib.sha256(repr((config.to_dict(), dev.type, where, torch.__version__, HEAD_ROUNDED)).encode())
    for mod in (quant_linear, w4a8, gguf_w4a8):
        h.update(Path(mod.__file__).read_bytes())
    tensors = [(n, t) for m in ([head, head.rows_source()] if eagle1 else [head])
               for n, t in [*m.named_parameters(), *m.named_buffers()]]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()[:24]


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module name: kernel} of every quantized linear in model."""
    return {fqn: m.kernel for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}


def save_quantized(model: nn.Module, path: str | os.PathLike, config: QuantConfig, source: str = "") -> Path:
    """Write model's state dict + config to one safetensors file, atomically (polybasic.artifacts).
    source: the float model's source (short name, folder, ...), so `load_model(path)` finds its
    architecture and tokenizer."""
    path = Path(path)
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    meta = {"format": FORMAT, "quant_config": json.dumps(config.to_dict()), "dtype": str(dtype),
            "modules": json.dumps(quantized_modules(model)), "aliases": json.dumps(aliases),
            "source": source}
    save_safetensors(path, tensors, meta)
    return path


def quant_header(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a polybasic quantized checkpoint, read from its checked header (errors name
    the problem: missing, damaged or truncated file, another format)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"path: quantized checkpoint {path} does not exist; run quantize first")
    meta = safetensors_metadata(path, FIX_QUANTIZED)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a polybasic quantized checkpoint (metadata format="
                          f"{meta.get('format')!r}); save it with save_quantized")
    return meta


def read_quant_metadata(path: str | os.PathLike
                        ) -> tuple[QuantConfig, dict[str, str], dict[str, str], torch.dtype]:
    """(config, {module: kernel at save time}, {alias: stored name}, model dtype) from the header."""
    meta = quant_header(path)
    return (QuantConfig.from_dict(json.loads(meta["quant_config"])), json.loads(meta["modules"]),
            json.loads(meta["aliases"]), getattr(torch, meta.get("dtype", "torch.float32").split(".")[-1]))


def load_quantized(path: str | os.PathLike, base_model_builder: Callable[[], nn.Module],
                   device: str | torch.device = "cpu", kernel: str | None = None) -> nn.Module:
    """Build the float architecture on the meta device, swap in empty quantized modules, then load
    the checkpoint with assign=True (kernel buffers are rebuilt by a load post-hook).

    kernel: run with another execution kernel than the one recorded (the stored state is
    kernel-independent), e.g. 'dequant' where int4pack is unavailable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, modules, aliases, dtype = read_quant_metadata(path)
    if kernel is not None:
        config = replace(config, kernel=kernel)  # re-validated by __post_init__
    with torch.device("meta"):
        model = base_model_builder()
    if kernel is None:  # the kernels recorded at save time
        plan = modules
    else:
        plan = {}
        for fqn in modules:
            lin = model.get_submodule(fqn)
            plan[fqn] = choose_kernel(config, lin.in_features, lin.out_features, torch.device(device),
                                      fqn, dtype)
    try:
        _swap(model, config, plan, device)
    except AttributeError as e:
        raise ConfigError(f"{path}: {e}; build the architecture the checkpoint was saved from") from None
    try:
        sd = load_file(str(path), device=str(device))
    except SafetensorError as e:
        raise corrupt_safetensors(path, FIX_QUANTIZED, e) from None
    for alias, name in aliases.items():
        sd[alias] = sd[name]
    model.load_state_dict(sd, strict=True, assign=True)
    for alias, name in aliases.items():  # assign=True split the tensors shared at save time: share again
        (mod, _, attr), (src, _, src_attr) = alias.rpartition("."), name.rpartition(".")
        setattr(model.get_submodule(mod), attr, getattr(model.get_submodule(src), src_attr))

    # the float modules left (e.g. a tied LM head) get the layout and kernels load_model gives them
    # (bf16_rows for bf16 linears and attention on the CPU), so the copy runs the same kernels on the same
    # layouts as the model it was saved from: equal outputs
    return prepare_for_device(model.eval().requires_grad_(False))


def load_quantized_model(path: str, device: str = "cpu", kernel: str | None = None) -> LoadedModel:
    """A quantized copy written by `polybasic quantize`, with the tokenizer of the model it was
    made from (recorded in its metadata); it runs in the dtype and kernels it was saved with (or every
    quantized layer in `kernel`, see load_quantized)."""
    base = quant_header(path).get("source", "")
    if not base:
        raise ConfigError(f"model: {path} does not record the model it was quantized from (written by an "
                          "older polybasic); re-run `polybasic quantize RECIPE.yaml`")
    folder, args = folder_and_args(base)
    model = load_quantized(path, lambda: Transformer(args), device=device, kernel=kernel)
    return LoadedModel(model, load_tokenizer(folder), args, str(path), folder)


def load_any_model(source: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> LoadedModel:
    """`models.load_model(source)`, or the quantized copy a `.safetensors` source names (which runs in
    the dtype and kernels it was saved with), or for 'NAME@w4a8' the model NAME whose linears run its GGUF's
    own Q4_K/Q6_K codes on the CPU kernel w4a8 (quant.gguf_w4a8; the rest in `dtype`)."""
    if str(source).endswith(".safetensors"):
        return load_quantized_model(source, device)
    base, coded = split_kernel(source)
    if not coded:
        return load_model(source, dtype, device)
    gguf_w4a8.check(device)  # before loading anything
    folder, args = folder_and_args(base)
    gguf = source_gguf(folder)
    model = gguf_w4a8.load_bound(gguf, args, parse_dtype(dtype)) if gguf is not None else None
    if model is not None:  # a later load: from the binding's cache alone
        return LoadedModel(prepare_for_device(model), load_tokenizer(folder), args, source, folder)
    lm = load_model(base, dtype, device)
    if lm.gguf_file is None:
        raise ConfigError(f"model: '{source}': '{CODES_KERNEL}' runs a GGUF file's own codes, and {base} was not "
                          f"loaded from one; drop '{CODES_KERNEL}'")
    swapped, total = gguf_w4a8.bind(lm.model, lm.gguf_file)
    if not swapped:
        raise ConfigError(f"model: '{source}': none of its {total} linears is held as Q4_K/Q6_K codes in "
                          f"{lm.gguf_file.name}; drop '{CODES_KERNEL}'")
    return replace(lm, name=source)
