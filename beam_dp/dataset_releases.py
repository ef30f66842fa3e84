"""Releases about a dataset rather than a model, each calibrated and accounted, then written
with its privacy report: ``beam-dp stats``'s numeric summary (counts, means, quantiles;
``stats.dataset_summary_stages``) or categorical frequencies (the projection mechanism;
``stats.categorical_frequency_stages``), and ``beam-dp vocabulary``'s categorical values
(``vocabulary_release``: pipeline-dp's partition selection)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

from beam_dp import (accounting, data, losses, mechanisms, report, secure_noise, stats,
                     vocabulary_release)

LOCAL = "local"


def _files(patterns: Sequence[str]) -> list[str]:
    return sorted({f for pattern in patterns for f in data.list_files(pattern)})


def _seed(seed: int | None) -> int:
    # The stages go into the Beam job: they hold a key derived from the root seed, not the seed.
    return stats.stages_seed(seed if seed is not None else mechanisms.secure_seed())


def release_summary(input: Sequence[str], output: str, *, epsilon: float, delta: float,
                    quantiles: Sequence[float], value_bound: float, runner: str,
                    pipeline_args: list[str] = (), overwrite: bool = False,
                    label_column: str = "label", feature_columns=None, batch_rows: int = 65536,
                    accountant: str = "pld", num_examples: int | None = None,
                    noise: str | None = None, seed: int | None = None,
                    gate: Callable | None = None, bounds: dict | None = None,
                    before_write: Callable[[dict], None] = lambda files: None) -> tuple[dict, int]:
    """Writes OUTPUT/stats_report.json, the private summary of the numeric feature columns;
    returns (the summary, the number of columns). ``bounds`` (column -> (low, high), a schema's
    declared ranges): each is checked against the column's released quantiles
    (``stats.check_declared_ranges``; post-processing, nothing more is spent). Secure noise unless ``noise="float"``; where its
    samplers' slack would pass 1e-3 delta, refused with ``noise="secure"``, float noise (said in
    the report) by default. ``gate``: the budget across runs (``accounting.Ledger``'s), which
    admits the whole release before any data is read. ``before_write(files)`` (file name ->
    text) may raise to abandon the output (an interrupt), or commit it (the budget ledger)."""
    if not quantiles or not all(0.0 <= q <= 1.0 for q in quantiles):
        raise ValueError("--quantiles must be fractions in [0, 1]")
    if not (epsilon > 0 and 0 < delta < 1 and 0 < value_bound <= 1e150):
        # (The grids span value_bound * sqrt(d): a bound near the float range would overflow.)
        raise ValueError("--epsilon must be positive, --delta in (0, 1) and --value-bound in "
                         "(0, 1e150]")
    from beam_dp.api import file_input

    report.check_output_directory(output, overwrite)
    files = _files(input)
    report.check_not_inside(output, files)
    _, features, aggregator, _ = file_input(files, runner, list(pipeline_args),
                                            losses.SquaredLoss(), label_column, feature_columns,
                                            batch_rows, read_label=False)
    seed_fixed, seed = seed is not None, _seed(seed)

    def make_stages(kind: str) -> list:
        return stats.dataset_summary_stages(len(features), tuple(quantiles), epsilon, delta, seed,
                                            value_bound, count=num_examples is None,
                                            accountant=accountant, noise=kind)

    # Closed however the run ends: a calibration that raises must not leave a Beam run's work
    # directory and shard cache behind.
    with contextlib.closing(aggregator), report.atomic_directory(output, overwrite) as out:
        ledger = accounting.Ledger(accountant, accounting.ADD_REMOVE)
        secure, sampler_delta = noise != "float", None
        if secure:
            stages = make_stages("secure")
            planned = accounting.Ledger(accountant, accounting.ADD_REMOVE)
            stats.record_releases(stages, planned)
            # The samplers' total variation over every release, at the run's (target) epsilon.
            sampler_delta = secure_noise.secure_delta_bound(
                secure_noise.prior_total_variation(planned), epsilon)
            if sampler_delta > 1e-3 * delta:
                why = secure_noise.SecureNoiseUnavailable(
                    f"secure noise's samplers could add {sampler_delta:.2g} to delta")
                secure = secure_noise.float_instead(noise, why, ledger) == "secure"
                sampler_delta = None
        if not secure:
            stages = make_stages("float")
        _admit_whole_release(ledger, gate, lambda into: stats.record_releases(stages, into))
        if secure:
            ledger.notes.append(secure_noise.secure_release_note())
        state = aggregator.run_stages(stages, {"n": num_examples} if num_examples else {})
        summary = stats.summary(state, stages, features,
                                "public (--num-examples)" if num_examples
                                else "private estimate: discrete Laplace count" if secure
                                else "private estimate: Laplace count")
        if bounds:
            stats.check_declared_ranges(summary, stages, bounds)
        summary["privacy"] = report.release_report(
            ledger, delta, seed_fixed, requested_epsilon=epsilon, value_bound=value_bound,
            **({"sampler_delta_bound": sampler_delta} if secure else {}))
        _write(out, {"stats_report.json": summary}, before_write)
    return summary, len(features)


def release_frequencies(input: Sequence[str], output: str, *, categorical_columns: Sequence[str],
                        epsilon: float, delta: float, runner: str,
                        pipeline_args: list[str] = (), overwrite: bool = False,
                        hash_buckets: int | None = None, hash_seed: int = 0,
                        vocabulary: str | None = None, mechanism: str = "gaussian",
                        batch_rows: int = 65536, accountant: str = "pld",
                        num_examples: int | None = None, noise: str | None = None,
                        seed: int | None = None, gate: Callable | None = None,
                        before_write: Callable[[dict], None] = lambda files: None
                        ) -> tuple[dict, object]:
    """Writes OUTPUT/stats_report.json, each categorical value's (or hash bucket's) private
    frequency by the projection mechanism (``mechanism``: gaussian or laplace), under
    replace-one; returns (the summary, the encoding). ``gate``, ``before_write``: as
    ``release_summary``'s."""
    if noise == "secure":
        raise ValueError("--noise secure: the categorical frequencies (the projection mechanism) "
                         "have float noise only; use --noise float or leave --noise out")
    # The encoding and the stages (the noise calibrated) before the data is read: a bad request
    # fails at once.
    seed_fixed, seed = seed is not None, _seed(seed)
    encoding = stats.frequency_encoding(list(categorical_columns), hash_buckets, hash_seed,
                                        vocabulary)
    stages = stats.categorical_frequency_stages(encoding, mechanism, epsilon, delta, seed,
                                                count=num_examples is None,
                                                accountant=accountant)
    aggregator = _categorical_aggregator(input, output, overwrite, encoding, runner,
                                         list(pipeline_args), batch_rows)
    try:
        with report.atomic_directory(output, overwrite) as out:
            ledger = accounting.Ledger(accountant, accounting.REPLACE_ONE)
            _admit_whole_release(ledger, gate, lambda into: stats.record_releases(stages, into))
            state = aggregator.run_stages(stages, {"n": num_examples} if num_examples else {})
            summary = stats.categorical_summary(
                state, stages, encoding, "public (--num-examples)" if num_examples
                else "private estimate: Laplace count")
            fields = {"requested_epsilon": epsilon, "noise": "float (numpy)",
                      "sparse_mechanism": mechanism,
                      "privacy_and_sparsity": stats.SPARSE_PRIVACY[mechanism]}
            if mechanism == "laplace":
                fields["delta_note"] = "the Laplace variant is pure epsilon-DP: --delta is not spent"
            summary["privacy"] = report.release_report(ledger, delta, seed_fixed, **fields)
            _write(out, {"stats_report.json": summary}, before_write)
    finally:
        aggregator.close()
    return summary, encoding


def _categorical_aggregator(input, output: str, overwrite: bool, encoding, runner: str,
                            pipeline_args: list[str], batch_rows: int):
    """The aggregator over ``encoding``'s blocks (the categorical columns only); the output is
    checked before anything is read."""
    report.check_output_directory(output, overwrite)
    files = _files(input)
    if not files:
        raise data.DataError("no input files given")
    report.check_not_inside(output, files)
    if runner == LOCAL:
        open_file = data.open_input
    else:
        from beam_dp.beam.transforms import open_file   # (Beam's file systems: gs://, s3://)
    data.check_categorical(files[0], data.read_schema(files[0], open_file),
                           list(encoding.categorical))
    loss = losses.SquaredLoss()   # (no label is read: the loss only types the blocks)
    if runner == LOCAL:
        from beam_dp.local import LocalAggregator
        return LocalAggregator(data.load_blocks(files, None, encoding.columns, loss, batch_rows,
                                                encoding))
    from beam_dp.beam.aggregator import BeamAggregator
    return BeamAggregator(files, None, encoding.columns, loss, batch_rows,
                          ["--runner", runner] + pipeline_args, encoding=encoding)


def release_vocabulary(input: Sequence[str], output: str, *, categorical_columns: Sequence[str],
                       epsilon: float, delta: float, batch_rows: int = 65536,
                       overwrite: bool = False, seed: int | None = None,
                       gate: Callable | None = None, release_id: str | None = None,
                       before_write: Callable[[dict], None] = lambda files: None,
                       privacy_unit_column: str | None = None,
                       max_values_per_user: int = vocabulary_release.DEFAULT_VALUES_PER_USER
                       ) -> tuple[list, dict]:
    """Writes OUTPUT/vocabulary.json (for train --vocabulary) and privacy_report.json: the
    values of each categorical column that partition selection keeps, (epsilon, delta)-DP under
    add/remove of one row, or of one user (``privacy_unit_column``: a value kept only if enough
    users hold it, each user counting for at most ``max_values_per_user`` values a column);
    returns (the vocabulary as (column, values) pairs, the privacy report). ``release_id`` (the
    CLI's): recorded in the report, for the runs that train on the vocabulary to name it.
    ``gate``, ``before_write``: as ``release_summary``'s."""
    if not (epsilon > 0 and math.isfinite(epsilon) and 0 < delta < 1):
        raise ValueError("--epsilon must be positive and --delta in (0, 1)")
    report.check_output_directory(output, overwrite)
    files = _files(input)
    report.check_not_inside(output, files)
    columns = list(categorical_columns)
    data.check_categorical(files[0], data.read_schema(files[0]), columns)
    per_unit = 1
    if privacy_unit_column is not None:
        if privacy_unit_column in columns or privacy_unit_column not in data.read_schema(
                files[0]).names:
            raise ValueError(f"--privacy-unit-column '{privacy_unit_column}' must be a column of "
                             "the input other than the categorical columns")
        if isinstance(max_values_per_user, bool) or not (
                isinstance(max_values_per_user, int) and max_values_per_user >= 1):
            raise ValueError("--max-values-per-user must be a whole number, at least 1")
        per_unit = max_values_per_user
    ledger = accounting.Ledger("pld", accounting.ADD_REMOVE if privacy_unit_column is None
                               else accounting.USER_ADD_REMOVE)
    _admit_whole_release(ledger, gate, lambda into: into.record(
        vocabulary_release.VOCABULARY_RELEASE, vocabulary_release.vocabulary_event(epsilon, delta),
        1, mechanism="pipeline-dp partition selection (truncated geometric thresholding)",
        max_partitions_contributed=len(columns) * per_unit,
        **({"values_per_user": per_unit} if privacy_unit_column is not None else {})))
    if privacy_unit_column is None:
        counts = vocabulary_release.value_counts(files, columns, data.open_input, batch_rows)
    else:
        counts = vocabulary_release.user_value_counts(files, columns, data.open_input, batch_rows,
                                                      privacy_unit_column, per_unit)
    seed_fixed = seed is not None
    seed = seed if seed is not None else mechanisms.secure_seed()
    vocabulary = vocabulary_release.private_vocabulary(counts, epsilon, delta, seed, per_unit)
    privacy = report.release_report(ledger, delta, seed_fixed,
                                    columns={c: len(v) for c, v in vocabulary},
                                    **({"release_id": release_id} if release_id else {}))
    with report.atomic_directory(output, overwrite) as out:
        _write(out, {"vocabulary.json": {c: list(v) for c, v in vocabulary},
                     "privacy_report.json": privacy}, before_write)
    return vocabulary, privacy


def _admit_whole_release(ledger: accounting.Ledger, gate: Callable | None,
                         record: Callable[[accounting.Ledger], None]) -> None:
    """``record(ledger)``, then the whole of it admitted by ``gate`` (the budget across runs) as
    one reservation, before any data is read: everything these commands release is known by
    then, and recording releases nothing."""
    record(ledger)
    if gate is not None:
        ledger.gate = gate
        ledger.admit(ledger.event(), whole_run=True)


def _write(directory: str, contents: dict, before_write: Callable[[dict], None]) -> None:
    """Each JSON file's text, shown to ``before_write`` (which may commit it, or raise) and then
    written: a rerun of a committed release writes the same bytes."""
    files = {name: report.json_text(value) for name, value in contents.items()}
    before_write(files)
    report.write_texts(directory, files)
