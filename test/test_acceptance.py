"""The acceptance calibrator (``sgl_ecospec.acceptance``): cold start, what it learns from a
verify result, convergence to known acceptance rates on synthetic trees, monotonicity along
root paths, and graph safety (one compiled graph reading the live tables, no host sync)."""

import pytest
import torch
from _util import compile_once, host_syncs

from sgl_ecospec.acceptance import (
    AcceptanceCalibrator,
    accepted_candidates,
    expected_accepted,
    node_mask,
)
from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.predictors.online import OnlineExpertPredictor
from sgl_ecospec.step import select_step

DEPTH, BRANCH = 3, 3  # full trees: 3 + 9 + 27 candidates


def full_trees(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random full trees (``BRANCH`` children per node, ``DEPTH`` levels), parents first:
    scores float32 ``[B, N]`` (cumulative draft probabilities, each node's children sharing
    at most 0.95 of it) and parents int64 ``[B, N]``."""
    gen = torch.Generator().manual_seed(seed)
    parents, level, first = [], [-1], 0
    for _ in range(DEPTH):
        children = [p for p in level for _ in range(BRANCH)]
        parents += children
        level = list(range(first, first + len(children)))
        first += len(children)
    parents = torch.tensor(parents).expand(batch, -1).clone()
    num_nodes = parents.shape[1]
    # Sibling edge probabilities: a sharp draft (one likely child) with a random total.
    raw = torch.rand(batch, num_nodes // BRANCH, BRANCH, generator=gen) ** 3
    total = 0.5 + 0.45 * torch.rand(batch, num_nodes // BRANCH, 1, generator=gen)
    edges = (raw / raw.sum(-1, keepdim=True) * total).flatten(1)  # [B, N]
    scores = torch.empty(batch, num_nodes)
    for node in range(num_nodes):
        above = scores[:, parents[0, node]] if parents[0, node] >= 0 else 1.0
        scores[:, node] = edges[:, node] * above
    return scores, parents


def simulate_accept(scores, parents, selected, alpha, gen) -> torch.Tensor:
    """The accepted path as verify rows ``[B, DEPTH + 1]`` (root first, -1 padded): at each
    accepted node the target picks child v with probability alpha[depth] * q_v (at most one),
    and the path goes on while the pick was verified."""
    batch, num_nodes = scores.shape
    verified = node_mask(selected, num_nodes)
    row_of = torch.full((batch, num_nodes), -1)
    for b in range(batch):
        for r, node in enumerate(selected[b].tolist()):
            if node >= 0:
                row_of[b, node] = r + 1
    path = torch.full((batch, DEPTH + 1), -1)
    path[:, 0] = 0
    for b in range(batch):
        current = -1
        for depth in range(DEPTH):
            children = (parents[b] == current).nonzero().flatten()
            above = scores[b, current] if current >= 0 else torch.tensor(1.0)
            chance = alpha[depth] * scores[b, children] / above
            draw = torch.rand((), generator=gen)
            picked = (chance.cumsum(0) > draw).nonzero()
            if len(picked) == 0 or not verified[b, children[picked[0, 0]]]:
                break
            current = int(children[picked[0, 0]])
            path[b, depth + 1] = row_of[b, current]
    return path


def all_nodes(batch: int, num_nodes: int) -> torch.Tensor:
    return torch.arange(num_nodes).expand(batch, -1).clone()


# --- cold start, exact bookkeeping ---------------------------------------------------------


def test_cold_calibrator_returns_the_draft_probabilities():
    scores, parents = full_trees(4, seed=0)
    calibrated = AcceptanceCalibrator(DEPTH).calibrate(scores, parents)
    torch.testing.assert_close(calibrated, scores)
    assert calibrated.dtype == scores.dtype


def test_observe_counts_tested_nodes_only():
    # Candidates: 0 (q .6) and 1 (q .3) under the root; 2 under 0 (q .5); 3 under 1 (q .5).
    scores = torch.tensor([[0.6, 0.3, 0.3, 0.15]])
    parents = torch.tensor([[-1, -1, 0, 1]])
    calibrator = AcceptanceCalibrator(2, num_bins=10)
    selected = torch.tensor([[0, 1, 2, 3]])
    # Verify rows: 0 root, 1 -> node 0, 2 -> node 1, 3 -> node 2, 4 -> node 3. Accepted:
    # the root, node 0, node 2. Node 3's parent (1) was rejected: not tested.
    calibrator.observe(scores, parents, selected, torch.tensor([[0, 1, 3]]))
    accepted, promised = torch.zeros(2, 10), torch.zeros(2, 10)
    accepted[0, 6], promised[0, 6] = 1, 0.6  # node 0
    promised[0, 3] = 0.3  # node 1, rejected
    accepted[1, 5], promised[1, 5] = 1, 0.5  # node 2
    torch.testing.assert_close(calibrator.accepted, accepted)
    torch.testing.assert_close(calibrator.promised, promised)
    # Ratios shrink (weight 1) towards their depth's, which shrinks towards the global one.
    pooled = (2 + 1) / (1.4 + 1)
    depth = [(1 + pooled) / (0.9 + 1), (1 + pooled) / (0.5 + 1)]
    ratios = calibrator.ratios()
    assert ratios[0, 3] == pytest.approx(depth[0] / 1.3)
    assert ratios[1, 5] == pytest.approx((1 + depth[1]) / 1.5)
    assert ratios[0, 0] == pytest.approx(depth[0])  # an unseen bin follows its depth
    assert ratios[1, 0] == pytest.approx(depth[1])


def test_padding_invalid_requests_and_halving():
    scores = torch.tensor([[0.6, 0.3], [0.6, 0.3]])
    parents = torch.full((2, 2), -1)
    calibrator = AcceptanceCalibrator(1, num_bins=10, halve_every=2)
    selected = torch.tensor([[0, -1], [1, 0]])
    rows = torch.tensor([[0, 1], [0, 2]])  # request 0 accepts node 0, request 1 node 0
    calibrator.observe(scores, parents, selected, rows, valid=torch.tensor([True, False]))
    assert calibrator.accepted.sum() == 1 and calibrator.promised.sum() == pytest.approx(0.6)
    calibrator.observe(scores, parents, selected, rows, valid=torch.tensor([True, False]))
    # The second call halves: (1 + 1) / 2 accepted, (0.6 + 0.6) / 2 promised.
    assert calibrator.accepted.sum() == 1 and calibrator.promised.sum() == pytest.approx(0.6)


def test_row_and_mask_helpers():
    selected = torch.tensor([[2, 5, -1], [0, 1, 4]])
    rows = torch.tensor([[0, 2, -1], [0, 1, 3]])
    assert accepted_candidates(selected, rows).tolist() == [[-1, 5, -1], [-1, 0, 4]]
    assert node_mask(torch.tensor([[5, -1, 0]]), 6).tolist() == [[1, 0, 0, 0, 0, 1]]
    assert accepted_candidates(selected[:, :0], rows).tolist() == [[-1] * 3] * 2
    probs = torch.tensor([[0.5, 0.25, 0.1]])
    assert expected_accepted(probs, torch.tensor([[0, 2, -1]])).tolist() == pytest.approx([0.6])
    assert expected_accepted(probs, torch.zeros(1, 0, dtype=torch.long)).tolist() == [0.0]


# --- learning known acceptance rates -------------------------------------------------------


@pytest.mark.parametrize("alpha", [(0.5, 0.3, 0.2), (0.9, 0.6, 0.9)])
def test_converges_to_known_per_depth_rates(alpha):
    gen = torch.Generator().manual_seed(1)
    calibrator = AcceptanceCalibrator(DEPTH, num_bins=4)
    predicted, measured = [], []
    for step in range(100):
        scores, parents = full_trees(16, seed=100 + step)
        # Verify the 6 nodes of highest calibrated probability (confidence selection).
        probs = calibrator.calibrate(scores, parents)
        selected = probs.topk(6, dim=1).indices.sort(1).values
        path = simulate_accept(scores, parents, selected, alpha, gen)
        if step >= 20:  # forecasts made before each step's result is learnt
            predicted.append(expected_accepted(probs, selected))
            measured.append((path >= 1).sum(1).double())
        calibrator.observe(scores, parents, selected, path)
    # Where a depth saw enough promised tokens, its learnt ratio is its true rate.
    promised = calibrator.promised.sum(1)
    learnt = (calibrator.accepted.sum(1) / promised).tolist()
    checked = [d for d in range(DEPTH) if promised[d] > 50]
    assert checked[:2] == [0, 1]
    for depth in checked:
        assert learnt[depth] == pytest.approx(alpha[depth], abs=0.1), depth
    predicted_length = 1 + torch.cat(predicted).mean()
    measured_length = 1 + torch.cat(measured).mean()
    assert predicted_length == pytest.approx(float(measured_length), rel=0.06)
    # The raw draft probabilities promise much more than the target grants at alpha < 1.
    if max(alpha) < 0.6:
        raw = 1 + expected_accepted(scores, selected).mean()
        assert raw > 1.2 * measured_length


def test_probabilities_never_rise_along_a_path():
    gen = torch.Generator().manual_seed(2)
    calibrator = AcceptanceCalibrator(DEPTH, num_bins=8, prior_weight=0.1)
    for step in range(10):
        scores, parents = full_trees(8, seed=step)
        path = simulate_accept(scores, parents, all_nodes(8, 39), (1.0, 1.0, 1.0), gen)
        calibrator.observe(scores, parents, all_nodes(8, 39), path)
    assert (calibrator.ratios() > 1).any(), "some bins must be scaled up for the test to bite"
    scores, parents = full_trees(8, seed=99)
    probs = calibrator.calibrate(scores, parents)
    has_parent = parents >= 0
    above = torch.where(has_parent, probs.gather(1, parents.clamp_min(0)), 1.0)
    assert (probs <= above).all() and (probs >= 0).all()


# --- errors ----------------------------------------------------------------------------------


def test_errors():
    scores, parents = full_trees(2, seed=0)
    with pytest.raises(ValueError, match="deeper than max_depth=2"):
        AcceptanceCalibrator(2).calibrate(scores, parents)
    calibrator = AcceptanceCalibrator(DEPTH)
    with pytest.raises(ValueError, match=r"parents must have shape \(2, 39\)"):
        calibrator.calibrate(scores, parents[:, :3])
    with pytest.raises(ValueError, match="probabilities >= 0"):
        calibrator.calibrate(-scores, parents)
    with pytest.raises(ValueError, match="accepted_rows must be -1 or a verify row"):
        calibrator.observe(scores, parents, all_nodes(2, 2), torch.tensor([[0, 3], [0, 1]]))
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        AcceptanceCalibrator(0)
    with pytest.raises(ValueError, match="prior_weight must be finite and > 0"):
        AcceptanceCalibrator(2, prior_weight=0.0)


# --- graph safety ----------------------------------------------------------------------------


def test_calibrate_compiles_once_and_reads_the_live_tables():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    calibrator = AcceptanceCalibrator(DEPTH)
    scores, parents = full_trees(4, seed=7)

    def calibrate(s, p):
        return calibrator.calibrate(s, p, validate=False)

    compiled, recorder = compile_once(calibrate, "aot_eager")
    answers = []
    for step in range(3):
        torch.testing.assert_close(compiled(scores, parents), calibrate(scores, parents))
        answers.append(compiled(scores, parents))
        tree = full_trees(4, seed=step)
        path = simulate_accept(*tree, all_nodes(4, 39), (0.4, 0.4, 0.4), gen)
        calibrator.observe(*tree, all_nodes(4, 39), path, validate=False)
    assert len(recorder.graphs) == 1
    assert not torch.equal(answers[0], answers[-1]), "learning must change the graph's output"
    assert host_syncs(calibrate, scores, parents) == []
    torch._dynamo.reset()


def test_observe_holds_no_host_sync():
    calibrator = AcceptanceCalibrator(DEPTH)
    scores, parents = full_trees(2, seed=0)
    selected, rows = all_nodes(2, 39), torch.tensor([[0, 1, 4], [0, 2, -1]])

    def observe(s, p, sel, r):
        calibrator.observe(s, p, sel, r, validate=False)
        return calibrator.accepted + 0

    assert host_syncs(observe, scores, parents, selected, rows) == []


def test_select_step_on_calibrated_scores_compiles_as_one_graph():
    torch._dynamo.reset()
    layers, experts, top_k, budget = 2, 70, 3, 5
    predictor = OnlineExpertPredictor(layers, experts, top_k, num_buckets=64)
    calibrator = AcceptanceCalibrator(DEPTH)
    calibrator.accepted[0].fill_(3.0)
    calibrator.promised[0].fill_(9.0)  # depth-0 edges scaled by 4 / 10
    options = SelectionOptions(policy="ecospec", share_buffer=True)
    scores, parents = full_trees(3, seed=4)
    tokens = torch.randint(0, 500, (3, 40), generator=torch.Generator().manual_seed(0))

    def step(tokens, scores, parents):
        probs = calibrator.calibrate(scores, parents, validate=False)
        chosen = select_step(predictor, tokens, probs, parents, budget, options)
        return chosen.selected, expected_accepted(probs, chosen.selected)

    compiled, recorder = compile_once(step, "aot_eager")
    got, want = compiled(tokens, scores, parents), step(tokens, scores, parents)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert len(recorder.graphs) == 1
    assert host_syncs(step, tokens, scores, parents) == []
    torch._dynamo.reset()
