"""One verify set per attention-TP group: rank 0's selection broadcast, and a periodic check
that the ranks' predictor states still agree.

Every TP rank of one scheduler group runs the draft step on the same batch and selects on its
own. The selection reads the expert predictor, whose online tables each rank learns from its
own captured routing, so one near tie in a router top-k that breaks differently on one rank
makes its tables differ for good; that rank would then pick another verify set, and the
all-reduced verify forward would mix two trees (wrong tokens, then a scheduler desync or an
NCCL hang). So the ranks agree by construction:

- **Broadcast** (:meth:`TpAgreement.broadcast_selection`, called by
  ``selection.EcoSpecSelector.organize`` inside the draft step): the selection's whole output,
  ``parent_list``, ``top_scores_index`` and ``draft_tokens``, packed into one int64 tensor,
  goes from rank 0 of the group to the others with SGLang's ``GroupCoordinator.broadcast``.
  That is everything ``build_tree_kernel_efficient`` reads from the selection, so the verify
  tree, its mask and positions (built from these and SGLang's per-request state) are rank
  0's on every rank. Graph safety: static shapes (``[B, P + 2 (D-1)]``), no host sync, and
  the same call SGLang's own speculative TP sync uses (``spec_tp_sync.SpecTpSync``): inside a
  CUDA-graph capture (SGLang's ``graph_capture()`` enables PyNccl on the TP and attention-TP
  groups) it is PyNccl's ``ncclBroadcast`` on the capture stream, captured like the model's
  all-reduces; in eager steps ``torch.distributed.broadcast`` on the group's device group.
- **Agreement check** (:meth:`TpAgreement.after_verify`, every ``interval`` verify steps, off
  the draft step): a checksum of the predictor's state (its tensors' bits, position-weighted,
  exact integer arithmetic) is all-gathered over the group's CPU (gloo) group, one host sync
  per check. Ranks that differ from rank 0 are logged as an ERROR on every rank, counted in
  :attr:`TpAgreement.divergences`, and get rank 0's state copied in place (a broadcast of each
  tensor), so the tables agree again and selection quality stays the same on every rank. It
  does not raise: the broadcast already keeps the output correct.

The acceptance calibrator (setting ``calibrated_acceptance``, :mod:`sglang_ecospec.acceptance`)
needs neither: it shapes only a rank's own choice, which the broadcast replaces by rank 0's,
and every rank learns from that verify set and SGLang's rank-identical ``accept_index``.

The group is SGLang's ``get_dp_tp_group()``: the ranks that run one batch (the attention-TP
group under attention DP, the TP group otherwise; the group SGLang's speculative TP sync
uses). With one rank (or no distributed state) there is no :class:`TpAgreement`: no
collective, no extra work.
"""

import logging

import torch

logger = logging.getLogger(__name__)

# Verify steps between two agreement checks (a checksum of the predictor's tables, one host
# sync and one small gloo all-gather each).
CHECK_INTERVAL = 256

# Checksums: sum over elements of (bits mod M) * (position mod P + 1), each term reduced mod M,
# in chunks, so every intermediate fits int64 exactly (< 2^31 * 2^20 per term, < 2^51 per
# chunk sum) and the result does not depend on the summation order.
_MODULUS = 2**31 - 1
_WEIGHT_PERIOD = 1_048_573  # a prime below 2^20
_CHUNK = 1 << 20
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def selection_group():
    """SGLang's group of ranks that share this process's batch (``get_dp_tp_group()``), or
    None with a single rank or without SGLang's parallel state."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    group = get_dp_tp_group()
    return group if group.world_size > 1 else None


def predictor_tensors(predictor) -> list[torch.Tensor]:
    """The tensors that make up a predictor's learnt state, in a fixed order (a module's state
    dict; otherwise its tensor attributes, e.g. the online predictor's ``counts`` and
    ``prior``)."""
    if isinstance(predictor, torch.nn.Module):
        items = predictor.state_dict().items()
    else:
        items = vars(predictor).items()
    return [value for _, value in sorted(items) if isinstance(value, torch.Tensor)]


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """int64 scalar on the tensor's device: a position-weighted hash of its bits, mod 2^31-1
    (exact; any changed element or two swapped elements change it, save a 2^-31 chance)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = torch.remainder(flat[start : start + _CHUNK].long(), _MODULUS)
        weight = torch.arange(start, start + part.numel(), device=flat.device)
        weight = torch.remainder(weight, _WEIGHT_PERIOD) + 1
        total = torch.remainder(total + torch.remainder(part * weight, _MODULUS).sum(), _MODULUS)
    return total


def state_checksum(predictor) -> torch.Tensor:
    """int64 ``[n + 1]``: each state tensor's checksum, then the predictor's ``observe``
    count (0 for predictors without one), on the predictor's device."""
    tensors = predictor_tensors(predictor)
    device = tensors[0].device if tensors else "cpu"
    calls = torch.tensor([getattr(predictor, "observe_calls", 0)], dtype=torch.int64)
    sums = [tensor_checksum(t).to(device) for t in tensors]
    return torch.cat([torch.stack(sums) if sums else calls[:0], calls.to(device)])


class TpAgreement:
    """Rank 0's verify set for the whole group, and the periodic check of the predictor state.

    Args:
        group: SGLang's ``GroupCoordinator`` of the ranks that share the batch (``broadcast``,
            ``cpu_group``, ``world_size``, ``rank_in_group``), with more than one rank.
        interval: verify steps between agreement checks (>= 1).

    Attributes:
        divergences: checks that found a rank's state different from rank 0's.
        last_diverged: the ranks (in the group) that differed at the last such check.
    """

    def __init__(self, group, *, interval: int = CHECK_INTERVAL):
        if group.world_size < 2:
            raise ValueError("TpAgreement needs a group of more than one rank")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        self.group = group
        self.interval = interval
        self.steps = 0
        self.checks = 0
        self.divergences = 0
        self.last_diverged: list[int] = []

    @classmethod
    def for_group(cls, group, *, interval: int = CHECK_INTERVAL) -> "TpAgreement | None":
        """A :class:`TpAgreement` for ``group``, or None (no group, or one rank: nothing to
        agree on, no collective)."""
        if group is None or group.world_size < 2:
            return None
        return cls(group, interval=interval)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    def broadcast_selection(
        self, parent_list: torch.Tensor, index: torch.Tensor, draft_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank 0's ``(parent_list [B, P], index [B, D-1], draft_tokens [B, D-1])`` on every
        rank: one broadcast of a packed int64 ``[B, P + 2 (D-1)]``, no host sync (graph-safe;
        the module docstring). Dtypes are kept; the results are contiguous."""
        parts = (parent_list, index, draft_tokens)
        packed = torch.cat([part.long() for part in parts], 1)  # [B, P + 2 (D-1)]
        self.group.broadcast(packed, src=0)
        widths = [part.shape[1] for part in parts]
        return tuple(
            got.to(part.dtype).contiguous()
            for got, part in zip(packed.split(widths, 1), parts, strict=True)
        )

    def after_verify(self, predictor) -> list[int] | None:
        """Counts a verify step; every ``interval`` steps runs :meth:`check` (a collective:
        every rank of the group calls this once per verify step). Returns the check's result,
        or None when no check ran."""
        self.steps += 1
        if self.steps % self.interval:
            return None
        return self.check(predictor)

    def check(self, predictor) -> list[int]:
        """Compares the predictor's state across the group (collective, one host sync); ranks
        that differ from rank 0 are logged as an error and get rank 0's state. Returns those
        ranks (the same list on every rank; empty when all agree)."""
        local = state_checksum(predictor).cpu()
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, local, group=self.group.cpu_group)
        self.checks += 1
        diverged = [r for r, got in enumerate(gathered) if not torch.equal(got, gathered[0])]
        if not diverged:
            return []
        self.divergences += 1
        self.last_diverged = diverged
        logger.error(
            "ECOSPEC: the expert predictor's state on TP rank(s) %s differs from rank 0's "
            "(this is rank %d; check %d, after %d verify steps; checksums %s). Verify sets "
            "stay identical (rank 0's are broadcast each step); copying rank 0's state to "
            "those ranks. Likely cause: the target's routing captured differently across ranks.",
            diverged,
            self.rank,
            self.checks,
            self.steps,
            [got.tolist() for got in gathered],
        )
        self._copy_from_rank0(predictor, int(gathered[0][-1]))
        return diverged

    def _copy_from_rank0(self, predictor, observe_calls: int) -> None:
        """Every rank takes rank 0's state tensors (in place, so captured graphs keep reading
        the live tables) and its observe count."""
        with torch.no_grad():
            for tensor in predictor_tensors(predictor):
                buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
                self.group.broadcast(buffer, src=0)
                if buffer is not tensor:
                    tensor.copy_(buffer)
        if hasattr(predictor, "observe_calls"):
            predictor.observe_calls = observe_calls
