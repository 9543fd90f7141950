"""read_tensor_infos (a GGUF's tensors without building its metadata) finds what gguf's own reader
finds: names, block types, shapes and bytes, past metadata of every value type and a custom alignment."""
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from polybasic.models.gguf_index import read_tensor_infos


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_infos_equal_ggufs_reader(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.chat_template", "{{ messages }} é ü")  # multi-byte UTF-8
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0] * 40)
    w.add_array("nested", [[1, 2], [3]])
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("flag", True)
    w.add_uint64("big", 1 << 40)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("q8", quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q41", quantize(rng.standard_normal((2, 96)).astype(np.float32), Q.Q4_1), raw_dtype=Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = read_tensor_infos(path), GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in ref] == ["f32", "q8", "q41"]
    for a, b in zip(ours, ref):
        assert a.kind == b.tensor_type.name
        assert a.shape == tuple(int(s) for s in b.shape)
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensor_infos(path)
