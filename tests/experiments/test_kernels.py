"""`python -m experiments.kernels`: one model's verification cost in several numerics."""
import json

from experiments import kernels
from tests.helpers import tiny_hf_folder


def test_kernel_table_marks_the_fastest_per_m(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2)
    rc = kernels.main(["--model", str(tmp_path / "tiny"), "--kernels", "float32,bfloat16", "--tokens", "1,3",
                       "--context", "8", "--reps", "1", "--json", str(tmp_path / "k.json")])
    assert rc == 0
    data = json.loads((tmp_path / "k.json").read_text())
    assert list(data["curves"]) == ["float32", "bfloat16"]
    for c in data["curves"].values():
        assert c["tokens"] == [1, 3] and len(c["ms"]) == 2 and all(x > 0 for x in c["ms"] + [c["step_ms"]])
    table = capsys.readouterr().out
    assert "| kernel | step | M=1 | M=3 | prefill 8 |" in table
    for i, t in enumerate((1, 3)):  # exactly the fastest kernel's cell is bold in each M column
        best = min(c["ms"][i] for c in data["curves"].values())
        assert table.count(f"**{best}**") >= 1


def test_bad_kernel_is_a_clear_error(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2)
    assert kernels.main(["--model", str(tmp_path / "tiny"), "--kernels", "float31", "--tokens", "1",
                         "--context", "8", "--reps", "1"]) == 2
    assert "float31" in capsys.readouterr().err


def test_unknown_kernel_mode_names_the_flag(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2)
    assert kernels.main(["--model", str(tmp_path / "tiny"), "--kernels", "float32-fast", "--tokens", "1",
                         "--context", "8", "--reps", "1"]) == 2
    assert "--kernels" in capsys.readouterr().err
