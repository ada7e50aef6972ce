"""The serving benchmark's Python side: local SGLang servers and ``sglang.bench_serving``
against each (``scripts/bench_serving.sh``)."""
