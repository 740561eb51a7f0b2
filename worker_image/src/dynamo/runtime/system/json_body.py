"""Read a JSON request body into a struct as upstream's system server does, rejections included.

Upstream's routes take their bodies through axum's `Json` extractor: serde_json deserializes
the body into a Rust struct (serde_path_to_error names where it failed), and the extractor
answers a failure with plain text before the handler runs:

* 415 `Expected request with `Content-Type: application/json`` without a JSON content type;
* 400 `Failed to parse the request body as JSON: <error>` for a syntax error (or the body
  ending early);
* 422 `Failed to deserialize the JSON body into the target type: <error>` for well-formed
  JSON of the wrong shape: a missing or duplicate field, a value of the wrong type, a
  sequence of the wrong length (a struct may also be written as a sequence of its fields).

`<error>` is serde_json's message, `[<path>: ]<message> at line <l> column <c>`. This module
reproduces those messages and positions for structs whose fields are strings or structs:
the body is read in serde's order (fields as they come, unknown fields skipped but still
checked as JSON, the first failure wins) and positions count bytes as serde_json does. What
follows the top-level value is not looked at, as upstream.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

CONTENT_TYPE_TEXT = "Expected request with `Content-Type: application/json`"
SYNTAX_PREFIX = "Failed to parse the request body as JSON: "
DATA_PREFIX = "Failed to deserialize the JSON body into the target type: "

_WHITESPACE = b" \t\n\r"
_ESCAPES = {
    ord('"'): '"',
    ord("\\"): "\\",
    ord("/"): "/",
    ord("b"): "\b",
    ord("f"): "\f",
    ord("n"): "\n",
    ord("r"): "\r",
    ord("t"): "\t",
}
_DIGITS = b"0123456789"
_HEX = b"0123456789abcdefABCDEF"


@dataclass(frozen=True)
class Struct:
    """A struct of named fields, each a string (None) or another `Struct`."""

    name: str
    fields: tuple[tuple[str, Struct | None], ...]

    def expected(self) -> str:
        return f"struct {self.name}"


class Rejection(Exception):
    """What the extractor answers instead of calling the handler: status and plain text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def is_json_content_type(content_type: str | None) -> bool:
    """`application/json` or `application/<anything>+json`, parameters allowed."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def extract(content_type: str | None, body: bytes, schema: Struct) -> dict[str, Any]:
    """The body as a dict of the struct's fields (unknown fields kept as plain JSON values);
    `Rejection` with upstream's status and text otherwise."""
    if not is_json_content_type(content_type):
        raise Rejection(415, CONTENT_TYPE_TEXT)
    reader = _Reader(body)
    try:
        return reader.struct(schema)
    except _JsonError as exc:
        prefix = DATA_PREFIX if exc.data else SYNTAX_PREFIX
        raise Rejection(422 if exc.data else 400, prefix + exc.render(body)) from None


class _JsonError(Exception):
    """A serde_json error: syntax or data, with the path serde_path_to_error reports and the
    byte offset it is reported at (None until the enclosing struct fixes it)."""

    def __init__(self, message: str, path: str, pos: int | None, *, data: bool) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.pos = pos
        self.data = data

    def render(self, body: bytes) -> str:
        pos = self.pos if self.pos is not None else len(body)
        line_start = body.rfind(b"\n", 0, pos) + 1
        line = body.count(b"\n", 0, line_start) + 1
        where = f"{self.message} at line {line} column {pos - line_start}"
        return f"{self.path}: {where}" if self.path else where


class _Reader:
    """serde_json's reading of one body, byte by byte."""

    def __init__(self, body: bytes) -> None:
        self.b = body
        self.i = 0
        self.path: list[str] = []

    # ----- errors --------------------------------------------------------------------------

    def _path(self) -> str:
        text = ""
        for segment in self.path:
            text += segment if segment.startswith("[") or not text else "." + segment
        return text

    def error(self, message: str) -> _JsonError:
        """A syntax error where reading stopped."""
        return _JsonError(message, self._path(), self.i, data=False)

    def peek_error(self, message: str) -> _JsonError:
        """A syntax error at the byte looked at (not consumed)."""
        return _JsonError(message, self._path(), min(len(self.b), self.i + 1), data=False)

    def data_error(self, message: str, *, positioned: bool = False) -> _JsonError:
        """A shape error; unpositioned ones are placed where their struct ends."""
        return _JsonError(message, self._path(), self.i if positioned else None, data=True)

    # ----- bytes ---------------------------------------------------------------------------

    def peek(self) -> int | None:
        return self.b[self.i] if self.i < len(self.b) else None

    def peek_or_null(self) -> int:
        return self.b[self.i] if self.i < len(self.b) else 0

    def next_char(self) -> int | None:
        char = self.peek()
        if char is not None:
            self.i += 1
        return char

    def skip_whitespace(self) -> int | None:
        while self.i < len(self.b) and self.b[self.i] in _WHITESPACE:
            self.i += 1
        return self.peek()

    # ----- values the schema names ---------------------------------------------------------

    def value(self, kind: Struct | None) -> Any:
        return self.string() if kind is None else self.struct(kind)

    def string(self) -> str:
        char = self.skip_whitespace()
        if char is None:
            raise self.peek_error("EOF while parsing a value")
        if char != ord('"'):
            raise self.invalid_type("a string")
        self.i += 1
        return self.parse_str()

    def struct(self, schema: Struct) -> dict[str, Any]:
        char = self.skip_whitespace()
        if char is None:
            raise self.peek_error("EOF while parsing a value")
        if char == ord("{"):
            self.i += 1
            return self._closed(self._map_fields, schema, self._end_map)
        if char == ord("["):
            self.i += 1
            return self._closed(self._seq_fields, schema, self._end_seq)
        raise self.invalid_type(schema.expected())

    def _closed(
        self,
        read: Callable[[Struct], dict[str, Any]],
        schema: Struct,
        end: Callable[..., None],
    ) -> dict[str, Any]:
        # serde_json closes the map or sequence even when reading its fields failed, then
        # places an unpositioned error (missing field, ...) where closing left off.
        try:
            value = read(schema)
        except _JsonError as exc:
            end(strict=False)
            if exc.pos is None:
                exc.pos = self.i
            raise
        end(strict=True)
        return value

    def _map_fields(self, schema: Struct) -> dict[str, Any]:
        fields = dict(schema.fields)
        values: dict[str, Any] = {}
        first = True
        while True:
            char = self.skip_whitespace()
            if char == ord("}"):
                break
            if char == ord(",") and not first:
                self.i += 1
                char = self.skip_whitespace()
            elif char is None:
                raise self.peek_error("EOF while parsing an object")
            elif first:
                first = False
            else:
                raise self.peek_error("expected `,` or `}`")
            if char == ord('"'):
                self.i += 1
                key = self.parse_str()
            elif char == ord("}"):
                raise self.peek_error("trailing comma")
            elif char is None:
                raise self.peek_error("EOF while parsing a value")
            else:
                raise self.peek_error("key must be a string")
            if key in fields and key in values:
                raise self.data_error(f"duplicate field `{key}`")
            self._colon()
            self.path.append(key)
            if key in fields:
                values[key] = self.value(fields[key])
            else:
                self.skip_whitespace()
                start = self.i
                self.ignore_value()
                values[key] = json.loads(self.b[start : self.i].decode(errors="replace"))
            self.path.pop()
        for name, _ in schema.fields:
            if name not in values:
                raise self.data_error(f"missing field `{name}`")
        return values

    def _seq_fields(self, schema: Struct) -> dict[str, Any]:
        values: dict[str, Any] = {}
        count = len(schema.fields)
        for index, (name, kind) in enumerate(schema.fields):
            char = self.skip_whitespace()
            if char == ord("]"):
                noun = "element" if count == 1 else "elements"
                raise self.data_error(
                    f"invalid length {index}, expected {schema.expected()} with {count} {noun}"
                )
            if char == ord(",") and index:
                self.i += 1
                char = self.skip_whitespace()
            elif char is None:
                raise self.peek_error("EOF while parsing a list")
            elif index:
                raise self.peek_error("expected `,` or `]`")
            if char == ord("]"):
                raise self.peek_error("trailing comma")
            if char is None:
                raise self.peek_error("EOF while parsing a value")
            self.path.append(f"[{index}]")
            values[name] = self.value(kind)
            self.path.pop()
        return values

    def _colon(self) -> None:
        char = self.skip_whitespace()
        if char == ord(":"):
            self.i += 1
        elif char is None:
            raise self.peek_error("EOF while parsing an object")
        else:
            raise self.peek_error("expected `:`")

    def _end_map(self, *, strict: bool) -> None:
        # Reading a map's fields only succeeds at its closing brace, so `strict` never fails.
        del strict
        char = self.skip_whitespace()
        if char == ord("}"):
            self.i += 1
        elif char == ord(","):
            self.i += 1
            self.skip_whitespace()

    def _end_seq(self, *, strict: bool) -> None:
        # After the struct's last field the sequence must end.
        char = self.skip_whitespace()
        if char == ord("]"):
            self.i += 1
            return
        if char == ord(","):
            self.i += 1
            after = self.skip_whitespace()
            if strict:
                trailing = "trailing comma" if after == ord("]") else "trailing characters"
                raise self.peek_error(trailing)
        elif strict:
            ending = "EOF while parsing a list" if char is None else "trailing characters"
            raise self.peek_error(ending)

    # ----- the wrong type: what serde's `invalid type` names ---------------------------------

    def invalid_type(self, expected: str) -> _JsonError:
        char = self.peek()
        if char == ord("n"):
            self.i += 1
            self.ident(b"ull")
            found = "null"
        elif char in (ord("t"), ord("f")):
            self.i += 1
            self.ident(b"rue" if char == ord("t") else b"alse")
            found = f"boolean `{'true' if char == ord('t') else 'false'}`"
        elif char == ord("-") or (char is not None and char in _DIGITS):
            found = self.number()
        elif char == ord('"'):
            self.i += 1
            found = f"string {_rust_debug(self.parse_str())}"
        elif char == ord("["):
            found = "sequence"
        elif char == ord("{"):
            found = "map"
        else:
            raise self.peek_error("expected value")
        return self.data_error(f"invalid type: {found}, expected {expected}", positioned=True)

    def ident(self, rest: bytes) -> None:
        for expected in rest:
            char = self.next_char()
            if char is None:
                raise self.error("EOF while parsing a value")
            if char != expected:
                raise self.error("expected ident")

    def number(self) -> str:
        """Read a number; how serde's `invalid type` shows it."""
        start = self.i
        self.scan_number(eof="EOF while parsing a value")
        text = self.b[start : self.i].decode()
        if not any(char in text for char in ".eE"):
            integer = int(text)
            # serde_json: u64 and i64 stay integers, `-0` and anything wider are floats.
            if 0 <= integer < 2**64 and text != "-0":
                return f"integer `{integer}`"
            if -(2**63) <= integer < 0:
                return f"integer `{integer}`"
        value = float(text)
        if math.isinf(value):
            raise self.error("number out of range")
        return f"floating point `{_rust_float(value)}`"

    # ----- strings -------------------------------------------------------------------------

    def parse_str(self) -> str:
        """A string after its opening quote, escapes decoded and UTF-8 checked."""
        out = bytearray()
        while True:
            char = self.next_char()
            if char is None:
                raise self.error("EOF while parsing a string")
            if char == ord('"'):
                break
            if char == ord("\\"):
                out += self._escape().encode("utf-8", "surrogatepass")
            elif char < 0x20:
                raise self.error("control character (\\u0000-\\u001F) found while parsing a string")
            else:
                out.append(char)
        try:
            return out.decode()
        except UnicodeDecodeError:
            raise self.error("invalid unicode code point") from None

    def _escape(self) -> str:
        char = self.next_char()
        if char is None:
            raise self.error("EOF while parsing a string")
        if char in _ESCAPES:
            return _ESCAPES[char]
        if char != ord("u"):
            raise self.error("invalid escape")
        unit = self._hex4()
        if 0xDC00 <= unit <= 0xDFFF:
            raise self.error("lone leading surrogate in hex escape")
        if not 0xD800 <= unit <= 0xDBFF:
            return chr(unit)
        for expected in b"\\u":
            char = self.peek()
            if char is None:
                raise self.error("EOF while parsing a string")
            self.i += 1
            if char != expected:
                raise self.error("unexpected end of hex escape")
        low = self._hex4()
        if not 0xDC00 <= low <= 0xDFFF:
            raise self.error("lone leading surrogate in hex escape")
        return chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))

    def _hex4(self) -> int:
        digits = self.b[self.i : self.i + 4]
        if len(digits) < 4:
            self.i = len(self.b)
            raise self.error("EOF while parsing a string")
        self.i += 4
        if not all(char in _HEX for char in digits):
            raise self.error("invalid escape")
        return int(digits, 16)

    # ----- values nobody reads (unknown fields): checked, not decoded -----------------------

    def ignore_value(self) -> None:
        """Skip one value as serde_json's `ignore_value` does (strings are not decoded)."""
        frames: list[int] = []
        while True:
            char = self.skip_whitespace()
            if char is None:
                raise self.peek_error("EOF while parsing a value")
            if char in (ord("["), ord("{")):
                self.i += 1
                frames.append(char)
                accept_comma = False
            else:
                self._ignore_scalar(char)
                if not frames:
                    return
                accept_comma = True
            while True:
                frame = frames[-1]
                close = ord("]") if frame == ord("[") else ord("}")
                char = self.skip_whitespace()
                if char == ord(",") and accept_comma:
                    self.i += 1
                    break
                if char == close:
                    self.i += 1
                    frames.pop()
                    if not frames:
                        return
                    accept_comma = True
                    continue
                in_list = frame == ord("[")
                if char is None:
                    raise self.peek_error(
                        "EOF while parsing a list" if in_list else "EOF while parsing an object"
                    )
                if accept_comma:
                    expected = "expected `,` or `]`" if in_list else "expected `,` or `}`"
                    raise self.peek_error(expected)
                break
            if frames[-1] == ord("{"):
                char = self.skip_whitespace()
                if char is None:
                    raise self.peek_error("EOF while parsing an object")
                if char != ord('"'):
                    raise self.peek_error("key must be a string")
                self.i += 1
                self._ignore_str()
                self._colon()

    def _ignore_scalar(self, char: int) -> None:
        if char in (ord("n"), ord("t"), ord("f")):
            self.i += 1
            self.ident({ord("n"): b"ull", ord("t"): b"rue", ord("f"): b"alse"}[char])
        elif char == ord('"'):
            self.i += 1
            self._ignore_str()
        elif char == ord("-") or char in _DIGITS:
            self.scan_number(eof="invalid number")
        else:
            raise self.peek_error("expected value")

    def scan_number(self, *, eof: str) -> None:
        """Consume one number's grammar (no range check). Where it ends too early a number
        being read says `eof`; an ignored one says "invalid number", as serde_json does."""
        if self.peek() == ord("-"):
            self.i += 1
        char = self.next_char()
        if char is None:
            raise self.error(eof)
        if char == ord("0"):
            if self.peek_or_null() in _DIGITS:
                raise self.peek_error("invalid number")
        elif char in _DIGITS:
            self._skip_digits()
        else:
            raise self.error("invalid number")
        if self.peek_or_null() == ord("."):
            self.i += 1
            if self.peek_or_null() not in _DIGITS:
                raise self.peek_error(eof if self.peek() is None else "invalid number")
            self._skip_digits()
        if self.peek_or_null() in b"eE":
            self.i += 1
            if self.peek_or_null() in b"+-":
                self.i += 1
            char = self.next_char()
            if char is None:
                raise self.error(eof)
            if char not in _DIGITS:
                raise self.error("invalid number")
            self._skip_digits()

    def _skip_digits(self) -> None:
        while self.peek_or_null() in _DIGITS:
            self.i += 1

    def _ignore_str(self) -> None:
        while True:
            char = self.next_char()
            if char is None:
                raise self.error("EOF while parsing a string")
            if char == ord('"'):
                return
            if char == ord("\\"):
                char = self.next_char()
                if char is None:
                    raise self.error("EOF while parsing a string")
                if char == ord("u"):
                    self._hex4()
                elif char not in _ESCAPES:
                    raise self.error("invalid escape")
            elif char < 0x20:
                raise self.error("control character (\\u0000-\\u001F) found while parsing a string")


def _rust_debug(text: str) -> str:
    """A string as Rust's `{:?}` writes it (serde's `invalid type: string "..."`)."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[char])
        elif char == "\0":
            out.append("\\0")
        elif not char.isprintable():
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _rust_float(value: float) -> str:
    """A float as serde writes it in `invalid type: floating point `...``: the shortest
    round-trip digits, plain between 1e-5 and 1e16 (`.0` when whole), else `<d>e<+|-><n>`."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    scientific = len(text) - 1 + exponent
    prefix = "-" if sign else ""
    if -5 <= scientific < 16:
        if exponent >= 0:
            return f"{prefix}{text}{'0' * exponent}.0"
        point = len(text) + exponent
        if point > 0:
            return f"{prefix}{text[:point]}.{text[point:]}"
        return f"{prefix}0.{'0' * -point}{text}"
    mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
    return f"{prefix}{mantissa}e{'+' if scientific > 0 else '-'}{abs(scientific)}"
