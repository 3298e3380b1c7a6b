"""Every byte read is checked before anything made from it is committed (issue 17 §3).

Each chunk of a ``.distcp`` file, and each ``.bin``, is a ``torch.save`` zip whose directory
records a CRC-32 per entry. One flipped bit inside a tensor's data must stop every reader of
tensor bytes with one :class:`ChecksumError` naming the file, before any output appears:
merge, merge-weights, the spread merge, export-hf (plain, tied check, LoRA adapter and
fuse), ``load_full_state_dict``, diff, convert's ``.bin`` input and ``load_state``. An
untouched checkpoint still merges bit for bit.
"""

from __future__ import annotations

import io
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

import fsdpckpt
from fsdpckpt import ChecksumError, CorruptCheckpointError
from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp.reader import read_dcp_folder

from conftest import FIXTURES, assert_one_line_error, run_cli, save_small_checkpoint

CKPT = FIXTURES / "fsdp2_accelerate"


def flip_tensor_bit(folder: Path, name: str | None = None) -> tuple[str, Path]:
    """Flip one bit in the middle of the data of the first chunk of tensor ``name`` (or of
    the first tensor with data) of the DCP folder ``folder``; ``(tensor, file)``."""
    meta = read_dcp_folder(folder).metadata
    for tensor in meta.tensors:
        if name is not None and tensor.name != name:
            continue
        for chunk in tensor.chunks:
            if chunk.file is None or chunk.transforms or not chunk.numel:
                continue
            path = folder / chunk.file
            with path.open("rb") as file:
                raw = locate_tensor(file, chunk.offset, chunk.length, source=str(path))
            data = bytearray(path.read_bytes())
            data[raw.storage_start + raw.storage_nbytes // 2] ^= 0x10
            path.write_bytes(bytes(data))
            return tensor.name, path
    raise AssertionError(f"no tensor data to damage in {folder}")


def flip_bin_bit(path: Path) -> None:
    """Flip one bit inside the first tensor storage entry of the torch.save file ``path``."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size)
    at = info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
    data[at + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged(tmp_path) -> tuple[Path, Path]:
    """A copy of the FSDP2 Accelerate checkpoint with one bit flipped in a model tensor's
    data; ``(checkpoint, damaged file)``."""
    ckpt = Path(shutil.copytree(CKPT, tmp_path / "ckpt"))
    _, path = flip_tensor_bit(ckpt / "pytorch_model_fsdp_0")
    return ckpt, path


def test_merge_of_a_flipped_bit_exits_1_naming_the_file_and_writes_no_output(damaged, tmp_path):
    ckpt, path = damaged
    result = run_cli("merge", ckpt, tmp_path / "out", "--quiet")
    assert_one_line_error(result, path, "CRC-32")
    assert not (tmp_path / "out").exists()


def test_merge_raises_checksum_error_a_corrupt_checkpoint_error(damaged, tmp_path):
    ckpt, path = damaged
    with pytest.raises(ChecksumError, match="flipped bit") as caught:
        fsdpckpt.merge(ckpt, tmp_path / "out")
    assert isinstance(caught.value, CorruptCheckpointError) and str(path) in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_merge_into_an_existing_folder_leaves_it_as_it_was(damaged, tmp_path):
    ckpt, _ = damaged
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ChecksumError):
        fsdpckpt.merge(ckpt, out, format="bin", max_shard_size=600)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_merge_weights_of_a_flipped_bit_exits_1_and_writes_nothing(damaged, tmp_path):
    ckpt, path = damaged
    result = run_cli("merge-weights", ckpt / "pytorch_model_fsdp_0", tmp_path / "out", "--quiet")
    assert_one_line_error(result, path, "CRC-32")
    assert not (tmp_path / "out").exists()


def test_an_untouched_checkpoint_still_merges_bit_exact(tmp_path):
    from conftest import reference_state_dict
    from deep_compare import assert_same_state

    folder = CKPT / "pytorch_model_fsdp_0"
    (result,) = fsdpckpt.merge(folder, tmp_path / "out", keep_keys=True)
    reference = reference_state_dict(folder)
    assert_same_state(
        fsdpckpt.load_full_state_dict(result.path),
        next(iter(reference.values())) if len(reference) == 1 else reference,
    )


def test_load_full_state_dict_of_a_flipped_bit_raises_naming_the_file(damaged):
    ckpt, path = damaged
    with pytest.raises(ChecksumError, match="CRC-32") as caught:
        fsdpckpt.load_full_state_dict(ckpt / "pytorch_model_fsdp_0")
    assert str(path) in str(caught.value)


def test_diff_of_a_flipped_bit_raises_instead_of_reporting_a_difference(damaged):
    ckpt, path = damaged
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.diff(CKPT, ckpt)
    assert str(path) in str(caught.value)


def test_a_flipped_bit_in_a_non_tensor_entry_is_a_checksum_error(tmp_path):
    from fsdpckpt.dcp._objects import read_object

    folder = Path(shutil.copytree(CKPT / "optimizer_0", tmp_path / "opt"))
    meta = read_dcp_folder(folder).metadata
    entry = next(o for o in meta.objects if o.file is not None and o.length > 200)
    path = folder / str(entry.file)
    data = bytearray(path.read_bytes())
    archive = zipfile.ZipFile(io.BytesIO(data[entry.offset : entry.offset + entry.length]))
    pkl = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    at = entry.offset + pkl.header_offset
    name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
    data[at + 30 + name_len + extra_len + pkl.file_size - 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="CRC-32"), path.open("rb") as file:
        read_object(file, entry, source=str(path))


def test_convert_of_a_bin_with_a_flipped_bit_exits_1_and_writes_nothing(tmp_path):
    import torch

    source = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8)}, source)
    flip_bin_bit(source)
    result = run_cli("convert", source, tmp_path / "out")
    assert_one_line_error(result, source, "CRC-32")
    assert not (tmp_path / "out").exists()


def test_load_state_of_a_flipped_bit_raises_and_changes_no_parameter(tmp_path):
    import torch

    ckpt = save_small_checkpoint(tmp_path / "ckpt")
    _, path = flip_tensor_bit(ckpt / "pytorch_model_fsdp_0")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.load_state(ckpt, model, optimizer)
    assert str(path) in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_load_state_of_a_flipped_bit_in_the_optimizer_changes_no_parameter(tmp_path):
    import torch

    ckpt = save_small_checkpoint(tmp_path / "ckpt")
    flip_tensor_bit(ckpt / "optimizer_0")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ChecksumError):
        fsdpckpt.load_state(ckpt, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- export-hf ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_export_hf_of_a_flipped_bit_exits_1_and_writes_nothing(variant, tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES / "tiny_llama" / variant, tmp_path / "run"))
    _, path = flip_tensor_bit(ckpt / "checkpoint-3" / "pytorch_model_fsdp_0")
    result = run_cli("export-hf", ckpt / "checkpoint-3", tmp_path / "out", "--quiet")
    assert_one_line_error(result, path, "CRC-32")
    assert not (tmp_path / "out").exists()


def test_the_tied_weight_check_reads_a_flipped_bit_as_damage_not_as_untied(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES / "tiny_llama" / "tied", tmp_path / "run"))
    folder = ckpt / "checkpoint-3" / "pytorch_model_fsdp_0"
    head = next(
        t.name
        for t in read_dcp_folder(folder).metadata.tensors
        if t.name.endswith("lm_head.weight")
    )
    _, path = flip_tensor_bit(folder, head)
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.export_hf(ckpt / "checkpoint-3", tmp_path / "out")
    assert str(path) in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def lora_run(tmp_path):
    """A PEFT Llama saved with DCP, its adapter_config.json beside it, and its base folder."""
    peft = pytest.importorskip("peft")
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    def llama():
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    base = tmp_path / "base"
    llama().save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "untied" / name, base / name)
    model = peft.get_peft_model(
        llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    )
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    return ckpt, base


@pytest.mark.parametrize("mode", ["adapter", "fuse"])
def test_export_hf_lora_of_a_flipped_bit_raises_and_writes_nothing(lora_run, mode, tmp_path):
    ckpt, base = lora_run
    folder = ckpt / "pytorch_model_fsdp_0"
    names = [t.name for t in read_dcp_folder(folder).metadata.tensors]
    # The adapter reads the LoRA matrices; the fuse reads them and the base weights.
    _, path = flip_tensor_bit(folder, next(n for n in names if "lora_A" in n))
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora=mode)
    assert str(path) in str(caught.value)
    assert not (tmp_path / "out").exists()


# -- the spread merge --------------------------------------------------------------------


def _spread_merge(rank: int, world: int, ckpt: str, out: str) -> str:
    import torch.distributed as dist

    try:
        fsdpckpt.merge(ckpt, out, max_shard_size=600, process_group=dist.group.WORLD)
    except fsdpckpt.FsdpCkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multirank
def test_the_spread_merge_of_a_flipped_bit_fails_on_every_rank_and_leaves_nothing(
    damaged, tmp_path
):
    from multirank import run_ranks

    ckpt, path = damaged
    errors = run_ranks(_spread_merge, str(ckpt), str(tmp_path / "new" / "out"))
    assert all("CRC-32" in e and str(path) in e for e in errors), errors
    assert not (tmp_path / "new").exists()


# -- what verify says of formats that record no checksum ---------------------------------


def test_verify_names_the_safetensors_files_it_could_not_check_without_a_manifest():
    report = fsdpckpt.verify_checkpoint(FIXTURES / "hf_storage" / "consolidated")
    assert report.ok and not report.manifest
    assert report.unchecked and all(f.endswith(".safetensors") for f in report.unchecked)
    assert report.to_json()["unchecked"] == list(report.unchecked)
    result = run_cli("verify", FIXTURES / "hf_storage" / "consolidated", "--quiet")
    assert result.exit_code == 0
    assert f"unchecked: {len(report.unchecked)} files record no checksums" in result.stdout


def test_verify_of_a_dcp_checkpoint_leaves_nothing_unchecked():
    report = fsdpckpt.verify_checkpoint(CKPT)
    assert report.ok and report.unchecked == ()
    assert "unchecked" not in run_cli("verify", CKPT, "--quiet").stdout


# -- the same bytes through object storage -------------------------------------------------


@pytest.mark.s3
@pytest.mark.parametrize("target", ["local", "remote"])
def test_a_remote_merge_of_a_flipped_bit_fails_and_commits_nothing(s3, damaged, tmp_path, target):
    from conftest import upload

    server, root = s3
    ckpt, path = damaged
    url = upload(server, ckpt, f"s3://{root}/ckpt")
    out = str(tmp_path / "out") if target == "local" else f"s3://{root}/out"
    with pytest.raises(ChecksumError, match="CRC-32") as caught:
        fsdpckpt.merge(url, out, storage_options=server.options)
    assert path.name in str(caught.value) and str(caught.value).startswith("s3://")
    if target == "local":
        assert not (tmp_path / "out").exists()
    else:
        assert not server.filesystem().find(f"{root}/out")


class _Ema:
    """Custom state holding a tensor, saved beside the model (``extra=``)."""

    def __init__(self, value: float) -> None:
        import torch

        self.weights = torch.full((1024,), value)

    def state_dict(self) -> dict:
        return {"weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.weights = state["weights"]


def test_load_state_of_a_flipped_bit_in_a_side_file_raises_before_torch_reads_it(tmp_path):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = tmp_path / "ckpt"
    fsdpckpt.save_state(ckpt, model, extra={"ema": _Ema(1.0)}, step=1)
    side = next(p for p in ckpt.iterdir() if p.name.startswith("custom_checkpoint"))
    flip_bin_bit(side)
    ema = _Ema(0.0)
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.load_state(ckpt, model, extra={"ema": ema})
    assert str(side) in str(caught.value)
    assert torch.equal(ema.weights, torch.zeros(1024))


@pytest.mark.parametrize("fixture", ["accelerate_rank_bin", "accelerate_rank_bin_fsdp1"])
def test_a_merge_of_per_rank_files_with_a_flipped_bit_raises_and_writes_nothing(fixture, tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES / fixture, tmp_path / "ckpt"))
    damaged_file = next(p for p in sorted(ckpt.iterdir()) if p.name.startswith("pytorch_model"))
    flip_bin_bit(damaged_file)
    with pytest.raises(ChecksumError) as caught:
        fsdpckpt.merge(ckpt, tmp_path / "out")
    assert str(damaged_file) in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_crc_computed_beside_the_write_is_the_crc_computed_inline(tmp_path):
    """CheckedRead.read_at(later=True) (the merge's blocks, their CRC on the other core while
    they are written) gives the same CRC as reading inline, over buffers taking turns."""
    import os
    import zlib

    from fsdpckpt.dcp._checked import CheckedRead

    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "entry"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for later in (False, True):
            checked = CheckedRead(fd, 0, len(data), zlib.crc32(data), source="entry")
            buffers = [memoryview(bytearray(4096)), memoryview(bytearray(4096))]
            for turn, at in enumerate(range(0, len(data), 4096)):
                view = buffers[turn % 2][:min(4096, len(data) - at)]
                checked.read_at(view, at, later=later)
            checked.finish()  # raises if the CRC differs
        wrong = CheckedRead(fd, 0, len(data), zlib.crc32(data) ^ 1, source="entry")
        wrong.read_at(memoryview(bytearray(4096)), 0, later=True)
        with pytest.raises(ChecksumError):
            wrong.finish()
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_flipped_bit_in_any_block_of_a_large_chunk_fails_the_merge(where, tmp_path):
    # A chunk of many 256 KiB blocks, checked beside the writes: the first, a middle and the
    # last block each caught, and nothing published.
    import torch

    from chunked import flip_stored_byte, split, write_dcp

    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(1024, 1024), split([0]))})
    flip_stored_byte(folder, where=where)
    with pytest.raises(ChecksumError):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_forked_child_checks_with_a_crc_thread_of_its_own(tmp_path):
    """The CRC thread is made on first use; a child forked after it (a DataLoader worker)
    would otherwise hand its blocks to a thread it does not have and wait forever."""
    import os

    import torch

    from chunked import split, write_dcp

    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(512, 512), split([0]))})
    fsdpckpt.merge(folder, tmp_path / "parent")  # the parent's thread now exists
    pid = os.fork()
    if pid == 0:  # the child: merge again, exit 0 when done (a hang fails by the timeout)
        try:
            fsdpckpt.merge(folder, tmp_path / "child")
        finally:
            os._exit(0 if (tmp_path / "child" / "model.safetensors").exists() else 1)
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the forked child's checked merge did not finish")
