"""The ``sgl-ecospec`` command: one subcommand per tool, each registered by its module's
``add_parser`` (no command module imports this one)."""

import argparse
import sys

from sgl_ecospec.lab import calibrate, numerics
from sgl_ecospec.lab import costmodel_report as report
from sgl_ecospec.lab.bench import cli as bench_cli
from sgl_ecospec.lab.bench import predictor_replay, sweep, train_head
from sgl_ecospec.lab.testbed import command as testbed_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sgl-ecospec", description="Cost-aware speculative decoding for MoE models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report.add_parser(commands)
    bench_cli.add_parser(commands)
    sweep.add_parser(commands)
    train_head.add_parser(commands)
    predictor_replay.add_parser(commands)
    testbed_command.add_parser(commands)
    calibrate.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "reproducible", False):
            numerics.make_reproducible(sys.argv[1:] if argv is None else argv)
        return args.run(args) or 0
    except (ValueError, FileNotFoundError, numerics.PinningError) as exc:
        print(f"sgl-ecospec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
