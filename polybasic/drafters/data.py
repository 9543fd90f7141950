"""Drafter training data: token sequences, and the base model's features on them.

Sequences: the base model's own answers to instruction prompts (self-distillation, generated in
batches), optionally plus the dataset's reference answers (teacher-forced, as EAGLE-1 trained on
fixed ShareGPT replies: a prefill costs a fraction of a generated token). Prompts come from Alpaca
or ShareGPT records of any data source (polybasic.data: json / jsonl / parquet / csv, Hub ids).

Features (the base's last hidden states) are either recomputed by every training step ("online")
or computed once by batched prefills and cached as safetensors shards ("cache"); the base's
next-token distributions are always derived from them through its frozen norm and LM head.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from polybasic.artifacts import fault_point, save_safetensors, seed_for, write_text
from polybasic.config import SamplingConfig
from polybasic.data import DEFAULT_DATA, SCHEMAS, DataSource, read_examples  # noqa: F401 (DEFAULT_DATA)
from polybasic.errors import ConfigError
from polybasic.runtime.batch import generate_batch
from polybasic.runtime.sampling import make_generator
from polybasic.runtime.text import encode_prompt, eos_ids


def load_pairs(source: DataSource | str | Path, limit: int | None = None,
               field: str = "distill.data") -> list[tuple[str, str | None]]:
    """(prompt, reference answer or None) of the first `limit` Alpaca or ShareGPT records of
    `source` (any DataSource: file or Hub id); records with an empty prompt are skipped. `field`
    is the recipe field errors name."""
    src = source if isinstance(source, DataSource) else DataSource(str(source))
    pairs = [x for x in (ex.exchange() for ex in read_examples(src, field, True, limit)) if x[0].strip()]
    if not pairs:
        raise ConfigError(f"{field}: {src} holds no usable prompts (every prompt is empty); expected {SCHEMAS}")
    return pairs


def load_prompts(source: DataSource | str | Path, limit: int | None = None) -> list[str]:
    """User prompts of the first `limit` Alpaca or ShareGPT records of `source`."""
    return [q for q, _ in load_pairs(source, limit)]


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
                 eos: set[int] | None = None, progress: bool = False, batch_size: int = 32,
                 shard_dir: Path | None = None) -> list[Sample]:
    """Base-model answers (chat template), `batch_size` prompts per decode loop (left-padded),
    in the order of `prompts`. Prompts longer than max_prompt_tokens are left-truncated.
    Batch j samples with its own generator (seed, j), so it does not depend on the other batches;
    with shard_dir each batch's answers are saved as a shard when done (`answers-JJJJJ.jsonl`) and
    a finished shard is read instead of generated again."""
    from tqdm import tqdm

    eos = eos if eos is not None else eos_ids(tokenizer)
    ids = [encode_prompt(tokenizer, text)[-max_prompt_tokens:] for text in prompts]
    out: list[Sample | None] = [None] * len(ids)
    generated, t0 = [0], time.perf_counter()  # answer tokens generated in this call (a finished shard's are read)
    bar = tqdm(total=len(ids), desc="self-distill", unit="prompt", disable=not progress)
    for j, idx in enumerate(_batches(len(ids), batch_size, [len(x) for x in ids])):
        def answer(idx=idx, j=j) -> list[dict]:
            g = make_generator(seed_for(seed, 0, j), model.device)
            rows = [{"tokens": a.tokens, "n_prompt": a.n_prompt}
                    for a in generate_batch(model, [ids[i] for i in idx], max_new_tokens, sampling, eos, g)]
            generated[0] += sum(len(r["tokens"]) - r["n_prompt"] for r in rows)
            return rows

        for i, ans in zip(idx, batch_shard(shard_dir, "answers", j, answer)):
            out[i] = Sample(ans["tokens"], ans["n_prompt"])
        bar.update(len(idx))
        if generated[0]:
            bar.set_postfix(new_tok_s=f"{generated[0] / (time.perf_counter() - t0):.0f}")
    bar.close()
    return out


def batch_shard(folder: Path | None, name: str, j: int, make) -> list:
    """The JSON rows of batch j: read from folder/NAME-JJJJJ.jsonl when that shard is finished,
    else `make()`d and saved there atomically (a resume point: fault point distill.samples_shard)."""
    if folder is None:
        return make()
    path = Path(folder) / f"{name}-{j:05d}.jsonl"
    if path.is_file():
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    rows = make()
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    fault_point("distill.samples_shard")
    return rows


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
                  progress: bool = False, shard_dir: Path | None = None, openings: Sequence[str] = ()) -> list[str]:
    """`n` distinct user prompts written by the model itself (Magpie, Xu et al. 2024): the chat
    template is opened at a user turn and sampled (T=1, top-p 0.95) until the turn ends.
    With `openings`, batch j's turns begin with openings[j % len(openings)] (task-seeded prompts:
    "Summarize the following article:" steers the model toward that kind of request); the opening
    is part of the prompt. Unfinished, empty and repeated prompts are dropped; sampling stops after
    3n attempts. Batch j samples with its own generator (seed, j); with shard_dir each batch's
    finished turns are saved as a shard (`prompts-JJJJJ.jsonl`) and reused on a rerun."""
    from tqdm import tqdm

    prefix = user_turn_prefix(tokenizer)
    eos = eos_ids(tokenizer)
    seen: dict[str, None] = {}
    bar = tqdm(total=n, desc="self-instruct", unit="prompt", disable=not progress)

    def opening(j: int) -> str:
        return openings[j % len(openings)] if openings else ""

    def turns(j: int) -> list[str]:  # the finished user turns of batch j, each with its opening
        g = make_generator(seed_for(seed, 1, j), model.device)
        start = prefix + tokenizer.encode(opening(j), add_special_tokens=False)  # [P]
        rows = generate_batch(model, [start] * batch_size, max_tokens, SamplingConfig(1.0, 0, 0.95), eos, g)
        return [tokenizer.decode(r.tokens[len(prefix):-1], skip_special_tokens=True).strip() for r in rows
                if len(r.tokens) > r.n_prompt and r.tokens[-1] in eos]  # else no end of turn within max_tokens

    for j in range(-(-3 * n // batch_size)):
        if len(seen) >= n:
            break
        for text in batch_shard(shard_dir, "prompts", j, lambda: turns(j)):
            if len(text) - len(opening(j).strip()) >= 8 and text not in seen and len(seen) < n:
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
                     desc: str = "features", dtype: torch.dtype = torch.bfloat16) -> list[Tensor]:
    """The base's last hidden states [len, E] (in `dtype`, CPU) for every sample, by right-padded
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
        _, hidden = model(tokens.to(model.device), 0, last_only=True)  # [B, T, E] (logits of one row only)
        for r, k in enumerate(idx):
            feats[k] = hidden[r, :lengths[k]].to("cpu", dtype).clone()
        bar.update(sum(lengths[k] for k in idx))
        i = j
    bar.close()
    return feats


def save_feature_shard(path: Path, samples: list[Sample]) -> None:
    """One safetensors shard: concatenated tokens and features, offsets and prompt lengths."""
    lens = torch.tensor([len(s.tokens) for s in samples])
    tensors = {"tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int32),
               "feats": torch.cat([s.feats for s in samples]).contiguous(),  # [sum len, E]
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
               "n_prompt": torch.tensor([s.n_prompt for s in samples])}
    save_safetensors(path, tensors, {"format": "polybasic-features"})


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
    """Seeded shuffle per epoch, sharded over ranks: the order depends only on (seed, epoch). With
    `lengths` and `batch_size`, each batch holds sequences of similar length (sorted within windows
    of 32 batches, batch order shuffled): far less padding.

    Resumable mid-epoch: `state_dict()` holds the epoch and how many of its batches were handed out
    (indices are drawn batch by batch, on demand); after `load_state_dict`, the iteration of that
    epoch skips those batches, so a resumed run sees exactly the batches an uninterrupted one
    would."""

    def __init__(self, n: int, seed: int = 0, lengths: list[int] | None = None, batch_size: int = 1) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self.lengths, self.batch_size = lengths, batch_size
        self.position = 0  # batches of this epoch handed out
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))

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
        skip = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        self._resume = None
        return self._indices(batches[rank * per:(rank + 1) * per], skip)

    def _indices(self, batches: list[list[int]], skip: int):
        self.position = skip
        for bt in batches[skip:]:
            self.position += 1
            yield from bt

    def __len__(self) -> int:
        return (self.n // self.batch_size) // self._ranks()[1] * self.batch_size
