"""The ``fsdpckpt`` command line. It only parses, calls the library and prints.

One error boundary (:class:`_Group`) turns every error into one line on stderr
and exit status 1; ``--debug`` shows the traceback instead. ``--json`` puts one
JSON document on stdout; logs and progress bars go to stderr.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import click

from . import __version__
from .errors import FsdpCkptError

__all__ = ["main"]


def _debug_option(func: Any) -> Any:
    def remember(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.meta["fsdpckpt.debug"] = True
        return value

    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                        callback=remember,
                        help="On error, show the full traceback instead of one line.")(func)


def _fail(ctx: click.Context, message: str, exc: BaseException | None = None) -> None:
    if exc is not None and ctx.meta.get("fsdpckpt.debug"):
        traceback.print_exception(exc)
    click.echo(f"fsdpckpt: error: {message}", err=True)
    ctx.exit(1)


class _Group(click.Group):
    """The error boundary: library errors become one line and exit 1."""

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
        except KeyboardInterrupt as exc:
            _fail(ctx, "interrupted", exc)
        except Exception as exc:  # noqa: BLE001 - the boundary of last resort
            _fail(ctx, f"unexpected {type(exc).__name__}: {exc} (rerun with --debug and "
                       "report it, with the traceback)", exc)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})
@click.version_option(__version__, prog_name="fsdpckpt")
@_debug_option
def main() -> None:
    """Inspect, verify and merge sharded PyTorch FSDP checkpoints.

    Works on torch.distributed.checkpoint (DCP) folders, as FSDP1, FSDP2 and
    Accelerate's save_state write them, without loading them into memory and
    without trusting their pickles.

    \b
    Examples:
      fsdpckpt inspect ckpt/                       # what is in a checkpoint
      fsdpckpt inspect ckpt/pytorch_model_fsdp_0 --json
    """


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (schema in docs/cli.md).")
@click.option("--name", "-n", "names", metavar="PATTERN",
              help="Only list tensors and objects whose name matches: a glob "
                   "('*.weight') or a substring ('layers.0.').")
@click.option("--chunks", is_flag=True, help="Also list every chunk: offsets, sizes, file, byte range.")
@click.option("--summary", is_flag=True, help="Only the summary, no table of tensors.")
@_debug_option
def inspect(path: str, as_json: bool, names: str | None, chunks: bool, summary: bool) -> None:
    """Show what a checkpoint holds and check that its structure is whole.

    PATH is a DCP folder (the one holding .metadata) or a whole checkpoint folder
    in Accelerate's layout (pytorch_model_fsdp_0/, optimizer_0/, random_states_0.pkl,
    scheduler.bin...) or HF Trainer's. Only .metadata and file sizes are read: no
    tensor data, no torch import, no pickle code runs.

    Exit status: 0 when the structure is whole, 1 when problems were found
    (gaps or overlaps between chunks, missing or truncated rank files) or the path
    is not a readable checkpoint.

    \b
    Examples:
      fsdpckpt inspect ckpt/
      fsdpckpt inspect ckpt/pytorch_model_fsdp_0 --name 'layers.0.*' --chunks
      fsdpckpt inspect ckpt/ --json | jq '.parts[0].tensors[].name'
    """
    from .inspection import inspect_checkpoint
    from .render import render_inspect

    doc = inspect_checkpoint(path, names=names)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render_inspect(doc, chunks=chunks, tensors=not summary))
    if not doc["ok"]:
        count = len(doc["problems"])
        click.echo(f"fsdpckpt: error: {count} problem{'s' * (count != 1)} found in {path}; "
                   "the checkpoint is not whole", err=True)
        sys.exit(1)
