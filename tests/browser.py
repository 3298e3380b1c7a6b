"""A page as a person sees it: opened in a real headless browser (Debian's ``chromium``,
which ``.ci/run`` installs), its document after its scripts ran, and a screenshot.

Used by tests/test_reports.py and by docs/make_screenshots.py (the screenshots in docs/ are
made by this same code). The browser runs with a throwaway profile, no network and, as the
test machine runs as root, no sandbox; every run has a deadline.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["chromium", "Element", "Rendered", "render", "screenshot"]

_TIMEOUT = 90


def chromium() -> str | None:
    """The browser's command, or None when none is installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def _run(page: Path, *flags: str, fragment: str = "") -> subprocess.CompletedProcess[str]:
    command = chromium()
    if command is None:
        raise RuntimeError("no chromium: apt-get install chromium (.ci/run does)")
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-browser-") as profile:
        return subprocess.run(
            [command, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--proxy-server=127.0.0.1:9", f"--user-data-dir={profile}", *flags,
             page.resolve().as_uri() + (f"#{fragment}" if fragment else "")],
            capture_output=True, text=True, timeout=_TIMEOUT, check=True)


@dataclass
class Element:
    """One element of the rendered document: its tag, attributes and text."""

    tag: str
    attrs: dict[str, str]
    text: str = ""


@dataclass
class Rendered:
    """The document after the page's scripts ran."""

    root: dict[str, str]  # the attributes of <html>
    elements: list[Element] = field(default_factory=list)

    def having(self, attribute: str, value: str | None = None) -> list[Element]:
        return [e for e in self.elements if attribute in e.attrs and
                (value is None or e.attrs[attribute] == value)]


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.result = Rendered({})
        self.open: list[Element] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        if tag == "html":
            self.result.root = element.attrs
        self.result.elements.append(element)
        if tag not in ("meta", "br", "img", "input", "link", "hr"):
            self.open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self.open:
            if self.open.pop().tag == tag:
                break

    def handle_data(self, data: str) -> None:
        for element in self.open:
            element.text += data


def render(page: Path, *, fragment: str = "") -> Rendered:
    """Open ``page`` in chromium; its document once loaded (``--dump-dom``), parsed.
    ``fragment``: the part of the address after ``#`` (``q=bias``: what the page reads)."""
    parser = _Parser()
    parser.feed(_run(page, "--dump-dom", fragment=fragment).stdout)
    return parser.result


def screenshot(page: Path, into: Path, *, width: int = 1280, height: int = 1600) -> Path:
    """A PNG of ``page`` as chromium draws it in a ``width`` x ``height`` window."""
    _run(page, f"--screenshot={into.resolve()}", f"--window-size={width},{height}",
         "--hide-scrollbars")
    return into
