"""Graph safety of the public ops and the selection step (issue 14), proved on the CPU.

On the ``validate=False`` path every op and ``select_step`` must trace as one graph with
``torch.compile(fullgraph=True)`` and equal the eager call, and must hold no host sync
(``.item()``, ``bool(tensor)``, boolean-mask indexing, data-dependent shapes): a FakeTensor
trace (``make_fx``) scans for them. A step traced once must replay on its persistent
buffers, the online predictor's tables included, after they change in place (the CPU
stand-in for CUDA-graph replay). And ``impl="auto"`` on a CUDA tensor without the CUDA
kernel must raise, not fall back (finding 4).
"""

import warnings

import pytest
import torch
from _util import compile_once, host_syncs
from torch.fx.experimental.proxy_tensor import make_fx

from sgl_ecospec.ops import bitmap_popcount, select_verify_set, topk_to_bitmap
from sgl_ecospec.ops import native as _native
from sgl_ecospec.ops.selection import POLICIES, SelectionOptions
from sgl_ecospec.predictors.online import OnlineExpertPredictor
from sgl_ecospec.step import Placement, select_step
from sgl_ecospec.synthetic import random_draft_tree

B, N, L, E, K, R, BUDGET = 3, 10, 2, 70, 3, 4, 4  # E = 70: two words per layer bitmap
BACKENDS = ["eager", "aot_eager"]
CUDA = torch.device("cuda")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def tree():
    return random_draft_tree(B, N, L, E, K, seed=1)


def ep_keywords(ep: bool, *, per_layer: bool = True) -> dict:
    """The EP arguments: ranks ``[L, E]`` (or ``[E]``, every layer alike) and R."""
    if not ep:
        return {}
    gen = torch.Generator().manual_seed(3)
    shape = (L, E) if per_layer else (E,)
    return {"expert_rank": torch.randint(0, R, shape, generator=gen), "num_ranks": R}


def options(policy: str, share_buffer: bool | str) -> SelectionOptions:
    """``share_buffer``: a bool, or "rounds" (a shared buffer with round_sync)."""
    return SelectionOptions(
        policy=policy,
        share_buffer=bool(share_buffer),
        round_sync=share_buffer == "rounds",
        step_cost=20.0 if policy == "adaptive" else None,
    )


def selector(impl: str, options: SelectionOptions, ep_arguments: dict, **extra):
    """``select_verify_set`` on a tree's tensors (scores, parents, node_experts,
    root_experts), as one function to compile."""

    def select(scores, parents, node_experts, root_experts):
        return select_verify_set(
            scores,
            parents,
            node_experts,
            BUDGET,
            root_experts=root_experts,
            options=options,
            validate=False,
            impl=impl,
            **ep_arguments,
            **extra,
        )

    return select


# --- the ops ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_experts", [64, 130])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_bitmap_ops_compile_as_one_graph(impl, backend, num_experts, dtype):
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (4, L, K), generator=gen).to(dtype)

    def bitmaps_and_counts(topk_ids):
        bitmaps = topk_to_bitmap(topk_ids, num_experts, validate=False, impl=impl)
        return bitmaps, bitmap_popcount(bitmaps, impl=impl)

    compiled, recorder = compile_once(bitmaps_and_counts, backend)
    got, want = compiled(ids), bitmaps_and_counts(ids)
    assert len(recorder.graphs) == 1 and recorder.calls_native() == (impl == "native")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # New values in the same shapes run the same graph.
    ids.copy_(torch.randint(0, num_experts, ids.shape, generator=gen))
    assert torch.equal(compiled(ids)[0], bitmaps_and_counts(ids)[0])
    assert len(recorder.graphs) == 1
    assert host_syncs(bitmaps_and_counts, ids) == []


@pytest.mark.parametrize("ep", [False, True], ids=["flat", "ep"])
@pytest.mark.parametrize("share_buffer", [False, True, "rounds"], ids=["own", "shared", "rounds"])
@pytest.mark.parametrize("policy", POLICIES)
def test_select_verify_set_compiles_as_one_graph(impl, policy, share_buffer, ep):
    t = tree()
    weights = torch.tensor([1.0, 0.5])
    placement = ep_keywords(ep, per_layer=policy != "ecospec")
    select = selector(impl, options(policy, share_buffer), placement, layer_weights=weights)

    args = (t.scores, t.parents, t.node_experts, t.root_experts)
    for backend in BACKENDS:
        torch._dynamo.reset()
        compiled, recorder = compile_once(select, backend)
        assert torch.equal(compiled(*args), select(*args)), backend
        assert len(recorder.graphs) == 1 and recorder.calls_native() == (impl == "native")
    assert host_syncs(select, *args) == []


def test_host_sync_scan_catches_syncs():
    # The scan above would pass vacuously if it missed the patterns it looks for.
    def masked(x):
        return x[x > 0].sum()

    def counted(x):
        return torch.full((2,), int(x.sum().item()))

    x = torch.arange(-3, 3)
    assert any("boolean mask" in op for op in host_syncs(masked, x))
    with pytest.raises(Exception, match="(?i)data.dependent|item|scalar"):
        host_syncs(counted, x)


# --- the selection step with the online predictor --------------------------------------------


@pytest.fixture
def step_impl(impl, monkeypatch):
    """``select_step`` calls the ops with impl="auto": "reference" here hides the native
    kernels (the warn-once CPU fallback, warning already given)."""
    if impl == "reference":
        monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: False)
        monkeypatch.setattr(_native, "_warned", True)
    return impl


def trained_predictor(seed: int = 0) -> OnlineExpertPredictor:
    predictor = OnlineExpertPredictor(L, E, K, num_buckets=64)
    learn(predictor, seed)
    return predictor


def learn(predictor: OnlineExpertPredictor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (300,), generator=gen)
    predictor.observe(tokens, torch.randint(0, E, (300, L, K), generator=gen), validate=False)


def step_inputs(seed: int = 5):
    """Persistent step buffers: tokens [B, 1 + N] (root first), scores, parents, valid."""
    t = tree()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (B, 1 + N), generator=gen)
    return tokens, t.scores.clone(), t.parents.clone(), torch.ones(B, dtype=torch.bool)


def step_fn(predictor, policy, share_buffer, placement):
    """The whole step as a function of its per-step buffers, returning every output."""
    opts = options(policy, share_buffer)

    def step(tokens, scores, parents, valid):
        out = select_step(
            predictor, tokens, scores, parents, BUDGET, opts, valid=valid, placement=placement
        )
        return out.predicted, out.bitmaps, out.selected, out.verify_predicted

    return step


def assert_same(got, want):
    assert len(got) == len(want)
    for name, g, w in zip(("predicted", "bitmaps", "selected", "verify"), got, want, strict=True):
        assert torch.equal(g, w), name


def placement_of(ep: bool):
    return Placement(**ep_keywords(ep)) if ep else None


@pytest.mark.parametrize("ep", [False, True], ids=["flat", "ep"])
@pytest.mark.parametrize("share_buffer", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("policy", POLICIES)
def test_select_step_compiles_as_one_graph(step_impl, policy, share_buffer, ep):
    step = step_fn(trained_predictor(), policy, share_buffer, placement_of(ep))
    inputs = step_inputs()
    compiled, recorder = compile_once(step, "aot_eager")
    assert_same(compiled(*inputs), step(*inputs))
    assert len(recorder.graphs) == 1 and recorder.calls_native() == (step_impl == "native")
    assert host_syncs(step, *inputs) == []


def mutate_in_place(predictor, tokens, scores, valid, placement) -> None:
    """A later step's state written into the same tensors: the predictor learns (its tables
    change in place), new root (bonus) and candidate tokens, new scores, a masked request,
    and an EPLB-style refresh of the placement."""
    learn(predictor, seed=1)
    gen = torch.Generator().manual_seed(9)
    predictor.counts.mul_(torch.rand(predictor.counts.shape, generator=gen))
    tokens[:, 0] = torch.randint(500, 1000, (B,), generator=gen)  # the root / bonus tokens
    tokens[:, 1:] = torch.randint(0, 1000, (B, N), generator=gen)
    scores.mul_(torch.rand(scores.shape, generator=gen))
    valid[-1] = False
    if placement is not None:
        placement.expert_rank.copy_(torch.randint(0, R, placement.expert_rank.shape, generator=gen))


@pytest.mark.parametrize("ep", [False, True], ids=["flat", "ep"])
@pytest.mark.parametrize("share_buffer", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("policy", ["ecospec", "adaptive"])
def test_step_traced_once_replays_on_new_state(step_impl, policy, share_buffer, ep):
    # make_fx records the step's aten ops once; replaying the graph runs no Python of the
    # step, so whatever it read at trace time as a value (rather than from a tensor) is
    # frozen, as in a CUDA graph.
    predictor, placement = trained_predictor(), placement_of(ep)
    step = step_fn(predictor, policy, share_buffer, placement)
    inputs = step_inputs()
    graph = make_fx(step)(*inputs)
    # The tables are read from the live tensors, not from copies taken at trace time.
    tables = (predictor.counts, predictor.prior)
    constants = [getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr"]
    reads = [c for c in constants if any(c.shape == t.shape and c.dtype == t.dtype for t in tables)]
    assert {c.data_ptr() for c in reads} == {t.data_ptr() for t in tables}
    before = [x.clone() for x in graph(*inputs)]
    assert_same(before, step(*inputs))

    mutate_in_place(predictor, inputs[0], inputs[1], inputs[3], placement)
    after = graph(*inputs)
    assert_same(after, step(*inputs))
    # The new state changed the answer, so a graph with the old state frozen in would fail.
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])


@pytest.mark.parametrize("ep", [False, True], ids=["flat", "ep"])
def test_compiled_step_reads_the_live_tables(step_impl, ep):
    # torch.compile lifts the predictor's tables as graph inputs: changing them in place
    # (observe) neither recompiles nor leaves the graph on stale values.
    predictor, placement = trained_predictor(), placement_of(ep)
    step = step_fn(predictor, "ecospec", True, placement)
    inputs = step_inputs()
    compiled, recorder = compile_once(step, "aot_eager")
    before = [x.clone() for x in compiled(*inputs)]
    mutate_in_place(predictor, inputs[0], inputs[1], inputs[3], placement)
    after = compiled(*inputs)
    assert len(recorder.graphs) == 1
    assert_same(after, step(*inputs))
    assert not torch.equal(after[2], before[2])


# --- impl="auto" on a CUDA device without the CUDA kernel (finding 4) -----------------------


@pytest.fixture
def no_cuda_kernels(monkeypatch):
    """An extension built without CUDA kernels (the CPU ones present), whatever this build."""
    monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: device.type != "cuda")
    monkeypatch.setattr(_native, "_warned", False)


@pytest.mark.parametrize("op", ["topk_to_bitmap", "bitmap_popcount", "select_verify_set"])
def test_auto_on_cuda_without_the_kernel_raises(no_cuda_kernels, op):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning first: a clear error instead
        with pytest.raises(RuntimeError) as caught:
            _native.use_native("auto", op, CUDA)
    message = str(caught.value)
    assert f"CUDA op sgl_ecospec::{op} is missing" in message
    for hint in ("scripts/setup_env.sh", "pip install --no-build-isolation -e .", "CUDA_HOME"):
        assert hint in message
    with pytest.raises(RuntimeError, match="CUDA op .* is missing"):
        _native.use_native("native", op, CUDA)


def test_auto_on_cuda_without_the_extension_says_why(monkeypatch):
    monkeypatch.setattr(_native, "NATIVE_ERROR", "simulated: no _C")
    monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: False)
    with pytest.raises(RuntimeError, match="simulated: no _C.*CUDA_HOME"):
        _native.use_native("auto", "select_verify_set", CUDA)


def test_reference_and_built_kernels_stay_allowed_on_cuda(no_cuda_kernels, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.use_native("reference", "topk_to_bitmap", CUDA) is False
        monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: True)
        assert _native.use_native("auto", "topk_to_bitmap", CUDA) is True


def test_auto_on_cpu_without_the_kernel_warns_once_and_falls_back(no_cuda_kernels, monkeypatch):
    monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: False)
    ids = torch.tensor([[1, 2]])
    with pytest.warns(RuntimeWarning, match="setup_env.sh"):
        assert topk_to_bitmap(ids, 8).tolist() == [[6]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert topk_to_bitmap(ids, 8).tolist() == [[6]]


def test_cpu_fallback_compiles_before_the_warning(no_cuda_kernels, monkeypatch):
    # The warning cannot be traced: a compiled first call skips it (no graph break) and the
    # next eager call still gives it.
    monkeypatch.setattr(_native, "has_native_kernel", lambda op, device: False)
    ids = torch.tensor([[1, 2]])
    compiled, recorder = compile_once(lambda x: topk_to_bitmap(x, 8, validate=False), "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled(ids).tolist() == [[6]]
    assert len(recorder.graphs) == 1 and not recorder.calls_native()
    with pytest.warns(RuntimeWarning, match="setup_env.sh"):
        topk_to_bitmap(ids, 8)


@pytest.mark.slow  # inductor compiles C++ on the CPU: ~5 s native, ~35 s the reference
def test_select_verify_set_under_inductor(impl):
    t = tree()
    select = selector(impl, options("adaptive", True), ep_keywords(True))

    args = (t.scores, t.parents, t.node_experts, t.root_experts)
    compiled, recorder = compile_once(select, "inductor")
    assert torch.equal(compiled(*args), select(*args))
    assert len(recorder.graphs) == 1 and recorder.calls_native() == (impl == "native")
