"""Block-wise calibration: RTN, OmniQuant-style diagonal transforms, AffineQuant-style affine ones.

One decoder block at a time (OmniQuant): the input of block i is the output of the already
quantized blocks 0..i-1 on the calibration tokens; the target is the full-precision block's output
on the full-precision stream; the loss is their MSE. Learnable pieces, all merged into the weights
afterwards (no run-time cost):
- diagonal scales s on the norm side: RMSNorm weight / s, following linear weight * s (wqkv, w13),
  initialised SmoothQuant-style s = max|x|^alpha / max|W|^(1-alpha) (omniquant and affinequant);
- per-kv-head block-diagonal matrices A_g [D, D] between v and o (affinequant): Wv_g <- A_g^T Wv_g,
  Wo_h <- Wo_h A_g^-T, so attention output y_h A_g is undone exactly by wo;
  A = dominant(P * mask): the gradual mask has 1 on the diagonal and the stability factor on the
  active off-diagonal bands, widened each epoch (1 band at epoch 0 -> all at the last epoch, as
  AffineQuant does); `dominant` rescales off-diagonal rows so that A stays strictly diagonally
  dominant, hence invertible (Levy-Desplanques);
- learnable weight clipping (sigmoid-bounded factors, primitives.fake_quantize_weight).
With a_bits=16 the transforms are off unless `transforms_weight_only` (OmniQuant's weight-only
setting uses clipping only). Fake quantization lives only here; `build_quantized_model` turns the
result into real kernels.

Shapes: N samples, L tokens, E model dim, H heads, G kv heads, D head dim.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from polybasic.quant.from_gguf import GGUFCodes

from polybasic.artifacts import fault_point, seed_for, torch_save
from polybasic.config import UNTRAINED, CalibrationConfig, QuantConfig
from polybasic.errors import ConfigError, PolybasicError
from polybasic.models.blocks import NoCache, rope_tables
from polybasic.models.decoder import use_decode_layout
from polybasic.models.families import block_for
from polybasic.quant.linear import KERNEL_CLASSES, choose_kernel
from polybasic.quant.primitives import (
    fake_quantize_activation,
    fake_quantize_weight,
    quantize_weight,
    resolve_group_size,
)

LINEARS = {"wqkv": "attention.wqkv", "wo": "attention.wo", "w13": "feed_forward.w13",
           "w2": "feed_forward.w2"}
NORMS = {"attention_norm": "attention_norm", "ffn_norm": "ffn_norm"}
BIASES = {"wqkv_bias": "attention.wqkv"}  # present when the family's q/k/v have biases (Qwen2)
DOMINANCE_MARGIN = 0.05  # off-diagonal row sum <= (1 - margin) * |diagonal|
SCALE_CLAMP = 1e-5


class CalibrationDiverged(PolybasicError):
    """Non-finite calibration loss; `.layer` names the block, `.params` is its last good state."""

    def __init__(self, msg: str, layer: str, params: dict[str, Tensor]) -> None:
        super().__init__(msg)
        self.layer, self.params = layer, params


# ---- pure math ----------------------------------------------------------------------------------
def gradual_width(epoch: int, epochs: int, n: int) -> int:
    """Active bands (diagonal included) at `epoch`: 1 at the first epoch, n at the last."""
    return n if epochs <= 1 else 1 + (n - 1) * epoch // (epochs - 1)


def band_mask(n: int, width: int, stability: float) -> Tensor:
    """[n, n]: 1 on the diagonal, `stability` where 0 < |i - j| < width, 0 elsewhere."""
    i = torch.arange(n)
    dist = (i[:, None] - i[None, :]).abs()
    return torch.where(dist == 0, 1.0, torch.where(dist < width, stability, 0.0))


def dominant(a: Tensor, margin: float = DOMINANCE_MARGIN) -> Tensor:
    """a [..., n, n] -> same with each row's off-diagonal part scaled down (never up) so that
    sum_j!=i |a_ij| <= (1 - margin) |a_ii|: strictly diagonally dominant, hence invertible."""
    diag = torch.diagonal(a, dim1=-2, dim2=-1)  # [..., n]
    off = a - torch.diag_embed(diag)
    r = off.abs().sum(-1)  # [..., n]
    f = torch.clamp((1 - margin) * diag.abs() / r.clamp(min=1e-12), max=1.0)
    return torch.diag_embed(diag) + off * f.unsqueeze(-1)


def affine_matrix(p: Tensor, mask: Tensor) -> Tensor:
    """Learnable p [G, D, D] under the gradual mask [D, D] -> invertible A [G, D, D]."""
    return dominant(p * mask)


def merge_transforms(fp: dict[str, Tensor], params: dict[str, Tensor], n_heads: int, n_kv: int,
                     head_dim: int, mask: Tensor | None) -> dict[str, Tensor]:
    """fp block weights + transform params -> equivalent transformed weights (same shapes)."""
    w = dict(fp)
    for norm, lin, key in (("attention_norm", "wqkv", "s_attn"), ("ffn_norm", "w13", "s_ffn")):
        if key in params:
            s = params[key].exp()  # [E]
            w[norm] = fp[norm] / s
            w[lin] = fp[lin] * s  # [out, E] columns
    if "a_vo" in params:
        h, g, d = n_heads, n_kv, head_dim
        a = affine_matrix(params["a_vo"], mask if mask is not None else torch.ones(d, d))  # [G, D, D]
        qk, v = w["wqkv"][:(h + g) * d], w["wqkv"][(h + g) * d:]
        v = torch.einsum("gij,gie->gje", a, v.reshape(g, d, -1)).reshape(g * d, -1)  # A^T Wv_g
        w["wqkv"] = torch.cat([qk, v])
        if "wqkv_bias" in w:  # v = Wv x + bv, so bv <- A^T bv as well
            b = w["wqkv_bias"]
            bv = torch.einsum("gij,gi->gj", a, b[(h + g) * d:].reshape(g, d)).reshape(g * d)
            w["wqkv_bias"] = torch.cat([b[:(h + g) * d], bv])
        inv = torch.linalg.inv(a).repeat_interleave(h // g, dim=0)  # [H, D, D]
        wo = w["wo"].reshape(w["wo"].shape[0], h, d)  # [E, H, D]
        w["wo"] = torch.einsum("ehd,hkd->ehk", wo, inv).reshape(wo.shape[0], h * d)  # Wo_h A^-T
    return w


def fake_quantize_block(w: dict[str, Tensor], params: dict[str, Tensor], cfg: CalibrationConfig,
                        prefix: str) -> dict[str, Tensor]:
    """Fake-quantize the four linears of a (transformed) block, with learnable clipping if any."""
    out = dict(w)
    for key, fqn in LINEARS.items():
        out[key] = fake_quantize_weight(w[key], cfg.w_bits, cfg.group_size, cfg.w_symmetric,
                                        params.get(f"{key}.gamma"), params.get(f"{key}.beta"),
                                        f"{prefix}.{fqn}")
    return out


def block_forward(x: Tensor, w: dict[str, Tensor], args, cos: Tensor, sin: Tensor, a_bits: int = 16,
                  a_symmetric: bool = False, stats: dict | None = None) -> Tensor:
    """args.family's decoder block (models.families) as a pure function of the weights w (keys of
    LINEARS, NORMS, BIASES), causal from position 0.

    x [N, L, E]; cos, sin [L, 1, D] (sin sign-folded). Inputs of the four linears are fake-quantized
    per token when a_bits < 16. stats: filled with per-channel max|input| of wqkv and w13 [E].
    """
    with torch.device("meta"):
        block = block_for(args)  # weights come from w below
    block.attention.kv_cache = NoCache()

    def quantize_input(key):
        def hook(mod, inputs):
            (t,) = inputs
            if stats is not None and key in ("wqkv", "w13"):
                stats[key] = t.detach().abs().amax((0, 1))
            return (fake_quantize_activation(t, a_bits, a_symmetric),)
        return hook

    for key, fqn in LINEARS.items():
        block.get_submodule(fqn).register_forward_pre_hook(quantize_input(key))
    names = {**{k: f"{fqn}.weight" for k, fqn in {**LINEARS, **NORMS}.items()},
             **{k: f"{fqn}.bias" for k, fqn in BIASES.items()}}
    return torch.func.functional_call(block, {names[k]: v for k, v in w.items()}, (x, cos, sin, None, 0))


def block_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out.float(), target.float())


# ---- model plumbing ---------------------------------------------------------------------------
def block_weights(block: nn.Module) -> dict[str, Tensor]:
    """fp32 detached copies of a models.blocks.Block's weights."""
    w = {k: block.get_submodule(fqn).weight.detach().float().clone() for k, fqn in LINEARS.items()}
    w.update({k: block.get_submodule(fqn).weight.detach().float().clone() for k, fqn in NORMS.items()})
    w.update({k: b.detach().float().clone() for k, fqn in BIASES.items()
              if (b := block.get_submodule(fqn).bias) is not None})
    return w


def check_group_sizes(model: nn.Module, cfg: CalibrationConfig) -> None:
    """ConfigError naming the first layer whose in_features the group size does not divide."""
    for i, block in enumerate(model.layers):
        for fqn in LINEARS.values():
            resolve_group_size(block.get_submodule(fqn).in_features, cfg.group_size, f"layers.{i}.{fqn}")


def init_params(fp: dict[str, Tensor], stats: dict[str, Tensor], cfg: CalibrationConfig,
                n_kv: int, head_dim: int) -> dict[str, Tensor]:
    """Leaf tensors to learn for one block (empty for rtn and gguf)."""
    p: dict[str, Tensor] = {}
    if cfg.method in UNTRAINED:
        return p
    if cfg.uses_transforms:
        for lin, key in (("wqkv", "s_attn"), ("w13", "s_ffn")):
            act = stats[lin].clamp(min=SCALE_CLAMP)
            wmax = fp[lin].abs().amax(0).clamp(min=SCALE_CLAMP)  # [E]
            s = (act.pow(cfg.smooth_alpha) / wmax.pow(1 - cfg.smooth_alpha)).clamp(min=SCALE_CLAMP)
            p[key] = s.log()
        if cfg.method == "affinequant":
            p["a_vo"] = torch.eye(head_dim).repeat(n_kv, 1, 1)  # [G, D, D]
    for key in LINEARS:
        out, k = fp[key].shape
        groups = k // resolve_group_size(k, cfg.group_size, key)
        p[f"{key}.gamma"] = torch.full((out, groups), cfg.clip_init)
        if not cfg.w_symmetric:
            p[f"{key}.beta"] = torch.full((out, groups), cfg.clip_init)
    return {k: v.clone().requires_grad_(True) for k, v in p.items()}


def _detach(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in params.items()}


def _act_maxima(fwd, x: Tensor, bs: int) -> dict[str, Tensor]:
    """Per-channel max|input| [E] of wqkv and w13 over all samples of x [N, L, E]."""
    stats: dict[str, Tensor] = {}
    with torch.no_grad():
        for j in range(0, x.shape[0], bs):
            st: dict = {}
            fwd(x[j:j + bs], st)
            stats = {k: torch.maximum(stats[k], v) if k in stats else v for k, v in st.items()}
    return stats


def _batched(fn, x: Tensor, bs: int) -> Tensor:
    with torch.no_grad():
        return torch.cat([fn(x[i:i + bs]) for i in range(0, x.shape[0], bs)])


def calibrate(model: nn.Module, tokens: Tensor, cfg: CalibrationConfig, work_dir: str | Path | None = None,
              progress: bool = True) -> list[dict]:
    """Calibrate every block of a models.decoder.Transformer on tokens [N, L] (positions 0..L-1).

    Returns, per block, {"weights": transformed fp32 weights, "params": learned params, "resumed":
    whether the params were read from work_dir}; pass it to build_quantized_model. work_dir: each
    finished block's params are saved there atomically (block_XXX.pt) and reused on a rerun with
    the same config, so an interrupted job resumes. Block i's epoch e draws its sample order from
    its own generator (cfg.seed, i, e), so a resumed run equals an uninterrupted one exactly.
    """
    from tqdm.auto import tqdm

    check_group_sizes(model, cfg)
    args = model.args
    h, g, d = args.n_heads, args.n_kv_heads, args.head_dim
    n, l = tokens.shape
    cos, sin = rope_tables(args, l)  # [L, D]
    sin = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [L, 1, D]
    fwd = lambda x, w, a_bits=16, stats=None: block_forward(  # noqa: E731
        x, w, args, cos, sin, a_bits, cfg.a_symmetric, stats)
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    bs = cfg.batch_size
    with torch.no_grad():
        fp_x = model.tok_embeddings(tokens).float()  # [N, L, E]
    q_x = fp_x.clone()
    train = cfg.method not in UNTRAINED and cfg.epochs > 0
    bar = tqdm(total=len(model.layers) * (cfg.epochs if train else 1), disable=not progress,
               desc=f"calibrate {cfg.method} w{cfg.w_bits}a{cfg.a_bits}", unit="block-epoch")
    full_mask = band_mask(d, d, cfg.stability)
    results = []
    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}"
        fp = block_weights(block)
        fp_out = _batched(lambda x: fwd(x, fp), fp_x, 8)  # [N, L, E] target
        saved = work / f"block_{i:03d}.pt" if work is not None else None
        resumed = saved is not None and saved.is_file()
        if resumed:
            params = torch.load(saved)
            bar.update(cfg.epochs if train else 1)
        else:
            stats = _act_maxima(lambda x, st: fwd(x, fp, 16, st), q_x, bs) if cfg.uses_transforms else {}
            params = init_params(fp, stats, cfg, g, d)
            if train:
                params = _train_block(params, fp, q_x, fp_out, fwd, cfg, prefix, i, bar, d)
            else:
                bar.update(1)
            params = _detach(params)
            if saved is not None:
                torch_save(saved, params)
                fault_point("calibrate.block")
        with torch.no_grad():
            w = merge_transforms(fp, params, h, g, d, full_mask)
            wq = fake_quantize_block(w, params, cfg, prefix)
            q_x = _batched(lambda x: fwd(x, wq, cfg.a_bits), q_x, 8)
        fp_x = fp_out
        results.append({"weights": {k: v.detach() for k, v in w.items()}, "params": params, "resumed": resumed})
    bar.close()
    return results


def _train_block(params, fp, q_x, fp_out, fwd, cfg, prefix, layer, bar, head_dim):
    """AdamW over block `layer`'s params; raises CalibrationDiverged on a non-finite loss."""
    tr = [v for k, v in params.items() if not k.endswith((".gamma", ".beta"))]
    clip = [v for k, v in params.items() if k.endswith((".gamma", ".beta"))]
    groups = [{"params": tr, "lr": cfg.lr_transform}] if tr else []
    opt = torch.optim.AdamW(groups + [{"params": clip, "lr": cfg.lr_clip}], weight_decay=0.0)
    good = _detach(params)
    n = q_x.shape[0]
    for epoch in range(cfg.epochs):
        mask = band_mask(head_dim, gradual_width(epoch, cfg.epochs, head_dim), cfg.stability)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed_for(cfg.seed, layer, epoch)))
        losses = []
        for j in range(0, n, cfg.batch_size):
            idx = perm[j:j + cfg.batch_size]
            snap = _detach(params)
            w = merge_transforms(fp, params, *_heads(fp, params, head_dim), head_dim, mask)
            out = fwd(q_x[idx], fake_quantize_block(w, params, cfg, prefix), cfg.a_bits)
            loss = block_loss(out, fp_out[idx])
            if not torch.isfinite(loss):
                with torch.no_grad():
                    for k, v in params.items():
                        v.copy_(good[k])
                raise CalibrationDiverged(
                    f"{prefix}: calibration loss is {loss.item()} (epoch {epoch}, step "
                    f"{j // cfg.batch_size}); stopped and kept the last good state of {prefix} "
                    "(earlier blocks are saved); lower quantize.calib.lr_transform / lr_clip or "
                    "check the model weights", prefix, good)
            good = snap
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        bar.set_postfix(layer=prefix, loss=f"{sum(losses) / len(losses):.3g}")
        bar.update(1)
    return params


def _heads(fp, params, head_dim):
    """(n_heads, n_kv) from the fused shapes: wqkv rows = (H + 2G) D, wo cols = H D."""
    h = fp["wo"].shape[1] // head_dim
    g = (fp["wqkv"].shape[0] // head_dim - h) // 2
    return h, g


def rtn_block_mse(model: nn.Module, tokens: Tensor, cfg: CalibrationConfig, layer: int = 0) -> tuple[float, float]:
    """(MSE of RTN, MSE of cfg's calibration) of block `layer` on tokens, both fed the fp stream
    (a diagnostic for tests: calibration must beat round-to-nearest)."""
    args = model.args
    from types import SimpleNamespace

    sub = SimpleNamespace(args=args, tok_embeddings=model.tok_embeddings, layers=list(model.layers)[:layer + 1])
    rtn = calibrate(sub, tokens, CalibrationConfig(**{**cfg.to_dict(), "method": "rtn"}), progress=False)
    cal = calibrate(sub, tokens, cfg, progress=False)
    d = args.head_dim
    cos, sin = rope_tables(args, tokens.shape[1])
    sin = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    with torch.no_grad():
        x = model.tok_embeddings(tokens).float()
        for blk in list(model.layers)[:layer]:
            x = block_forward(x, block_weights(blk), args, cos, sin)
        target = block_forward(x, block_weights(model.layers[layer]), args, cos, sin)
        out = []
        for res, c in ((rtn[-1], CalibrationConfig(**{**cfg.to_dict(), "method": "rtn"})), (cal[-1], cfg)):
            wq = fake_quantize_block(res["weights"], res["params"], c, f"layers.{layer}")
            y = block_forward(x, wq, args, cos, sin, c.a_bits, c.a_symmetric)
            out.append(block_loss(y, target).item())
    return out[0], out[1]


def _copy_without_block_linears(model: nn.Module) -> nn.Module:
    """A deep copy of model whose block linears (about to be replaced) hold empty placeholders, so a
    large model is never copied whole (a 1.5B fp32 model would need 6 GB more)."""
    memo = {}
    for block in model.layers:
        for fqn in LINEARS.values():
            lin = block.get_submodule(fqn)
            memo[id(lin.weight)] = nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
    return copy.deepcopy(model, memo)


def build_quantized_model(model: nn.Module, results: list[dict], config: QuantConfig,
                          dtype: torch.dtype = torch.float32, device: str = "cpu",
                          codes: "GGUFCodes | None" = None) -> nn.Module:
    """A copy of model with the calibrated (transformed) norms and real quantized linears.

    The codes come from quantize_weight with the learned clipping, so the real model computes the
    calibrated fake-quantized block exactly (up to the kernel's arithmetic); for method 'gguf' from
    `codes` (the model's GGUF file, quant.from_gguf). The LM head stays as it is unless
    config.quantize_lm_head (then: untied from the embedding, quantized the same way, no clipping).
    """
    if config.method == "gguf" and codes is None:
        raise ConfigError("method 'gguf' needs the model's GGUF codes (GGUFCodes.read(path)); "
                          "pass codes= or use method rtn")

    def quantize(w: Tensor, p: dict, key: str, name: str) -> tuple[Tensor, Tensor, Tensor]:
        if codes is not None:
            return codes.quantize(w, name)
        return quantize_weight(w, config.w_bits, config.group_size, config.w_symmetric,
                               p.get(f"{key}.gamma"), p.get(f"{key}.beta"), name)

    qm = _copy_without_block_linears(model).to(device=device, dtype=dtype)
    for i, (block, res) in enumerate(zip(qm.layers, results)):
        w, p = res["weights"], res["params"]
        for key, fqn in NORMS.items():
            block.get_submodule(fqn).weight.data = w[key].to(device=device, dtype=dtype)
        for key, fqn in LINEARS.items():
            name = f"layers.{i}.{fqn}"
            bias = w.get(f"{key}_bias")
            mod = _real_linear(quantize(w[key], p, key, name), config, dtype, device,
                               None if bias is None else bias.to(device, dtype), name)
            parent, _, attr = fqn.rpartition(".")
            setattr(block.get_submodule(parent), attr, mod)
    if config.quantize_lm_head:  # own weight: the embedding keeps the float table
        head = model.output
        qm.output = _real_linear(quantize(head.weight.detach().float(), {}, "output", "output"), config,
                                 dtype, device, None if head.bias is None else head.bias.to(device, dtype), "output")
    use_decode_layout(qm)  # float linears left over (the head) get the layout for their new dtype
    return qm.eval().requires_grad_(False)


def _real_linear(qsz: tuple[Tensor, Tensor, Tensor], config: QuantConfig, dtype: torch.dtype, device: str,
                 bias: Tensor | None, name: str) -> nn.Module:
    """The kernel module (chosen for shape, device and dtype) of codes, scale, zero (q [out, in])."""
    q, scale, zero = qsz
    out, k = q.shape
    kernel = choose_kernel(config, k, out, torch.device(device), name, dtype)
    return KERNEL_CLASSES[kernel].from_quantized(q.to(device), scale.to(device), zero.to(device), config,
                                                 bias, name)


__all__ = ["CalibrationConfig", "CalibrationDiverged", "calibrate", "build_quantized_model",
           "block_forward", "merge_transforms", "affine_matrix", "band_mask", "dominant",
           "gradual_width", "ConfigError"]
