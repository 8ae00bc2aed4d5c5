"""Batch-size arithmetic with DeepSpeed's semantics.

``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``. Any two
determine the third; ``train_batch_size`` alone gives accumulation 1; the micro batch alone gives
accumulation 1; accumulation alone, or nothing, is an error. Unlike DeepSpeed, a derived value that
does not divide evenly is an error instead of being rounded down.
"""

from __future__ import annotations

from collections.abc import Collection

from zeroshard.errors import ConfigError

__all__ = ["BATCH_KEYS", "resolve_batch_sizes"]

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)
"""The three batch-size keys, in DeepSpeed's order."""


def _ranks(world_size: int) -> str:
    return f"{world_size} rank" if world_size == 1 else f"{world_size} ranks"


def _divide(tbs: int, divisor: int, divisor_text: str, derived: str) -> int:
    if tbs % divisor:
        raise ConfigError(
            f"train_batch_size {tbs} is not divisible by {divisor_text} (= {divisor}), "
            f"so {derived} cannot be derived",
            key=TBS,
        )
    return tbs // divisor


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
    auto_keys: Collection[str] = (),
) -> tuple[int, int, int]:
    """Complete and check the batch-size triple for ``world_size`` data-parallel ranks.

    Args:
        train_batch_size: global batch size per optimizer step, or None if not set.
        train_micro_batch_size_per_gpu: per-rank micro batch size, or None if not set.
        gradient_accumulation_steps: micro-steps per optimizer step, or None if not set.
        world_size: number of data-parallel ranks (>= 1).
        auto_keys: keys that were ``"auto"`` (passed as None); each must be derivable from the other two,
            which must both be set.

    Returns:
        ``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``.

    Raises:
        ConfigError: the values are inconsistent, not divisible, or underdetermined.
    """
    values = {TBS: train_batch_size, MICRO: train_micro_batch_size_per_gpu, GAS: gradient_accumulation_steps}
    for key in BATCH_KEYS:
        if key in auto_keys:
            others = [k for k in BATCH_KEYS if k != key]
            if any(values[k] is None or k in auto_keys for k in others):
                raise ConfigError(
                    f"'{key}' is \"auto\" and cannot be derived because {others[0]} and {others[1]} are not "
                    f'both set: pass its value in initialize(auto_values={{"{key}": ...}})',
                    key=key,
                )
            values[key] = None
    tbs, micro, gas = values[TBS], values[MICRO], values[GAS]
    ranks = _ranks(world_size)

    if tbs is not None and micro is not None and gas is not None:
        pass
    elif tbs is not None and micro is not None:
        gas = _divide(tbs, micro * world_size, f"{MICRO} {micro} * {ranks}", GAS)
    elif tbs is not None and gas is not None:
        micro = _divide(tbs, gas * world_size, f"{GAS} {gas} * {ranks}", MICRO)
    elif micro is not None and gas is not None:
        tbs = micro * gas * world_size
    elif tbs is not None:
        gas = 1
        micro = _divide(tbs, world_size, ranks, f"{MICRO} (with {GAS} 1)")
    elif micro is not None:
        gas = 1
        tbs = micro * world_size
    else:
        raise ConfigError(
            f"set {TBS} or {MICRO} (with {GAS} alone, or nothing, the batch size is undetermined)",
            key=None,
        )

    if tbs != micro * gas * world_size:
        raise ConfigError(
            f"{TBS} {tbs} != {MICRO} {micro} * {GAS} {gas} * {ranks} (= {micro * gas * world_size})",
            key=None,
        )
    return tbs, micro, gas
