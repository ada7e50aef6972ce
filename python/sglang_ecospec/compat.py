"""Gaps in sglang 0.5.23's EAGLE-3 support for our testbed architecture, filled by hooks.

- ``Qwen2MoeForCausalLM`` (the testbed's architecture) captures EAGLE-3 aux hidden states but
  has no ``get_embed_and_head``, which the EAGLE worker calls to share the target's token
  embedding with the draft: EAGLE3 (and so ECOSPEC) on a Qwen2-MoE target stops at startup
  with ``AttributeError``. :func:`resolve_target_embed_and_head` answers for such targets
  with their ``model.embed_tokens`` and ``lm_head`` weights and defers to SGLang otherwise.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

EMBED_HEAD_TARGET = "sglang.srt.speculative.pp_draft_embedding.resolve_target_embed_and_head"

_registered = False


def register_hooks() -> None:
    """Registers the hooks of this module (idempotent; applied by SGLang's load_plugins)."""
    global _registered
    if not _registered:
        HookRegistry.register(EMBED_HEAD_TARGET, resolve_target_embed_and_head, HookType.AROUND)
        _registered = True


def resolve_target_embed_and_head(original, target_model, *args, **kwargs):
    """AROUND hook: (embed, head) weights of a target without ``get_embed_and_head``."""
    if not (
        hasattr(target_model, "get_embed_and_head")
        or hasattr(target_model, "get_embed_and_head_for_draft")
    ):
        embed = getattr(getattr(target_model, "model", None), "embed_tokens", None)
        head = getattr(target_model, "lm_head", None)
        if embed is not None and head is not None and hasattr(embed, "weight"):
            return embed.weight, head.weight
    return original(target_model, *args, **kwargs)
