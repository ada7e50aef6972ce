"""What the ``sgl-ecospec`` command modules share: adding a subcommand, and parsing a flag's
comma-separated integers.

The command modules and the run configurations import this module and it imports none of
them, so that ``lab/cli.py`` can import every command module without a cycle.
"""


def add_command(subparsers, name: str, run, help: str, description: str):
    """Adds the subcommand ``name`` (``help`` in the list, ``description`` atop its --help)
    to ``subparsers`` (from ``ArgumentParser.add_subparsers``), run by ``run(args)``;
    returns its parser, for the module to add its arguments."""
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.set_defaults(run=run)
    return parser


def parse_positive_ints(text: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; ValueError naming ``flag`` on anything else."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be comma-separated positive ints, got {text!r}")
    return values
