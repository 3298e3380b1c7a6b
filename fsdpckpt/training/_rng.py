"""Saving and restoring RNG state per rank, in Accelerate's ``random_states_{rank}.pkl`` format.

The file is a ``torch.save`` of ``{"step", "random_state", "numpy_random_seed",
"torch_manual_seed", "torch_cuda_manual_seed"}``, as Accelerate writes it. It is
never read by ``torch.load`` or numpy's unpickling: :mod:`fsdpckpt.dcp._rngfile` decodes
exactly that shape of state with fsdpckpt's own restricted unpickler, checks every
field, and refuses anything else with one line.

Policy when the world size changes (documented in docs/training.md): a rank
with a saved file restores it; a rank without one seeds python, numpy and torch
from a hash of rank 0's saved state and its own rank (deterministic, distinct
per rank) and a warning says so; files of ranks that no longer exist are ignored
with a warning. Nothing is skipped silently.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._rngfile import read_rng_archive, rng_fields
from fsdpckpt.errors import NotACheckpointError

__all__ = ["capture_rng_state", "rng_state_bytes", "load_rng_file", "restore_rng", "rng_file",
           "prepare_rng", "PreparedRng"]


def rng_file(checkpoint_dir: Place, rank: int) -> Place:
    """Accelerate's name for ``rank``'s RNG file (HF Trainer's ``rng_state_{rank}.pth`` if only
    that exists)."""
    accelerate = checkpoint_dir / f"random_states_{rank}.pkl"
    trainer = checkpoint_dir / f"rng_state_{rank}.pth"
    return trainer if trainer.exists() and not accelerate.exists() else accelerate


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional: without it there is no numpy RNG to keep
        return None
    return numpy


def capture_rng_state(step: int | None) -> dict[str, Any]:
    """This process's RNG state, keyed as Accelerate keys it."""
    import torch

    state: dict[str, Any] = {"step": step if step is not None else 0,
                             "random_state": random.getstate(),
                             "torch_manual_seed": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy_random_seed"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def rng_state_bytes(step: int | None) -> bytes:
    """This process's RNG state as the bytes of a ``random_states_{rank}.pkl`` file."""
    return torch_save_bytes(capture_rng_state(step))


def torch_save_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` into bytes."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_rng_file(path: Place) -> dict[str, Any]:
    """Read an RNG file exactly (see :mod:`fsdpckpt.dcp._rngfile`), keyed as Accelerate keys it.

    Never calls ``torch.load`` or numpy's unpickling: numpy's key array is built
    with ``numpy.frombuffer`` from bytes checked to be exactly 624 uint32 words.

    Raises:
        UnsafePickleError: the file names a global outside the RNG allowlist (it may be hostile).
        NotACheckpointError: the file is not a torch.save archive of RNG state, or a field
            is not what RNG state holds; one line naming the file and the field.
    """
    return _normalize(read_rng_archive(path), path)


def refused(path: Place, exc: BaseException, what: str) -> BaseException:
    """The error for a file ``torch.load(weights_only=True)`` would not load (fsdpckpt's own
    errors, a checksum that fails before torch reads, as they are): the one translation,
    :func:`fsdpckpt.dcp._objects.refused_load`."""
    from fsdpckpt.dcp._objects import refused_load

    return refused_load(path, exc, what)


def _normalize(state: dict[Any, Any], path: Place) -> dict[str, Any]:
    """Check every field (HF Trainer's names too) and build the real states (:func:`rng_fields`)."""
    state = rng_fields(state, path)
    if "torch_manual_seed" not in state and "random_state" not in state:
        raise NotACheckpointError(f"{path}: holds no RNG state this tool knows "
                                  f"(keys {sorted(state)})")
    return state


def _apply(state: dict[str, Any]) -> None:
    import torch

    if "random_state" in state:
        random.setstate(state["random_state"])
    np = _numpy()
    if np is not None and "numpy_random_seed" in state:
        np.random.set_state(state["numpy_random_seed"])
    if "torch_manual_seed" in state:
        torch.set_rng_state(state["torch_manual_seed"])
    cuda = state.get("torch_cuda_manual_seed")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda)


def _derive(rank_zero: dict[str, Any], rank: int) -> None:
    import torch

    digest = hashlib.sha256(bytes(rank_zero["torch_manual_seed"].numpy().tobytes()) +
                            rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


class PreparedRng:
    """This rank's RNG state, read and checked by :func:`prepare_rng`, not yet applied.

    Attributes:
        step: the step saved with it, or None.
        warnings: what the caller should know (the policy applied on a new world size...).
    """

    def __init__(self, step: int | None, warnings: list[str],
                 apply: Callable[[], None]) -> None:
        self.step, self.warnings, self._apply = step, warnings, apply

    def apply(self) -> None:
        """Set python's, numpy's and torch's RNG state (or seed them, by the policy above)."""
        self._apply()


def _checked(path: Place, change: Callable[[], None]) -> Callable[[], None]:
    # The decoded state is tried once and the current state put back, so apply() later
    # cannot fail half-way: whatever python, numpy or torch would refuse is refused now,
    # before a load has changed anything.
    current = capture_rng_state(None)
    try:
        change()
    except Exception as exc:  # noqa: BLE001 - one clear error
        raise NotACheckpointError(f"{path}: holds RNG state that cannot be restored "
                                  f"({type(exc).__name__}); the file is damaged. Delete it "
                                  "to resume without it") from None
    finally:
        _apply(current)
    return change


def _ranks(checkpoint_dir: Place, prefix: str, suffix: str) -> list[int]:
    """The ranks of the files ``{prefix}{rank}{suffix}`` in the checkpoint folder."""
    found = (p.name[len(prefix):-len(suffix)] for p in checkpoint_dir.glob(f"{prefix}*{suffix}"))
    return sorted(int(rank) for rank in found if rank.isdigit())


def prepare_rng(checkpoint_dir: Place, rank: int, world_size: int) -> PreparedRng:
    """Read and check everything :func:`restore_rng` needs, changing no RNG state.

    Args:
        checkpoint_dir: the checkpoint folder holding ``random_states_{rank}.pkl``.
        rank: this process's rank.
        world_size: the number of ranks now.

    Returns:
        A :class:`PreparedRng`; its ``apply()`` restores the state by the policy above.

    Raises:
        UnsafePickleError: an RNG file asks for a global outside the allowlist.
        NotACheckpointError: an RNG file is damaged or holds state that cannot be set.
    """
    saved = _ranks(checkpoint_dir, "random_states_", ".pkl") or \
        _ranks(checkpoint_dir, "rng_state_", ".pth")
    warnings: list[str] = []
    if not saved:
        return PreparedRng(None, [f"{checkpoint_dir}: no RNG state files; RNG state was not "
                                  "restored"], lambda: None)
    if len(saved) != world_size and rank == 0:
        warnings.append(f"{checkpoint_dir}: RNG states saved for {len(saved)} ranks, this run has "
                        f"{world_size}; ranks without a file are seeded from rank 0's state and "
                        "their rank, extra files are ignored")
    path = rng_file(checkpoint_dir, rank if rank in saved else saved[0])
    state = load_rng_file(path)
    if rank in saved:
        change = _checked(path, lambda: _apply(state))
    else:
        change = _checked(path, lambda: _derive(state, rank))
    step = state.get("step")
    step = int(step) if isinstance(step, int) and not isinstance(step, bool) else None
    return PreparedRng(step, warnings, change)


def restore_rng(checkpoint_dir: Place, rank: int, world_size: int) -> tuple[int | None, list[str]]:
    """Restore this rank's RNG state by the policy above; return the saved step and warnings.

    The same as :func:`prepare_rng` then ``apply()``: nothing changes unless every
    part of the state could be read and set.
    """
    prepared = prepare_rng(checkpoint_dir, rank, world_size)
    prepared.apply()
    return prepared.step, prepared.warnings
