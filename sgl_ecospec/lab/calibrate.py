"""The ``sgl-ecospec calibrate`` command: the target's forward timed on this device under
controlled routing, the MoESD model fitted to the times, the profile file written.

Each grid point is one target forward of B requests x gamma new tokens over a prefilled
context of ``--context`` tokens per request, with every MoE layer's routing forced so that the
forward touches exactly U distinct experts per layer; the draft's step and the greedy accept
step are timed per batch size, so that all ten parameters are fitted. The timing, the fit
and the file are the library's (:mod:`sgl_ecospec.costmodel.calibration_run`, which the
plugin's startup calibration runs too); this command adds the testbed as the default models.
docs/costmodel.md, "Calibration".
"""

import argparse
import sys
from pathlib import Path

from sgl_ecospec.costmodel import calibration_run
from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.config import testbed_models

HELP = "time the target on this device and fit the cost model (a calibration profile)"
DESCRIPTION = (
    "Times the target's forward (the testbed by default) on the device it runs on over a grid "
    "of batch sizes, tokens per request and unique experts per layer (routing forced), plus "
    "the draft and accept steps, fits the ten-parameter MoESD model (least squares, relative "
    "residuals) and writes the profile file the server reads (SGLANG_ECOSPEC_PROFILE=FILE)."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``calibrate`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_command(subparsers, "calibrate", run, HELP, DESCRIPTION)
    models = parser.add_argument_group("model")
    models.add_argument(
        "--small", action="store_true", help="time the small testbed (default: the full one)"
    )
    models.add_argument("--target", metavar="DIR", help="a target checkpoint instead")
    models.add_argument(
        "--draft", metavar="DIR", help="its EAGLE-3 draft (default: the testbed's; none: no draft)"
    )
    calibration_run.add_arguments(parser)
    return parser


def _models(args) -> tuple[str, str | None, str]:
    """(target dir, draft dir or None, model name) from the flags; the testbed is built
    first when missing (announced, as ``bench`` does)."""
    if args.target is not None:
        if not Path(args.target).is_dir():
            raise FileNotFoundError(f"--target {args.target!r} is not a directory")
        draft = None if args.draft in (None, "none") else args.draft
        return args.target, draft, calibration_run.checkpoint_name(args.target)
    target, draft = testbed_models(args.small)
    if args.draft is not None:
        draft = None if args.draft == "none" else args.draft
    return target, draft, f"testbed-{'small' if args.small else 'full'}"


def run(args: argparse.Namespace) -> int:
    """Times, fits, prints the fit table and writes the profile file. Returns 0."""
    from transformers import AutoModelForCausalLM

    calibration = calibration_run.CalibrationRun.from_args(args)
    target_dir, draft_dir, name = _models(args)
    command = "sgl-ecospec " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    calibration_run.calibrate_checkpoint(
        calibration, target_dir, draft_dir, name, AutoModelForCausalLM.from_pretrained, command
    )
    return 0
