"""The kinds of field a job spec is made of, and a refusal of one in the spec's own words.

Owns: how a field is declared (``described``, ``extension_point``), what pydantic converts
before it checks a type (a number written as text, names separated by commas, an empty
section), what it holds every section to (``Checked``), and how its refusal becomes today's
``SpecError`` (``refusal``: the dotted field, the value given, what is expected, and for an
unknown key the field it is closest to). The fields themselves are ``raytrain_sys.spec``.

Pydantic is imported only when a validator is built (``raytrain_sys.spec._adapter``): declaring
the spec costs no pydantic import. Imports nothing of raytrain_sys but errors.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import field
from typing import Annotated, Any, Callable, TypeVar

from raytrain_sys.errors import SpecError, quote

INT_LIMIT = 2 ** 63  # every integer of the spec ends in a 64-bit one (a tensor's shape, a seed, a count)
FIELD_NAME_CHARS = 64  # a key longer than any field's name is quoted, not echoed, in the field of an error
# A number as text: PyYAML follows YAML 1.1, where `3e-3` (no dot) is a string; YAML 1.2 and every
# user read it as a number.
NUMBER_TEXT = r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?"


class _Accepts:
    """Pydantic metadata for a field's type (``Annotated[float, _Accepts(...)]``): ``convert``
    turns what a user may write for the type into it before pydantic checks the type, and the
    JSON schema admits ``written`` as well. Pydantic is imported only when a validator is built."""

    def __init__(self, convert: Callable[[Any], Any], written: dict[str, Any] | None = None):
        self.convert, self.written = convert, written

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self.convert, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {"anyOf": [handler(schema), self.written]} if self.written else handler(schema)


def _integer(value: Any) -> Any:
    """An integral number (``185.0``) is its int: JSON Schema's ``integer`` is any number without a
    fraction, and a JSON writer may send 185 so (JavaScript's numbers cannot tell them apart), as
    the API's other integer fields take it. 185.5, "185" and true stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _number(value: Any) -> Any:
    """A number written as text is the number; an integer past 64 bits is past any float the
    spec means (infinite, so refused as one)."""
    if isinstance(value, str) and re.fullmatch(NUMBER_TEXT, value.strip()):
        return float(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
        return math.inf
    return value


def _names(value: Any) -> Any:
    """``--set data.columns=x,y`` is the list [x, y]; a tuple is its list."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value) if isinstance(value, tuple) else value


def _section(value: Any) -> Any:
    """A section left empty (``train:`` with nothing under it) has every default; anything but a
    mapping is refused (a section given as a dataclass too: a spec is data)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("not a mapping of fields")
    return value


class _Within:
    """Pydantic metadata for an integer: at least ``low`` and below ``high`` (its JSON schema's
    minimum and exclusiveMaximum)."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        return {**handler(source), "ge": self.low, "lt": self.high}


Integer = Annotated[int, _Within(-INT_LIMIT, INT_LIMIT), _Accepts(_integer)]
Number = Annotated[float, _Accepts(_number, {"type": "string", "pattern": rf"^\s*{NUMBER_TEXT}\s*$"})]
Names = Annotated[list[str], _Accepts(_names, {"type": "string", "description": "names separated by commas"})]
SectionClass = TypeVar("SectionClass")
Section = Annotated[SectionClass, _Accepts(_section, {"type": "null", "description": "every field at its default"})]


class Checked:
    """What pydantic holds every section to beyond each field's type: no key that is not a
    field, no infinite or NaN number."""

    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}


def described(default: Any, description: str) -> Any:
    """A field with its default and what it means (the reference's and the API schema's words),
    checked strictly: no text for a number, no number for true/false (``_Accepts`` says what is
    converted). An empty mapping or list as the default is a new one for each spec."""
    meta = {"description": description, "strict": True}
    if isinstance(default, (dict, list)):
        assert not default, "a default mapping or list is empty: each spec gets its own"
        return field(default_factory=type(default), metadata={**meta, "json_schema_extra": {"default": default}})
    return field(default=default, metadata=meta)


def extension_point(default: str, description: str) -> Any:
    """A field that names user code: an import path "pkg.module:name", or from Python the object
    itself (checked by ``spec_rules``, not by its type)."""
    return field(default=default, metadata={"description": description})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _key(key: Any) -> str:
    """A mapping key as a field's name in an error: itself, or its quote if it could not be one."""
    text = str(key)
    return text if len(text) <= FIELD_NAME_CHARS and text.isprintable() else quote(key, FIELD_NAME_CHARS)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _wrong_type(value: Any, kind: Any) -> str:
    """What is wrong with ``value``, refused for a field of type ``kind``, and what to give."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # int | None: None was taken
        kind = next(arm for arm in typing.get_args(kind) if arm is not type(None))
    kind = typing.get_origin(kind) or kind  # list[str]: a list
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and number and (isinstance(value, int) or value.is_integer()):
        return f"got {quote(value)}; expected an integer of 64 bits (-2**63 .. 2**63-1)"
    if kind is int and isinstance(value, bool):
        return f"got {quote(value)}; expected an integer"
    if kind is float and (number or isinstance(value, str) and re.fullmatch(NUMBER_TEXT, value.strip())):
        return f"got {quote(value)}; expected a finite number"
    if kind is list:
        return f"got {quote(value)}; expected a list of names, e.g. [a, b]"
    if kind is dict:
        return f"got {quote(value)} ({type(value).__name__}); expected a mapping"
    return f"got {quote(value)} ({type(value).__name__}); expected {_TYPE_NAMES[kind]}"


def refusal(spec_class: type, raw: Any, errors: list[Any]) -> SpecError:
    """The field pydantic refused that comes first in the spec as written (the one its reader
    meets first): an unknown key with the field it is closest to, a section that is not a
    mapping, or a value with what its field expects."""
    def position(error: Any) -> list[int]:
        node, where = raw, []
        for key in error["loc"]:
            if not isinstance(node, dict) or key not in node:
                break
            where.append(list(node).index(key))
            node = node[key]
        return where

    cls, path, value = spec_class, [], raw
    for key in min(errors, key=position)["loc"]:
        if isinstance(value, dict) and key in value:  # the key as written: pydantic says 1 for a key true
            key = list(value)[list(value).index(key)]
        names = [f.name for f in dataclasses.fields(cls)]
        path.append(_key(key))
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return SpecError(".".join(path), f"unknown field{hint}; allowed: {', '.join(names)}")
        value, kind = value[key], _hints(cls)[key]
        if not dataclasses.is_dataclass(kind):
            return SpecError(".".join(path), _wrong_type(value, kind))
        cls = kind
    return SpecError(".".join(path) or "the spec",
                     f"expected a mapping of fields, got {type(value).__name__} {quote(value)}")


def written_in_place(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with each ``$ref`` to its ``$defs`` replaced by the definition itself (a
    spec's sections are not recursive), so that a larger document can hold it whole."""
    defs = schema.get("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            merged = {**defs[ref.rsplit("/", 1)[1]], **node} if ref else node
            return {k: inline(v) for k, v in merged.items() if k not in ("$ref", "$defs")}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return inline(schema)
