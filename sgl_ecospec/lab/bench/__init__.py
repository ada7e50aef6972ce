"""The offline benchmark, ``sgl-ecospec bench`` (docs/bench.md).

- ``metrics``: per-step engine statistics -> acceptance length, unique experts (mean, p90),
  predictor recall, and their price on a real model profile (MoESD cost model).
- ``report``: the table, the JSON file and the plot.
- ``cli``: argument parsing and the run loop.
"""
