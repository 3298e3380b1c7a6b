"""Unpickling with an allowlist, resolving torch's globals to light stand-ins.

Checkpoints come from elsewhere, and ``pickle.load`` on a file from elsewhere
runs whatever the file asks for. The unpickler here admits only the globals a
legitimate file of each kind contains, and maps each one to a harmless value of
fsdpckpt's own, so reading metadata never imports torch and never executes code
from the file. Anything else stops the load with :class:`UnsafePickleError`
naming the file and the global (and, for a torch name it does not know, saying that a
newer torch may have written the file). The tables of what each kind of file may name
are in :mod:`fsdpckpt.dcp._allowlist`.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from fsdpckpt import _torch
from fsdpckpt.dcp._allowlist import (
    BUILTIN_GLOBALS,
    METADATA_GLOBALS,
    Record,
    _Refusal,
    brief,
    cap,
)
from fsdpckpt.dcp._pickle_scan import _Unwalkable, scan
from fsdpckpt.dcp._pickle_walk import walk
from fsdpckpt.errors import FsdpCkptError, NotACheckpointError, UnsafePickleError

__all__ = [
    "walked",
    "check_legacy_pickles",
    "check_pickle",
    "Record",
    "RestrictedUnpickler",
    "safe_loads",
    "refuse_global",
    "refusal",
    "unreadable",
    "METADATA_GLOBALS",
    "BUILTIN_GLOBALS",
    "brief",
]


def refuse_global(source: str, module: Any, name: Any) -> NoReturn:
    """Refuse a global outside the allowlist: as a newer torch's name, or as hostile."""
    named = cap(f"{module}.{name}", 120)
    if isinstance(module, str) and _torch.is_torch_global(module):
        # A torch name fsdpckpt does not know is most likely a class a newer torch
        # added or renamed; saying "hostile" would send the user the wrong way.
        raise UnsafePickleError(
            f"{source}: refusing to load the global {named!r}, a torch name "
            "fsdpckpt does not know. Written by a newer torch? fsdpckpt knows "
            f"torch's checkpoint classes up to torch {_torch.KNOWN_TORCH}; upgrade "
            "fsdpckpt. Nothing was executed. If the file did not come from a newer "
            "torch, do not trust it."
        ) from None
    raise UnsafePickleError(
        f"{source}: refusing to load the global {named!r}, "
        "which a file of this kind never contains; the file may be hostile. Nothing "
        "was executed. Only load it with plain pickle if you trust where it came from."
    ) from None


def refusal(source: str, what: str, opcode: str) -> UnsafePickleError:
    """The error for a state-setting ``opcode`` aimed at ``what``, which it may not change."""
    return UnsafePickleError(
        f"{source}: refusing a pickle that changes {what} ({opcode}); no file of "
        "this kind does that, and it could change how later files are read. The file "
        "may be hostile; nothing was changed. Use an intact copy of the checkpoint.")


def unreadable(source: str, where: int, size: int, exc: BaseException) -> NotACheckpointError:
    """The error for bytes that are not a readable pickle, failing at byte ``where``."""
    return NotACheckpointError(
        f"{source}: not a readable pickle of the expected kind (at byte {where} of "
        f"{size}: {type(exc).__name__}: {cap(str(exc), 200)})")


def _own_setstate(cls: type) -> Any:
    """The ``__setstate__`` a class defines or inherits, never its metaclass's (a
    :class:`~fsdpckpt.dcp._allowlist.Sealed` class's metaclass refuses for the class itself)."""
    for klass in cls.__mro__:
        method = klass.__dict__.get("__setstate__")
        if method is not None:
            return method
    return None


# pickle's pure-Python unpickler (from the compat module): its opcode methods are what this
# class reuses.
_BASE: Any = _torch.PurePythonUnpickler


#: The last allowlist's ``id -> name`` table, with the allowlist itself (held, so its id
#: is not given to another object): a reader unpickling thousands of chunk archives with
#: one allowlist builds the table once, not once a chunk.
_last_names: tuple[Mapping[tuple[str, str], Any], int, dict[int, str]] | None = None


def _global_names(allowed: Mapping[tuple[str, str], Any]) -> dict[int, str]:
    global _last_names
    last = _last_names
    if last is not None and last[0] is allowed and last[1] == len(allowed):
        return last[2]
    names = {id(v): f"{m}.{n}" for (m, n), v in allowed.items()}
    _last_names = (allowed, len(allowed), names)
    return names


class RestrictedUnpickler(_BASE):
    """An unpickler that resolves globals only through ``allowed`` and changes nothing else.

    It is pickle's pure-Python unpickler (reading from memory, without its framing
    layer) with these changes, each closing a way a file could reach beyond itself:

    - globals resolve only through ``allowed`` (:meth:`find_class`);
    - the opcodes that change an existing object (BUILD, SETITEM(S), APPEND(S),
      ADDITEMS) apply only to objects this same load built (an empty dict, list or set,
      or what a call of an allowlisted class returned), and BUILD only through the
      object's own ``__setstate__`` (fsdpckpt's stand-ins such as :class:`Record` define
      one); aimed at anything else, above all at an allowlisted
      global, they stop the load with :class:`UnsafePickleError`. Without this a BUILD
      writes into the ``__dict__`` of a module-level stand-in (a frozen dataclass does not
      stop it), changing how every later file is read in the process;
    - the memo is a dict, and BYTEARRAY8 is checked against the bytes left (pickle's C
      unpickler grows its memo array to the largest index a file names: 9 bytes could
      ask for gigabytes).

    Args:
        file: a binary, seekable file object holding the pickle (a ``BytesIO``).
        allowed: ``(module, name) -> object`` for every global the pickle may name.
        source: what to call the file in error messages (usually its path).
        persistent_load: handler for persistent ids, or None to refuse them.
    """

    dispatch = dict(_BASE.dispatch)
    #: Whether BUILD may be aimed at a dict this load built (a subclass that allows it
    #: says so, for the shape walk).
    builds_dicts = False

    def __init__(
        self,
        file: Any,
        *,
        allowed: Mapping[tuple[str, str], Any],
        source: str,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._file = file
        self._allowed = allowed
        self._source = source
        self._persistent = persistent_load
        # id -> name of every allowlisted value: never counted as built by this load,
        # and named when a pickle aims a state-setting opcode at it.
        self._globals = _global_names(allowed)
        # id -> object for what this load built; holding the objects keeps their ids
        # from being reused by others while the load runs.
        self._built: dict[int, Any] = {}
        self.memo: dict[int, Any] = {}

    def load(self) -> Any:
        """Read the pickle; as pickle's own loop, minus the framing layer.

        FRAME only announces how many bytes follow; reading straight from memory needs
        no buffering, and every read is short at the end of the data instead of failing,
        so a truncated pickle ends in EOFError or a short value, never in a large read.
        """
        self.read = self._file.read
        self.readline = self._file.readline
        self.readinto = self._file.readinto
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("the pickle ends before its STOP opcode")
                dispatch[key[0]](self)
        except _torch.PickleStop as stop:
            return stop.value

    @property
    def position(self) -> int:
        """How many bytes of the pickle were read: the failing opcode ends here."""
        return self._file.tell()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            refuse_global(self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self._persistent(pid)

    # -- objects this load builds -------------------------------------------------------
    #
    # These handlers run for most opcodes of a large .metadata, hence written out flat.

    def _push_built(self, value: Any) -> None:
        """Push what a call returned; count it as built unless it is an allowlisted value."""
        if id(value) not in self._globals:
            self._built[id(value)] = value
        self.append(value)

    def _load_empty_dict(self) -> None:
        value: dict[Any, Any] = {}
        self._built[id(value)] = value
        self.append(value)

    def _load_empty_list(self) -> None:
        value: list[Any] = []
        self._built[id(value)] = value
        self.append(value)

    def _load_empty_set(self) -> None:
        value: set[Any] = set()
        self._built[id(value)] = value
        self.append(value)

    def _load_dict(self) -> None:
        items = self.pop_mark()
        value = {items[i]: items[i + 1] for i in range(0, len(items), 2)}
        self._built[id(value)] = value
        self.append(value)

    def _load_list(self) -> None:
        value = self.pop_mark()
        self._built[id(value)] = value
        self.append(value)

    def _load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        data = self.read(size)  # at most the bytes present, however large the size
        if len(data) != size:
            raise pickle.UnpicklingError(f"BYTEARRAY8 of {size} bytes, {len(data)} present")
        self._push_built(bytearray(data))

    def _load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack.pop()
        self._push_built(func(*args))

    def _load_newobj(self) -> None:
        stack = self.stack
        args = stack.pop()
        cls = stack.pop()
        self._push_built(cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        stack = self.stack
        kwargs = stack.pop()
        args = stack.pop()
        cls = stack.pop()
        self._push_built(cls.__new__(cls, *args, **kwargs))

    def _load_obj(self) -> None:
        args = self.pop_mark()
        cls = args.pop(0)
        self._instantiate(cls, args)
        self._push_built(self.stack.pop())

    def _load_inst(self) -> None:
        module = self.readline()[:-1].decode("ascii")
        name = self.readline()[:-1].decode("ascii")
        self._instantiate(self.find_class(module, name), self.pop_mark())
        self._push_built(self.stack.pop())

    def _load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise EOFError("the pickle ends inside a FRAME opcode")

    # -- opcodes that change an object --------------------------------------------------
    #
    # Each checks its target in line: built by this load (the very object, by identity)
    # and of the one type the opcode may change; anything else goes to _refuse.

    def _refuse(self, value: Any, opcode: str) -> NoReturn:
        name = self._globals.get(id(value))
        what = f"the allowlisted global '{name}'" if name else \
            f"a {type(value).__name__} it did not build" \
            if self._built.get(id(value)) is not value else \
            f"a {type(value).__name__}, which takes no state"
        raise refusal(self._source, what, opcode)

    def _load_build(self) -> None:
        # Only through the object's own __setstate__ (a stand-in's, which checks what it
        # gets): never pickle's fallback that writes __dict__ or calls setattr.
        stack = self.stack
        state = stack.pop()
        target = stack[-1]
        setstate = _own_setstate(type(target))
        if self._built.get(id(target)) is not target or setstate is None:
            self._refuse(target, "BUILD")
        setstate(target, state)

    def _load_setitem(self) -> None:
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        target = stack[-1]
        self._require_built(target, dict, "SETITEM")
        target[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._require_built(target, dict, "SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _require_built(self, target: Any, kind: type, opcode: str) -> None:
        """Refuse ``opcode`` unless ``target`` is a ``kind`` this same pickle built."""
        if self._built.get(id(target)) is not target or type(target) is not kind:
            self._refuse(target, opcode)

    def _load_append(self) -> None:
        stack = self.stack
        value = stack.pop()
        target = stack[-1]
        self._require_built(target, list, "APPEND")
        target.append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._require_built(target, list, "APPENDS")
        target.extend(items)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._require_built(target, set, "ADDITEMS")
        target.update(items)

    for _opcode, _handler in {
        pickle.EMPTY_DICT: _load_empty_dict, pickle.EMPTY_LIST: _load_empty_list,
        pickle.EMPTY_SET: _load_empty_set, pickle.DICT: _load_dict, pickle.LIST: _load_list,
        pickle.BYTEARRAY8: _load_bytearray8, pickle.REDUCE: _load_reduce,
        pickle.NEWOBJ: _load_newobj, pickle.NEWOBJ_EX: _load_newobj_ex, pickle.OBJ: _load_obj,
        pickle.INST: _load_inst, pickle.FRAME: _load_frame, pickle.BUILD: _load_build,
        pickle.SETITEM: _load_setitem, pickle.SETITEMS: _load_setitems,
        pickle.APPEND: _load_append, pickle.APPENDS: _load_appends,
        pickle.ADDITEMS: _load_additems,
    }.items():
        dispatch[_opcode[0]] = _handler
    del _opcode, _handler


def safe_loads(
    data: bytes,
    *,
    allowed: Mapping[tuple[str, str], Any],
    source: str,
    persistent_load: Callable[[Any], Any] | None = None,
    unpickler_class: type[RestrictedUnpickler] | None = None,
) -> Any:
    """Unpickle ``data`` through :class:`RestrictedUnpickler` (or ``unpickler_class``, a
    subclass that allows one more narrow case).

    Args:
        data: the pickle bytes.
        allowed: the allowlist, ``(module, name) -> stand-in``.
        source: the file's name for error messages.
        persistent_load: handler for persistent ids, if the format has them.

    Returns:
        The unpickled object, built from stand-ins.

    Raises:
        UnsafePickleError: the pickle names a global outside ``allowed``.
        NotACheckpointError: the bytes are not a valid pickle of this kind.

    Example:
        >>> safe_loads(pickle.dumps({"a": 1}), allowed=BUILTIN_GLOBALS, source="x")
        {'a': 1}
    """
    cls = unpickler_class or RestrictedUnpickler
    walked(data, allowed, source=source, persistent_ids=persistent_load is not None,
           builds_dicts=cls.builds_dicts)
    unpickler = cls(
        io.BytesIO(data), allowed=allowed, source=source, persistent_load=persistent_load
    )
    try:
        return unpickler.load()
    except _Refusal as exc:  # a sealed value refused the opcode itself
        raise refusal(source, exc.what, exc.opcode) from None
    except FsdpCkptError:
        # Our own refusals, and stand-ins that found the file damaged (a tensor outside
        # its storage): their messages say more than "not a readable pickle" would.
        raise
    except Exception as exc:
        # The parser and the allowlisted callables fail in many ways on malformed bytes
        # (UnpicklingError, EOFError, struct.error, IndexError, TypeError, ValueError,
        # OverflowError, RecursionError, UnicodeDecodeError, LookupError, MemoryError...).
        raise unreadable(source, unpickler.position, len(data), exc) from exc


def walked(data: bytes, allowed: Mapping[tuple[str, str], Any] | None, *, source: str,
           persistent_ids: bool = False, shape: bool = True,
           builds_dicts: bool = False) -> None:
    """The walks every pickle goes through before a reader builds it: the opcode scan,
    then (``shape``) the shape walk; their refusals said as the unpicklers say theirs
    (a global outside ``allowed`` and a state-setting opcode aimed at what it may not
    change as :class:`UnsafePickleError`, anything else as :class:`NotACheckpointError`).
    """
    try:
        scan(data)
        if shape:
            walk(data, allowed, persistent_ids=persistent_ids, builds_dicts=builds_dicts)
    except _Unwalkable as exc:
        if exc.refused is not None:
            refuse_global(source, *exc.refused)
        if exc.state is not None:
            raise refusal(source, *exc.state) from None
        raise unreadable(source, exc.where, len(data), exc) from None


def check_pickle(data: bytes, *, source: str, persistent_ids: bool = False) -> None:
    """Walk ``data`` as every reader of fsdpckpt's does, building nothing: for bytes handed
    to a reader of torch's (``torch.load(weights_only=True)``, which hashes as unguarded).

    Raises:
        NotACheckpointError: what no checkpoint's pickle holds (see :mod:`._pickle_walk`).
    """
    walked(data, None, source=source, persistent_ids=persistent_ids)


#: The most bytes the pickles of a legacy ``torch.save`` file may take before its storages.
LEGACY_PICKLE_LIMIT = 64 << 20

#: A legacy ``torch.save`` file: magic number, protocol, system info, the object (its
#: tensors' storages as persistent ids), the storage keys; then the storages' raw bytes.
_LEGACY_PICKLES = (False, False, False, True, False)


def check_legacy_pickles(file: Any, start: int, length: int, *, source: str) -> None:
    """Walk the pickles of the legacy (pre-zip) ``torch.save`` file at ``start``, which
    ``torch.load`` reads one after another before the storages.

    Raises:
        NotACheckpointError: bytes torch would not read as that format (a tar archive of
            torch < 0.4, say), a pickle no checkpoint holds, or pickles past
            :data:`LEGACY_PICKLE_LIMIT`.
    """
    file.seek(start)
    data = file.read(min(length, LEGACY_PICKLE_LIMIT))
    pos = 0
    for persistent in _LEGACY_PICKLES:
        if data[pos:pos + 1] != pickle.PROTO:
            raise NotACheckpointError(
                f"{source}: neither a zip archive nor a legacy torch.save file (no pickle at "
                f"byte {pos}); it is damaged, or not a torch.save file")
        try:
            end = scan(data[pos:]) + 1
        except _Unwalkable as exc:
            raise unreadable(source, pos + exc.where, len(data), exc) from None
        check_pickle(data[pos:pos + end], source=source, persistent_ids=persistent)
        pos += end

