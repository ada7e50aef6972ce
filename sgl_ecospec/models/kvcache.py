"""A batched KV cache whose requests have different lengths, with tree-friendly commits.

Layout: per layer, keys and values ``[B, G, W, Dh]``. Request b's committed tokens are the
columns ``[0, lengths[b])`` (its rotary positions equal the column indices); columns between
``lengths[b]`` and the committed width ``C`` are stale and always masked. A forward appends
its new rows as *pending* columns ``[C, W)`` for every request (HF ``Cache.update``
protocol, so a transformers model writes into it directly). :meth:`commit` then keeps, per
request, a chosen subset of the pending columns (e.g. the accepted path of a verified
tree) by moving them to ``[lengths[b], lengths[b] + n_b)`` and drops the rest.

Shape legend: B = requests, G = key/value heads, W = stored columns, C = committed width,
P = pending columns, T = new rows of a forward, Dh = head dim, M = kept columns per request.
"""

import torch


class BatchKVCache:
    """Keys/values of ``num_layers`` attention layers for a batch of requests.

    Attributes:
        lengths: int64 ``[B]``, committed tokens per request.
        committed_width: C, the columns before the pending ones.
    """

    def __init__(self, num_layers: int, batch_size: int, device: str | torch.device = "cpu"):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.committed_width = 0

    @property
    def width(self) -> int:
        """W, the stored columns (committed width plus pending)."""
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    @property
    def pending(self) -> int:
        """P, columns appended since the last :meth:`commit`."""
        return self.width - self.committed_width

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int):
        """Appends T new rows ``[B, G, T, Dh]`` to one layer; returns all its columns
        ``[B, G, W, Dh]`` (the transformers ``Cache.update`` protocol)."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = key, value
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], 2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], 2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Stored columns W (transformers asks for it when no positions are given)."""
        return self.width

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) ``[B, G, W, Dh]`` of one layer, or None while empty."""
        if self.keys[layer_idx] is None:
            return None
        return self.keys[layer_idx], self.values[layer_idx]

    def attention_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Full mask for a forward of T new rows.

        Args:
            new_mask: bool ``[B, T, P + T]``: which pending and new columns each row sees.

        Returns:
            bool ``[B, T, C + P + T]``: committed columns ``< lengths[b]`` are visible to
            every row of request b, stale ones to none.
        """
        batch, rows, _ = new_mask.shape
        columns = torch.arange(self.committed_width, device=new_mask.device)
        committed = (columns < self.lengths[:, None])[:, None].expand(batch, rows, -1)
        return torch.cat([committed, new_mask], -1)

    def commit(self, keep: torch.Tensor) -> None:
        """Keeps some pending columns per request and drops the rest.

        Args:
            keep: int64 ``[B, M]``: offsets into the pending columns (in [0, P)), ascending
                per row, then -1 padding. Row b's kept columns become its tokens
                ``lengths[b] .. lengths[b] + n_b - 1`` in the given order.
        """
        counts = (keep >= 0).sum(1)
        new_lengths = self.lengths + counts
        new_width = int(new_lengths.max()) if new_lengths.numel() else 0
        if bool((counts > 0).any()):
            # The kept columns are gathered before any write, so moves may overlap. Padding
            # slots repeat slot 0 (same source, destination and value): the scatter has no
            # conflicting writes, and a row that keeps nothing only writes a stale column.
            valid = keep >= 0
            slots = torch.arange(keep.shape[1], device=keep.device)
            offsets = torch.where(valid, keep, keep[:, :1]).clamp_min(0)
            source = (self.committed_width + offsets)[:, None, :, None]
            dest = (self.lengths[:, None] + torch.where(valid, slots, 0))[:, None, :, None]
            for t in self.keys + self.values:
                index = source.expand(t.shape[0], t.shape[1], -1, t.shape[3])
                t.scatter_(2, dest.expand_as(index), t.gather(2, index))
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = t[:, :, :new_width]
        self.lengths = new_lengths
        self.committed_width = new_width

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the requests ``rows`` (int64 ``[B']``, in the new order) and crops the
        width to the longest of them; call with no pending columns."""
        self.lengths = self.lengths[rows]
        width = int(self.lengths.max()) if rows.numel() else 0
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = t[rows, :, :width]
        self.committed_width = width


def padded_causal_mask(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Causal mask over T new rows of which the first ``counts[b]`` are real.

    Args:
        counts: int64 ``[B]`` in [0, T].
        rows: T.

    Returns:
        bool ``[B, T, T]``: real rows see the real rows up to themselves; padding rows see
        only themselves, so no row is fully masked (attention would give NaN).
    """
    index = torch.arange(rows, device=counts.device)
    real = index[None] < counts[:, None]  # [B, T]
    causal = index[:, None] >= index[None]
    return (causal & real[:, None, :]) | torch.eye(rows, dtype=torch.bool, device=counts.device)
