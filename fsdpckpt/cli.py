"""The ``fsdpckpt`` command line. It only parses, calls the library and prints.

One error boundary (:class:`_Group`) turns every error into one line on stderr
(names from the checkpoint escaped, at most :data:`~fsdpckpt._printable.MAX_ERROR_CHARS`
characters) and exit status 1; ``--debug`` shows the traceback too. Human output escapes
control and bidi characters in names and paths. ``--json`` puts one JSON document on
stdout, with the exact strings; logs and progress bars go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from fsdpckpt._cli_common import (
    _debug_option,
    _dtype_option,
    _fail,
    _progress,
    _shard_size_option,
    _storage_options_option,
    interrupted_status,
    json_pieces,
    merge_output,
    one_checkpoint,
    refuse_file_output,
    say_note,
    with_note,
)
from fsdpckpt._cli_export import diff, export_hf
from fsdpckpt._cli_list import list_command
from fsdpckpt._printable import printable
from fsdpckpt._version import __version__
from fsdpckpt.errors import FsdpCkptError, interruption

__all__ = ["main"]


class _Group(click.Group):
    """The error boundary: library errors become one line and exit 1 (an interruption:
    130, or 143 for SIGTERM)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except FsdpCkptError as exc:
            _fail(ctx, str(exc), exc)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(ctx, f"{where}{exc.strerror or exc}", exc)
        except KeyboardInterrupt as exc:  # Ctrl-C (exit 130), or SIGTERM during a merge (143)
            _fail(ctx, str(exc) or "interrupted", exc, interrupted_status(exc))
        except Exception as exc:  # noqa: BLE001 - the boundary of last resort
            if (interrupt := interruption(exc)) is not None:  # a Ctrl-C Python wrapped
                _fail(ctx, str(interrupt) or "interrupted", exc, interrupted_status(interrupt))
            _fail(ctx, f"unexpected {type(exc).__name__}: {exc} (rerun with --debug and "
                       "report it, with the traceback)", exc)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})
@click.version_option(__version__, prog_name="fsdpckpt")
@_debug_option
def main() -> None:
    """Inspect, verify, diff, merge, convert and export sharded PyTorch FSDP checkpoints.

    Reads what FSDP1, FSDP2 and the trainers built on them save (DCP folders and
    per-rank files of Accelerate, HF Trainer, torchtitan, Lightning, torchtune,
    VeRL), locally or on object storage, without loading them into memory and
    without trusting their pickles. Each command's --help has examples.

    \b
    Examples:
      fsdpckpt inspect ckpt/                  # what a checkpoint holds
      fsdpckpt verify ckpt/                   # whether every byte is what was written
      fsdpckpt diff ckpt-100/ ckpt-200/       # which tensors changed, and by how much
      fsdpckpt list run/                      # the run's checkpoints, newest last
      fsdpckpt merge ckpt/ merged/            # one safetensors file, streaming
      fsdpckpt export-hf ckpt/ exported/      # a folder from_pretrained loads as is
      fsdpckpt convert model.safetensors dcp/ # a full state dict into a DCP folder

    \b
    Object storage (s3://, gs://, az:// paths): --storage-options takes the
    fsspec filesystem's options as a JSON object, e.g.
    '{"endpoint_url": "http://localhost:9000", "anon": false}'. Credentials and
    endpoints are otherwise read where the cloud tools keep them (AWS_*
    variables, AWS_ENDPOINT_URL, ~/.aws, gcloud, Azure). S3 timeouts default to
    connect 10 s, read 30 s, two attempts; '{"config_kwargs": {"read_timeout": 120}}'
    raises them.
    """


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (schema in docs/cli.md).")
@click.option("--name", "-n", "names", metavar="PATTERN",
              help="Only list tensors and objects whose name matches: a glob "
                   "('*.weight') or a substring ('layers.0.'), against the name as stored "
                   "('model.0.weight') or as merge writes it ('0.weight').")
@click.option("--chunks", is_flag=True,
              help="Also list every chunk: offsets, sizes, file, byte range.")
@click.option("--summary", is_flag=True,
              help="Only the summary: no table of tensors, and each part's rank files on one line.")
@click.option("--html", "html", metavar="FILE",
              help="Also write a self-contained HTML page: bytes by part, rank file and "
                   "dtype, a shard map, the problems (docs/reports.md).")
@_storage_options_option
@_debug_option
def inspect(path: str, as_json: bool, names: str | None, chunks: bool, summary: bool,
            html: str | None, storage_options: dict | None) -> None:
    """Show what a checkpoint holds and check that its structure is whole.

    PATH is a DCP folder (the one holding .metadata) or a whole checkpoint folder
    in Accelerate's layout (pytorch_model_fsdp_0/, optimizer_0/, random_states_0.pkl,
    scheduler.bin...) or HF Trainer's, local or on object storage (s3://bucket/run/ckpt).
    Only .metadata and file sizes are read: no tensor data, no torch import, no
    pickle code runs. PATH may also be what diff reads besides: a .safetensors or
    .bin file, a shard index, or a folder holding a merged or Hugging Face model
    (its tensors listed whole, from the safetensors headers).

    Exit status: 0 when the structure is whole, 1 when problems were found
    (gaps or overlaps between chunks, missing or truncated rank files) or the path
    is not a readable checkpoint.

    \b
    Examples:
      fsdpckpt inspect ckpt/
      fsdpckpt inspect ckpt/pytorch_model_fsdp_0 --name 'layers.0.*' --chunks
      fsdpckpt inspect ckpt/ --json | jq '.parts[0].tensors[].name'
      fsdpckpt inspect exported/model.safetensors
      fsdpckpt inspect ckpt/ --summary --html ckpt-report.html
      AWS_ENDPOINT_URL=http://localhost:9000 fsdpckpt inspect s3://runs/llama/checkpoint-100
    """
    from fsdpckpt._render import render_inspect
    from fsdpckpt.inspection.inspect import inspect_checkpoint

    given, (path, note) = path, one_checkpoint(path, storage_options)
    say_note(note, as_json)
    report = inspect_checkpoint(path, names=names, storage_options=storage_options)
    if html:
        from fsdpckpt.inspection._html import write_page
        from fsdpckpt.inspection.html_inspect import inspect_html

        written = write_page(html, inspect_html(report))
        click.echo(f"wrote {printable(written)}", err=True)
    if as_json:
        for piece in json_pieces(with_note(report, note)):  # written as made, never whole
            click.echo(piece, nl=False)
        click.echo()
    else:
        click.echo(render_inspect(report, chunks=chunks, tensors=not summary, names=names))
    if not report.ok:
        count = len(report.problems)
        click.echo(f"fsdpckpt: error: {count} problem{'s' * (count != 1)} found in "
                   f"{printable(given)}; the checkpoint is not whole", err=True)
        sys.exit(1)


def _merge_report(results: list[Any], as_json: bool, note: str | None = None) -> None:
    from fsdpckpt._render import human_bytes

    if as_json:
        document: dict[str, Any] = {"outputs": [r.to_json() for r in results]}
        click.echo(json.dumps({**document, "note": note} if note else document, indent=2))
        return
    say_note(note, as_json)
    for r in results:
        rate = human_bytes(r.bytes / r.seconds) if r.seconds > 0 else "-"
        click.echo(f"merged {printable(r.source)} -> {printable(r.path)}: {r.tensors} tensors, "
                   f"{human_bytes(r.bytes)} in {r.seconds:.2f} s ({rate}/s)")
        if r.objects:
            where = ("the safetensors metadata ('fsdpckpt.objects')"
                     if r.path.suffix in (".safetensors", ".json") else "the pickle")
            shown = ", ".join(map(printable, r.objects[:5])) + \
                (" ..." if len(r.objects) > 5 else "")
            click.echo(f"  kept {len(r.objects)} non-tensor entries ({shown}) in {where}")
        if r.kept_dtype:
            click.echo(f"  {r.kept_dtype.describe()}")


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.argument("output_dir", type=click.Path(path_type=str))
@click.option("--optimizer", is_flag=True,
              help="Also merge the optimizer folder (optimizer_0/) into optimizer.safetensors "
                   "(optimizer.bin with --format bin).")
@click.option("--model-index", type=int, metavar="N",
              help="Which model to merge when a checkpoint holds several (pytorch_model_fsdp_N/).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "bin"]), default="safetensors",
              show_default=True, help="Output format; bin is a torch.save archive.")
@_dtype_option("Convert the model's floating-point tensors to this dtype: bf16 (bfloat16), "
               "fp16 (float16) or fp32 (float32); integer and bool tensors keep theirs, and "
               "so does the optimizer (see --optimizer-dtype). Default: keep every dtype.")
@_dtype_option("Convert the optimizer's floating-point moments (exp_avg, exp_avg_sq, momentum "
               "buffers; merged with --optimizer) to this dtype. Step counters and 0-dimensional "
               "scalars are never cast (bf16 holds integers exactly only up to 256). "
               "Default: keep the stored dtypes.", name="--optimizer-dtype")
@_shard_size_option("Split into HF-style shards of at most SIZE (5GB, 5G, 5GiB, 500M, or bytes) "
                    "plus an index file; a model that fits in one shard is one file, without "
                    "an index.")
@click.option("--keep-keys", is_flag=True,
              help="Keep wrapper segments (_fsdp_wrapped_module., _checkpoint_wrapped_module., "
                   "_orig_mod.) in names; by default they are removed.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Only merge entries whose name matches, as written ('0.weight') or as "
                   "stored and inspect lists it ('model.0.weight') (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Skip entries whose name, as written or as stored, matches (repeatable).")
@click.option("--overwrite", is_flag=True,
              help="Replace the output of an earlier merge (the files its index names, or the "
                   "single file); other files in OUTPUT_DIR are never touched.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
@_storage_options_option
@_debug_option
def merge(checkpoint: str, output_dir: str, optimizer: bool, model_index: int | None, fmt: str,
          dtype: str | None, optimizer_dtype: str | None, max_shard_size: str | None,
          keep_keys: bool, include: tuple[str, ...], exclude: tuple[str, ...], overwrite: bool,
          quiet: bool, as_json: bool, storage_options: dict | None) -> None:
    """Merge a sharded checkpoint into one safetensors or .bin file, streaming.

    CHECKPOINT is a DCP folder (pytorch_model_fsdp_0/, optimizer_0/) or a whole
    checkpoint folder, of which the model is merged (--optimizer: the optimizer too).
    Memory stays flat however large the model: bytes go from the rank files
    straight to their place in the output, never through a full state dict.
    Output goes to a temporary name in OUTPUT_DIR and is renamed when complete.

    CHECKPOINT and OUTPUT_DIR may be on object storage (s3://bucket/run/ckpt, gs://,
    az://). A remote checkpoint is read with ranged reads, never downloaded whole; a
    remote OUTPUT_DIR is merged in $TMPDIR (room for the output needed), then
    uploaded file by file, the index last, so a loader never sees a partial output.

    Under torchrun (WORLD_SIZE > 1 in the environment) the ranks share the work:
    fsdpckpt initializes a gloo process group from torchrun's environment, each
    rank writes its share of the output files (balanced by bytes; use
    --max-shard-size to have several), and rank 0 writes the index and commits.
    OUTPUT_DIR must be on a file system every rank sees. The output is byte for
    byte the single-process one; a failure on any rank fails every rank and leaves
    nothing. Only rank 0 shows progress (its own share) and prints the report.

    \b
    Examples:
      fsdpckpt merge ckpt/ merged/
      fsdpckpt merge ckpt/ merged/ --dtype bf16 --max-shard-size 5GB
      fsdpckpt merge ckpt/ merged/ --optimizer --exclude '*.lora_*'
      torchrun --nproc-per-node 8 -m fsdpckpt merge ckpt/ merged/ --max-shard-size 5GB
      fsdpckpt merge s3://runs/llama/checkpoint-100 s3://runs/llama/merged-100
    """
    from fsdpckpt.merging._distributed import torchrun_group
    from fsdpckpt.merging.merger import merge as merge_checkpoint

    output_dir, file_name = merge_output(checkpoint, output_dir, fmt, optimizer, max_shard_size)
    checkpoint, note = one_checkpoint(checkpoint, storage_options)
    with torchrun_group() as group:
        rank = 0 if group is None else group.rank()
        desc = "merging" if group is None else f"merging (rank 0's share of {group.size()})"
        results = merge_checkpoint(checkpoint, output_dir, optimizer=optimizer,
                                   model_index=model_index, format=fmt, dtype=dtype,
                                   optimizer_dtype=optimizer_dtype,
                                   max_shard_size=max_shard_size, keep_keys=keep_keys,
                                   include=include, exclude=exclude, overwrite=overwrite,
                                   file_name=file_name,
                                   progress=_progress(quiet or rank != 0, desc),
                                   process_group=group, storage_options=storage_options)
    if rank == 0:
        _merge_report(results, as_json, note)


@main.command("merge-weights")
@click.argument("checkpoint_directory", type=click.Path(path_type=str))
@click.argument("output_path", type=click.Path(path_type=str))
@click.option("--unsafe_serialization", "--unsafe-serialization", "unsafe", is_flag=True,
              help="Save the merged weights as pytorch_model.bin rather than model.safetensors.")
@click.option("--remove_checkpoint_dir", "--remove-checkpoint-dir", "remove", is_flag=True,
              help="Remove the checkpoint directory after a successful merge.")
@click.option("--overwrite", is_flag=True, hidden=True,
              help="Accepted for older scripts; an existing output is always replaced.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
@_storage_options_option
@_debug_option
def merge_weights(checkpoint_directory: str, output_path: str, unsafe: bool, remove: bool,
                  overwrite: bool, quiet: bool, as_json: bool,
                  storage_options: dict | None) -> None:
    """Drop-in for `accelerate merge-weights`: same arguments, same output names.

    Merges CHECKPOINT_DIRECTORY (e.g. ckpt/pytorch_model_fsdp_0) into
    OUTPUT_PATH/model.safetensors (or pytorch_model.bin with --unsafe_serialization),
    keys exactly as Accelerate writes them, but streaming in constant memory, and
    without crashing on optimizer folders or non-tensor entries (an optimizer folder
    becomes optimizer.safetensors / optimizer.bin). As with Accelerate, an existing
    output is replaced: atomically, the old file stays whole until the new one is done.

    \b
    Example:
      fsdpckpt merge-weights ckpt/pytorch_model_fsdp_0 merged/
    """
    import time

    from fsdpckpt._io.remote import location
    from fsdpckpt.dcp.layout import refuse_rank_file
    from fsdpckpt.merging.merger import merge_fsdp_weights

    refuse_file_output(output_path, "OUTPUT_PATH")
    source = location(checkpoint_directory, storage_options=storage_options)
    if source.is_file():  # named as Accelerate's merge-weights takes it: the DCP folder
        refuse_rank_file(source, whole=False)
    start = time.perf_counter()
    del overwrite  # always on, as in Accelerate
    path = merge_fsdp_weights(checkpoint_directory, output_path, not unsafe, remove,
                              overwrite=True, progress=_progress(quiet),
                              storage_options=storage_options)
    seconds = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({"output": str(path), "seconds": round(seconds, 3)}))
    else:
        click.echo(f"merged {printable(checkpoint_directory)} -> {printable(path)} in "
                   f"{seconds:.2f} s")


@main.command()
@click.argument("full_file", type=click.Path(path_type=str))
@click.argument("out_dcp_dir", type=click.Path(path_type=str))
@click.option("--key", default="model", show_default=True,
              help="Nest every entry under this top-level key, as Accelerate's "
                   "pytorch_model_fsdp_0/ holds a model; pass '' for none.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT_DCP_DIR.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_storage_options_option
@_debug_option
def convert(full_file: str, out_dcp_dir: str, key: str, overwrite: bool, as_json: bool,
            quiet: bool, storage_options: dict | None) -> None:
    """Turn a full safetensors or .bin state dict into a DCP folder.

    The reverse of merge: a pretrained or merged model becomes a DCP folder that
    an FSDP run of any world size can load (DCP reshards on load). One tensor is
    in memory at a time. FULL_FILE may be a shard index (*.safetensors.index.json),
    or a folder holding model.safetensors or pytorch_model.bin (or their index).
    A sharded checkpoint is DCP already: to get a full file from it, use merge.

    \b
    Examples:
      fsdpckpt convert merged/model.safetensors seed/pytorch_model_fsdp_0
      fsdpckpt convert pytorch_model.bin seed_dcp --key ''
    """
    from fsdpckpt._render import human_bytes
    from fsdpckpt.merging.to_dcp import convert as convert_file

    refuse_file_output(out_dcp_dir, "OUT_DCP_DIR")
    result = convert_file(full_file, out_dcp_dir, key=key or None, overwrite=overwrite,
                          progress=_progress(quiet, "converting"),
                          storage_options=storage_options)
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(f"converted {printable(result.source)} -> {printable(result.path)}: "
                   f"{result.tensors} tensors "
                   f"({human_bytes(result.bytes)}), {result.objects} other entries")


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--expect-digest", metavar="sha256:HEX",
              help="The manifest digest kept from the save (printed by verify, logged by "
                   "save_state): fail unless the checkpoint's manifest has exactly it.")
@_storage_options_option
@_debug_option
def verify(path: str, as_json: bool, quiet: bool, expect_digest: str | None,
           storage_options: dict | None) -> None:
    """Check that every byte of a checkpoint is what was written.

    Checks the structure as inspect does. Where the checkpoint has a manifest
    (fsdpckpt.json, written by fsdpckpt.save_state), every file's size and CRC-32 (and
    SHA-256 when saved with digest="sha256") and every tensor chunk's CRC-32, and flags
    stray files and folders. Without one (Accelerate or plain DCP wrote it), decodes
    every chunk's header against the metadata and checks its data against the CRC-32
    its zip directory stores. An output of export-hf or merge (a model folder, a
    shard index, a weight file): every file it needs present, headers strict, every
    tensor byte read, .bin data against its zip CRC-32s (safetensors records no
    checksum: its files are listed as unchecked). Exit 0 only when whole.

    CRC-32 catches accidents. To detect deliberate changes too, save with
    digest="sha256", keep the manifest digest this command prints somewhere safe,
    and pass it back with --expect-digest.

    \b
    Examples:
      fsdpckpt verify ckpt/checkpoint_100
      fsdpckpt verify ckpt/checkpoint_100 --expect-digest sha256:3f2a...
      fsdpckpt verify s3://runs/llama/checkpoint-100
    """
    from fsdpckpt._render import render_verify
    from fsdpckpt.inspection.verify import verify_checkpoint

    given, (path, note) = path, one_checkpoint(path, storage_options)
    say_note(note, as_json)
    report = verify_checkpoint(path, progress=_progress(quiet, "verifying"),
                               expect_digest=expect_digest, storage_options=storage_options)
    if as_json:
        click.echo(json.dumps(with_note(report, note).to_json(), indent=2))
    else:
        click.echo(render_verify(report, path))
    if not report.ok:
        count = len(report.problems)
        click.echo(f"fsdpckpt: error: {count} problem{'s' * (count != 1)} found in "
                   f"{printable(given)}", err=True)
        sys.exit(1)


main.add_command(export_hf)
main.add_command(diff)
main.add_command(list_command)
