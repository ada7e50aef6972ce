"""Fixtures shared by the ops tests."""

import pytest
from _util import IMPLS


@pytest.fixture(params=IMPLS)
def impl(request):
    """Each implementation of the ops: the reference, and the native op when built."""
    return request.param
