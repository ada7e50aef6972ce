"""Every launcher of the native ops checks its arguments alike (csrc/checks.h).

The CPU, CUDA and Meta kernels of ``torch.ops.sgl_ecospec.*`` all call one C++ check, so
the same bad input must fail with the same error type and message on each. The ops are
called raw here (the Python wrappers check first and would hide the native checks). The
Meta kernel is the CUDA launcher's shared check run without a GPU; the CUDA launcher
itself is compared where a GPU is present.
"""

import math
import re

import pytest
import torch

from sgl_ecospec.ops.native import has_native, has_native_kernel
from sgl_ecospec.ops.options import SelectionOptions
from sgl_ecospec.ops.selection import native_arguments

pytestmark = pytest.mark.skipif(not has_native(), reason="sgl_ecospec._C is not built")

CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
HAS_GPU = torch.cuda.is_available() and has_native_kernel("select_verify_set", torch.device("cuda"))
LAUNCHERS = [
    "cpu",
    "meta",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not HAS_GPU, reason="needs a GPU and the CUDA build of _C"),
    ),
]


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def call(launcher: str, op: str, args: list):
    """Runs ``op``'s kernel for ``launcher`` on ``args`` (CPU tensors, moved to the
    launcher's device; tensors already on meta stay there)."""
    overload = getattr(torch.ops.sgl_ecospec, op).default
    if launcher == "cpu":
        # Redispatch straight to the CPU kernel: with a meta tensor among the inputs the
        # dispatcher would otherwise pick the Meta kernel.
        return overload.redispatch(CPU_KEYS, *args)
    device = torch.device(launcher)
    moved = [a if isinstance(a, torch.Tensor) and a.is_meta else _to(a, device) for a in args]
    return overload(*moved)


def select_names() -> list[str]:
    """select_verify_set's argument names, in its schema's order."""
    return [a.name for a in torch.ops.sgl_ecospec.select_verify_set.default._schema.arguments]


def select_args(**changes) -> list:
    """A valid call's arguments, in the schema's order as the Python wrapper builds them
    (``native_arguments``), with ``changes`` by the schema's argument names."""
    tensors = [torch.tensor([[0.5, 0.4]]), torch.tensor([[-1, 0]]), torch.zeros((1, 2, 1, 1))]
    tensors[2] = tensors[2].long()  # node_experts: int64 bitmaps
    valid = native_arguments(*tensors, 1, None, None, None, SelectionOptions(), 1, 0.0)
    args = dict(zip(select_names(), valid, strict=True))
    unknown = set(changes) - set(args)
    assert not unknown, unknown
    args.update(changes)
    return list(args.values())


LONG = torch.long
SELECT_CASES = {
    # dtypes
    "scores int": (dict(scores=torch.tensor([[1, 2]])), TypeError, "scores must have dtype"),
    "parents float": (dict(parents=torch.tensor([[-1.0, 0.0]])), TypeError, "parents must have"),
    "node_experts int32": (
        dict(node_experts=torch.zeros((1, 2, 1, 1), dtype=torch.int32)),
        TypeError,
        "node_experts must have dtype int64, got int32",
    ),
    # The CUDA launcher used to convert these; every launcher now requires int64.
    "root_experts int32": (
        dict(root_experts=torch.zeros((1, 1, 1), dtype=torch.int32)),
        TypeError,
        "root_experts must have dtype int64",
    ),
    "layer_weights int": (dict(layer_weights=torch.ones(1, dtype=LONG)), TypeError, "float32"),
    "expert_rank float": (dict(expert_rank=torch.zeros(8)), TypeError, "int32 or int64"),
    # shapes
    "scores 3d": (dict(scores=torch.zeros(1, 2, 1)), ValueError, r"scores must be \[B, N\]"),
    "parents N": (
        dict(parents=torch.tensor([[-1, 0, 1]])),
        ValueError,
        r"parents must be \[B, N\] with N = 2 \(from scores\), got shape \[1, 3\]",
    ),
    "node_experts 3d": (
        dict(node_experts=torch.zeros((1, 2, 1), dtype=LONG)),
        ValueError,
        r"node_experts must be \[B, N, L, W\]",
    ),
    "node_experts B": (
        dict(node_experts=torch.zeros((2, 2, 1, 1), dtype=LONG)),
        ValueError,
        "with B = 1",
    ),
    "root_experts L": (
        dict(root_experts=torch.zeros((1, 2, 1), dtype=LONG)),
        ValueError,
        r"root_experts must be \[B, L, W\] with L = 1 \(from node_experts\)",
    ),
    "layer_weights L": (dict(layer_weights=torch.ones(2)), ValueError, "with L = 1"),
    "expert_rank W": (dict(expert_rank=torch.zeros(65, dtype=LONG)), ValueError, "W = ceil"),
    "expert_rank L": (dict(expert_rank=torch.zeros((2, 8), dtype=LONG)), ValueError, "L = 1"),
    "expert_rank 3d": (
        dict(expert_rank=torch.zeros((1, 1, 8), dtype=LONG)),
        ValueError,
        r"expert_rank must be \[E\] or \[L, E\]",
    ),
    # scalars
    "budget": (dict(budget=-1), ValueError, "budget must be >= 0, got -1"),
    "policy": (dict(policy="fastest"), ValueError, "unknown policy 'fastest'"),
    "eps 0": (dict(eps=0.0), ValueError, "eps must be finite and > 0"),
    "eps < 0": (dict(eps=-1.0), ValueError, "eps must be finite and > 0"),
    "eps nan": (dict(eps=math.nan), ValueError, "eps must be finite and > 0, got nan"),
    "eps inf": (dict(eps=math.inf), ValueError, "eps must be finite and > 0"),
    "num_ranks": (dict(num_ranks=0), ValueError, "num_ranks must be >= 1, got 0"),
    "total_weight 2": (dict(total_weight=2.0), ValueError, r"total_weight must lie in \[0, 1\]"),
    "total_weight nan": (dict(total_weight=math.nan), ValueError, "total_weight must lie"),
    "step_tokens": (dict(step_tokens=-1.0), ValueError, "step_tokens must be finite and >= 0"),
    "step_cost": (dict(step_cost=0.0), ValueError, "step_cost must be finite and > 0"),
    "adaptive without step_cost": (
        dict(policy="adaptive"),
        ValueError,
        "policy 'adaptive' needs step_cost",
    ),
    "candidate_cost": (
        dict(candidate_cost=-1.0),
        ValueError,
        "candidate_cost must be finite and >= 0",
    ),
    "candidate_decay": (
        dict(candidate_decay=1.5),
        ValueError,
        r"candidate_decay must lie in \[0, 1\]",
    ),
    "min_score negative": (dict(min_score=-0.1), ValueError, "min_score must be finite and >= 0"),
    "min_score nan": (dict(min_score=math.nan), ValueError, "min_score must be finite and >= 0"),
}

BITMAP_CASES = {
    "topk_ids 1d": (
        "topk_to_bitmap",
        [torch.tensor([1, 2]), 8],
        ValueError,
        r"topk_ids must be \[\.\.\., L, K\], got shape \[2\]",
    ),
    "topk_ids float": ("topk_to_bitmap", [torch.zeros(2, 2), 8], TypeError, "int32 or int64"),
    "num_experts": (
        "topk_to_bitmap",
        [torch.zeros((2, 2), dtype=LONG), 0],
        ValueError,
        "num_experts must be >= 1, got 0",
    ),
    "bitmaps 0d": ("bitmap_popcount", [torch.tensor(3)], ValueError, r"must be \[\.\.\., W\]"),
    "bitmaps int32": (
        "bitmap_popcount",
        [torch.zeros(2, 1, dtype=torch.int32)],
        TypeError,
        "bitmaps must have dtype int64, got int32",
    ),
}


def error_of(launcher, op, args):
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        call(launcher, op, args)
    return type(info.value), str(info.value)


def assert_same_error_everywhere(op, args, error, message):
    errors = {launcher: error_of(launcher, op, args) for launcher in ("cpu", "meta")}
    if HAS_GPU:
        errors["cuda"] = error_of("cuda", op, args)
    for launcher, (kind, text) in errors.items():
        assert kind is error, (launcher, kind, text)
        assert re.search(message, text), (launcher, text)
    assert len({text for _, text in errors.values()}) == 1, errors


@pytest.mark.parametrize("case", SELECT_CASES)
def test_select_verify_set_rejects_alike(case):
    changes, error, message = SELECT_CASES[case]
    assert_same_error_everywhere("select_verify_set", select_args(**changes), error, message)


@pytest.mark.parametrize("case", BITMAP_CASES)
def test_bitmap_ops_reject_alike(case):
    op, args, error, message = BITMAP_CASES[case]
    assert_same_error_everywhere(op, args, error, message)


TENSORS = ("parents", "node_experts", "root_experts", "expert_rank")


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("name", TENSORS)
def test_tensors_on_two_devices_are_rejected(launcher, name):
    # scores on the launcher's device and one other tensor elsewhere: the dispatcher picks
    # a kernel from the union of the devices, so each launcher must catch the mix itself.
    other = torch.device("meta" if launcher == "cpu" else "cpu")
    args = select_args(
        root_experts=torch.zeros((1, 1, 1), dtype=LONG), expert_rank=torch.zeros(8, dtype=LONG)
    )
    odd = select_names().index(name)
    args = [_to(a, other if i == odd else torch.device(launcher)) for i, a in enumerate(args)]
    overload = torch.ops.sgl_ecospec.select_verify_set.default
    with pytest.raises(ValueError) as info:
        if launcher == "cpu":
            overload.redispatch(CPU_KEYS, *args)
        else:
            overload(*args)
    assert str(info.value).startswith(
        f"select_verify_set: {name} is on {other} but scores is on {args[0].device}: "
        "all tensors must be on one device"
    ), str(info.value)


def _valid_select_args():
    from sgl_ecospec.synthetic import random_draft_tree

    tree = random_draft_tree(3, 12, 2, 70, 4, seed=1)
    return select_args(
        scores=tree.scores,
        parents=tree.parents,
        node_experts=tree.node_experts,
        budget=5,
        root_experts=tree.root_experts,
        layer_weights=torch.ones(tree.node_experts.shape[2]),
    )


def test_meta_outputs_match_the_cpu_outputs_in_shape_and_dtype():
    ids = torch.randint(0, 65, (4, 3, 2, 8), dtype=torch.int32)
    cases = [
        ("topk_to_bitmap", [ids, 65]),
        ("bitmap_popcount", [torch.zeros((4, 3, 2), dtype=LONG)]),
        ("select_verify_set", _valid_select_args()),
    ]
    for op, args in cases:
        real = call("cpu", op, args)
        fake = call("meta", op, args)
        assert fake.is_meta, op
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype), op
    assert call("meta", "topk_to_bitmap", [ids, 65]).shape == (4, 3, 2, 2)
    assert call("meta", "select_verify_set", _valid_select_args()).shape == (3, 5)


def test_fake_tensor_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _valid_select_args()
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.sgl_ecospec.select_verify_set(*fake_args)
    assert out.shape == (3, 5) and out.dtype == torch.int64


def _over_tensor_args(body):
    """``(fn, inputs)``: ``fn(*inputs)`` returns ``body(args)`` for the valid select
    arguments ``args``, taking their tensors as its own arguments (what tracers see)."""
    args = _valid_select_args()
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*ts):
        full = list(args)
        for i, t in zip(tensors, ts, strict=True):
            full[i] = t
        return body(full)

    return fn, [args[i] for i in tensors]


def test_make_fx_traces_the_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, inputs = _over_tensor_args(lambda full: torch.ops.sgl_ecospec.select_verify_set(*full))
    graph = make_fx(fn, tracing_mode="fake")(*inputs)
    assert "sgl_ecospec.select_verify_set" in graph.code
    assert torch.equal(graph(*inputs), fn(*inputs))


def test_torch_compile_fullgraph():
    def body(full):
        out = torch.ops.sgl_ecospec.select_verify_set(*full)
        return out, torch.ops.sgl_ecospec.bitmap_popcount(full[2])

    fn, inputs = _over_tensor_args(body)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    got, expected = compiled(*inputs), fn(*inputs)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
