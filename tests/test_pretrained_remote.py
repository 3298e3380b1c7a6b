"""save_pretrained into and load_pretrained from object storage, on 2 ranks, against the real
S3 server: every rank uploads its own parts, the output is the local save's bytes, a failure
on one rank leaves nothing, and what was saved loads back bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_save_pretrained import TINY, _full_state, _llama, _train, _wrap

import fsdpckpt

from deep_compare import assert_same_tensors
from multirank import run_ranks

pytestmark = [pytest.mark.s3, pytest.mark.multirank]


def _save(rank: int, world: int, root: str, url: str, options: dict, fail: bool) -> dict:
    from fsdpckpt._io import multipart, spread_remote

    multipart.PART_SIZE = 5 << 20  # S3's smallest part: a file of several parts
    model = _wrap(_llama("untied"), "fsdp2")
    _train(model)
    if fail and rank == 1:
        original, calls = spread_remote._File.write, []

        def write(self, offset, data):  # the third write of rank 1 fails
            calls.append(offset)
            if len(calls) == 3:
                raise OSError(5, "simulated write failure")
            original(self, offset, data)

        spread_remote._File.write = write
    try:
        fsdpckpt.save_pretrained(model, url, base=TINY / "untied", max_shard_size="40KB",
                                 storage_options=options)
    except Exception as exc:  # noqa: BLE001 - the test asks every rank what it raised
        return {"error": type(exc).__name__, "message": str(exc)}
    fsdpckpt.save_pretrained(model, Path(root) / "local", base=TINY / "untied",
                             max_shard_size="40KB")
    # What was saved loads back into a fresh sharded model, each rank reading its own bytes.
    fresh = _wrap(_llama("untied"), "fsdp2")
    fsdpckpt.load_pretrained(fresh, url, storage_options=options)
    return {"error": None, "trained": _full_state(model), "loaded": _full_state(fresh)}


def _objects(server, root: str) -> dict[str, bytes]:
    fs = server.filesystem()
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path)
            for path, info in fs.find(root, detail=True).items() if info["type"] == "file"}


def test_two_ranks_save_to_s3_what_they_save_locally_and_load_it_back_exactly(s3, tmp_path):
    server, root = s3
    ranks = run_ranks(_save, str(tmp_path), f"s3://{root}/out", server.options, False)
    assert [r["error"] for r in ranks] == [None, None]
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert "model.safetensors.index.json" in local  # sharded: several spread files
    assert _objects(server, root) == local
    # The check's full state dicts are gathered on rank 0 (cpu_offload): compared there.
    trained, loaded = ranks[0]["trained"], ranks[0]["loaded"]
    assert_same_tensors(loaded, trained)
    initial = _llama("untied").state_dict()
    assert any(not torch.equal(value, initial[key]) for key, value in trained.items())


def test_a_failure_on_one_rank_leaves_nothing_on_s3_and_raises_on_every_rank(s3, tmp_path):
    server, root = s3
    ranks = run_ranks(_save, str(tmp_path), f"s3://{root}/out", server.options, True)
    assert ranks[1]["error"] == "OSError"
    assert ranks[0]["error"] and "simulated write failure" in ranks[0]["message"]
    assert _objects(server, root) == {}
    assert not (tmp_path / "local").exists()
