"""`python -m experiments.speed_states`: copies of one target decode the same tokens, one of them in 2 MB pages."""
import copy

import torch

from experiments import speed_states
from tests.helpers import tiny_hf_folder


def test_hugepage_copy_moves_every_tensor_and_keeps_outputs_and_sharing():
    lin = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(lin, torch.nn.Linear(8, 8))
    model[1].weight = lin.weight  # shared storage stays shared
    model.register_buffer("scale", torch.tensor([2.0]))
    x = torch.randn(3, 8)
    want = model(x)
    moved = speed_states.hugepage_copy(copy.deepcopy(model))
    assert torch.equal(moved(x), want) and moved[1].weight is moved[0].weight
    ptrs = [t.data_ptr() for t in [*moved.parameters(), *moved.buffers()]]
    assert min(ptrs) % (2 << 20) == 0 and max(ptrs) - min(ptrs) < (2 << 20)  # one aligned arena
    assert not any(p == q.data_ptr() for p in ptrs for q in [*model.parameters(), *model.buffers()])


def test_rounds_print_every_copy_and_its_ratio(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2, init_std=0.2)
    speed_states.main(["--model", str(tmp_path / "tiny"), "--dtype", "float32", "--rounds", "2", "--tokens", "4",
                       "--hugepages"])  # asserts every copy's tokens equal the first's
    out = capsys.readouterr().out
    assert out.count("round ") == 2 and "huge" in out.splitlines()[0]
    assert all(f"{name} " in out and "median" in out for name in ("loaded", "copy1", "copy2", "huge"))
