"""The offline benchmark, ``sgl-ecospec bench`` and ``sweep`` (docs/bench.md).

- ``metrics``: per-step engine statistics -> acceptance length, unique experts (mean, p90),
  predictor recall, and their price on a real model profile (MoESD cost model).
- ``report``: the table, the JSON file and the plot.
- ``arguments``: the flags ``bench``, ``sweep`` and ``train-head`` share.
- ``runs``: the engine, greedy reference, output check and progress both commands use.
- ``cli``: the ``bench`` command and its run loop.
- ``sweep``: the ``sweep`` command; ``sweep_plan``, ``sweep_run``, ``sweep_report`` its parts.

The run configurations are ``sgl_ecospec.lab.config``.
"""
