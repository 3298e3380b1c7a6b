"""export-hf of a checkpoint on object storage: the same folder as the local export, byte
for byte, with the config, tokenizer and chat template downloaded from where trainers leave
them (or from a remote --base), each size-checked before it is read.

The server is SeaweedFS on loopback (tests/s3server.py); each test uploads a committed
tiny-Llama run into its own folder. The output stays local.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import fsdpckpt
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.export import _config

from conftest import FIXTURES, assert_one_line_error, run_cli, upload

TINY = FIXTURES / "tiny_llama"



def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(tmp_path: Path, variant: str = "untied") -> Path:
    """A copy of the tiny run without the reference weights (not part of a run)."""
    run = shutil.copytree(TINY / variant, tmp_path / "run")
    (run / "trained.safetensors").unlink()
    return run


@pytest.mark.s3
@pytest.mark.parametrize("variant", ["untied", "tied"])
@pytest.mark.parametrize("options", [{}, {"dtype": "bf16", "max_shard_size": "100KB"}],
                         ids=["plain", "bf16-sharded"])
def test_export_of_a_remote_checkpoint_is_the_local_export_byte_for_byte(s3, tmp_path, variant,
                                                                         options):
    server, root = s3
    run = _run(tmp_path, variant)
    url = upload(server, run, f"s3://{root}/run")
    remote = fsdpckpt.export_hf(f"{url}/checkpoint-3", tmp_path / "remote",
                                storage_options=server.options, **options)
    local = fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "local", **options)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
    assert str(remote.config_from) == f"{url}/config.json"
    assert remote.tied == local.tied and remote.tensors == local.tensors


@pytest.mark.s3
def test_a_remote_base_gives_the_config_and_tokenizer(s3, tmp_path):
    server, root = s3
    run = _run(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (run / name).rename(base / name)
    url = upload(server, run, f"s3://{root}/run")
    base_url = upload(server, base, f"s3://{root}/base")
    result = fsdpckpt.export_hf(f"{url}/checkpoint-3", tmp_path / "out", base=base_url,
                                storage_options=server.options)
    assert str(result.config_from) == f"{base_url}/config.json"
    fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "local", base=base)
    assert _files(tmp_path / "out") == _files(tmp_path / "local")


@pytest.mark.s3
def test_a_remote_side_file_over_the_bound_is_refused_before_it_is_read(s3, tmp_path,
                                                                       monkeypatch):
    server, root = s3
    url = upload(server, _run(tmp_path), f"s3://{root}/run")
    monkeypatch.setattr(_config, "MAX_SIDE_BYTES", 1000)  # tokenizer.json is larger
    with pytest.raises(NotACheckpointError, match=f"{url}/tokenizer.json"):
        fsdpckpt.export_hf(f"{url}/checkpoint-3", tmp_path / "out",
                           storage_options=server.options)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.s3
def test_the_cli_exports_a_remote_checkpoint_with_storage_options(s3, tmp_path):
    server, root = s3
    url = upload(server, _run(tmp_path), f"s3://{root}/run")
    result = run_cli("export-hf", f"{url}/checkpoint-3", tmp_path / "out", "--storage-options",
                     json.dumps(server.options), "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["source"].startswith(f"{url}/checkpoint-3")
    assert (tmp_path / "out" / "config.json").is_file()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (TINY / "untied" / "tokenizer.json").read_bytes()


@pytest.mark.s3
def test_a_remote_lora_export_without_an_adapter_is_one_line_naming_it(s3, tmp_path):
    server, root = s3
    url = upload(server, _run(tmp_path), f"s3://{root}/run")
    result = run_cli("export-hf", f"{url}/checkpoint-3", tmp_path / "out", "--lora", "adapter",
                     "--storage-options", json.dumps(server.options))
    assert_one_line_error(result, f"{url}/checkpoint-3", "--lora")
    assert not (tmp_path / "out").exists()
