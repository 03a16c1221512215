"""Fixtures of the server tests."""

from __future__ import annotations

import pytest
from server_utils import served


@pytest.fixture(scope="module")
def server(model_dir):
    """A server over the tiny model with the default limits, one per test module (a module that
    needs other limits or options defines its own)."""
    with served(model_dir) as srv:
        yield srv
