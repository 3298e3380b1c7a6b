"""The ``export-hf`` and ``diff`` commands (registered on :data:`fsdpckpt.cli.main`): they
only parse, call the library and print, as every command does."""

from __future__ import annotations

import json
import sys

import click

from fsdpckpt._cli_common import (
    _debug_option,
    _dtype_option,
    _progress,
    _shard_size_option,
    _storage_options_option,
    one_checkpoint,
    refuse_file_output,
    say_note,
    with_note,
)
from fsdpckpt._printable import printable

__all__ = ["diff", "export_hf"]


@click.command("export-hf")
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.argument("output", type=click.Path(path_type=str))
@click.option("--base", metavar="PATH", type=click.Path(path_type=str),
              help="The Hugging Face model folder the run started from: config, generation "
                   "config, tokenizer and chat template come from there. Default: found where "
                   "trainers leave them (the checkpoint folder, its huggingface/, the run's "
                   "output folder above it).")
@_dtype_option("Cast floating-point weights to this dtype: bf16 (bfloat16), fp16 (float16) or "
               "fp32 (float32); the config says so too. Default: keep the stored dtypes.")
@_shard_size_option("The largest safetensors file (5GB, 5G, 5GiB, 500M, or bytes); a model that "
                    "fits is one model.safetensors, otherwise model-0000i-of-0000N.safetensors "
                    "plus an index.", default="5GB")
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier export in OUTPUT (its weights, config and tokenizer "
                   "files); other files are never touched.")
@click.option("--lora", type=click.Choice(["adapter", "fuse"]),
              help="For a PEFT-wrapped model: 'adapter' writes adapter_model.safetensors and "
                   "adapter_config.json for PeftModel.from_pretrained(base, OUTPUT); 'fuse' "
                   "exports the base model with the adapter fused in (W + scaling * B @ A).")
@click.option("--lora-config", metavar="PATH", type=click.Path(path_type=str),
              help="The adapter's adapter_config.json (or its folder). Default: found beside "
                   "the checkpoint or in --base.")
@click.option("--untie", is_flag=True,
              help="Write lm_head.weight too and set tie_word_embeddings: false in the config: "
                   "for a checkpoint whose output and input embeddings differ although its "
                   "config ties them (export-hf refuses that otherwise).")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the Python code the config's auto_map names (the .py files in the "
                   "checkpoint's or --base folder) to build the model class and check the keys "
                   "against it. It runs as you: only for code you trust. Without it nothing "
                   "from those folders runs; the code files are copied and the keys are checked "
                   "against --base's weights.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout.")
@_storage_options_option
@_debug_option
def export_hf(checkpoint: str, output: str, base: str | None, dtype: str | None,
              max_shard_size: str, overwrite: bool, lora: str | None, lora_config: str | None,
              untie: bool, trust_remote_code: bool, quiet: bool, as_json: bool,
              storage_options: dict | None) -> None:
    """Export a sharded checkpoint to a Hugging Face model folder.

    AutoModelForCausalLM.from_pretrained(OUTPUT) and AutoTokenizer.from_pretrained(OUTPUT)
    load the result as it is: weights named as Hugging Face names them (streamed,
    bit-exact after --dtype), config.json with FSDP2's "FSDP" class prefix removed and
    the exported dtype, generation config, tokenizer and chat template. Tied weights
    (lm_head.weight with tie_word_embeddings) follow the config and are not written,
    once their bytes are checked equal to what they are tied to (--untie when not).
    With transformers installed (pip install 'fsdpckpt[hf]'), the keys and shapes are
    checked against the config's model class before anything is written. A model with
    custom code (auto_map in config.json) is built only with --trust-remote-code, which
    runs that code; without it, its code files are copied, the keys are checked against
    the --base folder's weights, and the output says what was not checked.

    \b
    Examples:
      fsdpckpt export-hf run/checkpoint-500 exported/ --dtype bf16
      fsdpckpt export-hf ckpt/ exported/ --base meta-llama/Llama-3.2-1B-local/
      fsdpckpt export-hf lora-run/checkpoint-500 adapter/ --lora adapter
      fsdpckpt export-hf lora-run/checkpoint-500 fused/ --lora fuse --dtype bf16
      fsdpckpt export-hf s3://bucket/run/checkpoint-500 exported/ --dtype bf16
    """
    from fsdpckpt._render import human_bytes
    from fsdpckpt.export.hf import export_hf as export
    from fsdpckpt.export.lora import AdapterExport

    refuse_file_output(output, "OUTPUT")
    checkpoint, note = one_checkpoint(checkpoint, storage_options)
    say_note(note, as_json)
    result = export(checkpoint, output, base=base, dtype=dtype, max_shard_size=max_shard_size,
                    overwrite=overwrite, lora=lora, lora_config=lora_config, untie=untie,
                    progress=_progress(quiet, "exporting"), storage_options=storage_options,
                    trust_remote_code=trust_remote_code)
    if isinstance(result, AdapterExport):
        if as_json:
            click.echo(json.dumps(with_note(result, note).to_json(), indent=2))
        else:
            click.echo(f"exported adapter '{printable(result.adapter)}' ({result.modules} "
                       f"modules, {result.tensors} tensors) -> {printable(result.output)}: "
                       + ", ".join(printable(name) for name in result.files))
        return
    if as_json:
        click.echo(json.dumps(with_note(result, note).to_json(), indent=2))
        return
    click.echo(f"exported {printable(result.source)} -> {printable(result.output)}: "
               f"{result.tensors} tensors, {human_bytes(result.bytes)} {result.dtype} in "
               f"{len(result.weights)} file{'s' * (len(result.weights) != 1)}, "
               f"{result.seconds:.2f} s")
    for target, source in result.tied:
        click.echo(f"  {printable(target)} is tied to {printable(source)} (the config says "
                   "so): not written")
    click.echo(f"  config from {printable(result.config_from)}; also wrote "
               + ", ".join(printable(p.name) for p in result.files))
    if result.converted:
        click.echo(f"  converted {result.converted}")
    if result.model_class:
        click.echo(f"  keys and shapes match {result.model_class}")
    if result.not_checked:
        click.echo(f"  not checked: {printable(result.not_checked)}")
    if result.no_tokenizer:
        click.echo(f"  {printable(result.no_tokenizer)}")
@click.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Absolute tolerance: equal when |a - b| <= atol + rtol * |b|.")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Relative tolerance. With atol and rtol both 0, values and dtypes must be "
                   "equal; with a tolerance, a dtype change (a bf16 export) is allowed.")
@click.option("--name", "-n", "names", multiple=True, metavar="PATTERN",
              help="Only compare entries whose name matches: a glob ('*.weight') or a "
                   "substring ('layers.0.'), against the name as compared ('0.weight') or "
                   "as a side stores it ('model.0.weight'); repeatable.")
@click.option("--optimizer", is_flag=True,
              help="Compare the optimizer state (optimizer_0/, optimizer.safetensors) of "
                   "checkpoints and merged folders instead of the model.")
@click.option("--model-index", type=int, metavar="N",
              help="Which model to compare when a checkpoint holds several "
                   "(pytorch_model_fsdp_N/).")
@click.option("--keep-keys", is_flag=True,
              help="Compare names with wrapper segments (_fsdp_wrapped_module., "
                   "_checkpoint_wrapped_module., _orig_mod.) kept; by default they are "
                   "removed on both sides, as merge removes them.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout (schema in docs/cli.md).")
@click.option("--html", "html", metavar="FILE",
              help="Also write a self-contained HTML page: per layer and module, the "
                   "relative change ||a-b||/||a|| and max |a-b|, and the largest changes "
                   "(computed in the same read; --json then carries rel_change too).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_storage_options_option
@_debug_option
def diff(a: str, b: str, atol: float, rtol: float, names: tuple[str, ...], optimizer: bool,
         model_index: int | None, keep_keys: bool, as_json: bool, html: str | None,
         quiet: bool, storage_options: dict | None) -> None:
    """Compare two state sources tensor by tensor, streaming.

    A and B are each a DCP folder, a whole checkpoint (its model folder; --optimizer:
    its optimizer folder), a .safetensors or .bin file or shard index (*.index.json),
    or a folder holding model.safetensors or pytorch_model.bin (or their index), as
    Hugging Face and fsdpckpt merge write them. Names are compared as merge writes
    them: a DCP folder's shared top-level key ("model.") and wrapper segments are
    dropped. One box of one tensor per side is in memory at a time.

    Reports names missing from B, names unexpected in B, shape and dtype mismatches,
    and per tensor the largest absolute and relative difference. A NaN on both sides
    at the same position counts as equal.

    Exit status: 0 only when equal within the tolerance; 1 when anything differs or
    a side cannot be read.

    \b
    Examples:
      fsdpckpt diff ckpt/ merged/                  # a merge equals its checkpoint
      fsdpckpt diff ckpt/ export/ --rtol 1e-2      # a bf16 export, within bf16's precision
      fsdpckpt diff a.safetensors b.bin --name 'layers.0.*' --json
      fsdpckpt diff s3://bucket/run/checkpoint-500 merged/
      fsdpckpt diff run/checkpoint-1000 run/checkpoint-2000 --html moved.html
    """
    from fsdpckpt._render import render_diff
    from fsdpckpt.inspection.diff import diff as diff_sources

    (a, note_a), (b, note_b) = one_checkpoint(a, storage_options), \
        one_checkpoint(b, storage_options)
    notes = [n for n in (note_a, note_b) if n]
    for note in notes:
        say_note(note, as_json)
    report = diff_sources(a, b, atol=atol, rtol=rtol, names=names, optimizer=optimizer,
                          model_index=model_index, keep_keys=keep_keys,
                          progress=_progress(quiet, "comparing"), norms=bool(html),
                          storage_options=storage_options)
    if html:
        from fsdpckpt.inspection._html import write_page
        from fsdpckpt.inspection.html_diff import diff_html

        click.echo(f"wrote {printable(write_page(html, diff_html(report)))}", err=True)
    if as_json:
        click.echo(json.dumps(with_note(report, "; ".join(notes) or None).to_json(), indent=2))
    else:
        click.echo(render_diff(report))
    if not report.equal:
        sys.exit(1)
