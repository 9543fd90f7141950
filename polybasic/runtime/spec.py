"""Chains spelled as text: the levels below the target, '+'-separated.

  ngram | ngram:N        prompt-lookup proposer (longest n-gram N, default 3)
  SOURCE[@DTYPE]         any model source load_model accepts (short name, .gguf, HF folder, Hub id)
  target@DTYPE           the target's own weights in another dtype (e.g. a bf16 copy)
  PATH.safetensors       a quantized copy of the target written by `polybasic quantize`
  eagle:PATH             an EAGLE drafter head (`polybasic distill`) drafting on the features of
                         the level just above it (which must be a model)
Examples: "target@bfloat16+ngram" (three levels with the target on top), "eagle:runs/x/head.safetensors".
"""
from __future__ import annotations

from polybasic.errors import ConfigError
from polybasic.models.loader import DTYPES, LoadedModel, load_model
from polybasic.runtime.levels import Level, ModelLevel, NGramLevel


def parse_level(item: str, target: LoadedModel, above: Level, device: str = "cpu") -> Level:
    """One level from its spelling; `above` is the level it drafts for."""
    item = item.strip()
    if not item:
        raise ConfigError("chain: empty level name (two '+' in a row?); spell levels like 'target@bf16+ngram'")
    if item.startswith("eagle:"):
        from polybasic.drafters.head import load_head
        from polybasic.drafters.level import EagleLevel

        if not isinstance(above, ModelLevel):
            raise ConfigError(f"chain: '{item}' drafts on the features of the level above it, but "
                              f"'{above.name}' is not a model; put the head right below a model level")
        return EagleLevel(load_head(item[len("eagle:"):], above.model), above, name=item)
    if item == "ngram" or item.startswith("ngram:"):
        n = item.partition(":")[2] or "3"
        if not n.isdigit():
            raise ConfigError(f"chain: '{item}' needs an integer n-gram size, e.g. ngram:3")
        return NGramLevel(max_ngram=int(n), name=item)
    if item.endswith(".safetensors"):
        from polybasic.models.llama import Transformer
        from polybasic.quant import load_quantized

        model = load_quantized(item, lambda: Transformer(target.args), device=device)
        return ModelLevel(model, name=item, tokenizer=target.tokenizer)
    source, dtype = item, "float32"
    if "@" in item and item.rsplit("@", 1)[1] in DTYPES:
        source, dtype = item.rsplit("@", 1)
    if source == "target":
        source = target.name
    lm = load_model(source, dtype, device)
    return ModelLevel(lm.model, name=item, tokenizer=lm.tokenizer)


def parse_chain(spec: str, target: LoadedModel, device: str = "cpu") -> list[Level]:
    """Target level first, then the levels the spec names. A spec may start with 'target+'."""
    items = spec.split("+")
    if items[0] == "target":
        items = items[1:]
    if not items:
        raise ConfigError(f"chain: '{spec}' names no level below the target; e.g. 'target@bf16+ngram'")
    levels: list[Level] = [ModelLevel(target.model, name="target", tokenizer=target.tokenizer)]
    for item in items:
        levels.append(parse_level(item, target, levels[-1], device))
    return levels
