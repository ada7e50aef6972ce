"""Set and size per step in SGLang's fixed-width verify (``policy=adaptive``, or a
``min_score`` floor).

SGLang verifies ``--speculative-num-draft-tokens`` rows per request in every step (one
verify shape per CUDA graph), so a request cannot verify fewer nodes. The ``adaptive`` policy
still chooses how many: 1 to D-1 nodes per request, each taken only while it raises the
step's expected tokens per predicted step cost (``sgl_ecospec.ops.select_verify_set``; the
utility gate is the way to verify none). The slots it leaves unused hold copies of a chosen
leaf (:func:`sgl_ecospec.step.fill_unused_slots`): a copy has the leaf's token, ancestors and
position, so the target routes it to the leaf's experts and the step loads no expert the
chosen nodes do not need. A ``min_score`` floor (any policy) leaves slots unused the same way.

Verification must never count a copy: SGLang's tree sampling accepts a sibling by the running
sum of the target's probabilities over the siblings it has tried, so a token tried twice
would be accepted with twice its probability. After SGLang builds the tree,
:func:`unlink_hook` (an AFTER hook on ``build_tree_kernel_efficient``) takes the copies out of
their parent's sibling chain: greedy and sampling verification never visit them (nothing
hangs under a copy, and a copy follows its original, so no first-child link points to one).

The proof that copies load nothing: :class:`CopyCheck` compares, after each verify pass, the
captured routing of every copy row with the row before it (its original or an earlier copy of
it), on the device; the "EcoSpec:" line reports the copies and those routed differently.

Shape legend: B = requests, D = verify rows per request (root first), L = MoE layers,
K = experts per token.
"""

import torch
from sglang.srt.plugins.hook_registry import HookType

from sglang_ecospec.hooks import HookSlot

BUILD_TREE_TARGET = "sglang.srt.speculative.eagle_utils.build_tree_kernel_efficient"


def copy_rows(filled: torch.Tensor) -> torch.Tensor:
    """bool ``[B, D]``: the verify rows that are copies (row 0, the root, never is).

    Args:
        filled: int64 ``[B, D-1]``: the verify set after ``fill_unused_slots`` (ascending,
            a copy right after its original or an earlier copy).
    """
    copies = torch.zeros(
        filled.shape[0], filled.shape[1] + 1, dtype=torch.bool, device=filled.device
    )
    copies[:, 2:] = filled[:, 1:] == filled[:, :-1]
    return copies


def unlink_copies(next_sibling: torch.Tensor, copies: torch.Tensor) -> None:
    """Takes the copy rows out of every sibling chain, in place (graph-safe: D-1 gathers).

    Args:
        next_sibling: int64 ``[B, D]``: SGLang's ``retrieve_next_sibling`` (-1: none).
        copies: bool ``[B, D]``: :func:`copy_rows`.
    """
    nodes = next_sibling.shape[1]
    link = next_sibling.clone()
    for _ in range(nodes - 1):  # a chain of copies is at most D-2 long
        target = link.clamp_min(0)
        skip = (link >= 0) & torch.gather(copies, 1, target)
        link = torch.where(skip, torch.gather(next_sibling, 1, target), link)
    next_sibling.copy_(link)


class CopyCheck:
    """Device totals: copy rows verified, and those whose captured routing differs from the
    row before them (0 when copies add no expert)."""

    def __init__(self, device):
        self.totals = torch.zeros(2, dtype=torch.int64, device=device)

    def update(self, routing: torch.Tensor, copies: torch.Tensor) -> None:
        """Adds one verify pass.

        Args:
            routing: int64 ``[B * D, L, K]``: the captured routing of the verify rows.
            copies: bool ``[B * D]``: :func:`copy_rows`, flattened.
        """
        previous = torch.roll(routing, 1, dims=0)  # row r - 1 (row 0 is never a copy)
        differs = (routing.sort(-1).values != previous.sort(-1).values).flatten(1).any(1)
        self.totals.add_(torch.stack((copies.sum(), (copies & differs).sum())))


# The selector whose copies the tree-building hook unlinks; empty: SGLang's tree as built.
slot: HookSlot = HookSlot("fixed-width copies")


@slot.hook(BUILD_TREE_TARGET, HookType.AFTER)
def unlink_hook(result, *args, **kwargs):
    """AFTER hook on ``build_tree_kernel_efficient``: unlinks the copies of the selection
    just made (the active selector's ``copy_rows``) from SGLang's sibling chains."""
    selector = slot.active()
    if selector is None or selector.copy_rows is None:
        return result
    next_sibling = result[4]  # [B, D]
    batch, nodes = next_sibling.shape
    if batch <= selector.copy_rows.shape[0] and nodes == selector.copy_rows.shape[1]:
        unlink_copies(next_sibling, selector.copy_rows[:batch])
    return result
