"""EcoSpec settings of an ECOSPEC server, validated at startup.

SGLang's argument parser rejects flags it does not know, so EcoSpec's own settings come from
the environment of the server process:

- ``SGLANG_ECOSPEC_CONFIG=/path/settings.json``: a JSON object whose keys are field names of
  :class:`EcoSpecSettings` (unknown keys are an error);
- ``SGLANG_ECOSPEC_<FIELD>`` (upper case, e.g. ``SGLANG_ECOSPEC_EPS=0.2``): one field; these
  override the file. An ``SGLANG_ECOSPEC_*`` variable that names no field is an error, so a
  typo never passes silently.

The launcher validates them when it resolves ``--speculative-algorithm ECOSPEC`` (the
server does not start on a bad value) and every scheduler process reads them again (spawned
processes inherit the environment).
"""

import dataclasses
import json
import math
import os
import typing
from typing import Any

ENV_PREFIX = "SGLANG_ECOSPEC_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
POLICIES = ("ecospec", "confidence")
PREDICTORS = ("online",)


class EcoSpecSettingsError(ValueError):
    """An EcoSpec setting is missing, unknown or out of range (the message says which)."""


@dataclasses.dataclass(frozen=True)
class EcoSpecSettings:
    """What ECOSPEC does differently from EAGLE3 (docs/sglang.md, "Settings").

    Attributes:
        policy: "ecospec" (P / (DeltaCost + eps), the paper's rule) or "confidence" (top
            cumulative probability: SGLang's own selection, through our machinery; an A/B
            switch that keeps everything else equal).
        eps: > 0, added to DeltaCost (predicted new experts summed over MoE layers).
        share_buffer: one expert buffer for the whole batch, seeded with every request's
            bonus token (a batched verify pass loads the union); False: one per request.
        predictor: "online" (:class:`sgl_ecospec.predictor.OnlineExpertPredictor`).
        predictor_file: warm start: a file written by ``OnlineExpertPredictor.save`` for this
            model (its layer count, experts and top-k must match), or None.
        learn: update the predictor from the routing of every verify pass.
        num_buckets, prior_weight, halve_every: the online predictor's table size, prior
            pseudo-count and ageing period (see its docstring); ignored with predictor_file,
            which carries its own.
        log_interval: verify steps between two "EcoSpec:" log lines (unique experts per
            layer per verify step, predictor recall); 0 = never. Reading the statistics is
            the only host sync EcoSpec adds, once per interval.
    """

    policy: str = "ecospec"
    eps: float = 0.1
    share_buffer: bool = True
    predictor: str = "online"
    predictor_file: str | None = None
    learn: bool = True
    num_buckets: int = 4096
    prior_weight: float = 0.05
    halve_every: int = 0
    log_interval: int = 50

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise EcoSpecSettingsError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise EcoSpecSettingsError(f"eps must be a finite number > 0, got {self.eps}")
        if self.predictor not in PREDICTORS:
            raise EcoSpecSettingsError(
                f"predictor must be one of {PREDICTORS}, got {self.predictor!r}"
            )
        if self.predictor_file is not None and not os.path.isfile(self.predictor_file):
            raise EcoSpecSettingsError(
                f"predictor_file {self.predictor_file!r} does not exist; write one with "
                "OnlineExpertPredictor.save, or leave it unset to start from an empty table"
            )
        if not 1 <= self.num_buckets < 2**31:
            raise EcoSpecSettingsError(f"num_buckets must be in [1, 2**31), got {self.num_buckets}")
        if not (math.isfinite(self.prior_weight) and self.prior_weight >= 0):
            raise EcoSpecSettingsError(f"prior_weight must be >= 0, got {self.prior_weight}")
        for name in ("halve_every", "log_interval"):
            if getattr(self, name) < 0:
                raise EcoSpecSettingsError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "EcoSpecSettings":
        """Reads the settings file and the ``SGLANG_ECOSPEC_*`` variables (see module doc)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = environ.get(CONFIG_ENV)
        if path:
            values.update(_read_file(path))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in fields:
                raise EcoSpecSettingsError(
                    f"unknown EcoSpec setting {key}; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in fields)
                    + f", {CONFIG_ENV}"
                )
            values[name] = _parse(key, raw, fields[name].type)
        return cls._build(values, source=f"{path} and environment" if path else "environment")

    @classmethod
    def _build(cls, values: dict[str, Any], source: str) -> "EcoSpecSettings":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise EcoSpecSettingsError(
                f"unknown EcoSpec settings {unknown} in {source}; known: {sorted(fields)}"
            )
        for name, value in values.items():
            _check_type(name, value, fields[name].type, source)
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _read_file(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise EcoSpecSettingsError(f"{CONFIG_ENV}={path!r}: no such file") from None
    except json.JSONDecodeError as exc:
        raise EcoSpecSettingsError(f"{CONFIG_ENV}={path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise EcoSpecSettingsError(f"{CONFIG_ENV}={path!r} must hold a JSON object")
    return data


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _kind(type_: Any) -> tuple[type, bool]:
    """(base type, accepts None) of a field annotation: ``float`` or ``str | None``."""
    if isinstance(type_, type):
        return type_, False
    args = [a for a in typing.get_args(type_) if a is not type(None)]
    return args[0], True


def _parse(key: str, raw: str, type_: Any) -> Any:
    base, optional = _kind(type_)
    text = raw.strip()
    if optional and text.lower() in ("", "none"):
        return None
    try:
        if base is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        return base(text)
    except ValueError:
        raise EcoSpecSettingsError(f"{key}={raw!r} is not a valid {base.__name__}") from None


def _check_type(name: str, value: Any, type_: Any, source: str) -> None:
    base, optional = _kind(type_)
    if value is None and optional:
        return
    accepted = (int, float) if base is float else (base,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and base is not bool):
        raise EcoSpecSettingsError(
            f"EcoSpec setting {name!r} from {source} must be {base.__name__}, got {value!r}"
        )
