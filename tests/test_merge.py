"""`merge`: every merged tensor equals what torch's DCP loader gives, byte for byte."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import fsdpckpt
from fsdpckpt.merging.full import load_full_state_dict
from fsdpckpt.merging.plan import MergePlanError

from conftest import DCP_FOLDERS, FIXTURES, reference_state_dict, single_process
from deep_compare import assert_same_state


def _stripped(reference: dict) -> dict:
    # Accelerate's rule, which merge follows: a single top-level key is dropped.
    return next(iter(reference.values())) if len(reference) == 1 else reference


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_merged_output_equals_dcp_loader(dcp_folder, tmp_path, fmt):
    (result,) = fsdpckpt.merge(dcp_folder, tmp_path / "out", format=fmt, keep_keys=True)
    assert_same_state(load_full_state_dict(result.path),
                      _stripped(reference_state_dict(dcp_folder)))


def test_bin_output_is_a_plain_torch_save_file(dcp_folder, tmp_path):
    (result,) = fsdpckpt.merge(dcp_folder, tmp_path, format="bin", keep_keys=True)
    loaded = torch.load(result.path, weights_only=True)
    assert_same_state(loaded, _stripped(reference_state_dict(dcp_folder)))
    mmapped = torch.load(result.path, weights_only=True, mmap=True)  # data is 64-byte aligned
    assert_same_state(mmapped, loaded)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_output_equals_dcp_loader(dcp_folder, tmp_path, fmt):
    (result,) = fsdpckpt.merge(dcp_folder, tmp_path, format=fmt, max_shard_size=100,
                               keep_keys=True)
    assert result.path.name.endswith(".index.json") and len(result.files) > 2
    assert_same_state(load_full_state_dict(result.path),
                      _stripped(reference_state_dict(dcp_folder)))


def test_non_contiguous_stored_chunks_merge_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"t": torch.arange(12.0).reshape(3, 4).t(), "w": torch.arange(6.0)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    for fmt in ("safetensors", "bin"):
        (result,) = fsdpckpt.merge(tmp_path / "ckpt", tmp_path / fmt, format=fmt)
        assert_same_state(load_full_state_dict(result.path), state["model"])


def test_chunk_runs_match_numpy_slicing_for_every_grid():
    import itertools

    import numpy as np

    from fsdpckpt.dcp.metadata import Chunk
    from fsdpckpt.merging.plan import chunk_runs

    shape = (4, 6, 5)
    index = np.arange(np.prod(shape)).reshape(shape)
    cuts = [[0, 1, 4], [0, 2, 3, 6], [0, 5]]  # uneven cuts on dims 0 and 1, none on dim 2
    for starts in itertools.product(*[c[:-1] for c in cuts]):
        ends = [c[c.index(s) + 1] for c, s in zip(cuts, starts)]
        sizes = tuple(e - s for s, e in zip(starts, ends))
        run, run_starts = chunk_runs(shape, Chunk(tuple(starts), sizes, None, 0, 0))
        got = [i for s in run_starts for i in range(s, s + run)]
        expected = index[tuple(slice(s, e) for s, e in zip(starts, ends))].ravel().tolist()
        assert got == expected, (starts, sizes)


def test_sharded_output_has_hf_names_and_index(tmp_path):
    folder = DCP_FOLDERS["fsdp2-model"]
    (result,) = fsdpckpt.merge(folder, tmp_path, max_shard_size=600)
    index_path = tmp_path / "model.safetensors.index.json"
    assert result.path == index_path
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as handle:
            names = list(handle.keys())
            assert all(index["weight_map"][n] == shard for n in names)
            total += sum(handle.get_tensor(n).nbytes for n in names)
    assert index["metadata"]["total_size"] == total
    assert_same_state(load_full_state_dict(index_path), _stripped(reference_state_dict(folder)))


def test_safetensors_metadata_says_format_pt(tmp_path):
    (result,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path)
    with safe_open(str(result.path), "pt") as handle:
        assert handle.metadata()["format"] == "pt"


def test_export_dtype_converts_floats_only(tmp_path):
    folder = DCP_FOLDERS["dtensor"]
    (result,) = fsdpckpt.merge(folder, tmp_path, dtype="bf16")
    expected = _stripped(reference_state_dict(folder))
    got = load_full_state_dict(result.path)
    from deep_compare import flatten

    flat_expected = flatten(expected)
    for key, value in flatten(got).items():
        want = flat_expected[key]
        if isinstance(want, torch.Tensor):
            target = torch.bfloat16 if want.is_floating_point() else want.dtype
            assert value.dtype == target, key
            assert torch.equal(value, want.to(target)), key
    assert any(isinstance(v, torch.Tensor) and not v.is_floating_point()
               for v in flat_expected.values())


def test_optimizer_folder_to_safetensors_round_trips_to_dcp_state(tmp_path):
    folder = DCP_FOLDERS["fsdp2-optimizer"]
    (result,) = fsdpckpt.merge(folder, tmp_path)
    assert result.path.name == "optimizer.safetensors"
    assert_same_state(load_full_state_dict(result.path), _stripped(reference_state_dict(folder)))


def test_optimizer_param_groups_are_kept_as_objects(tmp_path):
    (result,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-optimizer"], tmp_path)
    assert any(name.startswith("param_groups") for name in result.objects)


def test_non_tensor_entries_do_not_break_safetensors(tmp_path):
    (result,) = fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)
    assert "step" in result.objects
    with safe_open(str(result.path), "pt") as handle:
        assert "fsdpckpt.objects" in handle.metadata()


def test_wrapper_segments_are_removed_by_default_and_kept_on_request(tmp_path):
    import torch.distributed.checkpoint as dcp

    stored = ["_orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight",
              "_fsdp_wrapped_module.embed._fsdp_wrapped_module.weight", "head._orig_modx"]
    dcp.save({"model": {name: torch.ones(2) for name in stored}},
             checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    (clean,) = fsdpckpt.merge(tmp_path / "ckpt", tmp_path / "clean")
    (kept,) = fsdpckpt.merge(tmp_path / "ckpt", tmp_path / "kept", keep_keys=True)
    with safe_open(str(clean.path), "pt") as a, safe_open(str(kept.path), "pt") as b:
        assert sorted(a.keys()) == ["embed.weight", "head._orig_modx", "layers.0.mlp.weight"]
        assert sorted(b.keys()) == sorted(stored)


def test_names_that_collide_after_cleanup_are_refused_before_writing(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"_orig_mod.w": torch.ones(1), "w": torch.ones(1)}},
             checkpoint_id=str(tmp_path / "ckpt"), **single_process())
    with pytest.raises(MergePlanError, match="both be named 'w'.*--keep-keys"):
        fsdpckpt.merge(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_include_and_exclude_filter_names(tmp_path):
    folder = DCP_FOLDERS["fsdp2-model"]
    (result,) = fsdpckpt.merge(folder, tmp_path, include=["*weight"], exclude=["*0.weight"])
    with safe_open(str(result.path), "pt") as handle:
        names = list(handle.keys())
    assert names and all(n.endswith("weight") and not n.endswith("0.weight") for n in names)


def test_filters_that_leave_nothing_are_an_error(tmp_path):
    with pytest.raises(MergePlanError, match="no tensor left"):
        fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path / "o", include=["nothing*"])
    assert not (tmp_path / "o").exists()


def test_whole_checkpoint_merges_its_model(tmp_path):
    (result,) = fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", tmp_path)
    assert result.source.name == "pytorch_model_fsdp_0" and result.path.name == "model.safetensors"


def test_whole_checkpoint_with_optimizer_merges_both(tmp_path):
    results = fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", tmp_path, optimizer=True)
    assert [r.path.name for r in results] == ["model.safetensors", "optimizer.safetensors"]


def test_several_models_need_a_choice(tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    for i in (0, 1):
        shutil.copytree(DCP_FOLDERS["fsdp2-model"], ckpt / f"pytorch_model_fsdp_{i}")
    with pytest.raises(fsdpckpt.NotACheckpointError, match="--model-index") as caught:
        fsdpckpt.merge(ckpt, tmp_path / "out")
    assert "pytorch_model_fsdp_1" in str(caught.value)
    (result,) = fsdpckpt.merge(ckpt, tmp_path / "out", model_index=1)
    assert result.source.name == "pytorch_model_fsdp_1"


def test_chunk_runs_for_dim0_dim1_and_grids():
    from fsdpckpt.dcp.metadata import Chunk
    from fsdpckpt.merging.plan import chunk_runs

    def chunk(offsets, sizes):
        return Chunk(offsets, sizes, None, 0, 0)

    assert chunk_runs((5, 3), chunk((3, 0), (2, 3))) == (6, [9])
    assert chunk_runs((4, 5), chunk((0, 3), (4, 2))) == (2, [3, 8, 13, 18])
    assert chunk_runs((2, 4, 4), chunk((0, 2, 0), (2, 2, 4))) == (8, [8, 24])
    assert chunk_runs((), chunk((), ())) == (1, [0])
    assert chunk_runs((0, 3), chunk((0, 0), (0, 3))) == (0, [])


def test_plan_is_computed_from_metadata_alone():
    from fsdpckpt.merging.plan import plan_merge

    plan = plan_merge(fsdpckpt.read_dcp_folder(DCP_FOLDERS["fsdp2-model"]), max_shard_size=600)
    assert plan.index_name == "model.safetensors.index.json"
    assert all(f.nbytes <= 600 or len(f.tensors) == 1 for f in plan.files)
    assert [t.spec.name for f in plan.files for t in f.tensors] == [
        t.name.split(".", 1)[1] for t in plan.folder.metadata.tensors]


def test_plan_merge_takes_what_merge_takes(tmp_path):
    from fsdpckpt.merging.plan import plan_merge

    folder = DCP_FOLDERS["dtensor"]
    plan = plan_merge(str(folder), dtype="bf16", max_shard_size="5GB", include="*")
    assert plan.folder.path == folder and plan.num_tensors
    floats = [t.spec.dtype.name for t in plan.files[0].tensors if t.source.dtype.is_floating]
    assert floats and set(floats) == {"bfloat16"}
    assert plan_merge(folder, dtype=torch.float16).files[0].tensors  # a torch.dtype, a Path


@pytest.mark.parametrize("dtype, size", [("int8", None), ("bf16", "lots"), ("bf16", 0)])
def test_plan_merge_names_a_bad_dtype_or_size(dtype, size):
    from fsdpckpt.merging.plan import plan_merge

    with pytest.raises(MergePlanError, match=repr(dtype) if size is None else repr(size)):
        plan_merge(DCP_FOLDERS["dtensor"], dtype=dtype, max_shard_size=size)


@pytest.mark.parametrize("fmt, name", [("safetensors", "model.safetensors"),
                                       ("bin", "pytorch_model.bin")])
def test_a_shard_size_larger_than_the_model_writes_one_file_without_index(tmp_path, fmt, name):
    (result,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, format=fmt,
                               max_shard_size="5GB")
    assert [p.name for p in result.files] == [name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_the_plan_knows_its_stem(tmp_path):
    from fsdpckpt.merging.plan import plan_merge

    assert plan_merge(DCP_FOLDERS["fsdp2-optimizer"], stem="optimizer",
                      max_shard_size=100).stem == "optimizer"
    assert plan_merge(DCP_FOLDERS["fsdp2-model"], format="bin").stem == "pytorch_model"
