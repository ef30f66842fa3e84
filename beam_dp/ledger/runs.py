"""A training run as the ledger sees it: its release id, and its charge as it grows.

Release id. A deterministic hash of what the run releases: its configuration (every train flag
that can change the model or its guarantee, the dataset id and partitions), its input snapshot
(``input_snapshot``: each file's size and its store's checksum, or locally its size and
modification time unless ``--input-snapshot content``; a warm-start model by its bytes'
hash) and the code version. A scheduler's retry or a double submission of the same command on
the same files has the same id, so the ledger neither charges nor trains twice; new data, a new
partition or a new release of beam-dp is a new release. Left out, as they do not change what is
released: where the output, checkpoints and temp files go, the runner and its flags, progress,
--max-jobs, --steps-per-job and orchestrator ids (an Airflow retry has a new run id).

The charge. A run cannot know its whole DpEvent before it reads data: with a private count the
noise is calibrated to the count. So ``RunCharge`` (the in-run ledger's gate,
``accounting.Ledger(gate=...)``) reserves the first releases (the count) before they are made,
and extends the reservation with the plan (the steps) before training starts; each is admitted
by the Renyi filter. A refusal after the count leaves the count charged (it was made).
"""
from __future__ import annotations

import hashlib
import json
import os

from beam_dp import storage
from beam_dp.algorithms.base import checkpoint_exists
from beam_dp.ledger import core

# The orchestrator entry of a reservation naming where its attempt saves its state.
CHECKPOINT_KEY = "checkpoint_dir"
# Increment when the meaning of a release id's fields changes. 2: object-store inputs by their
# store's checksum, not their modification time; a warm-start model by the hash of its bytes.
RELEASE_ID_VERSION = 2
# How a run's local input files enter its release id (--input-snapshot).
SNAPSHOT_MODES = ("metadata", "content")


def input_snapshot(paths, mode: str = "metadata") -> list[dict]:
    """What identifies each input file, sorted by path: on an object store its size and the
    checksum the store keeps (GCS's CRC32C, S3's ETag: same bytes re-uploaded, same id); on a
    local disk its size and modification time (no content read), or with ``mode="content"``
    the SHA-256 of its bytes (a touched or re-copied file with the same bytes, same id)."""
    if mode not in SNAPSHOT_MODES:
        raise ValueError(f"--input-snapshot must be one of {', '.join(SNAPSHOT_MODES)}")
    snapshot = []
    for path in sorted(set(paths)):
        if "://" in path:
            from apache_beam.io.filesystems import FileSystems
            metadata = FileSystems.match([path])[0].metadata_list[0]
            entry = {"path": path, "size": int(metadata.size_in_bytes)}
            checksum = FileSystems.checksum(path)
            if checksum:
                entry["checksum"] = str(checksum)
            else:   # a store that keeps none: its modification time
                entry["modified"] = repr(float(metadata.last_updated_in_seconds))
        elif mode == "content":
            entry = {"path": os.path.abspath(path), "sha256": _sha256(path)}
        else:
            stat = os.stat(path)
            entry = {"path": os.path.abspath(path), "size": int(stat.st_size),
                     "modified": repr(stat.st_mtime_ns / 1e9)}
        snapshot.append(entry)
    return snapshot


def artifact_snapshot(paths) -> list[dict]:
    """Small artifacts a run builds on (a warm-start model): the SHA-256 of their bytes, so that
    a model written again with the same bytes (a re-run day's) keeps the runs after it the
    same releases."""
    return [{"path": p, "sha256": hashlib.sha256(storage.read_bytes(p)).hexdigest()}
            for p in sorted(set(paths))]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with storage.open_read(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stand_in(epsilon: float, delta: float, neighbouring: str):
    """A run of (epsilon, delta) as the filter sees it before the run knows its releases: one
    Gaussian mechanism calibrated by dp_accounting's PLD accountant to exactly that (epsilon,
    delta). A DP-GD run is close to it (its steps compose to one Gaussian; its count and quality
    check take a share); other runs compose differently, which the admission proper sees."""
    from dp_accounting import dp_event, mechanism_calibration
    from beam_dp import accounting

    sigma = mechanism_calibration.calibrate_dp_mechanism(
        lambda: accounting.make_accountant("pld", neighbouring), dp_event.GaussianDpEvent,
        epsilon, delta, mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0))
    return dp_event.GaussianDpEvent(sigma)


def release_id(configuration: dict, snapshot: list[dict], version: str) -> str:
    """The hash of a run's configuration, input snapshot and code version (module docstring)."""
    text = json.dumps({"release_id_version": RELEASE_ID_VERSION, "configuration": configuration,
                       "inputs": snapshot, "beam_dp": version}, sort_keys=True, default=str)
    return "r-" + hashlib.sha256(text.encode()).hexdigest()[:32]


class RunCharge:
    """The gate of one attempt of a run (``accounting.Ledger(gate=...)``), called with
    everything the attempt will have released (cumulative): the first call reserves it, later
    ones extend the reservation (``core.Ledger.extend``). ``earlier``: the charge of earlier
    attempts (reserved, not committed), or None. An attempt that resumes their checkpoint
    (``from_checkpoint``) continues their releases: what it plans again is already charged. One
    that starts over (no checkpoint: another --checkpoint-dir, or it died before the first) makes
    new releases, charged on top of theirs. BudgetExceeded propagates: the run stops before
    releasing more."""

    def __init__(self, ledger: core.Ledger, release: str, dataset: str, partitions,
                 neighbouring: str, orchestrator: dict, earlier: core.Charge | None = None,
                 from_checkpoint: bool = False, checkpoint_dir: str | None = None):
        self.ledger, self.release = ledger, release
        self.dataset, self.partitions = dataset, partitions
        self.neighbouring, self.orchestrator = neighbouring, dict(orchestrator)
        self.checkpoint_dir = checkpoint_dir
        if checkpoint_dir:   # where the attempt's state goes, for a later attempt to check
            self.orchestrator[CHECKPOINT_KEY] = checkpoint_dir
        self.reserved = earlier is not None
        # An earlier attempt that checkpointed to this directory and left nothing there made no
        # release anyone can see: a run saves its plan (the first state that depends on the
        # data) here before it extends the charge with anything that depends on the data, and
        # what it reserved before that is public. This attempt then takes over its charge
        # instead of charging on top. (Conservative where it cannot know: an earlier attempt
        # that checkpointed elsewhere, or nowhere, is charged on top.)
        takes_over = (earlier is not None and bool(checkpoint_dir) and not from_checkpoint
                      and earlier.orchestrator.get(CHECKPOINT_KEY) == checkpoint_dir)
        self.base = None if earlier is None or from_checkpoint or takes_over else earlier.event
        self.admission = None   # (an ExitStack holding core.Ledger.admission, set by the caller)

    def released_nothing(self) -> bool:
        """Whether the charge covers no release anyone can see: all of it this attempt's (or
        taken over from one that saw none), and no state saved in its checkpoint directory (a
        run without one cannot tell: its charge's extension may depend on the data)."""
        return (self.base is None and bool(self.checkpoint_dir)
                and not checkpoint_exists(self.checkpoint_dir))

    def whole_run_admitted(self) -> None:
        """The accounting ledger's word that the run's whole plan is now charged: the runs of
        its partitions waiting to be admitted may go on (``core.Ledger.admission``)."""
        if self.admission is not None:
            self.admission.close()

    def precheck(self, epsilon: float | None, delta: float | None = None) -> None:
        """Before the run reads any data: refuses it, charging nothing, if a partition it reads
        has no budget, or less epsilon left (the filter's reading) than the run's target. Only
        public values decide (the ledger and the requested epsilon), so the refusal reveals
        nothing about the data. With the run's ``delta`` too, the filter is asked whether it
        would admit a stand-in for the whole run (``stand_in``: a Gaussian mechanism of the
        run's (epsilon, delta)) next to the charges already there; under the partitions'
        admission lock (``core.Ledger.admission``) those include every run admitted before. The
        filter's own admission, once the run knows its releases, still decides (a run whose
        releases compose worse than the stand-in may be refused there, after its count: the
        count is then charged, as the refusal depends on it)."""
        for partition in self.partitions or [None]:
            view = self.ledger.explain(self.dataset, partition)
            where = core._where(self.dataset, partition)
            if view.budget is None:
                raise core.NoBudget(
                    f"no budget is declared for {where}: declare one (beam-dp ledger budget "
                    f"--dataset-id {self.dataset} --epsilon E --delta D) before running on it")
            remaining = view.remaining_epsilon
            # (without the run's delta, a cruder reading: its epsilon against what is left)
            if epsilon is not None and delta is None and epsilon > remaining:
                raise core.BudgetExceeded(
                    f"refused before reading any data: {where} has epsilon="
                    f"{max(0.0, remaining):.4g} remaining of its lifetime {view.budget.epsilon:g} at "
                    f"delta={view.budget.delta:g} (Renyi filter's reading of {view.committed} "
                    f"committed and {view.reserved} reserved runs); this run asks for epsilon="
                    f"{epsilon:g}. Nothing was charged. (Remaining is a reading, not an amount: "
                    f"Renyi curves compose below the sum of epsilons, so a run of a smaller "
                    f"epsilon may still fit; beam-dp ledger explain)",
                    self.dataset, partition, view.spent_epsilon, view.spent_epsilon + epsilon,
                    view.budget)
        if epsilon is not None and delta is not None:
            try:
                self.ledger.check_admits(self.dataset, self.partitions, stand_in(
                    epsilon, delta, self.neighbouring), self.neighbouring)
            except core.BudgetExceeded as e:
                raise core.BudgetExceeded(
                    f"refused before reading any data, nothing charged: {e} (the run's "
                    f"epsilon={epsilon:g}, delta={delta:g}, as one Gaussian mechanism)",
                    e.dataset, e.partition, e.spent_epsilon, e.epsilon_with_run,
                    e.budget) from None

    def __call__(self, event) -> None:
        if self.reserved:
            self.ledger.extend(self.release, event, self.base)
            return
        reservation = self.ledger.reserve(self.release, self.dataset, self.partitions, event,
                                          self.neighbouring, self.orchestrator)
        self.reserved = True
        if reservation.status == core.COMMITTED:   # checked under the lock before training
            raise core.LedgerError(f"release {self.release!r} was committed meanwhile")
