"""Every entry of fsdpckpt/_torch.py still holds in the installed torch, whichever it is.

A newer torch than the allowlist was last checked against is checked, not failed for being
newer: every name the allowlist accepts must still exist there, and what that torch pickles
into ``.metadata`` must be accepted. When torch moves or renames one, the test for it fails
with a message naming the change and the file to update. On an older torch, a name a later
release brought is skipped. No module but fsdpckpt/_torch.py names a private torch API.
"""

from __future__ import annotations

import ast
import importlib
import io
import pickle
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch

from fsdpckpt import _torch
from fsdpckpt.dcp._allowlist import METADATA_GLOBALS
from fsdpckpt.dcp.dtypes import DTYPES

from conftest import single_process

PACKAGE = Path(_torch.__file__).parent
FIX = "update fsdpckpt/_torch.py"


def _globals_named(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle names: GLOBAL, and STACK_GLOBAL's two strings
    (pushed as they are or fetched from the memo)."""
    found: set[tuple[str, str]] = set()
    memo: dict[int, object] = {}
    recent: list[object] = []
    last: object = None
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))  # type: ignore[arg-type]
            last = None
        elif op.name == "STACK_GLOBAL":
            found.add((str(recent[-2]), str(recent[-1])))
            last = None
        elif isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
            last = arg
            recent.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = last
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = last
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            last = memo.get(arg)
            recent.append(last)
        else:
            last = None
    return found


def _older_than_known() -> bool:
    installed = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return installed < tuple(int(p) for p in _torch.KNOWN_TORCH.split("."))


@pytest.mark.parametrize("key", sorted(_torch.PICKLED_NAMES), ids=".".join)
def test_every_pickled_name_still_exists_in_torch(key):
    module, name = key
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        if _older_than_known():  # a name a later torch brought (torch 2.13's _MeshLayout)
            pytest.skip(f"{module}.{name} is newer than torch {torch.__version__}")
        pytest.fail(f"torch {torch.__version__} moved or removed {module}.{name}, which "
                    f"{_torch.PICKLED_NAMES[key]} names; keep the old name for old files "
                    f"and add the new one: {FIX}")


def test_a_dcp_save_pickles_only_names_the_allowlist_knows(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(2, 3), "h": torch.zeros(2, dtype=torch.bfloat16), "step": 3,
             "nested": {"lr": 0.1, "ids": [1, 2]}}
    dcp.save(state, checkpoint_id=str(tmp_path), **single_process())
    unknown = _globals_named((tmp_path / ".metadata").read_bytes()) - set(METADATA_GLOBALS)
    if unknown:
        pytest.fail(f"torch {torch.__version__} pickles {sorted(unknown)} into .metadata, "
                    f"which fsdpckpt's allowlist does not know: {FIX}")


@pytest.mark.parametrize("dtype,expected", [
    ("float32", _torch.REBUILD_TENSOR_V2), ("uint16", _torch.REBUILD_TENSOR_V3)])
def test_torch_save_rebuilds_a_tensor_through_the_names_fsdpckpt_reads(dtype, expected):
    buffer = io.BytesIO()
    torch.save(torch.zeros(2, dtype=getattr(torch, dtype)), buffer)
    with zipfile.ZipFile(buffer) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    names = _globals_named(data)
    if expected not in names:
        pytest.fail(f"torch {torch.__version__} no longer rebuilds a {dtype} tensor with "
                    f"{'.'.join(expected)} (it names {sorted(names)}): {FIX}")
    storage = (_torch.TORCH_MODULE, DTYPES[dtype].storage_class) if \
        DTYPES[dtype].storage_class else _torch.UNTYPED_STORAGE
    assert storage in names


def test_storage_info_is_torchs_and_has_the_fields_the_reader_reads():
    from dataclasses import fields

    info = _torch.storage_info("__0_0.distcp", 10, 20)
    module, name = _torch.STORAGE_INFO
    if type(info) is not getattr(importlib.import_module(module), name, None):
        pytest.fail(f"torch {torch.__version__} moved _StorageInfo out of {module}: {FIX}")
    have = {f.name for f in fields(info)}
    if not {"relative_path", "offset", "length"} <= have:
        pytest.fail(f"torch {torch.__version__} renamed _StorageInfo's fields ({sorted(have)}); "
                    "fsdpckpt/dcp/reader.py reads relative_path, offset, length")


def test_flatten_state_dict_gives_the_names_dcp_save_writes(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"optimizer": {"state": {"0.w": {"exp_avg": torch.ones(2)}},
                           "param_groups": [{"lr": 0.1, "params": ["0.w"]}]}}
    flat, mappings = _torch.flatten_state_dict(state)
    dcp.save(state, checkpoint_id=str(tmp_path), **single_process())
    from fsdpckpt.dcp.reader import read_dcp_folder

    meta = read_dcp_folder(tmp_path).metadata
    written = {t.name: t.key_path for t in meta.tensors} | \
        {o.name: o.key_path for o in meta.objects}
    if set(flat) != set(written) or any(tuple(mappings[k]) != written[k] for k in flat):
        pytest.fail(f"torch {torch.__version__}'s flatten_state_dict no longer gives the "
                    f"names dcp.save writes ({sorted(flat)} vs {sorted(written)}): {FIX}")


def test_the_writer_writes_through_its_fs_and_metadata_under_the_tmp_suffix(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    created: list[str] = []

    class Recording(FileSystem):
        def create_stream(self, path, mode):
            if "w" in mode:
                created.append(Path(path).name)
            return super().create_stream(path, mode)

    writer = FileSystemWriter(str(tmp_path))
    _torch.set_writer_filesystem(writer, Recording())
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, **single_process())
    if not created:
        pytest.fail(f"torch {torch.__version__}'s FileSystemWriter no longer writes through "
                    f"its 'fs' attribute, so manifests record nothing: {FIX}")
    if ".metadata" + _torch.METADATA_TMP_SUFFIX not in created:
        pytest.fail(f"torch {torch.__version__} writes .metadata as {created}, not under "
                    f"{_torch.METADATA_TMP_SUFFIX!r}: {FIX}")
    assert {_torch.written_file_name(n) for n in created} == \
        {p.name for p in tmp_path.iterdir()}


def test_a_writer_without_fs_is_refused_with_the_file_to_update():
    with pytest.raises(TypeError, match="fsdpckpt/_torch.py"):
        _torch.set_writer_filesystem(object(), None)


def test_the_load_planner_keeps_the_attributes_store_loaded_value_uses(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dcp.save({"opt": {"groups": [{"lr": 0.5}]}}, checkpoint_id=str(tmp_path), **single_process())
    state = {"opt": {"groups": [{"lr": 0.0}]}}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, FileSystemReader(str(tmp_path)).read_metadata(), True)
    missing = [a for a in ("flatten_state_dict", "mappings", "original_state_dict",
                           "state_dict") if not hasattr(planner, a)]
    if missing:
        pytest.fail(f"torch {torch.__version__}'s DefaultLoadPlanner lost {missing}, which "
                    f"store_loaded_value uses: {FIX}")
    _torch.store_loaded_value(planner, "opt.groups.0.lr", 0.5)
    assert state == {"opt": {"groups": [{"lr": 0.5}]}}


def test_the_fsspec_writer_and_reader_go_through_the_filesystem_fsdpckpt_gives_them():
    import fsspec
    import torch.distributed.checkpoint as dcp

    memory = fsspec.filesystem("memory")
    written = _torch.fsspec_filesystem_class()()
    written.fs = memory
    writer = _torch.fsspec_writer("memory://compat/ckpt", written)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, **single_process())
    names = {p.rsplit("/", 1)[1] for p in memory.ls("/compat/ckpt", detail=False)}
    if ".metadata" not in names or not any(n.endswith(".distcp") for n in names):
        pytest.fail(f"torch {torch.__version__}'s FsspecWriter no longer writes through the "
                    f"FileSystem given to it ({sorted(names)}): {FIX}")
    reader = _torch.fsspec_reader_class()("memory://compat/ckpt")
    read = _torch.fsspec_filesystem_class()()
    read.fs = memory
    reader.fs = read
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=reader, **single_process())
    assert torch.equal(state["w"], torch.arange(4.0))


# -- no private torch name outside fsdpckpt/_torch.py ------------------------------------


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def _private_torch_names(tree: ast.AST) -> list[str]:
    """Imports of private torch modules or names, ``torch.x._y`` attribute chains, and
    ``("torch...", "name")`` pairs (a pickled global) with a private part."""
    found: list[str] = []
    inner: set[int] = set()  # attribute nodes inside a longer chain, counted with it
    for node in ast.walk(tree):
        if id(node) in inner:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and \
                _torch.is_torch_global(node.module):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if _torch.is_torch_global(a.name) and _private(a.name)]
        elif isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                parts.append(value.attr)
                value = value.value
            dotted = ".".join([getattr(value, "id", "")] + parts[::-1])
            if isinstance(value, ast.Name) and value.id == "torch" and _private(dotted):
                found.append(dotted)
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            module, name = (e.value for e in node.elts)  # type: ignore[attr-defined]
            if _torch.is_torch_global(module) and _private(f"{module}.{name}"):
                found.append(f"{module}.{name}")
    return found


def test_the_scan_finds_each_kind_of_private_torch_name():
    source = ("from torch.distributed.checkpoint._nested_dict import flatten_state_dict\n"
              "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
              "import torch._utils\nx = torch._utils._rebuild_tensor_v2\n"
              "y = {('torch._utils', '_rebuild_tensor_v3'): 1}\n"
              "ok = torch.__version__, ('torch', 'Size')\n")
    assert len(_private_torch_names(ast.parse(source))) == 5


def test_no_module_but_the_compat_module_names_a_private_torch_api():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch.py" and path.parent == PACKAGE:
            continue
        names = _private_torch_names(ast.parse(path.read_text(), str(path)))
        if names:
            offenders[str(path.relative_to(PACKAGE.parent))] = names
    assert not offenders, f"private torch names outside fsdpckpt/_torch.py: {offenders}"


def test_the_allowlist_resolves_an_unpickled_storage_info_to_its_own_kind():
    # The reader matches storage_data's values by the stand-in's kind, named in _torch.
    from fsdpckpt.dcp._allowlist import STORAGE_INFO_KIND

    assert METADATA_GLOBALS[_torch.STORAGE_INFO].kind == STORAGE_INFO_KIND
    assert pickle.loads(pickle.dumps(_torch.storage_info("f", 0, 1))).relative_path == "f"


def test_pythons_pure_python_pickle_classes_are_still_there():
    """The restricted unpickler and the .bin writer extend them: their opcode methods and
    dispatch tables must exist as fsdpckpt uses them."""
    from fsdpckpt import _torch

    for name in ("load_build", "load_global", "load_reduce", "load_setitems", "load_append",
                 "load_mark", "pop_mark", "dispatch"):
        assert hasattr(_torch.PurePythonUnpickler, name), (
            f"Python's pickle._Unpickler lost {name}: update fsdpckpt/_torch.py and "
            "fsdpckpt/dcp/_safe_pickle.py")
    for name in ("save_reduce", "memoize", "dispatch", "save"):
        assert hasattr(_torch.PurePythonPickler, name), (
            f"Python's pickle._Pickler lost {name}: update fsdpckpt/_torch.py and "
            "fsdpckpt/formats/torch_bin.py")
    assert issubclass(_torch.PickleStop, Exception)
