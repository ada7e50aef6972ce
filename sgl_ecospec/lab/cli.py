"""The ``sgl-ecospec`` command: one subcommand per tool, each registered by its module."""

import argparse
import sys


def add_command(subparsers, name: str, run, help: str, description: str):
    """Adds the subcommand ``name`` (``help`` in the list, ``description`` atop its --help)
    to ``subparsers`` (from ``ArgumentParser.add_subparsers``), run by ``run(args)``;
    returns its parser, for the module to add its arguments."""
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.set_defaults(run=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    # Imported here: the command modules import add_command from this one.
    from sgl_ecospec.lab import calibrate
    from sgl_ecospec.lab import costmodel_report as report
    from sgl_ecospec.lab.bench import cli as bench_cli
    from sgl_ecospec.lab.bench import predictor_replay, sweep, train_head
    from sgl_ecospec.lab.testbed import build as testbed_build

    parser = argparse.ArgumentParser(
        prog="sgl-ecospec", description="Cost-aware speculative decoding for MoE models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report.add_parser(commands)
    bench_cli.add_parser(commands)
    sweep.add_parser(commands)
    train_head.add_parser(commands)
    predictor_replay.add_parser(commands)
    testbed_build.add_parser(commands)
    calibrate.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sgl_ecospec.lab import numerics

    try:
        if getattr(args, "reproducible", False):
            numerics.make_reproducible(sys.argv[1:] if argv is None else argv)
        return args.run(args) or 0
    except (ValueError, FileNotFoundError, numerics.PinningError) as exc:
        print(f"sgl-ecospec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
