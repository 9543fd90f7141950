"""Greedy identity in bf16: a target's one-token steps and its k-token verifications give every row
the same bits, so a bf16 chain emits exactly what bf16 vanilla decoding emits.

Reduced-precision CPU GEMMs give a row the same bits for any row count >= 2 but not for one row, and
SDPA's bits for a row change with the row count; bf16 rounding turns those last-bit differences into
different logits and, on near-ties, different greedy tokens (18/26 identical Spec-Bench answers for a
bf16 Qwen2.5-Coder-1.5B chain before the fix). The lean decoder therefore runs its bf16 linears on the
row-invariant kernel bf16_rows where the CPU has AVX-512 BF16, and its attention too (each row alone over
its own keys), else oneDNN with a single row run as two (gguf_codes.project) and a verification's attention
row by row with each row's own key length; and a chain's target prefills the prompt alone
(ModelLevel.score), as vanilla does. Both kernels are tested."""
import pytest
import torch
import torch.nn.functional as F

from polybasic.models import bf16_rows
from polybasic.runtime.chain import Chain
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf

# wide enough for the GEMMs to block like a real model's; 4 query heads over 2 kv heads (GQA)
KW = dict(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, init_std=0.05)


def _gemm_rows_invariant(k: int, n: int) -> bool:
    """This CPU's bf16 GEMM gives row 0 the same bits at 2..16 rows (the property the fix builds on)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(16, k, generator=g).to(torch.bfloat16)
    ref = F.linear(x[:2], w)[0]
    return all(torch.equal(F.linear(x[:m], w)[0], ref) for m in range(3, 17))


def _on(model, kernel: str):
    """model with every linear on `kernel`: bf16_rows (bound, as models.prepare does) or oneDNN (unbound)."""
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert bf16_rows.bind(model, kernel) == (linears if kernel == "bf16_rows" else 0)
    assert all(getattr(layer.attention, bf16_rows.ATTEND) == (kernel == "bf16_rows") for layer in model.layers)
    return model


@pytest.fixture(scope="module", params=[(f, k) for f in ("llama", "qwen2") for k in ("onednn", "bf16_rows")],
                ids=lambda p: "-".join(p))
def target(request):
    family, kernel = request.param
    if kernel == "bf16_rows" and not bf16_rows.status()[0]:
        pytest.skip(f"the bf16_rows kernel cannot run here: {bf16_rows.status()[1]}")
    if kernel == "onednn" and not all(_gemm_rows_invariant(k, n) for k, n in ((256, 544), (544, 256), (256, 512),
                                                                               (256, 1088))):
        pytest.skip("this CPU's bf16 GEMM changes a row's bits with the row count: bf16 greedy identity "
                    "cannot hold here (use an fp32 target)")
    hf = tiny_hf(family, seed=0, **KW)
    model = _on(lean_from_hf(hf, torch.bfloat16), kernel)
    return hf, model, kernel


@torch.inference_mode()
def test_step_rows_equal_verification_rows(target):
    _, model, _ = target
    prompt, new = list(range(5, 25)), [7, 300, 41, 9, 77, 123, 5, 260, 33, 18]
    model.setup_caches(64)
    model(torch.tensor([prompt]), 0)
    steps = [model(torch.tensor([[t]]), len(prompt) + i)[0][0, -1] for i, t in enumerate(new)]
    for chunk in (2, 3, 5, 10):
        model.setup_caches(64)
        model(torch.tensor([prompt]), 0)
        rows = []
        for s in range(0, len(new), chunk):
            rows += list(model(torch.tensor([new[s:s + chunk]]), len(prompt) + s)[0][0])
        assert all(torch.equal(a, b) for a, b in zip(rows, steps)), chunk


def test_bf16_chains_equal_bf16_vanilla(target):
    hf, model, kernel = target
    drafter = _on(lean_from_hf(perturbed_copy(hf, 0.05, seed=1), torch.bfloat16), kernel)
    for p in range(6):
        prompt = [(7 * p + 3 * i) % 500 + 2 for i in range(12 + 5 * p)]
        ref = list(generate_tokens(model, prompt, 40))
        for levels, k in (([ModelLevel(drafter, "d")], 4), ([NGramLevel(max_ngram=2)], 3),
                          ([ModelLevel(drafter, "d"), NGramLevel(max_ngram=2)], 3)):
            out, _ = Chain([ModelLevel(model, "target"), *levels], k=k).generate(prompt, 40)
            assert out == ref, (p, [lv.name for lv in levels])
