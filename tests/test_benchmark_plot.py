"""docs/benchmarks.png shows every tool's line (issue 33): fsdpckpt's runs on cp -r's, so
the two are drawn apart (style, width, order), and the plot is drawn from the figures the
page's tables give."""

from __future__ import annotations

import importlib.util
import json
import re

from conftest import ROOT


def _merge_benchmark():
    spec = importlib.util.spec_from_file_location("merge_benchmark",
                                                  ROOT / "benchmarks" / "merge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdpckpt_is_drawn_on_top_of_cp_r_in_another_style():
    styles = _merge_benchmark()._STYLES
    ours, floor = styles["fsdpckpt merge-weights"], styles["cp -r"]
    assert ours["zorder"] > floor["zorder"]
    assert ours.get("linestyle", "-") != floor["linestyle"]
    assert ours["marker"] != floor["marker"] and floor["linewidth"] > ours["linewidth"]
    assert set(styles) == set(json.loads((ROOT / "benchmarks" / "merge_figures.json")
                                         .read_text())["1.6"])


def test_the_plotted_figures_are_the_pages_tables():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    figures = json.loads((ROOT / "benchmarks" / "merge_figures.json").read_text())
    ours = [float(x) for x in re.findall(r"\| `fsdpckpt merge-weights` \| \*\*([\d.]+)\*\*", page)]
    assert ours == [figures["1.6"]["fsdpckpt merge-weights"]["seconds"],
                    figures["6.4"]["fsdpckpt merge-weights"]["seconds"]]
