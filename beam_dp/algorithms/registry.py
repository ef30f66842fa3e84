"""The algorithm registry: every optimizer module is listed here, once, and nothing else.

Each entry is an ``Algorithm`` (``spec``: what an algorithm declares) built by its own module;
the ``beam_dp.cli`` package, ``api.py`` and the estimators loop over ``algorithms()``. No
algorithm imports this module: the dependency goes one way, registry -> algorithm modules ->
``spec``.
"""
from __future__ import annotations

from beam_dp import accounting
from beam_dp.algorithms import (bias_reduced_sgd, dp_ambssgd, dpsgd_f, heavy_tailed_md,
                                mirror_descent, noisy_gd, objective_perturbation,
                                output_perturbation, ssp)
from beam_dp.algorithms.spec import Algorithm, Problem


def algorithms() -> dict[str, Algorithm]:
    """Every registered algorithm by name, in the order `beam-dp algorithms` lists them (read
    from the modules at each call, so a test may replace one entry)."""
    registered = (
        noisy_gd.DPGD,
        noisy_gd.DPSGD,
        ssp.SSP,
        dp_ambssgd.DP_AMBSSGD,
        dpsgd_f.DPSGD_F,
        mirror_descent.MIRROR_DESCENT,
        heavy_tailed_md.HEAVY_TAILED_MD,
        objective_perturbation.OBJECTIVE_PERTURBATION,
        bias_reduced_sgd.BIAS_REDUCED_SGD,
        output_perturbation.OUTPUT_PERTURBATION,
    )
    return {a.name: a for a in registered}


def get(name: str) -> Algorithm:
    registered = algorithms()
    if name not in registered:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(registered)}")
    return registered[name]


# The refusals that name the registered algorithms able to serve the request (so they live here,
# not on ``Algorithm``).


def check(algorithm: Algorithm, problem: Problem) -> None:
    """Refuses a problem ``algorithm`` cannot solve, with a message naming the choice (and
    the registered algorithms that can)."""
    if problem.loss.name not in algorithm.models:
        raise ValueError(f"{algorithm.name} does not fit --model {problem.loss.name}; "
                         f"it supports: {', '.join(algorithm.models)}")
    if problem.checkpoint_dir and not algorithm.checkpoints:
        raise ValueError(f"{algorithm.name} does not support --checkpoint-dir "
                         f"({algorithm.why_no_checkpoints})")
    if not problem.fit_intercept and not algorithm.no_intercept:
        raise ValueError(f"{algorithm.name} always fits an intercept; drop --no-intercept")
    if problem.sparse and not algorithm.sparse_input and not (
            algorithm.sparse_user_level and problem.privacy_unit is not None):
        takers = ", ".join(a.name for a in algorithms().values() if a.sparse_input)
        also = [a.name for a in algorithms().values() if a.sparse_user_level]
        raise ValueError(f"{algorithm.name} needs dense features; with --categorical-columns use "
                         f"one of: {takers}" + (f" ({', '.join(also)} with "
                                                "--privacy-unit-column too)" if also else ""))
    if problem.sparse and problem.privacy.noise == "secure":
        raise ValueError("secure noise needs dense features (its exact sums quantize dense "
                         "rows); with --categorical-columns use --noise float (the default "
                         "then)")
    if problem.privacy_unit is not None:
        check_user_level(algorithm)
        if algorithm.relation != accounting.ADD_REMOVE:
            raise ValueError("--privacy-unit-column is an add/remove relation (one user)")
    if problem.privacy.noise == "secure" and not algorithm.secure_noise:
        raise ValueError(f"{algorithm.name} has no secure noise yet (its releases add numpy's float "
                         "noise); use --noise float")


def check_user_level(algorithm: Algorithm) -> None:
    """Refuses --privacy-unit-column where ``algorithm`` has no user-level bounding."""
    if not algorithm.user_level:
        takers = ", ".join(a.name for a in algorithms().values() if a.user_level)
        raise ValueError(f"{algorithm.name} has no user-level privacy yet; with "
                         f"--privacy-unit-column use: {takers}")
