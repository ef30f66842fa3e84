"""User-level privacy (``--privacy-unit-column``): the numpy core, shared by the in-process and
the Beam paths (no Beam import).

The neighbouring relation is "add or remove one user with all their rows"
(``accounting.USER_ADD_REMOVE``). Each user's influence on every release is bounded in two steps,
as PipelineDP bounds contributions per privacy unit:

1. **Rows per user** (``bound_rows``): a user keeps at most K rows (``--max-rows-per-user``):
   the K of smallest priority, a keyed hash of the user's key and the row's own content
   (``row_priorities``). So which rows a user keeps is a function of that user's rows only:
   adding or removing another user, or reordering the input, never changes it (a rule by row
   position would: positions shift when another user's rows are removed).
2. **Gradient per user** (``user_clipped_gradient_sum``): each step sums a user's per-row-clipped
   gradients over the kept rows, then clips that sum to C in l2. One user then adds at most C
   to a step's sum, whatever their number of rows, so the Gaussian noise calibrated to
   sensitivity C (``noisy_gd``) holds for the user-level relation with the same DpEvents.

K does not enter the sensitivity (the user's sum is clipped to C either way); it bounds the
work per user and how far a heavy user's gradient can be dominated by their own many rows.

Users are grouped so that no user's rows are split over two blocks (``group_by_user``): a
block's per-user sums are then the users' whole sums, and the blocks' clipped sums add up.
In-process the grouping is one sort; on Beam a GroupByKey on a hash bucket of the user key
(``beam_dp.beam.aggregator``), once per job.

**Sampling users** (dpsgd, ``in_step_batch``): step t's batch is a Poisson sample of USERS at
rate q: a user is in it iff a keyed hash of (user key, t) is below q, under keys drawn for step t
from the run's sampling seed. The rule reads the user's key only, so all of a user's (bounded)
rows are in or out together, each user independently of every other user and of the data: the
PoissonSampledDpEvent(q, Gaussian) of a row-level step, with a user as the unit.

User keys are 64-bit keyed hashes of the column's values as text (``user_keys``), so that a
Parquet integer 7 and a CSV "7" are the same user. Two users whose keys collide are bounded
together (their joint sum clipped to C): for U users that happens with probability below
U^2 / 2^65 (1e-5 at 10^7 users), which the report states.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

from beam_dp import clipping
from beam_dp import losses as losses_mod
from beam_dp.block import Block

# --max-rows-per-user's default. K changes no noise (the user's sum is clipped to C whatever
# K), only the data kept: large enough that typical users keep everything (PipelineDP's
# examples cap contributions at a few to tens per unit), small enough that a user with
# millions of rows costs a step K rows of work, not millions.
DEFAULT_MAX_ROWS_PER_USER = 64
AUTO_FIRST_PASS = 1 << 62   # --max-rows-per-user auto's pass before the cap is chosen: no cap
# The public key of the kept-rows hash and of the user keys (the rule needs no secret: it
# depends on the user's own rows only). Fixed, so every runner and every run keeps the same rows.
_USER_HASH_KEY = "beam-dp-user-key"    # pandas' siphash key: 16 characters
_PRIORITY_KEY = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass(frozen=True)
class UserBounding:
    """The public contribution bounds of a user-level run (picklable: it travels to Beam)."""

    column: str                 # the privacy unit's column (its name only, never a value)
    max_rows: int = DEFAULT_MAX_ROWS_PER_USER
    # --max-rows-per-user auto: the first pass keeps every row (max_rows is AUTO_FIRST_PASS),
    # and the cap is then chosen from the private histogram of rows per user (beam_dp.user_rows)
    auto: bool = False

    def describe(self) -> dict:
        return {"column": self.column, "max_rows_per_user": self.max_rows,
                "rows_kept": "the max_rows_per_user rows of smallest keyed hash of (user, row "
                             "content): a function of the user's own rows only",
                "per_user_clipping": "each step's gradient summed over a user's kept rows "
                                     "(each row clipped to C), then clipped to C",
                "key_collisions": "users are keyed by a 64-bit hash: two users sharing a key "
                                  "(probability below users^2 / 2^65) are bounded together"}


def requested(column: str | None, max_rows) -> UserBounding | None:
    """The user-level bounds from ``train``'s keywords (None: row-level), checked."""
    if column is None:
        if max_rows is not None:
            raise ValueError("max_rows_per_user (--max-rows-per-user) bounds the rows of each "
                             "user: it needs privacy_unit_column (--privacy-unit-column)")
        return None
    if not isinstance(column, str) or not column:
        raise ValueError("privacy_unit_column must be a column name")
    if max_rows is None:
        max_rows = DEFAULT_MAX_ROWS_PER_USER
    if max_rows == "auto":
        return UserBounding(column, AUTO_FIRST_PASS, auto=True)
    if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
        raise ValueError("max_rows_per_user (--max-rows-per-user): a whole number >= 1, or auto")
    return UserBounding(column, int(max_rows))


# ------------------------------------------------------------------------------ keys


def first_missing_key(column: pa.Array) -> int | None:
    """The index of the first row without a user (null, or an empty CSV cell), else None."""
    absent = pc.is_null(column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # (Kleene: a null's length is null, and null or true is true; plain ``or`` gives null.)
        absent = pc.fill_null(pc.or_kleene(absent, pc.equal(pc.utf8_length(column), 0)), True)
    absent = np.asarray(absent.to_numpy(zero_copy_only=False), dtype=bool)
    found = np.flatnonzero(absent)
    return int(found[0]) if found.size else None


def user_keys(column: pa.Array) -> np.ndarray:
    """64-bit keys (uint64) of a column's values, as text: one vectorized hash, no row loop."""
    from pandas.util import hash_array   # (pandas: a dependency of apache-beam)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = pc.cast(column, pa.string())
    values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
    return hash_array(values, hash_key=_USER_HASH_KEY, categorize=True).astype(np.uint64)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (wrapping uint64 arithmetic), vectorized."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def row_priorities(block) -> np.ndarray:
    """A keyed hash of (user key, the row's features and label) per row: the kept-rows order.
    A loop over the columns, not the rows (over the nonzeros of categorical rows)."""
    with np.errstate(over="ignore"):
        h = _mix(np.asarray(block.users, np.uint64) ^ _PRIORITY_KEY)
        if block.sparse:
            h = _mix(h ^ _sparse_row_hashes(block.features))
        else:
            features = np.ascontiguousarray(block.features, dtype=np.float64)
            for j in range(features.shape[1]):
                h = _mix(h ^ features[:, j].view(np.uint64))
        labels = np.ascontiguousarray(block.labels, dtype=np.float64)
        return _mix(h ^ labels.view(np.uint64))


def _sparse_row_hashes(x) -> np.ndarray:
    """A hash per CSR row of its (column, value) pairs: the wrapping sum of each nonzero's mixed
    pair, so it depends on the row's content only (not on the order or on stored zeros)."""
    x = sp.csr_matrix(x)
    with np.errstate(over="ignore"):
        values = np.ascontiguousarray(x.data, dtype=np.float64)
        pairs = _mix(_mix(x.indices.astype(np.uint64) ^ _PRIORITY_KEY) ^ values.view(np.uint64))
        pairs[values == 0] = 0
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(pairs, dtype=np.uint64)])
        return sums[x.indptr[1:]] - sums[x.indptr[:-1]]


# ------------------------------------------------------------------------------ bounding and grouping


def _concat(blocks):
    blocks = [b for b in blocks if len(b)]
    if any(b.users is None for b in blocks):
        raise ValueError("user-level privacy needs every row's user (Block.users)")
    if not blocks:
        return None
    features = (sp.vstack([b.features for b in blocks], format="csr") if blocks[0].sparse
                else np.concatenate([b.features for b in blocks]))
    return Block(features, np.concatenate([b.labels for b in blocks]), blocks[0].source, 0,
                 np.concatenate([b.sq_norms for b in blocks]),
                 users=np.concatenate([b.users for b in blocks]))


def bound_rows(block, max_rows: int):
    """The block's rows with at most ``max_rows`` per user (the smallest ``row_priorities``),
    sorted by user key then priority."""
    priorities = row_priorities(block)
    order = np.lexsort((priorities, block.users))
    users = block.users[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    # The rank of each sorted row within its user: position minus its user's first position.
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    return block.take(order[rank < max_rows])


def group_by_user(blocks, max_rows: int, batch_rows: int, source: str = "users") -> list:
    """Every user's rows bounded (``bound_rows``) and gathered so that no user spans two blocks:
    blocks of about ``batch_rows`` rows cut at user boundaries, sorted by user key. Their
    ``source`` and ``row_start`` name them uniquely and reproducibly (Beam orders sums by them)."""
    whole = _concat(blocks)
    if whole is None:
        return []
    _, owner, counts = np.unique(whole.users, return_inverse=True, return_counts=True)
    whole.user_rows = counts[owner.ravel()]   # before the cap: its cost is released from these
    bounded = bound_rows(whole, max_rows)
    users = bounded.users
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    out, first = [], 0
    # Cuts at the first user start at or after each multiple of batch_rows.
    found = np.searchsorted(starts, np.arange(batch_rows, len(users), batch_rows))
    cuts = np.unique(starts[found[found < len(starts)]])
    for cut in [*cuts.tolist(), len(users)]:
        if cut > first:
            part = bounded.take(np.arange(first, cut))
            part.source, part.row_start = source, first
            out.append(part)
            first = cut
    return out


def user_starts(users: np.ndarray) -> np.ndarray:
    """Where each user's run of rows begins in rows sorted (grouped) by user."""
    if len(users) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, users[1:] != users[:-1]])


# ------------------------------------------------------------------------------ sampling users

# The last spawn-key element of the per-step user-sampling keys: 2^63, which no block key (a
# 63-bit ``Block.key``, the row-level sampler's) reaches, so the two samplers' streams differ.
_USER_SAMPLING_STREAM = 1 << 63


def in_step_batch(users: np.ndarray, step: int, sampling_seed: int, rate: float) -> np.ndarray:
    """Which rows are in step ``step``'s Poisson sample of users at ``rate`` (a bool per row):
    the user's uniform u = (a keyed hash of (user key, step)) / 2^64 is below ``rate``. The two
    64-bit keys of the step are drawn from (``sampling_seed``, step), so each step's sample is
    independent of the others' (up to the hash's statistical quality: that of the row-level
    sampler's PCG64, not a cryptographic PRF). A function of the user's key only: a user's rows
    are all in or all out, wherever they are. Vectorized over the rows, no loop."""
    users = np.asarray(users, dtype=np.uint64)
    if rate >= 1.0:
        return np.ones(len(users), dtype=bool)
    from beam_dp import mechanisms
    a, b = mechanisms.rng(sampling_seed, mechanisms.STREAM_SAMPLING, int(step),
                          _USER_SAMPLING_STREAM).integers(0, 1 << 64, size=2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(_mix(users ^ a) ^ b)
    # The top 53 bits as a double in [0, 1): exact, so P(u < q) is q to within 2^-53.
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 ** -53) < rate


# ------------------------------------------------------------------------------ the gradient


def per_row_weights(users: np.ndarray) -> np.ndarray:
    """1 / (the rows of each row's user) for rows grouped by user: a user's rows weigh 1 in all,
    so a statistic summing them moves by one row's bound when a user is added or removed."""
    starts = user_starts(users)
    counts = np.diff(np.r_[starts, len(users)])
    return np.repeat(1.0 / counts, counts) if len(starts) else np.zeros(0)


def per_user_sums(per_row: np.ndarray, users: np.ndarray) -> np.ndarray:
    """Row vectors (m, p) summed per user (rows grouped by user): (users, p)."""
    starts = user_starts(users)
    if starts.size == 0:
        return np.zeros((0, per_row.shape[1]))
    return np.add.reduceat(per_row, starts, axis=0)


def per_user_means(per_row: np.ndarray, users: np.ndarray) -> np.ndarray:
    """Row vectors (m, p) averaged per user (rows grouped by user): (users, p). A user's mean
    has at most the largest norm of their rows, whatever their number of rows."""
    starts = user_starts(users)
    if starts.size == 0:
        return np.zeros((0, per_row.shape[1]))
    counts = np.diff(np.r_[starts, len(users)])
    return np.add.reduceat(per_row, starts, axis=0) / counts[:, None]


def clip_rows(v: np.ndarray, clip_norm: float) -> np.ndarray:
    """Each row scaled to l2 norm at most ``clip_norm``; a row that is not finite counts zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.sqrt(np.einsum("ij,ij->i", v, v))
        factors = clipping.clip_factors(norms, clip_norm)
    factors[~np.isfinite(v).all(axis=1)] = 0.0
    return np.where(factors[:, None] > 0, v * factors[:, None], 0.0)


def per_row_clipped_gradients(theta: np.ndarray, features: np.ndarray, sq_norms: np.ndarray,
                              labels: np.ndarray, loss: losses_mod.GlmLoss, clip_norm: float,
                              fit_intercept: bool) -> np.ndarray:
    """(m, k (d + 1)): each row's gradient derivative (outer) (x, 1), clipped to ``clip_norm``
    (``clipping.clip_factors`` of ``clipping.gradient_norms``: a row whose norm is not finite
    counts zero)."""
    with np.errstate(all="ignore"):
        derivative = loss.derivative(losses_mod.scores(theta, features), labels)
        factors = clipping.clip_factors(
            clipping.gradient_norms(derivative, sq_norms, fit_intercept), clip_norm)
        weighted = np.where(factors[:, None] > 0, derivative * factors[:, None], 0.0)   # (m, k)
        m, d = features.shape
        augmented = np.empty((m, d + 1))
        augmented[:, :d] = features
        augmented[:, d] = float(fit_intercept)
        rows = (weighted[:, :, None] * augmented[:, None, :]).reshape(m, -1)
    rows[~np.isfinite(rows).all(axis=1)] = 0.0
    return rows


def user_clipped_gradient_sum(theta: np.ndarray, block, loss: losses_mod.GlmLoss,
                              clip_norm: float, fit_intercept: bool = True,
                              users: np.ndarray | None = None, count: bool = False):
    """The sum over the block's users of their summed per-row-clipped gradients, each user's
    sum clipped to ``clip_norm``: shaped like theta; one user adds at most ``clip_norm`` in
    norm. The block's rows must be grouped by user (``group_by_user``). ``count``: also the
    number of users whose sum was at most ``clip_norm`` before that clipping (adaptive
    clipping's count, sensitivity 1 per user): (sum, count)."""
    users = block.users if users is None else users
    if len(block) == 0:
        return (np.zeros_like(theta), 0) if count else np.zeros_like(theta)
    if block.sparse:
        total, norms = sparse_user_clipped_gradient_sum(
            theta, block.features, block.labels, users, loss, clip_norm, fit_intercept,
            norms=True)
    else:
        rows = per_row_clipped_gradients(theta, np.asarray(block.features, np.float64),
                                         block.sq_norms, block.labels, loss, clip_norm,
                                         fit_intercept)
        sums = per_user_sums(rows, users)
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(np.einsum("ij,ij->i", sums, sums))
        total = clip_rows(sums, clip_norm).sum(axis=0).reshape(theta.shape)
    if not count:
        return total
    return total, int(np.count_nonzero(norms <= clip_norm))


def sparse_user_clipped_gradient_sum(theta: np.ndarray, x, labels: np.ndarray,
                                     users: np.ndarray, loss: losses_mod.GlmLoss,
                                     clip_norm: float, fit_intercept: bool = True,
                                     norms: bool = False):
    """``user_clipped_gradient_sum`` of CSR rows (categorical and hashed columns), never
    densified: O(nnz k) a step. Row i's clipped gradient is w_i (outer) (u_i, extra_i)
    (``clipping.sparse_clipped_row_weights``); user j's sum S_j is then A (w (outer) u) with A
    the users' (users x rows) indicator, a sparse product; each user's factor
    g_j = min(1, C / ||S_j||) scales their rows' weights, and the total is u^T (g w), so each
    user adds g_j S_j, at most C in norm. The rows need not be grouped here (users are told
    apart by key), but a user must not span two blocks (``group_by_user``). ``norms``: also
    the users' sums' norms before their clipping: (sum, norms)."""
    k, d1 = theta.shape
    out = np.zeros((k, d1))
    m = x.shape[0]
    if m == 0:
        return (out, np.zeros(0)) if norms else out
    u, extra, weights = clipping.sparse_clipped_row_weights(theta, x, labels, loss, clip_norm,
                                                            fit_intercept)
    _, owner = np.unique(np.asarray(users, np.uint64), return_inverse=True)
    owner = owner.ravel()
    indicator = sp.csr_matrix((np.ones(m), (owner, np.arange(m))), shape=(owner.max() + 1, m))
    with np.errstate(all="ignore"):
        sq = np.zeros(indicator.shape[0])
        for c in range(k):   # k outputs: one for every loss but softmax
            sums = indicator @ sp.csr_matrix(u.multiply(weights[:, c:c + 1]))
            sq += np.asarray(sums.multiply(sums).sum(axis=1)).ravel()
            sq += (indicator @ (weights[:, c] * extra)) ** 2
        factors = clipping.clip_factors(np.sqrt(sq), clip_norm)
        scaled = weights * factors[owner][:, None]
    out[:, :-1] = np.asarray(u.T @ scaled).T
    if fit_intercept:
        out[:, -1] = scaled.T @ extra
    return (out, np.sqrt(sq)) if norms else out


# The public cells of the histogram of rows per user: cell 0 holds users with 1 row, cell j
# users with 2^(j-1) + 1 .. 2^j rows, the last cell users with more than 2^30.
ROWS_GRID = 2 ** np.arange(31, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class DistinctUsersStage:
    """A stage (``beam_dp.algorithms.base``) over blocks grouped by user whose sum is exact and
    goes to the driver, which adds the noise (``beam_dp.user_rows``): the number of users, the
    histogram of their rows before the cap (``ROWS_GRID``'s cells), and for each cap K in
    ``caps`` the users above it, their rows kept (min(r, K) each) and dropped (max(r - K, 0),
    counted up to K each)."""

    caps: tuple = ()

    @property
    def shape(self):
        return (1 + len(ROWS_GRID) + 1 + 3 * len(self.caps),)

    def partial_sum(self, block, state) -> np.ndarray:
        starts = user_starts(block.users)
        out = np.zeros(self.shape, dtype=np.int64)
        out[0] = len(starts)
        if not len(starts) or block.user_rows is None:
            return out
        rows = block.user_rows[starts].astype(np.int64)
        cells = len(ROWS_GRID) + 1
        out[1:1 + cells] = np.bincount(np.searchsorted(ROWS_GRID, rows, side="left"),
                                       minlength=cells)
        caps = np.asarray(self.caps, dtype=np.int64)[:, None]
        over = np.maximum(rows[None, :] - caps, 0)
        at = 1 + cells
        out[at:at + len(caps)] = (over > 0).sum(axis=1)
        out[at + len(caps):at + 2 * len(caps)] = np.minimum(rows[None, :], caps).sum(axis=1)
        out[at + 2 * len(caps):] = np.minimum(over, caps).sum(axis=1)
        return out

    def apply(self, state, total) -> dict:
        total = np.asarray(total, dtype=np.int64)
        cells, k = len(ROWS_GRID) + 1, len(self.caps)
        at = 1 + cells
        return {"users": int(total[0]), "rows_per_user": total[1:at],
                "above": total[at:at + k], "kept": total[at + k:at + 2 * k],
                "dropped": total[at + 2 * k:]}
