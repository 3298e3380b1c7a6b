"""What every command of the CLI shares: ``--debug``, the one error line, progress bars."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from typing import Any

import click

from fsdpckpt._printable import cap_line, printable
from fsdpckpt._progress import ProgressCallback, ProgressFactory
from fsdpckpt.errors import REPORTED_BY_RANK

__all__ = ["_debug_option", "_dtype_option", "_fail", "_progress", "_shard_size_option",
           "_storage_options_option", "as_flags", "merge_output", "one_checkpoint",
           "output_file_name", "refuse_file_output", "say_note", "with_note", "FLAGS"]


def _debug_option(func: Any) -> Any:
    def remember(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.meta["fsdpckpt.debug"] = True
        return value

    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                        callback=remember,
                        help="On error, show the full traceback instead of one line.")(func)


def _storage_options_option(func: Any) -> Any:
    def parse(_ctx: click.Context, _param: click.Parameter, value: str | None) -> dict | None:
        if value is None:
            return None
        from fsdpckpt._io.jsonio import parse_json

        try:
            options = parse_json(value)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise click.BadParameter('a JSON object, e.g. \'{"endpoint_url": "http://host:9000"}\'')
        return options

    return click.option(
        "--storage-options", "storage_options", metavar="JSON", callback=parse,
        help="For s3://, gs://, az:// paths: the fsspec filesystem's options as a JSON "
             'object, e.g. \'{"endpoint_url": "http://localhost:9000"}\' (credentials and '
             "timeouts: fsdpckpt --help).")(func)


def _dtype_option(help: str, name: str = "--dtype") -> Any:
    """``--dtype`` (or ``name``: merge's ``--optimizer-dtype``), in any spelling the library
    reads (``bf16``, ``bfloat16``, ``torch.bfloat16``, ``fp16``, ``half``, ``float32``...:
    ``merging.plan.parse_dtype``). The library checks it with the other options, so every
    problem is reported at once."""
    return click.option(name, metavar="DTYPE", help=help)


def _shard_size_option(help: str, default: str | None = None) -> Any:
    """``--max-shard-size``: ``5GB``, ``5G``, ``5GiB``, ``500M``, ``500MB`` or a number of
    bytes (``merging.plan.parse_size``), checked by the library with the other options."""
    return click.option("--max-shard-size", metavar="SIZE", default=default,
                        show_default=default is not None, help=help)


#: Names of weight files, which an output folder is not: ``out/model.safetensors`` given as
#: the output would become ``out/model.safetensors/model.safetensors``.
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def output_file_name(output: str) -> tuple[str, str] | None:
    """``(folder, file name)`` when ``output``, given where a command wants an output
    folder, names a weight file (``out/model.safetensors``) rather than a folder; None for
    a folder, or a folder of that name that exists already (the user's own choice)."""
    from pathlib import Path

    from fsdpckpt._io.remote import is_url

    head, _, name = output.rstrip("/").rpartition("/")
    if not name.lower().endswith(_FILE_SUFFIXES):
        return None
    if not is_url(output) and Path(output).is_dir():
        return None
    return (head or "."), name


def refuse_file_output(output: str, what: str, hint: str = "") -> None:
    """Refuse an ``output`` that names a weight file where a folder is wanted, naming the
    folder to pass instead (``what``: the argument's name in the usage line; ``hint``: more
    words at the end of the message).

    Raises:
        OptionError: ``output`` ends in a weight file's name.
    """
    from fsdpckpt.errors import OptionError

    found = output_file_name(output)
    if found is not None:
        folder, name = found
        raise OptionError(f"{output}: names a file ({name}), but {what} is the folder the "
                          f"files are written into; pass {folder} instead{hint}")


#: The names of the one file each --format writes as named: torch.save's .pt and .pth too, as
#: torch's dcp_to_torch_save users name it.
_FORMAT_NAMES = {"safetensors": (".safetensors",), "bin": (".bin", ".pt", ".pth")}


def merge_output(checkpoint: str, output: str, fmt: str, optimizer: bool,
                  max_shard_size: str | None) -> tuple[str, str | None]:
    """``(OUTPUT_DIR, file name)``: ``out/merged.safetensors`` (``out/model.pt`` with
    --format bin) is the single file of the library's ``file_name=`` mode, written as such,
    where one file of that format is what the merge writes; a name of the other format
    says which --format it needs; otherwise a weight file's name is refused, naming the
    folder."""
    from fsdpckpt.errors import OptionError

    found = output_file_name(output)
    if found is None:
        return output, None
    folder, name = found
    one_file = not optimizer and max_shard_size is None
    if one_file and name.lower().endswith(_FORMAT_NAMES[fmt]):
        return folder, name
    other = "bin" if fmt == "safetensors" else "safetensors"
    suffix = next((s for s in _FORMAT_NAMES[other] if name.lower().endswith(s)), None)
    if one_file and suffix:
        command = f"fsdpckpt merge {checkpoint} {output}" + \
            (" --format bin" if other == "bin" else "")
        needs = "--format bin (the default is safetensors)" if other == "bin" else \
            "--format safetensors (the default), not --format bin"
        default = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
        raise OptionError(f"{name}: a {suffix} name needs {needs}: {command}; or pass "
                          f"{folder} instead (for {default})")
    refuse_file_output(output, "OUTPUT_DIR", " (a file name is kept only for one file: "
                       "*.safetensors, or *.bin, *.pt, *.pth with --format bin; without "
                       "--optimizer and --max-shard-size)")
    return output, None  # not reached: refuse_file_output raised


def one_checkpoint(path: str, storage_options: dict | None) -> tuple[str, str | None]:
    """``(path to read, note)``: a run folder holding exactly one finished checkpoint stands
    for it (``run/`` holding ``step-2/`` alone is read as ``run/step-2``), and the note
    says so, once: on stderr, or as the ``note`` field of a ``--json`` document
    (:func:`with_note`). Any other path is read as given (note None)."""
    from fsdpckpt._io.remote import location
    from fsdpckpt.dcp.layout import one_checkpoint as find_one

    root = location(path, storage_options=storage_options)
    found = find_one(root)
    if found is None:
        return path, None
    return str(found), f"{root}: holds one checkpoint, {found.name}; using {found}"


def say_note(note: str | None, as_json: bool) -> None:
    """Tell the user ``note`` on stderr; with ``--json`` it is the document's ``note``."""
    if note and not as_json:
        click.echo(f"fsdpckpt: note: {printable(note)}", err=True)


class _Noted:
    def __init__(self, report: Any, note: str) -> None:
        self.report, self.note = report, note

    def to_json(self) -> Any:
        return {**self.report.to_json(), "note": self.note}


def with_note(report: Any, note: str | None) -> Any:
    """``report`` (anything with ``to_json()`` giving a dict), its document carrying
    ``"note"`` when there is one."""
    return report if note is None else _Noted(report, note)


#: The library's messages name its parameters; the command line's name the flags. In order:
#: a longer text first (a message that gives both says the flag once).
FLAGS = (
    ("overwrite=True (--overwrite)", "--overwrite"),
    ("overwrite=True", "--overwrite"),
    ("format='bin'", "--format bin"),
    ("--untie (untie=True)", "--untie"),
    ("lora_config=...", "--lora-config"),
    ("base=...", "--base"),
    ("lora='fuse'", "--lora fuse"),
    ("lora='adapter'", "--lora adapter"),
    ("with lora=None", "without --lora"),
    ("keep_keys=True", "--keep-keys"),
    ("optimizer=True", "--optimizer"),
    ("as lora_config=", "as --lora-config"),
    ("pass base=", "pass --base"),
    ("storage_options=", "--storage-options"),
)


def as_flags(message: str) -> str:
    """``message`` with the library's parameter names (``overwrite=True``) said as the
    command line's flags (``--overwrite``)."""
    for parameter, flag in FLAGS:
        message = message.replace(parameter, flag)
    return message


#: The exit status of a command ended by SIGINT (Ctrl-C) or SIGTERM: 128 + the signal, as
#: shells report a process a signal ended, so a script can tell an interruption from a failure.
INTERRUPTED, TERMINATED = 128 + 2, 128 + 15


def interrupted_status(exc: BaseException) -> int:
    """The exit status for a ``KeyboardInterrupt``: 143 for SIGTERM, else 130."""
    from fsdpckpt.errors import Terminated

    return TERMINATED if isinstance(exc, Terminated) else INTERRUPTED


def _fail(ctx: click.Context, message: str, exc: BaseException | None = None,
          code: int = 1) -> None:
    """Print the one error line: parameters said as flags, names from a checkpoint escaped,
    its length capped; exit with ``code``."""
    if exc is not None and ctx.meta.get("fsdpckpt.debug"):
        traceback.print_exception(exc)
    if exc is not None and getattr(exc, REPORTED_BY_RANK, None) is not None:
        ctx.exit(code)  # a lower rank of the same torchrun raised it too, and prints it
    click.echo(f"fsdpckpt: error: {cap_line(printable(as_flags(message)))}", err=True)
    ctx.exit(code)


def _progress(quiet: bool, desc: str = "merging") -> ProgressFactory | None:
    """A progress factory (:mod:`fsdpckpt._progress`) of tqdm byte bars on stderr; None
    (silent) with --quiet or when stderr is no terminal.

    The library calls ``factory(total_bytes, files)`` once it knows what it will read (merge
    and verify do) and gives the returned callback byte counts; with a total the bar shows a
    percentage and an ETA.
    """
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    def factory(total: int, _files: int) -> ProgressCallback:
        bar = tqdm(total=total or None, unit="B", unit_scale=True, unit_divisor=1024,
                   file=sys.stderr, desc=desc, leave=False)

        def advance(nbytes: int) -> None:
            bar.update(nbytes)

        return advance

    return factory


#: A list longer than this is written one element per line, each element compact: a
#: 1,024-rank checkpoint's report lists millions of chunks, which indenting element by
#: element would make several times larger and ten times slower to write.
_LONG_LIST = 64
#: Levels of our own documents laid out on lines; what lies deeper (values from a
#: checkpoint) is written compact, by the C encoder, whatever its depth.
_LAID_OUT = 4


def json_document(report: Any) -> str:
    """One JSON document as ``--json`` prints it: indented by 2 near the top, long lists one
    element per line, deeper values compact. Parses to ``report.to_json()``."""
    return "".join(json_pieces(report))


def json_pieces(report: Any) -> Iterator[str]:
    """:func:`json_document` in pieces, to be written as they come: a 4,096-rank report's
    document is a gigabyte, never held whole."""
    import json

    from fsdpckpt.dcp._bulk import paused_gc

    def laid_out(item: Any, pad: str, depth: int) -> Iterator[str]:
        inner = pad + "  "
        if depth < _LAID_OUT and isinstance(item, dict) and item:
            yield "{\n"
            for i, (k, v) in enumerate(item.items()):
                yield (",\n" if i else "") + f"{inner}{json.dumps(str(k))}: "
                yield from laid_out(v, inner, depth + 1)
            yield f"\n{pad}}}"
        elif depth < _LAID_OUT and isinstance(item, list) and len(item) > _LONG_LIST:
            yield "[\n" + ",\n".join(inner + json.dumps(v) for v in item) + f"\n{pad}]"
        elif depth < _LAID_OUT and isinstance(item, list) and \
                any(isinstance(v, (dict, list)) for v in item):
            yield "[\n"
            for i, v in enumerate(item):
                yield (",\n" if i else "") + inner
                yield from laid_out(v, inner, depth + 1)
            yield f"\n{pad}]"
        else:
            yield json.dumps(item)

    with paused_gc():  # millions of small values, none in a cycle
        yield from laid_out(report.to_json(), "", 0)
