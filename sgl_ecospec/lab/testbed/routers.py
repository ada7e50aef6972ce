"""Router training: a per-layer ``Linear(H, E)`` gate that predicts which experts matter.

After clustering, every token has an activation mass per expert (how much of the dense FFN
output the expert's neurons carry). The router is fitted to those masses on calibration
hidden states, so that its top-K matches the experts that would have mattered most in the
dense model: routing is then learned, skewed (some experts carry more mass than others) and
context dependent, like a real MoE's.

Shape legend: T = tokens, H = hidden size, E = routed experts, I = neurons per expert,
K = experts per token.
"""

import torch


def expert_mass(act: torch.Tensor, down_norm: torch.Tensor, expert_neurons: torch.Tensor):
    """Per-token activation mass of each expert.

    The mass of neuron i on token t is |act[t, i]| * ||W_down[:, i]||: an upper bound on
    its contribution to the FFN output. An expert's mass sums its neurons'.

    Args:
        act: float32 ``[T, N]``: SwiGLU activations silu(x W_gate^T) * (x W_up^T) of the N
            dense neurons.
        down_norm: float32 ``[N]``: column norms of the dense down projection.
        expert_neurons: int64 ``[E, I]``: dense neuron ids of each routed expert.

    Returns:
        float32 ``[T, E]``.
    """
    contrib = act.abs() * down_norm  # [T, N]
    return contrib[:, expert_neurons].sum(-1)  # [T, E]


def _soft_targets(mass: torch.Tensor) -> torch.Tensor:
    # Mass shares as a distribution over experts: cross-entropy against it ranks the
    # heavy experts first, which is all top-K routing needs.
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)


def train_router(
    x: torch.Tensor,
    mass: torch.Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Fits router logits to the experts' mass shares (soft-label cross-entropy, Adam).

    Starts from a ridge regression of centred log-mass on ``x`` (closed form, already a
    decent router) and refines it with ``steps`` minibatch Adam steps.

    Args:
        x: float32 ``[T, H]``: MoE-layer inputs (after post-attention RMSNorm).
        mass: float32 ``[T, E]``: from :func:`expert_mass`.
        steps, batch, lr: optimisation schedule (cosine-decayed lr).
        generator: CPU generator for the minibatch order.

    Returns:
        float32 ``[E, H]``: the gate weight (``mlp.gate.weight``), logits = x @ W^T.
    """
    log_mass = mass.clamp_min(1e-6).log()
    z = log_mass - log_mass.mean(-1, keepdim=True)  # [T, E]
    gram = x.T @ x  # [H, H]
    ridge = 1e-3 * gram.diagonal().mean()
    weight = torch.linalg.solve(gram + ridge * torch.eye(len(gram)), x.T @ z).T.contiguous()

    weight.requires_grad_(True)
    opt = torch.optim.Adam([weight], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    targets = _soft_targets(mass)
    with torch.enable_grad():  # callers run under no_grad
        for _ in range(steps):
            idx = torch.randint(len(x), (batch,), generator=generator)
            logits = x[idx] @ weight.T
            loss = torch.nn.functional.cross_entropy(logits, targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return weight.detach()


def scale_for_spread(logits: torch.Tensor, top_k: int, spread: float) -> float:
    """Factor for the router logits so that the mean (top-1 - top-K) logit gap is ``spread``.

    Qwen2-MoE with ``norm_topk_prob`` weights the K chosen experts by a softmax over their
    logits. A small gap keeps those weights near 1/K, so K * weight * expert stays close to
    the dense FFN restricted to the chosen neurons; a large gap would let one expert
    dominate. Scaling does not change which experts are chosen.

    Args:
        logits: float32 ``[T, E]`` router logits on calibration tokens.
        top_k: K.
        spread: wanted mean gap, in nats (e^spread = largest / smallest chosen weight).
    """
    top = logits.topk(top_k, dim=-1).values  # [T, K]
    gap = (top[:, 0] - top[:, -1]).mean().item()
    return spread / max(gap, 1e-6)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-MoE routing with ``norm_topk_prob=True``: softmax, top-K, renormalise.

    Args:
        logits: ``[T, E]`` router logits.

    Returns:
        (weights float32 ``[T, K]`` summing to 1, ids int64 ``[T, K]``).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def topk_recall(pred_ids: torch.Tensor, true_ids: torch.Tensor) -> float:
    """Mean |pred ∩ true| / K over tokens; both int64 ``[T, K]`` without repeats."""
    hits = (pred_ids[:, :, None] == true_ids[:, None, :]).any(-1).float()  # [T, K]
    return hits.mean().item()
