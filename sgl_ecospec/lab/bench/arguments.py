"""Command-line arguments shared by ``bench``, ``sweep`` and ``train-head``.

Parsing only: the values are checked where the configuration is built
(``sgl_ecospec.lab.config``).
"""

import argparse

from sgl_ecospec.ops.options import SERVED_SHARE_BUFFER

PREDICTORS = ("online", "vocab", "context", "adjacent", "oracle", "head")
DTYPES = ("float32", "bfloat16", "float16")


def add_tree_arguments(group) -> None:
    """--topk, --steps, --budget: the draft tree and its verify budget (bench and sweep)."""
    group.add_argument("--topk", type=int, default=4, help="draft tree branching")
    group.add_argument("--steps", type=int, default=3, help="draft tree depth")
    group.add_argument("--budget", type=int, default=4, help="draft tokens verified per request")


def add_decoding_group(parser, *, batch_size: int):
    """The "decoding" group of ``bench`` and ``train-head``: ``--max-new-tokens``,
    ``--batch-size`` (default ``batch_size``) and the draft tree; returned for the command's
    own flags."""
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-new-tokens", type=int, default=64)
    group.add_argument("--batch-size", type=int, default=batch_size, help="prompts per batch")
    add_tree_arguments(group)
    return group


def add_predictor_arguments(group) -> None:
    """``--predictor`` and ``--predictor-file`` (shared by ``bench`` and ``sweep``)."""
    group.add_argument(
        "--predictor",
        choices=PREDICTORS,
        default="online",
        help="online: routing counts learnt while decoding (4096 hashed token rows); vocab: "
        "the same with every token its own row (compact counts); context: vocab plus (parent "
        "token, token) pair counts, backing off to the token; adjacent: context leaning to "
        "each row's latest routing, an unseen token taking its parent's experts; oracle: the "
        "true routing; head: a trained LowRankExpertHead (--predictor-file, from "
        "`sgl-ecospec train-head`)",
    )
    group.add_argument(
        "--predictor-file",
        metavar="FILE",
        help="the head for --predictor head, or a saved online predictor to start from "
        "(every run starts from the file)",
    )


def add_recall_weighted_argument(group, default: bool) -> None:
    """``--recall-weighted-cost`` / ``--no-recall-weighted-cost``: DeltaCost trusts only what
    the predictor knows."""
    group.add_argument(
        "--recall-weighted-cost",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="weigh each layer's DeltaCost by the predictor's live trust (how far its predicted "
        "new experts track the verified candidates' true ones) and add the measured cost of "
        "the rest to eps, so that as the trust falls ecospec approaches confidence "
        f"(default {'on' if default else 'off'})",
    )


def add_share_buffer_argument(group, help: str) -> None:
    """``--share-buffer`` / ``--no-share-buffer`` (on by default: ``SERVED_SHARE_BUFFER``)."""
    group.add_argument(
        "--share-buffer",
        action=argparse.BooleanOptionalAction,
        default=SERVED_SHARE_BUFFER,
        help=help,
    )


def add_model_arguments(parser) -> None:
    """The "models" group: --target, --draft, --small, --device, --dtype, --reproducible. Without
    --target/--draft the commands use the testbed, built (announced on stderr) when missing."""
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="DIR", help="target checkpoint (default: testbed)")
    models.add_argument("--draft", metavar="DIR", help="EAGLE-3 draft checkpoint")
    models.add_argument("--small", action="store_true", help="use the small testbed")
    models.add_argument("--device", default="cpu")
    models.add_argument("--dtype", choices=DTYPES, default="float32")
    models.add_argument(
        "--reproducible",
        action="store_true",
        help="pin the CPU float numerics (AVX2 kernels, 2 threads): bit-identical results on "
        "any x86-64 machine with AVX2, a little slower (the main job and docs/RESULTS.md)",
    )


def add_output_arguments(parser, *, default_plot: str, plot_help: str):
    """The "output" group with --json and --plot (``default_plot`` without a file name);
    returns the group."""
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the report as JSON")
    out.add_argument("--plot", nargs="?", const=default_plot, metavar="FILE", help=plot_help)
    return out


def add_check_lossless_argument(group) -> None:
    """--check-lossless: exit 1 at the first output unlike the target's greedy one."""
    group.add_argument(
        "--check-lossless",
        action="store_true",
        help="fail (exit 1) on the first output that differs from the target's greedy one",
    )
