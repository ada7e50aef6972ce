"""Saved predictor files: their format tags and the checks that name what does not fit."""

import os

import torch

ONLINE_FORMAT = "sgl_ecospec.OnlineExpertPredictor"
HEAD_FORMAT = "sgl_ecospec.LowRankExpertHead"
CONTEXT_FORMAT = "sgl_ecospec.ContextExpertPredictor"
STATE_VERSION = 1


def check_state_header(state, source: str, fmt: str = ONLINE_FORMAT) -> None:
    kind = fmt.rsplit(".", 1)[-1]
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise ValueError(f"{source} is not a saved {kind} (write one with {kind}.save)")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"{source} has format version {state.get('version')}, this code reads version "
            f"{STATE_VERSION}: re-create it with this version of sgl_ecospec"
        )


def state_source(path: str | os.PathLike) -> str:
    return f"predictor file {os.fspath(path)!r}"


def check_state(state, source: str, fmt: str, expected: dict) -> None:
    """ValueError unless ``state`` is a saved predictor of format ``fmt`` whose config
    matches the non-None entries of ``expected``."""
    check_state_header(state, source, fmt)
    wanted = {key: value for key, value in expected.items() if value is not None}
    diffs = config_diffs(state["config"], wanted)
    if diffs:
        raise ValueError(
            f"{source} was learnt for a different model ({diffs}); delete it or point to "
            f"the file saved for this model, or start a fresh predictor"
        )


def torch_load(path: str | os.PathLike):
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no expert predictor file at {os.fspath(path)!r}: check the path, or write one "
            f"(OnlineExpertPredictor.save, ContextExpertPredictor.save, LowRankExpertHead.save, "
            f"or the CLI's "
            f"`sgl-ecospec bench --save-predictor` / `sgl-ecospec train-head`)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a foreign file
        raise ValueError(
            f"{os.fspath(path)!r} is not a predictor file torch can read: {error}"
        ) from None


def config_diffs(saved: dict, wanted: dict) -> str:
    return ", ".join(
        f"{key}: saved {saved.get(key)!r}, expected {value!r}"
        for key, value in wanted.items()
        if saved.get(key) != value
    )
