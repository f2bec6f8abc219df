"""The base of the typed control messages (``transport/control.py``): encoding and checked decoding.

Every control call carries one of these dataclasses as a msgpack map (``to_wire``) with the
message version ``v``; ``from_wire`` checks the version and every field's type before anything
uses it, so a malformed or hostile message fails as a ``WireError`` naming the field, never as a
``KeyError`` deep in a handler. Fields are plain data (numbers, strings, bytes, lists and maps of
them, nested messages): no code and no pickles cross a process boundary.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from fusionllm.core.errors import WireError

VERSION = 1
M = TypeVar("M", bound="Message")


class Message:
    """Base of the control messages: (de)serialisation with validation."""

    name: ClassVar[str] = "message"

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: _out(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        out["v"] = VERSION
        return out

    @classmethod
    def from_wire(cls: type[M], raw: Any) -> M:
        if not isinstance(raw, dict):
            raise WireError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        if raw.get("v", VERSION) != VERSION:
            raise WireError(f"{cls.__name__}: message version {raw.get('v')!r}, this side speaks {VERSION} (run the same fusionllm everywhere)")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in raw:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"{cls.__name__}: field {f.name!r} is missing")
                continue
            values[f.name] = _check(raw[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
        return cls(**values)


def _out(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, list):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


def _check(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        raise WireError(f"{where}: untyped field")  # message types name every field's type
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            try:
                return _check(value, option, where)
            except WireError as exc:
                errors.append(exc)
        real = [e for o, e in zip(get_args(tp), errors, strict=True) if o is not type(None)]
        if len(real) == 1 and value is not None:
            raise real[0]  # an optional field: the reason its value is wrong
        raise WireError(f"{where}: {type(value).__name__} is none of {tp}")
    if tp is type(None):
        if value is not None:
            raise WireError(f"{where}: expected nothing, got {type(value).__name__}")
        return None
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp.from_wire(value)
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(tp)
        return [_check(v, item, f"{where}[]") for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = get_args(tp)
        return {_check(k, kt, f"{where} key"): _check(v, vt, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WireError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bytes, bool):
        if not isinstance(value, tp):
            raise WireError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise WireError(f"{where}: unsupported field type {tp}")
