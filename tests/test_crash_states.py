"""No crash loses a committed checkpoint or leaves a half-written output that passes as one.

Each commit path runs for real under ``strace`` (tests/crashsim.py); every disk state a power
loss could leave after each of its file-system operations, under ext4's ``data=ordered``
rules taken harshly, is materialized, and the invariants are checked in each with the
public API:

- a restore finds the newest step reported committed, or a newer whole one, bit-exact, and
  no step older than the last reported one is lost to retention;
- an output is absent, or the previous output whole, or the new one whole;
- ``verify`` never says OK for anything that is not whole.

The commit paths run one after another in one recorded program (one start of Python and
torch for all), each in a folder of its own: :data:`SCENARIOS`. Each test explores one and
prints how many operations, states and distinct states it went through (``pytest -s``).
"""

from __future__ import annotations

import json
import shutil
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fsdpckpt

import crashsim

pytestmark = pytest.mark.skipif(shutil.which("strace") is None,
                                reason="needs strace (apt-get install strace; .ci/run does)")

FIXTURES = Path(__file__).parent.parent / "fixtures"
LLAMA = FIXTURES / "tiny_llama" / "untied"
LORA = FIXTURES / "hf_trainer_lora"

#: What every recorded program and the checks share: the weights of each step.
PRELUDE = f"""
import logging, warnings
import torch
import transformers
import fsdpckpt
logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
warnings.simplefilter("ignore")


def model_at(step):
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def llama_at(seed):
    config = transformers.LlamaConfig.from_pretrained({str(LLAMA)!r})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)
"""
_shared: dict = {}
exec(PRELUDE, _shared)
model_at, llama_at = _shared["model_at"], _shared["llama_at"]

Check = Callable[[Path, list[str]], list[str]]
#: name -> setup(folder): prepares the folder, returns (root, program, check).
SCENARIOS: dict[str, Callable[[Path], tuple[Path, str, Check]]] = {}


def scenario(setup: Callable[[Path], tuple[Path, str, Check]]):
    SCENARIOS[setup.__name__] = setup
    return setup


@pytest.fixture(autouse=True)
def _quiet(quiet_fsdpckpt):
    """fsdpckpt's warnings and log lines, expected in crash states, kept out of the output."""


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """Every scenario set up, then all run in one recorded program."""
    base = tmp_path_factory.mktemp("crash")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = {name: setup(base / name) for name, setup in SCENARIOS.items()}
    code = PRELUDE + "".join(
        f"\n\ndef _{name}():\n{textwrap.indent(program, '    ')}\n\n_{name}()\n"
        for name, (_, program, _) in made.items())
    found = crashsim.record_all(code, [root for root, _, _ in made.values()], cwd=base)
    return {name: (recording, check) for (name, (_, _, check)), recording
            in zip(made.items(), found)}


def _explore(recordings, name: str, tmp_path: Path) -> crashsim.Exploration:
    recording, check = recordings[name]
    result = crashsim.explore(recording, check, tmp_path)
    print(f"{name}: {result.operations} operations, {result.states} crash states, "
          f"{result.checked} distinct checked")
    assert result.checked > 0 and not result.violations, "\n".join(result.violations[:10])
    return result


def _verify_ok(path: Path) -> bool:
    try:
        return fsdpckpt.verify_checkpoint(path)["ok"] is True
    except fsdpckpt.FsdpCkptError:
        return False


def _same_model(module: torch.nn.Module, step: int) -> bool:
    want = model_at(step).state_dict()
    got = module.state_dict()
    return all(torch.equal(got[k], want[k]) for k in want)


# -- CheckpointManager ----------------------------------------------------------------------


def _manager_with(root: Path, steps: list[int]) -> None:
    manager = fsdpckpt.CheckpointManager(root, keep_last=2)
    for step in steps:
        manager.save(step, model=model_at(step))


def _restores(copy: Path, allowed: dict[int, list[int]]) -> list[str]:
    """The newest checkpoint restores, its step one of ``allowed``, bit-exact with one of the
    weights ``allowed[step]`` names; ``verify`` says OK of no step folder that is not whole."""
    target = model_at(0)
    try:
        step = fsdpckpt.CheckpointManager(copy, keep_last=2).restore(model=target)
    except fsdpckpt.FsdpCkptError as exc:
        return [f"restore failed: {exc}"]
    if step not in allowed:
        return [f"restored step {step}, expected one of {sorted(allowed)}"]
    problems = [] if any(_same_model(target, w) for w in allowed[step]) else \
        [f"step {step} restored, not bit-exact"]
    for folder in sorted(copy.glob("checkpoint_*")):
        saved = int(folder.name.split("_")[1])
        if _verify_ok(folder):
            model = fsdpckpt.load_full_state_dict(folder / "pytorch_model_fsdp_0")["model"]
            if not any(all(torch.equal(model[k], v) for k, v in model_at(w).state_dict().items())
                       for w in allowed.get(saved, [saved])):
                problems.append(f"verify says OK of {folder.name}, which is not whole")
    return problems


@scenario
def retention(folder: Path):
    root = folder / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        return _restores(copy, {3: [3]} if "3" in reported else {2: [2], 3: [3]})

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(3, model=model_at(3))\n" + crashsim.report("3", root))
    return root, program, check


def test_a_save_with_retention_keeps_the_last_committed_step_in_every_crash_state(
        recordings, tmp_path):
    _explore(recordings, "retention", tmp_path)


@scenario
def over_a_step(folder: Path):
    root = folder / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        # Step 2 again, with the weights of "step 20": before the save returns, either copy.
        return _restores(copy, {2: [20]} if "2" in reported else {2: [2, 20]})

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(2, model=model_at(20), overwrite=True)\n" + crashsim.report("2", root))
    return root, program, check


def test_a_save_over_a_step_keeps_a_whole_copy_of_it_in_every_crash_state(recordings, tmp_path):
    _explore(recordings, "over_a_step", tmp_path)


# -- save_state into a new folder -----------------------------------------------------------


def _loads_when_reported(copy: Path, reported: list[str]) -> list[str]:
    target = model_at(0)
    try:
        fsdpckpt.load_state(copy / "ckpt", target)
    except fsdpckpt.FsdpCkptError:
        return ["the saved checkpoint does not load"] if reported else []
    problems = [] if _same_model(target, 5) else ["a checkpoint loads, not bit-exact"]
    if reported and not _verify_ok(copy / "ckpt"):
        problems.append("verify refuses the saved checkpoint")
    return problems


@scenario
def save_state(folder: Path):
    root = folder / "out"
    root.mkdir(parents=True)
    program = (f"fsdpckpt.save_state({str(root / 'ckpt')!r}, model_at(5))\n" +
               crashsim.report("saved", root))
    return root, program, _loads_when_reported


def test_save_state_leaves_a_loadable_checkpoint_or_none_that_passes(recordings, tmp_path):
    _explore(recordings, "save_state", tmp_path)


def test_a_save_whose_metadata_is_never_fsynced_is_caught(tmp_path):
    # torch 2.6 to 2.13's writer fsyncs .metadata.tmp before its bytes are flushed (2.15
    # flushes first); had nothing fsynced it after, a power loss could cut a reported
    # checkpoint's .metadata. Every fsync of it taken out, on any torch:
    root = tmp_path / "out"
    root.mkdir()
    program = ("import os\n"
               "real_fsync = os.fsync\n"
               "def fsync(fd):\n"
               "    if not os.readlink(f'/proc/self/fd/{fd}').endswith('.metadata.tmp'):\n"
               "        real_fsync(fd)  # the bug: .metadata's bytes never made durable\n"
               "os.fsync = fsync\n"
               f"fsdpckpt.save_state({str(root / 'ckpt')!r}, model_at(5))\n" +
               crashsim.report("saved", root))
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, _loads_when_reported, tmp_path / "states",
                              thorough=False)
    assert any("the saved checkpoint does not load" in v for v in result.violations), \
        result.violations


# -- merge ----------------------------------------------------------------------------------


def _output(folder: Path) -> dict[str, bytes] | None:
    """The output in ``folder`` as a loader finds it: the single file if there is one (loaders
    prefer it), else the index and the shards it names; None: no output."""
    if (folder / "model.safetensors").is_file():
        return {"model.safetensors": (folder / "model.safetensors").read_bytes()}
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    data = index.read_bytes()
    try:
        names = set(json.loads(data)["weight_map"].values())
    except (ValueError, KeyError):
        return {index.name: data}  # a damaged index: compared whole, so never old nor new
    files = {n: (folder / n).read_bytes() if (folder / n).is_file() else b"" for n in names}
    return {index.name: data, **files}


def _merge_over(folder: Path, shard: str | None, spread: bool = False):
    root = folder / "work"
    for step in (1, 2):
        fsdpckpt.save_state(root / f"ckpt{step}", model_at(step))
    fsdpckpt.merge(root / "ckpt2", folder / "new", max_shard_size=shard)
    fsdpckpt.merge(root / "ckpt1", root / "out", max_shard_size=shard)
    old, new = _output(root / "out"), _output(folder / "new")
    assert old is not None and new is not None and old != new

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _output(copy / "out")
        allowed = [new] if reported else [old, new, None]
        problems = [] if now in allowed else [f"the output is neither old nor new: {sorted(now)}"]
        if now not in (old, new) and _verify_ok(copy / "out"):
            problems.append("verify says OK of an output that is not whole")
        return problems

    source, out = str(root / "ckpt2"), str(root / "out")
    if spread:  # torchrun's 2 ranks each write their share; the final publish is rank 0's
        program = ("import subprocess, sys\n"
                   "run = subprocess.run([sys.executable, '-m', 'torch.distributed.run', "
                   "'--standalone', '--nproc-per-node', '2', '-m', 'fsdpckpt', 'merge', "
                   f"{source!r}, {out!r}, '--overwrite', '--max-shard-size', {shard!r}], "
                   "capture_output=True, text=True)\n"
                   "assert run.returncode == 0, run.stderr\n")
    else:
        program = f"fsdpckpt.merge({source!r}, {out!r}, overwrite=True, max_shard_size={shard!r})\n"
    return root, program + crashsim.report("merged", root), check


@scenario
def merge_one_file(folder: Path):
    return _merge_over(folder, None)


@scenario
def merge_sharded(folder: Path):
    return _merge_over(folder, "600B")


@scenario
def spread_merge(folder: Path):
    return _merge_over(folder, "600B", spread=True)


def test_merge_over_an_output_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "merge_one_file", tmp_path)


def test_a_sharded_merge_over_an_output_never_leaves_an_old_index_over_new_shards(recordings,
                                                                                  tmp_path):
    _explore(recordings, "merge_sharded", tmp_path)


def test_a_spread_merge_over_an_output_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "spread_merge", tmp_path)


def test_the_explorer_finds_a_commit_that_renames_without_an_fsync(tmp_path):
    # The merge's publish with its folder fsync taken out: the rename that commits the new
    # output may be undone by a power loss after the merge reported it written.
    root = tmp_path / "work"
    fsdpckpt.save_state(root / "ckpt", model_at(2))
    fsdpckpt.merge(root / "ckpt", tmp_path / "new")
    new = _output(tmp_path / "new")

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _output(copy / "out")
        return [] if now == new or not reported else ["the merged output was lost"]

    program = ("import fsdpckpt._io.publish as publish\n"
               "publish.fsync_dir = lambda path: None  # the bug\n"
               f"fsdpckpt.merge({str(root / 'ckpt')!r}, {str(root / 'out')!r})\n" +
               crashsim.report("merged", root))
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states", thorough=False)
    assert any("(all unsynced lost): the merged output was lost" in v
               for v in result.violations), result.violations


# -- convert --------------------------------------------------------------------------------


@scenario
def convert(folder: Path):
    from safetensors.torch import save_file

    root = folder / "work"
    root.mkdir(parents=True)
    for step in (1, 2):
        save_file(model_at(step).state_dict(), str(root / f"step{step}.safetensors"))
    fsdpckpt.convert(root / "step1.safetensors", root / "out")
    old = fsdpckpt.load_full_state_dict(root / "out")["model"]
    new = model_at(2).state_dict()

    def check(copy: Path, reported: list[str]) -> list[str]:
        if not (copy / "out").exists():
            return ["the converted folder was lost"] if reported else []
        try:
            now = fsdpckpt.load_full_state_dict(copy / "out")["model"]
        except fsdpckpt.FsdpCkptError as exc:
            return [f"out does not load: {exc}"]
        wanted = [new] if reported else [old, new]
        if not any(now.keys() == w.keys() and all(torch.equal(now[k], w[k]) for k in w)
                   for w in wanted):
            return ["out is neither old nor new"]
        return []

    program = (f"fsdpckpt.convert({str(root / 'step2.safetensors')!r}, {str(root / 'out')!r}, "
               "overwrite=True)\n" + crashsim.report("converted", root))
    return root, program, check


def test_convert_over_an_output_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "convert", tmp_path)


# -- outputs replaced whole: export-hf, save_pretrained -------------------------------------

#: The files whose presence makes a folder an export: a folder without one is plainly
#: unfinished to from_pretrained and PeftModel.from_pretrained (the export's commit files).
COMMIT_FILES = ("config.json", "adapter_config.json")


def _files(folder: Path) -> dict[str, bytes] | None:
    """Every visible file under ``folder`` (hidden stages left out); None: no folder."""
    if not folder.is_dir():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in
                                       p.relative_to(folder).parts)}


def _as_loaded(files: dict[str, bytes] | None) -> dict[str, bytes] | None:
    """An export folder as loaders read it: the files of a kind whose commit file is absent
    are inert (a full model's weights without ``config.json``, an adapter's without
    ``adapter_config.json``: what remains of an earlier export of the other kind until the
    new one, committed, removes it); a folder with no commit file holds no export (None)."""
    if files is None or not any(name in files for name in COMMIT_FILES):
        return None
    inert = set()
    if "adapter_config.json" not in files:
        inert |= {"adapter_model.safetensors", "adapter_model.bin"}
    if "config.json" not in files:
        inert |= {n for n in files if n == "generation_config.json" or n.startswith("model")}
    return {n: b for n, b in files.items() if n not in inert}


def _replaced(folder: Path, first: Callable[[Path], object], second: Callable[[Path], object],
              program: str):
    """``first`` wrote ``root/out``; the recorded ``program`` does ``second`` over it. In every
    crash state the folder holds the old export whole, none (no commit file), or the new one
    whole (only that, once reported). The new one is what ``first`` then ``second`` leave."""
    first(folder / "expected")
    old = _as_loaded(_files(folder / "expected"))
    second(folder / "expected")
    new = _as_loaded(_files(folder / "expected"))
    assert old is not None and new is not None and old != new
    root = folder / "work"
    first(root / "out")

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _as_loaded(_files(copy / "out"))
        allowed = [new] if reported else [old, new, None]
        return [] if now in allowed else [f"out is neither old nor new: {sorted(now or {})}"]

    return root, program.format(out=str(root / "out")) + crashsim.report("written", root), check


@scenario
def export_hf(folder: Path):
    source = LLAMA / "checkpoint-3"
    return _replaced(folder, lambda out: fsdpckpt.export_hf(source, out),
                     lambda out: fsdpckpt.export_hf(source, out, dtype="bf16", overwrite=True),
                     f"fsdpckpt.export_hf({str(source)!r}, {{out!r}}, dtype='bf16', "
                     "overwrite=True)\n")


def _lora_over(folder: Path, old_kind: str, new_kind: str):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    return _replaced(folder, lambda out: fsdpckpt.export_hf(source, out, base=base,
                                                            lora=old_kind),
                     lambda out: fsdpckpt.export_hf(source, out, base=base, lora=new_kind,
                                                    overwrite=True),
                     f"fsdpckpt.export_hf({str(source)!r}, {{out!r}}, base={str(base)!r}, "
                     f"lora={new_kind!r}, overwrite=True)\n")


@scenario
def adapter_over_fused(folder: Path):
    return _lora_over(folder, "fuse", "adapter")


@scenario
def fused_over_adapter(folder: Path):
    return _lora_over(folder, "adapter", "fuse")


@scenario
def save_pretrained(folder: Path):
    return _replaced(folder, lambda out: fsdpckpt.save_pretrained(llama_at(1), out),
                     lambda out: fsdpckpt.save_pretrained(llama_at(2), out, overwrite=True),
                     "fsdpckpt.save_pretrained(llama_at(2), {out!r}, overwrite=True)\n")


def test_export_hf_over_an_export_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "export_hf", tmp_path)


def test_an_adapter_export_over_a_fused_one_leaves_the_old_or_the_new_whole(recordings,
                                                                            tmp_path):
    _explore(recordings, "adapter_over_fused", tmp_path)


def test_a_fused_export_over_an_adapter_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "fused_over_adapter", tmp_path)


def test_save_pretrained_over_a_save_leaves_the_old_or_the_new_whole(recordings, tmp_path):
    _explore(recordings, "save_pretrained", tmp_path)


def test_every_scenario_has_its_test():
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    assert all(f'_explore(recordings, "{name}"' in source for name in SCENARIOS)
