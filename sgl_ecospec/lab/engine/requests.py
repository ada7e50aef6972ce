"""Per-request outputs and the stop rule, shared by greedy and speculative decoding.

A request stops at the first EOS token (kept in its output) or when it holds
``max_new_tokens`` tokens; tokens produced past that point in the same step are dropped. The
same rule on both paths makes the lossless comparison exact.
"""

import torch


class Requests:
    """The outputs of a batch of prompts and which of them are still decoding.

    Args:
        num_requests: prompts in the batch.
        max_new_tokens: output cap per request (>= 0).
        eos_token_ids: tokens that end a request.
    """

    def __init__(self, num_requests: int, max_new_tokens: int, eos_token_ids: set[int]):
        self.outputs: list[list[int]] = [[] for _ in range(num_requests)]
        self.active = list(range(num_requests)) if max_new_tokens > 0 else []
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids

    def emit(self, tokens: list[list[int]]) -> torch.Tensor | None:
        """Appends each active request's new tokens under the stop rule.

        Args:
            tokens: per active request (in ``active`` order), its new tokens in order.

        Returns:
            None when every request continues, else int64 ``[B']``: positions (in the old
            ``active`` order) of the requests still decoding, which become ``active``.
        """
        keep = []
        for row, (request, new) in enumerate(zip(self.active, tokens, strict=True)):
            output = self.outputs[request]
            done = False
            for token in new:
                output.append(token)
                if token in self.eos_token_ids or len(output) >= self.max_new_tokens:
                    done = True
                    break
            if not done:
                keep.append(row)
        if len(keep) == len(self.active):
            return None
        self.active = [self.active[row] for row in keep]
        return torch.tensor(keep, dtype=torch.int64)
