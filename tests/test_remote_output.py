"""Merged outputs on object storage: merged locally, uploaded file by file, the index last.

Against the real S3 server (tests/s3server.py): the uploaded files are byte-identical to a
local merge's, existing outputs are refused without overwrite and replaced with it, and a
failed upload leaves nothing of the merge behind.
"""

from __future__ import annotations

import json

import pytest

import fsdpckpt
from fsdpckpt._io import publish_remote as _remote_out  # where the upload (_put) lives
from fsdpckpt.merging.writer import OutputExistsError, OutputNotWritableError

from conftest import FIXTURES, assert_one_line_error, run_cli, upload

CKPT = FIXTURES / "fsdp2_accelerate"
pytestmark = pytest.mark.s3



def _remote_files(server, url: str) -> dict[str, bytes]:
    fs = server.filesystem()
    root = url.removeprefix("s3://")
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in sorted(fs.find(root))}


def _local_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("options", [{}, {"max_shard_size": "1KB"}, {"format": "bin"},
                                     {"optimizer": True, "dtype": "bf16"}],
                         ids=["safetensors", "sharded", "bin", "optimizer-bf16"])
def test_a_merge_to_s3_uploads_exactly_what_a_local_merge_writes(s3, tmp_path, options):
    server, root = s3
    out = f"s3://{root}/merged"
    results = fsdpckpt.merge(CKPT, out, storage_options=server.options, **options)
    fsdpckpt.merge(CKPT, tmp_path / "local", **options)
    assert _remote_files(server, out) == _local_files(tmp_path / "local")
    assert all(str(f).startswith(out + "/") for r in results for f in r.files)


def test_a_merge_from_s3_to_s3_equals_the_local_merge(s3, tmp_path):
    server, root = s3
    source = upload(server, CKPT, f"s3://{root}/ckpt")
    out = f"s3://{root}/merged"
    fsdpckpt.merge(source, out, storage_options=server.options, max_shard_size="2KB")
    fsdpckpt.merge(CKPT, tmp_path / "local", max_shard_size="2KB")
    assert _remote_files(server, out) == _local_files(tmp_path / "local")


def test_the_index_is_uploaded_last(s3, monkeypatch):
    server, root = s3
    order: list[str] = []
    real = _remote_out._put

    def spy(local, target):
        order.append(target.name)
        real(local, target)

    monkeypatch.setattr(_remote_out, "_put", spy)
    fsdpckpt.merge(CKPT, f"s3://{root}/merged", storage_options=server.options,
                   max_shard_size="1KB")
    assert len(order) > 2 and order[-1] == "model.safetensors.index.json"


def test_an_existing_remote_output_is_refused_before_any_work(s3):
    server, root = s3
    out = f"s3://{root}/merged"
    server.filesystem().pipe(f"{root}/merged/model.safetensors", b"earlier")
    with pytest.raises(OutputExistsError, match="model.safetensors"):
        fsdpckpt.merge(CKPT, out, storage_options=server.options)
    assert server.filesystem().cat_file(f"{root}/merged/model.safetensors") == b"earlier"


def test_overwrite_replaces_an_earlier_sharded_output_and_removes_its_stale_shards(s3, tmp_path):
    server, root = s3
    out = f"s3://{root}/merged"
    fsdpckpt.merge(CKPT, out, storage_options=server.options, max_shard_size="1KB")
    assert "model.safetensors.index.json" in _remote_files(server, out)
    fsdpckpt.merge(CKPT, out, storage_options=server.options, overwrite=True)
    fsdpckpt.merge(CKPT, tmp_path / "local")
    assert _remote_files(server, out) == _local_files(tmp_path / "local")


def test_a_failed_upload_leaves_nothing_of_the_merge(s3, monkeypatch):
    server, root = s3
    real = _remote_out._put
    calls = []

    def failing(local, target):
        calls.append(target)
        if len(calls) == 3:
            raise OSError("connection reset")
        real(local, target)

    monkeypatch.setattr(_remote_out, "_put", failing)
    with pytest.raises(OutputNotWritableError, match="upload failed"):
        fsdpckpt.merge(CKPT, f"s3://{root}/merged", storage_options=server.options,
                       max_shard_size="1KB")
    # (SeaweedFS may keep an empty folder entry; no object is left inside it.)
    left = server.filesystem().find(f"{root}/merged")
    assert [p for p in left if p.startswith(f"{root}/merged/")] == []


def test_an_output_url_that_is_a_file_is_refused(s3):
    server, root = s3
    server.filesystem().pipe(f"{root}/taken", b"x")
    with pytest.raises(OutputNotWritableError, match="is a file"):
        fsdpckpt.merge(CKPT, f"s3://{root}/taken", storage_options=server.options)


def test_the_cli_merges_to_s3_and_reports_the_urls(s3):
    server, root = s3
    out = f"s3://{root}/merged"
    result = run_cli("merge", CKPT, out, "--storage-options", json.dumps(server.options),
                     "--json")
    assert result.exit_code == 0, result.output
    files = json.loads(result.stdout)["outputs"][0]["files"]
    assert files == [f"{out}/model.safetensors"]


def test_the_cli_refuses_an_existing_remote_output_in_one_line(s3):
    server, root = s3
    server.filesystem().pipe(f"{root}/merged/model.safetensors", b"earlier")
    result = run_cli("merge", CKPT, f"s3://{root}/merged", "--storage-options",
                     json.dumps(server.options))
    assert_one_line_error(result, f"s3://{root}/merged/model.safetensors", "--overwrite")


def test_merge_weights_takes_urls_on_both_sides_as_accelerate_would_take_paths(s3, tmp_path):
    server, root = s3
    source = upload(server, CKPT / "pytorch_model_fsdp_0", f"s3://{root}/ckpt/pytorch_model_fsdp_0")
    out = f"s3://{root}/merged"
    result = run_cli("merge-weights", source, out, "--storage-options",
                     json.dumps(server.options), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["output"] == f"{out}/model.safetensors"
    fsdpckpt.merge_fsdp_weights(str(CKPT / "pytorch_model_fsdp_0"), str(tmp_path / "local"))
    assert _remote_files(server, out) == _local_files(tmp_path / "local")


# -- a merge spread over ranks into object storage (no shared file system needed) ----------

def _spread_to_s3(rank: int, world: int, out: str, storage: dict, fail_upload_on: int) -> str:
    import torch.distributed as dist

    if rank == fail_upload_on:
        def failing(local, target):
            raise OSError("injected: connection reset")

        _remote_out._put = failing
    try:
        results = fsdpckpt.merge(CKPT, out, max_shard_size=600, optimizer=True,
                                 process_group=dist.group.WORLD, storage_options=storage)
    except fsdpckpt.FsdpCkptError as exc:
        return "error: " + str(exc)
    return json.dumps([[str(f) for f in r.files] for r in results])


@pytest.mark.multirank
def test_a_spread_merge_to_s3_uploads_exactly_the_single_process_merge(s3, tmp_path):
    from multirank import run_ranks

    server, root = s3
    out = f"s3://{root}/spread"
    per_rank = run_ranks(_spread_to_s3, out, server.options, -1)
    assert per_rank[0] == per_rank[1] and not per_rank[0].startswith("error")
    fsdpckpt.merge(CKPT, tmp_path / "single", max_shard_size=600, optimizer=True)
    assert _remote_files(server, out) == _local_files(tmp_path / "single")
    files = json.loads(per_rank[0])
    assert files[0][-1] == f"{out}/model.safetensors.index.json"  # the index named last


@pytest.mark.multirank
def test_a_failed_upload_on_one_rank_leaves_nothing_of_a_spread_merge(s3):
    from multirank import run_ranks

    server, root = s3
    out = f"s3://{root}/spread"
    errors = run_ranks(_spread_to_s3, out, server.options, 1)
    assert "injected: connection reset" in errors[1]
    assert errors[0].startswith("error: rank 1 failed, so rank 0 stops too")
    left = server.filesystem().find(f"{root}/spread")
    assert [p for p in left if p.startswith(f"{root}/spread/")] == []


# -- export-hf and convert into object storage ---------------------------------------------

def _tree(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _remote_tree(server, url: str) -> dict[str, bytes]:
    fs = server.filesystem()
    root = url.removeprefix("s3://") + "/"
    return {k[len(root):]: fs.cat_file(k) for k in sorted(fs.find(root)) if k.startswith(root)}


def test_an_export_to_s3_uploads_the_local_export_config_last(s3, tmp_path, monkeypatch):
    server, root = s3
    checkpoint = FIXTURES / "tiny_llama" / "untied" / "checkpoint-3"
    order: list[str] = []
    real = _remote_out._put

    def spy(local, target):
        order.append(target.name)
        real(local, target)

    monkeypatch.setattr(_remote_out, "_put", spy)
    out = f"s3://{root}/exported"
    result = fsdpckpt.export_hf(checkpoint, out, dtype="bf16", max_shard_size="200KB",
                                storage_options=server.options)
    fsdpckpt.export_hf(checkpoint, tmp_path / "local", dtype="bf16", max_shard_size="200KB")
    assert _remote_tree(server, out) == _tree(tmp_path / "local")
    assert order[-1] == "config.json" and str(result.output) == out
    with pytest.raises(OutputExistsError, match="already holds files"):
        fsdpckpt.export_hf(checkpoint, out, storage_options=server.options)


def test_a_convert_to_s3_uploads_the_local_dcp_folder_metadata_last(s3, tmp_path, monkeypatch):
    server, root = s3
    merged = fsdpckpt.merge(CKPT, tmp_path / "merged")[0].path
    order: list[str] = []
    real = _remote_out._put

    def spy(local, target):
        order.append(target.name)
        real(local, target)

    monkeypatch.setattr(_remote_out, "_put", spy)
    out = f"s3://{root}/seed/pytorch_model_fsdp_0"
    result = fsdpckpt.convert(merged, out, storage_options=server.options)
    fsdpckpt.convert(merged, tmp_path / "local")
    assert _remote_tree(server, out) == _tree(tmp_path / "local")
    assert order[-1] == ".metadata" and str(result.path) == out
    # What was uploaded is a DCP folder fsdpckpt reads back from the store.
    assert fsdpckpt.inspect_checkpoint(out, storage_options=server.options).ok
