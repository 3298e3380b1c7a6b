"""Make the screenshots of docs/reports.md from the shipped fixtures, with the same code the
browser tests use (tests/browser.py: Debian's chromium, headless).

    python docs/make_screenshots.py        # writes docs/report-*.png

Needs chromium (``apt-get install chromium``) and the test extras (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import browser  # noqa: E402 - tests/browser.py, found through the path above

FIXTURES = Path("fixtures")  # paths relative to the checkout: the pages show them so


def _fsdpckpt(*args: object) -> None:
    quiet = ["-q"] if args[0] != "inspect" else []  # no progress bars
    done = subprocess.run([sys.executable, "-m", "fsdpckpt", *map(str, args), *quiet],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 1):  # diff exits 1 when the sides differ
        raise SystemExit(done.stderr)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix=".screenshots-", dir=ROOT)).relative_to(ROOT)
    try:
        pages = {
            "report-inspect.png": ("inspect", FIXTURES / "fsdp2_accelerate", "--summary"),
            "report-diff-finetune.png": ("diff", FIXTURES / "hf_trainer_lora" / "base",
                                         FIXTURES / "hf_trainer_lora" /
                                         "reference_fused.safetensors"),
        }
        export = work / "export"
        _fsdpckpt("export-hf", FIXTURES / "tiny_llama" / "untied" / "checkpoint-3", export,
                  "--dtype", "bf16")
        pages["report-diff-export.png"] = ("diff", FIXTURES / "tiny_llama" / "untied" /
                                           "checkpoint-3", export, "--rtol", "1e-2")
        for name, args in pages.items():
            page = work / f"{name}.html"
            _fsdpckpt(*args, "--html", page)
            browser.screenshot(ROOT / page, ROOT / "docs" / name, height=1400)
            print(f"wrote docs/{name}")
    finally:
        shutil.rmtree(ROOT / work, ignore_errors=True)


if __name__ == "__main__":
    main()
