"""What a new user met first in the docs (issue 33): no private imports, examples that match
the shipped fixture, a page that names what its example needs, outputs git ignores."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT

_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PRIVATE = re.compile(r"^\s*(from|import)\s+fsdpckpt(\.\w+)*\._\w+", re.MULTILINE)


def _fenced(path) -> list[tuple[str, str]]:
    """``(tag, code)`` of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("doc", _DOCS, ids=lambda p: p.name)
def test_no_example_imports_a_private_module(doc):
    for tag, code in _fenced(doc):
        if tag in ("python", "py"):
            assert not _PRIVATE.search(code), f"{doc.name}: {_PRIVATE.search(code).group(0)}"


def test_the_example_files_import_no_private_module():
    for path in (ROOT / "docs").glob("*.py"):
        assert not _PRIVATE.search(path.read_text()), path.name


def test_the_index_pages_name_filter_matches_the_shipped_fixture():
    # index.md works on ``ckpt/``, a copy of fixtures/fsdp2_accelerate.
    patterns = re.findall(r"fsdpckpt inspect ckpt/ --name '([^']+)'",
                          (ROOT / "docs" / "index.md").read_text())
    assert patterns
    for pattern in patterns:
        out = subprocess.run([sys.executable, "-m", "fsdpckpt", "inspect",
                              str(ROOT / "fixtures" / "fsdp2_accelerate"), "--name", pattern],
                             capture_output=True, text=True, check=True).stdout
        assert "No tensor or object name matches" not in out, pattern


def test_the_training_page_names_what_its_example_imports():
    page = (ROOT / "docs" / "training.md").read_text()
    imported = re.findall(r"^from (\w+)", (ROOT / "docs" / "run_example.py").read_text(),
                          re.MULTILINE)
    extras = {"torch", "transformers", "fsdpckpt", "__future__"}
    for module in set(imported) - extras - set(sys.stdlib_module_names):
        assert f"pip install {module}" in page, module


def test_git_ignores_what_the_readmes_commands_write():
    ignored = (ROOT / ".gitignore").read_text().split()
    written = []
    for tag, code in _fenced(ROOT / "README.md"):
        if tag == "bash":
            written += re.findall(r"^fsdpckpt (?:merge|export-hf) \S+ (\S+)", code, re.MULTILINE)
    assert written
    for output in written:
        assert f"{output.rstrip('/')}/" in ignored, output


@pytest.mark.slow  # imports transformers and generates: ~15 s
def test_the_readme_says_what_its_generate_example_prints(tmp_path):
    readme = (ROOT / "README.md").read_text()
    blocks = _fenced(ROOT / "README.md")
    export = next(code for tag, code in blocks if "fsdpckpt export-hf" in code)
    generate = next(code for tag, code in blocks if tag == "python" and "generate(" in code)
    said = next(code for tag, code in blocks[blocks.index(("python", generate)):]
                if tag == "text").strip()
    # The README's export, into the scratch folder the generate block then reads from
    subprocess.run([sys.executable, "-m", "fsdpckpt", *export.split()[1:-1],
                    str(tmp_path / "tiny-hf")], cwd=ROOT, check=True, capture_output=True)
    printed = subprocess.run([sys.executable, "-c", generate], cwd=tmp_path, check=True,
                             capture_output=True, text=True).stdout.strip()
    assert printed == said, (printed, said)
    assert "prints" in readme[readme.index(generate):readme.index(said)]


def test_the_training_page_says_to_kill_the_workers_to_simulate_a_crash():
    # kill -9 of torchrun alone leaves its workers running to finish the save (tried by hand
    # on torch 2.13: both workers of a 2-rank torchrun outlived it and wrote their files)
    page = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "kill the workers, not torchrun alone" in page
    assert "pkill -9 -f training_example.py" in page
