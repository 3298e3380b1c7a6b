"""The model class's answer (:class:`~fsdpckpt.export._model.ModelExpectation`) kept on disk,
so that only the first export of a config pays for importing transformers.

Users export one run's checkpoints one after another (checkpoint-500, -1000, ...), each with
the same ``config.json``; building its class on the meta device costs seconds of importing
transformers and the model's code every time, and gives the same answer every time. So the
answer is written once, as JSON, under a key that names everything it depends on: this
file's format, fsdpckpt's, transformers' and torch's versions (read from the installed
packages' metadata, no import) and the exported config, but for its ``dtype`` field, which
the export sets after planning and which changes no key, shape or tie on the meta device.

Where: ``$FSDPCKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fsdpckpt``, else
``~/.cache/fsdpckpt``; one file ``expectations/<sha256>.json`` per key. Off with
``FSDPCKPT_NO_CACHE=1`` or ``FSDPCKPT_CACHE_DIR=""``. A config naming custom code
(:func:`~fsdpckpt.export._keycheck.custom_code`) is never kept nor read: its answer is its
code's, which the key does not name.

A file is trusted only whole and exactly as written: at most :data:`MAX_BYTES`, JSON (never
pickle) of the expected types, its own key and a SHA-256 of its content inside, every shape
a tuple of non-negative integers, every tied name and cut piece naming a key of the state
dict within its bounds. Anything else is a miss: the class is built and the file replaced.
Writing is a temporary file renamed into place, so a reader sees a whole file or none; a
cache that cannot be written (a read-only home, a full disk) is no cache, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._version import __version__
from fsdpckpt.export._keycheck import custom_code
from fsdpckpt.export._model import ModelExpectation
from fsdpckpt.export._moe import Piece

__all__ = ["MAX_BYTES", "OFF", "WHERE", "cache_dir", "recall", "remember"]

#: Bumped whenever what the file holds, or what the class's answer means, changes.
FORMAT = 1
#: The largest file read: a dense model takes tens of KB; a MoE model's per-expert pieces
#: (some 50,000 for the largest open models) some 10 MB.
MAX_BYTES = 32 << 20
#: The environment variable that turns the cache off (any value but empty or ``0``).
OFF = "FSDPCKPT_NO_CACHE"
#: The environment variable naming the cache folder (empty: no cache).
WHERE = "FSDPCKPT_CACHE_DIR"
_FOLDER = "expectations"
#: The largest dimension or offset taken as one (a tensor's size is an int64 in torch).
_MAX_INT = 2**63 - 1


def cache_dir() -> Path | None:
    """The cache folder (not created here); None when the cache is off or no home is known."""
    if os.environ.get(OFF, "") not in ("", "0"):
        return None
    chosen = os.environ.get(WHERE)
    if chosen is not None:
        return Path(chosen) if chosen else None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative path is ignored
        return Path(xdg) / "fsdpckpt"
    try:
        return Path.home() / ".cache" / "fsdpckpt"
    except RuntimeError:  # no $HOME and no password entry
        return None


def _key(config: dict[str, Any]) -> str | None:
    # The file name for ``config``'s answer; None when it is not to be kept (custom code,
    # transformers not installed, a config JSON cannot say canonically).
    if custom_code(config):
        return None
    from importlib import metadata  # some 30 ms: only where the cache is asked

    try:
        versions = [metadata.version("transformers"), metadata.version("torch")]
    except Exception:  # noqa: BLE001  not installed, or metadata unreadable: no cache
        return None
    identity = {k: v for k, v in config.items() if k != "dtype"}
    try:
        text = json.dumps([FORMAT, __version__, versions, identity], sort_keys=True,
                          separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _file(config: dict[str, Any]) -> tuple[str, Path] | None:
    folder = cache_dir()
    key = _key(config) if folder is not None else None
    return None if folder is None or key is None else (key, folder / _FOLDER / f"{key}.json")


def recall(config: dict[str, Any]) -> ModelExpectation | None:
    """The class's answer an earlier export of ``config`` kept; None on any miss.

    Args:
        config: the exported config (its ``dtype`` field, the only one the export sets after
            planning, is left out of the key, so any value may stand there).

    Returns:
        The expectation, exactly as :func:`~fsdpckpt.export._model.expect_model` gave it; None
        when the cache is off, the config names custom code, no file is kept for it, or the
        file is not one this module wrote (damaged, edited, another format).
    """
    found = _file(config)
    if found is None:
        return None
    key, path = found
    try:
        with open(path, "rb", opener=_no_block) as handle:
            info = os.fstat(handle.fileno())
            # Another user's file is not trusted: in a shared cache folder anyone could write
            # the answer that lets a wrong checkpoint pass the key check.
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES or \
                    info.st_uid != os.getuid():
                return None
            data = handle.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            return None
        return _decode(parse_json(data), key)
    except (OSError, ValueError):
        return None


def remember(config: dict[str, Any], answer: ModelExpectation | str) -> ModelExpectation | str:
    """Keep ``answer`` for ``config`` (an expectation, not a reason why there is none) and
    give it back. Nothing is raised: a cache that cannot be written is left unwritten.

    Args:
        config: the exported config the class was built from.
        answer: what :func:`~fsdpckpt.export._model.expect_model` gave.
    """
    found = _file(config) if isinstance(answer, ModelExpectation) else None
    if found is None or not isinstance(answer, ModelExpectation):
        return answer
    key, path = found
    data = json.dumps(_encode(answer, key), separators=(",", ":")).encode()
    if len(data) > MAX_BYTES:
        return answer
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)  # another export writing the same key writes the same bytes
        tmp = None
    except OSError:  # read-only, full, not a folder: the export goes on without the cache
        pass
    finally:
        with contextlib.suppress(OSError):
            if tmp is not None:
                os.unlink(tmp)
    return answer


def _no_block(path: str, flags: int) -> int:
    # A FIFO (or a device) put where the file should be must not hang the export.
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def _body(expect: ModelExpectation, key: str) -> dict[str, Any]:
    saved: Any = expect.saved if isinstance(expect.saved, str) else {
        source: [[p.name, p.source, list(p.offsets), list(p.sizes), list(p.shape), p.whole]
                 for p in pieces] for source, pieces in expect.saved.items()}
    return {"format": FORMAT, "key": key, "model_class": expect.model_class,
            "shapes": {name: list(shape) for name, shape in expect.shapes.items()},
            "tied": dict(expect.tied), "saved": saved}


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _encode(expect: ModelExpectation, key: str) -> dict[str, Any]:
    body = _body(expect, key)
    return {**body, "sha256": _digest(body)}


def _decode(doc: Any, key: str) -> ModelExpectation | None:
    # The expectation ``doc`` holds, or None unless every part is as _encode writes it.
    if not isinstance(doc, dict) or set(doc) != {"format", "key", "model_class", "shapes",
                                                 "tied", "saved", "sha256"}:
        return None
    body = {k: v for k, v in doc.items() if k != "sha256"}
    if type(doc["format"]) is not int or doc["format"] != FORMAT or doc["key"] != key \
            or doc["sha256"] != _digest(body):
        return None
    model_class, shapes, tied, saved = (doc["model_class"], doc["shapes"], doc["tied"],
                                        doc["saved"])
    if not isinstance(model_class, str) or not model_class or not isinstance(shapes, dict) \
            or not isinstance(tied, dict) or not isinstance(saved, (str, dict)):
        return None
    if not all(_is_shape(shape) for shape in shapes.values()):
        return None
    shaped = {name: tuple(shape) for name, shape in shapes.items()}
    if not all(isinstance(t, str) and isinstance(s, str) and t != s and t in shaped
               and s in shaped for t, s in tied.items()):
        return None
    cut: dict[str, tuple[Piece, ...]] = {}
    if isinstance(saved, dict):
        if set(saved) != set(shaped):  # saved_layout answers for every key of the state dict
            return None
        for source, pieces in saved.items():
            found = [_piece(p, source, shaped[source]) for p in pieces] \
                if isinstance(pieces, list) and pieces else [None]
            cut[source] = tuple(p for p in found if p is not None)
            if len(cut[source]) != len(found):
                return None
    expect = ModelExpectation(model_class, shaped, dict(tied),
                              saved if isinstance(saved, str) else cut)
    # What was read is what this answer writes: nothing more, nothing reinterpreted.
    return expect if _body(expect, key) == body else None


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(n) is int and 0 <= n <= _MAX_INT for n in value)


def _piece(value: Any, source: str, root: tuple[int, ...]) -> Piece | None:
    # One piece of ``source`` (of shape ``root``), as saved_layout cuts it: a box within it.
    if not isinstance(value, list) or len(value) != 6:
        return None
    name, of, offsets, sizes, shape, whole = value
    if not isinstance(name, str) or of != source or type(whole) is not bool \
            or not all(_is_shape(v) for v in (offsets, sizes, shape)):
        return None
    if len(offsets) != len(root) or len(sizes) != len(root) \
            or any(o + s > n for o, s, n in zip(offsets, sizes, root)) \
            or math.prod(sizes) != math.prod(shape):
        return None
    if whole and (any(offsets) or sizes != list(root)):
        return None
    return Piece(name, source, tuple(offsets), tuple(sizes), tuple(shape), whole)
