import pytest


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' Arrow cache in a tmp folder (local parquet / csv files are prepared there)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    return tmp_path / "hf-datasets"
