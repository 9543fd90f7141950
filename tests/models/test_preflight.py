"""Header checks of weight files, and the loaders' errors on damaged files (library boundary)."""
import pytest
import torch
from safetensors.torch import save_file

from polybasic.errors import ConfigError, CorruptFileError, ModelNotFoundError
from polybasic.models.preflight import check_gguf, check_source, safetensors_header, source_kind

FIX = "get a good copy"


@pytest.fixture
def st(tmp_path):
    """A valid safetensors file of two tensors."""
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.zeros(4, 6), "b": torch.ones(3)}, str(path), metadata={"format": "pt"})
    return path


def test_header_of_a_good_file(st):
    h = safetensors_header(st, FIX)
    assert h["__metadata__"] == {"format": "pt"} and h["a"]["shape"] == [4, 6] and h["b"]["dtype"] == "F32"


def _variant(st, how: str):
    data = st.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return {"trunc": data[:-5], "short": data[:5], "rand": bytes(range(200, 256)) * 20,
            "extra": data + b"\0" * 3,
            "notjson": data[:8] + b"{" * n + data[8 + n:],
            "reshaped": data.replace(b"[4,6]", b"[4,7]")}[how]


@pytest.mark.parametrize("how, words", [
    ("trunc", "truncated: its header says the file has"),
    ("short", "not a safetensors file or truncated"),
    ("rand", "not a safetensors file or truncated: its first 8 bytes give a header of"),
    ("extra", "damaged: its header says the file has"),
    ("notjson", "its header is not a JSON table"),
])
def test_damaged_headers(st, tmp_path, how, words):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_variant(st, how))
    with pytest.raises(CorruptFileError) as e:
        safetensors_header(bad, FIX)
    assert str(e.value).startswith(f"{bad}: ") and words in str(e.value) and str(e.value).endswith(FIX)


def test_gguf_magic(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGML" + b"\0" * 20)
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(CorruptFileError, match="not a GGUF file"):
        check_gguf(tmp_path / "a.gguf", FIX)
    with pytest.raises(CorruptFileError, match="truncated: 4 bytes"):
        check_gguf(tmp_path / "b.gguf", FIX)


def test_source_kinds(tmp_path, st):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text("{}")
    (tmp_path / "g.gguf").write_bytes(b"GGUF\3\0\0\0")
    assert [source_kind(s) for s in ("smollm2-135m", str(st), str(tmp_path / "g.gguf"), str(tmp_path / "f"),
                                     "owner/name")] == ["registry", "quantized", "gguf", "folder", "hub"]
    with pytest.raises(ModelNotFoundError, match="^--model: 'x/y/z' is not a known name"):
        source_kind("x/y/z", "--model")
    with pytest.raises(ConfigError, match="^--model: .*not a polybasic quantized copy"):
        check_source(str(st), "--model")  # a plain safetensors file is no quantized copy


def test_loaders_name_the_damaged_file(tmp_path, st):
    """read_state_dict, quant_header / load_quantized and load_head turn the library's errors into
    CorruptFileError naming the file and the fix, even where no pre-check ran."""
    from polybasic.models.eagle_head import load_head
    from polybasic.models.loader import read_state_dict
    from polybasic.quant.api import load_quantized, quant_header

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(_variant(st, "reshaped"))  # header passes, tensor does not
    with pytest.raises(CorruptFileError) as e:
        read_state_dict(folder)
    assert str(e.value).startswith(f"{folder / 'model.safetensors'}: cannot be read as safetensors (")
    assert "download or save the model folder again" in str(e.value)
    (folder / "model.safetensors").write_bytes(_variant(st, "trunc"))
    with pytest.raises(CorruptFileError, match="truncated"):
        read_state_dict(folder)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_variant(st, "rand"))
    for load, fix in ((quant_header, "polybasic quantize"), (lambda p: load_quantized(p, None), "polybasic quantize"),
                      (load_head, "polybasic distill")):
        with pytest.raises(CorruptFileError) as e:
            load(bad)
        assert str(e.value).startswith(f"{bad}: not a safetensors file") and fix in str(e.value)


def test_header_json_is_what_safetensors_reads(st):
    """The header reader agrees with safetensors' own view of the file."""
    from safetensors import safe_open

    h = safetensors_header(st, FIX)
    with safe_open(str(st), "pt") as f:
        assert f.metadata() == h["__metadata__"] and sorted(f.keys()) == sorted(k for k in h if k != "__metadata__")
