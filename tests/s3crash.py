"""Every state a crash could leave on object storage, request by request.

An object store does each request whole (an object appears whole or not at all, a
multipart upload only when completed), in the order the requests reach it, and keeps what
it did: a client that dies leaves the store as the requests it sent so far made it. So the
crash states of a commit path on S3 are the prefixes of its requests that change the store
(``PUT``, ``POST``, ``DELETE``; a ``GET`` or ``HEAD`` changes nothing): for N of them, the
N + 1 states after 0, 1, ... N. A cut of the connection before request k + 1 and one after
request k (its answer lost, the client dead) leave the same store: one state per boundary.

:func:`explore` runs a program once through :class:`faultproxy.FaultProxy`, which records
each such request as it is sent (head and body), puts the store's folder back as it was
before (from a snapshot), and sends the recorded requests again, one at a time, straight to
the server; before the first and after each, the folder as it is then is copied into a
fresh one (on the server) for the caller's check, which may recover, sweep and restore as a
new process would. Requests in flight together are taken in the order they reached the
proxy; equal states (a deletion of what is gone) are checked once. Multipart uploads are
refused (their ID is the server's, picked anew on a replay): the programs here upload
small files, one PUT each.

:func:`cut_each` is the other half: a client that lives on. Every other request that
changes the store has its connection cut, in turn before it reaches the server
(``"cut"``) and after the server did it, its answer lost (``"lost"``); the next one (the
client's retry) passes. The program then finishes or fails, and the same check runs on
what it left.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from faultproxy import MUTATING, FaultProxy, send

__all__ = ["Exploration", "explore", "cut_each", "wipe"]

#: ``program(storage_options, report)``: the commit path, its store reached through the
#: options given; ``report(what)`` once it returned what its caller is told (a step saved).
Program = Callable[[dict, Callable[[str], None]], None]
#: ``check(folder, reported)``: the invariants' violations in ``folder`` (``bucket/path``, a
#: copy of the program's folder), ``reported`` what the program had reported by then.
Check = Callable[[str, list[str]], list[str]]


@dataclass
class Exploration:
    """What :func:`explore` went through: requests recorded, crash states (one after each
    request, and the start), distinct states checked, and the violations found."""

    requests: int = 0
    states: int = 0
    checked: int = 0
    violations: list[str] = field(default_factory=list)


def _objects(fs, root: str) -> dict[str, str]:
    """``{key under root: ETag}`` as the server holds them now."""
    fs.invalidate_cache()
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    return {key[len(root) + 1:]: str(info.get("ETag", info.get("size")))
            for key, info in found.items() if info.get("type") != "directory"}


def wipe(fs, root: str) -> None:
    """Nothing left under ``root``, folders included: SeaweedFS keeps a folder whose files
    were deleted (a later listing shows it as a subfolder), so they go too, deepest first."""
    for _pass in range(8):
        fs.invalidate_cache()
        found = [p for p in fs.find(root, withdirs=True) if p.rstrip("/") != root]
        if not found:
            return
        fs.rm(sorted(set(found), key=lambda p: -p.count("/")))
    raise AssertionError(f"{root}: still there after 8 passes")


def _restore(fs, root: str, snapshot: dict[str, bytes]) -> None:
    wipe(fs, root)
    for name, data in snapshot.items():
        fs.pipe_file(f"{root}/{name}", data)
    fs.invalidate_cache()


def _copy(fs, root: str, names: list[str], into: str) -> None:
    if names:
        fs.copy([f"{root}/{n}" for n in names], [f"{into}/{n}" for n in names])
    fs.invalidate_cache()


def _line(head: bytes) -> str:
    return head.split(b"\r\n", 1)[0].decode("latin-1").rsplit(" ", 1)[0]


def _record(proxy: FaultProxy, program: Program) -> tuple[list[list[bytes]], list[tuple[int, str]]]:
    reports: list[tuple[int, str]] = []
    proxy.recorded = []
    try:
        program(proxy.storage_options(),
                lambda what: reports.append((len(proxy.recorded or ()), what)))
    finally:
        recorded, proxy.recorded = proxy.recorded, None
    return recorded, reports


def explore(server, proxy: FaultProxy, root: str, program: Program, check: Check
            ) -> Exploration:
    """Every crash state of ``program``'s requests to the folder ``root`` (``bucket/path``,
    as it holds the program's start), checked by ``check``."""
    fs = server.filesystem()
    snapshot = {name: fs.cat_file(f"{root}/{name}") for name in _objects(fs, root)}
    recorded, reports = _record(proxy, program)
    _restore(fs, root, snapshot)
    result = Exploration(requests=len(recorded), states=len(recorded) + 1)
    seen: set[tuple[frozenset[tuple[str, str]], tuple[str, ...]]] = set()
    multipart = [_line(head) for head, _body, _answer in recorded if b"uploadId=" in head
                 or b"?uploads" in head.split(b"\r\n", 1)[0]]
    if multipart:
        raise AssertionError(f"a multipart upload cannot be replayed: {multipart[0]}")
    for k in range(len(recorded) + 1):
        if k:
            head, body, _answer = recorded[k - 1]
            send(server.endpoint, head, body)
        state = _objects(fs, root)
        reported = [what for at, what in reports if at <= k]
        # The same objects with the same reports: the same verdict, checked once.
        if (key := (frozenset(state.items()), tuple(reported))) in seen:
            continue
        seen.add(key)
        result.checked += 1
        copy = f"{root}-state{k:04d}"
        _copy(fs, root, sorted(state), copy)
        where = f"after request {k} ({_line(recorded[k - 1][0])})" if k else "at the start"
        result.violations += [f"{where}: {problem}" for problem in check(copy, reported)]
    return result


def cut_each(proxy: FaultProxy, root: str, program: Program, check: Check
             ) -> tuple[dict[str, int], list[str]]:
    """Run ``program`` with every other request that changes the store cut, in turn before
    and after the server did it; how many requests each kind of cut hit, and the violations
    ``check`` finds in what the program left (a program that fails is allowed: it reports
    nothing more)."""
    turn = itertools.count()
    proxy.fault(("cut", "lost"), when=lambda r: r.method in MUTATING and next(turn) % 2 == 0)
    reported: list[str] = []
    try:
        program(proxy.storage_options(), reported.append)
    except Exception:  # noqa: BLE001 - a commit that fails is allowed; what it left is checked
        pass
    finally:
        kinds = [mode for _request, mode in proxy.seen if mode]
        proxy.fault(None)
    return {m: kinds.count(m) for m in ("cut", "lost")}, check(root, reported)
