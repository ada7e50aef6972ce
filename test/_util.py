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


# --- graph safety (test/ops/test_graph_safety.py, test/predictors/test_online_graph.py) -----

# aten ops that read a tensor's values on the host or give a shape that depends on them.
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


class Recorder:
    """A torch.compile backend that keeps each graph Dynamo hands it, then runs ``backend``."""

    def __init__(self, backend: str):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend = lookup_backend(backend)
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    def calls_native(self) -> bool:
        # A native op shows as torch.ops.sgl_ecospec.<op>, printed "sgl_ecospec.<op>...".
        return any(
            node.op == "call_function" and str(node.target).startswith("sgl_ecospec.")
            for gm in self.graphs
            for node in gm.graph.nodes
        )


def compile_once(fn, backend: str):
    """``fn`` compiled as one graph (fullgraph), and the recorder that sees its graphs."""
    recorder = Recorder(backend)
    return torch.compile(fn, fullgraph=True, backend=recorder), recorder


def host_syncs(fn, *args) -> list[str]:
    """The ops of ``fn``'s FakeTensor trace that would sync with the host (see SYNC_OPS, and
    indexing with a boolean mask); tracing itself fails on ``bool(tensor)`` or ``.item()``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        name = node.target._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            found.append(str(node.target))
        elif name in INDEX_OPS:
            indices = node.args[1] if len(node.args) > 1 else []
            masks = [
                i
                for i in indices
                if isinstance(i, torch.fx.Node) and i.meta["val"].dtype in (torch.bool, torch.uint8)
            ]
            if masks:
                found.append(f"{node.target} with a boolean mask")
    return found
