"""Continuing from a released model (``beam_dp.train(warm_start=...)``, ``--warm-start``): its
coefficients, if it fits the run. Free: a post-processing of a release."""
from __future__ import annotations

import numpy as np

from beam_dp import features
from beam_dp.algorithms import registry
from beam_dp.categorical import Encoding
from beam_dp.model import Model


def warm_start_theta(warm_start, chosen, loss, feature_columns, label_column, fit_intercept,
                     algorithm_options, encoding: Encoding | None = None) -> np.ndarray:
    """The coefficients of a released model to start from, if it fits this run: the same
    model, features, label and intercept, and no feature transform on either side (a transform
    would put the coefficients in another space)."""
    if not chosen.warm_start:
        supported = ", ".join(a.name for a in registry.algorithms().values() if a.warm_start)
        raise ValueError(f"{chosen.name} does not start from a model (--warm-start works with "
                         f"{supported})")
    try:
        model = warm_start if isinstance(warm_start, Model) else Model.load(warm_start)
    except (OSError, ValueError) as e:
        raise ValueError(f"--warm-start {warm_start}: {' '.join(str(e).split())}") from None
    artifact = model.artifact
    mismatch = [what for what, same in (
        ("model", artifact["model"] == loss.name),
        ("feature columns", list(artifact["feature_columns"]) == feature_columns),
        ("categorical encoding", artifact.get("encoding") == (encoding.spec() if encoding else None)),
        ("label column", artifact["label_column"] == label_column),
        ("intercept", artifact["fit_intercept"] == fit_intercept),
        ("number of outputs", model.theta.shape[0] == loss.outputs())) if not same]
    if mismatch:
        detail = ""
        if "feature columns" in mismatch:
            theirs, ours = list(artifact["feature_columns"]), feature_columns
            detail = (f" (the model's {len(theirs)}, this run's {len(ours)}; only in the model: "
                      f"{sorted(set(theirs) - set(ours))[:5]}, only in this run: "
                      f"{sorted(set(ours) - set(theirs))[:5]})")
        raise ValueError(f"--warm-start: the model does not fit this run: its "
                         f"{', '.join(mismatch)} differ{detail}")
    # A model scaled by ranges (declared or released: public) is continued on the same ranges
    # (noisy_gd, with --scale-features auto or none); any other map would put the coefficients
    # in another space.
    transform = artifact.get("feature_transform") or {}
    scaled = set(transform) == {"scale_columns"} and hasattr(algorithm_options, "scale_features")
    if ((transform and not scaled) or getattr(algorithm_options, "feature_norm", None)
            or getattr(algorithm_options, "scale_features", "none") == "private"):
        raise ValueError("--warm-start needs models without a feature transform other than "
                         "column ranges (no --feature-norm, no --scale-features private) on "
                         "both sides")
    inherited = features.ranges_as_bounds(transform["scale_columns"]) if scaled else None
    return np.array(model.theta, dtype=np.float64), inherited
