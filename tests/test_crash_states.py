"""No crash loses a committed checkpoint or leaves a half-written output that passes as one.

Each commit path runs for real under ``strace`` (tests/crashsim.py); every disk state a power
loss could leave after each of its file-system operations, under ext4's ``data=ordered``
rules taken harshly, is materialized, and the invariants are checked in each with the
public API:

- a restore finds the newest step reported committed, or a newer whole one, bit-exact, and
  no step older than the last reported one is lost to retention;
- an output is absent, or the previous output whole, or the new one whole;
- ``verify`` never says OK for anything that is not whole.

Each test prints how many operations it recorded and how many states it checked
(``pytest -s``), and asserts it checked some.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import fsdpckpt

import crashsim

pytestmark = pytest.mark.skipif(shutil.which("strace") is None,
                                reason="needs strace (apt-get install strace; .ci/run does)")

#: What every recorded program and the checks share: the weights of each step.
PRELUDE = """
import logging, warnings
import torch
import fsdpckpt
logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
warnings.simplefilter("ignore")


def model_at(step):
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
"""
_shared: dict = {}
exec(PRELUDE, _shared)
model_at = _shared["model_at"]


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.getLogger("fsdpckpt").setLevel(logging.NOTSET)


def _explore(tmp_path: Path, root: Path, program: str, check) -> crashsim.Exploration:
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states")
    print(f"{result.operations} operations, {result.states} crash states, "
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


def _verified_steps_are_whole(root: Path, weights: dict[int, list[int]]) -> list[str]:
    """``verify`` says OK only of a folder whose model is one that step was saved with."""
    problems = []
    for folder in sorted(root.glob("checkpoint_*")):
        step = int(folder.name.split("_")[1])
        if not _verify_ok(folder):
            continue
        model = fsdpckpt.load_full_state_dict(folder / "pytorch_model_fsdp_0")["model"]
        if not any(all(torch.equal(model[k], v) for k, v in model_at(w).state_dict().items())
                   for w in weights.get(step, [step])):
            problems.append(f"verify says OK of {folder.name}, which is not whole")
    return problems


# -- CheckpointManager ----------------------------------------------------------------------


def _manager_with(root: Path, steps: list[int], keep_last: int = 2) -> None:
    manager = fsdpckpt.CheckpointManager(root, keep_last=keep_last)
    for step in steps:
        manager.save(step, model=model_at(step))


def _restores(copy: Path, allowed: dict[int, int]) -> list[str]:
    """The newest checkpoint restores, its step one of ``allowed``, bit-exact with the
    weights ``allowed[step]`` names."""
    target = model_at(0)
    try:
        step = fsdpckpt.CheckpointManager(copy, keep_last=2).restore(model=target)
    except fsdpckpt.FsdpCkptError as exc:
        return [f"restore failed: {exc}"]
    if step not in allowed:
        return [f"restored step {step}, expected one of {sorted(allowed)}"]
    if not _same_model(target, allowed[step]):
        return [f"step {step} restored, not bit-exact"]
    return []


def test_a_save_with_retention_keeps_the_last_committed_step_in_every_crash_state(tmp_path):
    root = tmp_path / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        allowed = {3: 3} if "3" in reported else {2: 2, 3: 3}
        return _restores(copy, allowed) + _verified_steps_are_whole(copy, {})

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(3, model=model_at(3))\n" + crashsim.report("3"))
    _explore(tmp_path, root, program, check)


def test_a_save_over_a_step_keeps_a_whole_copy_of_it_in_every_crash_state(tmp_path):
    root = tmp_path / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        # Step 2 again, with the weights of "step 20": before the save returns, either copy.
        weights = {2: [20]} if "2" in reported else {2: [2, 20]}
        restored = [_restores(copy, {2: w}) for w in weights[2]]
        problems = [] if any(not r for r in restored) else restored[0]
        return problems + _verified_steps_are_whole(copy, weights)

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(2, model=model_at(20), overwrite=True)\n" + crashsim.report("2"))
    _explore(tmp_path, root, program, check)


# -- save_state into a new folder -----------------------------------------------------------


def test_save_state_leaves_a_loadable_checkpoint_or_none_that_passes(tmp_path):
    root = tmp_path / "out"
    root.mkdir()

    def check(copy: Path, reported: list[str]) -> list[str]:
        folder = copy / "ckpt"
        target = model_at(0)
        try:
            fsdpckpt.load_state(folder, target)
        except fsdpckpt.FsdpCkptError:
            return ["the saved checkpoint does not load"] if reported else []
        problems = [] if _same_model(target, 5) else ["a checkpoint loads, not bit-exact"]
        if not _verify_ok(folder) and reported:
            problems.append("verify refuses the saved checkpoint")
        return problems

    program = (f"fsdpckpt.save_state({str(root / 'ckpt')!r}, model_at(5))\n" +
               crashsim.report("saved"))
    _explore(tmp_path, root, program, check)


# -- merge ----------------------------------------------------------------------------------


def _output(folder: Path) -> dict[str, bytes] | None:
    """The output in ``folder`` as a loader finds it: the single file if there is one (loaders
    prefer it), else the index and the shards it names; None: no output."""
    import json

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


@pytest.mark.parametrize("shard", [None, "600B"], ids=["one-file", "sharded-with-index"])
def test_merge_over_an_output_leaves_the_old_or_the_new_whole(tmp_path, shard):
    root = tmp_path / "work"
    for step in (1, 2):
        fsdpckpt.save_state(root / f"ckpt{step}", model_at(step))
    fsdpckpt.merge(root / "ckpt2", tmp_path / "new", max_shard_size=shard)
    fsdpckpt.merge(root / "ckpt1", root / "out", max_shard_size=shard)
    old, new = _output(root / "out"), _output(tmp_path / "new")
    assert old != new and len(new) == (1 if shard is None else 3)  # 2 shards and the index

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _output(copy / "out")
        allowed = [new] if reported else [old, new, None]
        problems = [] if now in allowed else [f"the output is neither old nor new: {sorted(now)}"]
        if now not in (old, new) and _verify_ok(copy / "out"):
            problems.append("verify says OK of an output that is not whole")
        return problems

    program = (f"fsdpckpt.merge({str(root / 'ckpt2')!r}, {str(root / 'out')!r}, overwrite=True, "
               f"max_shard_size={shard!r})\n" + crashsim.report("merged"))
    _explore(tmp_path, root, program, check)


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
               crashsim.report("merged"))
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states")
    assert any("(all unsynced lost): the merged output was lost" in v
               for v in result.violations), result.violations


def test_a_save_whose_metadata_is_never_fsynced_is_caught(tmp_path):
    # torch's writer fsyncs .metadata.tmp before its bytes are flushed; without fsdpckpt's own
    # fsync of each closed file, a power loss can cut a reported checkpoint's .metadata.
    root = tmp_path / "out"
    root.mkdir()

    def check(copy: Path, reported: list[str]) -> list[str]:
        target = model_at(0)
        try:
            fsdpckpt.load_state(copy / "ckpt", target)
        except fsdpckpt.FsdpCkptError:
            return ["the saved checkpoint does not load"] if reported else []
        return []

    program = ("import fsdpckpt._io.dcp_storage as storage\n"
               "storage.fsync_file = lambda path: None  # the bug\n"
               f"fsdpckpt.save_state({str(root / 'ckpt')!r}, model_at(5))\n" +
               crashsim.report("saved"))
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states")
    assert any("the saved checkpoint does not load" in v for v in result.violations), \
        result.violations


# -- outputs replaced whole: convert, export-hf, save_pretrained ----------------------------


def _files(folder: Path) -> dict[str, bytes] | None:
    """Every visible file under ``folder`` (hidden stages left out); None: no folder."""
    if not folder.is_dir():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in
                                       p.relative_to(folder).parts)}


#: The files whose presence makes a folder an export: a folder without one is plainly
#: unfinished to from_pretrained and PeftModel.from_pretrained (the export's commit files).
COMMIT_FILES = ("config.json", "adapter_config.json")


def _replaced_whole(tmp_path: Path, root: Path, program: str, old, new) -> None:
    """``program`` replaces the export in ``root/out`` (``old``) with ``new``: in every crash
    state the folder holds the old export whole, none (no commit file), or the new one whole
    (only that, once reported)."""
    assert old != new and old is not None

    old, new = _as_loaded(old), _as_loaded(new)

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _as_loaded(_files(copy / "out"))
        allowed = [new] if reported else [old, new, None]
        return [] if now in allowed else [f"out is neither old nor new: {sorted(now or {})}"]

    _explore(tmp_path, root, program + crashsim.report("written"), check)


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


def _twice(tmp_path: Path, first, second) -> tuple[dict, dict]:
    """The folder after ``first`` alone, and after ``first`` then ``second`` over it: the
    old export and the new one as it must end (what the new one keeps of the old included)."""
    first(tmp_path / "expected")
    old = _files(tmp_path / "expected")
    second(tmp_path / "expected")
    return old, _files(tmp_path / "expected")


def test_convert_over_an_output_leaves_the_old_or_the_new_whole(tmp_path):
    from safetensors.torch import save_file

    root = tmp_path / "work"
    root.mkdir()
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
               "overwrite=True)\n" + crashsim.report("converted"))
    _explore(tmp_path, root, program, check)


LLAMA = Path(__file__).parent.parent / "fixtures" / "tiny_llama" / "untied"
LORA = Path(__file__).parent.parent / "fixtures" / "hf_trainer_lora"


def test_export_hf_over_an_export_leaves_the_old_or_the_new_whole(tmp_path):
    root = tmp_path / "work"
    source = LLAMA / "checkpoint-3"
    old, new = _twice(tmp_path, lambda out: fsdpckpt.export_hf(source, out),
                      lambda out: fsdpckpt.export_hf(source, out, dtype="bf16", overwrite=True))
    fsdpckpt.export_hf(source, root / "out")
    program = (f"fsdpckpt.export_hf({str(source)!r}, {str(root / 'out')!r}, dtype='bf16', "
               "overwrite=True)\n")
    _replaced_whole(tmp_path, root, program, old, new)


@pytest.mark.parametrize("old_kind,new_kind", [("fuse", "adapter"), ("adapter", "fuse")])
def test_a_lora_export_over_another_leaves_the_old_or_the_new_whole(tmp_path, old_kind,
                                                                    new_kind):
    root = tmp_path / "work"
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    old, new = _twice(tmp_path, lambda out: fsdpckpt.export_hf(source, out, base=base,
                                                               lora=old_kind),
                      lambda out: fsdpckpt.export_hf(source, out, base=base, lora=new_kind,
                                                     overwrite=True))
    fsdpckpt.export_hf(source, root / "out", base=base, lora=old_kind)
    program = (f"fsdpckpt.export_hf({str(source)!r}, {str(root / 'out')!r}, base={str(base)!r}, "
               f"lora={new_kind!r}, overwrite=True)\n")
    _replaced_whole(tmp_path, root, program, old, new)


def test_an_adapter_export_over_a_full_one_leaves_no_full_model_beside_it(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse")
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter", overwrite=True)
    names = set(_files(tmp_path / "out"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"config.json", "generation_config.json", "model.safetensors"}


def test_a_full_export_over_an_adapter_export_leaves_no_adapter_beside_it(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter")
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse", overwrite=True)
    names = set(_files(tmp_path / "out"))
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"}


def test_an_export_over_one_of_the_other_kind_needs_overwrite(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter")
    with pytest.raises(fsdpckpt.OutputExistsError, match="adapter_"):
        fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse")
    fsdpckpt.export_hf(source, tmp_path / "full", base=base, lora="fuse")
    with pytest.raises(fsdpckpt.OutputExistsError, match="config.json|model.safetensors"):
        fsdpckpt.export_hf(source, tmp_path / "full", base=base, lora="adapter")


_LLAMA_AT = f"""
import transformers


def llama_at(seed):
    config = transformers.LlamaConfig.from_pretrained({str(LLAMA)!r})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)
"""


def test_save_pretrained_over_a_save_leaves_the_old_or_the_new_whole(tmp_path):
    shared: dict = {}
    exec(PRELUDE + _LLAMA_AT, shared)
    llama_at = shared["llama_at"]
    root = tmp_path / "work"
    old, new = _twice(tmp_path, lambda out: fsdpckpt.save_pretrained(llama_at(1), out),
                      lambda out: fsdpckpt.save_pretrained(llama_at(2), out, overwrite=True))
    fsdpckpt.save_pretrained(llama_at(1), root / "out")
    program = _LLAMA_AT + (f"fsdpckpt.save_pretrained(llama_at(2), {str(root / 'out')!r}, "
                           "overwrite=True)\n")
    _replaced_whole(tmp_path, root, program, old, new)
