"""The execution context: device checks at the edge (CLI, recipe, runtime.load), generators on the
device, synchronizing timers, and the per-device preparation step. Runs on a CPU: a missing CUDA is
simulated by patching torch.cuda.is_available, so these checks hold on GPU machines too."""
import time

import pytest
import torch

from polybasic.bench.report import machine_info, markdown
from polybasic.cli import main
from polybasic.config import QuantConfig, SamplingConfig
from polybasic.errors import ConfigError
from polybasic.models.decoder import Transformer
from polybasic.models.prepare import check_compilable, prepare_for_device
from polybasic.quant.linear import Int4PackLinear, cuda_inner_k_tiles
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import build_chain
from polybasic.runtime.chainspec import parse_chain_spec
from polybasic.runtime.context import ExecutionContext, check_device, parse_device, timed
from polybasic.runtime.sampling import check_generator, make_generator
from tests.helpers import lean_from_hf, tiny_hf_folder, tiny_hf_llama


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_folder(path, init_std=0.2)
    return str(path)


def test_default_context_is_the_cpu_with_seeded_generators():
    ctx = ExecutionContext(seed=5)
    assert ctx.torch_device == torch.device("cpu") and ctx.torch_dtype == torch.float32
    a, b = ctx.generator(), ctx.generator()
    assert a.device.type == "cpu"
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))  # the context's seed
    assert not torch.equal(torch.rand(8, generator=ctx.generator(6)), torch.rand(8, generator=ctx.generator()))


@pytest.mark.parametrize("bad", ["tpu", "banana", "cpu:x"])
def test_unknown_device_names_the_flag(bad):
    with pytest.raises(ConfigError, match=r"^--device: .*use cpu, cuda or cuda:N"):
        ExecutionContext(bad)
    with pytest.raises(ConfigError, match=r"^model\.device: "):
        parse_device(bad, "model.device")


def test_cuda_without_a_gpu_names_the_flag_and_the_fix(no_cuda):
    with pytest.raises(ConfigError, match=r"--device: 'cuda' asked for, but this machine has no usable CUDA.*"
                                          r"pass --device cpu"):
        ExecutionContext("cuda")
    assert parse_device("cuda:1", "model.device") == torch.device("cuda:1")  # a cluster recipe still reads
    with pytest.raises(ConfigError, match="device: 'cuda:0' asked for"):
        check_device("cuda:0", "device")


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "w1 w2", "--device", "cuda"],
    ["generate", "--prompt", "w1 w2", "--device", "tpu"],
    ["bench", "--device", "cuda", "--methods", "vanilla"],
])
def test_cli_device_errors_exit_2_before_loading(argv, folder, no_cuda, capsys, monkeypatch):
    import polybasic.models

    monkeypatch.setattr(polybasic.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(argv + ["--model", folder]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device: ") and "Traceback" not in err


def test_compiled_steps_are_for_cpu_and_cuda():
    check_compilable("cpu")
    check_compilable("cuda:0")  # captured as CUDA graphs
    with pytest.raises(ConfigError, match="^--compile: .*not mps"):
        check_compilable("mps")
    with pytest.raises(ConfigError, match="^--methods vanilla-compiled: "):
        check_compilable("meta", "--methods vanilla-compiled")


def test_recipe_device_is_parsed_then_checked_when_it_runs(tmp_path, no_cuda):
    from polybasic.config import ModelSection
    from polybasic.pipelines.run import run_recipe

    assert ModelSection(device="cuda").device == "cuda"  # read anywhere (a GPU-cluster recipe)
    with pytest.raises(ConfigError, match=r"^model\.device: unknown device 'gpu0'"):
        ModelSection(device="gpu0")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nout_dir: {tmp_path / 'run'}\nmodel: {{source: smollm2-135m, device: cuda}}\n")
    with pytest.raises(ConfigError, match="r.yaml: model.device: 'cuda' asked for"):
        run_recipe(recipe)
    assert not (tmp_path / "run").exists()  # nothing ran


def test_generator_on_another_device_is_a_clear_error():
    check_generator(None, "meta")
    check_generator(make_generator(0, "cpu"), "cpu")
    with pytest.raises(ConfigError, match=r"generator: a generator on cpu cannot sample probabilities on meta"):
        check_generator(make_generator(0, "cpu"), "meta")


def test_timer_synchronizes_cuda_at_both_ends_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append(dev))
    with timed("cpu") as t:
        time.sleep(0.01)
    assert calls == [] and t.seconds >= 0.01
    with timed("cuda:0") as t:
        assert len(calls) == 1  # before the block
    assert calls == [torch.device("cuda:0")] * 2


def test_chain_levels_follow_the_target_device(folder):
    from polybasic.models import load_model

    lm = load_model(folder)
    levels = build_chain(parse_chain_spec("target@bfloat16+ngram", "--chain"), lm)
    assert levels[1].model.device == lm.model.device and levels[1].model.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"^--chain: levels asked for on meta, but the target is on cpu"):
        build_chain(parse_chain_spec("ngram", "--chain"), lm, "meta", "--chain")
    ngram = levels[2]
    assert ngram.device is None  # model-free: no device of its own until a chain gives it the target's
    Chain(levels, k=3)
    assert ngram.device == lm.model.device
    assert ngram.propose([5, 6, 5], 2, SamplingConfig(), None, frozenset())[1].device == lm.model.device


def test_prepare_for_device_is_the_cpu_decode_layout_and_idempotent():
    fp32 = lean_from_hf(tiny_hf_llama())
    prepare_for_device(fp32)
    w = fp32.layers[0].attention.wqkv.weight
    assert not w.is_contiguous() and w.t().is_contiguous()  # fp32 on CPU: transposed layout
    prepare_for_device(fp32)
    assert fp32.layers[0].attention.wqkv.weight is w  # already prepared: untouched
    bf16 = prepare_for_device(Transformer(fp32.args).to(torch.bfloat16))
    assert all(m.weight.is_contiguous() for m in bf16.modules() if isinstance(m, torch.nn.Linear))


def test_int4pack_binds_its_kernel_for_the_weights_device():
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack")
    mod = Int4PackLinear.from_float(torch.nn.Linear(64, 32), cfg)
    assert mod._mm is torch.ops.aten._weight_int4pack_mm_for_cpu and mod._dense_rows == mod.gemm_rows
    # CUDA tile counts for SmolLM2-135M's inner dimensions (576 = 36 x 16 takes 4 tiles, not gpt-fast's 8)
    assert [cuda_inner_k_tiles(k) for k in (576, 1536, 64, 32, 40)] == [4, 8, 4, 2, None]
    assert Int4PackLinear.check_shape(576, 1536, cfg, "cuda", "x") is None


def test_bench_machine_record_names_the_gpu(monkeypatch):
    cpu = machine_info("float32", "polybasic bench")
    assert cpu["device"] == "cpu" and "gpu" not in cpu and "GPU" not in markdown(_doc(cpu))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100 80GB HBM3")
    gpu = machine_info("bfloat16", "polybasic bench --device cuda", "cuda")
    assert gpu["device"] == "cuda" and gpu["gpu"] == "NVIDIA H100 80GB HBM3"
    assert "GPU NVIDIA H100 80GB HBM3" in markdown(_doc(gpu))


def _doc(machine: dict) -> dict:
    return {"machine": machine, "methods": {}, "config": {}, "records": []}
