"""The expert -> EP rank placement of an ECOSPEC scheduler, read from SGLang.

Under expert parallelism (``--ep-size`` > 1) the verify pass waits for its busiest EP rank,
so the selector prices a candidate by the rise of that rank's expert loads
(``select_verify_set(expert_rank=, num_ranks=)``, docs/selection.md). The placement comes
from SGLang's global ``ExpertLocationMetadata`` (``sglang.srt.eplb.expert_location``),
which covers EPLB's logical -> physical map and redundant experts, and is turned into ranks
by ``sgl_ecospec.placement.expert_rank_map``:

- a scheduler that owns its batch alone (attention DP with attention TP and CP of 1) meets
  the replicas its own rank dispatches to: ``logical_to_rank_dispatch_physical_map`` (static
  dispatch, SGLang's per-rank choice);
- otherwise the ranks of an attention-TP group run the selection on the same batch and must
  pick the same verify set, so every rank uses the map they all share, the first replica
  (``logical_to_all_physical_map[..., 0]``); also with dynamic dispatch, where no per-rank
  map exists. Without redundant experts both maps are the same.

A model without expert-location metadata keeps SGLang's plain layout, logical expert e in
slot e (rank-major).

EPLB rebalances by ``ExpertLocationMetadata.update`` on the global metadata, in place, on
whatever stream is current there, while a draft step (a CUDA graph reading ``expert_rank``)
may be running on the scheduler's forward stream. So :func:`after_location_update` (an AFTER
hook on it) only marks the active placement stale (:meth:`ExpertPlacement.request_refresh`,
recording an event on EPLB's stream after its writes), and the worker applies it at the start
of the next decode step (:meth:`ExpertPlacement.apply_refresh`, from
``EcoSpecRuntime.before_decode``): on the forward stream, which first waits for that event,
then recomputes the placement into the same buffer. The copy is thereby ordered after every
draft step already queued on the forward stream and before the next one; no step sees a
half-written map, and CUDA graphs captured before keep reading the current ranks. A replaced
metadata object of another EP size (elastic EP scaling) is not followed.

Shape legend: L = MoE layers the predictor covers, E = logical experts per layer.
"""

import dataclasses
import logging

import torch
from sglang.srt.plugins.hook_registry import HookType

from sgl_ecospec.placement import expert_rank_map
from sglang_ecospec.hooks import HookSlot

logger = logging.getLogger(__name__)

UPDATE_TARGET = "sglang.srt.eplb.expert_location.ExpertLocationMetadata.update"


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """What SGLang tells a scheduler process about expert parallelism.

    Attributes:
        ep_size: MoE EP ranks (1: no EP).
        metadata: SGLang's ``ExpertLocationMetadata`` (or an object with its fields), or
            None when the model has none.
        owns_batch: this process's batch is its own (attention TP and CP of 1); else the
            ranks of its attention group share one batch.
    """

    ep_size: int = 1
    metadata: object | None = None
    owns_batch: bool = False


def sglang_layout() -> EPLayout:
    """The layout of the running SGLang scheduler process (after the model is loaded)."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    metadata = get_global_expert_location_metadata()
    ep_size = metadata.ep_size if metadata is not None else parallel.moe_ep_size
    owns_batch = parallel.attn_tp_size == 1 and parallel.attn_cp_size == 1
    return EPLayout(ep_size=int(ep_size), metadata=metadata, owns_batch=owns_batch)


def physical_slots(metadata, owns_batch: bool) -> torch.Tensor:
    """The physical slot each logical expert's verify tokens reach, int ``[layers, E]``,
    per the module doc's rule."""
    dispatch = metadata.logical_to_rank_dispatch_physical_map
    if owns_batch and dispatch is not None:
        return dispatch
    return metadata.logical_to_all_physical_map[..., 0]


class ExpertPlacement:
    """The EP rank of every (MoE layer, logical expert) the predictor covers, kept in one
    persistent buffer.

    Args:
        layout: SGLang's EP state (``ep_size`` > 1).
        moe_layer_ids: the target's layer ids of the predictor's MoE layers, in its order.
        num_experts: E, the predictor's experts per layer.
        device: where the buffer lives (the selector's device).

    Attributes:
        expert_rank: int64 ``[L, E]``: rank in [0, num_ranks) of each expert.
        num_ranks: R = ep_size.

    Raises:
        ValueError: the metadata does not describe this model (experts, layers), or the
            experts do not split evenly over the ranks without metadata.
    """

    def __init__(self, layout: EPLayout, moe_layer_ids: list[int], num_experts: int, device):
        if layout.ep_size < 2:
            raise ValueError(f"an expert placement needs ep_size > 1, got {layout.ep_size}")
        self.layout = layout
        self.num_ranks = layout.ep_size
        self.num_experts = num_experts
        self.layer_ids = list(moe_layer_ids)
        self.expert_rank = torch.zeros(
            (len(self.layer_ids), num_experts), dtype=torch.int64, device=device
        )
        self._pending = False  # an EPLB update not yet applied (request_refresh)
        self._written = None  # its event on EPLB's stream (CUDA)
        self._check_metadata()
        self.refresh(validate=True)

    def _check_metadata(self) -> None:
        metadata = self.layout.metadata
        if metadata is None:
            if self.num_experts % self.num_ranks:
                raise ValueError(
                    f"{self.num_experts} experts do not split over ep_size {self.num_ranks} "
                    "and SGLang has no expert location metadata for this model: set "
                    "SGLANG_ECOSPEC_EP_COST=false"
                )
            return
        if metadata.ep_size != self.num_ranks:
            raise ValueError(
                f"expert location metadata is for ep_size {metadata.ep_size}, the layout "
                f"says {self.num_ranks}"
            )
        layers, experts = metadata.logical_to_all_physical_map.shape[:2]
        if experts != self.num_experts:
            raise ValueError(
                f"SGLang's expert location metadata has {experts} logical experts per "
                f"layer, the predictor {self.num_experts}"
            )
        if self.layer_ids and max(self.layer_ids) >= layers:
            raise ValueError(
                f"MoE layer {max(self.layer_ids)} is outside SGLang's expert location "
                f"metadata ({layers} layers)"
            )

    def ranks(self, *, validate: bool = False) -> torch.Tensor:
        """int64 ``[L, E]``: the current placement, computed from the metadata (no host
        sync unless ``validate``)."""
        device = self.expert_rank.device
        metadata = self.layout.metadata
        if metadata is None:
            slots = torch.arange(self.num_experts, device=device).expand_as(self.expert_rank)
            return expert_rank_map(slots, self.num_experts, self.num_ranks, validate=validate)
        slots = physical_slots(metadata, self.layout.owns_batch)
        rows = torch.tensor(self.layer_ids, dtype=torch.long, device=slots.device)
        slots = slots.index_select(0, rows)
        ranks = expert_rank_map(
            slots, metadata.num_physical_experts, self.num_ranks, validate=validate
        )
        return ranks.to(device)

    def refresh(self, *, validate: bool = False) -> None:
        """Recomputes the placement into ``expert_rank`` in place, on the current stream
        (graph-safe: same buffer, no host sync unless ``validate``)."""
        self.expert_rank.copy_(self.ranks(validate=validate))

    @property
    def refresh_pending(self) -> bool:
        """The metadata changed since the last refresh (:meth:`request_refresh`)."""
        return self._pending

    def request_refresh(self) -> None:
        """Marks the placement stale after an EPLB update; on a CUDA device records an event
        on the current stream (EPLB's, after its metadata writes). Nothing is copied."""
        self._pending = True
        self._written = None
        if self.expert_rank.is_cuda:
            self._written = torch.cuda.Event()
            self._written.record()

    def apply_refresh(self) -> bool:
        """At the start of a decode step, on the forward stream: a pending refresh, after
        waiting (on the device) for EPLB's writes. Returns whether one was applied."""
        if not self._pending:
            return False
        if self._written is not None:
            torch.cuda.current_stream(self.expert_rank.device).wait_event(self._written)
        self.refresh()
        self._pending, self._written = False, None
        return True

    def follows(self, metadata) -> bool:
        """This placement is computed from ``metadata`` (the object EPLB updates)."""
        return metadata is not None and metadata is self.layout.metadata


# The placement of this process's ECOSPEC worker (under EP with ep_cost); empty, EPLB
# updates are SGLang's alone.
slot: HookSlot[ExpertPlacement] = HookSlot("expert placement")


@slot.hook(UPDATE_TARGET, HookType.AFTER)
def after_location_update(result, metadata, *args, **kwargs):
    """AFTER hook on ``ExpertLocationMetadata.update`` (EPLB rebalance): marks the active
    placement stale when it reads the updated metadata; the worker applies the refresh at the
    next decode step, on the forward stream (module doc). Returns SGLang's result
    unchanged."""
    placement = slot.active()
    if placement is not None and placement.follows(metadata):
        placement.request_refresh()
        logger.info("ECOSPEC: expert placement refresh after an EPLB update, at the next step")
    return result
