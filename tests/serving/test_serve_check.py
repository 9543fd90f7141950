"""serve-check without vLLM: bad input refused with the field named before anything loads, the
speculators folder checked against the target, the worker's protocol (a fake vllm module), its
environment, our side's chain and the near-tie gap on a tiny model."""
import json
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from polybasic.cli import main
from polybasic.errors import ConfigError, ModelNotFoundError
from polybasic.serving import check as sc
from tests.helpers import lean_from_hf, tiny_hf, word_tokenizer

TARGET_CFG = {"hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 4, "architectures": ["LlamaForCausalLM"]}


def write_speculators(folder, *, model_type="eagle3", hidden=64, vocab=128, aux=(1, 2, 3), draft=48,
                      drop=()):
    """A speculators-format folder: config.json and a model.safetensors holding the named tensors (tiny)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"speculators_model_type": model_type, "draft_vocab_size": draft,
           "eagle_aux_hidden_state_layer_ids": list(aux),
           "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}]},
           "transformer_layer_config": {"model_type": "llama", "hidden_size": hidden, "vocab_size": vocab}}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = ["fc.weight", "norm.weight", "lm_head.weight", "layers.0.mlp.down_proj.weight", "d2t", "t2d"]
    save_file({n: torch.zeros(2) for n in names if n not in drop}, folder / "model.safetensors")
    return folder


@pytest.fixture
def fake_python(tmp_path):
    p = tmp_path / "venv" / "bin" / "python"
    p.parent.mkdir(parents=True)
    p.write_text("#!/bin/sh\n")
    return p


def serve_check(capsys, *argv):
    rc = main(["serve-check", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    ([], ["bundle: none given", "--speculators"]),
    (["--speculators", "{d}/spec"], ["--model:", "pass --model"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--k", "0"], ["k: must be >= 1, got 0"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--max-new-tokens", "0"],
     ["max_new_tokens: must be >= 1"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--near-tie", "-1"], ["near_tie: must be >= 0"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--ours-compiled", "--warmup", "0"],
     ["warmup: --ours-compiled compiles on its first prompt"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/missing"], ["speculators: {d}/missing: no such folder",
                                                                    "polybasic export"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/eagle1"], ["speculators_model_type", "'eagle'", "'eagle3'"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/no_fc"], ["tensors: fc.weight missing"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/no_d2t"], ["tensors: d2t missing"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--head", "{d}/nohead.safetensors"],
     ["head: {d}/nohead.safetensors does not exist"]),
    (["{d}/spec", "--head", "{d}/h.safetensors"], ["--head: our chain runs the bundle's exported head"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--out", "{d}/afile"], ["out: {d}/afile is a file"]),
    (["--model", "smollm2-135m", "--speculators", "{d}/spec", "--categories", "nope"], ["categories: unknown nope"]),
])
def test_bad_input_is_refused_with_the_field_named(tmp_path, capsys, fake_python, argv, words):
    write_speculators(tmp_path / "spec")
    write_speculators(tmp_path / "eagle1", model_type="eagle")
    write_speculators(tmp_path / "no_fc", drop=("fc.weight",))
    write_speculators(tmp_path / "no_d2t", drop=("d2t",))
    (tmp_path / "afile").write_text("x")
    argv = [a.format(d=tmp_path) for a in argv] + ["--vllm-python", str(fake_python)]
    rc, err = serve_check(capsys, *argv)
    assert rc == 2 and err.startswith("error: "), err
    for w in words:
        assert w.format(d=tmp_path) in err, (w, err)


def test_a_missing_vllm_environment_names_make_vllm_check(tmp_path, capsys, monkeypatch):
    write_speculators(tmp_path / "spec")
    monkeypatch.setenv(sc.VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    rc, err = serve_check(capsys, "--model", "smollm2-135m", "--speculators", str(tmp_path / "spec"))
    assert rc == 2 and "vllm-python:" in err and "make vllm-check" in err


def test_the_speculators_folder_is_checked_against_the_target(tmp_path):
    cfg = sc.read_speculators_config(write_speculators(tmp_path / "ok"))
    sc.check_against_target(cfg, TARGET_CFG, "speculators")  # fits
    for kw, words in (({"hidden": 32}, "transformer_layer_config.hidden_size: is 32, the target's is 64"),
                      ({"vocab": 256}, "transformer_layer_config.vocab_size: is 256, the target's is 128"),
                      ({"aux": (1, 2, 9)}, "eagle_aux_hidden_state_layer_ids: [9] are not layers")):
        cfg = sc.read_speculators_config(write_speculators(tmp_path / str(kw), **kw))
        with pytest.raises(ConfigError, match=r"another target|not layers") as e:
            sc.check_against_target(cfg, TARGET_CFG, "speculators")
        assert words in str(e.value)
    # no reduced draft vocabulary: no d2t / t2d needed
    sc.read_speculators_config(write_speculators(tmp_path / "full", draft=128, drop=("d2t", "t2d")))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        sc.read_speculators_config(tmp_path / "bad")


def test_the_target_folder_must_name_its_architecture_for_vllm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="architectures: is missing") as e:
        sc.check_hf_folder(tmp_path)
    assert "LlamaForCausalLM" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(TARGET_CFG))
    assert sc.check_hf_folder(tmp_path)["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        sc.check_hf_folder(tmp_path / "nothing")


def test_the_worker_binds_threads_and_preloads_intel_openmp(tmp_path):
    py = tmp_path / "v" / "bin" / "python"
    (tmp_path / "v" / "lib").mkdir(parents=True)
    (tmp_path / "v" / "lib" / "libiomp5.so").write_text("")
    env = sc.worker_env(1, py)
    assert env["OMP_NUM_THREADS"] == "1" and len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    assert str(tmp_path / "v" / "lib" / "libiomp5.so") in env["LD_PRELOAD"]
    assert "libiomp5" not in sc.worker_env(1, py, preload=False).get("LD_PRELOAD", "")


class _Metric:
    def __init__(self, name, value=None, values=None):
        self.name, self.value, self.values = name, value, values


def _fake_vllm(calls):
    """A stand-in `vllm` module: LLM echoes the prompt's last token + 1, counting drafts as a spec run would."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.0-fake"

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            calls.append(kw)
            self.spec = kw.get("speculative_config")
            self.drafts = self.accepted = 0

        def generate(self, prompts, params, use_tqdm=False):
            ids = prompts[0]["prompt_token_ids"]
            n = params.kw["max_tokens"]
            if self.spec:
                self.drafts += n
                self.accepted += n // 2
            out = types.SimpleNamespace(token_ids=[ids[-1] + 1 + i for i in range(n)])
            return [types.SimpleNamespace(outputs=[out])]

        def get_metrics(self):
            return [_Metric("vllm:spec_decode_num_drafts", self.drafts),
                    _Metric("vllm:spec_decode_num_draft_tokens", 3 * self.drafts),
                    _Metric("vllm:spec_decode_num_accepted_tokens", self.accepted),
                    _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[self.accepted, 0, 0]),
                    _Metric("vllm:generation_tokens", 1)]

    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    return mod


def test_the_worker_protocol_with_a_fake_vllm(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(calls))
    monkeypatch.delitem(sys.modules, "polybasic.serving.vllm_run", raising=False)
    from polybasic.serving import vllm_run

    req = {"model": "M", "prompts": [[5, 6], [9]], "max_new_tokens": 4, "stop_token_ids": [2], "dtype": "float32",
           "enforce_eager": True, "warmup": 1, "max_model_len": 64, "kv_cache_bytes": 1 << 20, "seed": 0,
           "speculative_config": {"method": "eagle3", "model": "D", "num_speculative_tokens": 3}}
    (tmp_path / "req.json").write_text(json.dumps(req))
    assert vllm_run.main([str(tmp_path / "req.json"), str(tmp_path / "res.json")]) == 0
    res = json.loads((tmp_path / "res.json").read_text())
    assert calls[0]["speculative_config"]["method"] == "eagle3" and calls[0]["disable_log_stats"] is False
    assert calls[0]["enable_prefix_caching"] is False and calls[0]["max_num_seqs"] == 1
    assert [r["tokens"] for r in res["runs"]] == [[7, 8, 9, 10], [10, 11, 12, 13]]
    # the counters of each timed prompt, the warm-up's left out
    assert [r["spec"]["num_drafts"] for r in res["runs"]] == [4, 4] and res["spec"]["num_accepted_tokens"] == 4
    assert res["spec"]["accepted_per_pos"] == [4, 0, 0] and res["vllm_version"] == "0.0-fake"
    assert vllm_run.main(["only-one"]) == 2


def test_our_side_runs_vanilla_and_the_chain_with_the_head_and_finds_the_gap(tmp_path):
    from polybasic.models.eagle_head import DrafterConfig, make_head

    torch.manual_seed(0)
    base = lean_from_hf(tiny_hf("llama", seed=3, vocab=128, init_std=0.2, layers=4))
    head = make_head(DrafterConfig.for_base(base.args, arch="eagle3", draft_vocab_size=0, feature_layers=[0, 1, 2]))
    head.init_output_from_base(base)
    lm = types.SimpleNamespace(model=base, tokenizer=word_tokenizer(128))
    plan = sc.Plan("tiny", "float32", None, tmp_path, None, 3, tmp_path, [], tmp_path)
    prompts = [(0, "a", [3, 4, 5, 6]), (1, "b", [7, 8, 9])]
    runs, tau, accept = sc.our_side(plan, lm, head.eval(), prompts, 12, warmup=1, progress=False)
    assert all(0 < len(r["tokens"]) <= 12 for r in runs[sc.OURS])
    assert [r["tokens"] for r in runs[sc.OURS_CHAIN]] == [r["tokens"] for r in runs[sc.OURS]]  # lossless
    assert tau >= 1.0 and accept >= 1.0
    counters = sc.our_counters(runs[sc.OURS_CHAIN])  # vLLM's definition: 1 + accepted / drafts
    assert counters["num_drafts"] > 0 and 1 + counters["num_accepted_tokens"] / counters["num_drafts"] == accept
    gap = sc.logit_gap(base, [3, 4, 5, 6], runs[sc.OURS][0]["tokens"][:2], *runs[sc.OURS][0]["tokens"][2:4])
    assert gap["top2"][0] == runs[sc.OURS][0]["tokens"][2] and gap["top2_gap"] >= 0 and gap["gap"] >= 0
    runs, tau, accept = sc.our_side(plan, lm, None, prompts, 4, warmup=0, progress=False)
    assert sc.OURS_CHAIN not in runs and tau is None


def test_a_bundle_names_the_target_the_speculators_folder_and_k(tmp_path, fake_python, capsys):
    """A bundle whose chain has an eagle3 head right under the target: serve-check serves its
    speculators/ folder on its target with its k, and our chain runs that very folder; a bundle with
    anything else right under the target is refused naming the level."""
    from polybasic.cli import build_parser
    from polybasic.models import load_model
    from polybasic.models.eagle_head import save_head
    from polybasic.runtime import bundle as B
    from polybasic.runtime.chainspec import parse_chain_spec
    from tests.helpers import tiny_hf_folder
    from tests.models.test_speculators_format import eagle3_head

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2, layers=3)
    lm = load_model(str(tmp_path / "m"))
    head = eagle3_head(lm.model, 16, layers=[1])
    save_head(tmp_path / "h.safetensors", head)
    folder = B.export_bundle(tmp_path / "bundle", str(tmp_path / "m"), "float32",
                             parse_chain_spec(f"eagle:{tmp_path}/h.safetensors"), B.Decoding(k=4), lm.tokenizer)
    args = build_parser().parse_args(["serve-check", str(folder), "--vllm-python", str(fake_python),
                                      "--categories", "writing"])
    plan = sc.validate(args)
    assert (plan.target, plan.k, plan.speculators, plan.head) == (str(tmp_path / "m"), 4, folder / "speculators", None)
    assert len(plan.questions) == 1
    ours, why = sc.load_our_head(plan, lm)
    assert why is None and all(torch.equal(ours.state_dict()[k], v) for k, v in head.state_dict().items())
    sc.check_against_target(sc.read_speculators_config(plan.speculators),
                            json.loads((tmp_path / "m" / "config.json").read_text()), "speculators")
    ngram = B.export_bundle(tmp_path / "ngram", str(tmp_path / "m"), "float32", parse_chain_spec("ngram"),
                            B.Decoding(k=4), lm.tokenizer)
    rc, err = serve_check(capsys, str(ngram), "--vllm-python", str(fake_python))
    assert rc == 2 and "the level right under the target is 'ngram'" in err


def test_a_failed_or_hung_vllm_run_names_its_log(tmp_path):
    from polybasic.errors import EngineError

    def plan_with(script: str):
        py = tmp_path / "bin" / "python"
        py.parent.mkdir(exist_ok=True)
        py.write_text("#!/bin/sh\n" + script)
        py.chmod(0o755)
        return sc.Plan("t", "float32", None, tmp_path, None, 3, py, [], tmp_path / "out")

    with pytest.raises(EngineError, match=r"(?s)vllm: the vllm run failed \(exit 1.*make vllm-check.*No module named"):
        sc.run_vllm(plan_with("echo 'No module named vllm'; exit 1\n"), "vllm", {"x": 1}, 1, 60)
    assert (tmp_path / "out" / "vllm.log").read_text().strip() == "No module named vllm"
    with pytest.raises(EngineError, match=r"timeout: vLLM's vllm-eagle3 run took more than 1 s .*--timeout"):
        sc.run_vllm(plan_with("sleep 30\n"), "vllm-eagle3", {"x": 1}, 1, 1)
