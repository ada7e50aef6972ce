"""Saved predictor files: their format tags and the checks that name what does not fit."""

import os

import torch

ONLINE_FORMAT = "sgl_ecospec.OnlineExpertPredictor"
HEAD_FORMAT = "sgl_ecospec.LowRankExpertHead"
CONTEXT_FORMAT = "sgl_ecospec.ContextExpertPredictor"
ADJACENT_FORMAT = "sgl_ecospec.AdjacentExpertPredictor"
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
            f"(OnlineExpertPredictor.save, ContextExpertPredictor.save, "
            f"AdjacentExpertPredictor.save, LowRankExpertHead.save, or the CLI's "
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


class SavedTables:
    """``save`` / ``load`` of an online predictor whose ``state_dict`` holds its ``config``
    and the format tag :attr:`STATE_FORMAT` (the count-table predictors share them)."""

    STATE_FORMAT: str

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` with ``torch.save``."""
        torch.save(self.state_dict(), path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        num_layers: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
    ):
        """Builds a predictor from a file written by :meth:`save` (warm start).

        Args:
            path: the file.
            device: where the tables go.
            num_layers, num_experts, top_k: the target model being served; when given,
                they must match the file's config, so a table learnt on another model is
                never used silently.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a predictor state or does not fit the model.
        """
        shape = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
        return cls._from_state(torch_load(path), state_source(path), device=device, **shape)

    @classmethod
    def _from_state(cls, state, source: str, *, device, **expected):
        check_state(state, source, cls.STATE_FORMAT, expected)
        predictor = cls(**state["config"], device=device)
        predictor.load_state_dict(state, source=source)
        return predictor
