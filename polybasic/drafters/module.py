"""Training the EAGLE head: a LightningModule, its config and the Trainer factory.

Loss: v_weight * smooth-L1(predicted feature, base feature) + p_weight * cross-entropy of the
head's logits against the base's next-token distribution (soft targets), on answer tokens (and on
prompt tokens with prompt_loss). What the regression compares is `regress`:
  prenorm   (default) the base's last hidden state BEFORE its final norm, which is what the head
            outputs and reads back while drafting; both sides divided by the base feature's RMS
            per token (below).
  postnorm  the final norm's output, base.norm(pred) vs base.norm(true): the LM head's input, the
            state EAGLE-1 regresses. It only constrains what the logits see (the direction, per
            norm weight), not the scale of the pre-norm feature the next draft step reads.
  none      no regression term, the token loss only (EAGLE-3; the only choice for an eagle3 head,
            models.eagle_head.Eagle3Head, whose outputs are no base feature).
With ttt_steps = K > 1 (training-time test, EAGLE-3) the head also drafts K-1 steps further on its
own predictions, attending as the drafting loop does (`EagleHead.unroll`), and step j's losses
count with weight ttt_decay**(j-1) (normalised): the later draft steps learn from the inputs they
will really see.
With prenorm both feature sides are divided by the base feature's RMS per token, so the regression
has the same scale whatever the base (SmolLM2's raw features have RMS ~30). The head may read the base's
features plus uniform noise (EAGLE), scaled the same way. Features come from the batch (cached
shards) or from a base forward per step. The base model is frozen and deliberately
NOT a registered submodule: it is not checkpointed, not wrapped by DDP, never broadcast.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from polybasic.artifacts import announce, fault_point, torch_save, write_json
from polybasic.config import TrainConfig
from polybasic.drafters.data import EpochSampler, collate
from polybasic.errors import ConfigError, check
from polybasic.models.eagle_head import DrafterConfig, EagleHead, frequent_tokens, make_head, save_head
from polybasic.runtime.context import ExecutionContext


class DistillModule(L.LightningModule):
    def __init__(self, base, head_cfg: DrafterConfig, cfg: TrainConfig, draft_vocab=None) -> None:
        super().__init__()
        self.cfg = cfg
        check(head_cfg.arch == "eagle1" or cfg.regress == "none", "distill.train.regress",
              f"is {cfg.regress!r}, and an {head_cfg.arch} head predicts no base feature",
              "set distill.train.regress: none (the token loss alone)")
        self.head = make_head(head_cfg)
        if head_cfg.draft_vocab_size:
            check(draft_vocab is not None, "draft_vocab", "is required with draft_vocab_size > 0",
                  "pass frequent_tokens(samples, n, vocab_size)")
            self.head.set_draft_vocab(draft_vocab)
        object.__setattr__(self, "base", base.requires_grad_(False).eval())
        self.head.init_output_from_base(base).bind(base)
        if cfg.init_from_base:
            self.head.init_from_base(base)
        self.losses: list[float] = []

    def on_fit_start(self) -> None:
        self.base.to(self.device)
        self.head.bind(self.base)  # the base returns the layers the head reads (online features)

    def losses_for(self, batch: dict, noise: bool = True) -> dict[str, torch.Tensor]:
        tokens, mask = batch["tokens"], batch["mask"]  # [B, T], [B, T]
        b, t = tokens.shape
        if "feats" in batch:  # cached features
            hidden = batch["feats"].float()  # [B, T, (n+1) E]: n other layers (head.cfg.feature_layers), then f
        else:
            with torch.no_grad():
                self.base.setup_caches(t, b)
                hidden = self.base(tokens, 0)[1].float()  # [B, T, (n+1) E]
        f = hidden[:, :-1]  # [B, T-1, (n+1) E] features f_p (and the other layers' outputs)
        last = hidden[..., -self.head.cfg.dim:]  # [B, T, E] the last layer's: what the head predicts
        if noise and self.cfg.noise_std > 0:
            g = torch.Generator(device="cpu").manual_seed(
                self.cfg.seed * 1_000_003 + self.global_step * 101 + self.global_rank)
            u = torch.rand(f.shape, generator=g).to(f.device, f.dtype)
            per_layer = f.unflatten(-1, (-1, self.head.cfg.dim))  # [B, T-1, n+1, E]: each layer's own RMS
            f = f + (u - 0.5) * self.cfg.noise_std * _rms(per_layer).expand_as(per_layer).flatten(-2)
        f = f.to(self.head.dtype)
        steps = self.cfg.ttt_steps
        outs = self.head.unroll(tokens, f, steps) if steps > 1 else [self.head(tokens[:, 1:], f, 0)]
        # vocabulary-sized work only on the rows that are learned: base row r (position r+1) counts where
        # mask[:, 1:] is set; step j's row p targets position p+1+j, i.e. base row p+j
        keep = mask[:, 1:] > 0  # [B, T-1]
        base_row = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)  # [B, T-1] -> [R]
        base_row[keep] = torch.arange(int(keep.sum()), device=keep.device)
        with torch.no_grad():  # the base's distribution (renormalised on the draft vocabulary, if any),
            # its top token and entropy, once for all steps
            probs, top, entropy = _vocab_op(target_stats, self.cfg)(self.head.base_logits(last[:, 1:][keep]))
            base = {"probs": probs, "top": top, "entropy": entropy}  # [R, V'], [R], [R]
        logs: dict[str, torch.Tensor] = {}
        loss = 0.0
        raw = [self.cfg.ttt_decay ** j for j in range(steps)]
        weights = [w / sum(raw) for w in raw]  # step j+1's share of the loss
        for j, out in enumerate(outs):  # out [B, T-1, E]: row p predicts f_{p+1+j}
            n = t - 1 - j  # rows whose target lies inside the sequence
            sel = keep[:, j:]  # [B, n] rows whose target position p+1+j is learned
            rows = base_row[:, j:][sel]  # [R_j] their base rows
            step = _step_losses(self.head, out[:, :n][sel], last[:, 1 + j:][sel],
                                base if j == 0 else {k: v[rows] for k, v in base.items()},  # step 1: every row
                                self.cfg.regress,
                                _vocab_op(soft_cross_entropy, self.cfg))
            loss = loss + weights[j] * (self.cfg.v_weight * step["vloss"] + self.cfg.p_weight * step["ploss"])
            logs.update(step if j == 0 else {f"acc{j + 1}": step["acc"]})
        return {"loss": loss, **logs}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.losses_for(batch)
        self.losses.append(float(out["loss"].detach()))
        self.log_dict({f"train/{k}": v for k, v in out.items()}, prog_bar=True, sync_dist=False)
        n_tok = float(batch["tokens"].numel())  # tokens through base + head this step
        self.log("tok_s", n_tok / max(time.perf_counter() - t0, 1e-9), prog_bar=True, sync_dist=False)
        return out["loss"]

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.head.parameters(), lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                weight_decay=self.cfg.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)  # the recipe's horizon, even when a
        if self.cfg.max_steps <= 0 and self.trainer.max_epochs:  # run is told to stop early
            total = total // self.trainer.max_epochs * self.cfg.max_epochs
        total = max(1, total)
        warm = max(1, self.cfg.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * max(0.05, 1.0 - s / total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Per-token RMS [..., 1] (no gradient): the scale features are measured in."""
    return x.detach().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)


def target_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The base's logits [R, V'] -> its distribution [R, V'] (fp32), top token and entropy [R]."""
    z = logits.float()
    lse = torch.logsumexp(z, -1)  # [R]
    probs = (z - lse[:, None]).exp()
    return probs, z.argmax(-1), lse - torch.linalg.vecdot(probs, z)


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log softmax(z)_v per row = logsumexp(z) - p.z (sum p = 1): logits [R, V'], probs [R, V'] -> [R]."""
    z = logits.float()
    return torch.logsumexp(z, -1) - torch.linalg.vecdot(probs, z)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _vocab_op(fn, cfg: "TrainConfig"):
    """fn, compiled when cfg.compile_loss: inductor fuses its passes over the [R, V'] logits into a few loops
    (the soft cross-entropy's forward and backward: 5x faster on a 2-core CPU, memory-bound here)."""
    return _compiled(fn) if cfg.compile_loss else fn


def _step_losses(head: EagleHead, out: torch.Tensor, nxt: torch.Tensor, base: dict[str, torch.Tensor],
                 regress: str = "prenorm", ce_fn=soft_cross_entropy) -> dict[str, torch.Tensor]:
    """Means over the R rows that are learned: out, nxt [R, E] predicted and base features (pre-norm); base:
    the base's distribution "probs" [R, V'], its "top" token and "entropy" [R]; regress: the regression
    target (see the module docstring); ce_fn: soft_cross_entropy (or its compiled form)."""
    denom = max(out.shape[0], 1)
    if regress == "prenorm":
        r = _rms(nxt)  # [R, 1]
        vloss = F.smooth_l1_loss(out.float() / r, nxt / r, reduction="none").mean(-1).sum() / denom
    elif regress == "postnorm":  # the base's frozen final norm on both sides (gradients flow through it)
        norm = head.base.norm
        pred, true = norm(out.float()).float(), norm(nxt.float()).float()  # [R, E]
        vloss = F.smooth_l1_loss(pred, true, reduction="none").mean(-1).sum() / denom
    else:  # "none": no regression term
        vloss = torch.zeros((), device=out.device)
    logits = head.logits(out)  # [R, V']
    ce = ce_fn(logits, base["probs"])  # [R] cross-entropy against the soft targets
    ploss = ce.sum() / denom
    with torch.no_grad():
        acc = (logits.argmax(-1) == base["top"]).float().sum() / denom
        kl = (ce - base["entropy"]).sum() / denom
    return {"vloss": vloss, "ploss": ploss, "kl": kl, "acc": acc}


class HeadExport(L.Callback):
    """Writes `head.safetensors` (weights + DrafterConfig metadata) beside every Lightning checkpoint."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)

    def _write(self, trainer: L.Trainer, module: DistillModule) -> None:
        if trainer.is_global_zero:
            save_head(self.out_dir / "head.safetensors", module.head,
                      {"global_step": trainer.global_step, "train_config": asdict(module.cfg)})

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self._write(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self._write(trainer, module)


class LastCheckpoint(L.Callback):
    """`last.ckpt`, the resume point: written (atomically, see AtomicCheckpointIO) at the end of
    every epoch, every `every_n_steps` optimizer steps within an epoch, and when training stops
    elsewhere (max_steps). It holds the loops' progress, optimizer, scheduler and the sampler's
    position in the epoch, so a resumed run continues with exactly the next batch.

    On resume this callback hands the saved position back to the loader itself: Lightning 2.6 does
    so only when it sets up the data after loading the checkpoint, but configure_optimizers reads
    `estimated_stepping_batches`, which sets the data up before."""

    def __init__(self, path: str | Path, every_n_steps: int) -> None:
        self.path, self.every = Path(path), every_n_steps
        self.saved_step = -1
        self.loader_states: list[dict] = []

    def on_load_checkpoint(self, trainer, module, checkpoint) -> None:
        self.loader_states = checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader", [])

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path)
        self.saved_step = trainer.global_step
        fault_point("train.checkpoint")

    def on_train_start(self, trainer, module) -> None:
        self.saved_step = trainer.global_step  # a resumed run starts from a saved state
        loaders = trainer.train_dataloader
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        for loader, state in zip([x for x in loaders if isinstance(x, ResumableLoader)], self.loader_states):
            loader.load_state_dict(state)
        self.loader_states = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # the epoch end saves that one
        if self.every and trainer.global_step % self.every == 0 and not last:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        self._save(trainer)

    def on_train_end(self, trainer, module) -> None:
        if trainer.global_step != self.saved_step:
            self._save(trainer)


def _atomic_checkpoint_io():
    """Lightning's checkpoint writer, through polybasic.artifacts (temp file + os.replace)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            torch_save(path, checkpoint)

    return AtomicCheckpointIO()


def deepspeed_config(cfg: TrainConfig) -> dict:
    """DeepSpeed ZeRO stage-2 config generated from the training config."""
    bf16 = cfg.precision.startswith("bf16")
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": cfg.precision.startswith("16")},
        "zero_allow_untested_optimizer": True,
    }


def on_cuda(ctx: ExecutionContext | None) -> bool:
    return ctx is not None and ctx.torch_device.type == "cuda"


def strategy_for(cfg: TrainConfig, ctx: ExecutionContext | None = None):
    """Lightning's strategy for cfg.strategy on the context's device (None: the CPU)."""
    if cfg.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="nccl" if on_cuda(ctx) else "gloo")
    if cfg.strategy == "deepspeed_stage_2":
        if not on_cuda(ctx):
            raise ConfigError("train.strategy: deepspeed_stage_2 needs CUDA GPUs and the run is on the CPU; "
                              "set model.device: cuda on a GPU machine, or use 'ddp' (CPU, gloo) or 'auto'")
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=deepspeed_config(cfg))
    return "auto"


def trainer_device(cfg: TrainConfig, ctx: ExecutionContext) -> dict:
    """Lightning's accelerator and devices, from the execution context: cuda:N trains on GPU N, cuda on
    cfg.devices GPUs, the CPU in cfg.devices processes (ddp)."""
    if on_cuda(ctx):
        index = ctx.torch_device.index
        return {"accelerator": "gpu", "devices": [index] if index is not None else cfg.devices}
    return {"accelerator": "cpu", "devices": cfg.devices}


def build_trainer(cfg: TrainConfig, out_dir: str | Path, ctx: ExecutionContext, **overrides) -> L.Trainer:
    """Trainer on the context's device writing `checkpoints/last.ckpt` (resumable; every epoch and
    every cfg.checkpoint_every_n_steps steps) and head.safetensors beside it, both atomically."""
    out = Path(out_dir)
    ckpt = LastCheckpoint(out / "checkpoints" / "last.ckpt", cfg.checkpoint_every_n_steps)
    deepspeed = cfg.strategy == "deepspeed_stage_2"  # DeepSpeed writes its own checkpoint folder
    kw = dict(default_root_dir=str(out), max_epochs=cfg.max_epochs, max_steps=cfg.max_steps,
              strategy=strategy_for(cfg, ctx), **trainer_device(cfg, ctx),
              precision=cfg.precision, gradient_clip_val=None if cfg.strategy == "deepspeed_stage_2" else cfg.grad_clip,
              callbacks=[ckpt, HeadExport(out)], enable_checkpointing=False,
              plugins=[] if deepspeed else [_atomic_checkpoint_io()], log_every_n_steps=cfg.log_every, logger=False,
              enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
              deterministic=False)
    kw.update(overrides)
    if kw.get("enable_progress_bar"):  # tqdm: loss, acc and ETA, also readable in a log file
        from lightning.pytorch.callbacks import TQDMProgressBar

        kw["callbacks"] = kw["callbacks"] + [TQDMProgressBar(refresh_rate=5)]
    return L.Trainer(**kw)


def train_dataloader(dataset, cfg: TrainConfig):
    """Seeded per-epoch order, sharded over DDP ranks at iteration time."""
    sampler = EpochSampler(len(dataset), cfg.seed, [len(s.tokens) for s in dataset.samples], cfg.batch_size)
    return ResumableLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                           collate_fn=lambda b: collate(b, cfg.max_len, cfg.prompt_loss))


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader whose sampler's position in the epoch is saved in Lightning checkpoints
    (Lightning stores the state of loaders with state_dict / load_state_dict). Batches are drawn
    on demand (num_workers=0), so the position counts exactly the batches trained on."""

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def fit(base, dataset, head_cfg: DrafterConfig, cfg: TrainConfig, out_dir: str | Path,
        resume: bool = True, ctx: ExecutionContext | None = None, **trainer_overrides) -> DistillModule:
    """Train (resuming from out_dir/checkpoints/last.ckpt when present) where `ctx` says (default: the
    base model's device); returns the module. With head_cfg.draft_vocab_size = N the draft vocabulary
    is the N most frequent answer tokens."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ctx = ctx or ExecutionContext(str(next(base.parameters()).device), flag="distill: the base model's device")
    trainer = build_trainer(cfg, out_dir, ctx, **trainer_overrides)
    d2t = None
    if head_cfg.draft_vocab_size:
        d2t = frequent_tokens(dataset.samples, head_cfg.draft_vocab_size, head_cfg.vocab_size)
    module = DistillModule(base, head_cfg, cfg, d2t)
    last = Path(out_dir) / "checkpoints" / "last.ckpt"
    loader = train_dataloader(dataset, cfg)
    same = _resumable(last, training_key(dataset.samples, head_cfg, cfg))  # recorded even when not resuming
    resume = resume and same
    if resume:
        announce(f"resumed: training of {out_dir} from {last} ({_progress(last)})")
    trainer.fit(module, loader, ckpt_path=str(last) if resume else None)
    return module


# training settings a checkpoint may be resumed under when they change: more epochs or steps train on from it
RESUMABLE_CHANGES = ("max_epochs", "max_steps", "checkpoint_every_n_steps", "log_every", "compile_loss")


def training_key(samples, head_cfg: DrafterConfig, cfg: TrainConfig) -> dict:
    """What a checkpoint's training depends on: the sequences (their tokens and prompt lengths), the head's
    architecture, and the training settings but those in RESUMABLE_CHANGES."""
    h = hashlib.sha256()
    for smp in samples:
        h.update(f"{smp.n_prompt}:{','.join(map(str, smp.tokens))};".encode())
    train = {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}
    # through JSON, so that it compares equal to the key read back from inputs.json (tuples become lists)
    return json.loads(json.dumps({"samples": h.hexdigest(), "head": head_cfg.to_dict(), "train": train}))


def _resumable(last: Path, key: dict) -> bool:
    """Whether `last` (a checkpoint, maybe absent) was made from the inputs `key`. The key is kept beside it
    (inputs.json); a checkpoint made from others (other data or settings, or before keys were kept) is moved
    aside to stale-last.ckpt, announced, and training starts afresh."""
    meta = last.with_name("inputs.json")
    same = last.is_file() and meta.is_file() and json.loads(meta.read_text()) == key
    if last.is_file() and not same:
        with contextlib.suppress(FileNotFoundError):  # another rank of the same run moved it first
            os.replace(last, last.with_name("stale-last.ckpt"))
        announce(f"moved {last} to stale-last.ckpt: made from other sequences or training settings; training "
                 "starts afresh")
    write_json(meta, key)
    return same


def _progress(ckpt: Path) -> str:
    """'epoch E, step S' of a Lightning checkpoint (epochs finished, optimizer steps done)."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    done = state["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
    return f"{done} epoch(s) finished, step {state['global_step']}"
