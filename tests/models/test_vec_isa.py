"""trust_probed_vec_isa: inductor's vector ISA probes are skipped only where they all passed before, and the ISA
inductor then picks is the one it picks after probing."""
import platform

import pytest
from torch._inductor import config, cpu_vec_isa

from polybasic.models import native

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 probes only")


@pytest.fixture
def fresh():
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    with config.patch({"cpp.vec_isa_ok": None}):  # restored after the test
        yield
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_marker_written_once_then_no_probe(tmp_path, monkeypatch, fresh):
    calls = []
    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", lambda: calls.append(1) or True)
    assert native.trust_probed_vec_isa(tmp_path) is True
    assert config.cpp.vec_isa_ok is True and len(calls) == 1
    assert len(list(tmp_path.glob("vec-isa-*.ok"))) == 1
    config.cpp.vec_isa_ok = None  # a new process
    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", lambda: pytest.fail("probed despite the marker"))
    assert native.trust_probed_vec_isa(tmp_path) is True
    assert config.cpp.vec_isa_ok is True


def test_failed_probe_keeps_probing(tmp_path, monkeypatch, fresh):
    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", lambda: False)
    assert native.trust_probed_vec_isa(tmp_path) is False
    assert config.cpp.vec_isa_ok is None
    assert not list(tmp_path.glob("*"))


def test_another_torchs_internals_keep_probing(tmp_path, monkeypatch, fresh):
    def moved():
        raise AttributeError("module 'torch._inductor.cpu_vec_isa' has no attribute 'x86_isa_checker'")

    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", moved)
    assert native.trust_probed_vec_isa(tmp_path) is False
    assert config.cpp.vec_isa_ok is None and not list(tmp_path.glob("*"))


def test_marker_keyed_by_cpu_flags(tmp_path, monkeypatch, fresh):
    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", lambda: True)
    native.trust_probed_vec_isa(tmp_path)
    config.cpp.vec_isa_ok = None
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : fpu sse2")  # another CPU
    native.trust_probed_vec_isa(tmp_path)
    assert len(list(tmp_path.glob("vec-isa-*.ok"))) == 2


def test_user_setting_left_alone(tmp_path, monkeypatch, fresh):
    config.cpp.vec_isa_ok = False
    monkeypatch.setattr(native, "_every_vec_isa_probe_passes", lambda: pytest.fail("probed"))
    assert native.trust_probed_vec_isa(tmp_path) is False
    assert config.cpp.vec_isa_ok is False and not list(tmp_path.glob("*"))


def test_trusted_pick_is_the_probed_pick(tmp_path, fresh, monkeypatch):
    """On the CPU at hand: the ISA inductor picks without probing equals the one it picks after its probes."""
    probed = str(cpu_vec_isa.pick_vec_isa())
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if not native.trust_probed_vec_isa(tmp_path):
        pytest.skip("a vector ISA probe fails on this machine: inductor keeps probing")
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    assert str(cpu_vec_isa.pick_vec_isa()) == probed
