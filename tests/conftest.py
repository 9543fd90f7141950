import pytest
import torch

from tests.devices import DEVICES

# Tiny models gain nothing from intra-op threads, and on a 2-core machine an OpenMP barrier that
# waits for a busy core costs ~10 ms per op; one thread keeps the suite fast and stable.
torch.set_num_threads(1)


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """Every device a test should run on: the CPU, and CUDA where available (gpu marker)."""
    return request.param
