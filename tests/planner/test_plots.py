"""Profile pictures: the cost curves and acceptance PNGs, and the plan stage that writes them beside plan.md."""
from types import SimpleNamespace

import pytest
from PIL import Image

from polybasic.config import PlanSection
from polybasic.pipelines.plan import run_stage
from polybasic.planner.plots import plot_acceptance, plot_cost_curves
from polybasic.planner.profile import PairProfile, Profile
from tests.planner.test_search import synthetic

PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    """A complete PNG of non-zero size, no temp left beside it."""
    assert path.read_bytes()[:8] == PNG, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        im.load()  # verify() checks chunks; load() decodes every row (a truncated file fails)
        assert im.width > 0 and im.height > 0
    assert not list(path.parent.glob(".*.partial"))


def test_assert_png_rejects_broken_files(tmp_path):
    good = plot_cost_curves(synthetic(), tmp_path / "c.png")
    assert_png(good)
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    for bad in (tmp_path / "missing.png", cut):
        with pytest.raises(Exception):
            assert_png(bad)


def test_cost_curves_and_acceptance(tmp_path):
    prof = synthetic()
    assert plot_cost_curves(prof, tmp_path / "cost.png") == tmp_path / "cost.png"
    assert plot_acceptance(prof, tmp_path / "acc.png") == tmp_path / "acc.png"
    for name in ("cost.png", "acc.png"):
        assert_png(tmp_path / name)


def test_acceptance_without_histograms_or_pairs(tmp_path):
    prof = synthetic()
    prof.pairs.append(PairProfile("target", "s", k=3, verifications=0, mean_accepted_length=1.0, rate=0.0))
    assert_png(plot_acceptance(prof, tmp_path / "some.png"))  # one pair has no histogram
    bare = Profile("target", prof.levels, [], device="cpu")
    assert_png(plot_acceptance(bare, tmp_path / "none.png"))


def test_plan_stage_writes_pictures_beside_plan_md(tmp_path):
    synthetic().save(tmp_path / "profile.json")
    ctx = SimpleNamespace(out=tmp_path, recipe=SimpleNamespace(plan=PlanSection(k_values=[3], thresholds=[4],
                                                                                 max_levels=3)))
    outputs = run_stage(ctx)
    assert {p.name for p in outputs} == {"plan.json", "plan.md", "cost_curves.png", "acceptance.png"}
    md = (tmp_path / "plan.md").read_text()
    assert "![cost curves](cost_curves.png)" in md and "![acceptance](acceptance.png)" in md
    for name in ("cost_curves.png", "acceptance.png"):
        assert_png(tmp_path / name)
