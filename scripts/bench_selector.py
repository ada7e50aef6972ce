"""Times verify-set selection: the C++ op against the PyTorch reference.

Shapes: B in {1, 16, 64} requests, N = 64 candidates, budget 16, with the layer and expert
counts of Qwen3-235B-A22B (L=94, E=128, K=8) and DeepSeek-V3 (L=58, E=256, K=8). Prints a
table and writes JSON. Both implementations must return the same selection.

    .venv/bin/python scripts/bench_selector.py --json results/bench_selector.json
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sgl_ecospec import has_native, select_verify_set
from sgl_ecospec.ops.options import SelectionOptions
from sgl_ecospec.synthetic import random_draft_tree

SHAPES = {
    "qwen3-235b-a22b": dict(layers=94, num_experts=128, top_k=8),
    "deepseek-v3": dict(layers=58, num_experts=256, top_k=8),
}
CONFIGS = [
    SelectionOptions("ecospec"),
    SelectionOptions("ecospec", share_buffer=True),
    SelectionOptions("confidence"),
]


def median_seconds(fn, *, min_repeats: int, min_seconds: float) -> float:
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("results/bench_selector.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch must be comma-separated ints, got {args.batch!r}")
    if not has_native():
        print("error: sgl_ecospec._C is not built; run bash scripts/setup_env.sh", file=sys.stderr)
        return 2
    repeats = (1, 0.0) if args.quick else (5, 1.0)
    rows = []
    print(
        f"{'model':16} {'policy':10} {'shared':6} {'B':>3} {'native_us':>10} "
        f"{'reference_us':>13} {'speedup':>8}"
    )
    for model, shape in SHAPES.items():
        for batch in batches:
            tree = random_draft_tree(batch, args.nodes, *shape.values(), seed=batch)
            for options in CONFIGS:
                policy, shared = options.policy, options.share_buffer

                def run(impl, tree=tree, options=options):
                    return select_verify_set(
                        tree.scores,
                        tree.parents,
                        tree.node_experts,
                        args.budget,
                        root_experts=tree.root_experts,
                        options=options,
                        validate=False,
                        impl=impl,
                    )

                if not torch.equal(run("native"), run("reference")):
                    print(
                        f"error: native and reference disagree for {model} B={batch} {policy}",
                        file=sys.stderr,
                    )
                    return 1
                native = median_seconds(
                    lambda run=run: run("native"),
                    min_repeats=repeats[0] * 20,
                    min_seconds=repeats[1],
                )
                reference = median_seconds(
                    lambda run=run: run("reference"), min_repeats=repeats[0], min_seconds=repeats[1]
                )
                row = dict(model=model, **shape, policy=policy, share_buffer=shared, batch=batch)
                row.update(nodes=args.nodes, budget=args.budget, native_us=native * 1e6)
                row.update(reference_us=reference * 1e6, speedup=reference / native)
                rows.append(row)
                print(
                    f"{model:16} {policy:10} {str(shared):6} {batch:>3} {row['native_us']:>10.1f} "
                    f"{row['reference_us']:>13.1f} {row['speedup']:>7.1f}x",
                    flush=True,
                )
    result = dict(
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        ),
        date=time.strftime("%Y-%m-%d"),
        rows=rows,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
