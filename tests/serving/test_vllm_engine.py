"""The real vLLM engine (marker vllm: `make vllm-check`, never in the default run; 6 to 9 min on 2 cores)
serving SmolLM2-135M with an EAGLE-3 head through `polybasic serve-check`, one request at a time:
vLLM's eagle3 output identical to its vanilla, its acceptance length beside ours for the same head and
k, and the JSON summary written. The heads are rigs whose acceptance follows from the output alone: a
zero LM head drafts the first token of the draft vocabulary, " the" (id 260), every time, so both
engines accept exactly where the target says " the" next. Two of them: ours (exported by
save_speculators) and one built and saved by the speculators library itself
(tests/serving/make_eagle3_draft.py), which our loader reads too. These tests run in polybasic's venv;
vLLM runs in .venv-vllm's python (subprocesses)."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from polybasic.cli import main
from polybasic.serving.check import default_vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.model]
HERE = Path(__file__).resolve().parent
THE = 260  # " the": about 7% of SmolLM2's answer tokens
ARGS = ["--enforce-eager", "--max-new-tokens", "32", "--categories", "writing,coding", "--threads", "2",
        "--no-progress", "--k", "3"]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    py = default_vllm_python()
    if not py.exists():
        pytest.skip(f"{py} does not exist: run `make vllm-check` (it creates .venv-vllm)")
    return py


@pytest.fixture(scope="module")
def smollm2():
    from polybasic.models import load_model

    return load_model("smollm2-135m")


def _summary(tmp_path, *extra) -> dict:
    rc = main(["serve-check", "--model", "smollm2-135m", *ARGS, "--out", str(tmp_path / "out"), *extra])
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert rc == (1 if any(v is False for v in doc["checks"].values()) else 0)
    assert (tmp_path / "out" / "report.md").read_text().startswith("# serve-check")
    return doc


def test_vllm_serves_our_exported_eagle3_head_as_its_own_vanilla(tmp_path, vllm_python, smollm2):
    from polybasic.models.eagle_head import DrafterConfig, eagle3_layers, make_head
    from polybasic.models.speculators_format import save_speculators

    base = smollm2.model
    torch.manual_seed(0)
    head = make_head(DrafterConfig.for_base(base.args, arch="eagle3", draft_vocab_size=8192,
                                            feature_layers=eagle3_layers(base.args.n_layers)))
    head.set_draft_vocab(torch.arange(THE, THE + 8192))
    head.init_output_from_base(base)
    with torch.no_grad():
        head.lm_head.weight.zero_()  # every draft token: draft id 0, " the"
    save_speculators(head, tmp_path / "spec", str(smollm2.hf_folder), k=3)
    doc = _summary(tmp_path, "--speculators", str(tmp_path / "spec"))
    assert doc["prompts"] == 2 and set(doc["tokens_per_s"]) == {"ours", "ours-eagle3", "vllm", "vllm-eagle3"}
    assert doc["identical"]["vllm-eagle3 vs vllm"] == 2 and doc["identical"]["ours-eagle3 vs ours"] == 2
    _same_acceptance(doc)
    for d in doc["differences"]:  # vLLM against our kernels: any difference comes with our target's gap there
        assert d["gap"] is not None or None in d["tokens"]


def test_a_head_saved_by_speculators_itself_is_served_and_read_by_our_loader(tmp_path, vllm_python, smollm2):
    subprocess.run([str(vllm_python), str(HERE / "make_eagle3_draft.py"), str(smollm2.hf_folder),
                    str(tmp_path / "spec"), "--first-id", str(THE), "--constant"], check=True, capture_output=True,
                   timeout=600)
    doc = _summary(tmp_path, "--speculators", str(tmp_path / "spec"))
    assert doc["identical"]["vllm-eagle3 vs vllm"] == 2
    assert doc["config"]["our_chain_skipped"] is None and doc["identical"]["ours-eagle3 vs ours"] == 2
    _same_acceptance(doc)


def _same_acceptance(doc):
    """Some drafts accepted (" the" follows now and then), and as many by vLLM as by our chain."""
    assert doc["vllm_spec_counters"]["num_drafts"] > 0 and doc["vllm_acceptance"] > 1.0, doc
    assert doc["our_accept_len"] > 1.0
    # the same output, the same drafts: exactly the same tokens accepted
    assert doc["our_spec_counters"]["num_accepted_tokens"] == doc["vllm_spec_counters"]["num_accepted_tokens"]
    assert doc["checks"]["acceptance_within_10pct_of_our_accept_len"] is True, doc
