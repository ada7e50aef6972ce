"""sglang_ecospec: the SGLang plugin of sgl-ecospec.

SGLang runs :func:`register` (entry point ``ecospec`` of the group ``sglang.srt.plugins``,
see setup.py) in every server process: the launcher, each scheduler, the detokenizer. It

- registers the speculative algorithm ECOSPEC (``--speculative-algorithm ECOSPEC``): EAGLE-3
  with EcoSpec's cost-aware verify-set selection (:mod:`sglang_ecospec.algorithm`);
- fills gaps in SGLang's EAGLE-3 support for the testbed architecture
  (:mod:`sglang_ecospec.compat`);
- on a machine without a GPU serving with ``--device cpu`` (``SGLANG_USE_CPU_ENGINE=1``),
  turns on the CPU development mode (:mod:`sglang_ecospec.cpu_dev`).

Both are cheap: no SGLang worker module is imported until a scheduler builds an ECOSPEC
worker. docs/sglang.md describes the mechanism and the settings.
"""

import logging

logger = logging.getLogger(__name__)

__all__ = ["register"]


def register() -> None:
    """The plugin entry point (idempotent)."""
    from sglang_ecospec import algorithm, compat, cpu_dev

    compat.register_hooks()
    cpu_dev.enable_if_cpu()
    algorithm.register_algorithm()
