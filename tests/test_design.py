"""docs/design.md matches the tree: every module is on the page, every module the page names
exists, each package and top-level module imports only what its layering rule names (imports
inside functions included), there are no import cycles, and the read side does not import
torch."""

from __future__ import annotations

import ast
import functools
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


# --- layering: what each package and top-level module may import -----------------------
#
# Imports anywhere count: at module level, inside a function, under ``if TYPE_CHECKING:``,
# ``import x`` and ``from x import y`` alike. A function-level import defers the loading,
# not the dependency. Each rule is the code as it stands; a new import across the layers
# has to be written here first, on purpose.

#: Modules every package may import: they import nothing of fsdpckpt at module level.
_LEAVES = {"errors", "_printable", "_progress", "_torch", "_version"}

#: Each package, and the other packages it may import (its own modules and the leaves too).
_LAYERS = {
    "_io": set(),
    "dcp": {"_io"},
    "formats": {"_io", "dcp"},
    "merging": {"_io", "dcp", "formats"},
    # load_pretrained / save_pretrained read and write Hugging Face folders: the shard
    # index and header rules (formats), the shard split (merging), configs, ties and
    # LoRA naming (export) are the ones export-hf uses, never a second copy.
    "training": {"_io", "dcp", "formats", "merging", "export"},
    # verify reads the manifest (training.manifest); diff reads chunks with the merge's engine,
    # and knows an export's tied keys by export-hf's own rule (export._model), never a copy.
    "inspection": {"_io", "dcp", "formats", "merging", "training", "export"},
    # export builds on the merge pipeline, never on the read-side verbs.
    "export": {"_io", "dcp", "formats", "merging"},
}

#: The command line: parses, calls the library, prints. Nothing else imports these.
_CLI = {"cli", "__main__", "_cli_common", "_cli_export", "_cli_list", "_render"}
_CLI_MAY_IMPORT = {"_io", "dcp", "inspection", "merging", "export"}

#: The top-level modules outside the CLI, and what each may import.
_TOP = {
    "errors": set(),
    "_printable": set(),
    "_progress": set(),
    "_version": set(),
    # Nothing at module level; store_loaded_value nests with dcp._nesting inside the function,
    # and a dtype the installed torch lacks is a TorchTooOldError.
    "_torch": {"dcp", "errors"},
    # The public API: its names, loaded lazily from the packages.
    "__init__": {"_version", "errors", "dcp", "export", "inspection", "merging", "training"},
}


def _piece(module: str) -> str:
    """``fsdpckpt.dcp.reader`` -> ``dcp``; ``fsdpckpt._torch`` -> ``_torch``; the package
    itself (``from fsdpckpt import merge``: the public API) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def _imports(path: Path, *, module_level: bool = False) -> frozenset[str]:
    """The fsdpckpt subpackages and top-level modules ``path`` imports, by :func:`_piece`:
    anywhere in the file (every ``import`` and ``from ... import`` node, relative ones
    resolved), or with ``module_level`` only the statements at the top of the module."""
    modules = _package_modules()
    name = next(n for n, p in modules.items() if p == path)
    return frozenset(_piece(m) for m in _imported_modules(name, path, modules,
                                                      module_level=module_level))


@functools.cache
def _package_modules() -> dict[str, Path]:
    return _module_files(PACKAGE)


def _files_of(piece: str) -> list[Path]:
    folder = PACKAGE / piece
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{piece}.py"]


def _offences(piece: str, allowed: set[str]) -> list[str]:
    offences = []
    for path in _files_of(piece):
        extra = _imports(path) - allowed - {piece}
        if extra:
            offences.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    return offences


@pytest.mark.parametrize("package", sorted(_LAYERS))
def test_lower_layers_import_only_what_is_below_them(package):
    offences = _offences(package, _LAYERS[package] | _LEAVES)
    assert not offences, f"{package} may import only {sorted(_LAYERS[package])}: {offences}"


@pytest.mark.parametrize("module", sorted(_CLI))
def test_the_cli_modules_import_the_library_and_each_other(module):
    offences = _offences(module, _CLI_MAY_IMPORT | _CLI | _LEAVES)
    assert not offences, offences


@pytest.mark.parametrize("module", sorted(_TOP))
def test_the_top_level_modules_import_only_what_their_rule_names(module):
    offences = _offences(module, _TOP[module])
    assert not offences, offences


@pytest.mark.parametrize("module", sorted(_LEAVES))
def test_the_leaves_import_nothing_of_fsdpckpt_at_module_level(module):
    path = PACKAGE / f"{module}.py"
    assert not _imports(path, module_level=True), path


def test_every_module_is_under_a_layering_rule():
    pieces = {_piece(name) for name in _package_modules()}
    ruled = set(_LAYERS) | _CLI | set(_TOP)
    assert pieces == ruled, f"give each new package or module a rule: {sorted(pieces ^ ruled)}"


def test_only_the_cli_imports_the_cli_modules_and_nothing_imports_the_public_api():
    for name, path in _package_modules().items():
        if _piece(name) not in _CLI:
            assert not _imports(path) & _CLI, path
        if name != "fsdpckpt":
            assert "__init__" not in _imports(path), path


def test_the_import_rules_see_imports_inside_functions_and_plain_import_forms():
    # The layering checks read what the cycle check reads: a function body, `import a.b`.
    path = PACKAGE / "_torch.py"
    assert "dcp" in _imports(path) and not _imports(path, module_level=True)
    assert "dcp" in _imports(PACKAGE / "formats" / "safetensors.py")  # import fsdpckpt.dcp._objects


def test_nothing_imports_the_cli():
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("cli.py", "__main__.py"):
            assert "cli" not in _imports(path), path


def test_the_read_side_does_not_import_torch():
    code = ("import sys, fsdpckpt, fsdpckpt.dcp.reader, fsdpckpt.dcp.layout, "
            "fsdpckpt.dcp.checks, fsdpckpt.inspection.inspect, fsdpckpt.inspection.verify\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- no import cycles, function-level imports included ----------------------------

def _module_files(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its own)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported_modules(name: str, path: Path, modules: dict[str, Path], *,
                      module_level: bool = False) -> set[str]:
    """The package's modules that ``path`` imports anywhere: at module level, inside a
    function, under ``if TYPE_CHECKING:``. ``from pkg import name`` counts as importing
    ``pkg.name`` where that is a module, else ``pkg``. Importing ``pkg.sub`` also runs
    ``pkg/__init__.py``, but that is not counted: a package re-exporting its own modules
    is not a cycle. With ``module_level``, only the module's top statements count."""
    top = name.split(".")[0]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            module = known(target) if target.split(".")[0] == top else None
            if module and module != name:
                found.add(module)
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules of the package at ``root``: each strongly
    connected component of the import graph with more than one module, sorted."""
    modules = _module_files(root)
    graph = {name: sorted(_imported_modules(name, path, modules))
             for name, path in modules.items()}
    # Tarjan's algorithm, iterative: index, lowlink, and the stack of the open component.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycles_among_fsdpckpt_modules_function_level_imports_included():
    # A function-level import hides a cycle from the interpreter, not from the design:
    # the merge driver and its output strategies once imported each other that way.
    cycles = import_cycles(PACKAGE)
    assert not cycles, f"import cycles among fsdpckpt modules: {cycles}"


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "driver.py").write_text("from pkg.sub import strategy\n")
    (package / "sub" / "strategy.py").write_text(
        "def run():\n    from pkg.driver import Job  # the cycle hides here\n")
    (package / "sub" / "types.py").write_text("from . import strategy\n")
    assert import_cycles(package) == [["pkg.driver", "pkg.sub.strategy"]]


def test_the_cycle_check_sees_a_relative_import_and_type_checking_block(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert import_cycles(package) == [["pkg.a", "pkg.b"]]


def test_the_merge_output_strategies_import_the_job_types_not_the_driver():
    modules = _module_files(PACKAGE)
    for name in ("fsdpckpt.merging._distributed", "fsdpckpt.merging._distributed_remote",
                 "fsdpckpt.merging._remote_out"):
        imported = _imported_modules(name, modules[name], modules)
        assert "fsdpckpt.merging.merger" not in imported, name
        assert "fsdpckpt.merging._jobs" in imported, name


# --- one storage seam: callers never ask which kind of place they hold ----------------------

#: Every spelling of "is this place remote?" (the check, and the one capability built on it).
_KIND_CHECK = re.compile(r"isinstance\([^)]*RemotePath|is_remote\(|commits_by_rename\(|"
                         r"hasattr\([^)]*['\"]fs['\"]")


def test_at_most_three_questions_about_the_kind_of_place_outside_io():
    found = [f"{path.relative_to(PACKAGE)}:{number}"
             for path in PACKAGE.rglob("*.py") if path.parent.name != "_io"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if _KIND_CHECK.search(line) and not line.lstrip().startswith("#")]
    assert len(found) <= 3, ("outside fsdpckpt/_io/ only a policy may ask which kind of place "
                             f"it holds (docs/design.md, the storage seam); found {found}")
