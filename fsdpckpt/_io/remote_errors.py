"""Object-storage faults: bounded in time, and each one error naming the URL.

Two pieces of the remote seam (:func:`fsdpckpt._io.remote.location` uses both):

- :func:`bounded_options`: the options a filesystem is built with, fsdpckpt's timeouts and
  retry limits under whatever the user passed (``--storage-options`` / ``storage_options=``
  win, key by key). For S3 (s3fs over botocore): connect timeout 10 s, read timeout 30 s,
  two attempts per request (botocore's ``standard`` retry mode) and no second round of
  retries in s3fs, so an endpoint that accepts connections and never answers costs at most
  about a minute, not botocore's 60 s read timeout times its retries times s3fs's.
- :class:`GuardedFS`: the filesystem, every call of which (and of the file objects it
  opens) turns what the backends raise on a fault (botocore's ``ReadTimeoutError``,
  ``ConnectionClosedError``, ``EndpointConnectionError``, a 5xx ``ClientError``, aiohttp's
  errors, fsspec's ``FSTimeoutError``, s3fs's bare ``OSError``...) into
  :class:`~fsdpckpt.errors.RemoteStorageError` or
  :class:`~fsdpckpt.errors.RemoteTimeoutError`, one line naming the URL and the fix.
  "Not there" (``FileNotFoundError``) and the other errors that answer a question
  (``PermissionError``, ``FileExistsError``...) pass through unchanged.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from fsdpckpt.errors import FsdpCkptError, RemoteStorageError, RemoteTimeoutError

__all__ = ["DEFAULTS", "GuardedFS", "bounded_options", "remote_error"]

#: fsdpckpt's defaults per scheme, under the user's options.
DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {
        "config_kwargs": {
            "connect_timeout": 10,
            "read_timeout": 30,
            "retries": {"total_max_attempts": 2, "mode": "standard"},
        },
        "retries": 1,  # s3fs's own retry loop around each call: one try, botocore retries
    },
}
DEFAULTS["s3a"] = DEFAULTS["s3"]

#: The packages whose exceptions are network or service faults when a call raises them.
_BACKENDS = (
    "botocore",
    "aiobotocore",
    "aiohttp",
    "s3fs",
    "fsspec",
    "gcsfs",
    "adlfs",
    "azure",
    "google",
    "urllib3",
    "http",
    "requests",
    "asyncio",
    "ssl",
)
#: Errors that answer the question asked: they pass through as they are.
_ANSWERS = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    FsdpCkptError,
)
# Said with the flag: tests/test_remote_faults.py pins "--storage-options" on the command
# line's message, and _cli_common.FLAGS has no "storage_options=" to say it there yet.
_FIX = (
    "check the endpoint (endpoint_url in storage_options=, AWS_ENDPOINT_URL); "
    "raise the timeouts or retries through storage_options= (docs/remote.md)"
)
#: What a filesystem call was doing, for the message.
_ACTIONS = {
    "ls": "listing it",
    "find": "listing it",
    "glob": "listing it",
    "walk": "listing it",
    "info": "looking it up",
    "exists": "looking it up",
    "isfile": "looking it up",
    "isdir": "looking it up",
    "cat_file": "reading it",
    "cat": "reading it",
    "open": "opening it",
    "get_file": "downloading it",
    "pipe_file": "uploading it",
    "put_file": "uploading it",
    "pipe": "uploading it",
    "put": "uploading it",
    "rm": "deleting it",
    "rm_file": "deleting it",
    "mkdir": "creating it",
    "makedirs": "creating it",
}
#: At most this many characters of the backend's own message.
_DETAIL = 160


def bounded_options(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over fsdpckpt's defaults for ``scheme``: a user's key replaces ours, and
    within ``config_kwargs`` key by key (a user's ``retries`` dict replaces ours whole)."""
    defaults = copy.deepcopy(DEFAULTS.get(scheme.lower(), {}))
    merged = {**defaults, **options}
    for key in ("config_kwargs",):
        if isinstance(defaults.get(key), dict) and isinstance(options.get(key), dict):
            merged[key] = {**defaults[key], **options[key]}
    return merged


def _is_timeout(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if isinstance(current, TimeoutError) or "Timeout" in name:
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_fault(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    module = type(exc).__module__.split(".", 1)[0]
    return module in _BACKENDS


def remote_error(exc: BaseException, url: str, action: str) -> BaseException:
    """The fsdpckpt error for ``exc`` raised while ``action`` on ``url``; ``exc`` itself
    when it is no storage fault (an answer such as "not there", or a bug)."""
    if isinstance(exc, _ANSWERS) or not _is_fault(exc):
        return exc
    detail = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(detail) > _DETAIL:
        detail = detail[: _DETAIL - 3] + "..."
    if _is_timeout(exc):
        return RemoteTimeoutError(
            f"{url}: the object store did not answer in time while {action} ({detail}); {_FIX}"
        )
    return RemoteStorageError(f"{url}: the object store failed while {action} ({detail}); {_FIX}")


class GuardedFS:
    """An fsspec filesystem whose calls raise fsdpckpt's errors on a storage fault.

    Attributes and calls go to the wrapped filesystem (``fs``); a call's first argument,
    when a string, is the object it is about (named in the error, with ``prefix``).
    """

    def __init__(self, fs: Any, prefix: str) -> None:
        self.fs, self.prefix = fs, prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        @functools.wraps(attr)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                result = attr(*args, **kwargs)
            except Exception as exc:
                where = self._url(args, name)
                mapped = remote_error(exc, where, _ACTIONS.get(name, f"calling {name}"))
                if mapped is exc:
                    raise
                raise mapped from exc
            if name == "open":
                return _GuardedFile(result, self._url(args))
            return result

        return guarded

    def _url(self, args: tuple[Any, ...], name: str = "") -> str:
        at = 1 if name in ("put_file", "put") else 0  # (local path, remote path)
        path = args[at] if len(args) > at and isinstance(args[at], str) else ""
        return path if "://" in path else self.prefix + path


_VERBS = {
    "read": "reading it",
    "readinto": "reading it",
    "write": "writing it",
    "flush": "uploading it",
    "close": "uploading it",
    "__exit__": "uploading it",
    "commit": "uploading it",
    "seek": "reading it",
    "discard": "discarding it",
}


class _GuardedFile:
    """A file object of a :class:`GuardedFS`: its reads, writes and close map faults too."""

    def __init__(self, file: Any, url: str) -> None:
        self._file, self._url = file, url

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._file, name)(*args, **kwargs)
        except Exception as exc:
            mapped = remote_error(exc, self._url, _VERBS.get(name, name))
            if mapped is exc:
                raise
            raise mapped from exc

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._file, name)
        if callable(attr) and name in (
            "read",
            "readinto",
            "write",
            "flush",
            "close",
            "seek",
            "commit",
            "discard",
        ):
            return functools.partial(self._call, name)
        return attr

    def __enter__(self) -> _GuardedFile:
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._call("__exit__", *exc)

    def __iter__(self) -> Any:
        return iter(self._file)
