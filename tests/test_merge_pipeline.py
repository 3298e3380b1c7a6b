"""The merge pipeline: validate -> plan -> write -> commit, its plain data, the formats'
answers, the shard-size parser and the one reader of source files."""

from __future__ import annotations

import os
import re

import pytest

import fsdpckpt
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.formats import get_format
from fsdpckpt.formats.safetensors import SafetensorsFormat
from fsdpckpt.merging import _validate as validate
from fsdpckpt.merging import merger
from fsdpckpt.merging.plan import MergePlanError, chunk_runs, parse_size, plan_merge
from fsdpckpt.merging.writer import staging

from conftest import DCP_FOLDERS, FIXTURES

# --- parse_size ---------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5KB", 1500), ("10", 10), ("1B", 1),
    ("2GiB", 2 * 2**30), ("3MiB", 3 * 2**20), ("1TiB", 2**40), ("1TB", 10**12),
])
def test_parse_size_reads_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


def test_parse_size_ignores_case_and_spaces():
    assert parse_size(" 1 gib ") == 2**30


def test_parse_size_takes_a_positive_int_as_bytes():
    assert parse_size(7) == 7


@pytest.mark.parametrize("value", ["0", "-1", 0, -5, "0.0001B"])
def test_parse_size_refuses_sizes_that_are_not_positive(value):
    with pytest.raises(MergePlanError, match="must be positive"):
        parse_size(value)


@pytest.mark.parametrize("value", ["", "GB", "5XB", "five GB", "nan", "1.5.2GB", True, 1.5, None,
                                   b"5GB"])
def test_parse_size_names_what_it_cannot_read_and_shows_how(value):
    with pytest.raises(MergePlanError, match=re.escape(repr(value)) + ".*like 5GB"):
        parse_size(value)


@pytest.mark.parametrize("value", ["inf", "1e400", "1e300TB"])
def test_parse_size_refuses_infinite_sizes_as_unreadable(value):
    with pytest.raises(MergePlanError, match="cannot read the size"):
        parse_size(value)


# --- formats answer their own questions --------------------------------------------


@pytest.mark.parametrize("fmt, kind, single, shard, index", [
    ("safetensors", "model", "model.safetensors", "model-00002-of-00003.safetensors",
     "model.safetensors.index.json"),
    ("bin", "model", "pytorch_model.bin", "pytorch_model-00002-of-00003.bin",
     "pytorch_model.bin.index.json"),
    ("bin", "optimizer", "optimizer.bin", "optimizer-00002-of-00003.bin",
     "optimizer.bin.index.json"),
])
def test_a_format_names_its_files(fmt, kind, single, shard, index):
    output = get_format(fmt)
    stem = output.file_stem(kind)
    assert output.single_file_name(stem) == single
    assert output.shard_file_name(stem, 2, 3) == shard
    assert output.index_file_name(stem) == index


def test_a_format_knows_its_own_shard_names_only():
    output = get_format("safetensors")
    assert output.is_shard_file_name("model", "model-00001-of-00003.safetensors")
    assert output.is_shard_file_name("model", "model-123456-of-123456.safetensors")
    assert not output.is_shard_file_name("model", "model-v2-of-llama.safetensors")
    assert not output.is_shard_file_name("model", "model-00001-of-00003.bin")
    assert not output.is_shard_file_name("mode", "model-00001-of-00003.safetensors")


def test_which_dtypes_a_format_can_hold():
    from fsdpckpt.dcp.dtypes import dtype_from_name

    complex32 = dtype_from_name("complex32")
    assert not get_format("safetensors").can_hold(complex32)
    assert get_format("bin").can_hold(complex32)
    assert get_format("safetensors").can_hold(dtype_from_name("bfloat16"))


def test_only_safetensors_reserves_a_tensor_name():
    assert "reserves" in get_format("safetensors").name_problem("m.__metadata__", "__metadata__")
    assert get_format("safetensors").name_problem("m.w", "w") is None
    assert get_format("bin").name_problem("m.__metadata__", "__metadata__") is None


def test_formats_are_values():
    assert get_format("bin") == get_format("bin") != get_format("safetensors")
    assert len({get_format("bin"), get_format("bin")}) == 1


# --- the plan carries what the writer needs ----------------------------------------


def test_the_plan_carries_the_format_object():
    plan = plan_merge(DCP_FOLDERS["fsdp2-model"], format="bin")
    assert plan.format == get_format("bin") and plan.suffix == "bin"


def test_the_plan_carries_each_chunks_runs():
    plan = plan_merge(DCP_FOLDERS["dtensor"])
    for file in plan.files:
        for tensor in file.tensors:
            assert len(tensor.runs) == len(tensor.source.chunks)
            for runs, chunk in zip(tensor.runs, tensor.source.chunks):
                assert runs == chunk_runs(tensor.source.shape, chunk)


class _Renamed(SafetensorsFormat):
    """A format the registry does not know: the plan must carry it, not its name."""

    name = "renamed"
    suffix = "st"


def test_a_format_object_unknown_to_the_registry_is_planned_and_written(tmp_path):
    (result,) = fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path, format=_Renamed())
    assert [p.name for p in result.files] == ["model.st"]
    (reference,) = fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "ref")
    assert result.path.read_bytes() == reference.path.read_bytes()


# --- the stages -------------------------------------------------------------------


def test_the_stages_compose_into_what_merge_writes(tmp_path):
    request = validate.validate_merge(DCP_FOLDERS["fsdp2-model"], tmp_path / "out", dtype="bf16")
    assert request.options.format == get_format("safetensors")
    assert [s.kind for s in request.sources] == ["model"]
    job = merger.plan_job(request)
    assert job.replaced == ()
    (tmp_path / "out").mkdir()
    with staging(tmp_path / "out") as stage:
        staged = merger.write_job(job, stage)
        assert [p.parent for s in staged for p in s.files] == [stage]
        (result,) = merger.commit_job(job, staged)
    (expected,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path / "direct", dtype="bf16")
    assert result.path.read_bytes() == expected.path.read_bytes()


def test_an_output_that_is_a_file_is_refused_before_planning(tmp_path, monkeypatch):
    def never(*_a, **_k):
        raise AssertionError("planned despite an output that is a file")

    monkeypatch.setattr(merger, "plan_merge", never)
    (tmp_path / "out").write_text("x")
    with pytest.raises(fsdpckpt.NotACheckpointError, match="is a file"):
        fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "out")


def test_merge_fsdp_weights_finds_the_layout_once(tmp_path, monkeypatch):
    from fsdpckpt.dcp import layout

    calls = []

    def counting(path):
        calls.append(path)
        return layout.find_layout(path)

    monkeypatch.setattr(merger, "find_layout", counting)
    monkeypatch.setattr(validate, "find_layout", counting)
    fsdpckpt.merge_fsdp_weights(str(DCP_FOLDERS["fsdp2-model"]), str(tmp_path))
    assert len(calls) == 1


@pytest.mark.parametrize("verb", ["merge", "merge_fsdp_weights"])
def test_both_verbs_choose_how_the_output_is_written_in_one_place(tmp_path, monkeypatch, verb):
    calls = []
    real = merger.run_job

    def recording(out, plan, **kwargs):
        calls.append(out)
        return real(out, plan, **kwargs)

    monkeypatch.setattr(merger, "run_job", recording)
    getattr(fsdpckpt, verb)(str(DCP_FOLDERS["fsdp2-model"]), str(tmp_path / "out"))
    assert calls == [tmp_path / "out"]


@pytest.mark.parametrize("verb", ["merge", "merge_fsdp_weights"])
def test_a_file_url_output_is_the_local_folder_it_names(tmp_path, monkeypatch, verb):
    monkeypatch.chdir(tmp_path)  # where a misread URL would land: ./file:/...
    out = tmp_path / "out"
    getattr(fsdpckpt, verb)(str(DCP_FOLDERS["fsdp2-model"]), f"file://{out}")
    assert os.listdir(out) == ["model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]


def test_a_bad_format_is_reported_with_the_other_option_problems(tmp_path):
    with pytest.raises(MergePlanError, match=r"unknown format 'zip'.*unknown export dtype"):
        fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path, format="zip", dtype="int8")


# --- one reader of source files ----------------------------------------------------


def test_data_files_opens_each_file_once_with_a_descriptor_and_a_file_object():
    folder = FIXTURES / "dtensor"
    with DataFiles(folder) as files:
        first = files.open("__0_0.distcp")
        assert files.open("__0_0.distcp") is first
        assert first.fd == first.file.fileno() and first.path == folder / "__0_0.distcp"
        fd = first.fd
        first.file.seek(0)
        assert first.file.read(4) == os.pread(fd, 4, 0)
    assert first.file.closed
    with pytest.raises(OSError):
        os.fstat(fd)


def test_data_files_reads_by_descriptor_do_not_move_the_file_object():
    with DataFiles(FIXTURES / "dtensor") as files:
        data = files.open("__0_0.distcp")
        data.file.seek(10)
        os.pread(data.fd, 100, 0)
        assert data.file.tell() == 10


@pytest.mark.parametrize("name", ["../dtensor/__0_0.distcp", "/etc/passwd", ""])
def test_data_files_refuse_a_name_outside_the_folder(name):
    with DataFiles(FIXTURES / "dtensor") as files, \
            pytest.raises(fsdpckpt.NotACheckpointError, match="outside"):
        files.open(name)


def test_data_files_name_a_missing_file():
    with DataFiles(FIXTURES / "dtensor") as files, \
            pytest.raises(fsdpckpt.CheckpointNotFoundError, match="missing data file"):
        files.open("__9_0.distcp")



def test_a_computed_tensor_of_another_dtype_of_the_same_size_is_refused(tmp_path):
    # A fuser that yields float16 where bfloat16 was planned: same bytes per element, other
    # numbers. The writer refuses it rather than write the bytes under the planned dtype.
    import torch

    from fsdpckpt.dcp.dtypes import DTYPES
    from fsdpckpt.errors import CorruptCheckpointError
    from fsdpckpt.formats import TensorSpec
    from fsdpckpt.merging.plan import computed_plan, no_metadata
    from fsdpckpt.merging.writer import write_plan

    spec = TensorSpec("w", ("w",), DTYPES["bfloat16"], (2, 3))
    plan = computed_plan(no_metadata(tmp_path), [spec],
                         lambda: [("w", torch.zeros(2, 3, dtype=torch.float16))])
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(CorruptCheckpointError, match="bfloat16"):
        write_plan(plan, stage)
    ok = computed_plan(no_metadata(tmp_path), [spec],
                       lambda: [("w", torch.ones(2, 3, dtype=torch.bfloat16))])
    (tmp_path / "ok").mkdir()
    assert [p.name for p in write_plan(ok, tmp_path / "ok")] == ["model.safetensors"]
