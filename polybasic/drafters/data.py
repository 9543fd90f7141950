"""Drafter training data: token sequences, and the base model's features on them.

Sequences: the base model's own answers to instruction prompts (self-distillation, generated in
batches), optionally plus the dataset's reference answers (teacher-forced, as EAGLE-1 trained on
fixed ShareGPT replies: a prefill costs a fraction of a generated token). Prompts come from a JSON
list or JSONL file in Alpaca or ShareGPT format.

Features (the base's last hidden states) are either recomputed by every training step ("online")
or computed once by batched prefills and cached as safetensors shards ("cache"); the base's
next-token distributions are always derived from them through its frozen norm and LM head.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from polybasic.errors import ConfigError
from polybasic.pipelines.records import read_records
from polybasic.runtime.sampling import SamplingConfig, make_generator
from polybasic.runtime.text import encode_prompt, eos_ids

DEFAULT_DATA = "../shared/data/alpaca_1000/alpaca_data_cleaned_1000.json"
SCHEMA = ('Alpaca: [{"instruction": str, "input": str (optional), "output": str}, ...] or '
          'ShareGPT: [{"conversations": [{"from": "human", "value": str}, {"from": "gpt", "value": str}, ...]}, ...]'
          ' (a JSON list, or one object per line in a .jsonl file)')


def _pair(rec, i: int, path: Path) -> tuple[str, str | None]:
    """(user prompt, reference answer or None) of one record."""
    if isinstance(rec, dict) and isinstance(rec.get("instruction"), str):
        extra = rec.get("input") or ""
        out = rec.get("output")
        return rec["instruction"] + (f"\n\n{extra}" if extra else ""), out if isinstance(out, str) else None
    if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
        turns = [t for t in rec["conversations"] if isinstance(t, dict) and isinstance(t.get("value"), str)]
        for j, turn in enumerate(turns):  # the first user turn, and the reply after it
            if turn.get("from") in ("human", "user"):
                nxt = turns[j + 1] if j + 1 < len(turns) else None
                ans = nxt["value"] if nxt is not None and nxt.get("from") in ("gpt", "assistant") else None
                return turn["value"], ans
    raise ConfigError(f"data.path: record {i} of {path} is neither Alpaca nor ShareGPT "
                      f"(got {str(rec)[:80]!r}); expected {SCHEMA}")


def load_pairs(path: str | Path, limit: int | None = None) -> list[tuple[str, str | None]]:
    """(prompt, reference answer or None) from an Alpaca or ShareGPT JSON/JSONL file (first `limit`
    records; records with an empty prompt are skipped)."""
    p = Path(path)
    recs = read_records(p, "data.path", f"{SCHEMA} (default {DEFAULT_DATA})")[:limit]
    pairs = [x for x in (_pair(r, i, p) for i, r in enumerate(recs)) if x[0].strip()]
    if not pairs:
        raise ConfigError(f"data.path: {p} holds no usable prompts; expected {SCHEMA}")
    return pairs


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """User prompts from an Alpaca or ShareGPT JSON/JSONL file (first `limit` records)."""
    return [q for q, _ in load_pairs(path, limit)]


@dataclass
class Sample:
    tokens: list[int]  # prompt + answer
    n_prompt: int  # loss only on the answer
    feats: Tensor | None = None  # [len(tokens), E] the base's features, when cached


def _batches(n: int, size: int, lengths: list[int]) -> list[list[int]]:
    """Indices grouped by similar length (less padding), in batches of `size`."""
    order = sorted(range(n), key=lambda i: lengths[i])
    return [order[i:i + size] for i in range(0, n, size)]


def self_distill(model, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, max_prompt_tokens: int = 512,
                 eos: set[int] | None = None, progress: bool = False, batch_size: int = 32) -> list[Sample]:
    """Base-model answers (chat template), `batch_size` prompts per decode loop (left-padded),
    in the order of `prompts`. Prompts longer than max_prompt_tokens are left-truncated."""
    from tqdm import tqdm

    from polybasic.runtime.batch import generate_batch

    g = make_generator(seed)
    eos = eos if eos is not None else eos_ids(tokenizer)
    ids = [encode_prompt(tokenizer, text)[-max_prompt_tokens:] for text in prompts]
    out: list[Sample | None] = [None] * len(ids)
    n_new, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(ids), desc="self-distill", unit="prompt", disable=not progress)
    for idx in _batches(len(ids), batch_size, [len(x) for x in ids]):
        for i, ans in zip(idx, generate_batch(model, [ids[i] for i in idx], max_new_tokens, sampling, eos, g)):
            out[i] = Sample(ans.tokens, ans.n_prompt)
            n_new += len(ans.tokens) - ans.n_prompt
        bar.update(len(idx))
        bar.set_postfix(new_tok_s=f"{n_new / (time.perf_counter() - t0):.0f}")
    bar.close()
    return out


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user message's text begins."""
    mark = "\ue000"  # a private-use character no template adds by itself
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False) \
        if getattr(tokenizer, "chat_template", None) else ""
    if mark not in text:
        raise ConfigError("distill.self_instruct: the tokenizer has no chat template with a user turn; "
                          "set self_instruct: 0 and give prompts in distill.data")
    return tokenizer.encode(text.split(mark)[0], add_special_tokens=False)


def self_instruct(model, tokenizer, n: int, max_tokens: int = 96, seed: int = 0, batch_size: int = 32,
                  progress: bool = False) -> list[str]:
    """`n` distinct user prompts written by the model itself (Magpie, Xu et al. 2024): the chat
    template is opened at a user turn and sampled (T=1, top-p 0.95) until the turn ends.
    Unfinished, empty and repeated prompts are dropped; sampling stops after 3n attempts."""
    from tqdm import tqdm

    from polybasic.runtime.batch import generate_batch

    prefix = user_turn_prefix(tokenizer)
    eos = eos_ids(tokenizer)
    g = make_generator(seed)
    seen: dict[str, None] = {}
    bar = tqdm(total=n, desc="self-instruct", unit="prompt", disable=not progress)
    for _ in range(-(-3 * n // batch_size)):
        if len(seen) >= n:
            break
        rows = generate_batch(model, [prefix] * batch_size, max_tokens, SamplingConfig(1.0, 0, 0.95), eos, g)
        for row in rows:
            new = row.tokens[row.n_prompt:]
            if not new or new[-1] not in eos:  # no end of turn within max_tokens
                continue
            text = tokenizer.decode(new[:-1], skip_special_tokens=True).strip()
            if len(text) >= 8 and text not in seen and len(seen) < n:
                seen[text] = None
                bar.update(1)
    bar.close()
    return list(seen)


def reference_samples(tokenizer, pairs: list[tuple[str, str | None]], max_len: int) -> list[Sample]:
    """The dataset's own answers in the chat template (records without one are skipped)."""
    out = []
    for q, ans in pairs:
        if not ans or not ans.strip():
            continue
        prompt = encode_prompt(tokenizer, q)
        full = encode_prompt(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": ans}],
                             add_generation_prompt=False)
        if full[:len(prompt)] != prompt or len(prompt) >= max_len - 1:  # template oddity, or no room
            continue
        out.append(Sample(full[:max_len], len(prompt)))
    return out


@torch.inference_mode()
def compute_features(model, samples: list[Sample], batch_tokens: int = 4096, progress: bool = False,
                     desc: str = "features") -> list[Tensor]:
    """The base's last hidden states [len, E] (bf16, CPU) for every sample, by right-padded
    batched prefills of about `batch_tokens` tokens (padding sits after each sequence, so under
    causal attention it changes nothing before it)."""
    from tqdm import tqdm

    lengths = [len(s.tokens) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: lengths[i])
    feats: list[Tensor | None] = [None] * len(samples)
    bar = tqdm(total=sum(lengths), desc=desc, unit="tok", unit_scale=True, disable=not progress)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * lengths[order[j]] <= batch_tokens:
            j += 1
        idx = order[i:j]
        t = max(lengths[k] for k in idx)
        tokens = torch.zeros(len(idx), t, dtype=torch.long)  # [B, T]
        for r, k in enumerate(idx):
            tokens[r, :lengths[k]] = torch.tensor(samples[k].tokens)
        model.setup_caches(t, len(idx))
        _, hidden = model(tokens.to(model.device), 0)  # [B, T, E]
        for r, k in enumerate(idx):
            feats[k] = hidden[r, :lengths[k]].to("cpu", torch.bfloat16).clone()
        bar.update(sum(lengths[k] for k in idx))
        i = j
    bar.close()
    return feats


def save_feature_shard(path: Path, samples: list[Sample]) -> None:
    """One safetensors shard: concatenated tokens and features, offsets and prompt lengths."""
    from safetensors.torch import save_file

    lens = torch.tensor([len(s.tokens) for s in samples])
    tensors = {"tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int32),
               "feats": torch.cat([s.feats for s in samples]).contiguous(),  # [sum len, E]
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
               "n_prompt": torch.tensor([s.n_prompt for s in samples])}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "polybasic-features"})
    tmp.replace(path)


def load_feature_shard(path: Path) -> list[Sample]:
    from safetensors.torch import load_file

    t = load_file(str(path))
    off, toks = t["offsets"].tolist(), t["tokens"]
    return [Sample(toks[a:b].tolist(), int(n), t["feats"][a:b])
            for a, b, n in zip(off[:-1], off[1:], t["n_prompt"].tolist())]


class DistillDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[Sample], max_len: int) -> None:
        if not samples:
            raise ConfigError("data: the self-distillation set is empty; pass a file with prompts")
        self.samples, self.max_len = samples, max_len

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def collate(batch: list[Sample], max_len: int = 1 << 30, prompt_loss: bool = False) -> dict[str, Tensor]:
    """Right-padded tokens [B, T], loss mask [B, T] (1 on answer tokens, or on every token with
    prompt_loss; padding is harmless under causal attention) and, when the samples carry them,
    features [B, T, E]."""
    t = min(max(len(s.tokens) for s in batch), max_len)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t)
    has_feats = batch[0].feats is not None
    feats = torch.zeros(len(batch), t, batch[0].feats.shape[-1], dtype=batch[0].feats.dtype) if has_feats else None
    for i, s in enumerate(batch):
        n = min(len(s.tokens), t)
        tokens[i, :n] = torch.tensor(s.tokens[:n])
        mask[i, 0 if prompt_loss else s.n_prompt:n] = 1.0
        if has_feats:
            feats[i, :n] = s.feats[:n]
    out = {"tokens": tokens, "mask": mask}
    if has_feats:
        out["feats"] = feats
    return out


class EpochSampler(torch.utils.data.Sampler):
    """Seeded shuffle per epoch, sharded over ranks: the order depends only on (seed, epoch), so a
    run resumed at an epoch boundary sees the same batches as an uninterrupted one. With `lengths`
    and `batch_size`, each batch holds sequences of similar length (sorted within windows of 32
    batches, batch order shuffled): far less padding."""

    def __init__(self, n: int, seed: int = 0, lengths: list[int] | None = None, batch_size: int = 1) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self.lengths, self.batch_size = lengths, batch_size

    @staticmethod
    def _ranks() -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        b = self.batch_size
        if self.lengths is not None:
            w = 32 * b
            order = [i for k in range(0, self.n, w) for i in sorted(order[k:k + w], key=lambda i: self.lengths[i])]
        batches = [order[k:k + b] for k in range(0, self.n - self.n % b, b)]  # full batches only
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in perm]

    def __iter__(self):
        rank, world = self._ranks()
        batches = self._batches()
        per = len(batches) // world
        return iter([i for bt in batches[rank * per:(rank + 1) * per] for i in bt])

    def __len__(self) -> int:
        return (self.n // self.batch_size) // self._ranks()[1] * self.batch_size
