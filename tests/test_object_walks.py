"""Every walk over a decoded pickle value is linear in the pickle's size (issue 17 §2).

A pickle's memo lets a few bytes reference one container at every level: 34 levels of
``{"a": d, "b": d}`` are 1,500 bytes and 2**34 paths, and a list nested 200,000 deep is
400 KB. Such values inside real rank files (VeRL, Accelerate ``use_dcp=False``) and a
``pytorch_model.bin`` must end every command at once with one line naming the file; and the
walk (:mod:`fsdpckpt.dcp._graph`) visits each object once, whatever graph it is given.
"""

from __future__ import annotations

import io
import pickle
import shutil
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # registers DTensor for weights_only loading
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpckpt.dcp import _graph
from fsdpckpt.dcp._graph import bounded_repr, measure, node_budget, tree_items
from fsdpckpt.errors import NotACheckpointError

from conftest import FIXTURES, assert_one_line_error, run_cli, torch_loads_fixture

RANK_FILES = {
    "verl": (FIXTURES / "verl", "model_world_size_2_rank_0.pt"),
    "accelerate": (FIXTURES / "accelerate_rank_bin", "pytorch_model_fsdp_0_rank0.bin"),
}


def _shared(levels: int, make):
    node = 1
    for _ in range(levels):
        node = make(node)
    return node


#: name -> the hostile value, and what the one line says about it.
GRAPHS = {
    "shared-dict-34": (lambda: _shared(34, lambda n: {"a": n, "b": n}), "reference each other"),
    "shared-list-34": (lambda: _shared(34, lambda n: [n, n]), "reference each other"),
    "shared-tuple-35": (lambda: _shared(35, lambda n: (n, n)), "reference each other"),
    "list-200000-deep": (None, "nested more than 40 levels"),
}

_DEEP = 200_000


def _with_hostile_value(state: dict, graph: str, path: Path) -> None:
    """``torch.save`` of ``state`` plus an entry ``"evil"`` holding the graph, at ``path``."""
    make, _ = GRAPHS[graph]
    torch.save({**state, "evil": make() if make else []}, path)
    if make:  # torch.save's pickler reuses the shared containers by memo: a small pickle
        return
    # 200,000 nested lists are too deep for any pickler: write the opcodes directly.
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                at = data.index(pickle.EMPTY_LIST, data.index(b"evil"))
                data = (
                    data[:at]
                    + pickle.EMPTY_LIST * _DEEP
                    + pickle.APPEND * (_DEEP - 1)
                    + data[at + 1 :]
                )
            archive.writestr(info, data)
    path.write_bytes(buffer.getvalue())


def _hostile_rank_files(layout: str, graph: str, tmp_path: Path) -> tuple[Path, Path]:
    folder, name = RANK_FILES[layout]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    state = torch_loads_fixture(ckpt / name)
    _with_hostile_value(state, graph, ckpt / name)
    return ckpt, ckpt / name


@pytest.mark.parametrize("layout", sorted(RANK_FILES))
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_inspect_of_a_hostile_rank_file_is_one_line_naming_it(graph, layout, tmp_path):
    ckpt, victim = _hostile_rank_files(layout, graph, tmp_path)
    assert victim.stat().st_size < 500_000
    assert_one_line_error(run_cli("inspect", ckpt), victim, GRAPHS[graph][1])


@pytest.mark.parametrize("layout", sorted(RANK_FILES))
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_verify_of_a_hostile_rank_file_names_it_as_the_problem(graph, layout, tmp_path):
    ckpt, victim = _hostile_rank_files(layout, graph, tmp_path)
    result = run_cli("verify", ckpt)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output
    named = [line for line in result.output.splitlines() if f"{victim}:" in line]
    assert len(named) == 1 and GRAPHS[graph][1] in named[0], result.output


@pytest.mark.parametrize("layout", sorted(RANK_FILES))
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_merge_of_a_hostile_rank_file_is_one_line_and_writes_nothing(graph, layout, tmp_path):
    ckpt, victim = _hostile_rank_files(layout, graph, tmp_path)
    assert_one_line_error(run_cli("merge", ckpt, tmp_path / "out"), victim, GRAPHS[graph][1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_convert_of_a_hostile_bin_is_one_line_and_writes_nothing(graph, tmp_path):
    source = tmp_path / "pytorch_model.bin"
    _with_hostile_value({"weight": torch.ones(2)}, graph, source)
    result = run_cli("convert", source, tmp_path / "out")
    assert_one_line_error(result, source, GRAPHS[graph][1])
    assert "unexpected" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("graph", ["shared-dict-34", "list-200000-deep"])
def test_diff_and_load_full_state_dict_of_a_hostile_bin_refuse_it_naming_it(graph, tmp_path):
    from fsdpckpt import load_full_state_dict

    source = tmp_path / "pytorch_model.bin"
    _with_hostile_value({"weight": torch.ones(2)}, graph, source)
    assert_one_line_error(run_cli("diff", source, source), source, GRAPHS[graph][1])
    with pytest.raises(NotACheckpointError, match=GRAPHS[graph][1]):
        load_full_state_dict(source)


# -- the walk itself ----------------------------------------------------------------------


def test_a_value_that_contains_itself_is_refused():
    value: list = []
    value.append({"x": value})
    with pytest.raises(NotACheckpointError, match="X: holds a value that contains itself"):
        measure(value, source="X", budget=10**6)


def test_shared_tensors_and_tuples_of_an_honest_state_dict_pass():
    weight, betas = object(), (0.9, 0.999)  # a tied tensor; the defaults' betas in each group
    value = {
        "embed": weight,
        "lm_head": weight,
        "param_groups": [{"params": [0, 1], "betas": betas}, {"params": [2], "betas": betas}],
    }
    assert measure(
        value, source="X", budget=node_budget(len(pickle.dumps(value)))
    ) == _graph.Measure(nodes=_naive_nodes(value), depth=4)


def test_a_container_reached_by_two_key_paths_is_refused_naming_both():
    inner = {"w": 1}
    with pytest.raises(NotACheckpointError, match=r"'b' is the same container as 'a'"):
        tree_items({"a": inner, "b": inner}, is_branch=lambda v: False, source="X")


def test_tree_items_gives_dcps_key_paths():
    value = {"state": {0: {"step": 5}}, "param_groups": [{"lr": 0.1}], "shape": [1, 2]}
    assert tree_items(
        value, is_branch=lambda v: isinstance(v, list) and not _graph.is_leaf_list(v), source="X"
    ) == [(("state", 0, "step"), 5), (("param_groups", 0, "lr"), 0.1), (("shape",), [1, 2])]


@pytest.mark.parametrize("graph", ["shared-dict-34", "shared-tuple-35"])
def test_a_shared_graph_is_shown_in_bounded_text(graph):
    text = bounded_repr(GRAPHS[graph][0](), 80)
    assert len(text) <= 80 and text.endswith("...")


def test_a_deep_list_is_shown_in_bounded_text():
    value: list = []
    for _ in range(_DEEP):
        value = [value]
    assert bounded_repr(value, 50) == "[" * 47 + "..."


# -- linear in the pickle's size, for any graph -------------------------------------------


@st.composite
def shared_graphs(draw):
    """A random graph of dicts, lists and tuples, each built over those before it, so any
    of them may be referenced from many places (a DAG: what a pickle's memo can build)."""
    nodes: list = [draw(st.integers(-5, 5))]
    for _ in range(draw(st.integers(1, 40))):
        picks = draw(st.lists(st.integers(0, len(nodes) - 1), min_size=0, max_size=4))
        children = [nodes[i] for i in picks]
        kind = draw(st.sampled_from(["dict", "list", "tuple"]))
        nodes.append(
            {f"k{i}": c for i, c in enumerate(children)}
            if kind == "dict"
            else children
            if kind == "list"
            else tuple(children)
        )
    return nodes[-1]


def _naive_nodes(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(_naive_nodes(k) + _naive_nodes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 1 + sum(map(_naive_nodes, value))
    return 1


def _counted(value, budget: int, monkeypatch) -> tuple[int, object]:
    """How many children the walk looked at, and what it answered (a Measure or an error)."""
    seen = [0]
    children = _graph._children

    def counting(node):
        found = children(node)
        seen[0] += 1 + len(found)
        return found

    monkeypatch.setattr(_graph, "_children", counting)
    try:
        answer: object = measure(value, source="X", budget=budget)
    except NotACheckpointError as exc:
        answer = exc
    finally:
        monkeypatch.undo()
    return seen[0], answer


@settings(max_examples=150, deadline=None)
@given(shared_graphs())
def test_the_walk_looks_at_each_object_once_whatever_the_sharing(value):
    data = pickle.dumps(value, protocol=2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        visits, answer = _counted(value, node_budget(len(data)), monkeypatch)
    # Each container entered once, each reference looked at once: the pickle spends at
    # least one byte on every object and every memo reference.
    assert visits <= 2 * len(data)
    if isinstance(answer, _graph.Measure):
        assert answer.nodes == _naive_nodes(value) <= node_budget(len(data))
    else:
        assert "reference each other" in str(answer) or "nested more than" in str(answer)


@pytest.mark.parametrize("levels", [10, 20, 40, 80])
def test_the_walk_of_a_doubling_graph_grows_with_its_pickle_not_its_paths(levels, monkeypatch):
    value = _shared(levels, lambda n: [n, n])
    data = pickle.dumps(value, protocol=2)
    visits, answer = _counted(value, 2**levels + 10, monkeypatch)
    assert visits <= 2 * len(data)
    assert isinstance(answer, NotACheckpointError)  # 80 levels: nested too deep
    if levels <= 20:
        assert _counted(value, 2 ** (levels + 2), monkeypatch)[1] == _graph.Measure(
            2 ** (levels + 1) - 1, levels
        )


@pytest.mark.parametrize("size", [1_000, 4_000, 16_000])
def test_the_walks_memory_grows_with_the_values_size(size):
    value = [{"k": [i, (i, i)]} for i in range(size)]
    tracemalloc.start()
    measure(value, source="X", budget=node_budget(len(pickle.dumps(value))))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000 * size
