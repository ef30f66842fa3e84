"""The ledger: budgets, charges, admission and idempotent runs, over a ``Store``.

Every admission, budget change, commit and void is one write transaction that no other write on
the same dataset overlaps (see ``store``), so concurrent processes cannot both spend the last of
a budget. The same release id never charges twice: a second ``reserve`` returns the charge
there is (``resume`` or ``committed``), and ``run`` adds a per-release lock held for the run's
lifetime, so two live processes cannot both train it.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import math
import os

import numpy as np
from dp_accounting import dp_event

from beam_dp import accounting
from beam_dp.ledger import events, filter as rdp_filter, store
from beam_dp.ledger.store import (LedgerError, LedgerUnavailable, ReleaseInProgress,  # noqa: F401
                                  SchemaTooNew)

RESERVED, COMMITTED, VOID = "reserved", "committed", "void"
# What ``reserve`` tells its caller.
NEW, RESUME = "new", "resume"
# Who voids a charge: the run itself (it failed before anyone could see a release), or an
# operator (``beam-dp ledger void``, once it has checked that the run released nothing).
VOIDED_BY = ("run", "operator")
# The detail of a history row read off a charge's timestamps: the charge predates the history
# table, so only what its timestamps say is known.
FROM_TIMESTAMPS = {"from": "charge timestamps"}


class BudgetExceeded(LedgerError):
    """The filter refused the run: it would exceed a partition's lifetime budget."""

    def __init__(self, message: str, dataset: str, partition: str | None, spent: float,
                 with_run: float, budget: "Budget"):
        super().__init__(message)
        self.dataset, self.partition, self.budget = dataset, partition, budget
        self.spent_epsilon, self.epsilon_with_run = spent, with_run


class NoBudget(LedgerError):
    """No budget is declared for the partition (nor a default for its dataset)."""


class ReleaseIdCollision(LedgerError):
    """One release id, two different runs: the caller's release id is wrong."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """A lifetime budget. ``partition`` None: the dataset's default (and the budget of an
    unpartitioned dataset)."""

    dataset: str
    partition: str | None
    epsilon: float
    delta: float


@dataclasses.dataclass(frozen=True)
class Charge:
    """One run, as stored. ``partitions`` None: the dataset is unpartitioned."""

    release_id: str
    dataset: str
    partitions: tuple | None
    event: dp_event.DpEvent
    neighbouring: str
    orders: tuple
    rdp: tuple
    status: str
    orchestrator: dict
    output: object
    reserved_at: str
    committed_at: str | None
    voided_at: str | None

    @property
    def keys(self) -> tuple:
        """The partitions it is charged to (None: the whole, unpartitioned dataset)."""
        return self.partitions if self.partitions is not None else (None,)

    def rdp_on(self, orders) -> np.ndarray:
        """Its curve on ``orders`` (``filter.rdp_curve``: RDP, then its (epsilon, delta) parts'
        delta): as stored, or recomputed from its event. A curve stored before that delta entry
        existed had no such parts (the filter refused them then): its delta is 0."""
        if tuple(self.orders) == tuple(orders):
            curve = np.array(self.rdp, dtype=float)
            return curve if len(curve) == len(orders) + 1 else np.append(curve, 0.0)
        return rdp_filter.rdp_curve(self.event, self.neighbouring, orders)


@dataclasses.dataclass(frozen=True)
class Reservation:
    """``reserve``'s answer. ``status``: NEW (admitted and charged now: train), RESUME (charged
    by an earlier attempt that did not finish: resume its checkpoint, do not charge again) or
    COMMITTED (released already: ``output`` is what was released; do not train)."""

    status: str
    charge: Charge

    @property
    def output(self):
        return self.charge.output


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The filter's view of one partition (``explain``). ``spent_*``: reserved and committed
    charges (what admission counts); ``committed_*``: committed ones only. Epsilons are the
    filter's reading (``filter.epsilon``) at the budget's delta. When runs are chosen after
    seeing earlier outputs, the DP guarantee of everything released on the partition is its
    lifetime budget; a running reading is what is used of it, not a guarantee by itself."""

    dataset: str
    partition: str | None
    budget: Budget | None
    neighbouring: str | None
    orders: tuple
    delta_per_order: float | None
    spent_rdp: tuple
    order_epsilons: tuple       # per order: the epsilon that order alone certifies for spent_rdp
    best_order: float | None
    spent_epsilon: float
    committed_epsilon: float
    committed: int
    reserved: int
    # The delta of the charges' (epsilon, delta)-DP parts (``filter.rdp_curve``), taken from the
    # budget's delta before the RDP sum is converted.
    approx_delta: float = 0.0

    @property
    def remaining_epsilon(self) -> float | None:
        """Lifetime epsilon minus the spent reading. A reading, not an amount: RDP does not
        add up in epsilon, so what fits next depends on the next run's curve."""
        return None if self.budget is None else self.budget.epsilon - self.spent_epsilon


class Run:
    """What ``Ledger.run`` yields: the reservation, and commit / void for this release."""

    def __init__(self, ledger: "Ledger", reservation: Reservation):
        self._ledger = ledger
        self.charge = reservation.charge
        self.status = reservation.status

    @property
    def release_id(self) -> str:
        return self.charge.release_id

    @property
    def output(self):
        return self.charge.output

    def commit(self, output) -> None:
        self.charge = self._ledger.commit(self.release_id, output)
        self.status = COMMITTED

    def void(self) -> None:
        """Only when the run read no data (the ledger takes the caller's word)."""
        self.charge = self._ledger.void(self.release_id)
        self.status = VOID


def open_ledger(url: str, create: bool = True) -> "Ledger":
    """A ledger on ``url``: a file path, ``sqlite:///relative/path`` or
    ``sqlite:////absolute/path`` (SQLite, as SQLAlchemy spells them), or ``postgresql://...`` /
    ``postgres://...`` (PostgreSQL; a password belongs in PGPASSWORD or ~/.pgpass). The schema
    is created on first open; without ``create`` (the CLI's train, show and explain) a SQLite
    file that does not exist yet is an error, so that a mistyped path is not a new empty
    ledger. Any failure to open it is a LedgerError naming the (password-free) URL."""
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise LedgerError("give the ledger as a file path, sqlite:///path or postgresql://...")
    url = os.fspath(url)
    shown = store.redact(url)
    try:
        if url.startswith(("postgresql://", "postgres://")):
            from beam_dp.ledger.postgres import PostgresStore
            return Ledger(PostgresStore(url), shown)
        from beam_dp.ledger.sqlite import SqliteStore
        if url.startswith("sqlite:///"):
            path = url[len("sqlite:///"):]
        elif "://" in url or url.startswith("sqlite:"):
            raise LedgerError(f"unsupported ledger URL {shown!r}: use a file path, "
                              f"sqlite:///path, or postgresql://...")
        else:
            path = url
        if not create and not os.path.exists(path):
            raise LedgerError(
                f"no ledger at {os.path.abspath(path)}: a ledger starts with a budget (beam-dp "
                f"ledger budget --ledger {url} --dataset-id D --epsilon E --delta D)")
        if os.path.isdir(path):
            raise LedgerError(f"the ledger {os.path.abspath(path)} is a directory, not a file")
        return Ledger(SqliteStore(path), url)
    except LedgerError:
        raise
    except Exception as error:   # the database's own error (unreachable, unreadable, ...)
        reason = " ".join(str(error).split()).replace(url, shown)
        raise LedgerError(f"cannot open the ledger {shown}: {reason}") from None


# How long a new run waits for the runs of its partitions being admitted before it (their
# pre-checks, counts and plans: seconds, or a Beam job's minutes).
ADMISSION_WAIT = 900.0


def budget_dataset(dataset: str, privacy_unit: str | None) -> str:
    """The ledger's dataset that the runs on ``dataset`` protecting ``privacy_unit`` (a user id
    column: user-level runs) are charged to: ``dataset`` itself for row-level runs, else
    ``dataset@column``, with a budget of its own. Row- and user-level guarantees protect
    different units and do not compose by one rule (a user-level run bounds each user's
    contribution, so one row can still move it by twice the clip norm; a row-level run bounds
    nothing per user), so each unit has its own budget; docs/guide/production.md says how to split
    a total between them."""
    return dataset if privacy_unit is None else f"{dataset}@{privacy_unit}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _check_budget(epsilon: float, delta: float) -> tuple[float, float]:
    epsilon, delta = float(epsilon), float(delta)
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise LedgerError(f"a budget's epsilon must be a positive number, got {epsilon}")
    if not 0 < delta < 1:
        raise LedgerError(f"a budget's delta must be in (0, 1), got {delta}")
    return epsilon, delta


def _check_name(what: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise LedgerError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _partition_keys(partitions) -> tuple | None:
    """None (unpartitioned) or the sorted partition names."""
    if partitions is None or (not isinstance(partitions, str) and len(partitions) == 0):
        return None
    if isinstance(partitions, str):
        raise LedgerError(f"partitions must be a list of names, got the string {partitions!r}")
    names = [_check_name("a partition", p) for p in partitions]
    if len(set(names)) != len(names):
        raise LedgerError(f"partitions listed twice in {names}")
    return tuple(sorted(names))


def _encode_output(output) -> str:
    # bytes (a model file) or anything JSON can write (a dict); tagged so it reads back as given.
    if isinstance(output, (bytes, bytearray)):
        return json.dumps({"base64": base64.b64encode(bytes(output)).decode("ascii")})
    try:
        return json.dumps({"json": output}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise LedgerError(f"a run's output must be bytes or plain JSON data: {error}") from None


def _decode_output(text: str | None):
    if text is None:
        return None
    value = json.loads(text)
    return base64.b64decode(value["base64"]) if "base64" in value else value["json"]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


_CHARGE_COLUMNS = ("release_id, dataset, partitions, event, neighbouring, orders, rdp, status, "
                   "orchestrator, output, reserved_at, committed_at, voided_at")


def _charge(row) -> Charge:
    (release_id, dataset, partitions, event, neighbouring, orders, rdp, status, orchestrator,
     output, reserved_at, committed_at, voided_at) = row
    partitions = json.loads(partitions)
    return Charge(release_id, dataset, None if partitions is None else tuple(partitions),
                  events.event_from_json(event), neighbouring, tuple(json.loads(orders)),
                  tuple(json.loads(rdp)), status, json.loads(orchestrator),
                  _decode_output(output), reserved_at, committed_at, voided_at)


def _record(tx, release_id: str, at: str, action: str, detail: dict) -> None:
    """One row of the charge's history, in the transaction of the change it records (so the
    history never shows a change that was rolled back, nor misses one that was made). ``at``:
    the timestamp the change wrote on the charge itself, so the two agree."""
    tx.execute("INSERT INTO charge_history (release_id, at, action, detail) VALUES (?, ?, ?, ?)",
               (release_id, at, action, json.dumps(detail, sort_keys=True)))


class Ledger:
    """The privacy budget of every dataset and partition, across runs. One object per thread
    (it holds a database connection); any number of processes may share the database."""

    def __init__(self, backend: store.Store, url: str):
        self._store = backend
        self.url = url    # without a password

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- budgets

    def set_budget(self, dataset: str, epsilon: float, delta: float, partition: str | None = None,
                   replace: bool = False) -> Budget:
        """Declares the lifetime budget of ``partition`` of ``dataset`` (None: the dataset's
        default, which every partition without a budget of its own has). Declaring the same
        budget again is a no-op; a different one is refused unless ``replace``; one that what is
        already spent would exceed is always refused."""
        _check_name("dataset id", dataset)
        if partition is not None:
            _check_name("partition", partition)
        epsilon, delta = _check_budget(epsilon, delta)
        now = _now()
        with self._store.transaction(dataset) as tx:
            tx.execute("INSERT INTO datasets (dataset, created_at, updated_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (dataset) DO NOTHING", (dataset, now, now))
            self._store.lock_dataset(tx, dataset)
            current = self._own_budget(tx, dataset, partition)
            if current is not None and (current.epsilon, current.delta) == (epsilon, delta):
                return current
            where = _where(dataset, partition)
            charges = self._live_charges(tx, dataset)
            if current is None and partition is not None and any(
                    partition in c.keys for c in charges):
                # Runs were admitted under the dataset's default: that is its budget so far.
                current = self._own_budget(tx, dataset, None)
            if current is not None and not replace:
                raise LedgerError(
                    f"{where} already has the budget epsilon={current.epsilon:g}, "
                    f"delta={current.delta:g}; changing a lifetime budget must be deliberate: "
                    f"beam-dp ledger budget --replace (replace=True in the API)")
            if partition is None:
                # The default covers the unpartitioned dataset and partitions without a budget.
                own = {row[0] for row in tx.execute(
                    "SELECT partition_id FROM budgets WHERE dataset = ?", (dataset,))}
                affected = {k for c in charges for k in c.keys if k not in own}
            else:
                affected = {partition}
            for key in sorted(affected, key=lambda k: (k is not None, k or "")):
                spent = self._spent(charges, key)
                value, _ = rdp_filter.epsilon(spent, delta)
                if value > epsilon:
                    raise LedgerError(
                        f"refused: {_where(dataset, key)} has already spent epsilon={_fmt(value)} "
                        f"at delta={delta:g}; a lifetime budget of epsilon={epsilon:g} would be "
                        f"below what is spent")
            if partition is None:
                tx.execute("UPDATE datasets SET epsilon = ?, delta = ?, updated_at = ? "
                           "WHERE dataset = ?", (epsilon, delta, now, dataset))
            elif current is None:
                tx.execute("INSERT INTO budgets (dataset, partition_id, epsilon, delta, "
                           "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                           (dataset, partition, epsilon, delta, now, now))
            else:
                tx.execute("UPDATE budgets SET epsilon = ?, delta = ?, updated_at = ? "
                           "WHERE dataset = ? AND partition_id = ?",
                           (epsilon, delta, now, dataset, partition))
            return Budget(dataset, partition, epsilon, delta)

    def budget(self, dataset: str, partition: str | None = None) -> Budget | None:
        """The budget that applies to ``partition``: its own, else the dataset's default."""
        with self._store.transaction() as tx:
            return self._budget(tx, dataset, partition)

    def budgets(self, dataset: str | None = None) -> list[Budget]:
        """Every declared budget (dataset defaults have partition None)."""
        with self._store.transaction() as tx:
            where, params = ("WHERE dataset = ?", (dataset,)) if dataset is not None else ("", ())
            defaults = tx.execute(f"SELECT dataset, epsilon, delta FROM datasets {where} "
                                  f"ORDER BY dataset", params)
            own = tx.execute(f"SELECT dataset, partition_id, epsilon, delta FROM budgets {where} "
                             f"ORDER BY dataset, partition_id", params)
        result = [Budget(d, None, e, dl) for d, e, dl in defaults if e is not None]
        return result + [Budget(d, p, e, dl) for d, p, e, dl in own]

    # ------------------------------------------------------------------------------ charges

    def reserve(self, release_id: str, dataset: str, partitions, event: dp_event.DpEvent,
                neighbouring: str = accounting.ADD_REMOVE,
                orchestrator: dict | None = None) -> Reservation:
        """Admits and charges a run, or tells the caller it was charged before (see
        ``Reservation``). ``partitions``: the partitions it reads (a list; None or [] for an
        unpartitioned dataset). ``event``: the run's whole composed DpEvent. ``orchestrator``:
        ids for people (a dict of strings: Airflow dag and run id, Kubernetes job, ...).
        BudgetExceeded if the filter refuses it; ReleaseIdCollision if ``release_id`` was
        charged for a different run. A voided release is admitted afresh (NEW)."""
        _check_name("release id", release_id)
        _check_name("dataset id", dataset)
        keys = _partition_keys(partitions)
        relation = rdp_filter.relation(neighbouring)
        orchestrator = dict(orchestrator or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in orchestrator.items()):
            raise LedgerError("orchestrator ids must be a dict of strings")
        event_json = events.event_to_json(event)
        try:
            rdp = rdp_filter.rdp_curve(event, relation)
        except ValueError as error:
            raise LedgerError(str(error)) from None
        for attempt in range(2):
            try:
                return self._reserve(release_id, dataset, keys, event, event_json, relation, rdp,
                                     orchestrator)
            except self._store.integrity_errors:
                # The same release id was inserted meanwhile (under another dataset's lock):
                # read again, and answer from what is there now.
                if attempt:
                    raise

    def _reserve(self, release_id, dataset, keys, event, event_json, relation, rdp,
                 orchestrator) -> Reservation:
        with self._store.transaction(dataset) as tx:
            existing = self._charge(tx, release_id)
            if existing is not None:
                self._check_same(existing, dataset, keys, event, relation)
                if existing.status == COMMITTED:
                    return Reservation(COMMITTED, existing)
                if existing.status == RESERVED:
                    return Reservation(RESUME, existing)
                # VOID: the earlier attempt read nothing; this one is admitted afresh below.
            charges = self._live_charges(tx, dataset)
            self._check_consistent(charges, dataset, keys, relation)
            self._admit(tx, release_id, dataset, keys, charges, rdp)
            now = _now()
            values = (dataset, json.dumps(None if keys is None else list(keys)), event_json,
                      relation, json.dumps(list(rdp_filter.ORDERS)), json.dumps(rdp.tolist()),
                      RESERVED, json.dumps(orchestrator, sort_keys=True), now)
            if existing is None:
                tx.execute("INSERT INTO charges (release_id, dataset, partitions, event, "
                           "neighbouring, orders, rdp, status, orchestrator, reserved_at) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (release_id,) + values)
            else:
                tx.execute("UPDATE charges SET dataset = ?, partitions = ?, event = ?, "
                           "neighbouring = ?, orders = ?, rdp = ?, status = ?, orchestrator = ?, "
                           "reserved_at = ?, voided_at = NULL WHERE release_id = ?",
                           values + (release_id,))
            _record(tx, release_id, now, "reserved" if existing is None else "re-reserved",
                    {"partitions": None if keys is None else list(keys),
                     "orchestrator": orchestrator})
            return Reservation(NEW, self._charge(tx, release_id))

    def _admit(self, tx, release_id, dataset, keys, charges, rdp) -> None:
        """BudgetExceeded (NoBudget) unless every partition read stays within its budget with
        ``rdp`` added to ``charges`` (the live charges, without this release's own)."""
        for key in (keys if keys is not None else (None,)):
            budget = self._budget(tx, dataset, key)
            if budget is None:
                raise NoBudget(
                    f"no budget is declared for {_where(dataset, key)}: declare one "
                    f"(beam-dp ledger budget --ledger {self.url} --dataset-id {dataset} "
                    f"--epsilon E --delta D) before running on it")
            spent = self._spent(charges, key)
            before, _ = rdp_filter.epsilon(spent, budget.delta)
            after, _ = rdp_filter.epsilon(spent + rdp, budget.delta)
            if after > budget.epsilon:
                raise BudgetExceeded(
                    f"refused: release {release_id!r} would exceed the lifetime budget of "
                    f"{_where(dataset, key)}: already spent epsilon={_fmt(before)} of "
                    f"{budget.epsilon:g} at delta={budget.delta:g} (reserved and committed "
                    f"runs), remaining {_fmt(max(0.0, budget.epsilon - before))}; with this "
                    f"run it would be epsilon={_fmt(after)} (Renyi filter, see beam-dp "
                    f"ledger explain)", dataset, key, before, after, budget)

    def extend(self, release_id: str, event: dp_event.DpEvent,
               base: dp_event.DpEvent | None = None) -> Charge:
        """Grows a reserved charge before the run makes more releases: a run reserves what it
        knows before it reads data (its dataset-size count) and extends the reservation once its
        plan is known (the noise calibrated to that count). ``event``: everything this attempt
        will have released (cumulative); ``base``: what earlier attempts of the release may have
        released (an attempt that starts over, without their checkpoint: its releases are new),
        charged on top. The charge becomes ``base`` + ``event`` wherever that is above it (its
        RDP curve never decreases), admitted by the filter like a reservation, or
        BudgetExceeded (the charge keeps what it had: that much was released)."""
        with self._store.transaction(self._dataset_of(release_id)) as tx:
            charge = self._existing(tx, release_id)
            if charge.status != RESERVED:
                raise LedgerError(f"release {release_id!r} is {charge.status}, not reserved: "
                                  f"only a reserved charge can grow")
            wanted = event if base is None else dp_event.ComposedDpEvent([base, event])
            rdp = rdp_filter.rdp_curve(wanted, charge.neighbouring)
            current = charge.rdp_on(rdp_filter.ORDERS)
            if np.all(rdp <= current):
                return charge
            total = np.maximum(current, rdp)
            others = [c for c in self._live_charges(tx, charge.dataset)
                      if c.release_id != release_id]
            self._admit(tx, release_id, charge.dataset, charge.partitions, others, total)
            tx.execute("UPDATE charges SET event = ?, rdp = ?, orders = ? WHERE release_id = ? "
                       "AND status = ?", (events.event_to_json(wanted), json.dumps(total.tolist()),
                                          json.dumps(list(rdp_filter.ORDERS)), release_id,
                                          RESERVED))
            # starts_over: an attempt without the earlier attempts' checkpoint, charged on top
            # of them; its state is not where the reservation says (``beam-dp ledger void``
            # then cannot prove that nothing was released).
            _record(tx, release_id, _now(), "extended", {"starts_over": base is not None})
            return self._charge(tx, release_id)

    @contextlib.contextmanager
    def admission(self, dataset: str, partitions, wait: float = ADMISSION_WAIT):
        """Held by a new run from its pre-check until its whole plan is charged: the runs of a
        partition are admitted one at a time, each checking its budget against what the ones
        before it reserved, so that of N runs racing for a budget that admits k, the others are
        refused before they read any data. Freed if the process dies. LedgerUnavailable after
        ``wait`` seconds (another run's admission took that long)."""
        keys = _partition_keys(partitions)
        names = sorted(f"admission\0{dataset}\0{key or ''}" for key in (keys or (None,)))
        with contextlib.ExitStack() as held:
            for name in names:
                try:
                    held.enter_context(self._store.run_lock(name, wait))
                except ReleaseInProgress:
                    raise LedgerUnavailable(
                        f"another run of {_names(keys) if keys else repr(dataset)} was still "
                        f"being admitted after {wait:g} s: run again later") from None
            yield

    def check_admits(self, dataset: str, partitions, event: dp_event.DpEvent,
                     neighbouring: str = accounting.ADD_REMOVE) -> None:
        """BudgetExceeded (NoBudget) unless ``event`` would be admitted now, next to every
        reserved and committed charge of the partitions; nothing is written."""
        keys = _partition_keys(partitions)
        rdp = rdp_filter.rdp_curve(event, rdp_filter.relation(neighbouring))
        with self._store.transaction() as tx:
            self._admit(tx, "(this run)", dataset, keys, self._live_charges(tx, dataset), rdp)

    @contextlib.contextmanager
    def lock(self, release_id: str, wait: float = 0.0):
        """Holds the per-release lock of ``run`` (freed if the process dies), for a caller that
        reserves and extends the charge itself; ReleaseInProgress if another process holds it."""
        with self._store.run_lock(_check_name("release id", release_id), wait):
            yield

    def commit(self, release_id: str, output) -> Charge:
        """Marks the reserved charge committed and stores the run's output (bytes, or plain
        JSON data: the model artifact), which a rerun of the release then gets back."""
        text = _encode_output(output)
        with self._store.transaction(self._dataset_of(release_id)) as tx:
            charge = self._existing(tx, release_id)
            if charge.status == COMMITTED:
                if charge.output == _decode_output(text):
                    return charge
                raise LedgerError(f"release {release_id!r} is already committed with a "
                                  f"different output; a released output is never replaced")
            if charge.status == VOID:
                raise LedgerError(f"release {release_id!r} was voided; reserve it again before "
                                  f"committing")
            now = _now()
            tx.execute("UPDATE charges SET status = ?, output = ?, committed_at = ? "
                       "WHERE release_id = ? AND status = ?",
                       (COMMITTED, text, now, release_id, RESERVED))
            # No output: a run refused after its first releases, committed to keep them charged.
            _record(tx, release_id, now, "committed", {"with_output": output is not None})
            return self._charge(tx, release_id)

    def void(self, release_id: str, by: str = "run") -> Charge:
        """Gives a reserved charge's budget back. Only for a run that read no data (the ledger
        takes the caller's word); a committed charge is never voided. ``by`` (VOIDED_BY): the
        run itself, or an operator (``beam-dp ledger void``), as the history records it."""
        if by not in VOIDED_BY:
            raise LedgerError(f"a charge is voided by one of {', '.join(VOIDED_BY)}, got {by!r}")
        with self._store.transaction(self._dataset_of(release_id)) as tx:
            charge = self._existing(tx, release_id)
            if charge.status == COMMITTED:
                raise LedgerError(f"refused: release {release_id!r} is committed; what was "
                                  f"released stays spent")
            if charge.status == RESERVED:
                now = _now()
                tx.execute("UPDATE charges SET status = ?, voided_at = ? "
                           "WHERE release_id = ? AND status = ?",
                           (VOID, now, release_id, RESERVED))
                _record(tx, release_id, now, "voided", {"by": by})
            return self._charge(tx, release_id)

    def history(self, release_id: str) -> list[dict]:
        """What happened to the charge, oldest first: dicts of ``at`` (UTC, ISO 8601),
        ``action`` (reserved, re-reserved, extended, committed, voided) and ``detail`` (public
        facts: partitions and orchestrator ids on a reservation; ``starts_over`` on an extension:
        an attempt charged on top of earlier ones; ``with_output`` on a commit: False for a run
        refused after its first releases; ``by`` on a void: run or operator). What happened
        before the ledger kept histories is read off the charge's timestamps (detail
        FROM_TIMESTAMPS): its latest reservation, commit and void only."""
        with self._store.transaction() as tx:
            charge = self._existing(tx, release_id)
            rows = tx.execute("SELECT at, action, detail FROM charge_history "
                              "WHERE release_id = ? ORDER BY at", (release_id,))
        recorded = [{"at": at, "action": action, "detail": json.loads(detail)}
                    for at, action, detail in rows]
        # Every change since the table exists is recorded, and its row carries the timestamp
        # the charge got: a timestamp older than the first row is from before.
        first = recorded[0]["at"] if recorded else None
        earlier = [{"at": at, "action": action, "detail": dict(FROM_TIMESTAMPS)}
                   for at, action in ((charge.reserved_at, "reserved"),
                                      (charge.committed_at, "committed"),
                                      (charge.voided_at, "voided"))
                   if at is not None and (first is None or at < first)]
        return sorted(earlier, key=lambda row: row["at"]) + recorded

    @contextlib.contextmanager
    def run(self, release_id: str, dataset: str, partitions, event: dp_event.DpEvent,
            neighbouring: str = accounting.ADD_REMOVE, orchestrator: dict | None = None,
            wait: float = 0.0):
        """A run of one release, under its per-release lock (held until the block ends, freed
        if the process dies)::

            with ledger.run(release_id, dataset, partitions, event) as run:
                if run.status == "committed":
                    return run.output           # released before: do not train
                ...                             # "new": train; "resume": from the checkpoint
                run.commit(artifact)

        ReleaseInProgress if another process holds the lock after ``wait`` seconds (default:
        fail at once); BudgetExceeded if the filter refuses. A block that ends without commit
        or void (an exception, a crash) leaves the charge reserved: the next run resumes it."""
        with self._store.run_lock(_check_name("release id", release_id), wait):
            yield Run(self, self.reserve(release_id, dataset, partitions, event, neighbouring,
                                         orchestrator))

    def charge(self, release_id: str) -> Charge | None:
        with self._store.transaction() as tx:
            return self._charge(tx, release_id)

    def charges(self, dataset: str | None = None) -> list[Charge]:
        """Every charge (void ones too), oldest first."""
        with self._store.transaction() as tx:
            if dataset is None:
                rows = tx.execute(f"SELECT {_CHARGE_COLUMNS} FROM charges "
                                  f"ORDER BY reserved_at, release_id")
            else:
                rows = tx.execute(f"SELECT {_CHARGE_COLUMNS} FROM charges WHERE dataset = ? "
                                  f"ORDER BY reserved_at, release_id", (dataset,))
        return [_charge(row) for row in rows]

    def datasets(self) -> list[str]:
        with self._store.transaction() as tx:
            rows = tx.execute("SELECT dataset FROM datasets UNION SELECT dataset FROM charges")
        return sorted(row[0] for row in rows)

    def partitions(self, dataset: str) -> list:
        """The partitions of ``dataset`` with a budget of their own or a charge (None stands
        for the unpartitioned dataset)."""
        keys = {k for c in self.charges(dataset) if c.status != VOID for k in c.keys}
        keys |= {b.partition for b in self.budgets(dataset) if b.partition is not None}
        return sorted(keys, key=lambda k: (k is not None, k or ""))

    # ------------------------------------------------------------------------------ explain

    def explain(self, dataset: str, partition: str | None = None) -> Explanation:
        """The filter's view of one partition (None: the unpartitioned dataset)."""
        with self._store.transaction() as tx:
            budget = self._budget(tx, dataset, partition)
            charges = [c for c in self._live_charges(tx, dataset) if partition in c.keys]
        orders = rdp_filter.ORDERS
        spent = self._spent(charges, partition)
        committed = self._spent([c for c in charges if c.status == COMMITTED], partition)
        relations = sorted({c.neighbouring for c in charges})
        if budget is None:
            return Explanation(dataset, partition, None, relations[0] if relations else None,
                               orders, None, tuple(spent[:len(orders)]), (), None, math.nan,
                               math.nan,
                               sum(c.status == COMMITTED for c in charges),
                               sum(c.status == RESERVED for c in charges))
        spent_epsilon, best = rdp_filter.epsilon(spent, budget.delta)
        spent_rdp, approx_delta = spent[:len(orders)], float(spent[len(orders)])
        return Explanation(
            dataset, partition, budget, relations[0] if relations else None, orders,
            rdp_filter.delta_per_order(max(0.0, budget.delta - approx_delta)),
            tuple(float(x) for x in spent_rdp),
            tuple(float(x) for x in rdp_filter.order_epsilons(spent, budget.delta)),
            best if charges else None, spent_epsilon,
            rdp_filter.epsilon(committed, budget.delta)[0],
            sum(c.status == COMMITTED for c in charges), sum(c.status == RESERVED for c in charges),
            approx_delta)

    # ---------------------------------------------------------------------------- internals

    def _charge(self, tx, release_id: str) -> Charge | None:
        row = tx.one(f"SELECT {_CHARGE_COLUMNS} FROM charges WHERE release_id = ?", (release_id,))
        return None if row is None else _charge(row)

    def _existing(self, tx, release_id: str) -> Charge:
        charge = self._charge(tx, release_id)
        if charge is None:
            raise LedgerError(f"no charge with release id {release_id!r} in the ledger")
        return charge

    def _dataset_of(self, release_id: str) -> str:
        with self._store.transaction() as tx:
            return self._existing(tx, release_id).dataset

    def _live_charges(self, tx, dataset: str) -> list[Charge]:
        rows = tx.execute(f"SELECT {_CHARGE_COLUMNS} FROM charges WHERE dataset = ? AND "
                          f"status <> ? ORDER BY reserved_at, release_id", (dataset, VOID))
        return [_charge(row) for row in rows]

    @staticmethod
    def _spent(charges, key) -> np.ndarray:
        total = np.zeros(rdp_filter.CURVE_LENGTH)
        for charge in charges:
            if key in charge.keys:
                total = total + charge.rdp_on(rdp_filter.ORDERS)
        return total

    @staticmethod
    def _own_budget(tx, dataset: str, partition: str | None) -> Budget | None:
        if partition is None:
            row = tx.one("SELECT epsilon, delta FROM datasets WHERE dataset = ?", (dataset,))
        else:
            row = tx.one("SELECT epsilon, delta FROM budgets WHERE dataset = ? AND "
                         "partition_id = ?", (dataset, partition))
        if row is None or row[0] is None:
            return None
        return Budget(dataset, partition, float(row[0]), float(row[1]))

    def _budget(self, tx, dataset: str, partition: str | None) -> Budget | None:
        own = self._own_budget(tx, dataset, partition) if partition is not None else None
        return own or self._own_budget(tx, dataset, None)

    @staticmethod
    def _check_same(existing: Charge, dataset, keys, event, relation) -> None:
        same = (existing.dataset == dataset and existing.partitions == keys
                and existing.neighbouring == relation and existing.event == event)
        if not same:
            raise ReleaseIdCollision(
                f"release id {existing.release_id!r} is already charged for another run "
                f"(dataset {existing.dataset!r}, partitions {_names(existing.partitions)}, "
                f"{existing.neighbouring}, a different DpEvent or not); asked now: dataset "
                f"{dataset!r}, partitions {_names(keys)}, {relation}. A release id must name "
                f"one run: this is a bug in how the release id is computed")

    @staticmethod
    def _check_consistent(charges, dataset, keys, relation) -> None:
        relations = {c.neighbouring for c in charges}
        if relations and relations != {relation}:
            raise LedgerError(
                f"dataset {dataset!r} is charged under {', '.join(sorted(relations))}; a run under "
                f"{relation} cannot be composed with those (one neighbouring relation per dataset)")
        partitioned = {c.partitions is not None for c in charges}
        if partitioned and partitioned != {keys is not None}:
            raise LedgerError(
                f"dataset {dataset!r} is charged as {'' if keys is None else 'un'}partitioned; a "
                f"run reading it {'whole' if keys is None else 'by partition'} would not be "
                f"accounted for correctly (one unit of privacy per dataset)")


def _where(dataset: str, partition: str | None) -> str:
    if partition is None:
        return f"dataset {dataset!r}"
    return f"dataset {dataset!r}, partition {partition!r}"


def _names(keys) -> str:
    return "(unpartitioned)" if keys is None else "[" + ", ".join(keys) + "]"
