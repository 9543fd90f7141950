"""The bench picture: speedup per category and method, written beside report.md."""
from polybasic.bench.plots import plot_speedup
from polybasic.bench.report import write_outputs
from tests.bench.test_report import chain_doc, doc
from tests.planner.test_plots import assert_png


def test_plot_speedup(tmp_path):
    d = chain_doc()
    d["machine"]["gpu"] = "NVIDIA H100"
    assert plot_speedup(d, tmp_path / "s.png") == tmp_path / "s.png"
    assert_png(tmp_path / "s.png")


def test_plot_speedup_with_missing_values(tmp_path):
    d = doc()
    d["methods"]["pld"]["per_category"]["qa"]["speedup"] = None
    d["methods"]["pld"]["speedup"] = None
    assert_png(plot_speedup(d, tmp_path / "s.png"))
    assert_png(plot_speedup({"machine": {}, "methods": {}}, tmp_path / "empty.png"))


def test_write_outputs_adds_the_picture(tmp_path):
    write_outputs(chain_doc(), None, tmp_path / "rep")
    assert "![speedup per category](speedup.png)" in (tmp_path / "rep" / "report.md").read_text()
    assert_png(tmp_path / "rep" / "speedup.png")

