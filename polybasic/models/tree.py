"""Token trees in one forward: where each row of a tree call sits, what it sees, and what its cache rows become.

A tree call feeds M rows in one forward: row i's parent is parents[i], an earlier row of the call, or -1 for the
sequence's committed prefix (cache rows 0..start-1). A path (a chain's draft, a prefill) is the tree whose every
row's parent is the row before it. Row i is *written* to cache row (slot) start + i, but its *logical position*
is start + depth(i) (RoPE and the keys it sees follow the logical position): it attends to the committed prefix
and to its ancestors and itself, in logical order. `anc` says where those live: for row i and the T logical
positions lo..pos[i] (lo = pos[i] - T + 1), the slots that hold them (identity below start). The row kernel
(bf16_rows.attend with anc) reads keys through it, so a tree row's bits equal a one-token step's at its position;
other attention paths take the same visibility as a mask over slots (`visible`).

After a verification keeps one root-to-leaf path, `path_slots` names the slots whose K/V move to logical positions
start, start+1, ... (Transformer.keep_path). Shapes: M rows, T = the map's width (the padded row count), S slots.
"""
from __future__ import annotations

import torch
from torch import Tensor

from polybasic.errors import ConfigError


def depths(parents: list[int]) -> list[int]:
    """Each row's depth (0: its parent is the committed prefix); a ConfigError unless every parent is an earlier
    row or -1."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ConfigError(f"parents[{i}] = {p}: a tree row's parent must be an earlier row of the call or -1 "
                              "(the committed prefix)")
        out.append(0 if p < 0 else out[p] + 1)
    return out


def is_path(parents: list[int]) -> bool:
    """Whether the rows form one path from the prefix (row i's parent is row i-1): an ordinary call."""
    return all(p == i - 1 for i, p in enumerate(parents))


def pad(parents: list[int], size: int) -> list[int]:
    """parents extended to `size` rows by padding rows that continue a path from the last row (they write slots
    after the real rows' and sit at logical positions no real row sees)."""
    return list(parents) + list(range(len(parents) - 1, size - 1))


def layout(parents: list[int], start: int, width: int | None = None, device=None) -> tuple[Tensor, Tensor]:
    """-> pos [M] (logical positions, start + depth) and anc [M, T] (T = width, default M): anc[i, t] is the slot
    holding row i's logical position pos[i] - T + 1 + t (its ancestor at that depth, itself last; identity below
    start, negative where the position is)."""
    d = depths(parents)
    m = len(parents)
    t = width or m
    anc = [[0] * t for _ in range(m)]
    for i in range(m):
        lo = start + d[i] - t + 1
        chain, j = [], i  # the row's ancestors' slots, deepest first
        while j >= 0:
            chain.append(start + j)
            j = parents[j]
        slots = list(range(lo, start)) if lo < start else []
        anc[i] = (slots + chain[::-1])[-t:]
    return (torch.tensor([start + x for x in d], dtype=torch.long, device=device),
            torch.tensor(anc, dtype=torch.long, device=device))


def path_layout(pos: Tensor) -> tuple[Tensor, Tensor]:
    """layout of a path whose rows sit at slots pos [M] (consecutive): (a copy of pos, anc [M, M]), each row's window
    the slots of its own last M positions, computed on pos's device without a Python loop. The copy: a compiled step
    takes slots and logical positions as two inputs, which a tree's call gives apart (the same tensor for both
    would make a graph that reads one for the other)."""
    m = pos.shape[0]
    return pos.clone(), pos[:, None] + torch.arange(1 - m, 1, device=pos.device)[None, :]


def visible(pos: Tensor, anc: Tensor, slots: int) -> Tensor:
    """The slots each row sees, as a mask [M, S] (S = slots): those below the map's window (the committed prefix)
    and the ones the map names (a negative entry, a position before the sequence, names none: the row's own slot
    stands in for it)."""
    s = torch.arange(slots, device=pos.device)  # [S]
    below = s[None, :] < (pos - anc.shape[1] + 1)[:, None]  # [M, S]
    return below.scatter_(1, torch.where(anc >= 0, anc, anc[:, -1:]), True)


def path_slots(parents: list[int], leaf: int, start: int) -> list[int]:
    """The slots of the rows from the root down to row `leaf` (-1: none), in logical order."""
    out = []
    while leaf >= 0:
        out.append(start + leaf)
        leaf = parents[leaf]
    return out[::-1]
