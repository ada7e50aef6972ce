"""Expert placement under expert parallelism (EP): which rank holds each expert.

``select_verify_set(..., expert_rank=...)`` prices a node by the rise of the busiest EP
rank's expert loads; it takes one rank per logical expert. With EPLB's redundant experts a
logical expert has several physical replicas on different ranks, and which one a verify
token reaches is a dispatch decision: SGLang's static dispatch sends every token that a
rank dispatches to one fixed replica (``ExpertLocationMetadata.
logical_to_rank_dispatch_physical_map``, this rank's choice per layer and logical expert).
That map, turned into ranks here, is the placement the verify pass actually meets when its
tokens are dispatched from one rank (attention TP, or no all-to-all backend, where every
rank picks the same replica). Dynamic dispatch spreads tokens over all replicas, which no
single rank per expert describes; the first replica (``logical_to_all_physical_map[..., 0]``)
is then an approximation.

Shape legend: L = MoE layers, E = logical experts per layer, P = physical expert slots.
"""

import torch

from sgl_ecospec.ops.checks import INDEX_DTYPES, check_int, check_tensor


def expert_rank_map(
    physical_expert_ids: torch.Tensor,
    num_physical_experts: int,
    ep_size: int,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """EP rank of each logical expert, from the physical slot its tokens are sent to.

    SGLang lays physical slots out rank-major: rank r holds slots
    [r P / R, (r + 1) P / R) (``ExpertLocationMetadata.num_local_physical_experts``).

    Args:
        physical_expert_ids: int32 or int64, shape ``[L, E]`` (or ``[E]``): the physical
            slot of the replica each logical expert's verify tokens reach, e.g. SGLang's
            ``ExpertLocationMetadata.logical_to_rank_dispatch_physical_map`` (static
            dispatch) or ``logical_to_all_physical_map[..., 0]`` (first replica).
        num_physical_experts: P, physical slots per layer (logical experts plus EPLB's
            redundant ones), a multiple of ``ep_size``.
        ep_size: R, EP ranks (>= 1).
        validate: check that every slot lies in [0, P) (a host sync on GPU).

    Returns:
        int64, the shape of ``physical_expert_ids``: ranks in [0, R), ready for
        ``select_verify_set(expert_rank=..., num_ranks=ep_size)``.

    Example:
        >>> expert_rank_map(torch.tensor([0, 5, 2, 7]), 8, 2)  # slots 0-3 on rank 0
        tensor([0, 1, 0, 1])
    """
    check_tensor("physical_expert_ids", physical_expert_ids, dtypes=INDEX_DTYPES)
    if physical_expert_ids.dim() not in (1, 2):
        raise ValueError(
            "physical_expert_ids must have shape [E] or [L, E], got "
            f"{tuple(physical_expert_ids.shape)}"
        )
    check_int("ep_size", ep_size, minimum=1)
    check_int("num_physical_experts", num_physical_experts, minimum=ep_size)
    if num_physical_experts % ep_size:
        raise ValueError(
            f"num_physical_experts = {num_physical_experts} must be a multiple of "
            f"ep_size = {ep_size}: each rank holds the same number of slots"
        )
    ids = physical_expert_ids.long()
    if validate and ids.numel():
        bad = (ids < 0) | (ids >= num_physical_experts)
        if bool(bad.any()):
            raise ValueError(
                f"physical_expert_ids holds slot {int(ids[bad][0])}, outside "
                f"[0, {num_physical_experts}): pass the physical slot of one replica per "
                "logical expert (no -1 padding)"
            )
    return ids // (num_physical_experts // ep_size)
