"""Every disk state a crash could leave, built from a real run's file-system operations.

ALICE (OSDI '14) and CrashMonkey (OSDI '18) in small: :func:`record` runs a commit path in a
subprocess under ``strace`` and keeps every operation on files under one root (torch's DCP
writer, fsdpckpt's own writes, threads and child processes alike); :func:`crash_states`
builds from that recording the disk states a power loss could leave, and materializes each
for the caller's invariants.

The crash model: ext4 in ``data=ordered`` mode, taken harshly.

- Folder operations (create, mkdir, rename, unlink, rmdir) reach the disk in order (ext4's
  journal); one is durable once its folder was fsynced after it, and then so is every one
  before it. Any later ones may be lost.
- File data survives where the file was fsynced after it was written. Unsynced data may be
  lost (the file cut back to what was synced) or, with the size kept, read as zeros.

For each prefix of the recording (a crash after every operation) it builds the harshest
states: every unsynced folder operation and every unsynced byte lost; only the last
folder operation lost; folder operations kept, unsynced data zeroed; nothing lost. Equal
states are checked once; :class:`Exploration` counts both. ``FSDPCKPT_CRASH_STATES=all`` (the
benchmark machine's longer mode) takes every prefix of the unsynced folder operations instead,
each with unsynced data lost, zeroed and kept.

Out of reach: file systems that reorder more than ext4's journal allows (a later rename
durable without an earlier one), and writes through ``mmap``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

_CALLS = ("openat,open,creat,write,pwrite64,writev,pwritev,pwritev2,lseek,ftruncate,fsync,"
          "fdatasync,rename,renameat,renameat2,unlink,unlinkat,mkdir,mkdirat,rmdir,"
          "sendfile,copy_file_range,close,io_submit,link,linkat,symlink,symlinkat")
_LINE = re.compile(r"^(\d+) +(\w+)\((.*)\) += (-?\d+)(?:<(.*)>)?")
_FD = re.compile(r"^(-?\d+|AT_FDCWD)(?:<(.*)>)?$")
#: What :func:`report` opens (and fails to: nothing is there) to mark a moment in the trace.
_MARK = "/crashsim-reported/"


def report(what: str, root: Path) -> str:
    """Code for a recorded program: mark in the trace that it reported ``what`` (a step
    committed, an output written) of the files under ``root``, for the invariants of the
    states after that moment."""
    mark = f"{_MARK}{_tag(str(root))}/{what}"
    return f"import os\ntry:\n    os.open({mark!r}, os.O_RDONLY)\nexcept OSError:\n    pass\n"


def _tag(root: str) -> str:
    return hashlib.sha256(root.encode()).hexdigest()[:12]


@dataclass
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    #: (operation index, offset, length) of every write, and of every fsync (-1, -1).
    events: list[tuple[int, int, int]] = field(default_factory=list)
    preexisting: bool = False


@dataclass
class Op:
    """One recorded operation: ``kind`` is a folder operation (``mkdir``, ``create``,
    ``rename``, ``exchange``, ``unlink``, ``rmdir``), ``write``, ``truncate`` or ``fsync``."""

    kind: str
    path: str
    other: str = ""
    inode: int = -1
    offset: int = 0
    length: int = 0


def _split_args(text: str) -> list[str]:
    """strace's argument list split at top-level commas (strings, brackets kept whole)."""
    args, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "[{<(":
            depth += 1
        elif c in "]}>)":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    args.append(text[start:].strip())
    return args


def _string(arg: str) -> str:
    value = arg.split('"', 1)[1].rsplit('"', 1)[0]
    return value.encode("latin-1").decode("unicode_escape")


def _fd(arg: str) -> tuple[str, str]:
    match = _FD.match(arg)
    if not match:
        raise ValueError(f"not a descriptor: {arg}")
    return match.group(1), match.group(2) or ""


class Recording:
    """The operations on files under ``root`` of one run, as :func:`record` parsed them."""

    def __init__(self, root: Path, cwd: Path) -> None:
        self.root, self.cwd = str(root), cwd
        self.ops: list[Op] = []
        self.inodes: list[_Inode] = []
        self.names: dict[str, int] = {}  # path -> inode (-1: a folder), live during parsing
        self.initial: dict[str, int] = {}
        self._pos: dict[tuple[str, str], int] = {}
        self._pending: dict[str, str] = {}

    def _mine(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + "/")

    def _abs(self, path: str, base: str = "") -> str:
        if path.startswith("/"):
            return os.path.normpath(path)
        return os.path.normpath(os.path.join(base or str(self.cwd), path))

    def snapshot(self) -> None:
        for folder, dirs, files in os.walk(self.root):
            self.names[folder] = -1
            for name in files:
                path = os.path.join(folder, name)
                self.inodes.append(_Inode(bytearray(Path(path).read_bytes()), preexisting=True))
                self.names[path] = len(self.inodes) - 1
            dirs.sort()
        self.initial = dict(self.names)

    # -- the namespace, replayed as the run changed it ------------------------------------

    def _move(self, src: str, dst: str) -> None:
        moved = {p: i for p, i in self.names.items() if p == src or p.startswith(src + "/")}
        for p in [p for p in self.names if p == dst or p.startswith(dst + "/")]:
            del self.names[p]
        for p, i in moved.items():
            del self.names[p]
            self.names[dst + p[len(src):]] = i

    def _namespace(self, op: Op) -> None:
        if op.kind == "mkdir":
            self.names[op.path] = -1
        elif op.kind == "create":
            self.names[op.path] = op.inode
        elif op.kind in ("unlink", "rmdir"):
            self.names.pop(op.path, None)
        elif op.kind == "rename":
            self._move(op.path, op.other)
        elif op.kind == "exchange":
            self._move(op.path, op.path + "\0swap")
            self._move(op.other, op.path)
            self._move(op.path + "\0swap", op.other)

    def _add(self, op: Op) -> None:
        if op.kind in ("write", "fsync") and op.inode >= 0:
            self.inodes[op.inode].events.append(
                (len(self.ops), op.offset, op.length) if op.kind == "write" else
                (len(self.ops), -1, -1))
        self.ops.append(op)
        self._namespace(op)

    def _inode_of(self, path: str) -> int:
        found = self.names.get(path)
        if found is None:  # opened before the snapshot's view (outside our replay): a new one
            self.inodes.append(_Inode())
            found = self.names[path] = len(self.inodes) - 1
        return found

    # -- strace's lines -------------------------------------------------------------------

    def parse(self, text: str) -> None:
        for raw in text.splitlines():
            pid = raw.split(" ", 1)[0]
            if raw.endswith("<unfinished ...>"):
                self._pending[pid] = raw[: -len("<unfinished ...>")].rstrip()
                continue
            resumed = re.match(r"^(\d+) +<\.\.\. \w+ resumed>(.*)$", raw)
            if resumed:
                raw = self._pending.pop(resumed.group(1), "") + resumed.group(2)
            match = _LINE.match(raw)
            if match and match.group(2) in ("openat", "open") and _MARK in raw:
                tag, _, what = raw.split(_MARK, 1)[1].split('"', 1)[0].partition("/")
                if tag == _tag(self.root):  # another root's mark is no moment of this one
                    self.ops.append(Op("mark", what))
                continue
            if match and int(match.group(4)) >= 0:
                self._call(match.group(2), _split_args(match.group(3)), int(match.group(4)),
                           match.group(5) or "")

    def _call(self, name: str, args: list[str], result: int, result_path: str) -> None:
        if name in ("openat", "open", "creat"):
            base = _fd(args[0])[1] if name == "openat" else ""
            path = self._abs(_string(args[1 if name == "openat" else 0]), base)
            flags = args[2 if name == "openat" else 1] if name != "creat" else "O_CREAT|O_TRUNC"
            path = os.path.normpath(result_path) if result_path else path
            if not self._mine(path) or "O_DIRECTORY" in flags:
                return
            if path not in self.names:
                if "O_CREAT" not in flags:
                    return
                self.inodes.append(_Inode())
                self._add(Op("create", path, inode=len(self.inodes) - 1))
            inode = self.names[path]
            if inode < 0:
                return  # a folder opened (to fsync it)
            if "O_TRUNC" in flags and self.inodes[inode].data:
                self._add(Op("truncate", path, inode=inode, length=0))
            self._pos[(str(result), path)] = len(self.inodes[inode].data) \
                if "O_APPEND" in flags else 0
            return
        if name in ("mkdir", "mkdirat"):
            base = _fd(args[0])[1] if name == "mkdirat" else ""
            path = self._abs(_string(args[1 if name == "mkdirat" else 0]), base)
            if self._mine(path):
                self._add(Op("mkdir", path))
            return
        if name in ("rename", "renameat", "renameat2"):
            if name == "rename":
                src, dst = self._abs(_string(args[0])), self._abs(_string(args[1]))
            else:
                src = self._abs(_string(args[1]), _fd(args[0])[1])
                dst = self._abs(_string(args[3]), _fd(args[2])[1])
            exchange = name == "renameat2" and "RENAME_EXCHANGE" in args[4]
            if self._mine(src) or self._mine(dst):
                self._add(Op("exchange" if exchange else "rename", src, dst))
            return
        if name in ("unlink", "unlinkat", "rmdir"):
            base = _fd(args[0])[1] if name == "unlinkat" else ""
            path = self._abs(_string(args[1 if name == "unlinkat" else 0]), base)
            folder = name == "rmdir" or (name == "unlinkat" and "AT_REMOVEDIR" in args[2])
            if self._mine(path):
                self._add(Op("rmdir" if folder else "unlink", path))
            return
        if name in ("link", "linkat", "symlink", "symlinkat", "io_submit"):
            involved = " ".join(args)
            if self.root in involved:
                raise NotImplementedError(f"{name} under the root is not modelled: {args}")
            return
        # Descriptor calls: the first descriptor argument names the file (strace -y).
        fd_arg = args[2] if name == "copy_file_range" else args[0]
        fd, path = _fd(fd_arg)
        path = path.removesuffix(" (deleted)")
        if not self._mine(path):
            return
        inode = self._inode_of(path)
        if inode < 0:  # a folder
            if name in ("fsync", "fdatasync"):
                self._add(Op("fsync", path))
            return
        key = (fd, path)
        if name in ("fsync", "fdatasync"):
            self._add(Op("fsync", path, inode=inode))
        elif name == "lseek":
            self._pos[key] = result
        elif name == "ftruncate":
            self._add(Op("truncate", path, inode=inode, length=int(args[1])))
        elif name in ("write", "writev", "sendfile") or (
                name == "copy_file_range" and args[3] == "NULL"):
            offset = self._pos.get(key, 0)
            self._add(Op("write", path, inode=inode, offset=offset, length=result))
            self._pos[key] = offset + result
        elif name in ("pwrite64", "pwritev", "pwritev2"):
            offset = int(args[3])
            self._add(Op("write", path, inode=inode, offset=offset, length=result))
        elif name == "copy_file_range":
            offset = int(args[3].strip("[]"))
            self._add(Op("write", path, inode=inode, offset=offset, length=result))

    def finish(self) -> None:
        """Read each surviving file's final bytes; check the replay against the real tree."""
        real = {}
        for folder, _dirs, files in os.walk(self.root):
            real[folder] = -1
            for name in files:
                real[os.path.join(folder, name)] = 0
        replayed = {p: (-1 if i < 0 else 0) for p, i in self.names.items()}
        if replayed != real:
            raise AssertionError("the replayed namespace is not the real one: "
                                 f"{sorted(set(replayed) ^ set(real))}")
        for path, inode in self.names.items():
            if inode >= 0 and not self.inodes[inode].preexisting:
                self.inodes[inode].data = bytearray(Path(path).read_bytes())


def record(code: str, root: Path, *, cwd: Path, timeout: float = 300) -> Recording:
    """Run ``code`` (a Python program) under strace; the operations on files under
    ``root`` (whose present contents are taken as durable)."""
    return record_all(code, [root], cwd=cwd, timeout=timeout)[0]


def record_all(code: str, roots: list[Path], *, cwd: Path,
               timeout: float = 300) -> list[Recording]:
    """:func:`record` of one program for several roots (one run, one trace: a program that
    goes through several commit paths, each in its own root, pays for one start)."""
    recordings = [Recording(root, cwd) for root in roots]
    for recording in recordings:
        recording.snapshot()
    trace = cwd / "strace.txt"
    # --seccomp-bpf: the calls not traced cost nothing (a run takes 1.1x, not 1.7x).
    run = subprocess.run(["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-s", "0",
                          "-e", f"trace={_CALLS}", "-o", str(trace), sys.executable, "-c", code],
                         cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise AssertionError(f"the recorded run failed:\n{run.stderr[-3000:]}")
    text = trace.read_text(errors="replace")
    for recording in recordings:
        recording.parse(text)
        recording.finish()
    return recordings


# -- crash states -------------------------------------------------------------------------


@dataclass
class Exploration:
    """What :func:`explore` went through: operations, states built, distinct states checked."""

    operations: int = 0
    states: int = 0
    checked: int = 0
    violations: list[str] = field(default_factory=list)


def _parent(path: str) -> str:
    return os.path.dirname(path)


def _durable_upto(ops: list[Op], k: int) -> int:
    """The index of the last folder operation in ``ops[:k]`` made durable by an fsync of its
    folder (or folders) within ``ops[:k]``; -1 if none."""
    synced_after: dict[str, int] = {}
    for i in range(k):
        if ops[i].kind == "fsync" and ops[i].inode < 0:
            synced_after[ops[i].path] = i
    last = -1
    for i in range(k):
        op = ops[i]
        if op.kind in ("mkdir", "create", "unlink", "rmdir", "rename", "exchange"):
            # A rename is one journal transaction: durable once the folder it names the
            # file in is fsynced (an exchange names both).
            folders = {_parent(op.other)} if op.kind == "rename" else \
                {_parent(op.path)} | ({_parent(op.other)} if op.other else set())
            if all(synced_after.get(f, -1) > i for f in folders):
                last = i
    return last


def _content(inode: _Inode, k: int, mode: str, truncations: list[tuple[int, int]]) -> bytes:
    """The inode's bytes after a crash following operation ``k - 1``: ``kept`` (everything
    written), ``zeroed`` (unsynced bytes read as zeros, size kept), ``lost`` (cut back to
    what was synced)."""
    if inode.preexisting and not inode.events and not truncations:
        return bytes(inode.data)
    size, written, synced_until = 0, [], -1
    base = bytes(inode.data) if inode.preexisting else b""
    size = len(base)
    for index, length in truncations:  # ftruncate to a size (O_TRUNC: 0); unsynced kept
        if index < k:
            size = length
    for index, offset, length in inode.events:
        if index >= k:
            break
        if offset < 0:
            synced_until = index
        else:
            written.append((index, offset, length))
            size = max(size, offset + length)
    out = bytearray(base[:size].ljust(size, b"\0"))
    synced_end = len(base)
    for index, offset, length in written:
        synced = index < synced_until
        if synced:
            synced_end = max(synced_end, offset + length)
        if mode == "kept" or synced:
            out[offset:offset + length] = inode.data[offset:offset + length].ljust(length, b"\0")
        else:
            out[offset:offset + length] = b"\0" * length
    if mode == "lost":
        return bytes(out[:synced_end])
    return bytes(out)


def _states(rec: Recording, k: int,
            thorough: bool = False) -> Iterator[tuple[str, dict[str, bytes | None]]]:
    ops = rec.ops
    folder_ops = [i for i in range(k) if ops[i].kind in
                  ("mkdir", "create", "unlink", "rmdir", "rename", "exchange")]
    durable = _durable_upto(ops, k)
    truncations: dict[int, list[tuple[int, int]]] = {}
    for i in range(k):
        if ops[i].kind == "truncate":
            truncations.setdefault(ops[i].inode, []).append((i, ops[i].length))
    plans = [("all unsynced lost", durable, "lost"),
             ("the last folder operation lost", folder_ops[-1] - 1 if folder_ops else -1,
              "kept"),
             ("unsynced data zeroed", k - 1, "zeroed"),
             ("nothing lost", k - 1, "kept")]
    if thorough:  # every prefix of the unsynced folder operations, with each kind of data
        cuts = [durable] + [j for j in folder_ops if j > durable]
        plans = [(f"folder operations to {cut} kept, data {mode}", cut, mode)
                 for cut in cuts for mode in ("lost", "zeroed", "kept")]
    for name, upto, mode in plans:
        upto = max(upto, durable)
        rec.names = dict(rec.initial)
        for i in range(upto + 1):
            rec._namespace(ops[i])
        tree: dict[str, bytes | None] = {}
        for path, inode in rec.names.items():
            tree[path] = None if inode < 0 else _content(rec.inodes[inode], k, mode,
                                                         truncations.get(inode, []))
        yield name, tree


def materialize(tree: dict[str, bytes | None], root: str, into: Path) -> Path:
    """Write ``tree`` (paths under ``root``) under ``into``; the copy of ``root``."""
    if into.exists():
        shutil.rmtree(into)
    for path in sorted(tree):
        target = into / os.path.relpath(path, root)
        data = tree[path]
        if data is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return into / "."


def explore(rec: Recording, check: Callable[[Path, list[str]], list[str]], workdir: Path,
            *, stride: int = 1, thorough: bool | None = None) -> Exploration:
    """Build the crash states after every ``stride``-th operation (and after the last),
    materialize each distinct one in ``workdir`` and collect the violations
    ``check(copy_of_root, reported)`` finds (``reported``: what the program had reported,
    by :func:`report`, before the crash).

    ``thorough`` (default: the environment's ``FSDPCKPT_CRASH_STATES=all``, the benchmark
    machine's longer mode): instead of the four harshest states of each prefix, every prefix
    of its unsynced folder operations, each with unsynced data lost, zeroed and kept."""
    if thorough is None:
        thorough = os.environ.get("FSDPCKPT_CRASH_STATES") == "all"
    result = Exploration(operations=len(rec.ops))
    seen: set[str] = set()
    points = sorted(set(range(0, len(rec.ops) + 1, stride)) | {len(rec.ops)})
    for k in points:
        for name, tree in _states(rec, k, thorough):
            result.states += 1
            digest = hashlib.sha256()
            for path in sorted(tree):
                data = tree[path]
                digest.update(path.encode() + b"\0" + (b"D" if data is None else
                                                       hashlib.sha256(data).digest()))
            reported = [op.path for op in rec.ops[:k] if op.kind == "mark"]
            digest.update(repr(reported).encode())
            key = digest.hexdigest()
            if key in seen:
                continue
            seen.add(key)
            result.checked += 1
            label = f"crash after operation {k} of {len(rec.ops)} ({name})"
            copy = materialize(tree, rec.root, workdir / "state")
            result.violations += [f"{label}: {v}" for v in check(copy, reported)]
    return result
