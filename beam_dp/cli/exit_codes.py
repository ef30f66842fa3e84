"""Exit codes of ``beam-dp`` besides 0 (done) and 2 (usage or input error: do not retry), each
with what an orchestrator should do (docs/guide/production.md has the table)."""
import errno

EXIT_USAGE = 2          # usage or data error: do not retry unchanged
EXIT_REFUSED = 3        # the budget ledger refused the run: do not retry
EXIT_IN_PROGRESS = 4    # the same release is running elsewhere (its lock is held): do not retry
EXIT_AUDIT_VIOLATION = 5   # beam-dp audit: the lower bound exceeds the claimed epsilon
EXIT_QUALITY = 6        # the model diverged or is much worse than a constant: nothing written
EXIT_CORRUPT_CHECKPOINT = 7   # the release's checkpoint cannot be read: discard it, then rerun
EXIT_TRANSIENT = 69     # disk full, read-only output, ledger locked or unreachable: retry later
EXIT_MORE_JOBS = 75     # --max-jobs reached: state checkpointed, run the same command again
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: resumable with --checkpoint-dir

# What an orchestrator must not retry unchanged (the others: retry, the run resumes).
DO_NOT_RETRY = (EXIT_USAGE, EXIT_REFUSED, EXIT_IN_PROGRESS, EXIT_QUALITY, EXIT_CORRUPT_CHECKPOINT)

# OS errors that another attempt may not meet (the same command then resumes, or returns a
# release already committed): no space or quota, a read-only file system, a network timeout.
TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ETIMEDOUT,
                              errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH,
                              errno.ENETUNREACH, errno.EAGAIN})
