"""The JSON profile a calibration run writes and `ProfileCostModel` reads.

    {"format": "rt-profile", "version": 2,   # 1: no step_time_stalls

     "device": "H200-SXM-141GB", "model": "Llama-3.1-8B", "dtype": "bfloat16",
     "versions": {"vllm": "...", "torch": "..."}, "date": "2026-05-01T12:00:00Z",
     "coefficients": {"constant_s": ..., "per_prefill_token_s": ..., "per_decode_token_s": ...,
                      "per_seq_s": ..., "per_prefill_attention_pair_s": ...,
                      "per_decode_kv_token_s": ...},
     "api_server": {"per_request_s": ..., "per_prompt_token_s": ...,
                    "per_output_token_s": ...},  # the last optional (0)
     "step_time_quantiles": [...],       # optional: measured/predicted step-time ratios
     "step_time_drift_quantiles": [...], # optional, with the next and step_time_quantiles:
     "step_time_drift_window_s": 0.25,   #   the slow factor of all steps in one window
     "step_time_stalls": {"probability": 0.04, "quantiles_s": [...]},  # optional (version 2,
                                         #   with step_time_quantiles): additive stalls
     "fit": {...}}                       # optional, free-form (residuals, sample counts)

Every coefficient is seconds per unit and must be a finite number >= 0. A bad file gives a
ValueError of one line naming the file, the field and the value. Version 1 files (written
before stalls existed) still load; a profile is written as version 2 only when it has stalls,
so one without them stays readable by older rt.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.step_noise import MIN_DRIFT_WINDOW_S, check_stalls

PROFILE_FORMAT = "rt-profile"
PROFILE_VERSION = 2  # the newest this rt reads and writes
PROFILE_VERSIONS = (1, 2)  # readable; 2 added step_time_stalls
# A cost coefficient at most (seconds per step, request, token or token pair): a minute is
# no device's; 1e308 s ran the simulation, then failed in its metrics (an int64 overflow).
MAX_COST_S = 60.0
_TOP_LEVEL = (
    "format",
    "version",
    "device",
    "model",
    "dtype",
    "versions",
    "date",
    "coefficients",
    "api_server",
    "step_time_quantiles",
    "step_time_drift_quantiles",
    "step_time_drift_window_s",
    "step_time_stalls",
    "fit",
)


@dataclass(frozen=True, slots=True)
class Profile:
    """A fitted profile: where it was measured and its coefficients.

    Attributes:
        device: the GPU it was measured on.
        model: the model it was measured with.
        dtype: weight and KV dtype, e.g. "bfloat16".
        versions: software versions (e.g. vllm, torch, rt), name -> version string.
        date: when it was fitted, ISO 8601.
        coefficients: the step-time coefficients, seconds per unit.
        api_server: the API-server cost, seconds.
        step_time_quantiles: optional quantile function (evenly spaced probabilities 0..1)
            of measured/predicted step times on the calibration steps, mean 1: what
            `sim.step_noise.StepNoise` draws from (`rt simulate --step-noise`); with drift,
            the fast (within-window) ratios' (`sim.step_noise.fit_step_noise`).
        step_time_drift_quantiles: optional quantile function (same form, mean 1) of the
            drift windows' speed factors: the slow factor shared by the steps of one window.
            Set together with `step_time_drift_window_s`, and only with
            `step_time_quantiles`.
        step_time_drift_window_s: the drift windows' length, seconds (> 0).
        step_time_stall_probability: the chance that a step stalls (an additive delay on top
            of the scatter, `sim.step_noise`), in [0, 1]; 0: no stalls.
        step_time_stall_quantiles_s: the stalls' quantile function (seconds, evenly spaced
            probabilities 0..1); set when the probability is > 0, only with
            `step_time_quantiles`.
        fit: optional free-form fit diagnostics (JSON-ready).
    """

    device: str
    model: str
    dtype: str
    versions: dict[str, str]
    date: str
    coefficients: ProfileCoefficients
    api_server: ApiServerCost = field(default_factory=ApiServerCost)
    step_time_quantiles: tuple[float, ...] | None = None
    step_time_drift_quantiles: tuple[float, ...] | None = None
    step_time_drift_window_s: float | None = None
    step_time_stall_probability: float = 0.0
    step_time_stall_quantiles_s: tuple[float, ...] | None = None
    fit: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.step_time_drift_quantiles is None) != (self.step_time_drift_window_s is None):
            raise ValueError("Profile.step_time_drift_quantiles and "
                             "step_time_drift_window_s must be set together (both or neither)")
        if self.step_time_drift_quantiles is not None and self.step_time_quantiles is None:
            raise ValueError("Profile.step_time_drift_quantiles needs step_time_quantiles")
        if self.step_time_stall_quantiles_s is not None and self.step_time_quantiles is None:
            raise ValueError("Profile.step_time_stall_quantiles_s needs step_time_quantiles")
        check_stalls(self.step_time_stall_probability, self.step_time_stall_quantiles_s,
                      "Profile")

    def has_stalls(self) -> bool:
        """Whether the profile carries a stall table (then it is written as version 2)."""
        return self.step_time_stall_quantiles_s is not None

    def to_json_dict(self) -> dict[str, Any]:
        """The profile as the JSON object `write_profile` writes."""
        data: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION if self.has_stalls() else 1,
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "versions": dict(self.versions),
            "date": self.date,
            "coefficients": asdict(self.coefficients),
            "api_server": asdict(self.api_server),
        }
        if self.step_time_quantiles is not None:
            data["step_time_quantiles"] = list(self.step_time_quantiles)
        if self.step_time_drift_quantiles is not None:
            data["step_time_drift_quantiles"] = list(self.step_time_drift_quantiles)
        if self.step_time_drift_window_s is not None:
            data["step_time_drift_window_s"] = self.step_time_drift_window_s
        if self.step_time_stall_quantiles_s is not None:
            data["step_time_stalls"] = {"probability": self.step_time_stall_probability,
                                        "quantiles_s": list(self.step_time_stall_quantiles_s)}
        if self.fit is not None:
            data["fit"] = self.fit
        return data

    def cost_model(self) -> ProfileCostModel:
        """A `ProfileCostModel` over these coefficients, carrying the profile's metadata."""
        metadata = {
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "versions": dict(self.versions),
            "date": self.date,
        }
        return ProfileCostModel(self.coefficients, metadata)


class _Reader:
    """Validates one decoded profile, naming `source` and the field in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def as_object(self, value: object, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"field {name!r} must be a JSON object, got {value!r}")
        return value

    def get(self, data: dict[str, Any], key: str, prefix: str = "") -> object:
        if key not in data:
            raise self.fail(f"missing field {prefix + key!r}")
        return data[key]

    def string(self, data: dict[str, Any], key: str, prefix: str = "") -> str:
        value = self.get(data, key, prefix)
        if not isinstance(value, str) or not value:
            raise self.fail(f"field {prefix + key!r} must be a non-empty string, got {value!r}")
        return value

    def seconds(self, data: dict[str, Any], key: str, prefix: str) -> float:
        value = self.get(data, key, prefix)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"field {prefix + key!r} must be a number, got {value!r}")
        if _finite(value) is None or value < 0:
            raise self.fail(f"field {prefix + key!r} must be a finite number >= 0, got {value!r}")
        if value > MAX_COST_S:
            raise self.fail(f"field {prefix + key!r} must be <= {MAX_COST_S:g} s, got {value!r}")
        return float(value)

    def no_unknown(self, data: dict[str, Any], known: tuple[str, ...], prefix: str = "") -> None:
        for key in data:
            if key not in known:
                raise self.fail(f"unknown field {prefix + key!r}")

    def section(self, data: dict[str, Any], name: str, known: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> dict[str, float]:
        """The numbers of section `name`: every `known` key, those in `optional` only when
        present (their defaults otherwise)."""
        section = self.as_object(self.get(data, name), name)
        self.no_unknown(section, known, f"{name}.")
        return {key: self.seconds(section, key, f"{name}.") for key in known
                if key in section or key not in optional}

    def profile(self, data: object) -> Profile:
        top = self.as_object(data, "(top level)")
        self.no_unknown(top, _TOP_LEVEL)
        if (fmt := self.get(top, "format")) != PROFILE_FORMAT:
            raise self.fail(f"field 'format' must be {PROFILE_FORMAT!r}, got {fmt!r}")
        version = self.get(top, "version")
        if isinstance(version, bool) or version not in PROFILE_VERSIONS:
            raise self.fail(f"field 'version' must be one of {list(PROFILE_VERSIONS)}, got "
                            f"{version!r}")
        versions = self.as_object(self.get(top, "versions"), "versions")
        for name, value in versions.items():
            if not isinstance(value, str):
                raise self.fail(f"field 'versions.{name}' must be a string, got {value!r}")
        fit = top.get("fit")
        if fit is not None:
            fit = self.as_object(fit, "fit")
        quantiles = top.get("step_time_quantiles")
        if quantiles is not None:
            quantiles = self.quantiles(quantiles, "step_time_quantiles")
        drift, window = self.drift(top, quantiles is not None)
        stall_p, stalls = self.stalls(top, version, quantiles is not None)
        coefficient_names = tuple(f.name for f in fields(ProfileCoefficients))
        api_names = tuple(f.name for f in fields(ApiServerCost))
        return Profile(
            device=self.string(top, "device"),
            model=self.string(top, "model"),
            dtype=self.string(top, "dtype"),
            versions=dict(versions),
            date=self.string(top, "date"),
            coefficients=ProfileCoefficients(
                **self.section(top, "coefficients", coefficient_names)
            ),
            api_server=ApiServerCost(**self.section(top, "api_server", api_names,
                                                    optional=("per_output_token_s",))),
            step_time_quantiles=quantiles,
            step_time_drift_quantiles=drift,
            step_time_drift_window_s=window,
            step_time_stall_probability=stall_p,
            step_time_stall_quantiles_s=stalls,
            fit=fit,
        )

    def drift(self, top: dict[str, Any], has_quantiles: bool
              ) -> tuple[tuple[float, ...] | None, float | None]:
        """step_time_drift_quantiles and step_time_drift_window_s: both or neither, only with
        step_time_quantiles; the table as `quantiles`, the window a finite number > 0."""
        drift = top.get("step_time_drift_quantiles")
        window = top.get("step_time_drift_window_s")
        if drift is None and window is None:
            return None, None
        if drift is None or window is None:
            given, missing = "step_time_drift_quantiles", "step_time_drift_window_s"
            if drift is None:
                given, missing = missing, given
            raise self.fail(f"field {given!r} needs field {missing!r} (both or neither)")
        if not has_quantiles:
            raise self.fail("field 'step_time_drift_quantiles' needs field "
                            "'step_time_quantiles'")
        table = self.quantiles(drift, "step_time_drift_quantiles")
        seconds = _finite(window)
        if seconds is None or seconds < MIN_DRIFT_WINDOW_S:
            raise self.fail("field 'step_time_drift_window_s' must be a finite number >= "
                            f"{MIN_DRIFT_WINDOW_S:g} (seconds), got {window!r}")
        return table, seconds

    def stalls(self, top: dict[str, Any], version: object, has_quantiles: bool
               ) -> tuple[float, tuple[float, ...] | None]:
        """step_time_stalls: {"probability": p in [0, 1], "quantiles_s": a table of >= 2
        numbers >= 0, non-decreasing}; only in version 2, only with step_time_quantiles."""
        section = top.get("step_time_stalls")
        if section is None:
            return 0.0, None
        if version == 1:
            raise self.fail("field 'step_time_stalls' needs 'version' 2 (got 1)")
        if not has_quantiles:
            raise self.fail("field 'step_time_stalls' needs field 'step_time_quantiles'")
        section = self.as_object(section, "step_time_stalls")
        self.no_unknown(section, ("probability", "quantiles_s"), "step_time_stalls.")
        p = _finite(self.get(section, "probability", "step_time_stalls."))
        if p is None or not 0.0 <= p <= 1.0:
            raise self.fail("field 'step_time_stalls.probability' must be a number in [0, 1], "
                            f"got {section['probability']!r}")
        table = self.get(section, "quantiles_s", "step_time_stalls.")
        if not (isinstance(table, list) and len(table) >= 2
                and all((f := _finite(v)) is not None and f >= 0 for v in table)
                and all(b >= a for a, b in zip(table, table[1:], strict=False))):
            raise self.fail("field 'step_time_stalls.quantiles_s' must be a list of 2 or more "
                            f"numbers >= 0 in non-decreasing order, got {table!r}")
        return p, tuple(float(v) for v in table)

    def quantiles(self, value: object, name: str) -> tuple[float, ...]:
        """A quantile table (field `name`): >= 2 positive finite numbers, non-decreasing."""
        if not (isinstance(value, list) and len(value) >= 2
                and all((f := _finite(v)) is not None and f > 0 for v in value)
                and all(b >= a for a, b in zip(value, value[1:], strict=False))):
            raise self.fail(f"field {name!r} must be a list of 2 or more "
                            f"positive numbers in non-decreasing order, got {value!r}")
        return tuple(float(v) for v in value)


def _finite(value: object) -> float | None:
    """`value` as a float when it is a JSON number (not a bool) with a finite float value,
    else None (an integer too large for a float is None, not an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def profile_from_json_dict(data: object, source: str = "<profile>") -> Profile:
    """A `Profile` from a decoded JSON object; ValueError naming `source` and the field."""
    return _Reader(source).profile(data)


SHIPPED_PROFILES = Path(__file__).with_name("profiles")  # <gpu>--<model>.json


def shipped_profile(gpu: str, model: str) -> Path:
    """`--profile calibrated`: the profile rt ships for this `--gpu` and `--model` preset;
    ValueError naming the pair and what is shipped when there is none."""
    path = SHIPPED_PROFILES / f"{gpu.lower()}--{model.lower()}.json"
    if not path.is_file():
        have = sorted(p.stem.replace("--", " + ") for p in SHIPPED_PROFILES.glob("*.json"))
        raise ValueError(f"--profile calibrated: rt ships no profile for --gpu {gpu} --model "
                         f"{model} (shipped: {', '.join(have) or 'none yet'}); fit one with "
                         "`rt fidelity --device cuda` or `rt calibrate` and pass its path")
    return path


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; ValueError (one line: file, field, value)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such profile file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # the decoder's own limit: ~1,000 nested arrays or objects
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    return profile_from_json_dict(data, str(path))


def write_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` as indented JSON with a trailing newline."""
    text = json.dumps(profile.to_json_dict(), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")
