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


def fill_union_tags(model: type[BaseModel], values: dict[str, Any]) -> None:
    """Give each section chosen by a tag (``loss``, ``scheduler``) that the sources set without it its default's
    tag, in place: ``--loss.clip-high 0.3`` tunes the default objective, where pydantic cannot pick a member."""
    for name, info in model.model_fields.items():
        key = name if name in values else info.alias
        value = values.get(key) if key else None
        if not isinstance(value, dict):
            continue
        tag = info.discriminator
        if isinstance(tag, str) and tag not in value and not getattr(info, "default_factory_takes_data", False):
            default = info.get_default(call_default_factory=True)
            if isinstance(default, BaseModel) and hasattr(default, tag):
                value[tag] = getattr(default, tag)
        members = _models_in(info.annotation)
        if isinstance(tag, str):
            members = [m for m in members if tag in m.model_fields and m.model_fields[tag].default == value.get(tag)]
        for sub in members:
            fill_union_tags(sub, value)


def tags_with_key(model: type[BaseModel], loc: Sequence[str]) -> list[str]:
    """For ``loc`` inside a section chosen by ``type``: the types that have its last key (``loss.seq_clip`` set
    while ``loss.type`` is another one)."""
    models = [model]
    for part in loc[:-1]:
        models = _models_in(_fields_of(models).get(part))
    return [
        str(m.model_fields["type"].default) for m in models if "type" in m.model_fields and loc[-1] in m.model_fields
    ]
