"""The lean decoder for every family (gpt-fast style): embeddings, the family's blocks
(models.blocks, picked by models.families), final norm and LM head, over a preallocated,
rollback-able KV cache.

The model is stateless about *where* the sequence ends: every call names the absolute position of
its first token (`start`). Rolling back to an accepted length L is therefore free: the next call
uses start=L, overwrites the stale cache rows and never attends past start+M.

Shapes: B batch, M tokens in this call, S cache length, H heads, G kv heads, D head dim, E model dim.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from polybasic.errors import ConfigError
from polybasic.models import tree as token_tree
from polybasic.models.args import ModelArgs
from polybasic.models.blocks import KVCache, RMSNorm, rope_tables
from polybasic.models.families import block_for, family_for
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES, attach_codes, project
from polybasic.models.static import StaticSteps, pad_rows, positions


class Transformer(nn.Module):
    """Decoder-only LM. Call `setup_caches` once before `forward`."""

    # compiled steps: a path's call of more than one row that returns every row's logits runs that size's tree step
    # (one graph a size for paths and trees, where a chain that verifies trees compiled two); False: a path step
    # apart (for measuring the two)
    paths_as_trees = True

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(block_for(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.max_seq_len = 0
        self._static: StaticSteps | None = None  # see compile_steps
        self.feature_layers: tuple[int, ...] = ()  # see use_feature_layers
        self.layers_per_region = 1  # compiled steps on the CPU: layers per compiled region (see compile_steps)
        self._groups: dict[tuple[int, ...], list] = {}  # feature_layers -> its LayerGroups (see _layer_groups)

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        """Allocate KV caches and RoPE tables for sequences of up to max_seq_len tokens.

        Eager, the caches only grow. With static steps (compile_steps) they take the request's size class
        (StaticSteps.cache_rows: a power of two >= 256 rows, plus the largest step's padding rows), on the
        CPU smaller as well as larger: a static step attends over every cache row, so a short request in
        caches sized for a long one would pay for rows it never reads (on a 2-core AMD EPYC, a Qwen2.5-Coder-1.5B
        W4 copy's attention took 3.6 ms a step at 1,088 rows, 1.9 ms at 320). On CUDA they only grow
        (StaticSteps.shrink). Each size class compiles its steps once (runtime.compiled.compile_levels warms
        the ones a run needs)."""
        if max_seq_len > self.args.max_seq_len:
            raise ConfigError(f"max_seq_len: {max_seq_len} exceeds the model's context window of "
                              f"{self.args.max_seq_len} tokens; shorten the prompt or max_new_tokens")
        same_batch = self.max_seq_len > 0 and self.layers[0].attention.kv_cache.k.shape[0] == batch
        rows = max_seq_len
        if self._static is not None:  # padding rows write up to `largest` rows past the sequence
            max_seq_len = self._static.size_class(max_seq_len, self.args.max_seq_len,
                                                  self.max_seq_len if same_batch else 0)
            rows = max_seq_len + self._static.largest
            if same_batch and max_seq_len == self.max_seq_len:
                return
        elif max_seq_len <= self.max_seq_len and same_batch:
            return
        with torch.inference_mode(False):  # plain tensors whoever calls (generate runs in inference mode,
            self._allocate(rows, batch)  # a warm-up need not): compiled steps guard on that, one graph each
        self.max_seq_len = max_seq_len

    def cache_classes(self, lengths) -> list[int]:
        """The distinct cache lengths (size classes) that setup_caches takes for requests of these lengths in this
        order, from fresh caches (static steps only; where the caches only grow, the largest so far)."""
        current, out = 0, []
        for n in lengths:
            current = self._static.size_class(n, self.args.max_seq_len, current)
            out.append(current)
        return list(dict.fromkeys(out))

    def _allocate(self, rows: int, batch: int) -> None:
        """KV caches [B, G, rows, D], RoPE tables [rows, 1, D] and the causal mask [rows, rows]."""
        dev, dt = self.device, self.dtype
        if self._static is not None:
            self._static.forget()  # its straight calls hold the caches replaced here
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, self.args.n_kv_heads, rows, self.args.head_dim, dt, dev)
        cos, sin = rope_tables(self.args, rows, dev)  # [S, D]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # sign-folded, see apply_rope
        self.register_buffer("rope_cos", cos.to(dt).unsqueeze(1), persistent=False)  # [S, 1, D]
        self.register_buffer("rope_sin", sin.to(dt).unsqueeze(1), persistent=False)  # [S, 1, D]
        causal = torch.ones(rows, rows, dtype=torch.bool, device=dev).tril()
        self.register_buffer("causal_mask", causal, persistent=False)

    def use_feature_layers(self, layers) -> None:
        """From now on `forward` also returns the outputs of these decoder layers (0-based, each below
        the last), in front of the last layer's hidden state: features [..., (len(layers)+1) * E], what a
        drafter head reading several layers (EAGLE-3) needs. () restores the last layer alone."""
        n = self.args.n_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n - 1 for i in layers):
            raise ConfigError(f"feature_layers: {list(layers)} must be distinct increasing layer indices in "
                              f"[0, {n - 2}] for this {n}-layer model (the last layer, {n - 1}, is always read); "
                              "fix distill.feature_layers")
        self.feature_layers = tuple(layers)

    def keep_rows(self, rows: Tensor) -> None:
        """Shrink the KV caches to the batch rows `rows` [B'] (the next calls pass B' sequences)."""
        for layer in self.layers:
            layer.attention.kv_cache.keep(rows)
        if self._static is not None:
            self._static.forget()  # its straight calls hold the caches it replaced

    def compile_steps(self, gguf: str | Path | None = None, options: dict | None = None, sizes=None,
                      notify=None, regions: bool = True) -> int:
        """Run every forward (any M, prefills in chunks) through static-shape compiled steps from now on
        (models.static): M padded up to one of `sizes`, compiled once per size on its first use, a
        cached copy loaded from disk in later processes; CUDA graphs on CUDA. The caches then hold a
        power of two (>= 256) rows plus the largest size, so a new request size rarely means a new graph.
        Logits agree with eager ones to float rounding (fused kernels sum in another order), not bit for
        bit. Left-padded batches (key_mask) stay eager.

        A bf16 or fp16 model on the CPU runs calls of more rows than the second largest size (prompts, long
        verifications) eagerly, unpadded: its kernels are row-invariant (bf16_rows, w4a8), so an eager call
        gives the compiled steps' bits, and eager vanilla decoding's, while a prompt in padded chunks costs
        more (a 1.5B `@w4a8` target, 2-core AMD EPYC: 384 / 1,335 / 4,922 ms eager against 501 / 1,900 /
        5,294 ms in 64-row chunks for 51 / 201 / 671 tokens; docs/results.md). Only the smaller sizes compile.

        gguf: the GGUF file the fp32 weights were expanded from. Its block codes are attached to the
        CPU fp32 linears they reproduce exactly (see gguf_codes), and steps of up to gguf_codes.CODED_ROWS
        tokens read those, 1 byte per weight instead of 4 (+~1.2 bytes per weight of memory). Returns how
        many linears read codes.
        options: inductor options (models.prepare.compile_for_device passes the device's).
        notify: told before each first compile (default: the log); a later call's notify replaces an earlier one's.
        regions: on the CPU, compile one graph per size for a decoder layer, which every layer runs (and the LM head
        apart where it reads GGUF codes), the rest of a step eager (models.static: ~6x less compile time, steps
        ~3% slower); False: one graph of the whole step, as on CUDA (CUDA graphs) always.
        """
        coded = attach_codes(self, gguf) if gguf is not None else 0
        if self._static is None:
            invariant = self.device.type == "cpu" and self.dtype in ROW_INVARIANT_DTYPES
            self._static = StaticSteps(self._static_forward, "the model", sizes, self.device, options, notify,
                                       eager_long=invariant,
                                       regions={"layer": _layer_step, "head": _head_step} if regions else None)
            # attention on the row kernel reads only the cache rows up to each position, whatever the cache
            # holds: its caches need not shrink to a request's size class, so a process compiles one class
            self._static.shrink &= not all(layer.attention.row_attention for layer in self.layers)
            self.max_seq_len = 0  # the next setup_caches sizes the caches for static steps
        elif notify is not None:  # steps compiled for another caller: its later compiles are this one's
            self._static.notify = notify
        return coded

    @torch.inference_mode()
    def warm_steps(self, decode: bool = False) -> None:
        """Compile every step now: each size with all rows' logits, and the one-token and prefill-chunk
        steps that read one row's, so that no compile lands inside a timed or latency-critical call.
        decode: only the two steps plain decoding runs (generate_tokens), the one-token step and the prefill
        chunk, each reading one row's logits. Writes garbage to cache rows the next generation overwrites; needs
        setup_caches first."""
        for _ in range(self._static.warm_runs):
            for size, last_only in self.warm_calls(decode):
                self(torch.zeros(1, size, dtype=torch.long, device=self.device), 0, last_only=last_only)

    def warm_calls(self, decode: bool = False) -> list[tuple[int, bool]]:
        """The (size, last_only) calls warm_steps makes: every size with all rows' logits (size 1 has one row; the
        larger sizes are tree steps, which paths run too: `_static_chunks`), or with decode the
        one-token step alone; then the prefill chunk reading one row's (none where long calls run eagerly)."""
        steps = self._static
        sizes = [size for size in steps.sizes if not steps.runs_eager(size)]
        calls = [(1, True)] if decode else [(size, False) for size in sizes]
        if not steps.runs_eager(steps.largest):
            calls.append((steps.largest, True))
        return calls

    def forward(self, tokens: Tensor, start: int, last_only: bool = False,
                key_mask: Tensor | None = None, tail: int | None = None,
                parents: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """tokens [B, M] at positions start..start+M-1.

        key_mask [B, S'] (S' >= start+M, bool): cache rows each sequence may attend to, for
        left-padded batches (False on the padding). RoPE is relative, so a row padded by n slots
        scores exactly as if it started at slot 0.

        parents [M]: the rows are a token tree (models.tree: row i's parent row, -1 for the prefix), written to cache
        rows start..start+M-1 at their logical positions start + depth; keep_path then moves a kept path's rows in
        place. None (or a path): an ordinary call.

        Returns logits [B, M, V] (only the last `tail` rows' with tail, [B, 1, V] with last_only) and the
        last layer's hidden states before the final norm, [B, M, E] (the features EAGLE-style drafters
        read); with `use_feature_layers`, the outputs of those layers in front of it, [B, M, (n+1) * E].
        """
        m = tokens.shape[1]
        end = start + m
        if end > self.max_seq_len:
            raise ConfigError(f"sequence length: {end} tokens exceed the cache of {self.max_seq_len}; "
                              "call setup_caches with a larger max_seq_len")
        tail = 1 if last_only else min(tail or m, m)
        if parents is not None and token_tree.is_path(parents):
            parents = None
        if parents is not None and (key_mask is not None or len(parents) != m or tokens.shape[0] != 1):
            raise ConfigError(f"parents: a tree call takes one sequence and one parent per row ({len(parents)} for "
                              f"{tokens.shape[0]} x {m} tokens) and no key_mask")
        if self._static is not None and key_mask is None and not self._static.runs_eager(m):
            if parents is not None and m > self._static.largest:
                raise ConfigError(f"parents: a tree of {m} rows exceeds the largest compiled step "
                                  f"({self._static.largest}); draft smaller trees")
            return self._static_chunks(tokens, start, tail, parents)
        return self._forward(tokens, start, tail, key_mask, parents)

    @property
    def max_step_rows(self) -> int | None:
        """The most rows a tree call can take (one compiled step, the largest size), None: any (eager)."""
        return None if self._static is None else self._static.largest

    @torch.inference_mode()
    def keep_path(self, slots: list[int], start: int) -> None:
        """Move the K/V in cache rows `slots` (a tree call's kept path, models.tree.path_slots) to rows start,
        start+1, ... where the next calls read them; nothing to do where they are there already."""
        if slots == list(range(start, start + len(slots))):
            return
        src = torch.tensor(slots, dtype=torch.long, device=self.device)
        for layer in self.layers:
            cache = layer.attention.kv_cache
            for buf in (cache.k, cache.v):
                buf[:, :, start:start + len(slots)] = buf.index_select(2, src)  # [B, G, n, D]

    def _layer_groups(self) -> list[LayerGroup]:
        """The layers in groups of `layers_per_region` (a group also ends at each of feature_layers, whose outputs
        are read), built once per feature_layers."""
        groups = self._groups.get(self.feature_layers)
        if groups is None:
            groups, start = [], 0
            for i in range(len(self.layers)):
                if i + 1 - start == self.layers_per_region or i in self.feature_layers or i == len(self.layers) - 1:
                    groups.append(LayerGroup(list(self.layers[start:i + 1]), i))
                    start = i + 1
            self._groups[self.feature_layers] = groups
        return groups

    def _static_chunks(self, tokens: Tensor, start: int, tail: int, parents: list[int] | None = None
                       ) -> tuple[Tensor, Tensor]:
        """forward through the compiled steps: chunks of the largest size, the last one padded (a tree: one chunk,
        its padding rows a path after the last row). A path's chunk of more than one row that returns every row's
        logits runs that size's tree step (`paths_as_trees`): a chain whose drafts are trees or paths verifies both
        through one graph a size, with the same bits (a path's tree layout is its own positions: models.tree.path_layout)."""
        steps, m = self._static, tokens.shape[1]
        logits, hidden = [], []
        for a, n, size, pos in steps.chunks(m, start, tokens.device):
            need = min(n, max(0, tail - (m - a - n)))  # rows of this chunk whose logits are wanted (its last)
            chunk = pad_rows(tokens[:, a:a + n], size)  # [B, size]
            # the LM head reads one row in one-token steps and prefill chunks (other sizes compute all rows'
            # logits: fewer graphs to compile, and their rows' logits are wanted anyway)
            one = need <= 1 and size in (1, steps.largest)
            pick = positions(n - 1, 1, tokens.device) if one else None  # [1]
            if parents is not None:
                tree = token_tree.layout(token_tree.pad(parents, size), start, device=tokens.device)  # [M], [M, M]
            elif self.paths_as_trees and size > 1 and not one:
                tree = token_tree.path_layout(pos)
            else:
                tree = None
            key = (tokens.shape[0], size, "last" if one else "all", self.max_seq_len, self.feature_layers,
                   tree is not None)
            lg, hd = steps(key, chunk, pos, pick, tree)
            hidden.append(hd[:, :n])
            if need:
                logits.append(lg if one else lg[:, n - need:n])
        return (logits[0] if len(logits) == 1 else torch.cat(logits, 1)), \
            (hidden[0] if len(hidden) == 1 else torch.cat(hidden, 1))

    def _static_forward(self, tokens: Tensor, pos: Tensor, pick: Tensor | None,
                        tree: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """tokens [B, M] at cache rows (slots) pos [M], every cache row visible up to its own position; logits of
        the rows `pick` [1] (None: all). tree: the rows are a token tree (models.tree.layout: logical positions [M]
        and ancestor map [M, M]). With regions (the CPU), this runs eagerly and each layer, and the final
        norm and LM head where they read GGUF codes, run one compiled graph per size (StaticSteps.region)."""
        at = pos if tree is None else tree[0]  # logical positions [M]
        cos, sin = self.rope_cos[at], self.rope_sin[at]  # [M, 1, D] x2
        mask = self.causal_mask[pos] if tree is None else token_tree.visible(*tree, self.causal_mask.shape[1])  # [M, S]
        steps = self._static
        if not steps.regions:  # CUDA: one graph of the whole step
            return self._run(tokens, cos, sin, mask, pos, pick, tree=tree)
        shape = (*tokens.shape, self.max_seq_len, tree is not None)  # what a layer's graph depends on: B, M, the
        keys = {"layer": shape, "head": (*shape, pick is None)}  # cache size, tree or not
        return self._run(tokens, cos, sin, mask, pos, pick,
                         lambda name, i, *args: steps.region(name, keys[name], i, *args), tree)

    def _forward(self, tokens: Tensor, start: int, tail: int, key_mask: Tensor | None = None,
                 parents: list[int] | None = None) -> tuple[Tensor, Tensor]:
        m = tokens.shape[1]
        end = start + m
        if parents is not None:  # a token tree: rows at slots start..end-1, logical positions start + depth
            tree = token_tree.layout(parents, start, device=tokens.device)  # [M], [M, M]
            cos, sin = self.rope_cos[tree[0]], self.rope_sin[tree[0]]  # [M, 1, D]
            return self._run(tokens, cos, sin, token_tree.visible(*tree, end), start, tail, tree=tree)
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]  # [M, 1, D]
        mask = None if m == 1 or start == 0 else self.causal_mask[start:end, :end]  # [M, start+M]
        if key_mask is not None:
            keys = key_mask[:, None, None, :end]  # [B, 1, 1, start+M]
            mask = keys & self.causal_mask[start:end, :end] if m > 1 else keys  # [B, 1, M, start+M]
        return self._run(tokens, cos, sin, mask, start, tail)

    def _run(self, tokens: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int | Tensor,
             rows: int | Tensor | None, region: Callable | None = None,
             tree: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The layers, then the final norm and LM head over `rows`: the last `rows` (an int), the rows of
        a tensor of indices, or all (None). region(name, index, *args): a static step's compiled regions
        (StaticSteps.region), which run the layers in groups (`_layer_groups`) and the head where it reads GGUF
        codes; None: everything here. tree: a token tree's positions and ancestor map (models.tree)."""
        x = self.tok_embeddings(tokens)  # [B, M, E]
        parts = list(enumerate(self.layers)) if region is None else [(g.last, g) for g in self._layer_groups()]
        taken = []  # outputs of self.feature_layers, each [B, M, E]
        for j, (last, part) in enumerate(parts):
            x = part(x, cos, sin, mask, start, tree) if region is None else \
                region("layer", j, part, x, cos, sin, mask, start, tree)
            if last in self.feature_layers:
                taken.append(x)
        hidden = torch.cat(taken + [x], dim=-1) if taken else x  # [B, M, (n+1) E]
        if region is not None and isinstance(getattr(self.output, "codes", None), Tensor):  # compiled: reads codes
            return region("head", 0, self.norm, self.output, x, rows), hidden
        return _head_step(self.norm, self.output, x, rows), hidden


class LayerGroup(nn.Module):
    """Consecutive decoder layers run as one region of a compiled step (the model's own modules, not copies)."""

    def __init__(self, layers: list[nn.Module], last: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.last = last  # the model's index of the group's last layer

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor,
                tree: tuple[Tensor, Tensor] | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin, mask, pos, tree)
        return x


def _layer_step(group: LayerGroup, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor,
                tree: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A group of decoder layers of a static step (Transformer._static_forward): x [B, M, E] -> [B, M, E]; compiled
    once per shape, the same graph for every group of the same structure."""
    return group(x, cos, sin, mask, pos, tree)


def _head_step(norm: nn.Module, output: nn.Module, x: Tensor, rows: int | Tensor | None) -> Tensor:
    """The final norm and LM head over x [B, M, E]'s last `rows` (an int), the rows of a tensor of indices, or all
    (None) -> logits [B, rows, V]."""
    if isinstance(rows, Tensor):
        x = x.index_select(1, rows)
    elif rows is not None and rows < x.shape[1]:
        x = x[:, -rows:]
    return project(output, norm(x))


def hf_to_lean_state_dict(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Map a transformers state dict onto ours, through args.family's mapping."""
    return family_for(args.family).hf_to_lean(sd, args)


def build_model(args: ModelArgs, state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None) -> Transformer:
    """Build on the meta device, then assign the weights (no double allocation) on `device` (default:
    where the state dict's tensors are)."""
    with torch.device("meta"):
        model = Transformer(args)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise ConfigError(f"state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                          "the weights do not match the model args")
    model.tie_weights()
    return model.eval().requires_grad_(False)


def use_decode_layout(model: nn.Module) -> nn.Module:
    """Give every nn.Linear weight [out, in] the faster memory layout for its dtype and device.

    fp32 on CPU: a transposed view of a contiguous [in, out] buffer, so F.linear runs the
    "x @ W^T-contiguous" GEMM (measured, all of SmolLM2-135M's matmuls at M=1: 16.7 vs 19.2 ms; no
    slower for prefills of 200-1300 tokens). Anything else (e.g. bf16, slower transposed at every M,
    or a bf16 copy made from a transposed fp32 model): plain contiguous [out, in].
    Values and shapes are unchanged. A tied embedding shares the new buffer (in the transposed
    layout a strided row gather: ~12 ms for a 1300-token prefill).
    """
    new: dict[int, nn.Parameter] = {}  # id(old weight) -> its replacement, so ties survive
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, nn.Linear) or id(w) in new:
            continue
        transposed = w.device.type == "cpu" and w.dtype == torch.float32
        if transposed and w.is_contiguous():
            new[id(w)] = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
        elif not transposed and not w.is_contiguous():
            new[id(w)] = nn.Parameter(w.detach().contiguous(), requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) and id(getattr(mod, "weight", None)) in new:
            mod.weight = new[id(mod.weight)]
    return model
