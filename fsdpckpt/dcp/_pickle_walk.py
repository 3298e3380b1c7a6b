"""The shape walk: what a pickle would build, checked before any unpickler builds it.

pickle's unpicklers (the C one that reads ``.metadata``, the pure-Python one that reads
every other file) build as they go, and some of what they build runs C code that no
limit guards: a dict hashes its keys (a tuple nested 300,000 deep segfaults the hash, a
tuple of shared tuples takes hours, integer keys ``k * (2**61 - 1)`` all collide), a set
hashes its members. :func:`walk` runs the pickle's opcodes over *kinds* instead of values
(a string, a small integer, a tuple of some depth, a container, a global, what a call
returned) and refuses, before anything is built:

- a dict key or set member that is not a string, bytes, an integer below 2**61 - 1 in
  size, a bool, None, or a record an allowlisted class's NEWOBJ made (whose hash is its
  identity): the only keys torch writes, and none of them costs more than its length to
  hash or can be made to collide;
- tuples nested more than :data:`MAX_DEPTH` deep, and marks (containers being built)
  nested more than :data:`MAX_DEPTH` deep: honest files nest a few levels;
- opcodes no checkpoint pickle uses (extension codes, out-of-band buffers, persistent ids
  where the format has none), and a stack or memo that does not hold what an opcode needs.

It runs after :func:`fsdpckpt.dcp._pickle_scan.scan`, which has already checked that the
opcodes tile the bytes, frames included, with every length and memo index in bounds; both
readers go through both walks, so they accept and refuse the same pickles alike.

The walk is pure Python, about 0.15 us an opcode: every pickle but a ``.metadata`` of more
than :data:`WALK_LIMIT` bytes is walked (docs/reliability.md says what that leaves).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.dcp._allowlist import (
    _HASH_MODULUS,
    Record,
    Size,
    _checked_dict,
    _checked_frozenset,
    _checked_set,
    _path,
    layout_name,
)
from fsdpckpt.dcp._pickle_scan import _Unwalkable

__all__ = ["MAX_DEPTH", "WALK_LIMIT", "walk"]

#: How deep tuples and marks may nest (honest checkpoint pickles: a few levels).
MAX_DEPTH = 64

#: The largest ``.metadata`` walked (about 1.3 s); larger ones get the opcode scan only.
WALK_LIMIT = 16 << 20

# Kinds. A string is its UTF-8 bytes (STACK_GLOBAL needs the names), a global its
# ``(module, name)``, everything else an int.
KEY = 0  # bytes, a small int, a bool, None: hashable in O(len), no crafted collisions
SCALAR = 1  # a float, a large int: not a key
DICT, SET, BYTES_ARRAY = 2, 4, 9  # containers: unhashable; each takes its own items
# A list is a cell, ``[whether every member so far could key a dict]``, shared by the stack
# and the memo as the list itself is: a call that hashes what a list holds (``set(items)``)
# is judged by it.
RECORD = 5  # what a call of a record class made: a key, given state by BUILD
VALUE = 6  # what a call returned, of no kind known here: the unpickler judges it
#: What a call returned that takes no state, by the type it is: a Size, a path's string...
FROZEN = {Size: -1, str: -2, int: -3, frozenset: -4, slice: -5, complex: -6}
_TUPLE = 100  # _TUPLE + depth: a tuple nesting ``depth`` tuples

#: What each state-setting opcode may change: a container of its own kind, or a value
#: the unpickler judges (it knows the stand-in); what RECORD may take: BUILD.
_TAKES = {"SETITEM": (DICT, VALUE), "SETITEMS": (DICT, VALUE), "APPEND": (VALUE,),
          "APPENDS": (VALUE,), "ADDITEMS": (SET, VALUE), "BUILD": (RECORD, VALUE)}
_LISTS = ("APPEND", "APPENDS")  # and a list


#: Opcodes that push a small scalar, and their widths.
_SMALL = {0x4B: 2, 0x4D: 3, 0x4A: 5, 0x4E: 1, 0x88: 1, 0x89: 1}


class _Globals:
    """An allowlist as the walk sees it: each name's global, and what a call of it makes."""

    def __init__(self, allowed: Mapping[tuple[str, str], Any] | None) -> None:
        self.judged = allowed is not None
        self.made: dict[tuple[str, str], int] = {}
        for key, value in (allowed or {}).items():
            self.made[key] = _made_by(value)

    def named(self, module: str, name: str, pos: int) -> tuple[str, str]:
        if self.judged and (module, name) not in self.made:
            raise _Unwalkable(pos, "a global outside the allowlist", refused=(module, name))
        return (module, name)

    def result(self, callee: Any) -> int:
        if type(callee) is not tuple:
            return VALUE  # not a global: the call fails in the unpickler, as it should
        if self.judged:
            return self.made.get(callee, VALUE)
        return _TORCH_MADE.get(callee, VALUE)


def _made_by(value: Any) -> int:
    make = getattr(value, "makes", value)
    if make is _checked_dict:
        return DICT
    if make is _checked_set:
        return SET
    if isinstance(value, type) and issubclass(value, Record) and \
            value.__hash__ is object.__hash__:
        return RECORD
    if isinstance(value, type) and issubclass(value, Size):
        return FROZEN[Size]
    if make in (slice, complex, int):
        return FROZEN[make]
    if make is _checked_frozenset or make is _path or make is layout_name:
        return FROZEN[frozenset if make is _checked_frozenset else str]
    if getattr(make, "makes_bytes", False):  # _codecs.encode, as protocol 2 writes bytes
        return KEY
    return VALUE


#: The allowlists walked lately, by identity, each held so its id is not reused: a reader
#: of thousands of chunk archives asks what its globals make once, not once a chunk.
_judged: dict[int, tuple[Any, _Globals]] = {}


def _globals_of(allowed: Mapping[tuple[str, str], Any] | None) -> _Globals:
    found = _judged.get(id(allowed))
    if found is None or found[0] is not allowed:
        if len(_judged) >= 16:
            _judged.clear()
        found = _judged[id(allowed)] = (allowed, _Globals(allowed))
    return found[1]


class _One(int):
    """A tuple of one list, dict or string: what a call's arguments usually are, kept so the
    call can be judged (``set([...])``, ``OrderedDict({...})``, ``_get_layout("...")``)."""

    inner: Any


def _deeper(kinds: list[Any], pos: int) -> int:
    """The kind of a tuple of ``kinds``: one deeper than its deepest tuple."""
    if len(kinds) == 1 and (type(kinds[0]) in (list, bytes) or kinds[0] == DICT):
        one = _One(_TUPLE + 1)
        one.inner = kinds[0]
        return one
    depth = 0
    for kind in kinds:
        if isinstance(kind, int) and kind >= _TUPLE and kind - _TUPLE > depth:
            depth = kind - _TUPLE
    if depth >= MAX_DEPTH:
        raise _Unwalkable(pos, f"tuples nested more than {MAX_DEPTH} deep")
    return _TUPLE + depth + 1


def _keyable(kinds: list[Any]) -> bool:
    return all(type(kind) is bytes or kind in (KEY, RECORD) for kind in kinds)


#: The globals torch's weights-only loader (and fsdpckpt's readers, by their stand-ins) may
#: call that hash what they are given, and what each may be given: nothing, a dict (keys
#: checked as it was built), a list of members that could key a dict, or (``_get_layout``,
#: a dict lookup) a string.
_SETS = {(m, n) for m in ("builtins", "__builtin__") for n in ("set", "frozenset")}
_HASHING: dict[tuple[str, str], tuple[str, ...]] = {
    **{key: ("list", "dict") for key in _SETS},
    ("collections", "OrderedDict"): ("dict",),
    ("collections", "Counter"): ("list", "dict"),
    _torch.GET_LAYOUT: ("string",),
}


#: What the calls of torch's own allowlist that matter here make (for bytes another reader,
#: torch's weights-only loader, builds: the walk has no stand-ins to ask).
_TORCH_MADE: dict[tuple[str, str], int] = {
    **{key: SET for key in _SETS if key[1] == "set"},
    ("collections", "OrderedDict"): DICT,
    ("collections", "Counter"): DICT,
    ("_codecs", "encode"): KEY,
}


def _hashed_arguments(callee: tuple[str, str], args: Any, pos: int) -> None:
    if args == _TUPLE and type(args) is int:  # ()
        return
    inner = getattr(args, "inner", None)
    given = "list" if type(inner) is list and inner[0] else \
        "string" if type(inner) is bytes else "dict" if inner == DICT else None
    if given not in _HASHING[callee]:
        raise _Unwalkable(pos, f"{callee[0]}.{callee[1]}, which hashes what it is given, is "
                               "given what could not key a dict")


def _check_keys(kinds: list[Any], pos: int, what: str) -> None:
    for kind in kinds:
        if not (type(kind) is bytes or kind in (KEY, RECORD)):
            raise _Unwalkable(pos, f"{what} is a {_name(kind)}; a checkpoint's keys are "
                                  "strings, small integers or records")


def _target(kind: Any, opcode: str, pos: int) -> None:
    """Refuse ``opcode`` aimed at ``kind`` unless it may change it (both readers would
    refuse, each its own way: the walk says it once, for both)."""
    if kind in _TAKES[opcode] or type(kind) is list and opcode in _LISTS:
        return
    if type(kind) is tuple:
        what = f"the allowlisted global '{kind[0]}.{kind[1]}'"
    else:
        what = f"a {_name(kind)}, which takes no state" if kind != RECORD or opcode != "BUILD" \
            else "a record"
    raise _Unwalkable(pos, f"{opcode} aimed at {what}", state=(what, opcode))


def _anything(kind: Any, opcode: str, pos: int) -> None:
    """:func:`_target` where the reader the bytes go to judges state-setting itself."""


def _name(kind: Any) -> str:
    if type(kind) is bytes:
        return "string"
    if type(kind) is tuple:
        return "global"
    if type(kind) is list:
        return "list"
    if kind >= _TUPLE:
        return "tuple"
    return {KEY: "small scalar", SCALAR: "float or large integer", DICT: "dict",
            SET: "set", BYTES_ARRAY: "bytearray", RECORD: "record",
            VALUE: "value built by a call",
            **{code: ("tuple" if made is Size else made.__name__)
               for made, code in FROZEN.items()}}[kind]


def _int_kind(value: int) -> int:
    return KEY if -_HASH_MODULUS < value < _HASH_MODULUS else SCALAR


#: Integers and floats as text (protocols 0 and 1), in the forms pickle writes: where
#: readers differ (leading zeros, underscores, spaces), it never writes.
_DECIMAL = re.compile(rb"-?(?:0|[1-9][0-9]*)|0[01]")
_FLOAT = re.compile(rb"-?(?:[0-9]+\.?[0-9]*(?:e[-+]?[0-9]+)?|inf|nan)")


def _line(data: bytes, pos: int) -> tuple[bytes, int]:
    end = data.index(b"\n", pos)
    return data[pos:end], end + 1


def _text(raw: Any, pos: int) -> str:
    if type(raw) is not bytes:
        raise _Unwalkable(pos, "a global's name that is not a string")
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _Unwalkable(pos, "a global's name that is not UTF-8") from None


def walk(data: bytes, allowed: Mapping[tuple[str, str], Any] | None, *,
         persistent_ids: bool = False, builds_dicts: bool = False) -> None:
    """Walk the pickle ``data`` (already :func:`~fsdpckpt.dcp._pickle_scan.scan`-ned) over
    kinds; raise :class:`_Unwalkable` for what no checkpoint pickle holds.

    ``allowed`` is the allowlist the unpickler will use: a global outside it is refused
    here, where the unpickler would refuse it, and its record classes are what may key a
    dict; None for bytes another reader judges the globals of (torch's weights-only
    loader). ``persistent_ids``: whether the format has them (torch.save's storages);
    ``builds_dicts``: whether the unpickler lets BUILD give a dict state (a module's
    ``state_dict()`` carries its ``_metadata`` so), or refuses it, as both readers of a
    ``.metadata`` do.
    """
    globals_ = _globals_of(allowed)
    # Where another reader judges the globals, it judges what BUILD and the like may change.
    target = _target if globals_.judged else _anything
    made = globals_.made if globals_.judged else _TORCH_MADE  # what a call of each makes
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    push, pop = stack.append, stack.pop
    frombytes = int.from_bytes
    pos = 0
    try:
        while True:
            op = data[pos]
            # Most frequent first (a .metadata's); what a MEMOIZE follows memoizes at once.
            if op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                push(memo[frombytes(data[pos + 1:pos + 5], "little")])
                pos += 5
            elif op == 0x68:  # BINGET
                push(memo[data[pos + 1]])
                pos += 2
            elif op == 0x85:  # TUPLE1
                kind = stack[-1]
                if type(kind) is int and kind < _TUPLE + MAX_DEPTH - 1:
                    stack[-1] = kind + 1 if kind >= _TUPLE else _TUPLE + 1
                else:
                    stack[-1] = _deeper([kind], pos)
                pos += 1
                if data[pos] == 0x94:
                    memo[len(memo)] = stack[-1]
                    pos += 1
            elif op in _SMALL:  # BININT1/2, BININT, None, bools
                push(KEY)
                pos += _SMALL[op]
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                if len(marks) > MAX_DEPTH:
                    raise _Unwalkable(pos, f"containers nested more than {MAX_DEPTH} deep")
                pos += 1
            elif op == 0x29:  # EMPTY_TUPLE
                push(_TUPLE)
                pos += 1
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: callee, arguments
                if not (isinstance(stack[-1], int) and stack[-1] >= _TUPLE):
                    # pickle's C reader takes a tuple only, its pure one any iterable
                    raise _Unwalkable(pos, f"a call's arguments are a {_name(stack[-1])}, "
                                           "not a tuple")
                args = pop()
                callee = stack[-1]
                if type(callee) is tuple:
                    if callee in _HASHING:
                        _hashed_arguments(callee, args, pos)
                    stack[-1] = made.get(callee, VALUE)
                else:
                    stack[-1] = VALUE  # not a global: the call fails in the unpickler too
                pos += 1
                if data[pos] == 0x94:
                    memo[len(memo)] = stack[-1]
                    pos += 1
            elif op == 0x62:  # BUILD: target, state
                state = pop()
                if stack[-1] != RECORD:
                    if stack[-1] == DICT and state != DICT:
                        # an OrderedDict's BUILD updates its __dict__ by the state: hashed
                        raise _Unwalkable(pos, f"BUILD gives a dict a {_name(state)} for state")
                    if not (builds_dicts and stack[-1] == DICT):
                        target(stack[-1], "BUILD", pos)
                pos += 1
            elif op == 0x75 or op == 0x64:  # SETITEMS (onto the dict below the mark), DICT
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if op == 0x75 and stack[-1] != DICT:
                    target(stack[-1], "SETITEMS", pos)
                if len(items) % 2:
                    raise _Unwalkable(pos, "a dict's items do not pair up")
                _check_keys(items[::2], pos, "a dict key")
                if op == 0x64:
                    push(DICT)
                pos += 1
            elif op == 0x7D:  # EMPTY_DICT
                push(DICT)
                pos += 1
                if data[pos] == 0x94:
                    memo[len(memo)] = DICT
                    pos += 1
            elif op == 0x86:  # TUPLE2
                second = pop()
                first = stack[-1]
                if type(first) is int and type(second) is int:
                    deepest = first if first > second else second
                    if deepest >= _TUPLE + MAX_DEPTH - 1:
                        raise _Unwalkable(pos, f"tuples nested more than {MAX_DEPTH} deep")
                    stack[-1] = deepest + 1 if deepest >= _TUPLE else _TUPLE + 1
                else:
                    stack[-1] = _deeper([first, second], pos)
                pos += 1
                if data[pos] == 0x94:
                    memo[len(memo)] = stack[-1]
                    pos += 1
            elif op == 0x8C:  # SHORT_BINUNICODE
                end = pos + 2 + data[pos + 1]
                push(data[pos + 2:end])
                pos = end
                if data[pos] == 0x94:
                    memo[len(memo)] = stack[-1]
                    pos += 1
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [_deeper(stack[-3:], pos)]
                pos += 1
            elif op == 0x7D:  # EMPTY_DICT
                push(DICT)
                pos += 1
            elif op == 0x5D:  # EMPTY_LIST
                push([True])
                pos += 1
            elif op == 0x73:  # SETITEM: dict, key, value
                target(stack[-3], "SETITEM", pos)
                _check_keys(stack[-2:-1], pos, "a dict key")
                del stack[-2:]
                pos += 1
            elif op == 0x65 or op == 0x61:  # APPENDS (the items to the mark), APPEND
                if op == 0x65:
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                else:
                    items = [pop()]
                into = stack[-1]
                target(into, "APPENDS" if op == 0x65 else "APPEND", pos)
                if type(into) is list and into[0]:
                    into[0] = _keyable(items)
                pos += 1
            elif op == 0x8A:  # LONG1
                n = data[pos + 1]
                push(_int_kind(frombytes(data[pos + 2:pos + 2 + n], "little", signed=True))
                     if n <= 9 else SCALAR)
                pos += 2 + n
            elif op == 0x93:  # STACK_GLOBAL
                name = pop()
                stack[-1] = globals_.named(_text(stack[-1], pos), _text(name, pos), pos)
                pos += 1
            elif op == 0x95:  # FRAME: the scan checked that frames tile the opcodes
                pos += 9
            elif op == 0x2E:  # STOP
                if len(stack) == (marks[-1] if marks else 0):
                    raise _Unwalkable(pos, "STOP with nothing to return")
                return
            else:
                pos = _walk_rare(data, pos, op, stack, marks, memo, globals_, persistent_ids)
    except _Unwalkable:
        raise
    except (IndexError, KeyError, ValueError, TypeError) as exc:
        # An empty stack, a mark missing, a memo entry never made: pickle fails too.
        raise _Unwalkable(pos, f"opcode {data[pos]:#04x} at a stack or memo that cannot "
                              f"feed it ({type(exc).__name__})") from None


def _walk_rare(data: bytes, pos: int, op: int, stack: list[Any], marks: list[int],
               memo: dict[int, Any], globals_: _Globals, persistent_ids: bool) -> int:
    """The opcodes honest protocol 2 and 4 pickles seldom use; returns the next offset."""
    push, pop, frombytes = stack.append, stack.pop, int.from_bytes
    if op == 0x71:  # BINPUT
        memo[data[pos + 1]] = stack[-1]
        return pos + 2
    if op == 0x72:  # LONG_BINPUT
        memo[frombytes(data[pos + 1:pos + 5], "little")] = stack[-1]
        return pos + 5
    if op == 0x70:  # PUT
        text, end = _line(data, pos + 1)
        memo[int(text)] = stack[-1]
        return end
    if op == 0x67:  # GET
        text, end = _line(data, pos + 1)
        push(memo[int(text)])
        return end
    if op == 0x80:  # PROTO
        return pos + 2
    if op == 0x47:  # BINFLOAT
        push(SCALAR)
        return pos + 9
    if op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
        width = 4 if op == 0x58 else 8
        start = pos + 1 + width
        end = start + frombytes(data[pos + 1:start], "little")
        push(data[start:end])
        return end
    if op in (0x43, 0x42, 0x8E, 0x55, 0x54):  # (SHORT_)BINBYTES(8), (SHORT_)BINSTRING
        width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x55: 1, 0x54: 4}[op]
        start = pos + 1 + width
        push(KEY)
        return start + frombytes(data[pos + 1:start], "little", signed=op == 0x54)
    if op == 0x96:  # BYTEARRAY8
        start = pos + 9
        push(BYTES_ARRAY)
        return start + frombytes(data[pos + 1:start], "little")
    if op == 0x8B:  # LONG4: more than 2**32 bits is no key
        start = pos + 5
        push(SCALAR)
        return start + frombytes(data[pos + 1:start], "little", signed=True)
    if op in (0x49, 0x4C):  # INT, LONG as text: decimal digits only, as pickle writes them
        text, end = _line(data, pos + 1)
        digits = text[:-1] if op == 0x4C and text.endswith(b"L") else text
        if not _DECIMAL.fullmatch(digits):  # C reads "010" as 8, Python refuses it...
            raise _Unwalkable(pos, "an integer written other than as pickle writes one")
        push(_int_kind(int(digits)) if len(digits) <= 20 else SCALAR)
        return end
    if op == 0x46:  # FLOAT as text
        text, end = _line(data, pos + 1)
        if not _FLOAT.fullmatch(text):  # ... and each its own way past repr's forms
            raise _Unwalkable(pos, "a float written other than as pickle writes one")
        push(SCALAR)
        return end
    if op == 0x56:  # UNICODE as text (raw-unicode-escape), kept as its UTF-8 like the rest
        text, end = _line(data, pos + 1)
        push(text.decode("raw-unicode-escape").encode("utf-8", "surrogatepass"))
        return end
    if op == 0x53:  # STRING as text: a quoted repr
        push(KEY)
        return _line(data, pos + 1)[1]
    if op == 0x63:  # GLOBAL module\nname\n
        module, mid = _line(data, pos + 1)
        name, end = _line(data, mid)
        push(globals_.named(_text(module, pos), _text(name, pos), pos))
        return end
    if op == 0x69:  # INST module\nname\n: a call of the global on the items to the mark
        module, mid = _line(data, pos + 1)
        name, end = _line(data, mid)
        named = globals_.named(_text(module, pos), _text(name, pos), pos)
        del stack[marks.pop():]
        push(globals_.result(named))
        return end
    if op == 0x6F:  # OBJ: the class, then its arguments, to the mark
        start = marks.pop()
        if len(stack) <= start:
            raise _Unwalkable(pos, "OBJ without a class")
        made = globals_.result(stack[start])
        del stack[start:]
        push(made)
        return pos + 1
    if op == 0x92:  # NEWOBJ_EX: class, args, kwargs
        if not (isinstance(stack[-2], int) and stack[-2] >= _TUPLE and stack[-1] == DICT):
            raise _Unwalkable(pos, "NEWOBJ_EX's arguments are not a tuple and a dict")
        del stack[-2:]
        stack[-1] = globals_.result(stack[-1])
        return pos + 1
    if op == 0x8F:  # EMPTY_SET
        push(SET)
        return pos + 1
    if op in (0x6C, 0x74, 0x90, 0x91):  # LIST, TUPLE, ADDITEMS, FROZENSET: items to the mark
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        if op == 0x6C:
            push([_keyable(items)])
        elif op == 0x74:
            push(_deeper(items, pos))
        else:
            _check_keys(items, pos, "a set member")
            if op == 0x91:
                push(FROZEN[frozenset])
            elif globals_.judged:
                _target(stack[-1], "ADDITEMS", pos)
        return pos + 1
    if op == 0x30:  # POP
        if marks and marks[-1] == len(stack):
            marks.pop()  # pickle's POP of a mark drops the mark
        else:
            pop()
        return pos + 1
    if op == 0x31:  # POP_MARK
        del stack[marks.pop():]
        return pos + 1
    if op == 0x32:  # DUP
        push(stack[-1])
        return pos + 1
    if op in (0x50, 0x51):  # PERSID, BINPERSID
        if not persistent_ids:
            raise _Unwalkable(pos, "a persistent id, which a file of this kind never holds")
        if op == 0x51:
            stack[-1] = VALUE
            return pos + 1
        push(VALUE)
        return _line(data, pos + 1)[1]
    raise _Unwalkable(pos, f"opcode {op:#04x}, which no checkpoint pickle uses")
