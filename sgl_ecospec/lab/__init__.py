"""The lab: offline tools built on the library (docs/structures.md).

``engine`` (offline tree speculative decoding on transformers), ``testbed`` (the test MoE
model and its EAGLE-3 draft), ``eagle3``, ``datasets``, ``bench`` (the ``bench``, ``sweep``
and ``train-head`` commands), ``serving`` (the serving benchmark's Python side), ``config``
(the validated run configuration) and ``cli`` (the ``sgl-ecospec`` command). The lab may
import transformers; it never imports the SGLang plugin.
"""
