"""A private vocabulary per user (``beam-dp vocabulary --privacy-unit-column``, issue 34): a
value is kept only if enough USERS hold it, each user counting for at most L values a column;
charged under the user-level relation."""
from __future__ import annotations

import json

import numpy as np

from beam_dp import data, vocabulary_release


def _table(tmp_path):
    """2,000 users holding 1-3 of 10 common values each; one user holding 1,000 rows of a value
    nobody else has."""
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 4, 2000)
    users = np.repeat([f"u{i}" for i in range(2000)], counts)
    values = np.array([f"common{v}" for v in rng.integers(0, 10, len(users))], dtype=object)
    users = np.r_[users, np.full(1000, "heavy")]
    values = np.r_[values, np.full(1000, "only-the-heavy-user")]
    path = str(tmp_path / "t.csv")
    data.write_table(path, {"item": values.astype(str), "user": users, "x0": np.zeros(len(users))})
    return path


def test_a_value_one_user_holds_is_kept_by_rows_never_by_users(tmp_path, cli):
    path = _table(tmp_path)
    common = ("vocabulary", "--input", path, "--categorical-columns", "item", "--epsilon", 1,
              "--seed", 0)
    r = cli(*common, "--output", tmp_path / "rows")
    assert r.code == 0, r.err
    rows = json.loads((tmp_path / "rows" / "vocabulary.json").read_text())["item"]
    assert "only-the-heavy-user" in rows   # 1,000 rows: far above the threshold
    r = cli(*common, "--output", tmp_path / "users", "--privacy-unit-column", "user")
    assert r.code == 0, r.err
    users = json.loads((tmp_path / "users" / "vocabulary.json").read_text())["item"]
    assert "only-the-heavy-user" not in users
    assert set(users) == {f"common{v}" for v in range(10)}   # ~400 users each
    report = json.loads((tmp_path / "users" / "privacy_report.json").read_text())
    assert report["neighbouring"] == "add/remove one user (all their rows)"
    (release,) = report["mechanisms"]
    assert release["max_partitions_contributed"] == vocabulary_release.DEFAULT_VALUES_PER_USER
    r = cli(*common, "--output", tmp_path / "bad", "--max-values-per-user", 2)
    assert r.code != 0 and "needs --privacy-unit-column" in r.err


def test_each_user_counts_once_for_at_most_l_values(tmp_path):
    path = str(tmp_path / "u.csv")
    # user a: 5 distinct values over 50 rows; user b: 1 value twice
    data.write_table(path, {"item": np.array([f"v{i % 5}" for i in range(50)] + ["v0", "v0"]),
                            "user": np.array(["a"] * 50 + ["b", "b"])})
    counts = vocabulary_release.user_value_counts([path], ["item"], data.open_input, 16, "user", 2)
    values, n = counts["item"]
    by_value = dict(zip(values.to_pylist(), n.tolist()))
    assert sum(by_value.values()) == 2 + 1            # a counts for 2 values, b for 1
    assert max(by_value.values()) <= 2                # users, not rows
    again = vocabulary_release.user_value_counts([path], ["item"], data.open_input, 7, "user", 2)
    assert dict(zip(again["item"][0].to_pylist(), again["item"][1].tolist())) == by_value


def test_a_per_user_vocabulary_is_charged_to_the_units_own_budget(tmp_path, cli):
    from beam_dp import accounting
    from beam_dp.ledger import core
    path = _table(tmp_path)
    ledger = str(tmp_path / "budget.db")
    assert cli("ledger", "budget", "--ledger", ledger, "--dataset-id", "d", "--privacy-unit",
               "user", "--epsilon", 2, "--delta", 1e-5).code == 0
    r = cli("vocabulary", "--input", path, "--categorical-columns", "item", "--epsilon", 1,
            "--output", tmp_path / "v", "--privacy-unit-column", "user", "--ledger", ledger,
            "--dataset-id", "d")
    assert r.code == 0, r.err
    with core.open_ledger(ledger) as opened:
        assert opened.charges("d") == []
        (charge,) = opened.charges("d@user")
        assert charge.status == "committed" and charge.neighbouring == accounting.USER_ADD_REMOVE
