"""dpgd's default cap on the steps from the (released) n, and dpsgd's default step per model."""
from __future__ import annotations

import numpy as np
import pytest

import beam_dp
from beam_dp import accounting, losses
from beam_dp.algorithms import noisy_gd
from beam_dp.algorithms.noisy_gd import NoisyGDConfig
from beam_dp.block import Block
from beam_dp.local import LocalAggregator


def test_default_max_steps_is_300_on_small_tables_and_the_old_100_from_300000_rows():
    cap = noisy_gd.default_max_steps
    assert [cap(n) for n in (1, 404, 8000, 100_000, 150_000, 300_000, 10 ** 6, 10 ** 9)] == [
        300, 300, 300, 300, 200, 100, 100, 100]
    caps = [cap(n) for n in range(1, 400_000, 997)]
    assert all(a >= b for a, b in zip(caps, caps[1:]))   # never more steps for more rows
    for n in range(1, 2_000_000, 4999):
        # a default run reads at most 3e7 rows (plus one pass: the ceiling), or 100 passes
        assert cap(n) * n <= max(noisy_gd.DEFAULT_STEP_ROWS + n, 100 * n)


@pytest.mark.parametrize("n,expected", [(404, 300), (150_000, 200), (10 ** 6, 100)])
def test_dpgd_plan_caps_its_steps_by_the_rule_unless_max_steps_is_given(n, expected):
    # With only a noise multiplier the rank rule is skipped: the steps are the cap itself.
    ledger = accounting.Ledger()
    plan = noisy_gd._plan(NoisyGDConfig(algorithm="dpgd", noise_multiplier=1.0), {"value": n},
                          ledger, dim=5)
    assert plan["steps"] == expected
    given = NoisyGDConfig(algorithm="dpgd", noise_multiplier=1.0, max_steps=100)
    assert noisy_gd._plan(given, {"value": 404}, ledger, dim=5)["steps"] == 100
    # dpsgd is untouched: 5 epochs of its batches
    dpsgd = NoisyGDConfig(algorithm="dpsgd", noise_multiplier=1.0, batch_size=1000)
    assert noisy_gd._plan(dpsgd, {"value": 10_000}, ledger, dim=5)["steps"] == 50


def test_dpgd_default_cap_is_read_from_the_released_count_and_stays_within_epsilon(monkeypatch):
    # The cap is post-processing of the count: the rule sees the released value (never the
    # true n), the count is in the ledger before the steps, and the run meets its epsilon.
    seen = []
    rule = noisy_gd.default_max_steps
    monkeypatch.setattr(noisy_gd, "default_max_steps", lambda n: seen.append(n) or rule(n))
    n, d = 2000, 3
    g = np.random.default_rng(0)
    x = g.standard_normal((n, d))
    y = (g.random(n) < 0.5).astype(float)
    ledger = accounting.Ledger()
    config = NoisyGDConfig(algorithm="dpgd", epsilon=1.0, delta=1e-5, noise="float")
    result = noisy_gd.train(config, losses.LogisticLoss(), d, LocalAggregator([Block(x, y)]), 4,
                            ledger)
    released = result.dataset_size["value"]
    assert result.dataset_size["source"].startswith("private estimate")
    assert seen == [released]
    # (n eps)^2 / (2 rank ln(1/delta)) ~ 43,000 at n ~ 2000: the cap decides, 300
    assert result.steps == rule(released) == 300
    names = [r.name for r in ledger.releases]
    assert names[0] == "laplace_count"
    steps = [r for r in ledger.releases if r.name == "gaussian_clipped_gradient_sum"]
    assert sum(r.count for r in steps) == 300
    assert ledger.epsilon(1e-5) <= 1.0 + 1e-9


@pytest.mark.parametrize("model,expected", [("linear", 0.5), ("huber", 0.5), ("logistic", 2.0)])
def test_dpsgd_default_step_follows_the_model_curvature_like_dpgd(monkeypatch, model, expected):
    seen = []
    real = noisy_gd.train
    monkeypatch.setattr(noisy_gd, "train",
                        lambda config, *a, **k: seen.append(config.learning_rate) or
                        real(config, *a, **k))
    g = np.random.default_rng(1)
    x = g.standard_normal((400, 2))
    y = (x[:, 0] > 0).astype(float) if model == "logistic" else x[:, 0] + 0.1 * g.standard_normal(400)
    # (standard normal columns and label: used as given, which a 400-row regression asks for)
    beam_dp.train(x, y, model=model, algorithm="dpsgd", epsilon=1.0, seed=0, epochs=1,
                  batch_size=100, quality_check="off", num_examples=400, scale_features="none")
    beam_dp.train(x, y, model=model, algorithm="dpsgd", epsilon=1.0, seed=0, epochs=1,
                  batch_size=100, quality_check="off", num_examples=400,
                  learning_rate=1.5, scale_features="none")
    assert seen == [expected, 1.5]
    assert noisy_gd.default_learning_rate(model, "dpsgd") == expected
    # dpgd's defaults are unchanged: 1/4 and 1
    assert noisy_gd.default_learning_rate(model) == expected / 2.0
