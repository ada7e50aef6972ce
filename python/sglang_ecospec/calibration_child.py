"""The startup calibration's child process: ``python -m sglang_ecospec.calibration_child
--target DIR [--draft DIR|none] [the device, grid and --out flags of sgl-ecospec calibrate]``.

It runs the library's calibration (:mod:`sgl_ecospec.costmodel.calibration_run`, the one
``sgl-ecospec calibrate`` runs) on the served checkpoint, loaded with transformers (which
SGLang brings), and exits: :mod:`sglang_ecospec.startup_calibration` starts it in its own
process, so that the timed models leave the server's memory with it. The fit table goes to
stdout, progress to stderr; a bad flag or checkpoint exits with status 2 and the reason.
"""

import argparse
import sys

from transformers import AutoModelForCausalLM

from sgl_ecospec.costmodel import calibration_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ecospec.calibration_child",
        description="Times the served checkpoint on this device and fits the cost model.",
    )
    parser.add_argument("--target", required=True, metavar="DIR", help="the served checkpoint")
    parser.add_argument(
        "--draft", default="none", metavar="DIR", help="its EAGLE-3 draft (none: no draft)"
    )
    calibration_run.add_arguments(parser)
    args = parser.parse_args(argv)
    flags = sys.argv[1:] if argv is None else argv
    try:
        calibration = calibration_run.CalibrationRun.from_args(args)
        calibration_run.calibrate_checkpoint(
            calibration,
            args.target,
            None if args.draft == "none" else args.draft,
            calibration_run.checkpoint_name(args.target),
            AutoModelForCausalLM.from_pretrained,
            "sgl-ecospec calibrate " + " ".join(flags),
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"calibration_child: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
