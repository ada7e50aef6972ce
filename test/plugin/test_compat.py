"""The hooks that fill gaps in SGLang's EAGLE-3 support."""

from types import SimpleNamespace

import torch


def test_compat_hook_shares_embed_and_head_of_targets_without_the_method():
    from sglang_ecospec import compat

    embed, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4)
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=head)
    got = compat.resolve_target_embed_and_head(lambda *a, **k: "sglang", target)
    assert got[0] is embed.weight and got[1] is head.weight
    with_method = SimpleNamespace(get_embed_and_head=lambda: None)
    assert compat.resolve_target_embed_and_head(lambda *a, **k: "sglang", with_method) == "sglang"
