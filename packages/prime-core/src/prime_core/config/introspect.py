"""What a config class's annotations say about its keys: sections, lists, dicts, booleans and every dotted key."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete alternatives of an annotation (Optional/Union/Annotated flattened)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                out.extend(_unwrap(arg))
        return out
    return [annotation]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    return [a for a in _unwrap(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]


def _fields_of(models: list[type[BaseModel]]) -> dict[str, Any]:
    """Union of the fields of several models (for discriminated unions): name -> annotation."""
    fields: dict[str, Any] = {}
    for model in models:
        for name, info in model.model_fields.items():
            fields.setdefault(name, info.annotation)
            if info.alias:
                fields.setdefault(info.alias, info.annotation)
    return fields


def _is_dict_type(annotation: Any) -> bool:
    return any(typing.get_origin(a) in (dict, Mapping) or a is dict for a in _unwrap(annotation))


def _is_list_type(annotation: Any) -> bool:
    return any(typing.get_origin(a) in (list, tuple, set, Sequence) or a in (list, tuple) for a in _unwrap(annotation))


def _is_bool_type(annotation: Any) -> bool:
    alts = _unwrap(annotation)
    return bool(alts) and all(a is bool for a in alts)


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config class (for suggestions and help)."""
    keys = []
    for name, annotation in _fields_of([model]).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        for sub in _models_in(annotation):
            keys.extend(all_keys(sub, dotted + "."))
    return sorted(set(keys))
