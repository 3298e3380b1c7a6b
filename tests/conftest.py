"""Shared test helpers: the committed fixtures and ways to damage copies of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

#: Every committed DCP folder, by a short id.
DCP_FOLDERS = {
    "fsdp2-model": FIXTURES / "fsdp2_accelerate" / "pytorch_model_fsdp_0",
    "fsdp2-optimizer": FIXTURES / "fsdp2_accelerate" / "optimizer_0",
    "fsdp1-model": FIXTURES / "fsdp1" / "pytorch_model_fsdp_0",
    "fsdp1-optimizer": FIXTURES / "fsdp1" / "optimizer_0",
    "dtensor": FIXTURES / "dtensor",
}


@pytest.fixture(params=sorted(DCP_FOLDERS), ids=sorted(DCP_FOLDERS))
def dcp_folder(request) -> Path:
    """Each committed DCP folder in turn."""
    return DCP_FOLDERS[request.param]


@pytest.fixture
def accelerate_ckpt(tmp_path) -> Path:
    """A private copy of the FSDP2 checkpoint in Accelerate's layout, free to damage."""
    return Path(shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt"))


@pytest.fixture
def dtensor_copy(tmp_path) -> Path:
    """A private copy of the DTensor DCP folder, free to damage."""
    return Path(shutil.copytree(FIXTURES / "dtensor", tmp_path / "dtensor"))


@pytest.fixture(scope="session", autouse=True)
def _no_home_cache(tmp_path_factory):
    """export-hf keeps the model class's answer in ~/.cache (export/_expect_cache.py): the
    suite never reads or writes the user's. Set for the session, so that module-scoped
    fixtures (which run before any test's own fixtures) export under it too; children
    (subprocess, multi-rank workers) inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FSDPCKPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache-session"))
        patch.delenv("FSDPCKPT_NO_CACHE", raising=False)
        yield


_CACHES = iter(range(10**9))


@pytest.fixture(autouse=True)
def _own_expectation_cache(_no_home_cache, tmp_path_factory, monkeypatch):
    """Each test its own empty cache of model classes' answers (created only when written):
    a test that replaces the class's builder (``expect_model``: transformers "not
    installed") or checks what an export imports must meet the class, not an answer an
    earlier test's export of the same config left."""
    monkeypatch.setenv("FSDPCKPT_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / f"cache-{next(_CACHES)}"))


_REFERENCE: dict = {}


def reference_state_dict(folder: Path) -> dict:
    """What torch's own DCP loader gives for ``folder`` (``dcp_to_torch_save``), cached."""
    key = str(folder)
    if key not in _REFERENCE:
        import tempfile

        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        skip_unless_torch_has_dtypes(folder)
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(folder), f"{tmp}/ref.pt")
            _REFERENCE[key] = torch.load(f"{tmp}/ref.pt", weights_only=False)  # our own file
    return _REFERENCE[key]


def skip_unless_torch_has_dtypes(folder: Path) -> None:
    """Skip, saying why, where the installed torch lacks a dtype the DCP folder holds
    (``float8_e8m0fnu`` on 2.6): torch's own reading of it, the reference, cannot be made
    there. What fsdpckpt says on such a torch is tested with the dtype taken away
    (tests/test_dtypes.py)."""
    import torch

    from fsdpckpt.dcp.reader import read_dcp_folder

    lacking = sorted({t.dtype.name for t in read_dcp_folder(folder).metadata.tensors
                      if not isinstance(getattr(torch, t.dtype.name, None), torch.dtype)})
    if lacking:
        pytest.skip(f"{folder.name} holds {', '.join(lacking)}, which torch {torch.__version__} "
                    "lacks: torch's reference reading cannot be made (docs/torch-versions.md)")


def torch_dcp_class(name: str):
    """``torch.distributed.checkpoint.<name>`` (``HuggingFaceStorageReader``...), the
    reference a test compares with; skipped, saying why, on a torch without it (2.6)."""
    import torch
    import torch.distributed.checkpoint as dcp

    found = getattr(dcp, name, None)
    if found is None:
        pytest.skip(f"torch {torch.__version__}'s DCP lacks {name}: torch's reference cannot be "
                    "made here; fsdpckpt reads such folders without it (docs/torch-versions.md)")
    return found


def run_fresh(code: str) -> None:
    """Run ``code`` in a fresh interpreter on this checkout: what it imports is its own (the
    torch-free paths are checked this way)."""
    import os
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))


def run_cli(*args):
    """Run the CLI in-process; stdout and stderr stay apart."""
    from click.testing import CliRunner

    from fsdpckpt.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *fragments, code=1):
    """Exit ``code`` (1; 130 for an interruption), one `fsdpckpt: error:` line on stderr
    naming every fragment, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdpckpt: error: "), result.stderr
    for fragment in fragments:
        assert str(fragment) in lines[0]
    assert "Traceback" not in result.output


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def hostile_pickle(sentinel) -> bytes:
    """A pickle that, loaded with plain pickle, creates the file ``sentinel``."""
    import pickle

    return pickle.dumps(_RunsCommand(f"touch {sentinel}"))


def reseal(manifest: dict) -> dict:
    """``manifest`` with its own checksum recomputed, as anyone who edits it can do: for
    tests of what verify checks beyond the manifest's self-checksum."""
    from fsdpckpt.training.manifest import _content_checksum

    return dict(manifest, checksum=_content_checksum(manifest))


def save_small_checkpoint(folder: Path, *, step: int = 1, **kwargs) -> Path:
    """``save_state`` of a small trained model and AdamW (so with a manifest) into
    ``folder``: big enough to damage in every part."""
    import torch

    import fsdpckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    fsdpckpt.save_state(folder, model, optimizer, step=step, **kwargs)
    return folder


def peak_rss_mib(code: str) -> float:
    """Peak resident memory (MiB) of a fresh Python process running ``code``.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child of the (large)
    test process would report the parent's peak as its own.
    """
    import subprocess
    import sys

    report = ("\nimport re\nwith open('/proc/self/status') as status:\n"
              "    print(re.search(r'VmHWM:\\s+(\\d+) kB', status.read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1]) / 1024


# -- a real S3 server (SeaweedFS) for the remote-storage tests -----------------------------

@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS server with S3 on loopback for the whole test session (tests/s3server.py)."""
    import s3server

    server = s3server.start()
    yield server
    # At once: the session is over and its data goes with it; SIGTERM alone leaves the
    # server running until stop()'s 10 s grace ends.
    server.kill()
    server.stop()


_PREFIXES = iter(range(10**6))


@pytest.fixture
def s3(s3_server):
    """``(server, root)``: a fresh, empty folder (``bucket/test-N``) on the session's S3 server.

    One bucket for the session: SeaweedFS gives each bucket its own volumes, and a bucket per
    test runs its volume server out of slots.
    """
    import s3server

    fs = s3_server.filesystem()
    if not fs.exists(s3server.BUCKET):
        fs.mkdir(s3server.BUCKET)
    return s3_server, f"{s3server.BUCKET}/test-{next(_PREFIXES):06d}"


def damaged_copy(folder: Path, relative: str, into: Path) -> Path:
    """A copy of ``folder`` at ``into`` whose file ``relative`` has its middle byte flipped."""
    copy = Path(shutil.copytree(folder, into))
    data = copy / relative
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return copy


def upload(server, local: Path, url: str) -> str:
    """Copy the local folder ``local`` to ``url`` (``s3://bucket/folder``); returns ``url``."""
    fs = server.filesystem()
    target = url.removeprefix("s3://")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{target}/{path.relative_to(local).as_posix()}")
    return url


@pytest.fixture
def quiet_fsdpckpt():
    """fsdpckpt's log lines (errors aside) and every warning silenced for the test."""
    import logging
    import warnings

    logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.getLogger("fsdpckpt").setLevel(logging.NOTSET)


@pytest.fixture
def default_sigint():
    """SIGINT raising KeyboardInterrupt, as in a terminal: a job started in the background
    by a non-interactive shell (nohup, ``cmd &``) inherits SIGINT ignored, and Python then
    never installs its handler. Restored after the test."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child that is sent SIGINT: the default disposition, whatever the
    test run inherited (see :func:`default_sigint`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_same_safetensors(got_file: Path, want_file: Path) -> None:
    """The two safetensors files hold the same names, and each tensor's dtype, shape and bytes."""
    import torch
    from safetensors.torch import load_file

    got, want = load_file(got_file), load_file(want_file)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def load_clean(model_class, folder: Path, caplog):
    """``model_class.from_pretrained(folder)`` (no remote code), asserting nothing was missing,
    unexpected, mismatched or newly initialized; the model in eval mode."""
    import logging

    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = model_class.from_pretrained(str(folder), output_loading_info=True,
                                                  trust_remote_code=False)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert "newly initialized" not in caplog.text
    return model.eval()


def single_process() -> dict:
    """What ``dcp.save`` and ``dcp.load`` take to run in one process without a process group:
    ``no_dist=True`` where torch has it (2.7 and later, which warns without it); torch 2.6
    decides that from the missing process group alone."""
    import torch.distributed.checkpoint as dcp

    from fsdpckpt import _torch

    return {"no_dist": True} if _torch.takes_no_dist(dcp.save) else {}


def torch_loads_fixture(path) -> object:
    """``torch.load(path, weights_only=True)``: torch's own reading of a committed fixture, the
    reference a test compares with. A fixture written by a newer torch can name classes an
    older torch's loader does not have (torch 2.13's ``_MeshLayout`` on 2.6): the reference
    cannot be had there, so the test is skipped, saying so."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc):
            raise
        pytest.skip(f"{path.name}: written by a newer torch than {torch.__version__}, whose "
                    "loader lacks a class it names: no reference here")
