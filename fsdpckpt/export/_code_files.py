"""The files a Hugging Face folder needs besides its weights that are code or may link out:
the custom code modules an ``auto_map`` names, and the check that a side file is inside its
folder.

Pure file work: a module is found by name and copied, never imported or run here (whether
transformers may run it is :mod:`fsdpckpt.export._keycheck`'s business).
"""

from __future__ import annotations

import re
from typing import Any

from fsdpckpt._io import storage_paths
from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import CheckpointNotFoundError, FsdpCkptError, NotACheckpointError

__all__ = ["MAX_CONFIG_BYTES", "check_inside", "code_files", "custom_code_names"]

_CONFIG = "config.json"  # export/_config.CONFIG, which imports this module
_TOKENIZER_CONFIG = "tokenizer_config.json"
#: A config is a few KB; one larger than this is not one (export/_config's bound too).
MAX_CONFIG_BYTES = 16 * 2**20


#: A module ``auto_map`` may name: one Python identifier (``modeling_custom``), so a name
#: can never reach outside the folder.
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: What transformers reads as a relative import of custom code (dynamic_module_utils).
_RELATIVE_IMPORTS = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                     re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))
#: A custom code module is source, not data: one larger than this is not one.
_MAX_CODE_BYTES = 16 * 2**20


def _auto_map_modules(auto_map: Any) -> list[str]:
    # {"AutoModelForCausalLM": "modeling_x.XForCausalLM", "AutoTokenizer": ["tok.T", null]}
    # A reference to another repo's code ("org/repo--modeling_x.X") is loaded from there.
    refs: list[Any] = []
    if isinstance(auto_map, dict):
        for value in auto_map.values():
            refs += value if isinstance(value, list) else [value]
    modules = []
    for ref in refs:
        if isinstance(ref, str) and "--" not in ref and "." in ref:
            modules.append(ref.rsplit(".", 1)[0])
    return modules


def custom_code_names(folder: Place) -> list[str]:
    """The ``.py`` files of ``folder`` its config's and tokenizer config's ``auto_map`` need
    (what the export copies beside them), by name; none when they name none, or name what is
    not there (the export says what is wrong)."""
    try:
        return [name for json_file in (folder / _CONFIG, folder / _TOKENIZER_CONFIG)
                if json_file.is_file() for _, name in code_files(json_file, folder)]
    except FsdpCkptError:
        return []


def code_files(json_file: Place, folder: Place) -> list[tuple[Place, str]]:
    """The ``.py`` files in ``folder`` that ``json_file``'s ``auto_map`` needs, as (source,
    name): each module it names, and the modules those import relatively (as
    transformers resolves them).

    Raises:
        NotACheckpointError: a module name that is not a plain Python name.
        CheckpointNotFoundError: a module it needs is not in ``folder``.
    """
    try:
        doc = parse_json(json_file.read_bytes()) if json_file.stat().st_size <= \
            MAX_CONFIG_BYTES else None
    except (ValueError, OSError):
        return []  # read_config, or the tokenizer itself, reports an unreadable file
    if not isinstance(doc, dict):
        return []
    todo = _auto_map_modules(doc.get("auto_map"))
    found: dict[str, Place] = {}
    while todo:
        module = todo.pop(0)
        if module in found:
            continue
        if not _MODULE.match(module):
            raise NotACheckpointError(f"{json_file}: auto_map names the module {module!r}, "
                                      "which is not a Python module name in its folder; fix "
                                      "the auto_map or pass base= with the model folder")
        path = folder / f"{module}.py"
        if not path.is_file():  # "--base": pinned by tests/test_export_hf.py
            raise CheckpointNotFoundError(f"{path}: {json_file.name}'s auto_map needs this "
                                          "custom code file and it is missing; pass --base "
                                          "with the model folder that holds it")
        check_inside(path, folder)
        if path.stat().st_size > _MAX_CODE_BYTES:
            raise NotACheckpointError(f"{path}: over {_MAX_CODE_BYTES} bytes, it is not a "
                                      "custom code module")
        found[module] = path
        text = path.read_bytes().decode("utf-8", errors="replace")
        todo += [m for pattern in _RELATIVE_IMPORTS for m in pattern.findall(text)]
    return [(path, path.name) for path in found.values()]


def check_inside(path: Place, folder: Place) -> None:
    """Refuse a side file that is a symlink leading out of the folder it is copied from.

    A Hugging Face hub cache's snapshot links its files to the repo's ``blobs/``; those
    are inside.

    Raises:
        NotACheckpointError: ``path`` resolves outside ``folder``.
    """
    # Object stores have no links (and RemotePath refuses '..' in names): there a file is
    # always inside the folder it was listed in. The containment rule's own resolution,
    # which a link loop cannot crash (storage_paths.real: None).
    root = storage_paths.real(folder)
    target = storage_paths.real(path)
    roots = [] if root is None else [root]
    if root is not None and root.parent.name == "snapshots":  # hub cache: .../snapshots/<rev>
        roots.append(root.parent.parent / "blobs")
    if target is None or not any(storage_paths.within(target, r) for r in roots):
        where = "itself (a loop)" if target is None else storage_paths.shown(target)
        raise NotACheckpointError(f"{storage_paths.shown(path)}: a symlink to {where}, outside "
                                  f"{storage_paths.shown(folder)}; side files are only copied "
                                  "from inside their folder: copy the file into the folder or "
                                  "pass base= with one that holds it")
