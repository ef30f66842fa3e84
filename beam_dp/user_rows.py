"""What the cap on rows per user costs, released privately, and ``--max-rows-per-user auto``
(user-level privacy, issue 34). The pass that counts the users (``user_level.
DistinctUsersStage``) also sums, exactly and for the driver only, each user's rows before the
cap r (a histogram on ``user_level.ROWS_GRID``'s cells: 1, 2, 3-4, 5-8, ... rows) and, for a cap
K, the users above it, the rows kept, min(r, K), and the rows dropped, max(r - K, 0) counted up
to K. The noise is added here, on the driver; all that follows it is post-processing.

* **The cap's cost** (every user-level run): (users above K, kept / K, dropped / K) with
  Laplace noise of scale 3 / epsilon on each. One user moves the vector by at most 3 in L1
  (at most 1 in each entry), so this is epsilon-DP, accounted as a count's LaplaceDpEvent
  (the vector's worst pair is the scalar's, scaled). Rows dropped are counted up to K per user,
  so their share is a lower bound: a user with 10 K rows shows as dropping K. Row totals carry
  K / epsilon rows of noise per user of sensitivity: at a large K on few users they are vague,
  which the report's noise scale shows; the users above the cap are a plain count.
* **auto**: the cap is the AUTO_QUANTILE quantile of the users' rows, chosen among the powers
  of two up to AUTO_MAX_ROWS by the exponential mechanism over the histogram (each user in one
  cell: sensitivity 1; ``stats.primitives.exponential_mechanism_quantile``). The cap changes no
  noise (each user's summed gradient is clipped to C whatever K): it bounds a step's work per
  user and how many of a heavy user's rows make up their clipped sum, so keeping most users'
  rows whole costs time, not privacy. Where the quantile's 95% rank error (from the released
  number of users and its epsilon: public) is above AUTO_RANK_ERROR of the users, nothing is
  spent and the default cap is kept, said in the report: at 671 users and epsilon 0.05 the
  error is about a third of the users, and auto chose 256, 512 and 4096 on three seeds
  (``pipelines/bench_movielens.py``).

Each release has its share of --epsilon (CAP_SHARE, AUTO_SHARE; with a noise multiplier and no
epsilon, 0.01 each), recorded in the ledger before it is made.
"""
from __future__ import annotations

import numpy as np

from beam_dp import accounting, mechanisms, user_level
from beam_dp.dataset_size import release_dataset_size
from beam_dp.stats.primitives import exponential_mechanism_quantile, quantile_rank_error_bound
from beam_dp.user_level import ROWS_GRID

CAP_SHARE = 0.05           # of --epsilon: the cap's cost
AUTO_SHARE = 0.05          # of --epsilon: auto's quantile
AUTO_QUANTILE = 0.9        # auto: about 90% of the users keep every row
AUTO_MAX_ROWS = 4096       # auto: at most this many rows per user (a step's work per user)
AUTO_CAPS = tuple(int(c) for c in ROWS_GRID[ROWS_GRID <= AUTO_MAX_ROWS])
AUTO_RANK_ERROR = 0.1      # auto: its quantile must be within 10% of the users (95%)
_COST_STREAM, _AUTO_STREAM = 1, 2   # substreams of the count's (mechanisms.STREAM_COUNT)


def share(epsilon: float | None, fraction: float) -> float:
    return fraction * epsilon if epsilon else 0.01


def caps(bounding) -> tuple:
    """The caps whose cost the users' pass sums: auto's candidates, or the one given."""
    return AUTO_CAPS if bounding.auto else (int(bounding.max_rows),)


def rank_error(epsilon: float) -> float:
    """The auto quantile's 95% rank error, in users (public)."""
    return quantile_rank_error_bound(len(AUTO_CAPS), epsilon, 0.05)


def choose_cap(histogram: np.ndarray, epsilon: float, seed: int,
               ledger: accounting.Ledger) -> int:
    """auto's cap: the exponential mechanism's AUTO_QUANTILE quantile of the rows per user."""
    ledger.record("exponential_mechanism_rows_per_user_quantile", accounting.PureDpEvent(epsilon),
                  epsilon=epsilon, sensitivity=1, quantile=AUTO_QUANTILE,
                  candidates="powers of two from 1 to " + str(AUTO_MAX_ROWS))
    counts = np.asarray(histogram, np.float64)
    k = len(AUTO_CAPS)
    folded = np.r_[counts[:k], counts[k:].sum()]   # users above the largest candidate: one cell
    return int(exponential_mechanism_quantile(
        folded, np.asarray(AUTO_CAPS, np.float64), 0.0, epsilon,
        mechanisms.rng(seed, mechanisms.STREAM_COUNT, _AUTO_STREAM), quantile=AUTO_QUANTILE))


AUTO_CHOSEN = (f"auto: the {AUTO_QUANTILE:.0%} quantile of the rows per user (a power of two, "
               f"at most {AUTO_MAX_ROWS}), by the exponential mechanism")


def release_cost(exact: dict, cap: int, chosen: str, epsilon: float, seed: int,
                 ledger: accounting.Ledger) -> dict:
    """The cap's cost (module docstring) for the report: noisy, post-processed, never exact;
    ``chosen``: how the cap was chosen ("given", AUTO_CHOSEN, or auto's fallback)."""
    ledger.record("laplace_cap_cost", accounting.laplace_count_event(epsilon), epsilon=epsilon,
                  sensitivity="3 in L1 over (users above the cap, rows kept / cap, rows dropped "
                              "/ cap, each counted up to the cap)",
                  noise="float Laplace of scale 3 / epsilon on each")
    at = list(exact["caps"]).index(cap)
    values = np.array([exact["above"][at], exact["kept"][at] / cap, exact["dropped"][at] / cap])
    noisy = values + mechanisms.laplace_noise(
        mechanisms.rng(seed, mechanisms.STREAM_COUNT, _COST_STREAM), 3.0 / epsilon, 3)
    above, kept, lost = np.maximum(noisy, 0.0) * np.array([1.0, cap, cap])
    return {
        "max_rows_per_user": cap,
        "chosen": chosen,
        "users_above_cap": round(float(above), 1),
        "rows_kept": round(float(kept), 1),
        "rows_dropped_at_least": round(float(lost), 1),
        "rows_dropped_share_at_least": (round(float(lost / (kept + lost)), 3)
                                        if kept + lost > 0 else 0.0),
        "epsilon": epsilon,
        "note": (f"noisy estimates (Laplace: {3 / epsilon:.3g} users, {3 * cap / epsilon:.3g} "
                 "rows of scale), a DP release in the run's epsilon; a user's dropped rows are "
                 "counted up to the cap, so the share dropped is a lower bound"),
    }


def release_users(config, aggregator, bounding, seed: int,
                  ledger: accounting.Ledger) -> tuple[dict, dict]:
    """A user-level run's releases before its plan: n (the users: public, or a Laplace count,
    ``dataset_size.release_dataset_size``), the cap (given, or auto's, applied to the
    aggregator from here on) and its cost. One pass of the data (``DistinctUsersStage``) serves
    them all, its exact sums staying on the driver. Returns (dataset_size, the cap's entry)."""
    users: dict = {}

    def users_pass() -> dict:
        if not users:
            stage = user_level.DistinctUsersStage(caps(bounding))
            users.update(aggregator.run_stages([stage], None), caps=stage.caps)
        return users
    dataset_size = release_dataset_size(config, aggregator, seed, ledger,
                                        lambda: users_pass()["users"])
    dataset_size["unit"] = "users"
    cap, chosen = bounding.max_rows, "given"
    if bounding.auto:
        auto_epsilon = share(config.epsilon, AUTO_SHARE)
        error = rank_error(auto_epsilon)
        if error <= AUTO_RANK_ERROR * dataset_size["value"]:
            cap = choose_cap(users_pass()["rows_per_user"], auto_epsilon, seed, ledger)
            chosen = AUTO_CHOSEN
        else:   # decided from public values, before anything is spent
            cap = user_level.DEFAULT_MAX_ROWS_PER_USER
            chosen = (f"auto fell back to the default {cap}: too few users for a private "
                      f"quantile (its 95% rank error, {error:.0f} users, is above "
                      f"{AUTO_RANK_ERROR:.0%} of about {dataset_size['value']})")
        aggregator.cap_rows_per_user(cap)
    cost = release_cost(users_pass(), cap, chosen, share(config.epsilon, CAP_SHARE), seed, ledger)
    return dataset_size, cost


def line(entry: dict) -> str:
    """One sentence for stderr."""
    how = ("auto, which kept the default: too few users for its private quantile"
           if entry["chosen"].startswith("auto fell back") else entry["chosen"].split(":")[0])
    return (f"user-level: the cap of {entry['max_rows_per_user']} rows per user ({how}) cuts the "
            f"rows of about {entry['users_above_cap']:.0f} users, at least about "
            f"{entry['rows_dropped_share_at_least']:.0%} of all rows (noisy estimates, in the "
            "report with their noise; --max-rows-per-user sets the cap)")
