"""The profile stage's cached measurements are keyed by the files a level spelling names."""
import os

from polybasic.pipelines.profile import _files, _key


def test_a_rewritten_level_file_is_measured_again(tmp_path):
    copy, head = tmp_path / "model.safetensors", tmp_path / "head.safetensors"
    copy.write_bytes(b"a" * 10)
    head.write_bytes(b"h")
    spelling = f"{copy}+eagle:{head}"
    ids = _files(spelling)
    assert [p for p, *_ in ids] == sorted([str(copy), str(head)])
    before = _key(spelling, ids)
    assert _key(spelling, _files(spelling)) == before  # unchanged files: the cache is reused
    copy.write_bytes(b"b" * 11)  # re-quantized in place
    os.utime(copy, ns=(1, 1))
    assert _key(spelling, _files(spelling)) != before
    assert _files("target") == [] and _files("ngram:3") == []  # no files: the spelling alone
