"""The ``list`` command (registered on :data:`fsdpckpt.cli.main`): it only parses, calls
:func:`fsdpckpt.inspection.listing.list_checkpoints` and prints."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING

import click

from fsdpckpt._cli_common import _debug_option, _storage_options_option
from fsdpckpt._printable import printable

if TYPE_CHECKING:
    from fsdpckpt.inspection.listing import CheckpointList

__all__ = ["list_command", "render_list"]


@click.command("list")
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@_storage_options_option
@_debug_option
def list_command(run_dir: str, as_json: bool, storage_options: dict | None) -> None:
    """List the checkpoints in RUN_DIR: step, state, when written, size.

    RUN_DIR is where a run saves its checkpoints: a CheckpointManager root
    (checkpoint_N/), an HF Trainer output folder (checkpoint-N/), an Accelerate
    project folder (checkpoints/checkpoint_N/), torchtitan's step-N/, VeRL's
    global_step_N/, torchtune's epoch_N/, Lightning's *.ckpt/. Local or a URL.

    States: committed (its manifest, written last, is there), complete (every DCP
    folder has its .metadata: a trainer's own save), unfinished (a save that did not
    finish: a staging folder, or .metadata missing), unreadable (named as a
    checkpoint, not one fsdpckpt reads). Reads names, sizes and times only.

    \b
    Examples:
      fsdpckpt list run/ckpts
      fsdpckpt list output/ --json
    """
    from fsdpckpt.inspection.listing import list_checkpoints

    found = list_checkpoints(run_dir, storage_options=storage_options)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
        return
    click.echo(render_list(found))


def render_list(found: CheckpointList) -> str:
    """The human form of a :class:`~fsdpckpt.inspection.listing.CheckpointList`: one line
    per checkpoint, oldest first, then the newest a load would take."""
    from fsdpckpt._render import human_bytes, table

    states = [c.state for c in found.checkpoints]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    out = [f"{printable(str(found.root))}: {len(states)} checkpoint"
           f"{'s' * (len(states) != 1)} ({counts})", ""]
    rows = []
    for c in found.checkpoints:
        when = "-" if c.modified is None else \
            datetime.fromtimestamp(c.modified).strftime("%Y-%m-%d %H:%M:%S")
        rows.append(["-" if c.step is None else str(c.step), c.state, when,
                     human_bytes(c.bytes), printable(c.name)])
    out += table(rows, header=["step", "state", "written", "size", "name"], right=(0, 3))
    for c in found.checkpoints:
        if c.why:
            out.append(f"  {printable(c.name)}: {printable(c.why)}")
    latest = found.latest
    out += ["", f"newest to load: {printable(str(latest.path))}" if latest else
            "no committed or complete checkpoint to load"]
    return "\n".join(out)
