"""``save_state`` / ``load_state``: what training code calls, in Accelerate's layout.

Mechanism only: torch's ``get_state_dict`` / ``set_state_dict`` family turns
FSDP2, FSDP1, DDP and plain modules into sharded state dicts, and ``dcp.save`` /
``dcp.load`` move them (resharding on load). This module decides which file
holds what (Accelerate's names, so ``accelerator.load_state`` reads ours and we
read its), which rank writes it, and checks a model against a checkpoint before
anything is changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fsdpckpt._io.checksums import new_digest
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place, put_bytes, refresh
from fsdpckpt.dcp._objects import to_torch
from fsdpckpt.dcp._sidefiles import read_state_file
from fsdpckpt.dcp.layout import refuse_links_out, refuse_unfinished_save
from fsdpckpt.dcp.reader import shared_parses
from fsdpckpt.errors import (
    FsdpCkptError,
    NotACheckpointError,
    OptionError,
    OutputExistsError,
    ResumeWarning,
    StateMismatchError,
)
from fsdpckpt.training import _remote
from fsdpckpt.training._commit import AsyncSave, Finish
from fsdpckpt.training._dataloader import dataloader_parts, prepare_dataloaders, stateful
from fsdpckpt.training._dcp_io import check_local_reads, safe_load_planner, safe_storage_reader
from fsdpckpt.training._diskfull import raising_disk_full, removed_on_failure
from fsdpckpt.training._dist import async_group, dcp_call, dist_or_none, everywhere, rank_world
from fsdpckpt.training._exclude import exclusion
from fsdpckpt.training._layout import (
    check_parts,
    checkpoint_parts,
    commits_by_marker,
    model_folder,
    optimizer_folder,
    remove_stale_parts,
    scheduler_file,
)
from fsdpckpt.training._rng import prepare_rng, rng_state_bytes, torch_save_bytes
from fsdpckpt.training._save_side import training_config_files
from fsdpckpt.training._statecheck import (
    compare,
    flatten,
    mismatch_message,
    without_options_it_lacks,
)
from fsdpckpt.training.manifest import (
    Archives,
    FileRecord,
    checksum_writer,
)

__all__ = ["save_state", "load_state", "LoadResult", "AsyncSave", "StateMismatchError",
           "ResumeWarning"]

log = logging.getLogger("fsdpckpt")


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_state` restored.

    Attributes:
        step: the step saved with the checkpoint, or None.
        restored: the parts restored, e.g. ``("model", "optimizer", "scheduler", "rng")``.
        warnings: things the caller should know (the RNG and dataloader policies on a new
            world size...).
        excluded: what ``exclude=`` left out: the parts named, then ``"model:<key>"`` for
            each model key a glob matched (empty without ``exclude``).
        missing, unexpected, mismatched: what a load with ``strict=False`` left alone
            (``load_pretrained``): the model's keys the source lacks, the source's names
            the model lacks, and the keys both hold with different shapes (empty otherwise).
    """

    step: int | None
    restored: tuple[str, ...]
    warnings: tuple[str, ...]
    excluded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The result as JSON: ``{"step", "restored", "warnings"}``, and ``"excluded"``,
        ``"missing"``, ``"unexpected"``, ``"mismatched"`` when not empty (so a plain load's
        JSON is as it was)."""
        data: dict[str, Any] = {"step": self.step, "restored": list(self.restored),
                                "warnings": list(self.warnings)}
        for name in ("excluded", "missing", "unexpected", "mismatched"):
            if getattr(self, name):
                data[name] = list(getattr(self, name))
        return data


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _pairs(models: list[Any], optimizers: list[Any]) -> list[tuple[Any, Any]]:
    # Accelerate pairs optimizer i with model i; a single model serves every optimizer.
    if optimizers and not models:
        raise OptionError("an optimizer needs its model: pass model=...")
    return [(models[i] if i < len(models) else models[0], opt) for i, opt in enumerate(optimizers)]


def save_state(checkpoint_dir: str | os.PathLike[str] | RemotePath, model: Any = None,
               optimizer: Any = None,
               scheduler: Any = None, *, step: int | None = None, scaler: Any = None,
               extra: Mapping[str, Any] | None = None, dataloader: Any = None,
               async_save: bool = False, manifest: bool = True,
               digest: str | None = None, overwrite: bool = False,
               storage_options: dict[str, Any] | None = None) -> AsyncSave | None:
    """Save training state in Accelerate's layout; call it on every rank.

    Args:
        checkpoint_dir: the folder to write (created): a local path, or a URL
            (``s3://bucket/run/step_100``, any fsspec URL). On object storage the save
            follows the commit protocol of docs/remote-training.md: the manifest, written
            last, is the commit marker, so ``manifest=False`` is refused there.
        model: a module (FSDP2, FSDP1, DDP or plain) or a list of them:
            ``pytorch_model_fsdp_{i}/``.
        optimizer: an optimizer or a list (``optimizer_{i}/``, paired with model i).
        scheduler: an LR scheduler or a list (``scheduler.bin``, ``scheduler_{i}.bin``).
        step: saved in every ``random_states_{rank}.pkl`` and returned by load_state.
        scaler: a GradScaler (``scaler.pt``).
        extra: objects with ``state_dict()``, saved as ``custom_checkpoint_{i}.pkl`` in
            order (Accelerate's ``register_for_checkpointing`` numbering).
        dataloader: a loader with ``state_dict()`` / ``load_state_dict()`` (torchdata's
            ``StatefulDataLoader``, Accelerate's stateful loaders) or a list: each rank saves
            its own state, rank 0 as Accelerate's ``dl_state_dict.bin``, rank r as
            ``dl_state_dict_rank{r}.bin`` (:mod:`fsdpckpt.training._dataloader`).
        async_save: write model and optimizer in the background; returns an
            :class:`AsyncSave` whose ``wait()`` every rank must call.
        manifest: write ``fsdpckpt.json`` with every file's CRC-32 (recorded while
            writing, from the CRCs torch.save already computes: about 3% of a save to
            memory, see docs/benchmarks.md). ``fsdpckpt verify`` checks
            every byte against it; without it, verify still checks each chunk against
            its own zip CRC. With ``manifest=False`` the small side files (RNG,
            scheduler) are not fsynced either, as Accelerate writes them; the
            CheckpointManager always writes the manifest and fsyncs everything.
            Rank 0 logs the manifest's own digest (logger ``fsdpckpt``, INFO);
            :func:`fsdpckpt.training.manifest.manifest_digest` gives it too.
        digest: also record each file's ``"sha256"`` or ``"blake2b"`` in the manifest,
            computed while writing, so that ``fsdpckpt verify --expect-digest`` with the
            manifest's digest kept elsewhere detects any change, deliberate ones included
            (CRC-32 catches accidents only). Costs a hash of every byte written (see
            docs/benchmarks.md); needs ``manifest=True``.
        overwrite: replace a checkpoint ``checkpoint_dir`` holds already (its parts are
            removed as the save starts). Without it such a folder is refused before
            anything is written, locally and on object storage alike: the rule of every
            verb that writes (docs/api.md, "Existing outputs").
        storage_options: options for the fsspec filesystem of a URL (endpoint,
            credentials), as for :func:`fsdpckpt.inspect_checkpoint`.

    Returns:
        None, or the :class:`AsyncSave` handle.

    Raises:
        OutputExistsError: ``checkpoint_dir`` holds a checkpoint and ``overwrite`` is False.

    Example:
        >>> fsdpckpt.save_state("ckpt/step_100", model, optimizer, scheduler, step=100)
    """
    root = location(checkpoint_dir, storage_options=storage_options)
    rank, _world = rank_world()
    new_digest(digest)  # an unknown name fails here, before anything is written
    if digest is not None and not manifest:
        raise OptionError("digest= is recorded in the manifest: it needs manifest=True")
    by_marker = commits_by_marker(root)
    if by_marker and not manifest:
        raise OptionError(f"{root}: on object storage the manifest is the commit marker "
                         "(docs/remote-training.md): saving there needs manifest=True")
    models, optimizers, loaders = _as_list(model), _as_list(optimizer), stateful(dataloader)
    def prepare() -> None:
        if rank != 0:
            return
        found = checkpoint_parts(root)
        if found and not overwrite:
            listed = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise OutputExistsError(
                f"{root}: holds a checkpoint already ({listed}); nothing was written. Save "
                "into a new folder, or pass overwrite=True to replace it (its parts are "
                "removed as the save starts; CheckpointManager replaces a step only once the "
                "new one is complete).")
        if by_marker:
            _remote.begin_save(cast(RemotePath, root))  # intent marker, then an empty folder
        else:
            folder = cast(Path, root)  # a save that commits itself is a local one
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_parts(folder)

    everywhere(prepare)
    # A save that fails (a full disk...) leaves nothing that could pass for a checkpoint.
    with removed_on_failure(root, remove_stale_parts, rank=rank):
        return _save(root, models, optimizers, scheduler, step=step, scaler=scaler, extra=extra,
                     loaders=loaders, async_save=async_save, manifest=manifest, digest=digest,
                     rank=rank)


def _save(root: Place, models: list[Any], optimizers: list[Any], scheduler: Any, *,
          step: int | None, scaler: Any, extra: Mapping[str, Any] | None, loaders: list[Any],
          async_save: bool, manifest: bool, digest: str | None, rank: int) -> AsyncSave | None:
    """Write every part of a save into the prepared folder ``root``, then the manifest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    futures = []
    records: dict[str, dict[str, FileRecord]] = {}  # folder -> file -> (size, crc32, digest)
    archives: dict[str, Archives] = {}  # folder -> this rank's chunk archives in its files

    def write(state: dict[str, Any], folder: Place) -> None:
        kwargs: dict[str, Any] = {}
        if manifest:
            kwargs["storage_writer"] = checksum_writer(folder, records.setdefault(folder.name, {}),
                                                       digest, archives.setdefault(folder.name, {}))
        else:
            kwargs["checkpoint_id"] = str(folder)
        if not async_save:
            with raising_disk_full(folder):
                dcp_call(dcp.save, state, **kwargs)
            return
        if dist_or_none():
            # The background writer runs collectives while training runs its own; on
            # one process group they would interleave and hang.
            kwargs["process_group"] = async_group(folder.name)
        futures.append((folder, dcp_call(dcp.async_save, state, **kwargs)))

    for i, module in enumerate(models):
        write({"model": get_model_state_dict(module)}, model_folder(root, i))
    for i, (module, opt) in enumerate(_pairs(models, optimizers)):
        write({"optimizer": get_optimizer_state_dict(module, opt)}, optimizer_folder(root, i))
    side = records.setdefault("", {})

    def write_side(path: Place, data: bytes) -> None:
        with raising_disk_full(path):
            size, crc = put_bytes(path, data, sync=manifest)  # remote: one PUT, always whole
        side[path.name] = (size, crc, hashlib.new(digest, data).hexdigest() if digest else None)

    def write_side_files() -> None:
        write_side(root / f"random_states_{rank}.pkl", rng_state_bytes(step))
        for path, loader in dataloader_parts(root, loaders, rank):  # every rank its own
            write_side(path, torch_save_bytes(loader.state_dict()))
        if rank == 0:
            shared = [(scheduler_file(root, i), s) for i, s in enumerate(_as_list(scheduler))]
            shared += [(root / "scaler.pt", scaler)] if scaler is not None else []
            shared += [(root / f"custom_checkpoint_{i}.pkl", obj)
                       for i, obj in enumerate((extra or {}).values())]
            for path, obj in shared:
                write_side(path, torch_save_bytes(obj.state_dict()))
            # A Hugging Face model's config beside it, as HF Trainer's checkpoints hold it.
            for name, data in training_config_files(models[0]) if models else ():
                write_side(root / name, data)

    try:
        everywhere(write_side_files)  # a rank that fails here fails the save on every rank
    except BaseException:
        for _, future in futures:  # background writes end before what they wrote is removed
            with contextlib.suppress(BaseException):
                future.result()
        raise
    finish = Finish(root, records, step, manifest=manifest, digest=digest, archives=archives)
    if async_save:
        return AsyncSave(futures, finish)
    finish()
    return None


def _read_everything(root: Place, models: list, optimizers: list, schedulers: list,
                     scaler: Any, extra: Mapping[str, Any], loaders: list, rank: int,
                     world: int) -> Any:
    """Read and check every part of a checkpoint before any training state changes.

    Returns the storage readers of the model and optimizer folders (their metadata
    parsed through the allowlist), the decoded scheduler, scaler and extra states,
    and the prepared dataloader and RNG states.
    """
    model_readers = [safe_storage_reader(model_folder(root, i)) for i in range(len(models))]
    optimizer_readers = [safe_storage_reader(optimizer_folder(root, i))
                         for i in range(len(optimizers))]
    def _load_trusted(path: Place, what: str = "state") -> Any:
        # The reader inspect and verify check side files with (never torch.load).
        return to_torch(read_state_file(path, what))

    scheduler_states = [_load_trusted(scheduler_file(root, i, reading=True), "scheduler state")
                        for i in range(len(schedulers))]
    scaler_state = _load_trusted(root / "scaler.pt", "scaler state") if scaler is not None \
        else None
    extra_states = [_load_trusted(root / f"custom_checkpoint_{i}.pkl")
                    for i in range(len(extra))]
    loaded = prepare_dataloaders(root, loaders, rank, world)
    rng = prepare_rng(root, rank, world)
    return (model_readers, optimizer_readers, scheduler_states, scaler_state, extra_states,
            loaded, rng)


@shared_parses()  # each .metadata parsed once for the whole load
def load_state(checkpoint_dir: str | os.PathLike[str] | RemotePath, model: Any = None,
               optimizer: Any = None,
               scheduler: Any = None, *, scaler: Any = None,
               extra: Mapping[str, Any] | None = None, dataloader: Any = None,
               strict: bool = True,
               exclude: str | Iterable[str] | None = None,
               storage_options: dict[str, Any] | None = None) -> LoadResult:
    """Load what :func:`save_state` (or ``accelerator.save_state``) wrote; call it on every rank.

    Model and optimizer reshard to the current world size. With ``strict``, a model
    whose keys or shapes differ from the checkpoint raises :class:`StateMismatchError`
    before any state is changed. RNG and dataloader state (each rank its own) follow the
    policies of :mod:`fsdpckpt.training._rng` and :mod:`fsdpckpt.training._dataloader`.

    ``checkpoint_dir`` may be a URL (``s3://...``, with ``storage_options=`` as for
    :func:`save_state`); a remote folder whose save did not finish is refused.

    ``exclude`` (torchtitan's ``exclude_from_loading``), one name or several, leaves parts
    out, e.g. to fine-tune with a new optimizer or head: ``"optimizer"``, ``"scheduler"``,
    ``"scaler"``, ``"rng"`` (the step is still read from the RNG file), ``"dataloader"`` or
    ``"extra"`` are neither read nor loaded, even when their objects are passed, which keep
    their state; any other name is an fnmatch glob on the model's state-dict keys
    (``"lm_head.*"``): those keys are not loaded, and the strict check ignores them, so a
    new head of another shape loads the rest strictly. A glob matching no key of the model or the
    checkpoint, or an unknown part, raises :class:`OptionError` before anything changes.

    Returns:
        A :class:`LoadResult` with the saved step, the parts restored and excluded, and
        warnings.

    Example:
        >>> result = fsdpckpt.load_state("ckpt/step_100", model, optimizer, scheduler)
        >>> start = result.step + 1
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    root = location(checkpoint_dir, storage_options=storage_options)
    rank, world = rank_world()
    models, optimizers, schedulers = _as_list(model), _as_list(optimizer), _as_list(scheduler)
    skip = exclusion(exclude)  # excluded parts are dropped here: never read, never loaded
    optimizers = [] if "optimizer" in skip else optimizers
    schedulers = [] if "scheduler" in skip else schedulers
    scaler = None if "scaler" in skip else scaler
    extra = None if "extra" in skip else extra
    loaders = [] if "dataloader" in skip else stateful(dataloader)
    refresh(root)  # another process saved it: list it anew
    refuse_unfinished_save(root)  # a save cut short, or a copy of one
    refuse_links_out(root)  # a part or side file linking out of it: never read
    check_parts(root, models, optimizers, schedulers)
    # All or nothing: every part is read and checked (on every rank, which agree) before
    # the first one is loaded, so a damaged file changes no training state.
    model_readers, optimizer_readers, scheduler_states, scaler_state, extra_states, loaded, \
        rng = everywhere(lambda: _read_everything(root, models, optimizers, schedulers, scaler,
                                                  extra or {}, loaders, rank, world))
    templates = [get_model_state_dict(m) for m in models]
    comparisons = [compare(model_folder(root, i), s, "model") for i, s in enumerate(templates)]
    skip.check_globs([k for s, c in zip(templates, comparisons) for k in [*s, *c.unexpected]])
    skipped_keys = [k for s in templates for k in s if skip.excludes_key(k)]
    for i, (state, comparison) in enumerate(zip(templates, comparisons)):
        comparison = skip.without_keys(comparison)
        if strict and comparison:
            raise StateMismatchError(mismatch_message(model_folder(root, i), comparison))
        for key in [*comparison.unloadable, *filter(skip.excludes_key, list(state))]:
            state.pop(key, None)
    optimizer_templates = [get_optimizer_state_dict(m, o) for m, o in _pairs(models, optimizers)]
    for i, optimizer_state in enumerate(optimizer_templates):
        folder = optimizer_folder(root, i)
        comparison = compare(folder, flatten(optimizer_state), "optimizer")
        comparison = without_options_it_lacks(optimizer_state, comparison)
        if comparison.unloadable:  # a different optimizer (SGD for AdamW) or model
            raise StateMismatchError(mismatch_message(folder, comparison, "optimizer"))
    # Every archive the loads read, checked against its CRC-32s first (torch's loader does not).
    for reader, part in [*zip(model_readers, ({"model": s} for s in templates)),
                         *zip(optimizer_readers, ({"optimizer": s} for s in optimizer_templates))]:
        check_local_reads(reader, part)
    restored: list[str] = []
    try:
        # Our storage reader, never a checkpoint_id: torch's own reader would unpickle
        # .metadata (and rank-local metadata files) with plain pickle.
        for module, state, reader in zip(models, templates, model_readers):
            wrapped = {"model": state}
            dcp_call(dcp.load, wrapped, storage_reader=reader, planner=safe_load_planner())
            set_model_state_dict(module, wrapped["model"],
                                 options=StateDictOptions(strict=strict and not skip.globs))
        restored += ["model"] * bool(models)
        for (module, opt), optimizer_state, reader in zip(
                _pairs(models, optimizers), optimizer_templates, optimizer_readers):
            wrapped_optimizer: dict[str, Any] = {"optimizer": optimizer_state}
            dcp_call(dcp.load, wrapped_optimizer, storage_reader=reader,
                      planner=safe_load_planner())
            set_optimizer_state_dict(module, opt, wrapped_optimizer["optimizer"])
        restored += ["optimizer"] * bool(optimizers)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        for failure in getattr(exc, "failures", {}).values():
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exc, traceback)
            if isinstance(cause, FsdpCkptError):  # ours, e.g. a refused pickle: say it as is
                raise cause from None
        first = str(exc).strip().splitlines()[0][:300]
        raise NotACheckpointError(f"{root}: DCP could not load it ({first})") from None
    for sched, state in zip(schedulers, scheduler_states):
        sched.load_state_dict(state)
    restored += ["scheduler"] * bool(schedulers)
    if scaler is not None:
        scaler.load_state_dict(scaler_state)
        restored.append("scaler")
    for (name, obj), state in zip((extra or {}).items(), extra_states):
        obj.load_state_dict(state)
        restored.append(f"extra:{name}")
    loaded.apply()
    restored += ["dataloader"] * bool(loaders)
    excluded = (*sorted(skip.parts), *(f"model:{k}" for k in skipped_keys))
    if "rng" in skip:  # the step only: the policy's warnings are about state not applied
        return LoadResult(rng.step, tuple(restored), tuple(loaded.warnings), excluded)
    rng.apply()  # last: nothing loaded after it may draw from the restored generators
    restored += ["rng"] * (rng.step is not None or not rng.warnings)
    return LoadResult(rng.step, tuple(restored), (*rng.warnings, *loaded.warnings), excluded)
