"""``inspect --html`` and ``diff --html``: one self-contained page each, whose figures are
the ``--json`` document's, shown as text whatever the names hold; opened in a real browser.

The page tests parse the page as written; the browser tests (tests/browser.py, Debian's
``chromium``) open it, check that it rendered without an error and that the numbers in its
document once the scripts ran equal the ``--json`` figures, and take a screenshot.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import browser
import pytest
import torch

import fsdpckpt
from fsdpckpt._render import human_bytes

from conftest import FIXTURES, run_cli

ACCELERATE = FIXTURES / "fsdp2_accelerate"
LORA = FIXTURES / "hf_trainer_lora"
#: A name that would run, or break out of an attribute, were it not shown as text.
HOSTILE = ("<script>document.documentElement.setAttribute('data-pwned','1')</script>"
           "\"'><img src=x onerror=\"document.documentElement.setAttribute('data-pwned','2')\">")

needs_browser = pytest.mark.skipif(browser.chromium() is None,
                                   reason="needs chromium (apt-get install chromium; "
                                          ".ci/run does)")


def _inspect(path: Path, out: Path, *extra: object) -> dict:
    result = run_cli("inspect", path, "--json", "--html", out, *extra)
    assert result.exit_code in (0, 1), result.output
    assert out.is_file() and f"wrote {out}" in result.stderr
    return json.loads(result.stdout)


def _diff(a: Path, b: Path, out: Path) -> dict:
    result = run_cli("diff", a, b, "--json", "--html", out, "-q")
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def _value(text: str) -> float:
    return float(text)


def _inspect_figures(doc: dict) -> dict[str, dict[str, float]]:
    """What the inspect page must show, by ``data-kind``, from the --json document."""
    dtypes: Counter[str] = Counter()
    figures: dict[str, dict[str, float]] = {"part": {}}
    for part in doc["parts"]:
        if not part["complete"]:
            continue
        figures["part"][part["name"]] = part["bytes"]
        figures[f"file:{part['name']}"] = {f["name"]: f["size"] for f in part["files"]}
        for t in part["tensors"]:
            dtypes[t["dtype"]] += t["bytes"]
    figures["dtype"] = dict(dtypes)
    return figures


def _shown(elements, kind_prefix: str = "") -> dict[str, dict[str, float]]:
    shown: dict[str, dict[str, float]] = {}
    for e in elements:
        if "data-label" in e.attrs and e.attrs.get("data-kind", "").startswith(kind_prefix):
            shown.setdefault(e.attrs["data-kind"], {})[e.attrs["data-label"]] = \
                _value(e.attrs["data-value"])
    return shown


# -- the page as written ------------------------------------------------------------------


def test_an_inspect_page_carries_the_json_figures(tmp_path):
    doc = _inspect(ACCELERATE, tmp_path / "r.html")
    parsed = browser._Parser()
    parsed.feed((tmp_path / "r.html").read_text())
    assert _shown(parsed.result.elements) == _inspect_figures(doc)


def test_an_inspect_page_is_self_contained(tmp_path):
    _inspect(ACCELERATE, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "http://" not in page and "https://" not in page and " src=" not in page
    assert "default-src 'none'" in page  # nothing may be fetched, even if a name asked


def test_a_diff_page_carries_the_json_figures(tmp_path):
    doc = _diff(LORA / "base", LORA / "reference_fused.safetensors", tmp_path / "d.html")
    parsed = browser._Parser()
    parsed.feed((tmp_path / "d.html").read_text())
    rows = _table_rows(parsed.result.elements)
    assert set(rows) == {t["name"] for t in doc["tensors"]}
    for t in doc["tensors"]:
        assert rows[t["name"]] == (t["rel_change"], t["max_abs"])


def _table_rows(elements) -> dict[str, tuple[float, float]]:
    rows: dict[str, tuple[float, float]] = {}
    cells = [e for e in elements if e.tag == "td"]
    for i in range(0, len(cells), 8):  # name, dtype, shape, rel, max abs, max rel, n, verdict
        name, rel, biggest = cells[i], cells[i + 3], cells[i + 4]
        rows[name.attrs["data-value"]] = (_value(rel.attrs["data-value"]),
                                          _value(biggest.attrs["data-value"]))
    return rows


def test_a_diff_page_plots_a_line_per_module_kind_over_the_layers(tmp_path):
    from safetensors.torch import save_file

    a = {f"model.layers.{i}.{kind}.weight": torch.randn(4, 4)
         for i in range(4) for kind in ("self_attn.q_proj", "mlp.up_proj")}
    b = {k: v + 0.1 * i for i, (k, v) in enumerate(a.items())}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    doc = _diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "d.html")
    parsed = browser._Parser()
    parsed.feed((tmp_path / "d.html").read_text())
    lines = {e.attrs["data-series"]: [] for e in parsed.result.elements
             if "data-series" in e.attrs}
    assert set(lines) == {"q_proj", "up_proj"}
    circles = [e for e in parsed.result.elements if e.tag == "circle"]
    # One point per tensor on each of the two plots (relative change, max |a - b|).
    assert len(circles) == 2 * len(doc["tensors"])
    rel = {(int(e.attrs["data-x"]), float(e.attrs["data-value"])) for e in circles[:8]}
    assert rel == {(int(t["name"].split(".")[2]), t["rel_change"]) for t in doc["tensors"]}


def test_diff_json_has_the_relative_change_only_when_asked(tmp_path):
    a, b = LORA / "base", LORA / "reference_fused.safetensors"
    plain = json.loads(run_cli("diff", a, b, "--json", "-q").stdout)
    assert {t["rel_change"] for t in plain["tensors"]} == {None}
    asked = _diff(a, b, tmp_path / "d.html")
    moved = {t["name"]: t["rel_change"] for t in asked["tensors"] if t["rel_change"]}
    assert moved and all(".q_proj." in n or ".v_proj." in n for n in moved)  # LoRA's targets


def test_the_relative_change_is_the_norm_of_the_difference_over_the_norm_of_a(tmp_path):
    from safetensors.torch import save_file

    a = {"w": torch.randn(300, 7, dtype=torch.float64), "z": torch.zeros(3)}
    b = {"w": a["w"] + 1e-3 * torch.randn(300, 7, dtype=torch.float64), "z": torch.ones(3)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    report = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", norms=True)
    by_name = {t.name: t for t in report.tensors}
    want = float((a["w"] - b["w"]).norm() / a["w"].norm())
    assert math.isclose(by_name["w"].rel_change, want, rel_tol=1e-12)
    assert by_name["z"].rel_change == math.inf  # a was all zeros


@pytest.mark.parametrize("form", ["dcp", "safetensors", "bin"])
def test_the_relative_change_counts_the_tiles_that_are_the_same_on_both_sides(tmp_path, form):
    # 1.1M elements: three tiles of diff's 2**19, only the last one changed; ||a|| must
    # still sum all three.
    from safetensors.torch import save_file

    a = torch.randn(1100, 1000)
    b = a.clone()
    b[-50:] += 1.0
    paths = []
    for name, value in (("a", a), ("b", b)):
        if form == "dcp":
            model = torch.nn.Linear(1000, 1100, bias=False)
            model.weight.data.copy_(value)
            fsdpckpt.save_state(tmp_path / name, model)
            paths.append(tmp_path / name)
        elif form == "bin":  # read box by box through torch's loader, not in tiles
            torch.save({"weight": value}, tmp_path / f"{name}.bin")
            paths.append(tmp_path / f"{name}.bin")
        else:
            save_file({"weight": value}, str(tmp_path / f"{name}.safetensors"))
            paths.append(tmp_path / f"{name}.safetensors")
    (t,) = fsdpckpt.diff(*paths, norms=True).tensors
    want = float((a.double() - b.double()).norm() / a.double().norm())
    assert math.isclose(t.rel_change, want, rel_tol=1e-9)


def test_a_report_over_a_folder_is_refused_naming_it(tmp_path):
    result = run_cli("inspect", ACCELERATE, "--html", tmp_path)
    assert result.exit_code == 1
    assert "is a folder" in result.stderr and str(tmp_path) in result.stderr


def _hostile_checkpoint(tmp_path: Path, value: float) -> Path:
    """A DCP folder (torch's own writer) whose tensor name is :data:`HOSTILE`."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / f"hostile{value}"
    dcp.save({HOSTILE: torch.full((4,), 1.0), "layers.0.x": torch.full((4,), value)},
             checkpoint_id=str(folder))
    return folder


def test_a_hostile_name_is_text_on_both_pages(tmp_path):
    a, b = _hostile_checkpoint(tmp_path, 1.0), _hostile_checkpoint(tmp_path, 2.0)
    _inspect(a, tmp_path / "i.html")
    _diff(a, b, tmp_path / "d.html")
    for page in ("i.html", "d.html"):
        written = (tmp_path / page).read_text()
        assert written.count("<script>") == 1, page  # the page's own, and no other
        assert "<img" not in written and "&lt;script&gt;" in written


# -- in a real browser --------------------------------------------------------------------


@needs_browser
def test_the_inspect_page_renders_and_shows_the_json_figures(tmp_path):
    doc = _inspect(ACCELERATE, tmp_path / "r.html")
    seen = browser.render(tmp_path / "r.html")
    assert seen.root.get("data-ready") == "1" and "data-error" not in seen.root
    assert _shown(seen.elements) == _inspect_figures(doc)
    cells = [float(e.attrs["data-value"]) for e in seen.having("class", "cell")]
    stored = sum(c["length"] for p in doc["parts"] for t in p["tensors"] for c in t["chunks"])
    assert cells and sum(cells) == stored  # the shard map accounts for every chunk's bytes
    shot = browser.screenshot(tmp_path / "r.html", tmp_path / "r.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@needs_browser
def test_problems_are_shown_in_the_text_outputs_words(tmp_path):
    damaged = tmp_path / "ckpt"
    shutil.copytree(ACCELERATE, damaged)
    (damaged / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()
    doc = _inspect(damaged, tmp_path / "r.html")
    seen = browser.render(tmp_path / "r.html")
    assert seen.root.get("data-ready") == "1"
    shown = [e.text for e in seen.having("data-kind", "problem")]
    assert shown and shown == [f"{p['path']}: {p['message']}" for p in doc["problems"]]


@needs_browser
def test_the_diff_page_renders_sorts_and_shows_the_json_figures(tmp_path):
    doc = _diff(LORA / "base", LORA / "reference_fused.safetensors", tmp_path / "d.html")
    seen = browser.render(tmp_path / "d.html")
    assert seen.root.get("data-ready") == "1" and "data-error" not in seen.root
    rows = _table_rows(seen.elements)
    assert rows == {t["name"]: (t["rel_change"], t["max_abs"]) for t in doc["tensors"]}
    # One layer: a bar per module kind (a line per kind from three layers on).
    plotted = {float(e.attrs["data-value"]) for e in seen.elements
               if (e.tag == "circle" or e.attrs.get("data-kind") == "relative change")
               and e.attrs.get("data-value")}
    assert {t["rel_change"] for t in doc["tensors"] if ".layers." in t["name"]} == plotted


@needs_browser
def test_a_hostile_name_never_runs_in_the_browser(tmp_path):
    a, b = _hostile_checkpoint(tmp_path, 1.0), _hostile_checkpoint(tmp_path, 2.0)
    _inspect(a, tmp_path / "i.html")
    _diff(a, b, tmp_path / "d.html")
    for page in ("i.html", "d.html"):
        seen = browser.render(tmp_path / page)
        assert seen.root.get("data-ready") == "1" and "data-pwned" not in seen.root, page
        assert any(HOSTILE in e.text for e in seen.elements), page  # shown, as text


# -- what the inspect page flags, and its table of tensors --------------------------------


def _flagged(elements) -> list[str]:
    """The texts the page calls for attention with: problems and notes."""
    return [e.text for e in elements
            if set(e.attrs.get("class", "").split()) & {"problem", "note"}]


def _parsed(page: Path) -> browser.Rendered:
    parser = browser._Parser()
    parser.feed(page.read_text())
    return parser.result


def test_the_inspect_page_of_a_healthy_checkpoint_flags_nothing(tmp_path):
    # Its optimizer's rank files differ by 2x (one holds the param groups): what DCP stores.
    _inspect(ACCELERATE, tmp_path / "r.html")
    assert _flagged(_parsed(tmp_path / "r.html").elements) == []


def test_a_truncated_rank_file_is_the_one_thing_the_inspect_page_flags(tmp_path):
    damaged = Path(shutil.copytree(ACCELERATE, tmp_path / "ckpt"))
    rank_file = damaged / "pytorch_model_fsdp_0" / "__1_0.distcp"
    rank_file.write_bytes(rank_file.read_bytes()[:4000])
    doc = _inspect(damaged, tmp_path / "r.html")
    assert doc["problems"] and all("truncated" in p["message"] for p in doc["problems"])
    flagged = _flagged(_parsed(tmp_path / "r.html").elements)
    assert flagged == [f"{p['path']}: {p['message']}" for p in doc["problems"]]


def _tensor_rows(elements, part: str, *, hidden: bool = True) -> list[list[str]]:
    """The rows of ``part``'s table of tensors, each cell's text; ``hidden=False``: only the
    rows the page's script did not hide."""
    rows: list[list[str]] = []
    inside, shown = False, True
    for e in elements:
        if e.tag == "table":
            inside = e.attrs.get("data-kind") == f"tensors:{part}"
        elif inside and e.tag == "tr":
            shown = hidden or "hidden" not in e.attrs
            rows.append([])
        elif inside and e.tag == "td" and shown:
            rows[-1].append(e.text)
    return [r for r in rows if r]  # the header row has no <td>


def _text_order(path, part_names) -> list[str]:
    """The tensor names of inspect's text output, in its order, that are in ``part_names``."""
    lines = [line.split() for line in run_cli("inspect", path).stdout.splitlines()]
    return [w[0] for w in lines if w and w[0] in part_names]


def test_the_inspect_page_lists_every_tensor_as_the_text_output_does(tmp_path):
    doc = _inspect(ACCELERATE, tmp_path / "r.html")
    elements = _parsed(tmp_path / "r.html").elements
    for part in doc["parts"]:
        row = {t["name"]: [t["name"], t["dtype"], str(t["shape"]), str(len(t["chunks"])),
                           t["sharding"], human_bytes(t["bytes"])] for t in part["tensors"]}
        assert _tensor_rows(elements, part["name"]) == [
            row[n] for n in _text_order(ACCELERATE, row)], part["name"]


def test_inspect_lists_an_optimizers_state_grouped_per_parameter(tmp_path):
    doc = _inspect(ACCELERATE, tmp_path / "r.html")
    stored = [t["name"] for t in doc["parts"][1]["tensors"]]
    names = _text_order(ACCELERATE, stored)
    assert [n.split("state.", 1)[1] for n in names] == [
        f"{p}.{k}" for p in ("0.bias", "0.weight", "2.bias", "2.weight")
        for k in ("exp_avg", "exp_avg_sq", "step")]
    # The page lists them in the same order; --json keeps the .metadata's (test_reader).
    rows = _tensor_rows(_parsed(tmp_path / "r.html").elements, "optimizer_0")
    assert [r[0] for r in rows] == names
    assert sorted(stored) == sorted(names) and stored != names


def test_inspect_orders_numbered_layers_by_number(tmp_path):
    import torch.distributed.checkpoint as dcp

    stored = [f"layers.{i}.w" for i in (10, 2, 1, 0)]
    dcp.save({n: torch.zeros(2) for n in stored}, checkpoint_id=str(tmp_path / "c"))
    names = _text_order(tmp_path / "c", stored)
    assert names == [f"layers.{i}.w" for i in (0, 1, 2, 10)]


def test_an_inspect_page_of_100000_tensors_stays_small_and_says_what_it_left_out(tmp_path):
    from safetensors.torch import save_file

    from fsdpckpt.inspection.html_inspect import MAX_TENSOR_ROWS

    save_file({f"model.layers.{i}.w": torch.zeros(1) for i in range(100_000)},
              str(tmp_path / "big.safetensors"))
    result = run_cli("inspect", tmp_path / "big.safetensors", "--summary", "--html",
                     tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    page = tmp_path / "r.html"
    assert page.stat().st_size < 5_000_000
    elements = _parsed(page).elements
    rows = _tensor_rows(elements, "big.safetensors")
    assert [r[0] for r in rows] == [f"model.layers.{i}.w" for i in range(MAX_TENSOR_ROWS)]
    said = " ".join(e.text for e in elements if e.tag == "p")
    assert f"{100_000 - MAX_TENSOR_ROWS:,} more tensors" in said and "--json" in said


@needs_browser
def test_the_search_box_of_the_inspect_page_filters_its_tensors_by_name(tmp_path):
    doc = _inspect(ACCELERATE, tmp_path / "r.html")
    seen = browser.render(tmp_path / "r.html", fragment="q=bias.exp_avg")
    assert seen.root.get("data-ready") == "1" and "data-error" not in seen.root
    for part in doc["parts"]:
        names = _text_order(ACCELERATE, [t["name"] for t in part["tensors"]])
        shown = [r[0] for r in _tensor_rows(seen.elements, part["name"], hidden=False)]
        assert shown == [n for n in names if "bias.exp_avg" in n], part["name"]
    unfiltered = browser.render(tmp_path / "r.html")
    assert [r[0] for r in _tensor_rows(unfiltered.elements, "optimizer_0", hidden=False)] == \
        _text_order(ACCELERATE, [t["name"] for t in doc["parts"][1]["tensors"]])

