import os

import pytest

from sgl_ecospec import has_native
from sgl_ecospec.ops.native import NATIVE_ERROR


def pytest_report_header(config):
    return f"sgl_ecospec._C built: {has_native()}"


def pytest_sessionstart(session):
    # CI builds the extension; a missing one there must fail, not turn tests into skips.
    if os.environ.get("CI") == "true" and not has_native():
        raise pytest.UsageError(f"CI requires sgl_ecospec._C, which failed to load: {NATIVE_ERROR}")


def pytest_collection_modifyitems(config, items):
    # Every e2e test is also slow, so `-m "not slow"` alone is the fast inner loop.
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
