import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked `big` (real multi-GB models) run only when selected with `-m big` (make test-big),
    so neither CI nor `-m 'not model'` ever downloads or loads them."""
    if "big" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="real-model test: run with `make test-big` (pytest -m big)")
    for item in items:
        if item.get_closest_marker("big") is not None:
            item.add_marker(skip)
