"""Job results that outlive the launch that built the job: the Flex Template protocol.

A Dataflow Flex Template launcher runs the entry point with ``--template_location``: Beam then
writes each job it is given to that location instead of running it, and the job runs only after
the launching process has exited. So a launch cannot read its own job's result. Instead, with
``--template_location`` the Beam aggregator builds at most one job per process, has it write its
result (a noised state, or a count or batch index the driver noises or checks) under the
release's checkpoint directory, and stops (``JobLimitReached``: exit 75, "launch again"). The
next launch replays the driver from the checkpoint and finds that result where the job left it.

A result is found again by *where the driver is* when it builds the job: the digest of the
checkpoint file as it then is (a new one is written after every chunk of steps), and the
ordinal of the job since that checkpoint. Between two checkpoints the driver is a pure function
of the checkpoint, the job results and the run's seed, so the same seed makes every launch build
the same jobs in the same order. Without ``--seed`` the run's seed is drawn once from the OS's
secure source and kept here until the run ends (``seed``); that file, like a count job's exact
result, is as sensitive as the input (it would let a reader strip the noise from the model), and
``remove`` deletes it with everything else once the run has finished. Results of an earlier
checkpoint are deleted as soon as a newer checkpoint is seen: nothing reads them again.
"""
from __future__ import annotations

import hashlib
import pickle

from beam_dp import mechanisms, storage

SEED_FILE = "run-seed"
MISSING = object()


class JobResults:
    """``directory``: where this release's job results wait for the next launch (under its
    checkpoint directory); ``checkpoint_file``: the driver's checkpoint, whose content says
    where in the run the driver is."""

    def __init__(self, directory: str, checkpoint_file: str):
        self.directory, self.checkpoint_file = directory, checkpoint_file
        self._digest: str | None = None
        self._ordinal = 0

    def seed(self) -> int:
        """The run's seed: drawn from the OS's secure source by the first launch, the same for
        every later one (they must replay the same noise to build the same jobs)."""
        path = storage.join(self.directory, SEED_FILE)
        if not storage.exists(path):
            # (as sensitive as the input: on a local disk, readable by its owner only)
            storage.write_bytes(path, str(mechanisms.secure_seed()).encode(), private=True)
        return int(storage.read_text(path))

    def next_key(self, kind: str, steps: int = 0) -> str:
        """The name of the next job's result: the checkpoint's digest, the job's ordinal since
        that checkpoint, its kind and steps (a launch that would plan the job otherwise finds
        no result, rather than another job's)."""
        checkpoint = (storage.read_bytes(self.checkpoint_file)
                      if storage.exists(self.checkpoint_file) else b"")
        digest = hashlib.sha256(checkpoint).hexdigest()[:16]
        if digest != self._digest:
            self._digest, self._ordinal = digest, 0
            self._remove_older(digest)
        key = f"{digest}-{self._ordinal:04d}-{kind}-{steps}"
        self._ordinal += 1
        return key

    def path(self, key: str, name: str = "result.pkl") -> str:
        return storage.join(self.directory, f"{key}.{name}")

    def load(self, key: str):
        """The result the job ``key`` wrote, or MISSING (not run yet, or it failed)."""
        path = self.path(key)
        if not storage.exists(path):
            return MISSING
        return pickle.loads(storage.read_bytes(path))

    def _remove_older(self, digest: str) -> None:
        older = [storage.join(self.directory, name) for name in storage.list_files(self.directory)
                 if name != SEED_FILE and not name.startswith(digest)]
        storage.delete_files(older)

    def remove(self) -> None:
        """Deletes every result and the seed: the run has finished."""
        storage.delete_tree(self.directory)
