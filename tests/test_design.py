"""docs/design.md matches the tree: every module is on the page, every module the page names
exists, and the read side keeps its promise not to import torch or reach up the layers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdpckpt"
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _modules() -> list[Path]:
    # A subpackage's __init__.py is its docstring (the map's row says the same), except
    # where it holds code (formats/).
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" or p.parent in (PACKAGE, PACKAGE / "formats"))


def _named_on_the_page() -> set[str]:
    """Module files the map names, as paths relative to fsdpckpt/."""
    names = set()
    for row in DESIGN.splitlines():
        match = re.match(r"\| `fsdpckpt/([a-z_/]*)` \|", row)
        if match:
            folder = match.group(1)
            names |= {folder + m for m in re.findall(r"`([a-z_]+\.py)`", row)}
    return names


@pytest.mark.parametrize("module", [str(m) for m in _modules()])
def test_every_module_in_the_tree_is_on_the_design_page(module):
    assert module in _named_on_the_page(), f"docs/design.md's module map lacks {module}"


def test_every_module_the_design_page_names_exists():
    missing = sorted(m for m in _named_on_the_page() if not (PACKAGE / m).is_file())
    assert not missing, f"docs/design.md names modules that do not exist: {missing}"
    for path in re.findall(r"`(?:fsdpckpt/)?([a-z_]+/[a-z_]+\.py)(?:::\w+)?`", DESIGN):
        assert (PACKAGE / path).is_file() or (ROOT / path).is_file(), \
            f"docs/design.md names {path}"


_LAYERS = {"_io": {"_io"}, "dcp": {"_io", "dcp"}, "formats": {"_io", "dcp", "formats"}}
_LEAVES = {"errors", "_printable", "_progress", "_torch"}


def _imports(path: Path) -> set[str]:
    """The fsdpckpt subpackages and top-level modules ``path`` imports at module level."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("fsdpckpt"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("fsdpckpt.")}
    return found


@pytest.mark.parametrize("package", sorted(_LAYERS))
def test_lower_layers_import_only_what_is_below_them(package):
    allowed = _LAYERS[package] | _LEAVES | {"__version__"}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        extra = _imports(path) - allowed
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)} at module level"


def test_nothing_imports_the_cli():
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("cli.py", "__main__.py"):
            assert "cli" not in _imports(path), path


def test_the_read_side_does_not_import_torch():
    code = ("import sys, fsdpckpt, fsdpckpt.dcp.reader, fsdpckpt.dcp.layout, "
            "fsdpckpt.dcp.checks, fsdpckpt.inspection.inspect, fsdpckpt.inspection.verify\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
