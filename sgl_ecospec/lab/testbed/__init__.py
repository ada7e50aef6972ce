"""The testbed: a real MoE model (SmolLM2-135M-Instruct MoEfied into Qwen2-MoE) and an
EAGLE-3 draft trained against it, built deterministically from packaged assets.

Entry points: :func:`sgl_ecospec.lab.testbed.build.build` (Python) and ``sgl-ecospec testbed
build|path|train-draft`` (CLI, :mod:`sgl_ecospec.lab.testbed.command`). Recipes and
the cache location are in :mod:`sgl_ecospec.lab.testbed.recipe`; see docs/testbed.md.

Modules: ``assets`` (packaged weights and text), ``data`` (chat-rendered token chunks,
perplexity), ``moefy`` and ``routers`` (MoEfication), ``export`` (Qwen2-MoE checkpoint),
``draft_training`` (distillation data and the EAGLE-3 training loop), ``acceptance``
(offline acceptance-length replay), ``recipe``, ``build``, ``shipped`` and ``train_shipped``
(the shipped draft) and ``command``.
"""
