"""The ``sgl-ecospec testbed`` command: ``build``, ``path`` (full, ``--small`` or
``--bandwidth``) and ``train-draft``."""

import argparse
import json
import sys

from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.testbed import bandwidth, build, train_shipped
from sgl_ecospec.lab.testbed.recipe import RECIPES

HELP = "build the MoE test model and its EAGLE-3 draft (cached)"
DESCRIPTION = (
    "MoEfies SmolLM2-135M-Instruct into a Qwen2-MoE model and trains an EAGLE-3 draft for it, "
    "from packaged assets only. Cached under $SGL_ECOSPEC_CACHE/testbed (default "
    "~/.cache/sgl-ecospec/testbed)."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``testbed`` (actions ``build``, ``path``, ``train-draft``) on ``subparsers``."""
    parser = add_command(subparsers, "testbed", run, HELP, DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build_cmd = actions.add_parser("build", help="build (unless cached) and print a summary")
    build_cmd.add_argument("--force", action="store_true", help="rebuild even if cached")
    path_cmd = actions.add_parser(
        "path", help="print target=DIR and draft=DIR, building first if needed"
    )
    for sub in (build_cmd, path_cmd):
        variant = sub.add_mutually_exclusive_group()
        variant.add_argument("--small", action="store_true", help="the small CI variant (8 layers)")
        variant.add_argument(
            "--bandwidth",
            action="store_true",
            help="the bandwidth-bound variant: the full testbed with its routed experts padded "
            "to Qwen3-235B-A22B's share of a layer's weight bytes (minutes from a built full "
            "testbed), with the full testbed's draft",
        )
    train_cmd = actions.add_parser(
        "train-draft",
        help="train the full testbed's shipped draft (hours; resumable)",
        description=train_shipped.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_shipped.add_arguments(train_cmd)
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs ``testbed build`` / ``path`` / ``train-draft``; progress goes to stderr."""
    if args.action == "train-draft":
        return train_shipped.run(args)
    force = getattr(args, "force", False)
    if args.bandwidth:
        out = bandwidth.build(force=force)
    else:
        out = build.build(RECIPES["small" if args.small else "full"], force=force)
    if args.action == "build":
        print(json.dumps(summary(out, args.bandwidth), indent=2), file=sys.stderr, flush=True)
    print(f"target={out / 'target'}")
    print(f"draft={out / 'draft'}")
    return 0


def summary(out, bandwidth_variant: bool) -> dict:
    """What ``testbed build`` prints of a build's ``build.json``: the bandwidth variant's in
    full (width, routed shares, weights hash, greedy check), a recipe build's headline."""
    info = build.read_info(out)
    if bandwidth_variant:
        return info
    keys = ("hash", "dense_perplexity", "moe_perplexity", "acceptance", "weights_sha256")
    source = info["draft_source"]
    draft = f"shipped {source['shipped']}" if "shipped" in source else "trained"
    return {**{key: info[key] for key in keys}, "draft": draft}
