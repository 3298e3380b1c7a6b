"""No crash on object storage loses a committed checkpoint or leaves a half-written output
that passes as one: every request boundary of every S3 commit path.

Each commit path runs for real against the test S3 server, through the fault proxy, which
records every request that changes the store; tests/s3crash.py then rebuilds the store as a
crash before each of them (or after it, the answer lost: the same state) would leave it
and checks the invariants there with the public API, as a new process would:

- a restore finds the newest step reported committed, or a newer whole one, bit-exact, and
  no step older than the last reported one is lost to retention;
- a step saved again has a committed copy, the old or the new, at every moment;
- an output is absent, or the previous output whole, or the new one whole;
- ``verify`` never says OK for anything that is not whole.

Each test also runs its path once with every other request cut (before it reaches the
server, and after, its answer lost) and the client living on: it retries, or fails, and
the same invariants hold in what it left. Each prints how many requests, states and
distinct states it went through (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import s3crash
import torch

import fsdpckpt
from fsdpckpt.training import _remote

from faultproxy import FaultProxy

pytestmark = pytest.mark.s3

LLAMA = Path(__file__).parent.parent / "fixtures" / "tiny_llama" / "untied" / "checkpoint-3"


def model_at(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture(autouse=True)
def _quiet(quiet_fsdpckpt):
    """fsdpckpt's warnings and log lines, expected in crash states, kept out of the output."""


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as running:
        yield running


class Store:
    """The test's folder on the server, reached directly (not through the proxy)."""

    def __init__(self, server, root: str) -> None:
        self.server, self.root, self.fs = server, root, server.filesystem()
        self.options = server.options

    def url(self, folder: str, *names: str) -> str:
        return "/".join([f"s3://{folder}", *names])

    def files(self, folder: str) -> dict[str, bytes] | None:
        """Every file under ``folder``, by relative name; None: nothing there."""
        self.fs.invalidate_cache()
        found = self.fs.find(folder)
        return {p[len(folder) + 1:]: self.fs.cat_file(p) for p in found} or None

    def wipe(self) -> None:
        """Nothing left in the folder (SeaweedFS keeps emptied folders: removed as well)."""
        s3crash.wipe(self.fs, self.root)

    def verify_ok(self, url: str) -> bool:
        try:
            return fsdpckpt.verify_checkpoint(url, storage_options=self.options)["ok"] is True
        except fsdpckpt.FsdpCkptError:
            return False


@pytest.fixture
def store(s3):
    return Store(*s3)


#: The options of the start states: the server reached directly (set by the fixture).
STORE_OPTIONS: dict = {}


@pytest.fixture(autouse=True)
def _start_options(s3_server):
    STORE_OPTIONS.clear()
    STORE_OPTIONS.update(s3_server.options)


def _explore(store: Store, proxy: FaultProxy, start: Callable[[str], None],
             program_at: Callable[[str], s3crash.Program], check: s3crash.Check,
             name: str) -> None:
    """Every crash state of ``program_at(folder)`` in a folder that ``start`` filled,
    checked; then the same in a fresh folder with every other request cut, before the
    server or after, the client living on."""
    start(store.root)
    result = s3crash.explore(store.server, proxy, store.root, program_at(store.root), check)
    print(f"{name}: {result.requests} requests, {result.states} crash states, "
          f"{result.checked} distinct checked")
    assert result.requests > 0 and result.checked > 1
    assert not result.violations, "\n".join(result.violations[:10])
    folder = f"{store.root}-cut"  # a fresh one: SeaweedFS keeps emptied folders
    start(folder)
    proxy.seen.clear()
    cut, problems = s3crash.cut_each(proxy, folder, program_at(folder), check)
    print(f"{name}: {cut['cut']} requests cut before the server, {cut['lost']} after")
    assert cut["cut"] > 0 and not problems, problems


# -- CheckpointManager ----------------------------------------------------------------------


def _same_model(state: dict, step: int) -> bool:
    want = model_at(step).state_dict()
    return state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


_VERDICTS: dict = {}


def _whole_if_verified(store: Store, folder: str, weights: tuple[int, ...]) -> bool:
    """False when ``verify`` says OK of the step folder and it does not load as one of
    ``weights``."""
    if not store.verify_ok(f"s3://{folder}"):
        return True
    model = fsdpckpt.load_full_state_dict(f"s3://{folder}/pytorch_model_fsdp_0",
                                          storage_options=store.options)["model"]
    return any(_same_model(model, w) for w in weights)


def _restores(store: Store, copy: str, allowed: dict[int, list[int]],
              kept: list[int] = ()) -> list[str]:
    """In the copy ``copy``: ``verify`` says OK of no step folder that is not whole (asked
    before a manager recovers anything); then a new manager restores a step of ``allowed``,
    bit-exact with one of the weights ``allowed[step]`` names; every step of ``kept`` is
    still there or has two newer ones (keep_last=2)."""
    problems = []
    store.fs.invalidate_cache()
    found = store.fs.find(f"{copy}/run", detail=True) if store.fs.exists(f"{copy}/run") else {}
    folders: dict[str, set] = {}
    for key, info in found.items():
        relative = key[len(copy) + 5:]
        if relative.startswith("checkpoint_") and "/" in relative:
            name, rest = relative.split("/", 1)
            folders.setdefault(name, set()).add((rest, info.get("ETag")))
    for name, content in sorted(folders.items()):
        step = int(name.split("_")[1].split(".")[0])
        # The same files (names and ETags) as a folder seen in an earlier state: the same
        # verdict, asked once.
        key = (step, tuple(allowed.get(step, [step])), frozenset(content))
        if key not in _VERDICTS:
            _VERDICTS[key] = _whole_if_verified(store, f"{copy}/run/{name}", key[1])
        if not _VERDICTS[key]:
            problems.append(f"verify says OK of {name}, which is not whole")
    target = model_at(0)
    try:
        manager = fsdpckpt.CheckpointManager(store.url(copy, "run"), keep_last=2,
                                             storage_options=store.options)
        step = manager.restore(model=target)
    except fsdpckpt.FsdpCkptError as exc:
        return [*problems, f"restore failed: {exc}"]
    if step not in allowed:
        return [*problems, f"restored step {step}, expected one of {sorted(allowed)}"]
    if not any(_same_model(target.state_dict(), w) for w in allowed[step]):
        problems.append(f"step {step} restored, not bit-exact")
    steps = [int(p.name.split("_")[1]) for p in manager.checkpoints()]
    problems += [f"step {s} lost to retention ({steps} left)" for s in kept
                 if s not in steps and sum(n > s for n in steps) < 2]
    return problems


def _manager_program(saves: list[tuple[int, int, bool]]) -> Callable[[str], s3crash.Program]:
    """A program saving ``(step, weights, overwrite)`` in turn, each reported as its step."""
    def at(url: str) -> s3crash.Program:
        def program(options: dict, report: Callable[[str], None]) -> None:
            manager = fsdpckpt.CheckpointManager(url, keep_last=2, storage_options=options)
            for step, weights, overwrite in saves:
                manager.save(step, model=model_at(weights), overwrite=overwrite)
                report(str(step))
        return program
    return at


def _run_with(steps: list[int]) -> Callable[[str], None]:
    def start(folder: str) -> None:
        _manager_program([(s, s, False) for s in steps])(f"s3://{folder}/run")(
            {**STORE_OPTIONS}, lambda _what: None)
    return start


def _saving(saves: list[tuple[int, int, bool]]) -> Callable[[str], s3crash.Program]:
    return lambda folder: _manager_program(saves)(f"s3://{folder}/run")


def test_a_save_with_retention_keeps_the_last_committed_step_at_every_request(store, proxy):
    def check(copy: str, reported: list[str]) -> list[str]:
        if "3" in reported:
            return _restores(store, copy, {3: [3]}, kept=[2, 3])
        return _restores(store, copy, {2: [2], 3: [3]}, kept=[1, 2])

    _explore(store, proxy, _run_with([1, 2]), _saving([(3, 3, False)]), check, "retention")


def _over_a_step(store: Store) -> s3crash.Check:
    def check(copy: str, reported: list[str]) -> list[str]:
        # Step 2 again, with the weights of "step 20": a committed copy, old or new, of
        # step 2 at every moment (seen before any recovery), then the restore's rules.
        copies = [n.split("/")[0] for n in store.files(f"{copy}/run") or {}
                  if n.endswith("/fsdpckpt.json")]
        problems = [] if {"checkpoint_2", "checkpoint_2.replacement"} & set(copies) else \
            ["no committed copy of step 2"]
        allowed = {2: [20]} if "2" in reported else {2: [2, 20]}
        return problems + _restores(store, copy, allowed, kept=[1, 2])
    return check


def test_a_save_over_a_step_keeps_a_committed_copy_of_it_at_every_request(store, proxy):
    _explore(store, proxy, _run_with([1, 2]), _saving([(2, 20, True)]), _over_a_step(store),
             "over_a_step")


def test_the_explorer_finds_a_save_over_a_step_that_uncommits_it_first(store, proxy,
                                                                      monkeypatch):
    # The protocol before: the new copy saved in place, the old one uncommitted as it starts.
    monkeypatch.setattr(_remote.MarkerCommits, "start",
                        lambda self, key: self.root / f"{self.final}{key}")
    _run_with([1, 2])(store.root)
    result = s3crash.explore(store.server, proxy, store.root,
                             _saving([(2, 20, True)])(store.root), _over_a_step(store))
    assert any("no committed copy of step 2" in v for v in result.violations), result


def test_the_replacement_of_a_step_is_finished_by_the_next_manager(store):
    # A crash after the new copy of step 2 committed beside the old one: the next manager
    # makes it checkpoint_2, and until then the listing counts it as step 2.
    _run_with([1, 2])(store.root)
    url = store.url(store.root, "run")
    fsdpckpt.save_state(f"{url}/checkpoint_2.replacement", model_at(20), step=2,
                        manifest=True, storage_options=store.options)
    store.fs.rm(f"{store.root}/run/checkpoint_2", recursive=True)  # crash mid-switch
    assert _remote.REPLACEMENT == ".replacement"
    target = model_at(0)
    manager = fsdpckpt.CheckpointManager(url, keep_last=2, storage_options=store.options)
    assert [p.name for p in manager.checkpoints()] == ["checkpoint_1", "checkpoint_2"]
    assert manager.restore(model=target) == 2 and _same_model(target.state_dict(), 20)
    assert not store.fs.exists(f"{store.root}/run/checkpoint_2.replacement")


def test_a_step_whose_replacement_is_committed_is_refused_without_overwrite(store):
    # Another process's switch cut short after this manager started: step 2 is saved (as
    # its replacement), so a save of step 2 without overwrite is refused, as for any step.
    _run_with([1, 2])(store.root)
    url = store.url(store.root, "run")
    manager = fsdpckpt.CheckpointManager(url, keep_last=2, storage_options=store.options)
    fsdpckpt.save_state(f"{url}/checkpoint_2.replacement", model_at(20), step=2,
                        manifest=True, storage_options=store.options)
    store.fs.rm(f"{store.root}/run/checkpoint_2", recursive=True)
    with pytest.raises(fsdpckpt.OutputExistsError, match="step 2 is saved already"):
        manager.save(2, model=model_at(30))


# -- save_state into a new folder -----------------------------------------------------------


def test_save_state_leaves_a_loadable_checkpoint_or_none_that_passes(store, proxy):
    def program_at(folder: str) -> s3crash.Program:
        def program(options: dict, report: Callable[[str], None]) -> None:
            fsdpckpt.save_state(f"s3://{folder}/ckpt", model_at(5), storage_options=options)
            report("saved")
        return program

    def check(copy: str, reported: list[str]) -> list[str]:
        target = model_at(0)
        try:
            fsdpckpt.load_state(store.url(copy, "ckpt"), target, storage_options=store.options)
        except fsdpckpt.FsdpCkptError:
            if store.verify_ok(store.url(copy, "ckpt")):
                return ["verify says OK of a checkpoint that does not load"]
            return ["the saved checkpoint does not load"] if reported else []
        problems = [] if _same_model(target.state_dict(), 5) else ["loads, not bit-exact"]
        if reported and not store.verify_ok(store.url(copy, "ckpt")):
            problems.append("verify refuses the saved checkpoint")
        return problems

    _explore(store, proxy, lambda _folder: None, program_at, check, "save_state")


# -- outputs: merge, convert, export-hf -----------------------------------------------------


def _output(store: Store, folder: str) -> dict[str, bytes] | None:
    """The output in ``folder`` as a loader finds it: the single file if there is one, else
    the index and the shards it names; None: no output."""
    files = store.files(folder) or {}
    if "model.safetensors" in files:
        return {"model.safetensors": files["model.safetensors"]}
    index = files.get("model.safetensors.index.json")
    if index is None:
        return None
    try:
        names = set(json.loads(index)["weight_map"].values())
    except (ValueError, KeyError):
        return {"index": index}
    return {"index": index, **{n: files.get(n, b"") for n in names}}


def _export(store: Store, folder: str) -> dict[str, bytes] | None:
    """An export folder as loaders read it: nothing without ``config.json``."""
    files = store.files(folder)
    return files if files and "config.json" in files else None


def _replaced_output(store: Store, proxy: FaultProxy, name: str,
                     write: Callable[[str, int, dict, bool], None],
                     seen: Callable[[Store, str], dict[str, bytes] | None],
                     commit: Callable[[str, int, dict, bool], None] | None = None) -> None:
    """``write(url, version, options, overwrite)`` writes an output; version 1 is there,
    the program writes version 2 over it: in every state the output (as ``seen`` finds it)
    is the old one whole, none, or the new one whole (only that, once reported); ``verify``
    says OK of nothing else. ``commit``, when given, is the program's write (the others'
    files the same, made faster)."""
    expected = f"{store.root}-expected"
    write(store.url(expected), 2, store.options, False)
    new = seen(store, expected)

    def start(folder: str) -> None:
        write(store.url(folder, "out"), 1, store.options, False)

    def program_at(folder: str) -> s3crash.Program:
        def program(options: dict, report: Callable[[str], None]) -> None:
            (commit or write)(store.url(folder, "out"), 2, options, True)
            report("written")
        return program

    old: list = []

    def check(copy: str, reported: list[str]) -> list[str]:
        now = seen(store, f"{copy}/out")
        allowed = [new] if reported else [*old, new, None]
        if now in allowed:
            return []
        problems = [f"the output is neither old nor new: {sorted(now or {})}"]
        if store.verify_ok(store.url(copy, "out")):
            problems.append("verify says OK of an output that is not whole")
        return problems

    def start_and_keep(folder: str) -> None:
        start(folder)
        old[:] = [seen(store, f"{folder}/out")]
        assert old[0] is not None and new is not None and old[0] != new

    _explore(store, proxy, start_and_keep, program_at, check, name)


def _merged(shard: str | None) -> Callable[[str, int, dict, bool], None]:
    sources: dict[int, Path] = {}

    def write(url: str, version: int, options: dict, overwrite: bool) -> None:
        source = sources[version]
        fsdpckpt.merge(source, url, overwrite=overwrite, max_shard_size=shard,
                       storage_options=options)
    return write, sources


@pytest.mark.parametrize("shard", [None, "600B"], ids=["one-file", "sharded"])
def test_a_merge_over_an_output_leaves_the_old_or_the_new_whole(store, proxy, shard, tmp_path):
    write, sources = _merged(shard)
    for version in (1, 2):
        sources[version] = tmp_path / f"ckpt{version}"
        fsdpckpt.save_state(sources[version], model_at(version))
    _replaced_output(store, proxy, f"merge {shard or 'one file'}", write, _output)


def test_convert_over_an_output_leaves_the_old_or_the_new_whole(store, proxy, tmp_path):
    from safetensors.torch import save_file

    for version in (1, 2):
        save_file(model_at(version).state_dict(), str(tmp_path / f"v{version}.safetensors"))

    def write(url: str, version: int, options: dict, overwrite: bool) -> None:
        fsdpckpt.convert(tmp_path / f"v{version}.safetensors", url, overwrite=overwrite,
                         storage_options=options)

    def seen(store: Store, folder: str) -> dict[str, bytes] | None:
        files = store.files(folder)
        return files if files and ".metadata" in files else None

    _replaced_output(store, proxy, "convert", write, seen)


def test_export_hf_over_an_export_leaves_the_old_or_the_new_whole(store, proxy):
    def write(url: str, version: int, options: dict, overwrite: bool) -> None:
        fsdpckpt.export_hf(LLAMA, url, dtype="bf16" if version == 2 else None,
                           overwrite=overwrite, storage_options=options)

    _replaced_output(store, proxy, "export-hf", write, _export)


@pytest.mark.multirank
def test_a_spread_merge_over_an_output_leaves_the_old_or_the_new_whole(store, proxy, tmp_path):
    # torchrun's 2 ranks each upload their parts of each file (multipart); rank 0 completes
    # the uploads, the index last: the spread merge's final publish on S3.
    for version in (1, 2):
        fsdpckpt.save_state(tmp_path / f"ckpt{version}", model_at(version))

    def merge(url: str, version: int, options: dict, overwrite: bool) -> None:
        fsdpckpt.merge(tmp_path / f"ckpt{version}", url, overwrite=overwrite,
                       max_shard_size="600B", storage_options=options)

    def spread(url: str, version: int, options: dict, overwrite: bool) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "-m", "fsdpckpt", "merge", str(tmp_path / f"ckpt{version}"), url,
             "--max-shard-size", "600B", "--storage-options", json.dumps(options),
             *(["--overwrite"] if overwrite else [])],
            capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise fsdpckpt.FsdpCkptError(run.stderr[-2000:])

    _replaced_output(store, proxy, "spread merge", merge, _output, commit=spread)
