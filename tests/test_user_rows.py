"""The cap on rows per user, released privately (``beam_dp.user_rows``, issue 34): the users'
pass sums exactly what the driver noises, one user moves the cap's cost by at most 3 in L1, the
noise has the law the ledger states, ``auto`` picks the users' 90% quantile, and a whole run
reports the cost on stderr and in its report, resumed without a second release."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from beam_dp import accounting, data, user_level, user_rows
from beam_dp.block import Block

HEAVY = "heavy-user-7"


def _users(counts) -> Block:
    """Blocks grouped by user: user i holds counts[i] rows."""
    ids = np.repeat(np.arange(len(counts)), counts)
    keys = user_level.user_keys(pa.array([f"u{i}" for i in ids]))
    rng = np.random.default_rng(len(ids))
    return Block(rng.normal(size=(len(ids), 2)), np.zeros(len(ids)), users=keys)


def test_the_users_pass_sums_each_users_rows_before_the_cap():
    counts = np.array([1, 2, 3, 4, 5, 8, 9, 64, 65, 300, 1000])
    K = 8
    grouped = user_level.group_by_user([_users(counts)], K, batch_rows=50)   # the cap applied
    assert sum(map(len, grouped)) == np.minimum(counts, K).sum()
    stage = user_level.DistinctUsersStage((4, K, 1024))
    total = sum(stage.partial_sum(b, None) for b in grouped)
    out = stage.apply(None, total)
    assert out["users"] == len(counts)
    cells = np.searchsorted(user_level.ROWS_GRID, counts, side="left")
    np.testing.assert_array_equal(out["rows_per_user"],
                                  np.bincount(cells, minlength=len(user_level.ROWS_GRID) + 1))
    for i, cap in enumerate(stage.caps):
        over = np.maximum(counts - cap, 0)
        assert out["above"][i] == (over > 0).sum()
        assert out["kept"][i] == np.minimum(counts, cap).sum()
        assert out["dropped"][i] == np.minimum(over, cap).sum()


def test_one_user_moves_the_caps_cost_by_at_most_3_in_l1():
    """(users above K, kept / K, dropped counted up to K / K): every number of rows, each cap."""
    for cap in (1, 7, 64):
        rows = np.arange(1, 5 * cap + 3)
        over = np.maximum(rows - cap, 0)
        l1 = (over > 0) + np.minimum(rows, cap) / cap + np.minimum(over, cap) / cap
        assert l1.max() <= 3.0 and l1.max() == 3.0   # reached: the bound is tight


def test_the_costs_noise_is_laplace_of_scale_3_over_epsilon():
    """Over 4,000 seeds, the noisy count of users above the cap minus the exact one: mean 0 and
    standard deviation sqrt(2) 3 / epsilon, within 4 standard errors (seeded)."""
    epsilon, exact = 0.5, {"caps": (8,), "above": [5000], "kept": [80000], "dropped": [20000]}
    draws = np.array([user_rows.release_cost(exact, 8, "given", epsilon, seed,
                                             accounting.Ledger())["users_above_cap"] - 5000
                      for seed in range(4000)])
    std = np.sqrt(2) * 3 / epsilon
    assert abs(draws.mean()) < 4 * std / np.sqrt(len(draws))
    assert abs(draws.std() / std - 1) < 4 * np.sqrt(0.25 / len(draws)) * 2.5   # (kurtosis 6)
    # Shares: post-processing of the noisy values, near the truth at this size.
    entry = user_rows.release_cost(exact, 8, "given", epsilon, 0, accounting.Ledger())
    assert entry["rows_dropped_share_at_least"] == pytest.approx(0.2, abs=0.01)


def test_auto_picks_the_users_90_percent_quantile_and_is_recorded():
    counts = np.zeros(len(user_level.ROWS_GRID) + 1)
    counts[:5] = [100, 100, 200, 300, 250]   # 950 of 1,000 users hold at most 16 rows, 700 8
    counts[10] = 50                          # and 50 about 1,000: the 900th user is in 9-16
    ledger = accounting.Ledger()
    chosen = [user_rows.choose_cap(counts, 2.0, seed, ledger) for seed in range(20)]
    assert set(chosen) == {16}   # 8 and 32 are 50 ranks off: exp(-50) at epsilon 2
    (release,) = {(r.name, r.event) for r in ledger.releases}
    assert release == ("exponential_mechanism_rows_per_user_quantile", accounting.PureDpEvent(2.0))
    assert user_rows.choose_cap(counts, 1e-6, 0, accounting.Ledger()) in user_rows.AUTO_CAPS


@pytest.fixture(scope="module")
def heavy_table(tmp_path_factory):
    """1,500 users with 1-4 rows and one with 1,000 rows, as a CSV."""
    directory = tmp_path_factory.mktemp("cap")
    rng = np.random.default_rng(3)
    ids = np.repeat(np.arange(1500), rng.integers(1, 5, 1500))
    users = np.r_[np.array([f"u{i}" for i in ids]), np.full(1000, HEAVY)]
    path = str(directory / "t.csv")
    data.write_table(path, {"x0": rng.normal(size=len(users)),
                            "label": (rng.random(len(users)) < 0.5).astype(float), "user": users})
    return path


def test_a_run_reports_its_caps_cost_and_auto_resumes_with_its_cap(heavy_table, tmp_path, cli,
                                                                   monkeypatch):
    common = ("train", "--input", heavy_table, "--privacy-unit-column", "user", "--epsilon", 4,
              "--runner", "local", "--seed", 1, "--steps", 3, "--noise", "float")
    r = cli(*common, "--output", tmp_path / "given", "--max-rows-per-user", 16)
    assert r.code == 0, r.err
    (line,) = [x for x in r.err.splitlines() if "cap of 16 rows per user (given)" in x]
    assert "users" in line and HEAVY not in r.err
    report = json.loads((tmp_path / "given" / "privacy_report.json").read_text())
    cost = report["privacy_unit"]["cap"]
    assert report["privacy_unit"]["max_rows_per_user"] == 16 and cost["chosen"] == "given"
    assert "laplace_cap_cost" in [m["name"] for m in report["mechanisms"]]
    assert "rows per user" in (tmp_path / "given" / "report.html").read_text()
    assert HEAVY not in json.dumps(report)

    auto = (*common, "--max-rows-per-user", "auto", "--checkpoint-dir", tmp_path / "ck")
    r = cli(*auto, "--output", tmp_path / "auto")
    assert r.code == 0, r.err
    first = json.loads((tmp_path / "auto" / "privacy_report.json").read_text())
    assert first["privacy_unit"]["cap"]["chosen"].startswith("auto")
    assert first["privacy_unit"]["max_rows_per_user"] in user_rows.AUTO_CAPS
    names = [m["name"] for m in first["mechanisms"]]
    assert "exponential_mechanism_rows_per_user_quantile" in names
    # The same command again resumes: the same cap (applied to the rows again, not chosen
    # again) and cost, nothing released twice.
    from beam_dp.local import LocalAggregator
    capped = []
    real = LocalAggregator.cap_rows_per_user
    monkeypatch.setattr(LocalAggregator, "cap_rows_per_user",
                        lambda self, k: (capped.append(k), real(self, k))[1])
    r = cli(*auto, "--output", tmp_path / "again")
    assert capped == [first["privacy_unit"]["max_rows_per_user"]]
    assert r.code == 0, r.err
    again = json.loads((tmp_path / "again" / "privacy_report.json").read_text())
    assert again["privacy_unit"] == first["privacy_unit"]
    assert again["mechanisms"] == first["mechanisms"]
    model = json.loads((tmp_path / "auto" / "model.json").read_text())
    assert json.loads((tmp_path / "again" / "model.json").read_text()) == model


def test_auto_keeps_the_default_cap_where_users_are_too_few_for_its_quantile(heavy_table,
                                                                            tmp_path, cli):
    """At epsilon 1 the quantile's 95% rank error (222 users) is above 10% of 1,501 users: the
    default cap, said in the report, and nothing spent on the quantile."""
    r = cli("train", "--input", heavy_table, "--privacy-unit-column", "user", "--epsilon", 1,
            "--runner", "local", "--seed", 1, "--steps", 3, "--noise", "float",
            "--max-rows-per-user", "auto", "--output", tmp_path / "out")
    assert r.code == 0, r.err
    report = json.loads((tmp_path / "out" / "privacy_report.json").read_text())
    cap = report["privacy_unit"]["cap"]
    assert cap["max_rows_per_user"] == 64 and cap["chosen"].startswith("auto fell back")
    assert "exponential_mechanism_rows_per_user_quantile" not in [m["name"] for m in
                                                                  report["mechanisms"]]
    assert "cap of 64 rows per user (auto, which kept the default" in r.err
