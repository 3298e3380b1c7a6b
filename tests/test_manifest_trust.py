"""`verify` cannot be fooled: the manifest checks itself, stays inside the checkpoint, and
with a cryptographic digest (kept elsewhere) pins every byte, even against changes made to
keep a file's CRC-32."""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpckpt
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.training.manifest import MANIFEST, manifest_digest, parse_manifest, read_manifest

from conftest import FIXTURES, assert_one_line_error, reseal, save_small_checkpoint
from conftest import run_cli as run
from fuzzing import damaged, fuzz_settings

_FUZZ = fuzz_settings()


def _save(folder: Path, **kwargs) -> Path:
    return save_small_checkpoint(folder, step=7, **kwargs)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("plain") / "ckpt")


@pytest.fixture
def hashed(tmp_path) -> Path:
    return _save(tmp_path / "ckpt", digest="sha256")


def _keep_crc(original: bytes, changed: bytearray, at: int) -> None:
    """Set ``changed[at:at + 4]`` so that its CRC-32 is ``original``'s again.

    CRC-32 is affine over GF(2): the CRC difference of two equal-length messages depends
    only on their XOR. The 32 bits at ``at`` give 32 independent differences, so a
    Gaussian elimination finds the bits that cancel the change: the 4-byte patch an
    attacker would use.
    """
    size, zero = len(changed), zlib.crc32(bytes(len(changed)))

    def effect(bit: int) -> int:
        delta = bytearray(size)
        delta[at + bit // 8] = 1 << (bit % 8)
        return zlib.crc32(delta) ^ zero

    rows = [(effect(bit), 1 << bit) for bit in range(32)]  # (CRC effect, which bits)
    target = zlib.crc32(changed) ^ zlib.crc32(original)
    basis: list[tuple[int, int]] = []
    for value, bits in rows:  # reduce to a basis indexed by leading bit
        for bvalue, bbits in basis:
            if value ^ bvalue < value:
                value, bits = value ^ bvalue, bits ^ bbits
        if value:
            basis.append((value, bits))
            basis.sort(reverse=True)
    flip = 0
    for bvalue, bbits in basis:
        if target ^ bvalue < target:
            target, flip = target ^ bvalue, flip ^ bbits
    assert target == 0
    for bit in range(32):
        if flip >> bit & 1:
            changed[at + bit // 8] ^= 1 << (bit % 8)
    assert zlib.crc32(changed) == zlib.crc32(original)


def _patch_weight_keeping_crc(ckpt: Path) -> Path:
    """Change one weight of the model's data file, then 4 bytes of the same tensor's data so
    the file's CRC-32 (and so its manifest entry) is unchanged."""
    from fsdpckpt.dcp._archive import locate_tensor
    from fsdpckpt.dcp.reader import read_dcp_folder

    folder = ckpt / "pytorch_model_fsdp_0"
    tensor = next(t for t in read_dcp_folder(folder).metadata.tensors
                  if t.name.endswith("0.weight"))
    chunk = tensor.chunks[0]
    path = folder / chunk.file
    original = path.read_bytes()
    with open(path, "rb") as handle:
        start = locate_tensor(handle, chunk.offset, chunk.length, source="x").storage_start
    data = bytearray(original)
    data[start:start + 4] = torch.tensor([1e6]).numpy().tobytes()  # one weight, now huge
    _keep_crc(original, data, start + 64)
    path.write_bytes(bytes(data))
    return path


# --- the manifest checks itself ---------------------------------------------------

def test_every_single_bit_flip_in_the_manifest_is_caught(plain):
    data = (plain / MANIFEST).read_bytes()
    original = parse_manifest(data, plain / MANIFEST)
    missed = []
    for index in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            try:
                decoded = parse_manifest(bytes(flipped), plain / MANIFEST)
            except CorruptCheckpointError:
                continue
            if decoded != original:  # a flip that decodes to the same content is harmless
                missed.append((index, bit))
    assert not missed, f"{len(missed)} flips read as a different, valid manifest: {missed[:5]}"


@pytest.mark.parametrize("field, value", [("step", 8), ("world_size", 2)])
def test_an_edited_field_is_a_damaged_manifest(plain, tmp_path, field, value):
    doc = json.loads((plain / MANIFEST).read_text())
    doc[field] = value
    with pytest.raises(CorruptCheckpointError, match="does not match its own checksum"):
        parse_manifest(json.dumps(doc).encode(), tmp_path / MANIFEST)


def test_a_damaged_manifest_is_one_line_from_verify(plain, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    text = (copy / MANIFEST).read_text()
    (copy / MANIFEST).write_text(text.replace('"step": 7', '"step": 9'))
    assert_one_line_error(run("verify", copy), str(copy / MANIFEST), "own checksum")


@pytest.mark.parametrize("document", [
    {"version": 2, "checksum": "x"},  # missing fields
    {"version": 3},  # from a newer fsdpckpt
    {"version": True},
    {"version": 1, "world_size": "1", "files": {}},
    {"version": 1, "world_size": 1, "step": -1, "files": {}},
    {"version": 1, "world_size": 1, "files": {"a": {"size": 1.5, "crc32": 0}}},
    {"version": 1, "world_size": 1, "files": {"a": {"size": 1, "crc32": 2**32}}},
    {"version": 1, "world_size": 1, "files": {"a": []}},
    {"version": 1, "world_size": 1, "files": {}, "chunks": {"m": [{"tensor": 1}]}},
    {"version": 1, "world_size": 1, "files": {}, "digest": "md5"},
    {"version": 1, "world_size": 1, "files": {"a": {"size": 1, "crc32": 0}}, "digest": "sha256"},
])
def test_a_manifest_off_schema_is_malformed(tmp_path, document):
    data = json.dumps({"format": "fsdpckpt-manifest", **document}).encode()
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        parse_manifest(data, tmp_path / MANIFEST)


def test_a_deeply_nested_manifest_is_one_clear_error(tmp_path):
    data = b'{"format": "fsdpckpt-manifest", "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(CorruptCheckpointError, match="nested deeper than"):
        parse_manifest(data, tmp_path / MANIFEST)


def test_a_manifest_from_before_self_checksums_is_still_read(plain, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    doc = json.loads((copy / MANIFEST).read_text())
    del doc["checksum"], doc["digest"]
    doc["version"] = 1
    doc["chunks"] = _listed_as_before(copy, doc["chunks"])
    (copy / MANIFEST).write_text(json.dumps(doc))
    assert fsdpckpt.verify_checkpoint(copy)["ok"]


_JSON_BITS = st.sampled_from([ord(c) for c in '[{"-0:e\\']) | st.integers(0, 255)


@_FUZZ
@given(data=st.data())
def test_fuzzed_manifests_raise_only_our_errors(plain, data):
    raw = data.draw(damaged((plain / MANIFEST).read_bytes(), values=_JSON_BITS))
    with contextlib.suppress(CorruptCheckpointError):
        parse_manifest(raw, plain / MANIFEST)


@_FUZZ
@given(value=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                          lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                          max_leaves=10),
       field=st.sampled_from(["version", "world_size", "step", "digest", "files", "chunks",
                              "checksum"]))
def test_any_value_in_any_field_is_read_or_refused(plain, value, field):
    doc = json.loads((plain / MANIFEST).read_text())
    doc[field] = value
    for document in (doc, reseal(doc)):
        with contextlib.suppress(CorruptCheckpointError):
            parse_manifest(json.dumps(document).encode(), plain / MANIFEST)


# --- manifest entries and folders stay inside the checkpoint ----------------------

def test_a_symlinked_folder_inside_a_checkpoint_is_a_stray(plain, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (copy / "extra").symlink_to(elsewhere)
    report = fsdpckpt.verify_checkpoint(copy)
    assert not report["ok"]
    assert [p["path"] for p in report["problems"]] == [str(copy / "extra")]
    assert "stray folder (a symlink to" in report["problems"][0]["message"]


# --- a cryptographic digest, kept elsewhere ----------------------------------------

def test_a_patch_that_keeps_the_crc_passes_crc_checks(plain, tmp_path):
    """The limit of CRC-32, and why the digest exists: this is what it lets through."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    _patch_weight_keeping_crc(copy)
    assert fsdpckpt.verify_checkpoint(copy)["ok"]


def test_a_patch_that_keeps_the_crc_is_caught_by_the_digest(hashed):
    path = _patch_weight_keeping_crc(hashed)
    report = fsdpckpt.verify_checkpoint(hashed)
    assert not report["ok"]
    (problem,) = report["problems"]
    assert problem["path"] == str(path)
    assert "sha256" in problem["message"] and "deliberately" in problem["message"]


def test_a_resealed_manifest_is_caught_by_the_expected_digest(hashed):
    kept = manifest_digest(hashed)
    path = _patch_weight_keeping_crc(hashed)
    doc = json.loads((hashed / MANIFEST).read_text())  # the attacker rewrites the manifest
    name = str(path.relative_to(hashed))
    import hashlib

    doc["files"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (hashed / MANIFEST).write_text(json.dumps(reseal(doc)))
    assert fsdpckpt.verify_checkpoint(hashed)["ok"]  # consistent in itself...
    report = fsdpckpt.verify_checkpoint(hashed, expect_digest=kept)
    assert not report["ok"]  # ...but not the checkpoint whose digest was kept
    assert "not the expected" in report["problems"][0]["message"]


def test_verify_prints_the_manifest_digest_and_checks_it(hashed):
    digest = manifest_digest(hashed)
    result = run("verify", hashed, "-q")
    assert result.exit_code == 0
    assert f"manifest digest: {digest} (files carry sha256)" in result.stdout
    assert run("verify", hashed, "-q", "--expect-digest", digest).exit_code == 0
    assert run("verify", hashed, "-q", "--expect-digest", digest.removeprefix("sha256:")
               ).exit_code == 0
    wrong = "sha256:" + "0" * 64
    result = run("verify", hashed, "-q", "--expect-digest", wrong)
    assert result.exit_code == 1 and "not the expected" in result.stdout
    doc = json.loads(run("verify", hashed, "-q", "--json").stdout)
    assert doc["manifest_digest"] == digest and doc["digest"] == "sha256"


def test_expect_digest_needs_a_manifest(tmp_path):
    from conftest import DCP_FOLDERS

    report = fsdpckpt.verify_checkpoint(DCP_FOLDERS["dtensor"], expect_digest="sha256:00")
    assert not report["ok"] and "no manifest" in report["problems"][0]["message"]


def test_save_logs_the_manifest_digest(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fsdpckpt"):
        ckpt = _save(tmp_path / "ckpt")
    assert manifest_digest(ckpt) in caplog.text


def test_the_manager_keeps_the_last_digest(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = fsdpckpt.CheckpointManager(tmp_path / "run", digest="blake2b")
    manager.save(3, model=model)
    latest = manager.latest()
    assert manager.last_digest == manifest_digest(latest)
    assert read_manifest(latest)["digest"] == "blake2b"
    assert fsdpckpt.verify_checkpoint(latest, expect_digest=manager.last_digest)["ok"]


def test_an_unknown_digest_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown digest 'md5'"):
        _save(tmp_path / "ckpt", digest="md5")
    assert not (tmp_path / "ckpt").exists()


def test_a_digest_needs_the_manifest(tmp_path):
    with pytest.raises(ValueError, match="needs manifest=True"):
        _save(tmp_path / "ckpt", digest="sha256", manifest=False)


def _listed_as_before(root, chunks):
    """Version 3's chunk checksums (8 hex digits a chunk, per file, in archive order) as
    versions 1 and 2 listed them: an object per chunk naming its tensor."""
    from fsdpckpt.dcp.reader import read_dcp_folder

    listed = {}
    for folder, files in chunks.items():
        meta = read_dcp_folder(root / folder).metadata
        located = sorted((c.file, c.offset, t.name, list(c.offsets))
                         for t in meta.tensors for c in t.chunks if c.file is not None)
        position = {f: 0 for f in files}
        listed[folder] = []
        for file, _offset, name, offsets in located:
            i = position[file]
            position[file] += 1
            listed[folder].append({"tensor": name, "offsets": offsets, "file": file,
                                   "crc32": int(files[file][8 * i:8 * i + 8], 16)})
    return listed


def test_a_version_2_manifest_still_names_the_tensor_of_a_changed_byte(plain, tmp_path):
    import shutil

    from fsdpckpt.dcp._archive import locate_tensor
    from fsdpckpt.dcp.reader import read_dcp_folder

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    doc = json.loads((copy / MANIFEST).read_text())
    doc["version"] = 2
    doc["chunks"] = _listed_as_before(copy, doc["chunks"])
    (copy / MANIFEST).write_text(json.dumps(reseal(doc)))
    folder = copy / "pytorch_model_fsdp_0"
    tensor = read_dcp_folder(folder).metadata.tensors[0]
    chunk = tensor.chunks[0]
    data = folder / str(chunk.file)
    with open(data, "rb") as f:
        start = locate_tensor(f, chunk.offset, chunk.length, source="x").storage_start
    raw = bytearray(data.read_bytes())
    raw[start] ^= 0x01  # a flipped bit in the tensor's data
    data.write_bytes(bytes(raw))
    report = fsdpckpt.verify_checkpoint(copy)
    assert not report["ok"]
    assert any(f"tensor '{tensor.name}'" in p["message"] for p in report["problems"])


def test_the_manifest_lists_8_hex_digits_a_chunk(plain):
    from fsdpckpt.dcp.reader import read_dcp_folder

    doc = json.loads((plain / MANIFEST).read_text())
    assert doc["version"] == 3
    for folder, files in doc["chunks"].items():
        meta = read_dcp_folder(plain / folder).metadata
        counts: dict[str, int] = {}
        for t in meta.tensors:
            for c in t.chunks:
                counts[str(c.file)] = counts.get(str(c.file), 0) + 1
        assert {f: len(d) for f, d in files.items()} == {f: 8 * n for f, n in counts.items()}


@pytest.mark.parametrize("digits", ["0123456", "0123456g", 12345678, ["01234567"]])
def test_chunk_checksums_that_are_not_8_hex_digits_a_chunk_are_refused(plain, digits):
    doc = json.loads((plain / MANIFEST).read_text())
    doc["chunks"]["pytorch_model_fsdp_0"]["__0_0.distcp"] = digits
    with pytest.raises(CorruptCheckpointError, match="8 hex digits a chunk"):
        parse_manifest(json.dumps(reseal(doc)).encode(), plain / MANIFEST)


def test_a_file_listed_with_one_checksum_too_few_is_named(plain, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(plain, copy)
    doc = json.loads((copy / MANIFEST).read_text())
    files = doc["chunks"]["pytorch_model_fsdp_0"]
    files["__0_0.distcp"] = files["__0_0.distcp"][8:]
    (copy / MANIFEST).write_text(json.dumps(reseal(doc)))
    data = copy / "pytorch_model_fsdp_0" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # so verify looks at the chunks of this file
    data.write_bytes(bytes(raw))
    report = fsdpckpt.verify_checkpoint(copy)
    assert any("another number of chunk checksums" in p["message"] and
               p["path"].endswith("__0_0.distcp") for p in report["problems"])


def test_every_chunk_crc_the_manifest_lists_is_the_one_its_archive_stores(plain):
    from fsdpckpt.dcp.reader import read_dcp_folder
    from fsdpckpt.training.manifest import data_entry_crc, listed_crcs

    doc = json.loads((plain / MANIFEST).read_text())
    assert set(doc["chunks"]) == {"pytorch_model_fsdp_0", "optimizer_0"}
    for folder, listed in doc["chunks"].items():
        meta = read_dcp_folder(plain / folder).metadata
        crcs, disagree = listed_crcs(listed, meta)
        assert not disagree
        for tensor in meta.tensors:
            for chunk in tensor.chunks:
                with open(plain / folder / str(chunk.file), "rb") as f:
                    stored = data_entry_crc(f, chunk.offset, chunk.length, source="x")
                assert crcs[(tensor.name, chunk.offsets)] == stored


def test_a_rank_sends_rank_0_a_crc_per_file_and_8_hex_digits_a_chunk(tmp_path, monkeypatch):
    from fsdpckpt.training import _commit

    sent = []
    real = _commit.own_checksums

    def spy(*args):
        sent.append(real(*args))
        return sent[-1]

    monkeypatch.setattr(_commit, "own_checksums", spy)
    _save(tmp_path / "ckpt")
    (files, chunks), = sent
    assert all(type(crc) is int for _size, crc, _digest in files.values())
    assert all(isinstance(d, str) and len(d) % 8 == 0 for listed in chunks.values()
               for d in listed.values())


def test_chunks_that_name_one_archive_share_its_listed_crc():
    # Empty shards of a tensor share one offset, so DCP stores them in one entry.
    from fsdpckpt.dcp.dtypes import DTYPES
    from fsdpckpt.dcp.metadata import Chunk, DcpMetadata, TensorEntry
    from fsdpckpt.training.manifest import listed_crcs

    chunks = (Chunk((0, 0), (2, 4), "__0_0.distcp", 0, 900),
              Chunk((2, 0), (0, 4), "__1_0.distcp", 0, 800),
              Chunk((2, 0), (0, 4), "__1_0.distcp", 0, 800))
    other = (Chunk((0,), (4,), "__1_0.distcp", 800, 700),)
    meta = DcpMetadata((TensorEntry("w", DTYPES["float32"], (2, 4), chunks, ("w",)),
                        TensorEntry("b", DTYPES["float32"], (4,), other, ("b",))), (), None)
    crcs, disagree = listed_crcs({"__0_0.distcp": "0000000a",
                                  "__1_0.distcp": "0000000b0000000c"}, meta)
    assert disagree == []
    assert crcs == {("w", (0, 0)): 10, ("w", (2, 0)): 11, ("b", (0,)): 12}


def _with_manifest(folder: Path) -> Path:
    """A manifest for a checkpoint some other tool wrote, made as save_state's ranks make
    theirs (each data file's archives, from its .metadata here)."""
    from fsdpckpt.dcp.reader import read_dcp_folder
    from fsdpckpt.training.manifest import build_manifest, own_checksums, write_manifest

    records: dict = {}
    archives: dict = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        part = path.parent.name if path.parent != folder else ""
        records.setdefault(part, {})[path.name] = (path.stat().st_size,
                                                   zlib.crc32(path.read_bytes()), None)
        if path.name == ".metadata":
            for tensor in read_dcp_folder(path.parent).metadata.tensors:
                for chunk in tensor.chunks:
                    archives.setdefault(part, {}).setdefault(chunk.file, []).append(
                        (chunk.offset, chunk.length))
    for part in archives:
        for file in archives[part]:
            archives[part][file] = sorted(set(archives[part][file]))
    files, chunks = own_checksums(folder, records, archives)
    write_manifest(folder, build_manifest(files, chunks, world_size=2, step=None))
    return folder


def test_changed_bytes_in_several_files_of_a_folder_are_named_in_one_pass(tmp_path,
                                                                          monkeypatch):
    import shutil

    from fsdpckpt.dcp._archive import locate_tensor
    from fsdpckpt.dcp.reader import read_dcp_folder
    from fsdpckpt.inspection import verify

    ckpt = _with_manifest(Path(shutil.copytree(FIXTURES / "fsdp2_accelerate",
                                               tmp_path / "ckpt")))
    folder = ckpt / "pytorch_model_fsdp_0"
    damaged = {}
    for tensor in read_dcp_folder(folder).metadata.tensors:
        for chunk in tensor.chunks:
            if chunk.file not in damaged and chunk.sizes[0]:
                data = folder / chunk.file
                with open(data, "rb") as f:
                    at = locate_tensor(f, chunk.offset, chunk.length, source="x").storage_start
                raw = bytearray(data.read_bytes())
                raw[at] ^= 0x01
                data.write_bytes(bytes(raw))
                damaged[chunk.file] = tensor.name
    assert len(damaged) == 2
    passes = []
    real = verify._check_chunks
    monkeypatch.setattr(verify, "_check_chunks",
                        lambda *a, **k: passes.append(k["only_files"]) or real(*a, **k))
    report = fsdpckpt.verify_checkpoint(ckpt)
    assert passes == [set(damaged)]
    for file, name in damaged.items():
        assert any(p["path"] == str(folder / file) and f"tensor '{name}'" in p["message"]
                   for p in report["problems"]), report["problems"]
