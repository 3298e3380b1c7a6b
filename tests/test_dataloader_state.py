"""save_state(dataloader=...) / load_state(dataloader=...) (issue 19): each rank's loader state
saved in its own file, Accelerate's names kept both ways, the policy on another world size."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import fsdpckpt
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError, UnsafePickleError

import workers
from conftest import _RunsCommand, hostile_pickle
from deep_compare import assert_same_tensors
from multirank import run_ranks

multirank = pytest.mark.multirank
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own

N = 48


def _shuffled(seed: int) -> StatefulDataLoader:
    """A shuffled loader whose state holds its sampler's generator (a tensor)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(list(range(N)), batch_size=4, shuffle=True, generator=generator)


def _sharded(rank: int, world: int) -> StatefulDataLoader:
    """A loader over this rank's share of the data, as training on several ranks has it."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(list(range(N)), num_replicas=world, rank=rank, seed=3)
    return StatefulDataLoader(list(range(N)), batch_size=4, sampler=sampler)


def _take(iterator, count: int) -> list[list[int]]:
    return [next(iterator).tolist() for _ in range(count)]


class Counter:
    """The smallest stateful loader: anything with state_dict() / load_state_dict()."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position, "order": torch.arange(4) * self.position}

    def load_state_dict(self, state: dict) -> None:
        assert torch.equal(state["order"], torch.arange(4) * state["position"])
        self.position = state["position"]


def _saved(tmp_path, *, consumed: int = 3, **kwargs):
    """A model and a shuffled loader ``consumed`` batches in, saved; with what comes next."""
    model = workers.make_model()
    loader = _shuffled(0)
    iterator = iter(loader)
    _take(iterator, consumed)
    fsdpckpt.save_state(tmp_path / "ckpt", model, dataloader=loader, step=consumed, **kwargs)
    return tmp_path / "ckpt", model, _take(iterator, N // 4 - consumed)


def test_a_resumed_loader_gives_the_batches_of_an_uninterrupted_one(tmp_path):
    ckpt, _model, rest = _saved(tmp_path)
    fresh = _shuffled(99)  # another seed: everything it gives comes from the saved state
    result = fsdpckpt.load_state(ckpt, workers.make_model(), dataloader=fresh)
    assert _take(iter(fresh), len(rest)) == rest
    assert result.restored == ("model", "dataloader", "rng") and result.warnings == ()
    manifest = json.loads((ckpt / "fsdpckpt.json").read_text())
    assert "dl_state_dict.bin" in json.dumps(manifest)  # recorded like every side file
    assert fsdpckpt.verify_checkpoint(ckpt).ok


def test_several_loaders_keep_accelerates_numbering(tmp_path):
    loaders = [_shuffled(0), Counter(5)]
    iterator = iter(loaders[0])
    _take(iterator, 2)
    fsdpckpt.save_state(tmp_path / "ckpt", workers.make_model(), dataloader=loaders, step=1)
    names = {f.name for f in find_layout(tmp_path / "ckpt").files_of("dataloader")}
    assert names == {"dl_state_dict.bin", "dl_state_dict_1.bin"}
    rest = _take(iterator, 3)
    fresh = [_shuffled(7), Counter()]
    result = fsdpckpt.load_state(tmp_path / "ckpt", dataloader=fresh)  # the loaders only
    assert fresh[1].position == 5 and result.restored == ("dataloader", "rng")
    assert _take(iter(fresh[0]), 3) == rest


def test_the_manager_passes_the_loader_through(tmp_path):
    loader = _shuffled(0)
    iterator = iter(loader)
    _take(iterator, 4)
    fsdpckpt.CheckpointManager(tmp_path / "run").save(4, model=workers.make_model(),
                                                     dataloader=loader)
    fresh = _shuffled(1)
    manager = fsdpckpt.CheckpointManager(tmp_path / "run")
    assert manager.restore(model=workers.make_model(), dataloader=fresh) == 4
    assert _take(iter(fresh), 2) == _take(iterator, 2)
    assert "dataloader" in manager.last_restore.restored


def test_saving_again_without_a_loader_leaves_no_old_loader_state(tmp_path):
    ckpt, _model, _rest = _saved(tmp_path)
    (ckpt / "dl_state_dict_rank1.bin").write_bytes((ckpt / "dl_state_dict.bin").read_bytes())
    fsdpckpt.save_state(ckpt, workers.make_model(), step=9, overwrite=True)
    assert not list(ckpt.glob("dl_state_dict*"))  # an old state is never loaded as the new
    with pytest.raises(CheckpointNotFoundError, match="dl_state_dict"):
        fsdpckpt.load_state(ckpt, workers.make_model(), dataloader=Counter())


def test_an_excluded_loader_is_neither_read_nor_loaded(tmp_path):
    ckpt, model, _rest = _saved(tmp_path)
    (ckpt / "dl_state_dict.bin").write_bytes(b"damaged")  # never read
    fresh = Counter(2)
    result = fsdpckpt.load_state(ckpt, workers.make_model(), dataloader=fresh,
                                 exclude="dataloader")
    assert fresh.position == 2 and result.excluded == ("dataloader",)
    assert result.restored == ("model", "rng")


def test_a_checkpoint_saved_without_loader_state_says_how_to_resume(tmp_path):
    fsdpckpt.save_state(tmp_path / "ckpt", workers.make_model(), step=1)
    model, fresh = workers.make_model(), Counter(3)
    with torch.no_grad():
        model[0].weight.add_(1)
    before = model.state_dict()[("0.weight")].clone()
    with pytest.raises(CheckpointNotFoundError, match=r"dl_state_dict\.bin.*exclude=.dataloader"):
        fsdpckpt.load_state(tmp_path / "ckpt", model, dataloader=fresh)
    assert torch.equal(model[0].weight, before) and fresh.position == 3


def test_an_object_that_is_not_stateful_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(fsdpckpt.OptionError, match="dataloader 0 .*list.* state_dict"):
        fsdpckpt.save_state(tmp_path / "ckpt", workers.make_model(), dataloader=[[1, 2]])
    assert not (tmp_path / "ckpt").exists()


def test_a_misspelt_part_lists_dataloader(tmp_path):
    ckpt, _model, _rest = _saved(tmp_path)
    with pytest.raises(fsdpckpt.OptionError, match=r"unknown part 'dataloaders'.*dataloader"):
        fsdpckpt.load_state(ckpt, workers.make_model(), dataloader=Counter(),
                            exclude="dataloaders")


def _damage(path, how, sentinel):
    if how == "hostile archive":
        torch.save({"_num_yielded": _RunsCommand(f"touch {sentinel}")}, path)
    elif how == "hostile pickle":
        path.write_bytes(hostile_pickle(sentinel))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("how, error", [("hostile archive", UnsafePickleError),
                                        ("hostile pickle", NotACheckpointError),
                                        ("truncated", NotACheckpointError)])
def test_a_bad_loader_file_is_one_error_before_anything_changes(tmp_path, how, error):
    ckpt, _model, _rest = _saved(tmp_path)
    sentinel = tmp_path / "ran"
    _damage(ckpt / "dl_state_dict.bin", how, sentinel)
    model = workers.make_model()
    with torch.no_grad():
        model[0].weight.add_(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _shuffled(5)
    rng_before = torch.get_rng_state()
    with pytest.raises(error) as caught:
        fsdpckpt.load_state(ckpt, model, dataloader=fresh)
    message = str(caught.value)
    assert "dl_state_dict.bin" in message and "\n" not in message
    assert not sentinel.exists()
    assert_same_tensors(model.state_dict(), before)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert _take(iter(fresh), 2) == _take(iter(_shuffled(5)), 2)
    problems = fsdpckpt.verify_checkpoint(ckpt).problems  # verify reads it as load does
    assert any("dl_state_dict.bin" in p.path for p in problems)


@pytest.mark.parametrize("name, index, rank", [
    ("dl_state_dict.bin", 0, None), ("dl_state_dict_2.bin", 2, None),
    ("dl_state_dict_rank1.bin", 0, 1), ("dl_state_dict_2_rank13.bin", 2, 13),
])
def test_per_rank_names_are_side_files_of_their_rank(tmp_path, name, index, rank):
    ckpt, _model, _rest = _saved(tmp_path)
    if name != "dl_state_dict.bin":
        shutil.copy(ckpt / "dl_state_dict.bin", ckpt / name)
    layout = find_layout(ckpt)
    found = [f for f in layout.files_of("dataloader") if f.name == name]
    assert len(found) == 1 and found[0].rank == rank and name not in layout.other_files
    report = fsdpckpt.inspect_checkpoint(ckpt).to_json()
    assert {"name": name, "kind": "dataloader", "rank": rank} in [
        {k: f[k] for k in ("name", "kind", "rank")} for f in report["side_files"]]


@pytest.mark.s3
def test_a_loader_state_on_object_storage(s3):
    server, root = s3
    url = f"s3://{root}/ckpt"
    loader = _shuffled(0)
    iterator = iter(loader)
    _take(iterator, 2)
    fsdpckpt.save_state(url, workers.make_model(), dataloader=loader, step=2,
                        storage_options=server.options)
    fresh = _shuffled(8)
    result = fsdpckpt.load_state(url, workers.make_model(), dataloader=fresh,
                                 storage_options=server.options)
    assert "dataloader" in result.restored
    assert _take(iter(fresh), 3) == _take(iterator, 3)


# --- Accelerate, both ways (one process; its stateful loaders wrap torchdata's) ---------------

@pytest.fixture
def accelerator():
    """Makes a new Accelerator, as a new process would (each keeps its own loaders)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    def make():
        AcceleratorState._reset_state(reset_partial_state=True)
        return accelerate.Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)


def _prepared(accelerator):
    from torch.utils.data import DataLoader

    # In order: Accelerate's loader state does not hold a shuffling sampler's generator, so
    # not even its own save_state / load_state resumes a shuffled one exactly.
    return accelerator.prepare(DataLoader(list(range(N)), batch_size=4))


def test_we_read_what_accelerate_save_state_writes(tmp_path, accelerator):
    saving = accelerator()
    iterator = iter(_prepared(saving))
    _take(iterator, 3)
    saving.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "dl_state_dict.bin").is_file()
    rest = _take(iterator, 5)
    fresh = _prepared(accelerator())
    result = fsdpckpt.load_state(tmp_path / "ckpt", dataloader=fresh)
    assert "dataloader" in result.restored and result.warnings == ()
    assert _take(iter(fresh), 5) == rest


def test_accelerate_load_state_reads_what_we_write(tmp_path, accelerator):
    iterator = iter(loader := _prepared(accelerator()))
    _take(iterator, 3)
    fsdpckpt.save_state(tmp_path / "ckpt", dataloader=loader, step=3)
    loading = accelerator()
    fresh = _prepared(loading)
    loading.load_state(tmp_path / "ckpt")
    assert _take(iter(fresh), 5) == _take(iterator, 5)


# --- Several ranks, and another world size ----------------------------------------------------

def _save_on_ranks(rank: int, world: int, ckpt: str) -> dict:
    """Each rank a different number of batches in, so each state is its own; saved, then
    loaded back into fresh loaders on the same ranks."""
    model = workers.wrap(workers.make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = _sharded(rank, world)
    iterator = iter(loader)
    _take(iterator, 1 + rank)
    fsdpckpt.save_state(ckpt, model, optimizer, dataloader=[loader, Counter(10 + rank)], step=7)
    rest = _take(iterator, 2)
    fresh, counter = _sharded(rank, world), Counter()
    result = fsdpckpt.load_state(ckpt, workers.wrap(workers.make_model(), "fsdp2"),
                                 dataloader=[fresh, counter])
    params, _ = workers.full_state(model, optimizer)
    return {"rest": rest, "resumed": _take(iter(fresh), 2), "counter": counter.position,
            "warnings": result.warnings, "restored": result.restored, "params": params}


def _load_on_ranks(rank: int, world: int, loads: list) -> list[dict]:
    """Each ``(folder, exclude)`` loaded into a fresh FSDP2 model, AdamW and loaders."""
    found = []
    for ckpt, exclude in loads:
        model = workers.wrap(workers.make_model(), "fsdp2")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        optimizer, counter = torch.optim.AdamW(model.parameters()), Counter(-1)
        result = fsdpckpt.load_state(ckpt, model, optimizer, exclude=exclude,
                                     dataloader=[_sharded(rank, world), counter])
        params, _ = workers.full_state(model, optimizer)
        found.append({"counter": counter.position, "warnings": result.warnings,
                      "params": params, "restored": result.restored})
    return found


@multirank
def test_each_rank_gets_its_own_state_back_and_one_rank_resumes_a_two_rank_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    ranks = run_ranks(_save_on_ranks, str(ckpt))
    for rank, got in enumerate(ranks):
        assert got["resumed"] == got["rest"] and got["counter"] == 10 + rank
        assert got["warnings"] == () and "dataloader" in got["restored"]
    assert ranks[0]["rest"] != ranks[1]["rest"]
    names = {f.name: f.rank for f in find_layout(ckpt).files_of("dataloader")}
    assert names == {"dl_state_dict.bin": None, "dl_state_dict_1.bin": None,
                     "dl_state_dict_rank1.bin": 1, "dl_state_dict_1_rank1.bin": 1}
    assert fsdpckpt.verify_checkpoint(ckpt).ok  # every rank's files are in the manifest

    # Resumed by one process: rank 0's state, and a warning that rank 1's is not used.
    model, counter, loader = workers.make_model(), Counter(), _sharded(0, 1)
    result = fsdpckpt.load_state(ckpt, model, dataloader=[loader, counter])
    assert counter.position == 10
    dataloader_warnings = [w for w in result.warnings if "dataloader state" in w]
    assert len(dataloader_warnings) == 1
    assert "saved by 2 ranks, this run has 1" in dataloader_warnings[0]
    assert "the state of rank 1 is not used" in dataloader_warnings[0]
    assert_same_tensors(model.state_dict(), ranks[0]["params"])

    # Fine-tuning on the new world size: fresh optimizer and loaders, no word about them.
    fresh = workers.make_model()
    result = fsdpckpt.load_state(ckpt, fresh, torch.optim.AdamW(fresh.parameters()),
                                 dataloader=Counter(-1), exclude=["optimizer", "dataloader"])
    assert result.excluded == ("dataloader", "optimizer")
    assert not [w for w in result.warnings if "dataloader" in w]
    assert_same_tensors(fresh.state_dict(), ranks[0]["params"])


@multirank
def test_two_ranks_resume_a_one_rank_run_and_accelerates_shared_file(tmp_path):
    one = tmp_path / "one"
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    fsdpckpt.save_state(one, model, optimizer, dataloader=[_sharded(0, 1), Counter(5)], step=2)
    shared = tmp_path / "shared"  # Accelerate's: one dl_state_dict.bin beside 2 RNG files
    shutil.copytree(one, shared)
    shutil.copy(shared / "random_states_0.pkl", shared / "random_states_1.pkl")
    (shared / "fsdpckpt.json").unlink()
    ranks = run_ranks(_load_on_ranks, [(str(one), None), (str(one), ["optimizer", "dataloader"]),
                                       (str(shared), None)])
    grown, fine_tune, from_shared = zip(*ranks)
    for got in grown:
        assert got["counter"] == 5  # rank 1 has no state of its own: rank 0's
    assert_same_tensors(grown[0]["params"], model.state_dict())  # full state: on rank 0
    said = [w for w in grown[0]["warnings"] if "dataloader" in w]
    assert len(said) == 1 and "saved by 1 rank, this run has 2" in said[0]
    assert "rank 1 has none and loads rank 0's" in said[0]
    assert not [w for w in grown[1]["warnings"] if "dataloader" in w]
    for got in fine_tune:  # the model reshards; optimizer and loaders keep their state
        assert got["counter"] == -1 and got["restored"] == ("model", "rng")
        assert not [w for w in got["warnings"] if "dataloader" in w]
    assert_same_tensors(fine_tune[0]["params"], model.state_dict())
    for got in from_shared:  # every rank loads the one file, as accelerator.load_state does
        assert got["counter"] == 5 and got["warnings"] == ()


def _accelerate_on_ranks(rank: int, world: int, ckpt: str) -> dict:
    """Accelerate (FSDP2 on the CPU) saves a stateful loader from both ranks, as it does, to
    one dl_state_dict.bin; fsdpckpt's load_state and accelerator.load_state then resume it."""
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    accelerator = workers._accelerator()
    accelerator.dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)
    model = workers.make_model()
    model, _optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    loader = accelerator.prepare(DataLoader(list(range(N)), batch_size=4))
    iterator = iter(loader)
    _take(iterator, 2)
    accelerator.save_state(ckpt)
    # Accelerate's save_state returns without a barrier after each rank writes its own
    # random_states_{rank}.pkl (and every rank writes dl_state_dict.bin): without this wait,
    # rank 0 may read the folder before rank 1 has finished writing into it.
    accelerator.wait_for_everyone()
    rest = _take(iterator, 2)
    ours = accelerator.prepare(DataLoader(list(range(N)), batch_size=4))
    result = fsdpckpt.load_state(ckpt, model, dataloader=ours)
    return {"rest": rest, "ours": _take(iter(ours), 2), "warnings": result.warnings,
            "restored": result.restored}


@multirank
def test_two_ranks_resume_what_accelerate_saved_on_two_ranks(tmp_path):
    pytest.importorskip("accelerate")
    ranks = run_ranks(_accelerate_on_ranks, str(tmp_path / "ckpt"))
    assert ranks[0]["rest"] != ranks[1]["rest"]  # each rank its own shard of the data
    for got in ranks:
        assert got["ours"] == got["rest"] and got["warnings"] == ()
        assert got["restored"] == ("model", "dataloader", "rng")
