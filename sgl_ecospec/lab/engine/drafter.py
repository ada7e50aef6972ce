"""The EAGLE-3 draft during decoding: its KV cache, draft extend and tree drafting.

State per request, as SGLang's EAGLE worker keeps it: the draft's KV cache (one row per
committed target token, same lengths as the target's cache), and the root's top-k draft
tokens, probabilities and pre-norm hidden state from the last draft-extend row.

- :meth:`Drafter.extend` runs the draft over newly verified tokens: row t pairs the target's
  aux state at token t with the embedding of token t+1 (the next verified token or the
  bonus), at position t. The last row's output seeds the next tree.
- :meth:`Drafter.grow` grows the candidate tree (``tree.grow_tree``) with num_steps - 1 draft
  forwards over the k beams, at positions lengths + step; the tree's keys/values are
  dropped afterwards (SGLang overwrites them too).

Tree attention, ``tree_attention``:

- "sglang": beam j at step s sees the committed prefix and the rows of beam *slot* j at
  steps 0..s, which is what SGLang's draft-decode KV indices give (each top-k slot owns a
  column per step), even when the beam now in slot j descends from another slot.
- "ancestors": beam j sees the rows of its true ancestors (a proper tree mask).

Shape legend: B = requests, T = rows, k = topk, H = hidden size, A = aux layers,
D = draft vocabulary.
"""

from collections.abc import Callable

import torch

from sgl_ecospec.lab.engine.tree import DraftTree, grow_tree
from sgl_ecospec.models.eagle3 import Eagle3Draft
from sgl_ecospec.models.kvcache import BatchKVCache, padded_causal_mask

TREE_ATTENTION = ("sglang", "ancestors")


class Drafter:
    """Drafting state of one batch.

    Args:
        draft: the EAGLE-3 head.
        embed: the target's token embedding, ids ``[...]`` -> ``[..., H]``.
        batch_size: B.
        topk: k, children per beam.
        tree_attention: "sglang" or "ancestors".
    """

    def __init__(
        self,
        draft: Eagle3Draft,
        embed: Callable[[torch.Tensor], torch.Tensor],
        batch_size: int,
        topk: int,
        tree_attention: str = "sglang",
    ):
        if tree_attention not in TREE_ATTENTION:
            raise ValueError(
                f"tree_attention must be one of {TREE_ATTENTION}, got {tree_attention!r}"
            )
        self.draft, self.embed, self.topk = draft, embed, topk
        self.tree_attention = tree_attention
        device = draft.fc.weight.device
        self.cache = BatchKVCache(1, batch_size, device)
        self.root_probs: torch.Tensor | None = None  # [B, k]
        self.root_tokens: torch.Tensor | None = None  # [B, k], target ids
        self.root_hidden: torch.Tensor | None = None  # [B, H]
        self._beam_hidden: torch.Tensor | None = None  # [B, k, H]
        # [B, k, steps so far]: the beam slot whose draft row each beam sees at each step.
        self._slots: torch.Tensor | None = None

    @torch.no_grad()
    def extend(self, next_tokens: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor) -> None:
        """Appends newly verified rows to the draft cache and sets the next root.

        Args:
            next_tokens: int64 ``[B, T]``: row t's token x_{t+1} (the token after the one
                whose aux state is in the row).
            aux: ``[B, T, A*H]``: the target's aux states of the verified tokens.
            counts: int64 ``[B]`` in [1, T]: valid rows per request (the rest is padding).
        """
        batch, rows = next_tokens.shape
        index = torch.arange(rows, device=counts.device)
        new_mask = padded_causal_mask(counts, rows)
        positions = self.cache.lengths[:, None] + index
        out = self._forward(next_tokens, aux, positions, new_mask)
        self.cache.commit(torch.where(index < counts[:, None], index, -1))
        every, last = torch.arange(batch, device=counts.device), counts - 1
        self.root_hidden = out.hidden[every, last]
        self.root_probs, self.root_tokens = self._top_children(out.logits[every, last])

    @torch.no_grad()
    def grow(self, num_steps: int) -> DraftTree:
        """The candidate tree of every request (see ``tree.grow_tree``)."""
        tree = grow_tree(
            self.root_probs, self.root_tokens, self.root_hidden, self._expand, num_steps
        )
        lengths = self.cache.lengths
        self.cache.commit(lengths.new_empty(lengths.shape[0], 0))
        return tree

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the requests ``rows`` (int64 ``[B']``)."""
        self.cache.select(rows)
        self.root_probs = self.root_probs[rows]
        self.root_tokens = self.root_tokens[rows]
        self.root_hidden = self.root_hidden[rows]

    def _expand(self, step: int, beam_tokens: torch.Tensor, parent_beam: torch.Tensor):
        """One draft forward over the k beams of ``step`` (``tree.Expand``): beam tokens and
        parent beams ``[B, k]`` -> children probabilities and target ids ``[B, k, k]``, and
        the beams' draft states ``[B, k, H]``."""
        batch, topk = beam_tokens.shape
        slot = torch.arange(topk, device=beam_tokens.device)[None, :, None].expand(batch, -1, 1)
        if step == 0:
            hidden = self.root_hidden[:, None].expand(-1, topk, -1)
            self._slots = slot
        else:
            index = parent_beam[..., None]
            hidden = self._beam_hidden.gather(1, index.expand(-1, -1, self._beam_hidden.shape[-1]))
            history = self._slots
            if self.tree_attention == "ancestors":
                history = history.gather(1, index.expand(-1, -1, history.shape[-1]))
            else:
                history = slot.expand(-1, -1, step)
            self._slots = torch.cat([history, slot], 2)
        # Step s's rows are pending columns s*k .. s*k + k - 1; row j sees one per step.
        columns = torch.arange(step + 1, device=beam_tokens.device) * topk + self._slots
        new_mask = torch.zeros(
            batch, topk, (step + 1) * topk, dtype=torch.bool, device=beam_tokens.device
        )
        new_mask.scatter_(2, columns, True)
        positions = (self.cache.lengths + step)[:, None].expand(-1, topk)
        out = self._forward(beam_tokens, hidden, positions, new_mask)
        self._beam_hidden = out.hidden
        return *self._top_children(out.logits), out.hidden

    def _forward(self, tokens, hidden, positions, new_mask):
        """One draft forward of new rows over the cache (``new_mask``: the new rows' mask
        among themselves); their keys and values are appended to the cache."""
        out = self.draft(
            self.embed(tokens),
            hidden,
            positions,
            past=self.cache.layer(0),
            attn_mask=self.cache.attention_mask(new_mask),
        )
        self.cache.update(out.key, out.value, 0)
        return out

    def _top_children(self, logits: torch.Tensor):
        # SGLang's draft: softmax over the draft vocabulary, top-k, then map to target ids.
        probs, draft_ids = torch.topk(logits.float().softmax(-1), self.topk, dim=-1)
        return probs, self.draft.to_target_ids(draft_ids)
