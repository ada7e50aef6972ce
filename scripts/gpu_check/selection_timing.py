"""Stage "selection" of the device check: ``select_verify_set`` timed at B = 1..128 on
SGLang-shaped trees (Qwen3-235B and DeepSeek-V3 layers), per request and batch-shared, with
and without EP: an eager call (the Python API, launcher and kernel as the GPU sees them) and
the replay of a CUDA graph holding the call (the device time, as inside SGLang's draft
graph), medians of CUDA-event timings, each result compared with the C++ CPU op. Writes
selection.json row by row. A dry run times the C++ op at tiny shapes on the CPU."""

import common
import torch
from selection_cases import (
    CONFIGS,
    SHAPES,
    TINY_SHAPES,
    cpu_op,
    on_device,
    selection_kwargs,
    sglang_tree,
    target_verdict,
)

from sgl_ecospec import select_verify_set

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    device = common.stage_device(args.dry_run)
    record = common.StageRecord(args.out, "selection", args.dry_run)
    topk, steps, budget = (2, 2, 3) if args.dry_run else (4, 3, 7)
    ranks, repeats = (2, 3) if args.dry_run else (8, 30)
    batches = [1, 2] if args.dry_run else BATCHES
    for model, (layers, experts) in (TINY_SHAPES if args.dry_run else SHAPES).items():
        for batch in batches:
            tree = sglang_tree(batch, topk, steps, layers, experts, 8, seed=batch)
            cpu_args = (tree.scores, tree.parents, tree.node_experts, budget)
            dev_args = [t.to(device) for t in cpu_args[:3]]
            for policy, shared, ep in CONFIGS:
                kwargs = selection_kwargs(policy, shared, ep, layers, experts, ranks)
                kwargs["root_experts"] = tree.root_experts
                dev_kwargs = on_device(kwargs, device)

                def run(dev_args=dev_args, dev_kwargs=dev_kwargs):
                    return select_verify_set(
                        *dev_args, budget, validate=False, impl="native", **dev_kwargs
                    )

                matches = bool(torch.equal(run().cpu(), cpu_op(*cpu_args, **kwargs)))
                eager = common.median_us(run, device, repeats)
                graph = common.replay_median_us(run, repeats) if device.type == "cuda" else None
                row = dict(
                    model=model, layers=layers, num_experts=experts,
                    candidates=tree.scores.shape[1], budget=budget, batch=batch,
                    policy=policy, buffer=shared, ep_ranks=ranks if ep else None,
                    eager_us=eager, graph_us=graph, matches_cpu_op=matches,
                )  # fmt: skip
                record.add(row, ok=matches, failure=f"selection differs from the C++ op: {row}")
                graph_text = "-" if graph is None else f"{graph:8.1f}"
                print(
                    f"select {model:16} {policy:10} shared={shared!s:6} ep={ep!s:5} B={batch:3} "
                    f"eager {eager:8.1f} us graph {graph_text} us matches={matches}",
                    flush=True,
                )
    record.info(target=target_verdict(record.data["rows"]))
    print(f"target: {record.data['info']['target']}")
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
