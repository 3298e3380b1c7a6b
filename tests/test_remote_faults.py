"""Object storage faults: every remote command ends in bounded time with one line naming
the URL, and nothing half-written is ever seen as committed (issue 17 §6).

The faults come from tests/faultproxy.py, a loopback HTTP proxy in front of the session's
SeaweedFS server (tests/s3server.py): 5xx answers, a stall, a truncated body, a flipped
byte, and the server gone in the middle of an upload (the proxy answers nothing) and back;
and a server of this module's own, killed (SIGKILL) in the middle of a ``save_state`` and
restarted on its data. The tests pass short timeouts through ``--storage-options``, as users
can, so that a stall costs seconds; one test pins the defaults.
"""

from __future__ import annotations

import json
import time

import pytest

import fsdpckpt
from fsdpckpt._io.remote import location
from fsdpckpt.errors import RemoteStorageError, RemoteTimeoutError

from conftest import FIXTURES, assert_one_line_error, run_cli, upload
from faultproxy import FaultProxy

CKPT = FIXTURES / "fsdp2_accelerate"
pytestmark = pytest.mark.s3
#: Timeouts the tests pass through --storage-options, so a stall costs a second or two.
FAST = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
#: The bound, in seconds, within which a command against a faulty endpoint must end here.
BOUND = 20.0


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as running:
        yield running


@pytest.fixture
def ckpt(s3):
    """The example checkpoint, uploaded directly (not through the proxy)."""
    server, root = s3
    return upload(server, CKPT, f"s3://{root}/ckpt")


def _cli(proxy: FaultProxy, *args: object, **options: object):
    """The CLI through the proxy (its --storage-options, with FAST timeouts); the seconds."""
    storage = json.dumps(proxy.storage_options(**FAST, **options))
    start = time.monotonic()
    result = run_cli(*args, "--storage-options", storage)
    return result, time.monotonic() - start


def _assert_network_line(result, url: str) -> None:
    assert_one_line_error(result, url)
    assert "unexpected" not in result.stderr
    assert "--storage-options" in result.stderr  # the fix: check the endpoint, the timeouts


# -- the defaults ------------------------------------------------------------------------------


def test_s3_gets_bounded_timeouts_and_retries_by_default():
    fs = location("s3://bucket/ckpt", storage_options={"anon": True}).fs.fs
    assert fs.config_kwargs == {
        "connect_timeout": 10,
        "read_timeout": 30,
        "retries": {"total_max_attempts": 2, "mode": "standard"},
    }
    assert fs.retries == 1


def test_storage_options_override_the_defaults_key_by_key():
    fs = location(
        "s3://bucket/ckpt",
        storage_options={
            "anon": True,
            "retries": 3,
            "config_kwargs": {"read_timeout": 300, "retries": {"max_attempts": 9}},
        },
    ).fs.fs
    assert fs.config_kwargs == {
        "connect_timeout": 10,
        "read_timeout": 300,
        "retries": {"max_attempts": 9},
    }
    assert fs.retries == 3


# -- a stalled endpoint ------------------------------------------------------------------------


def test_inspect_against_a_stalled_endpoint_ends_in_bounded_time_with_one_line(proxy, ckpt):
    proxy.fault("stall")
    result, seconds = _cli(proxy, "inspect", ckpt)
    _assert_network_line(result, ckpt)
    assert "did not answer in time" in result.stderr
    assert seconds < BOUND
    assert proxy.faulted == 2  # one request, two attempts, then the line


def test_a_stall_in_python_raises_remote_timeout_error_naming_the_url(proxy, ckpt):
    proxy.fault("stall")
    with pytest.raises(RemoteTimeoutError, match=ckpt) as raised:
        fsdpckpt.inspect_checkpoint(ckpt, storage_options=proxy.storage_options(**FAST))
    assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, OSError)


def test_a_stall_while_merging_ends_in_bounded_time_and_writes_nothing(proxy, ckpt, tmp_path):
    proxy.fault("stall", when=lambda r: ".distcp" in r.target)
    result, seconds = _cli(proxy, "merge", ckpt, tmp_path / "out", "--quiet")
    _assert_network_line(result, ckpt)
    assert seconds < BOUND
    assert not (tmp_path / "out").exists()


# -- truncated answers -------------------------------------------------------------------------


def test_a_truncated_listing_is_one_line_not_unexpected(proxy, ckpt):
    proxy.fault("truncate", when=lambda r: r.listing)
    result, seconds = _cli(proxy, "inspect", ckpt)
    _assert_network_line(result, ckpt)
    assert seconds < BOUND


def test_a_truncated_ranged_read_is_one_line_and_writes_nothing(proxy, ckpt, tmp_path):
    proxy.fault("truncate", when=lambda r: r.ranged)
    result, seconds = _cli(proxy, "merge", ckpt, tmp_path / "out", "--quiet")
    _assert_network_line(result, ckpt)
    assert seconds < BOUND
    assert not (tmp_path / "out").exists()


# -- 5xx answers -------------------------------------------------------------------------------


def test_one_5xx_answer_is_retried_and_the_command_succeeds(proxy, ckpt):
    proxy.fault("error", times=1)
    result, _ = _cli(proxy, "inspect", ckpt, "--summary")
    assert result.exit_code == 0, result.output
    assert proxy.faulted == 1


def test_5xx_answers_that_persist_end_after_bounded_retries_with_one_line(proxy, ckpt):
    proxy.fault("error")
    result, seconds = _cli(proxy, "inspect", ckpt)
    _assert_network_line(result, ckpt)
    assert "injected by faultproxy" in result.stderr  # the store's own words
    assert seconds < BOUND
    assert proxy.faulted == 2  # botocore's two attempts, no second round in s3fs


def test_5xx_in_python_is_a_remote_storage_error(proxy, ckpt):
    proxy.fault("error")
    with pytest.raises(RemoteStorageError, match=ckpt):
        fsdpckpt.verify_checkpoint(ckpt, storage_options=proxy.storage_options(**FAST))


# -- a flipped byte ----------------------------------------------------------------------------


def _tensor_offset(distcp, name: str) -> int:
    """Where, in the local copy of ``distcp``, the bytes of rank 0's piece of ``name`` are."""
    tensor = fsdpckpt.load_full_state_dict(CKPT / "pytorch_model_fsdp_0")["model"][name]
    piece = tensor.reshape(-1)[:4]
    data = distcp.read_bytes()
    at = data.find(piece.numpy().tobytes())
    assert at > 0 and data.count(piece.numpy().tobytes()) == 1
    return at + 1


def test_a_flipped_byte_in_a_ranged_read_fails_the_merge_and_writes_nothing(proxy, ckpt, tmp_path):
    shard = "pytorch_model_fsdp_0/__0_0.distcp"
    proxy.fault(
        "flip",
        when=lambda r: r.ranged and r.target.endswith(shard),
        offset=_tensor_offset(CKPT / shard, "0.weight"),
    )
    result, _ = _cli(proxy, "merge", ckpt, tmp_path / "out", "--quiet")
    assert proxy.faulted >= 1
    assert result.exit_code == 1, result.output
    assert not (tmp_path / "out").exists()


# -- the server goes down in the middle of an upload (the proxy answers nothing), then back -----


def _down_at(proxy: FaultProxy, name: str) -> None:
    """The server "dies" when the upload of ``name`` starts: that request and every later
    one get no answer, until ``proxy.fault(None)`` "restarts" it."""
    proxy.fault("down", when=lambda r: r.method == "PUT" and r.target.split("?")[0].endswith(name))


def _names(server, url: str) -> set[str]:
    fs = server.filesystem()
    return {p.rsplit("/", 1)[-1] for p in fs.find(url.removeprefix("s3://"))}


def test_a_merge_to_s3_cut_off_before_its_index_leaves_no_model(proxy, ckpt, s3, tmp_path):
    server, root = s3
    out = f"s3://{root}/merged"
    _down_at(proxy, "model.safetensors.index.json")
    result, seconds = _cli(proxy, "merge", ckpt, out, "--max-shard-size", "2KB", "--quiet")
    assert_one_line_error(result, out, "Left behind", "never the index", "--overwrite")
    assert "unexpected" not in result.stderr and seconds < BOUND
    proxy.fault(None)  # the server is back, with the shards and no index
    assert _names(server, out) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    for command in (["inspect", out], ["merge", out, tmp_path / "again", "--quiet"]):
        again, _ = _cli(proxy, *command)
        assert again.exit_code == 1, again.output
    assert not (tmp_path / "again").exists()
    again, _ = _cli(proxy, "merge", ckpt, out, "--max-shard-size", "2KB", "--overwrite", "-q")
    assert again.exit_code == 0, again.output
    assert "model.safetensors.index.json" in _names(server, out)


def test_an_export_to_s3_cut_off_before_its_config_leaves_no_model(proxy, s3, tmp_path):
    import shutil

    server, root = s3
    local = shutil.copytree(FIXTURES / "tiny_llama" / "untied", tmp_path / "run")
    (local / "trained.safetensors").unlink()
    out = f"s3://{root}/hf"
    _down_at(proxy, "/hf/config.json")
    result, seconds = _cli(proxy, "export-hf", local / "checkpoint-3", out, "-q")
    assert_one_line_error(result, f"{out}/config.json", "config.json")
    assert "unexpected" not in result.stderr and seconds < BOUND
    proxy.fault(None)
    assert "config.json" not in _names(server, out)
    again, _ = _cli(proxy, "export-hf", local / "checkpoint-3", out, "-q")
    assert_one_line_error(again, out, "--overwrite")  # refused, not taken for an export
    again, _ = _cli(proxy, "export-hf", local / "checkpoint-3", out, "-q", "--overwrite")
    assert again.exit_code == 0, again.output
    assert "config.json" in _names(server, out)


@pytest.mark.parametrize("command", ["inspect", "verify", "inspect-dcp-folder", "merge"])
def test_a_remote_folder_holding_the_intent_marker_and_no_manifest_is_refused(
    s3, tmp_path, command
):
    import workers

    server, root = s3
    url = f"s3://{root}/ckpt"
    fsdpckpt.save_state(url, model=workers.make_model(), step=1, storage_options=server.options)
    fs = server.filesystem()
    fs.pipe_file(f"{root}/ckpt/.fsdpckpt-incomplete", b"")  # what a save cut off leaves
    fs.rm_file(f"{root}/ckpt/fsdpckpt.json")
    args = {
        "inspect": ["inspect", url],
        "verify": ["verify", url],
        "inspect-dcp-folder": ["inspect", f"{url}/pytorch_model_fsdp_0"],
        "merge": ["merge", url, tmp_path / "out", "--quiet"],
    }[command]
    result = run_cli(*args, "--storage-options", json.dumps(server.options))
    assert_one_line_error(result, url, "did not finish")
    assert not (tmp_path / "out").exists()


# -- the real server killed (SIGKILL) mid-upload, then restarted on the same data ---------------


@pytest.fixture(scope="module")
def own_server():
    """A SeaweedFS server of this module's own, to kill and restart (the session's stays up)."""
    import s3server

    server = s3server.start()
    server.filesystem().mkdir("killed")
    yield server
    server.kill()  # at once: its data goes with it
    server.stop()


def test_a_save_state_whose_server_is_killed_before_the_manifest_is_not_committed(
    own_server, tmp_path
):
    import torch

    import workers

    run = "s3://killed/run"
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    fsdpckpt.CheckpointManager(run, storage_options=own_server.options).save(
        1, model=model, optimizer=optimizer
    )
    with FaultProxy(own_server.endpoint) as proxy:
        proxy.fault(
            "down",
            then=own_server.kill,
            when=lambda r: r.method == "PUT" and "fsdpckpt.json" in r.target,
        )
        with pytest.raises(RemoteStorageError, match="fsdpckpt.json"):
            fsdpckpt.save_state(
                f"{run}/checkpoint_2",
                model=model,
                optimizer=optimizer,
                step=2,
                storage_options=proxy.storage_options(**FAST),
            )
    own_server.restart()  # with step 2's data and intent marker, and no manifest
    assert {".metadata", ".fsdpckpt-incomplete"} <= _names(own_server, f"{run}/checkpoint_2")
    assert "fsdpckpt.json" not in _names(own_server, f"{run}/checkpoint_2")
    with FaultProxy(own_server.endpoint) as proxy:
        for command in (
            ["inspect", f"{run}/checkpoint_2"],
            ["verify", f"{run}/checkpoint_2"],
            ["inspect", f"{run}/checkpoint_2/pytorch_model_fsdp_0"],
            ["merge", f"{run}/checkpoint_2", tmp_path / "out", "--quiet"],
        ):
            result, _ = _cli(proxy, *command)
            assert_one_line_error(result, f"{run}/checkpoint_2", "did not finish")
        result, _ = _cli(proxy, "inspect", run)  # the folder of checkpoints: the newest committed
        assert_one_line_error(
            result, f"e.g. the newest finished save (checkpoint_2 is not): {run}/checkpoint_1"
        )
    assert not (tmp_path / "out").exists()
    # A manager sweeps the leftover away and finds the newest committed checkpoint.
    manager = fsdpckpt.CheckpointManager(run, storage_options=own_server.options)
    assert str(manager.latest()) == f"{run}/checkpoint_1"
