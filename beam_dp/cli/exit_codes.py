"""Exit codes of ``beam-dp`` besides 0, 2 (usage, input) and 130 (interrupted)."""

EXIT_REFUSED = 3        # the budget ledger refused the run
EXIT_IN_PROGRESS = 4    # the same release is running elsewhere (its lock is held)
EXIT_AUDIT_VIOLATION = 5   # beam-dp audit: the lower bound exceeds the claimed epsilon
EXIT_QUALITY = 6        # the model diverged or is much worse than a constant: nothing written
EXIT_MORE_JOBS = 75     # --max-jobs reached: state checkpointed, run the same command again
