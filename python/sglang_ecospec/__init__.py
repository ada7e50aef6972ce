"""sglang_ecospec: the SGLang plugin of sgl-ecospec.

SGLang runs :func:`register` (entry point ``ecospec`` of the group ``sglang.srt.plugins``,
see setup.py) in every server process: the launcher, each scheduler, the detokenizer. It

- registers the speculative algorithm ECOSPEC (``--speculative-algorithm ECOSPEC``): EAGLE-3
  with EcoSpec's cost-aware verify-set selection (:mod:`sglang_ecospec.algorithm`);
- fills gaps in SGLang's EAGLE-3 support for the testbed architecture
  (:mod:`sglang_ecospec.compat`);
- on a machine without a GPU serving with ``--device cpu`` (``SGLANG_USE_CPU_ENGINE=1``),
  turns on the CPU development mode, the separate package :mod:`sglang_ecospec_cpu`, which
  is not even imported otherwise (GPU servers never load it).

All are cheap: no SGLang worker module is imported until a scheduler builds an ECOSPEC
worker. docs/sglang.md describes the mechanism and the settings.
"""

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["register"]


def register() -> None:
    """The plugin entry point (idempotent)."""
    from sglang_ecospec import algorithm, compat

    compat.register_hooks()
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        import sglang_ecospec_cpu

        sglang_ecospec_cpu.enable_if_cpu()
    algorithm.register_algorithm()
