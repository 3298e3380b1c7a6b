"""One shard-index reader for every verb that reads a ``*.safetensors.index.json`` (issue 18 §3).

``load_full_state_dict``, ``convert`` and export-hf's check against ``--base`` read an index
through ``formats._shards.read_shard_index``: each refuses a file name leading out of the
index's folder, in its own words.
"""

from __future__ import annotations

import json

import pytest

from fsdpckpt import convert, load_full_state_dict
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.export._keycheck import base_weights
from fsdpckpt.formats import TensorSpec
from fsdpckpt.formats._shards import index_bytes, index_document, read_shard_index

_OUTSIDE = ["../elsewhere.safetensors", "/abs/model.safetensors", "sub/../../x.safetensors",
            "..\\x.safetensors"]


def _index(folder, name):
    folder.mkdir(exist_ok=True)
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {"w": name}}))
    return path


@pytest.mark.parametrize("name", _OUTSIDE)
def test_every_reader_refuses_a_name_outside_the_folder(tmp_path, name):
    index = _index(tmp_path / "m", name)
    with pytest.raises(NotACheckpointError, match="lies outside the index's folder"):
        read_shard_index(index)
    with pytest.raises(NotACheckpointError, match="outside the index's folder"):
        load_full_state_dict(index)
    with pytest.raises(NotACheckpointError, match="outside the index's folder"):
        convert(index, tmp_path / "dcp")
    with pytest.raises(NotACheckpointError, match=r"in its folder\); pass --base"):
        base_weights(tmp_path / "m")


def test_a_name_in_a_subfolder_stays_inside(tmp_path):
    index = _index(tmp_path / "m", "sub/model-00001-of-00001.safetensors")
    found = read_shard_index(index)
    assert found.files == [tmp_path / "m" / "sub" / "model-00001-of-00001.safetensors"]


def test_the_index_written_is_the_one_a_merge_plan_gives():
    f32 = DTYPES["float32"]
    files = [("model-00001-of-00002.safetensors", [TensorSpec("a", ("a",), f32, (2, 3))]),
             ("model-00002-of-00002.safetensors", [TensorSpec("b", ("b",), f32, (4,))])]
    doc = index_document(files)
    assert doc == {"metadata": {"total_size": 40},
                   "weight_map": {"a": "model-00001-of-00002.safetensors",
                                  "b": "model-00002-of-00002.safetensors"}}
    assert json.loads(index_bytes(doc)) == doc and index_bytes(doc).endswith(b"}\n")
