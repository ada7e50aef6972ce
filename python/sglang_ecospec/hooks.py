"""The plugin's hooks into SGLang: which object each hook serves in this process, and their
one-time installation.

SGLang's ``HookRegistry`` patches a target once for the life of the process, and a hook is a
plain function, so it cannot carry a runtime's objects. Each module that hooks SGLang
therefore keeps one :class:`HookSlot`: its hook functions (declared with :meth:`HookSlot.hook`)
read the slot's active object and run SGLang's own code while the slot is empty (EAGLE,
EAGLE3 and every other algorithm served by the same process). The ECOSPEC runtime fills its
slots with :func:`activate` at start, which first installs the slots' hooks (each target and
function once per process), and empties them with :func:`deactivate` at close.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

T = TypeVar("T")


class Hook(NamedTuple):
    """``fn``, a hook of type ``kind``, on the dotted path ``target`` (HookRegistry's)."""

    target: str
    fn: Callable
    kind: HookType = HookType.AROUND


# (target, fn) pairs registered in this process: HookRegistry itself would wrap a target
# again for every registration of the same function.
_installed: set[tuple[str, Callable]] = set()


def install(hooks: Iterable[Hook]) -> None:
    """Registers and applies those of ``hooks`` not installed yet in this process
    (idempotent)."""
    new = [hook for hook in dict.fromkeys(hooks) if (hook.target, hook.fn) not in _installed]
    for hook in new:
        HookRegistry.register(hook.target, hook.fn, hook.kind)
        _installed.add((hook.target, hook.fn))
    if new:
        HookRegistry.apply_hooks()


class HookSlot(Generic[T]):
    """The one object of a kind that this process's hooks use (None: they defer to SGLang).

    Args:
        name: what the slot holds (for messages).

    Attributes:
        hooks: the hooks that read the slot, installed by :func:`activate`.
    """

    def __init__(self, name: str):
        self.name = name
        self.hooks: tuple[Hook, ...] = ()
        self._active: T | None = None

    def __repr__(self) -> str:
        return f"HookSlot({self.name!r}, active={self._active is not None})"

    def hook(self, target: str, kind: HookType = HookType.AROUND):
        """Decorator: declares the function a hook of ``kind`` on ``target`` that reads this
        slot; the function is returned unchanged (tests call it directly)."""

        def declare(fn: Callable) -> Callable:
            self.hooks += (Hook(target, fn, kind),)
            return fn

        return declare

    def activate(self, obj: T | None) -> None:
        """Makes ``obj`` the one the hooks use (None: SGLang's own code)."""
        self._active = obj

    def active(self) -> T | None:
        return self._active

    def deactivate_if(self, obj: T | None) -> None:
        """Empties the slot if ``obj`` still holds it (a newer runtime's object stays)."""
        if obj is not None and self._active is obj:
            self._active = None

    def bind(self, obj: T, *extra: Hook) -> "Binding":
        """``obj`` for this slot, with the slot's hooks plus ``extra`` (hooks whose target
        is known only at run time, e.g. the served model's class)."""
        return Binding(self, obj, self.hooks + extra)


class Binding(NamedTuple):
    """An object for a slot and the hooks that must be installed before it is active."""

    slot: HookSlot
    obj: object
    hooks: tuple[Hook, ...]


def activate(bindings: Sequence[Binding]) -> None:
    """Installs every binding's hooks, then makes each object active in its slot."""
    install(hook for binding in bindings for hook in binding.hooks)
    for binding in bindings:
        binding.slot.activate(binding.obj)


def deactivate(bindings: Sequence[Binding]) -> None:
    """Empties the slots the bindings' objects still hold."""
    for binding in bindings:
        binding.slot.deactivate_if(binding.obj)
