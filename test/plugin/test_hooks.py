"""The hook slots: one active object per kind and process, hooks installed once however
often they are activated, and a close that empties only what it still holds."""

import sys
import types
from collections import defaultdict

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_ecospec import ep_placement, hooks, metrics, routing, selection, verify_moe_hook

# A module of our own as the hooked target, so that the test patches nothing of SGLang's.
TARGET_MODULE = "_ecospec_hook_target"


def make_target(monkeypatch):
    """A module with ``double(x)`` that counts its calls, and an empty hook registry (the
    process's real one, with SGLang's targets, is restored after the test)."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(hooks, "_installed", set())
    module = types.ModuleType(TARGET_MODULE)
    module.calls = 0

    def double(x):
        module.calls += 1
        return 2 * x

    module.double = double
    monkeypatch.setitem(sys.modules, TARGET_MODULE, module)
    return module


def test_slot_holds_one_object_and_defers_when_empty(monkeypatch):
    target = make_target(monkeypatch)
    slot = hooks.HookSlot("offset")

    @slot.hook(f"{TARGET_MODULE}.double")
    def add_offset(original, x):
        offset = slot.active()
        return original(x) if offset is None else original(x) + offset

    assert [hook.fn for hook in slot.hooks] == [add_offset]
    assert add_offset(lambda x: x, 3) == 3  # the decorator returns the function itself
    first, second = slot.bind(10), slot.bind(100)
    hooks.activate([first])
    hooks.activate([first])  # installed once: one wrapper, one call of the original
    assert target.double(1) == 12 and target.calls == 1
    hooks.activate([second])
    hooks.deactivate([first])  # no longer first's: the newer object stays
    assert slot.active() == 100 and target.double(1) == 102
    hooks.deactivate([second])
    assert slot.active() is None and target.double(1) == 2
    assert repr(slot) == "HookSlot('offset', active=False)"


def test_extra_hooks_and_after_hooks(monkeypatch):
    target = make_target(monkeypatch)
    slot = hooks.HookSlot("seen")
    seen = []

    def record(result, x):
        if slot.active() is not None:
            seen.append((x, result))
        return None  # SGLang's result stands

    extra = hooks.Hook(f"{TARGET_MODULE}.double", record, HookType.AFTER)
    binding = slot.bind("on", extra)
    assert binding.hooks == (extra,)
    hooks.activate([binding])
    assert target.double(4) == 8 and seen == [(4, 8)]
    hooks.deactivate([binding])
    assert target.double(5) == 10 and seen == [(4, 8)]


def test_each_plugin_module_declares_its_sglang_hooks():
    declared = {
        module.__name__.rsplit(".", 1)[1]: {(h.target, h.kind) for h in module.slot.hooks}
        for module in (selection, routing, metrics, ep_placement, verify_moe_hook)
    }
    assert declared == {
        "selection": {
            (selection.ORGANIZE_TARGET, HookType.AROUND),
            (selection.SELECT_TARGET, HookType.AROUND),
        },
        "routing": {
            (routing.CAPTURE_TARGET, HookType.AFTER),
            (f"{routing.TOPK_TARGET}.forward", HookType.AROUND),
            (f"{routing.TOPK_TARGET}.forward_cuda", HookType.AROUND),
        },
        "metrics": {(metrics.REPORT_TARGET, HookType.AROUND)},
        "ep_placement": {(ep_placement.UPDATE_TARGET, HookType.AFTER)},
        # The model class's forward is known only at run time: model_forward_hook.
        "verify_moe_hook": {(verify_moe_hook.MOE_CORE_TARGET, HookType.AROUND)},
    }
    hook = verify_moe_hook.model_forward_hook(HookRegistry)
    assert hook.target == "sglang.srt.plugins.hook_registry.HookRegistry.forward"
    assert hook.fn is verify_moe_hook.around_model_forward
