"""Helpers shared by the tests."""

import pytest

from sgl_ecospec import has_native

requires_native = pytest.mark.skipif(not has_native(), reason="sgl_ecospec._C is not built")

IMPLS = [
    "reference",
    pytest.param("native", marks=requires_native),
]
