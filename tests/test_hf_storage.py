"""Folders written by torch's ``HuggingFaceStorageWriter`` read as DCP folders.

The fixtures come from real 2-rank FSDP2 runs (fixtures/generate_hf_storage.py): per-rank
``shard-*`` files (the tiny Llama), and a consolidated save (``model-*-of-*`` files, index,
``sharded/``). The reference for every merge is torch's own reader on the same folder:
``dcp.load`` through ``HuggingFaceStorageReader``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from fsdpckpt import (
    export_hf,
    find_layout,
    inspect_checkpoint,
    load_full_state_dict,
    merge,
    verify_checkpoint,
)
from fsdpckpt.dcp._hfstorage import MODEL_PART, SHARDS_PART, parse_header
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from tests.fuzzing import damaged, fuzz_settings

from conftest import single_process, torch_dcp_class
from deep_compare import assert_same_tensors

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SHARDS = FIXTURES / "hf_storage" / "shards"
CONSOLIDATED = FIXTURES / "hf_storage" / "consolidated"
LLAMA = FIXTURES / "tiny_llama" / "untied"
RANK1 = "shard-00001-model-00001-of-00001.safetensors"
RANK2 = "shard-00002-model-00001-of-00001.safetensors"

# torch's reader and writer say they run in one process, as the tests mean them to.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FOLDERS = {"shards": SHARDS, "consolidated": CONSOLIDATED,
           "sharded": CONSOLIDATED / "sharded"}


def _torch_reads(folder: Path) -> dict[str, torch.Tensor]:
    """The full state dict torch's own HuggingFaceStorageReader loads from ``folder``."""
    import torch.distributed.checkpoint as dcp

    HuggingFaceStorageReader = torch_dcp_class("HuggingFaceStorageReader")
    meta = HuggingFaceStorageReader(str(folder)).read_metadata()
    state = {fqn: torch.empty(md.size, dtype=md.properties.dtype)
             for fqn, md in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), **single_process())
    return state


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def _rewrite(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _shift_rank2(folder: Path, name: str, offsets: list[int]) -> None:
    """Make rank 2's header say its piece of ``name`` starts at ``offsets``."""
    header, body = _header(folder / RANK2)
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info[name]["saved_offsets"] = offsets
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    _rewrite(folder / RANK2, header, body)


# ------------------------------------------------------------------- layout and inspect

def test_per_rank_shard_files_are_one_model_part_written_by_two_ranks():
    report = inspect_checkpoint(SHARDS)
    assert report.ok and report.style == "hf-storage"
    assert [(p.name, p.kind) for p in report.parts] == [(SHARDS_PART, "model")]
    assert (report.world_size, report.world_size_exact) == (2, True)
    embed = {t.name: t for t in report.parts[0].tensors}["model.embed_tokens.weight"]
    assert (list(embed.shape), embed.sharding) == ([103, 64], "dim0 x2 uneven")


def test_a_consolidated_folder_is_read_from_its_whole_files_with_sharded_listed_beside():
    report = inspect_checkpoint(CONSOLIDATED)
    assert report.ok and report.style == "hf-storage"
    assert [p.name for p in report.parts] == [MODEL_PART]
    assert report.other_files == ("sharded/",)
    assert {t.name: t.sharding for t in report.parts[0].tensors} == dict.fromkeys(
        ["0.weight", "0.bias", "2.weight", "2.bias"], "replicated")
    assert report.world_size == 2  # from sharded/'s names


def test_the_cli_inspects_a_save_and_names_its_writer():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "fsdpckpt", "inspect", str(SHARDS)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "HuggingFaceStorageWriter save, world size 2" in result.stdout


@pytest.mark.parametrize("which", FOLDERS)
def test_each_mode_verifies_clean(which):
    report = verify_checkpoint(FOLDERS[which])
    assert report.ok, report.problems


def test_a_plain_hugging_face_model_folder_is_still_not_a_checkpoint(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(NotACheckpointError, match="no checkpoint here"):
        find_layout(tmp_path)


# ------------------------------------------------------------------- bit-exact reads

@pytest.mark.parametrize("which", FOLDERS)
def test_merge_is_bit_exact_against_torchs_own_reader(which, tmp_path):
    merge(FOLDERS[which], tmp_path)
    assert_same_tensors(load_file(tmp_path / "model.safetensors"), _torch_reads(FOLDERS[which]))


@pytest.mark.parametrize("which", FOLDERS)
def test_load_full_state_dict_is_bit_exact_against_torchs_own_reader(which):
    assert_same_tensors(load_full_state_dict(FOLDERS[which]), _torch_reads(FOLDERS[which]))


def test_the_shards_merge_to_the_trained_llama_and_consolidation_to_its_files(tmp_path):
    merge(SHARDS, tmp_path / "llama")
    assert_same_tensors(load_file(tmp_path / "llama" / "model.safetensors"),
                load_file(LLAMA / "trained.safetensors"))
    merge(CONSOLIDATED, tmp_path / "small")
    whole = {**load_file(CONSOLIDATED / "model-00001-of-00002.safetensors"),
             **load_file(CONSOLIDATED / "model-00002-of-00002.safetensors")}
    assert_same_tensors(load_file(tmp_path / "small" / "model.safetensors"), whole)


def test_a_rank0_save_without_distribution_is_read(tmp_path):
    import torch.distributed.checkpoint as dcp

    HuggingFaceStorageWriter = torch_dcp_class("HuggingFaceStorageWriter")
    state = {"a": torch.arange(12, dtype=torch.float32).view(3, 4),
             "b": torch.arange(5, dtype=torch.int64), "empty": torch.ones(0, 3)}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "ckpt")),
             **single_process())
    assert find_layout(tmp_path / "ckpt").parts[0].name == MODEL_PART
    assert_same_tensors(load_full_state_dict(tmp_path / "ckpt"), state)


def test_export_hf_of_shards_gives_the_trained_llama(tmp_path):
    export_hf(SHARDS, tmp_path / "out", base=LLAMA)
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"),
                load_file(LLAMA / "trained.safetensors"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]


# ------------------------------------------------------------------- damaged folders

def test_a_missing_rank_file_is_named(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    (folder / RANK1).unlink()
    with pytest.raises(CheckpointNotFoundError, match=RANK1):
        merge(folder, tmp_path / "out")
    with pytest.raises(CheckpointNotFoundError, match=RANK1):
        load_full_state_dict(folder)


def test_a_missing_consolidated_file_is_named(tmp_path):
    folder = _copy(CONSOLIDATED, tmp_path)
    (folder / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="model-00001-of-00002.safetensors"):
        inspect_checkpoint(folder)


def test_data_offsets_past_the_end_are_one_corrupt_error(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    header, body = _header(folder / RANK2)
    header["model.norm.weight"]["data_offsets"][1] = len(body) + 4
    _rewrite(folder / RANK2, header, body)
    with pytest.raises(CorruptCheckpointError, match=r"model.norm.weight.*outside"):
        merge(folder, tmp_path / "out")
    assert not verify_checkpoint(folder).ok


def test_a_truncated_shard_is_one_corrupt_error(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    data = (folder / RANK2).read_bytes()
    (folder / RANK2).write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError, match=RANK2):
        load_full_state_dict(folder)


def test_overlapping_shards_are_one_corrupt_error(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    _shift_rank2(folder, "model.embed_tokens.weight", [40, 0])  # rank 1 holds rows 0..51
    with pytest.raises(CorruptCheckpointError, match=r"embed_tokens.*overlap"):
        merge(folder, tmp_path / "out")
    assert not inspect_checkpoint(folder).ok


def test_shards_that_leave_a_gap_are_one_corrupt_error(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    _shift_rank2(folder, "model.embed_tokens.weight", [60, 0])
    with pytest.raises(CorruptCheckpointError, match=r"embed_tokens.*gap"):
        load_full_state_dict(folder)


def test_saved_offsets_of_the_wrong_rank_are_one_corrupt_error(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    _shift_rank2(folder, "model.norm.weight", [0, 0])
    with pytest.raises(CorruptCheckpointError, match="model.norm.weight.*saved_offsets"):
        merge(folder, tmp_path / "out")


def test_a_header_length_beyond_the_file_is_refused_before_it_is_read(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    data = bytearray((folder / RANK2).read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (folder / RANK2).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="header"):
        inspect_checkpoint(folder)


def test_bytes_no_tensor_owns_are_a_verify_problem(tmp_path):
    folder = _copy(SHARDS, tmp_path)
    with open(folder / RANK2, "ab") as file:
        file.write(b"\0" * 16)
    report = verify_checkpoint(folder)
    assert not report.ok and any("belong to no tensor" in p.message for p in report.problems)


# ------------------------------------------------------------------- fuzz

_HEADER_SOURCE = (CONSOLIDATED / "sharded" / "shard-00002-model-00002-of-00002.safetensors")


@fuzz_settings(0.5)
@given(damaged(_HEADER_SOURCE.read_bytes(),
               where=lambda data: st.integers(0, min(len(data) - 1, 400))))
def test_the_header_parser_raises_only_fsdpckpt_errors_on_damaged_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "x.safetensors"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        header = parse_header(fd, len(data), str(path))
    except CorruptCheckpointError:
        return
    finally:
        os.close(fd)
    for _dtype, _shape, begin, end in header.tensors.values():
        assert 0 <= begin <= end <= header.data_size
