"""The engine's calibrated acceptance (``sgl_ecospec.acceptance``): the calibrator a run
learns with, and each step's predicted accepted tokens, raw and calibrated.

Every speculative run learns a calibrator from its verify results, whether or not its
selection reads the calibrated probabilities (``SpecConfig.calibrated_acceptance``), so that
every step records what the draft promised and what the calibration predicted, both before
the step's own result was learnt: the predicted acceptance length on tokens the calibrator
has not yet seen.

Shape legend: B = requests, N = candidates, S = selected candidates.
"""

import torch

from sgl_ecospec.acceptance import AcceptanceCalibrator, expected_accepted


def resolve_calibrator(
    calibrator: AcceptanceCalibrator | None, num_steps: int, device: torch.device
) -> AcceptanceCalibrator:
    """``calibrator`` checked against the tree depth, or a fresh (cold) one on ``device``."""
    if calibrator is None:
        return AcceptanceCalibrator(num_steps, device=device)
    if not isinstance(calibrator, AcceptanceCalibrator):
        raise TypeError(
            f"calibrator must be an AcceptanceCalibrator, got {type(calibrator).__name__}"
        )
    if calibrator.max_depth < num_steps:
        raise ValueError(
            f"the calibrator covers depths below {calibrator.max_depth}, the tree has "
            f"num_steps={num_steps}: build it with AcceptanceCalibrator({num_steps})"
        )
    return calibrator


def predicted_acceptance(
    raw: torch.Tensor, calibrated: torch.Tensor, selected: torch.Tensor
) -> dict[str, list[float]]:
    """The ``StepStats`` fields of a step's prediction: per request, the expected accepted
    draft tokens of its verify set under the calibrated and under the raw probabilities.

    Args:
        raw: float ``[B, N]``: cumulative draft probabilities.
        calibrated: float ``[B, N]``: calibrated acceptance probabilities.
        selected: int64 ``[B, S]``: the verified candidates, -1 padding.
    """
    return {
        "predicted_accepted": expected_accepted(calibrated, selected).tolist(),
        "predicted_accepted_raw": expected_accepted(raw, selected).tolist(),
    }
