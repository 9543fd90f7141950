"""A randomly initialised EAGLE-3 draft for a target, built with `speculators`' own classes and saved
in its format (run with the vLLM venv's python, which has `speculators`):

    .venv-vllm/bin/python tests/serving/make_eagle3_draft.py TARGET_HF_FOLDER OUT [--k 3] [--draft-vocab 8192]

The draft has the real format and shapes, so vLLM serves it with output identical to its vanilla
decoding: the engine's side of serve-check is tested without a trained head. Draft vocabulary: the
--draft-vocab token ids from --first-id on (d2t all --first-id). With --constant, the LM head is zero:
every draft token is --first-id (a rig whose acceptance follows from the output alone: every engine
counting drafts the same way reports the same acceptance).
"""
import argparse
import copy

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import AutoConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("out")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--aux-layers", default=None, help="comma-separated target layers (default: low, middle, high)")
    p.add_argument("--first-id", type=int, default=0)
    p.add_argument("--constant", action="store_true", help="zero LM head: always draft --first-id")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    cfg = AutoConfig.from_pretrained(a.target)
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.num_hidden_layers = 1
    n = cfg.num_hidden_layers
    aux = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else [2, n // 2, n - 3]
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[a.first_id:a.first_id + a.draft_vocab] = True
    d2t = torch.full((a.draft_vocab,), a.first_id, dtype=torch.long)  # target id = draft id + d2t
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=a.target, target_layer_ids=aux,
        draft_vocab_size=a.draft_vocab, norm_before_residual=False, ttt_steps=a.k, draft_attn_impl="eager")
    with torch.no_grad():
        for name, t in model.named_parameters():
            if torch.isnan(t).any():
                t.normal_(0, 0.02)
        if a.constant:
            model.lm_head.weight.zero_()
    model.save_pretrained(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
