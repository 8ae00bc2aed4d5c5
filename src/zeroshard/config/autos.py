"""Resolution of Hugging Face-style ``"auto"`` values.

Any key of the schema may be the string ``"auto"``. Resolution, in order:

1. a value in ``auto_values`` (keyed by dotted path, e.g. ``{"optimizer.params.lr": 1e-4}``);
2. batch-size keys: derived by the batch arithmetic from the other two (see :mod:`.batch`);
3. ZeRO bucket sizes and stage-3 thresholds (:data:`AUTO_DEFAULT_KEYS`): the schema default, which is
   DeepSpeed's default, announced in an info log;
4. anything else: a :class:`ConfigError` asking for the value.

A key of ``auto_values`` that is not ``"auto"`` in the config must equal the resolved config value.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from zeroshard.config.batch import BATCH_KEYS
from zeroshard.config.compat import normalize_path
from zeroshard.config.validation import check_json_data, known_keys, schema_kind, unknown_key_message
from zeroshard.config.zero import ZeroConfig
from zeroshard.errors import ConfigError

__all__ = ["AUTO", "AUTO_DEFAULT_KEYS", "check_auto_values_agree", "normalize_auto_values", "resolve_autos"]

logger = logging.getLogger("zeroshard")

AUTO = "auto"

AUTO_DEFAULT_KEYS: tuple[str, ...] = tuple(
    f"zero_optimization.{name}"
    for name in (
        "reduce_bucket_size",
        "allgather_bucket_size",
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    )
)
"""Keys whose ``"auto"`` falls back to the schema (DeepSpeed) default when ``auto_values`` lacks them."""


def _find_autos(node: Any, root: type[BaseModel], prefix: str, out: list[str]) -> None:
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        path = f"{prefix}{key}"
        kind = schema_kind(root, path)
        if kind is None:
            continue  # unknown keys are reported by validation
        if isinstance(value, str) and value == AUTO:
            out.append(path)
        elif kind in ("model", "dict"):
            _find_autos(value, root, path + ".", out)


def _set(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[last] = value


def normalize_auto_values(root: type[BaseModel], auto_values: Mapping[str, Any] | None) -> dict[str, Any]:
    """Canonicalize the keys of ``auto_values`` and check that each is a key path of the schema.

    Raises:
        ConfigError: a key is not a config key path, or a value is itself ``"auto"`` or not JSON data.
    """
    result: dict[str, Any] = {}
    for raw_key, value in (auto_values or {}).items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"auto_values keys must be dotted key paths (str), got {raw_key!r}")
        key = normalize_path(raw_key)
        if schema_kind(root, key) is None:
            parts = key.split(".")
            raise ConfigError(
                "auto_values: " + unknown_key_message(parts[-1], known_keys(root, parts[:-1])), key=key
            )
        if isinstance(value, str) and value == AUTO:
            raise ConfigError('auto_values must give a concrete value, not "auto"', key=key)
        check_json_data(value, key)
        result[key] = value
    return result


def resolve_autos(
    raw: dict[str, Any], root: type[BaseModel], auto_values: Mapping[str, Any]
) -> tuple[set[str], set[str]]:
    """Replace the ``"auto"`` values of ``raw`` in place.

    Batch-size keys that stay ``"auto"`` (no value in ``auto_values``) are set to None and returned, for
    :func:`~zeroshard.config.batch.resolve_batch_sizes` to derive.

    Args:
        raw: the config dict (aliases already normalized).
        root: the top-level model class.
        auto_values: canonical dotted path -> value (see :func:`normalize_auto_values`).

    Returns:
        ``(auto_keys, batch_autos)``: every path that was ``"auto"``, and the batch-size keys among them
        left to the batch arithmetic.

    Raises:
        ConfigError: some ``"auto"`` key has no value and no default.
    """
    paths: list[str] = []
    _find_autos(raw, root, "", paths)
    batch_autos: set[str] = set()
    missing: list[str] = []
    for path in paths:
        if path in auto_values:
            _set(raw, path, copy.deepcopy(auto_values[path]))
        elif path in BATCH_KEYS:
            _set(raw, path, None)
            batch_autos.add(path)
        elif path in AUTO_DEFAULT_KEYS:
            default = ZeroConfig.model_fields[path.split(".", 1)[1]].default
            logger.info(
                '%s is "auto": using DeepSpeed\'s default %d (pass initialize(auto_values={"%s": ...}) to '
                "choose another value)",
                path,
                default,
                path,
            )
            _set(raw, path, default)
        else:
            missing.append(path)
    if missing:
        names = ", ".join(f"'{p}'" for p in missing)
        verb, their = ("is", "its value") if len(missing) == 1 else ("are", "their values")
        wanted = ", ".join(f'"{p}": ...' for p in missing)
        raise ConfigError(
            f'{names} {verb} "auto": pass {their} in initialize(auto_values={{{wanted}}})', key=missing[0]
        )
    return set(paths), batch_autos


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def check_auto_values_agree(resolved: dict[str, Any], auto_values: Mapping[str, Any], used: set[str]) -> None:
    """Check that every ``auto_values`` entry that filled no ``"auto"`` equals the resolved config value.

    Args:
        resolved: the resolved config as a JSON-like dict (``to_dict``).
        auto_values: canonical dotted path -> value.
        used: the paths that were ``"auto"`` in the config.

    Raises:
        ConfigError: an entry contradicts the config, or names a key the config does not set.
    """
    for path, value in auto_values.items():
        if path in used:
            continue
        node: Any = resolved
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(
                    f"auto_values gives {value!r} but the config does not set this key; "
                    'auto_values only fills keys whose value is "auto"',
                    key=path,
                )
            node = node[part]
        if _jsonable(value) != node:
            raise ConfigError(
                f"auto_values gives {value!r} but the config sets {node!r}; "
                'auto_values only fills keys whose value is "auto"',
                key=path,
            )
