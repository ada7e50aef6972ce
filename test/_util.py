"""Helpers shared by the tests."""

import pytest

from sgl_ecospec import has_native

requires_native = pytest.mark.skipif(not has_native(), reason="sgl_ecospec._C is not built")

IMPLS = [
    "reference",
    pytest.param("native", marks=requires_native),
]


def compared_under_interpreter(module: str) -> int:
    """Runs ``test/<module>.py``'s ``compare_with_triton()`` in a fresh interpreter with
    ``TRITON_INTERPRET=1`` (it must be set before triton is imported) and returns how many
    cases it compared; fails the test with the child's stderr when it raises."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import {module}
        print("compared", {module}.compare_with_triton())
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    label, count = result.stdout.split()[-2:]
    assert label == "compared", result.stdout[-2000:]
    return int(count)
