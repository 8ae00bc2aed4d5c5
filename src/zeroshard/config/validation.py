"""Walking the config schema by dotted key path, and turning pydantic errors into :class:`ConfigError`.

Every message names the dotted key path of the culprit (``zero_optimization.stage``); an unknown key
is reported as ``unknown key 'foo'`` with the closest known key suggested when there is one.
:func:`check_json_data` rejects, before any of that, what no JSON file can hold (objects, bytes,
non-string keys, cycles, nesting deeper than :data:`MAX_DEPTH`).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from zeroshard.errors import ConfigError

__all__ = ["MAX_DEPTH", "check_json_data", "config_error_from_validation", "known_keys", "schema_kind", "suggest_key"]

SchemaKind = Literal["model", "dict", "leaf"]


def _unwrap(annotation: Any) -> Any:
    """Strip ``Optional``/``X | None`` and ``Annotated`` from a field annotation."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _kind_of(annotation: Any) -> tuple[SchemaKind, type[BaseModel] | None]:
    inner = _unwrap(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return "model", inner
    if inner is dict or typing.get_origin(inner) is dict:
        return "dict", None
    return "leaf", None


def _walk(root: type[BaseModel], parts: Sequence[str]) -> tuple[SchemaKind, type[BaseModel] | None] | None:
    kind: SchemaKind = "model"
    model: type[BaseModel] | None = root
    for part in parts:
        if kind == "dict":
            continue  # anything below a free-form dict (optimizer.params) is allowed
        if kind == "leaf" or model is None or part not in model.model_fields:
            return None
        kind, model = _kind_of(model.model_fields[part].annotation)
    return kind, model


def schema_kind(root: type[BaseModel], path: str) -> SchemaKind | None:
    """Classify a dotted key path against the schema rooted at ``root``.

    Args:
        root: the top-level model class.
        path: dotted key path such as ``"zero_optimization.stage"`` or ``"optimizer.params.lr"``.

    Returns:
        ``"model"`` for a config block, ``"dict"`` for a free-form dict or a key inside one, ``"leaf"`` for
        a scalar field, or None when the path is not part of the schema.
    """
    found = _walk(root, [p for p in path.split(".") if p] or [""])
    if found is None:
        return None
    return found[0]


def known_keys(root: type[BaseModel], parent: Sequence[str]) -> list[str]:
    """Return the keys allowed in the block at ``parent`` (a sequence of keys; empty for the top level)."""
    found = _walk(root, parent)
    if found is None or found[1] is None:
        return []
    return list(found[1].model_fields)


def suggest_key(name: str, candidates: Sequence[str]) -> str | None:
    """Return the candidate closest to ``name`` (difflib), or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(name: str, candidates: Sequence[str]) -> str:
    """Return ``unknown key 'name'`` plus a did-you-mean suggestion when one is close."""
    message = f"unknown key {name!r}"
    suggestion = suggest_key(name, candidates)
    if suggestion is not None:
        message += f" (did you mean {suggestion!r}?)"
    return message


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_error_from_validation(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """Convert a pydantic ``ValidationError`` into one :class:`ConfigError` naming the key path(s).

    Args:
        exc: the error raised by validating a dict against ``root``.
        root: the model class that was validated (used to suggest known keys).

    Returns:
        A ConfigError whose ``key`` is the dotted path of the first problem; further problems are appended
        to the message.
    """
    problems: list[tuple[str | None, str]] = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        key = ".".join(loc) or None
        if err["type"] == "extra_forbidden" and loc:
            message = unknown_key_message(loc[-1], known_keys(root, loc[:-1]))
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = str(err["msg"])
            if "input" in err and err["type"] != "value_error":
                message += f" (got {_short_repr(err['input'])})"
        problems.append((key, message))
    key, message = problems[0]
    if len(problems) > 1:
        others = "; ".join(f"{k}: {m}" if k else m for k, m in problems[1:])
        message += f"; also {others}"
    return ConfigError(message, key=key)


MAX_DEPTH = 32
"""Deepest nesting of dicts and lists accepted in a config (DeepSpeed's own configs use 4 levels)."""


def check_json_data(value: Any, key: str | None = None, depth: int = 0) -> None:
    """Check that ``value`` is data a JSON file could hold: dicts with string keys, lists (or tuples),
    strings, numbers, booleans and None, nested at most :data:`MAX_DEPTH` levels (so cycles fail too).

    Args:
        value: a config, a part of one, or an ``auto_values`` value.
        key: dotted key path of ``value``, for the message (None for the whole config).
        depth: nesting level of ``value``.

    Raises:
        ConfigError: naming the key path of the first offending value.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if depth >= MAX_DEPTH:
        problem = f"nested more than {MAX_DEPTH} levels deep (a cycle?)"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"keys must be strings, got {_short_repr(k)}", key=key)
            check_json_data(v, k if key is None else f"{key}.{k}", depth + 1)
        return
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_data(v, f"{key or ''}[{i}]", depth + 1)
        return
    else:
        problem = (f"a {type(value).__module__}.{type(value).__qualname__} is not JSON data "
                   "(expected a dict, list, string, number, boolean or null)")
    if key == "":  # the empty key: a dotted path cannot show it
        problem += " (at key '')"
    raise ConfigError(problem, key=key or None)
