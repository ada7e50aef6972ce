"""Helpers shared by the tests."""

import pytest
import torch

from sgl_ecospec import has_native

requires_native = pytest.mark.skipif(not has_native(), reason="sgl_ecospec._C is not built")

IMPLS = [
    "reference",
    pytest.param("native", marks=requires_native),
]


def compared_under_interpreter(test_file: str) -> int:
    """Runs the test module ``test_file``'s ``compare_with_triton()`` in a fresh interpreter
    with ``TRITON_INTERPRET=1`` (it must be set before triton is imported) and returns how
    many cases it compared; fails the test with the child's stderr when it raises."""
    import os
    import subprocess
    import sys
    import textwrap

    folder, module = os.path.split(os.path.splitext(os.path.abspath(test_file))[0])
    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.set_num_threads(1)
        sys.path[:0] = [{folder!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
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


def clone_args(args, kwargs, contiguous_only=False):
    """Copies of the tensors among ``args`` and ``kwargs`` (only the contiguous ones with
    ``contiguous_only``: views into a shared buffer stay shared); other values as they are."""

    def copy(x):
        if isinstance(x, torch.Tensor) and (x.is_contiguous() or not contiguous_only):
            return x.clone()
        return x

    return [copy(a) for a in args], {k: copy(v) for k, v in kwargs.items()}


def run_both(theirs, ours, args, kwargs, contiguous_only=False):
    """Runs ``theirs(*args, **kwargs)`` and ``ours`` on copies (:func:`clone_args`) of the same
    inputs, for kernels that write their outputs in place; returns ours' arguments."""
    ours_args, ours_kwargs = clone_args(args, kwargs, contiguous_only)
    theirs(*args, **kwargs)
    ours(*ours_args, **ours_kwargs)
    return ours_args, ours_kwargs
