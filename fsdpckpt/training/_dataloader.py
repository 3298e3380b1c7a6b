"""Dataloader state per rank: ``save_state(dataloader=...)`` / ``load_state(dataloader=...)``.

A dataloader is any object with ``state_dict()`` / ``load_state_dict()``: torchdata's
``StatefulDataLoader``, Accelerate's stateful loaders (``use_stateful_dataloader=True``).

Names. Accelerate's ``save_state`` has every rank ``torch.save`` its loader's state to the
same ``dl_state_dict.bin`` (``dl_state_dict_{i}.bin`` for loader i): the last rank to write
wins, and ``accelerator.load_state`` gives that one state to every rank. Each rank's state is
its own (its place in its shard, its workers' states), so fsdpckpt keeps one per rank: rank 0
writes Accelerate's name and rank r > 0 writes ``dl_state_dict_rank{r}.bin``
(``dl_state_dict_{i}_rank{r}.bin``), the ``_rank{r}`` suffix Accelerate itself gives per-rank
files (``pytorch_model_fsdp_{i}_rank{r}.bin``). So ``accelerator.load_state`` still reads what
fsdpckpt writes (rank 0's state, on every rank, as it does with its own files), and a folder
that Accelerate wrote is one holding a single state for every rank.

Policy (docs/training.md), per loader:

- a rank with a saved state of its own loads it, exactly;
- a rank without one (the run grew) loads rank 0's, as ``accelerator.load_state`` gives every
  rank the one file: it then stands as far into its epoch as the other ranks. Starting it
  afresh instead would have it yield more batches than the others, and ranks that step in
  lockstep would fall out of step (a collective at the epoch's end would hang);
- states of ranks that no longer exist (the run shrank) are not used;
- on another world size rank 0's :attr:`~fsdpckpt.training.state.LoadResult.warnings` says
  which of these happened; with ``exclude="dataloader"`` nothing is read and nothing said;
- a folder holding only Accelerate's name beside RNG files of several ranks was written by
  Accelerate: every rank loads that one state, as ``accelerator.load_state`` would, silently.

Files are written by the side-file writer of ``save_state`` (recorded in the manifest) and
read by :func:`fsdpckpt.dcp._sidefiles.read_state_file`, never ``torch.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._objects import to_torch
from fsdpckpt.dcp._sidefiles import read_state_file
from fsdpckpt.dcp.layout import DATALOADER_STATE
from fsdpckpt.errors import CheckpointNotFoundError, OptionError
from fsdpckpt.training._rng import _ranks

__all__ = ["dataloader_file", "stateful", "dataloader_parts", "prepare_dataloaders",
           "PreparedDataloaders"]


def dataloader_file(root: Place, index: int, rank: int) -> Any:
    """Where ``rank`` keeps the state of loader ``index`` (see the module's docstring)."""
    stem = "dl_state_dict" if index == 0 else f"dl_state_dict_{index}"
    return root / (f"{stem}.bin" if rank == 0 else f"{stem}_rank{rank}.bin")


def stateful(loaders: Any) -> list[Any]:
    """``loaders`` (None, one or a list) as a list, each checked to be a stateful loader.

    Raises:
        OptionError: a loader has no ``state_dict()`` / ``load_state_dict()``.
    """
    found = [] if loaders is None else list(loaders) if isinstance(loaders, (list, tuple)) \
        else [loaders]
    for i, loader in enumerate(found):
        if not (callable(getattr(loader, "state_dict", None))
                and callable(getattr(loader, "load_state_dict", None))):
            raise OptionError(f"dataloader {i} ({type(loader).__name__}) has no state_dict() "
                              "and load_state_dict(): pass a stateful loader, such as "
                              "torchdata's StatefulDataLoader")
    return found


def dataloader_parts(root: Place, loaders: list[Any], rank: int) -> list[tuple[Place, Any]]:
    """The files this rank writes, each with the loader whose ``state_dict()`` it holds."""
    return [(dataloader_file(root, i, rank), loader) for i, loader in enumerate(loaders)]


def _saved_ranks(root: Place) -> dict[int, set[int]]:
    """Loader index -> the ranks whose states of it the folder holds."""
    found: dict[int, set[int]] = {}
    for path in root.glob("dl_state_dict*.bin"):
        if match := DATALOADER_STATE.match(path.name):
            found.setdefault(int(match.group("index") or 0), set()).add(
                int(match.group("rank") or 0))
    return found


def _span(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 2 to 7`` or ``ranks 1, 4, 6`` (the first five, then a count)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]} to {ranks[-1]}"
    more = f" and {len(ranks) - 5} more" if len(ranks) > 5 else ""
    return f"ranks {', '.join(map(str, ranks[:5]))}{more}"


def _policy(root: Place, saved: set[int], world: int) -> str:
    """The warning for the states of the ranks ``saved`` loaded on ``world`` ranks."""
    count = f"{len(saved)} rank" + "s" * (len(saved) != 1)
    said = (f"{root}: dataloader state saved by {count}, this run has {world}: each rank "
            "with a state of its own loads it")
    if missing := [r for r in range(world) if r not in saved]:
        first, one = min(saved), len(missing) == 1  # rank 0, unless its file is gone
        said += (f"; {_span(missing)} {'has' if one else 'have'} none and "
                 f"{'loads' if one else 'load'} rank {first}'s (as accelerator.load_state does "
                 f"on every rank), so {'it starts' if one else 'they start'} as far into the "
                 f"epoch as rank {first}")
    if gone := sorted(r for r in saved if r >= world):
        said += (f"; the state of {_span(gone)} is not used" if len(gone) == 1 else
                 f"; the states of {_span(gone)} are not used")
    return said + ". Samples will not come in the order of an uninterrupted run"


class PreparedDataloaders:
    """The states of this rank's loaders, read and checked, not yet loaded.

    Attributes:
        warnings: the policy applied, on rank 0, when the world size changed.
    """

    def __init__(self, warnings: list[str], apply: Callable[[], None]) -> None:
        self.warnings, self._apply = warnings, apply

    def apply(self) -> None:
        """Call each loader's ``load_state_dict`` with its state."""
        self._apply()


def prepare_dataloaders(root: Place, loaders: list[Any], rank: int,
                        world: int) -> PreparedDataloaders:
    """Read the state each of ``loaders`` gets on this rank by the policy above.

    Args:
        root: the checkpoint folder.
        loaders: the stateful loaders, in the order they were saved.
        rank: this process's rank.
        world: the number of ranks now.

    Returns:
        A :class:`PreparedDataloaders`; its ``apply()`` loads the states.

    Raises:
        CheckpointNotFoundError: a loader's state is not in the folder (saved without it).
        UnsafePickleError: a state file names a global outside the allowlist (nothing ran).
        NotACheckpointError: a state file is empty, cut short or damaged; one line naming it.
    """
    if not loaders:
        return PreparedDataloaders([], lambda: None)
    found = _saved_ranks(root)
    rng_ranks = _ranks(root, "random_states_", ".pkl") or _ranks(root, "rng_state_", ".pth")
    states, warnings = [], []
    for i in range(len(loaders)):
        saved = found.get(i, set())
        if not saved:
            raise CheckpointNotFoundError(
                f"{dataloader_file(root, i, 0)}: no such file, so the checkpoint holds no "
                f"state of dataloader {i}; pass exclude=\"dataloader\" to resume without it")
        shared = saved == {0} and len(rng_ranks) > 1  # Accelerate's one file for every rank
        source = rank if rank in saved else min(saved)  # rank 0's, by the policy
        if not shared and saved != set(range(world)) and rank == 0:
            message = _policy(root, saved, world)
            warnings += [message] if message not in warnings else []
        states.append(to_torch(read_state_file(dataloader_file(root, i, 0 if shared else source),
                                               "dataloader state")))

    def apply() -> None:
        for loader, state in zip(loaders, states):
            loader.load_state_dict(state)

    return PreparedDataloaders(warnings, apply)
