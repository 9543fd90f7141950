"""quantize_ on a tiny lean model, save/load round trip, end-to-end signal-to-noise floors."""
import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from polybasic.errors import ConfigError, ModelNotFoundError
from polybasic.models import ModelArgs, Transformer
from polybasic.quant import QuantConfig, QuantLinear, load_quantized, quantize_, quantized_modules, save_quantized
from polybasic.quant.api import read_quant_metadata
from tests.helpers import lean_from_hf, tiny_hf_llama

LINEARS = ["attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"]
IDS = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base():
    # init_std 0.1 so the blocks (not just the tied embedding) shape the logits
    return lean_from_hf(tiny_hf_llama(init_std=0.1))


def logits(model, ids=IDS):
    model.setup_caches(64)
    with torch.no_grad():
        prefill, _ = model(ids[:, :20], 0)
        verify, _ = model(ids[:, 20:], 20)
    return torch.cat([prefill, verify], 1)


def snr_db(ref, y):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())).item()


W4A16 = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack")
W4A4 = QuantConfig(w_bits=4, a_bits=4, group_size=-1, method="affinequant")
W8A8 = QuantConfig(w_bits=8, a_bits=8, group_size=-1)


def test_swaps_every_block_linear_but_not_the_tied_head(base):
    model = quantize_(copy.deepcopy(base), W4A16)
    mods = quantized_modules(model)
    assert sorted(mods) == sorted(f"layers.{i}.{n}" for i in range(2) for n in LINEARS)
    assert set(mods.values()) == {"int4pack"}
    assert type(model.output) is nn.Linear and model.output.weight is model.tok_embeddings.weight
    out = logits(model)
    assert out.shape == (1, 24, 128) and torch.isfinite(out).all()


def test_auto_kernel_follows_the_activation_dtype(base):
    auto = QuantConfig(w_bits=4, a_bits=16, group_size=32)
    assert set(quantized_modules(quantize_(copy.deepcopy(base), auto)).values()) == {"dequant"}
    bf16 = quantize_(copy.deepcopy(base).to(torch.bfloat16), auto)
    assert set(quantized_modules(bf16).values()) == {"int4pack"}
    ref = logits(copy.deepcopy(base))
    assert snr_db(ref, logits(bf16).float()) > 10.0  # the fp32 w4a16 floor below holds in bf16 too


def test_quantize_lm_head_keeps_embedding(base):
    model = quantize_(copy.deepcopy(base), QuantConfig(w_bits=8, a_bits=16, group_size=32,
                                                       quantize_lm_head=True))
    assert isinstance(model.output, QuantLinear)
    assert torch.equal(model.tok_embeddings.weight, base.tok_embeddings.weight)
    assert torch.isfinite(logits(model)).all()


def test_filter_fn_selects_modules(base):
    model = quantize_(copy.deepcopy(base), W4A16, filter_fn=lambda m, fqn: fqn.endswith("w2"))
    assert sorted(quantized_modules(model)) == ["layers.0.feed_forward.w2", "layers.1.feed_forward.w2"]


# stated floors (dB of logit SNR vs the fp32 model, fixed seeds, round-to-nearest, no calibration):
# measured 32.6 / 12.9 / 8.1 when written
@pytest.mark.parametrize("config, floor", [(W8A8, 25.0), (W4A16, 10.0), (W4A4, 5.0)],
                         ids=["w8a8", "w4a16", "w4a4"])
def test_signal_to_noise_floor(base, config, floor):
    ref = logits(copy.deepcopy(base))
    y = logits(quantize_(copy.deepcopy(base), config))
    assert snr_db(ref, y) > floor


def test_w4a4_kernels_agree(base):
    a = logits(quantize_(copy.deepcopy(base), W4A4))  # auto -> int8mm
    b = logits(quantize_(copy.deepcopy(base), QuantConfig(**{**W4A4.to_dict(), "kernel": "dequant"})))
    assert set(quantized_modules(quantize_(copy.deepcopy(base), W4A4)).values()) == {"int8mm"}
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [W4A16, W4A4, QuantConfig(w_bits=8, a_bits=16, group_size=16,
                                                             quantize_lm_head=True)],
                         ids=["w4a16", "w4a4", "w8-head"])
def test_save_load_round_trip_exact(base, tmp_path, config):
    model = quantize_(copy.deepcopy(base), config)
    ref = logits(model)
    path = save_quantized(model, tmp_path / "q.safetensors", config)
    assert [p.name for p in tmp_path.iterdir()] == ["q.safetensors"]  # no tmp file left behind
    args = base.args
    loaded = load_quantized(path, lambda: Transformer(ModelArgs.from_dict(args.to_dict())))
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd2[k]) and sd[k].dtype == sd2[k].dtype for k in sd)
    assert quantized_modules(loaded) == quantized_modules(model)
    if not config.quantize_lm_head:
        assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()
    assert torch.equal(logits(loaded), ref)
    cfg, mods, _, dtype = read_quant_metadata(path)
    assert dtype == torch.float32
    assert cfg == config and mods == quantized_modules(model)


def test_load_with_another_kernel(base, tmp_path):
    model = quantize_(copy.deepcopy(base), W4A16)
    path = save_quantized(model, tmp_path / "q.safetensors", W4A16)
    loaded = load_quantized(path, lambda: Transformer(base.args), kernel="dequant")
    assert set(quantized_modules(loaded).values()) == {"dequant"}
    torch.testing.assert_close(logits(loaded), logits(model), rtol=1e-4, atol=1e-4)


def test_bad_group_size_names_the_layer_before_touching_the_model(base):
    model = copy.deepcopy(base)
    with pytest.raises(ConfigError, match=r"layers\.0\.feed_forward\.w2: group_size 64 does not divide "
                                          r"in_features=160.*32"):
        quantize_(model, QuantConfig(w_bits=4, group_size=64, kernel="dequant"))
    assert quantized_modules(model) == {}


def test_explicit_kernel_that_cannot_run_a_layer():
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40))
    with pytest.raises(ConfigError, match=r"^2: kernel 'int4pack' out_features=40 is not a multiple of 16"):
        quantize_(model, QuantConfig(w_bits=4, group_size=32, kernel="int4pack"))
    assert quantized_modules(model) == {}  # checked before the first swap
    quantize_(model, QuantConfig(w_bits=4, group_size=16, kernel="auto"))  # auto: dequant fallback
    assert quantized_modules(model) == {"0": "dequant", "2": "dequant"}


def test_load_errors(base, tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_quantized(tmp_path / "missing.safetensors", lambda: Transformer(base.args))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ConfigError, match="not a polybasic quantized checkpoint"):
        load_quantized(tmp_path / "plain.safetensors", lambda: Transformer(base.args))
    # a checkpoint from a newer polybasic
    model = quantize_(copy.deepcopy(base), W4A16)
    path = save_quantized(model, tmp_path / "q.safetensors", W4A16)
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    meta["quant_config"] = json.dumps({**W4A16.to_dict(), "version": 99})
    save_file(load_file(str(path)), str(tmp_path / "new.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match="QuantConfig.version: 99 is newer"):
        load_quantized(tmp_path / "new.safetensors", lambda: Transformer(base.args))


def test_bf16_round_trip_keeps_kernels(base, tmp_path):
    auto = QuantConfig(w_bits=4, a_bits=16, group_size=32)
    model = quantize_(copy.deepcopy(base).to(torch.bfloat16), auto)
    path = save_quantized(model, tmp_path / "q.safetensors", auto)
    for kernel in (None, "auto"):  # recorded kernels; re-resolved from the recorded dtype
        loaded = load_quantized(path, lambda: Transformer(base.args), kernel=kernel)
        assert set(quantized_modules(loaded).values()) == {"int4pack"}
        assert loaded.tok_embeddings.weight.dtype == torch.bfloat16
        assert torch.equal(logits(loaded), logits(model))


def test_load_into_the_wrong_architecture(base, tmp_path):
    path = save_quantized(quantize_(copy.deepcopy(base), W4A16), tmp_path / "q.safetensors", W4A16)
    other = ModelArgs.from_dict({**base.args.to_dict(), "n_layers": 1})
    with pytest.raises(ConfigError, match="build the architecture the checkpoint was saved from"):
        load_quantized(path, lambda: Transformer(other))


def test_quantized_copy_is_a_model_source(tmp_path):
    """load_model(copy.safetensors) rebuilds the copy with the tokenizer of the model it came from;
    the chain spec can then put a drafter head under it."""
    from polybasic.errors import ConfigError
    from polybasic.models import load_model
    from polybasic.quant import load_any_model
    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "m", vocab=64)
    lm = load_model(str(tmp_path / "m"))
    q = quantize_(copy.deepcopy(lm.model), W4A16)
    save_quantized(q, tmp_path / "q.safetensors", W4A16, source=str(tmp_path / "m"))
    got = load_any_model(str(tmp_path / "q.safetensors"))
    assert set(quantized_modules(got.model)) == set(quantized_modules(q))
    assert got.tokenizer.get_vocab() == lm.tokenizer.get_vocab() and got.args == lm.args
    # the contract: the reloaded copy is the saved one, tensor for tensor and layout for layout
    # (quantized codes are stored contiguous; the float modules left get load_model's decode
    # layout; a tied head stays tied), so it runs the same kernels and its logits are bitwise equal
    sd, sd2 = q.state_dict(), got.model.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]) and sd[k].stride() == sd2[k].stride(), k
    assert got.model.output.weight is got.model.tok_embeddings.weight
    ids = torch.tensor([[3, 5, 7]])
    with torch.inference_mode():
        q.setup_caches(8), got.model.setup_caches(8)
        assert torch.equal(q(ids, 0)[0], got.model(ids, 0)[0])
    save_quantized(q, tmp_path / "old.safetensors", W4A16)  # no source recorded
    with pytest.raises(ConfigError, match="re-run `polybasic quantize"):
        load_any_model(str(tmp_path / "old.safetensors"))
