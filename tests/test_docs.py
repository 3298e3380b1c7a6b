"""Every command and code block in README.md and docs/*.md runs as written, in order.

The rule, for whoever writes the docs (every ``.md`` in ``docs/`` is picked up on its own):

- ```` ```bash ```` (or ``sh``, ``shell``) blocks run as one bash script with
  ``set -euo pipefail``.
- ```` ```console ```` blocks: the lines starting with ``$ `` run; the other lines are their
  output, shown for the reader and not compared.
- ```` ```python ```` (or ``py``) blocks run as if pasted into one interpreter per document:
  names defined by one block are there for the next, ``__name__`` is ``"__main__"`` and
  ``sys.argv`` is ``[""]``.
- Every other block (no language, ``text``, ``jsonc``...) is shown, never run: use those for
  output, file trees and formats.
- A block that installs things or takes minutes is left out only by a marker on the line
  just before its fence (a blank line between is allowed)::

      <!-- doctest: skip (why, e.g. run by .ci/run) -->

  Each skipped block shows up as one SKIPPED line with its place and reason in pytest's
  summary. A block whose reason says "run by .ci/run" must appear in ``.ci/run`` verbatim.

Each document runs in a scratch copy of the repository, from its root, as a reader in a
fresh checkout would run it: blocks share files (and Python names) within a document, in
document order. Then all of them run one after another in one checkout (README first, then
docs/ by name), as a reader who follows them all would: name outputs so they do not clash.
``fsdpckpt`` is the one installed beside the interpreter running the tests, its command
line run warm: each command forked from one process that imported torch once
(tests/warmcli.py; the console script itself is tested by tests/test_entry_point.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import warmcli

from conftest import ROOT

pytestmark = pytest.mark.slow

SHELL_TAGS = {"bash", "sh", "shell"}
PYTHON_TAGS = {"python", "py"}
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*$")
_SCRATCH_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", "*.pyc",
                                         "build", "dist", "*.egg-info", ".pytest_cache", "out")


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown document."""

    doc: str        # path relative to the repository root
    line: int       # 1-based line of the opening fence
    tag: str        # the info string's first word, lower case ("" when none)
    code: str
    skip: str | None  # the marker's reason, or None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.tag in SHELL_TAGS | PYTHON_TAGS | {"console"}


def documents() -> list[Path]:
    """README.md, then every Markdown file in docs/ in name order."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks(path: Path, name: str | None = None) -> list[Block]:
    """The fenced blocks of one document, in order, with their skip markers."""
    name = name or str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, tag = opening.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            # Indented blocks (inside a list item) lose the fence's indentation.
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _SKIP.match(lines[k]) if k >= 0 else None
        found.append(Block(name, i + 1, tag.lower(), "\n".join(body) + "\n",
                           marker.group("reason").strip() if marker else None))
        i = j + 1
    return found


def _tracked_files(root: Path) -> list[str] | None:
    """The files git tracks under ``root`` (staged new files included), or None outside git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root,
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [name for name in listed.decode("utf-8", "surrogateescape").split("\0") if name]


def _scratch(tmp_path: Path, root: Path = ROOT) -> Path:
    """A copy of the checkout as a fresh clone has it: only what git tracks.

    A reader who followed the README first has its outputs (``merged/``, ``tiny-hf/``) in
    the checkout; copying them would make the README's own commands refuse to overwrite
    them. Outside git (an unpacked sdist), everything but build leftovers is copied."""
    into = tmp_path / "checkout"
    tracked = _tracked_files(root)
    if tracked is None:
        return Path(shutil.copytree(root, into, ignore=_SCRATCH_IGNORE))
    for name in tracked:
        source = root / name
        if not source.is_file():  # deleted in the work tree, or a submodule
            continue
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return into


def _shell(block: Block) -> str:
    if block.tag == "console":
        return "\n".join(line[2:] for line in block.code.splitlines() if line.startswith("$ "))
    return block.code


#: The folder of the warm ``fsdpckpt`` shim while this module's tests run.
_WARM: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _warm_fsdpckpt(tmp_path_factory):
    with warmcli.start(tmp_path_factory.mktemp("warm")) as bin_folder:
        _WARM.append(bin_folder)
        yield
        _WARM.remove(bin_folder)


def _run_shell(block: Block, cwd: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*map(str, _WARM), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + _shell(block)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        pytest.fail(f"{block.where}: the {block.tag} block exits {done.returncode}:\n"
                    f"{_shell(block)}\n--- stdout ---\n{done.stdout[-3000:]}"
                    f"\n--- stderr ---\n{done.stderr[-3000:]}", pytrace=False)


def _run_python(block: Block, namespace: dict) -> None:
    try:
        exec(compile(block.code, block.where, "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - reported with the block's place
        pytest.fail(f"{block.where}: the python block raises {type(exc).__name__}: {exc}\n"
                    f"{block.code}", pytrace=False)


ALL_BLOCKS = [b for doc in documents() for b in blocks(doc)]


#: What each document's blocks wrote into its fresh checkout (files git does not track), by
#: document, as the tests above ran them: what the pasted-in-one-checkout check compares.
_WROTE: dict[str, set[str]] = {}


def _written(checkout: Path) -> set[str]:
    tracked = set(_tracked_files(ROOT) or ())
    return {str(p.relative_to(checkout)) for p in checkout.rglob("*")
            if (p.is_file() or p.is_symlink()) and str(p.relative_to(checkout)) not in tracked
            and "__pycache__" not in p.parts}


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_of_the_document_runs_in_order(doc, tmp_path, monkeypatch):
    checkout = _scratch(tmp_path)
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(sys, "argv", [""])
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(doc):
        if not block.runs or block.skip is not None:
            continue
        if block.tag in PYTHON_TAGS:
            _run_python(block, namespace)
        else:
            _run_shell(block, checkout)
    _WROTE[str(doc.relative_to(ROOT))] = _written(checkout)


def test_the_documents_pasted_one_after_another_in_one_checkout(tmp_path, monkeypatch):
    """A reader goes from the README to the docs in one checkout: no document's commands
    may trip over files an earlier one made (an output folder that already exists...).

    Each document ran in a fresh checkout above (so none needs another's outputs); pasted
    one after another, one can only trip over what an earlier one wrote: so no two documents
    may write the same file. The docs then run once, not twice (issue 34). Run on its own
    (the documents' runs not in this session), it pastes them all into one checkout."""
    names = [str(doc.relative_to(ROOT)) for doc in documents()]
    if all(name in _WROTE for name in names):
        seen: dict[str, str] = {}
        for name in names:
            for path in sorted(_WROTE[name]):
                if path in seen:
                    pytest.fail(f"{name} writes {path}, which {seen[path]} wrote before it: "
                                "pasted one after another, the second trips over the first; "
                                "name the outputs apart", pytrace=False)
                seen[path] = name
        return
    checkout = _scratch(tmp_path)
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(sys, "argv", [""])
    for doc in documents():
        namespace: dict = {"__name__": "__main__"}
        for block in blocks(doc):
            if block.runs and block.skip is None:
                _run_python(block, namespace) if block.tag in PYTHON_TAGS else \
                    _run_shell(block, checkout)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.runs and b.skip is not None],
                         ids=lambda b: b.where)
def test_skipped_block(block):
    """Says which blocks are left out and why (pytest's summary lists each one)."""
    if "run by .ci/run" in block.skip:
        ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
        missing = [line for line in _shell(block).splitlines() if line.strip()
                   and line.strip() not in ci]
        assert not missing, f"{block.where} says it is run by .ci/run, but .ci/run lacks {missing}"
    pytest.skip(f"{block.where}: {block.skip}")


def test_markers_sit_right_before_a_block_that_would_run():
    for doc in documents():
        lines = doc.read_text(encoding="utf-8").splitlines()
        marked = {b.line for b in blocks(doc) if b.skip is not None and b.runs}
        for number, line in enumerate(lines, 1):
            if not (line.lstrip().startswith("<!--") and "doctest:" in line):
                continue
            after = next((n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip()),
                         None)
            assert _SKIP.match(line) and after in marked, \
                f"{doc.name}:{number}: a doctest marker must read '<!-- doctest: skip (why) -->' " \
                "and sit just before a bash, console or python block"


@pytest.mark.parametrize("name", ["training_example.py", "run_example.py"])
def test_the_training_page_shows_the_example_files_verbatim(name):
    example = (ROOT / "docs" / name).read_text(encoding="utf-8")
    shown = [b.code for b in blocks(ROOT / "docs" / "training.md") if b.tag in PYTHON_TAGS]
    assert example in shown, f"docs/training.md must show docs/{name} as it is"


def test_the_block_reader_follows_the_rule(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```bash\necho a\n```\n\n<!-- doctest: skip (slow) -->\n\n"
                   "```python\nx = 1\n```\n```\nplain\n```\n```console\n$ echo b\nb\n```\n")
    found = blocks(doc, name="x.md")
    assert [(b.line, b.tag, b.skip, b.runs) for b in found] == [
        (3, "bash", None, True), (9, "python", "slow", True), (12, "", None, False),
        (15, "console", None, True)]
    assert _shell(found[3]) == "echo b"


def test_the_scratch_copy_holds_what_git_tracks_not_a_readers_outputs(tmp_path):
    """Running the README's main job and then its test command in one checkout works: the
    outputs the main job left (``merged/``, ``tiny-hf/``) are not copied into the scratch
    checkout, where the README's commands would refuse to overwrite them."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "page.md").write_text("tracked\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "docs/page.md"], check=True)
    (repo / "merged").mkdir()
    (repo / "merged" / "model.safetensors").write_bytes(b"a reader's output")
    (repo / "tiny-hf").mkdir()
    (repo / "tiny-hf" / "config.json").write_text("{}")
    copy = _scratch(tmp_path / "scratch", repo)
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == \
        ["docs/page.md"]
