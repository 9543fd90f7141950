"""Verifying a token tree: the longest root-to-node path the verifier keeps, and its next token, lossless.

A drafted tree: tokens [N] with parents [N] (-1: a child of the context), a node's children distinct tokens, in
the order they were drafted; q [N, V]: the distribution node j was drawn from given its earlier siblings (a
deterministic pick, such as an n-gram continuation or a model's r-th best token, is one-hot). p [N+1, V]: the
verifier's distributions after the context (row 0) and after each node (row 1+j).

Greedy: follow the child whose token is the verifier's argmax; the first node without one ends the path, and the
argmax there is the next token: exactly plain greedy decoding's tokens.

Sampling (recursive rejection sampling, as SpecInfer and EAGLE-2): at a node with target distribution r = p[row],
try its children x_1, x_2, ... in order. Child x_j is accepted with probability min(1, r(x_j) / q_j(x_j)); on a
rejection r becomes norm(max(0, r - q_j)) and the next child is tried. If every child is rejected the next token
is a sample of the last r. Why every emitted token is an exact sample of p: at a try, P(accept and emit y) =
q_j(y) min(1, r(y)/q_j(y)) = min(q_j(y), r(y)), and P(reject) = sum max(0, r - q_j) = Z; so the try emits y with
probability min(q_j, r)(y) + Z * r'(y) = r(y) provided what follows a rejection emits an exact sample of
r' = max(0, r - q_j) / Z. The next child is drawn from q_{j+1} given x_j (without replacement), independently of
the rejection's coin, and r' does not depend on x_j; so by induction over the children (the last step: a sample
of r itself) the node emits an exact sample of p[row]. An accepted child then repeats this one level down with
the verifier's distribution there. With one child per node this is ordinary speculative sampling.
"""
from __future__ import annotations

import torch
from torch import Tensor

from polybasic.runtime.sampling import argmax, sample
from polybasic.runtime.verify import residual


def children(parents: list[int]) -> dict[int, list[int]]:
    """node (-1: the context) -> its children in draft order."""
    out: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        out.setdefault(p, []).append(j)
    return out


def rank_trials(parents: list[int], path: list[int]) -> list[tuple[int, int, bool]]:
    """What a verification that kept `path` tried: (depth, a child's rank among its siblings, accepted) for every
    child tried in order at each node of the path, up to the accepted one (all of them where none was)."""
    kids, out, node = children(parents), [], -1
    for depth in range(len(path) + 1):
        below = kids.get(node, [])
        taken = below.index(path[depth]) if depth < len(path) else len(below)
        out += [(depth, r, r == taken) for r in range(min(taken + 1, len(below)))]
        node = path[depth] if depth < len(path) else node
    return out


def verify_tree(tokens: list[int], parents: list[int], q: Tensor, p: Tensor, greedy: bool,
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """-> (the kept path's nodes from the root down, the next token: the correction or bonus token)."""
    kids, node, path = children(parents), -1, []
    while True:
        row = p[node + 1]  # [V] the verifier's distribution after `node`
        below = kids.get(node, [])
        if greedy:
            top = int(argmax(row))
            nxt = next((j for j in below if tokens[j] == top), None)
            if nxt is None:
                return path, top
        else:
            nxt, r = None, row
            for j in below:
                x = tokens[j]
                u = float(torch.rand((), generator=generator, device=row.device))
                if u * float(q[j, x]) < float(r[x]):  # accept with probability min(1, r(x) / q(x))
                    nxt = j
                    break
                r = residual(r, q[j], row)
            if nxt is None:
                return path, int(sample(r, generator))
        path.append(nxt)
        node = nxt
