import pytest
import torch

import polybasic.models.static as static
from tests.devices import DEVICES

# Tiny models gain nothing from intra-op threads, and on a 2-core machine an OpenMP barrier that
# waits for a busy core costs ~10 ms per op; one thread keeps the suite fast and stable.
torch.set_num_threads(1)

# Compiled steps: tests compile three sizes (1, 4, and prefill chunks of 8) instead of the product's seven
# (three on CUDA), so a model compiles 4 graphs, not 8; every code path (padding, chunks, one-row logits)
# still runs.
static.STEP_SIZES = static.CUDA_STEP_SIZES = (1, 4, 8)


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """Every device a test should run on: the CPU, and CUDA where available (gpu marker)."""
    return request.param


# markers whose tests run only when selected by name (`-m big`, `-m vllm`), never in the default run
OPT_IN = {
    "big": "real-model test: run with `make test-big` (pytest -m big)",  # multi-GB Qwen2.5-Coder wheels
    "vllm": "real vLLM engine: run with `make vllm-check` (pytest -m vllm)",  # its own venv, .venv-vllm
}


def pytest_collection_modifyitems(config, items):
    """Skip the OPT_IN markers' tests unless the -m expression names that marker, so neither CI nor
    `-m 'not model'` ever downloads the big models or starts vLLM."""
    for marker, reason in OPT_IN.items():
        if marker in (config.option.markexpr or ""):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
