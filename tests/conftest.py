"""Shared pytest set-up: make ``tests/`` importable (the harness and model helpers live here),
and the ``process_group`` fixture for single-process tests that initialize an engine."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """Destroy, after the module, the one-rank process group that ``initialize`` creates, when
    the module did not start with one."""
    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()
