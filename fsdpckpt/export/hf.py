"""``export_hf``: a sharded checkpoint to a folder ``from_pretrained`` loads as it is.

The weights go through the merge pipeline (:mod:`fsdpckpt.merging`: validate, plan, write,
commit), so they stream in constant memory and come out bit-exact after the chosen cast, as
safetensors named as Hugging Face names them (``model.safetensors``, or shards with
``model.safetensors.index.json``); with ``lora="fuse"`` the plan's tensors are computed by
the LoRA fuser instead of copied (:mod:`fsdpckpt.export._fuse_hf`), through the same stages.
Beside them: the config (``architectures`` without FSDP2's ``FSDP`` prefix, the dtype field
set to the exported dtype), the generation config, the tokenizer and its chat template, from
``base`` or from where trainers leave them. Tied targets (``lm_head.weight`` with
``tie_word_embeddings``) are decided by the config and not written, after checking that the
checkpoint holds the same bytes under both names (``untie`` writes both when they differ).
Names are what transformers' ``save_pretrained`` writes (the hub's): its own conversion
mapping, run on the model class on the meta device, cuts fused MoE experts per expert and
renames LLaVA's modules, each written tensor read as a box of a stored one; a checkpoint
already under those names (a transformers 4 run) is written as it is
(:mod:`fsdpckpt.export._moe`). A torchtune (Llama, Mistral, Gemma, Gemma 2, Qwen2) or torchtitan
(Llama 3, Qwen 3) run's names go to the hub's, q and k rows reordered where the trainer's
converter reorders them, still as a copy (:mod:`fsdpckpt.export._trainer_names`).
Before a byte is written, the exported keys and shapes are checked against the config's
model class (built on the meta device when transformers is installed, after its declared
layer and expert counts are bounded by the checkpoint's keys; its answer is kept for later
exports of the same config, :mod:`fsdpckpt.export._expect_cache`); a model whose class needs
custom code is built only with ``trust_remote_code`` and otherwise checked against the
base's weights (:mod:`fsdpckpt.export._keycheck`). Everything is staged in the output folder
and renamed into place at the end; on any error the output folder is left as it was.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io.durable import write_bytes
from fsdpckpt._io.publish import remove_durably
from fsdpckpt._io.publish_built import built_into
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._progress import ProgressFactory
from fsdpckpt.dcp.layout import CheckpointLayout, find_layout
from fsdpckpt.errors import ExportMismatchError, MergePlanError, OutputExistsError
from fsdpckpt.export._config import (
    CONFIG,
    SideFiles,
    config_bytes,
    exported_config,
    find_side_files,
    read_config,
    side_file_bytes,
)
from fsdpckpt.export._earlier import earlier_adapter_export
from fsdpckpt.export._expect_cache import recall, remember
from fsdpckpt.export._fuse_hf import plan_fused
from fsdpckpt.export._keycheck import check_against_base, check_declared_sizes, custom_code
from fsdpckpt.export._lora_config import ADAPTER_CONFIG
from fsdpckpt.export._lora_keys import refuse_unasked
from fsdpckpt.export._lora_read import folder_source
from fsdpckpt.export._model import (
    ModelExpectation,
    base_may_answer,
    expect_from_base,
    expect_model,
    start_import,
    tied_without_transformers,
)
from fsdpckpt.export._moe import hub_names, hub_plan
from fsdpckpt.export._refusals import refuse_optimizer, refuse_weight_file
from fsdpckpt.export._tied import compare_tied, refuse_differing
from fsdpckpt.export._trainer_names import looks_like, trainer_job
from fsdpckpt.export.lora import AdapterExport, export_adapter
from fsdpckpt.merging._validate import MergeRequest, validate_merge
from fsdpckpt.merging.merger import MergeJob, commit_job, plan_job, write_job
from fsdpckpt.merging.writer import commit, sigterm_interrupts, staging

__all__ = ["export_hf", "ExportResult", "ExportMismatchError"]


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote.

    Attributes:
        source: the DCP folder exported. output: the output folder.
        weights: the safetensors files (the index last, when sharded).
        files: the other files written (config last).
        tensors, bytes: tensors and tensor bytes written. dtype: the exported dtype
            (``"bfloat16"``...), as the config now says.
        tied: tied targets left out (``lm_head.weight``), each with the key it is tied to.
        config_from: the ``config.json`` the exported config was made from.
        model_class: the class the keys were checked against; None when it was not built
            (then tied keys were decided from the config alone).
        seconds: wall time.
        not_checked: when the model class was not built, what was not checked and why (one
            line: custom code that runs only with ``trust_remote_code``, transformers not
            installed...), and what the keys were checked against instead (the base's
            weights); None when they were checked against the model class.
        names_as_stored: why the tensors were written under the checkpoint's own names
            rather than those ``save_pretrained`` writes (the hub's: per-expert MoE
            tensors, LLaVA's ``language_model.model.*``), which come from transformers'
            conversion mapping; None when they were written as ``save_pretrained`` writes
            them.
        no_tokenizer: where no tokenizer was found, one line saying so (the export has
            none); None when one was copied.
        converted: the trainer's names converted to the hub's (a torchtune or torchtitan
            run of a family :mod:`fsdpckpt.export._trainer_families` lists), as one
            phrase; None when the checkpoint held Hugging Face's names.
        base_weights: the base's weight file (``model.safetensors`` or its index) whose
            names and shapes the export's are, every one: they answered for the model class
            (``model_class``, as the config names it), which was then not built and
            transformers not imported; None when the class was built.
    """

    source: Path | RemotePath
    output: Path | RemotePath
    weights: tuple[Path | RemotePath, ...]
    files: tuple[Path | RemotePath, ...]
    tensors: int
    bytes: int
    dtype: str
    tied: tuple[tuple[str, str], ...]
    config_from: Path | RemotePath
    model_class: str | None
    seconds: float
    not_checked: str | None = None
    names_as_stored: str | None = None
    converted: str | None = None
    base_weights: Path | RemotePath | None = None
    no_tokenizer: str | None = None

    def to_json(self) -> dict:
        """What ``fsdpckpt export-hf --json`` prints."""
        return {"source": str(self.source), "output": str(self.output),
                "weights": [str(p) for p in self.weights], "files": [str(p) for p in self.files],
                "tensors": self.tensors, "bytes": self.bytes, "dtype": self.dtype,
                "tied": {target: source for target, source in self.tied},
                "config_from": str(self.config_from), "checked_against": self.model_class,
                "not_checked": self.not_checked, "names_as_stored": self.names_as_stored,
                "converted": self.converted,
                "base_weights": str(self.base_weights) if self.base_weights else None,
                "no_tokenizer": self.no_tokenizer, "seconds": round(self.seconds, 3)}


def _search_root(layout: CheckpointLayout) -> Path | RemotePath:
    # A DCP folder given on its own (ckpt/pytorch_model_fsdp_0) sits in its checkpoint
    # folder: look from there, as from the checkpoint folder itself.
    return layout.path.parent if layout.style == "dcp" else layout.path


def _glob_literal(name: str) -> str:
    # An exact name as an --exclude glob: its glob characters matched literally.
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _exported_dtype(job: MergeJob) -> str:
    # No --dtype: the config says the dtype most of the floating-point bytes have.
    sizes: Counter[str] = Counter()
    for plan in job.plans:
        for file in plan.files:
            for t in file.tensors:
                if t.spec.dtype.is_floating:
                    sizes[t.spec.dtype.name] += t.spec.nbytes
    return sizes.most_common(1)[0][0] if sizes else "float32"


def _placed(result: ExportResult | AdapterExport,
            placed: Callable[[Any], Any]) -> ExportResult | AdapterExport:
    # The result of an export, naming where its files were published (built_into).
    if isinstance(result, AdapterExport):
        return dataclasses.replace(result, output=placed(result.output))
    return dataclasses.replace(
        result, output=placed(result.output), weights=tuple(placed(p) for p in result.weights),
        files=tuple(placed(p) for p in result.files))


def _check_outputs(side: SideFiles, out: Path, overwrite: bool) -> None:
    names = [name for _, name in side.copied] + [name for name, _ in side.made] + [CONFIG]
    existing = [out / n for n in names if (out / n).exists()] + earlier_adapter_export(out)
    if existing and not overwrite:
        # The parameter, and the flag beside it (tests/test_export_hf.py pins "--overwrite"
        # here); the command line's error boundary says the flag alone.
        raise OutputExistsError(f"{existing[0]}: already exists; pass overwrite=True "
                                "(--overwrite) to replace the earlier export, or choose "
                                "another output folder")


def export_hf(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *,
              base: str | os.PathLike[str] | None = None, dtype: str | None = None,
              max_shard_size: str | int = "5GB", overwrite: bool = False,
              lora: str | None = None, lora_config: str | os.PathLike[str] | None = None,
              untie: bool = False, progress: ProgressFactory | None = None,
              storage_options: dict[str, Any] | None = None,
              trust_remote_code: bool = False) -> ExportResult | AdapterExport:
    """Export a sharded checkpoint to a Hugging Face model folder.

    ``AutoModelForCausalLM.from_pretrained(output)`` and ``AutoTokenizer.from_pretrained
    (output)`` load the result as it is.

    Args:
        checkpoint: a whole checkpoint folder (Accelerate's or HF Trainer's layout) or its
            model's DCP folder; local or on object storage (``s3://bucket/run/ckpt``).
        output: the output folder (local); created if missing.
        base: the Hugging Face model folder the run started from: config, generation
            config, tokenizer and chat template come from there. Without it they are
            looked for where trainers leave them: the checkpoint folder, its
            ``huggingface/`` (VeRL), the run's output folder above it and its
            ``huggingface/``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: cast floating-point weights (the
            config says so too). Default: keep the stored dtypes.
        max_shard_size: the largest safetensors file (``"5GB"`` as Hugging Face, decimal);
            a model that fits is one ``model.safetensors`` without an index.
        overwrite: replace an earlier export in ``output`` (its weights, config and
            tokenizer files); other files are never touched.
        lora: for a PEFT-wrapped model's checkpoint: ``"adapter"`` writes the adapter
            as PEFT's ``save_pretrained`` does (``adapter_model.safetensors`` and
            ``adapter_config.json``, for ``PeftModel.from_pretrained(base, output)``;
            returns an :class:`~fsdpckpt.export.lora.AdapterExport`); ``"fuse"`` exports
            the base model with the adapter fused in (``W + scaling * B @ A``, in fp32,
            then cast), as ``merge_and_unload`` gives it, split by ``max_shard_size`` as
            a plain export is.
            None exports the weights as stored.
        lora_config: the adapter's ``adapter_config.json`` (or its folder); found beside
            the checkpoint or in ``base`` by default.
        untie: write the tied target too (``lm_head.weight``) and set
            ``tie_word_embeddings: false`` in the exported config: for a checkpoint whose
            output and input embeddings differ although the config ties them.
        progress: ``progress(total_bytes, files)`` returns a callback given byte counts.
        storage_options: fsspec options for a ``checkpoint``, ``base`` or ``output`` on
            object storage (``{"endpoint_url": ...}``, credentials); None uses the
            environment's. A remote ``output`` is exported into ``$TMPDIR``, then uploaded
            file by file, ``config.json`` last.
        trust_remote_code: run the custom code the config's ``auto_map`` names (the
            ``.py`` files of the checkpoint's or ``base``'s folder) to build the model class
            and check the keys against it. Only for code you trust: it runs as you. Off by
            default: nothing from a checkpoint, ``base`` or adapter folder runs; a
            custom-code model is exported with its code files copied, its keys checked
            against ``base``'s weights when there are any, and
            :attr:`ExportResult.not_checked` says what was not checked.

    Returns:
        The :class:`ExportResult`.

    Raises:
        CheckpointNotFoundError: no config or tokenizer found (the message lists where it
            looked), or the checkpoint is missing.
        ExportMismatchError: the tensors do not match the config's model class, or the
            base's weights where the class is not built (the message lists what is missing,
            unexpected or of the wrong shape); the config declares more layers or experts
            than the checkpoint's keys show (refused before anything is built); or the
            config ties two tensors the checkpoint holds with different bytes (pass
            ``untie=True``).
        MergePlanError, OutputExistsError, DiskFullError, NotACheckpointError: as for
            :func:`fsdpckpt.merge`.

    Example:
        >>> fsdpckpt.export_hf("run/checkpoint-500", "exported", dtype="bf16")
    """
    # Locally written in place; on object storage built in $TMPDIR and uploaded, config.json
    # last (fsdpckpt/_io/publish_built.py chooses).
    exported, placed = built_into(
        location(output, storage_options=storage_options),
        lambda folder: _export(checkpoint, folder, base=base, dtype=dtype,
                               max_shard_size=max_shard_size, overwrite=overwrite, lora=lora,
                               lora_config=lora_config, untie=untie, progress=progress,
                               storage_options=storage_options,
                               trust_remote_code=trust_remote_code),
        overwrite=overwrite, last=(ADAPTER_CONFIG, CONFIG))  # an adapter's, or a model's
    return _placed(exported, placed)


def _export(checkpoint: str | os.PathLike[str], output: Path, *,
            base: str | os.PathLike[str] | None, dtype: str | None,
            max_shard_size: str | int, overwrite: bool, lora: str | None,
            lora_config: str | os.PathLike[str] | None, untie: bool,
            progress: ProgressFactory | None, storage_options: dict[str, Any] | None,
            trust_remote_code: bool) -> ExportResult | AdapterExport:
    # export_hf into the local folder ``output``.
    start = time.perf_counter()
    if lora not in (None, "adapter", "fuse"):
        raise MergePlanError(f"lora={lora!r}: use 'adapter' (write the LoRA adapter) or "
                             "'fuse' (fuse it into the base weights)")
    where = location(checkpoint, storage_options=storage_options)
    base_at = location(base, storage_options=storage_options) if base is not None else None
    # Located once, with the storage options: the LoRA readers take them as they are.
    lora_at = location(lora_config, storage_options=storage_options) \
        if lora_config is not None else None
    refuse_weight_file(where)  # merged weights: export from their checkpoint
    if lora == "adapter":
        return export_adapter(where, output, lora_config=lora_at, base=base_at, dtype=dtype,
                              overwrite=overwrite)
    layout = find_layout(where)
    held = refuse_optimizer(layout)  # before the config is looked for: no model, no config
    side = find_side_files(_search_root(layout), base_at)
    config = read_config(side.config)
    # transformers' import is the export's largest cost: it runs while this thread plans,
    # unless the base's own weights may stand in for the model class (export._model), or an
    # earlier export of this config kept the class's answer (export._expect_cache; the
    # dtype, planned below, is no part of its key).
    from_base = base_may_answer(side.config, base_at)
    kept = None if from_base else recall(exported_config(config, "", untie=untie))
    importing = None if from_base or kept else start_import(config)
    request = validate_merge(layout, output, dtype=dtype, max_shard_size=max_shard_size,
                             overwrite=overwrite)
    del held  # validate_merge read the parts' .metadata parsed once, while held
    job = plan_job(request)  # also: is the output free, and which earlier outputs go
    trainer = None  # a torchtune or torchtitan run's names: renamed to the hub's
    if lora is None:
        job, trainer = trainer_job(job, config, side.config)
    folder = request.sources[0].folder  # the part merge merges, its metadata read once
    if lora is None:  # adapter tensors would fail the key check with a puzzling list
        refuse_unasked(folder_source(folder).names, folder.path)
    fused = plan_fused(where, folder_source(folder), folder=folder, dtype=dtype,
                       lora_config=lora_at, base=base_at) if lora == "fuse" else None
    if fused is not None:  # the base model with the adapter fused in, by plain names
        export_dtype, shapes = fused.dtype, fused.shapes
    else:
        export_dtype = _exported_dtype(job)  # after the cast: the planned dtypes
        shapes = {t.spec.name: tuple(t.spec.shape) for plan in job.plans for f in plan.files
                  for t in f.tensors}
    fixed = exported_config(config, export_dtype, untie=untie)
    if trust_remote_code or not custom_code(fixed):  # the class may be built: bound it first
        check_declared_sizes(fixed, shapes, side.config)
    _check_outputs(side, request.output_dir, overwrite)
    # The pairs the config ties, compared while transformers is still importing; the model
    # class (when there is one) decides below which pairs are tied.
    compared = compare_tied(job, tied_without_transformers(fixed, shapes)) \
        if fused is None else {}
    with sigterm_interrupts(), staging(request.output_dir) as stage:
        config_file = stage / CONFIG
        write_bytes(config_file, config_bytes(fixed))
        # Staged before the class is built: custom code, when trusted, is loaded from here.
        copies: list[Path] = []
        nested: list[Path] = []
        for source, name in side.copied:
            target = stage / name  # additional_chat_templates/x.jinja: staged in its folder
            target.parent.mkdir(exist_ok=True)
            write_bytes(target, side_file_bytes(source))  # small, size checked; durably
            (copies if target.parent == stage else nested).append(target)
        for name, data in side.made:  # the generation config no folder held
            write_bytes(stage / name, data)
            copies.append(stage / name)
        quick = expect_from_base(shapes, fixed, from_base) if from_base else None
        kept = kept or (recall(fixed) if from_base and quick is None else None)
        if quick is None and kept is None:
            (importing or start_import(config)).join()
        expect = quick or kept or remember(fixed, expect_model(
            stage, fixed, trust_remote_code=trust_remote_code))
        not_checked = names = None
        if isinstance(expect, ModelExpectation):
            # In-memory names (transformers 5) or the hub's (transformers 4's per-expert
            # MoE names): either is matched, and the hub's are written (export._moe).
            saved = expect.saved if isinstance(expect.saved, dict) else None
            names = hub_names(shapes, expect.shapes, expect.tied, saved)
            tied = names.tied
            if names.problems:
                raise ExportMismatchError(
                    f"{request.sources[0].folder.path}: does not match {expect.model_class} "
                    f"as {side.config} describes it: " + "; ".join(names.problems) + "; "
                    + (looks_like(shapes, fixed, side.config)
                       or "pass base=... with the config of the model this run trained"))
            # None: transformers' conversion is no cut (why, where it says).
            as_stored = str(expect.saved) or None if saved is None else None
        else:  # not built: the reason says why; the base's own weight names, if any
            as_stored = f"the model class was not built: {expect}"
            tied = tied_without_transformers(fixed, shapes)
            not_checked = check_against_base(
                {k: v for k, v in shapes.items() if k not in tied}, tied, base_at, expect,
                request.sources[0].folder.path)
        if fused is None and tied:
            compared.update(compare_tied(job, {k: v for k, v in tied.items()
                                                if (k, v) not in compared}))
            refuse_differing(request.sources[0].folder.path, tied, compared, side.config, untie)
            job, _ = trainer_job(plan_job(_excluding(request, sorted(
                trainer.stored(t) if trainer else t for t in tied))), config, side.config,
                trainer)
        if fused is not None:  # the plan whose tensors the fuser computes, tied targets out
            job = fused.job(request.output_dir, exclude=tied, overwrite=overwrite,
                            max_shard_size=request.options.max_shard_size)
        if names is not None and any(not p.whole or p.name != p.source for p in names.pieces):
            job = hub_plan(job, names.pieces, overwrite=overwrite,
                           max_shard_size=request.options.max_shard_size)
        # An earlier export's commit files go first: never an old config over new weights.
        remove_durably([request.output_dir / CONFIG, request.output_dir / ADAPTER_CONFIG])
        (result,) = commit_job(job, write_job(job, stage, progress))
        for target in nested:
            (request.output_dir / target.parent.name).mkdir(exist_ok=True)
        nested_files = [commit([t], request.output_dir / t.parent.name)[0] for t in nested]
        # The config last: a folder without it is plainly unfinished to from_pretrained.
        files = nested_files + commit([*copies, config_file], request.output_dir)
        remove_durably(earlier_adapter_export(request.output_dir))  # an adapter export's
    return ExportResult(result.source, request.output_dir, result.files, tuple(files),
                        result.tensors, result.bytes, export_dtype, tuple(sorted(tied.items())),
                        side.config, expect.model_class if isinstance(expect, ModelExpectation)
                        else None, time.perf_counter() - start, not_checked, as_stored,
                        trainer.said() if trainer else None,
                        from_base[1] if quick is not None and from_base else None,
                        side.no_tokenizer)


def _excluding(request: MergeRequest, names: list[str]) -> MergeRequest:
    options = request.options
    exclude = options.exclude + tuple(_glob_literal(n) for n in names)
    return dataclasses.replace(request, options=dataclasses.replace(options, exclude=exclude))

