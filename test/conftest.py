import os

import pytest
import torch

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


@pytest.fixture(scope="session", autouse=True)
def no_gate_memory():
    """Servers the tests start keep no gate memory (``SGLANG_ECOSPEC_GATE_MEMORY=off``), so
    one test's decisions never reach another's server (or the next run's); a test of the
    memory gives its own directory."""
    before = os.environ.get("SGLANG_ECOSPEC_GATE_MEMORY")
    os.environ["SGLANG_ECOSPEC_GATE_MEMORY"] = "off"
    yield
    if before is None:
        os.environ.pop("SGLANG_ECOSPEC_GATE_MEMORY", None)
    else:
        os.environ["SGLANG_ECOSPEC_GATE_MEMORY"] = before


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: tiny models and tables gain nothing from
    more, and on a busy 2-core machine the spinning threads make these tests several times
    slower (an ``index_add_`` with repeated rows hundreds of times). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """A reset dynamo around each test: every test compiles its own functions, so no cache
    (or recompile limit) carries over. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
