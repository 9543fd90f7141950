"""Whether the machine's speed holds still: identical plain decoding on copies of one target, interleaved:

    python -m experiments.speed_states --model qwen2.5-coder-1.5b@w4a8 --rounds 8

Copies in one process, the same weights: `loaded` (the model as loaded: a cached safetensors file's pages, memory
mapped), `copy1`..`copyN` (--copies deep copies: anonymous memory in 4 KB pages, as the bench's compiled methods get),
with --hugepages, `huge` (a deep copy moved into one anonymous arena advised MADV_HUGEPAGE: 2 MB pages). Each round
decodes the same prompt greedily with every copy in turn (eager, --tokens new tokens) and prints tokens/s; at the end,
each copy's per-round ratio to `copy1` and their median. If the rounds' figures move together by more than the copies
differ within a round, what moves is the machine, not the copy: a comparison then needs methods interleaved within
seconds, repeated (`polybasic bench --repeat`).
"""
from __future__ import annotations

import argparse
import copy
import mmap
import statistics
import time

import torch


def hugepage_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the storage of every CPU parameter and buffer moved into one anonymous arena advised MADV_HUGEPAGE;
    tensors that shared a storage (tied weights, views) share the moved one, with their offsets and strides."""
    storages: dict[int, list] = {}  # storage address -> [(table, key, tensor)]
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in table.items():
                if t is not None and t.device.type == "cpu":
                    storages.setdefault(t.untyped_storage().data_ptr(), []).append((table, key, t))
    page = 4096
    sizes = {ptr: -(-group[0][2].untyped_storage().nbytes() // page) * page for ptr, group in storages.items()}
    arena = mmap.mmap(-1, sum(sizes.values()) + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the arena alive as long as a view of it lives
    off = (-base.data_ptr()) % (2 << 20)  # 2 MB aligned: whole huge pages
    moved: dict[int, torch.Tensor] = {}  # id of an old tensor -> its moved one (a tensor held twice stays one)
    for ptr, group in storages.items():
        old = group[0][2].untyped_storage()
        base[off:off + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for table, key, t in group:
            if id(t) not in moved:
                new = torch.empty(0, dtype=t.dtype).set_(base.untyped_storage(), off // t.element_size()
                                                         + t.storage_offset(), t.shape, t.stride())
                moved[id(t)] = torch.nn.Parameter(new, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
                    else new
            table[key] = moved[id(t)]
        off += sizes[ptr]
    return model


def main(argv=None) -> None:
    from polybasic.quant import load_any_model
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b@w4a8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--copies", type=int, default=2, help="deep copies (each ~1.4 GB for the 1.5B @w4a8 target)")
    p.add_argument("--hugepages", action="store_true", help="add a copy in 2 MB pages (MADV_HUGEPAGE)")
    a = p.parse_args(argv)
    lm = load_any_model(a.model, a.dtype, "cpu")
    copies = {"loaded": lm.model, **{f"copy{i + 1}": copy.deepcopy(lm.model) for i in range(max(1, a.copies))}}
    if a.hugepages:
        copies["huge"] = hugepage_copy(copy.deepcopy(lm.model))
    prompt = encode_prompt(lm.tokenizer, "Explain how a hash map handles collisions.")
    speeds: dict[str, list[float]] = {name: [] for name in copies}
    ref = None
    for r in range(a.rounds):
        for name, model in copies.items():
            t0 = time.perf_counter()
            out = list(generate_tokens(model, prompt, a.tokens))
            speeds[name].append(len(out) / (time.perf_counter() - t0))
            ref = ref or out
            assert out == ref, f"{name}: other tokens than the first copy's"
        print(f"round {r}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in speeds.items()), flush=True)
    print(f"tokens/s, {a.tokens} new tokens a run, greedy, eager; ratio to copy1 per round, then its median:")
    for name, v in speeds.items():
        ratios = [x / y for x, y in zip(v, speeds["copy1"])]
        print(f"{name:7s} {' '.join(f'{x:.3f}' for x in ratios)}  median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
