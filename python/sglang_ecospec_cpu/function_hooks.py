"""AROUND hooks that swap SGLang's Triton kernel functions for PyTorch versions on the CPU.

Shared by :mod:`sglang_ecospec_cpu.attention` and :mod:`sglang_ecospec_cpu.kernels`: a hook
runs the PyTorch version for the calls it covers and hands the rest (its fallback predicate
names why, logged once per reason) to the original kernel; a kernel function whose
parameters differ from ours (another SGLang version) keeps its Triton version.
"""

import inspect
import logging

logger = logging.getLogger(__name__)


def around_hook(name: str, impl, fallback_reason):
    """AROUND hook: ``impl`` for the calls it covers, the Triton kernel for the rest."""
    signature = inspect.signature(impl)
    reported = set()

    def hook(original, *args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        reason = fallback_reason(**arguments)
        if reason is None:
            return impl(*args, **kwargs)
        if reason not in reported:
            reported.add(reason)
            logger.info("%s: %s, running the Triton kernel", name, reason)
        return original(*args, **kwargs)

    return hook


def same_parameters(target: str, impl) -> bool:
    """Whether SGLang's kernel function at ``target`` takes the parameters ``impl`` takes."""
    import pkgutil

    original = pkgutil.resolve_name(target)
    theirs = list(inspect.signature(original).parameters)
    ours = list(inspect.signature(impl).parameters)
    if theirs != ours:
        logger.warning(
            "%s takes %s, the CPU version %s: keeping the Triton kernel", target, theirs, ours
        )
        return False
    return True


def register_function_hooks(functions: dict) -> list[str]:
    """Registers ``target -> (PyTorch version, fallback predicate)`` as AROUND hooks with
    SGLang's ``HookRegistry`` (applied after plugin loading); returns the targets hooked."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooked = []
    for target, (impl, fallback_reason) in functions.items():
        if not same_parameters(target, impl):
            continue
        name = target.rsplit(".", 1)[1]
        HookRegistry.register(target, around_hook(name, impl, fallback_reason), HookType.AROUND)
        hooked.append(target)
    return hooked
