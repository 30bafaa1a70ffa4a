"""Typed errors of the indknn library and the exit codes the CLI maps them to.

Exit codes (documented in README and `indknn --help`):

    0  success
    1  runtime error (I/O failure such as a full disk or a read-only file system, lock timeout, ...),
       and a damaged or rolled-back ledger (LedgerIntegrityError: a broken hash chain, a missing,
       duplicated, edited, reordered, truncated or unreadable event or snapshot, edited budgets, a
       ledger behind the store's high-water mark, a store restored from an older copy whose rows no longer
       hold the ledger's records; `account --verify` failing); nothing was written
    2  usage error / bad input, including a missing, foreign (not what indknn writes) or newer-format
       store or ledger, and a second ledger for a store bound to another one (nothing was written)
    3  stop serving: the public query allowance is used up (`serve-queries --max-queries`,
       `account --queries-left`), or, for the operator only, fewer active records than
       `account --min-active`. `serve-queries` never exits 3 because records are retired.
    4  budget check failed (`indknn account --eps E`: the guarantee is above E)
  130  interrupted (SIGINT): what was committed stays; re-running resumes
  143  terminated (SIGTERM: `kill`, systemd, a cron timeout): as 130
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_BUDGET_EXHAUSTED = 3
EXIT_CHECK_FAILED = 4


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be (the CLI installs the handler: :func:`indknn_cli.cli.app.main`), so that
    the same clean-up runs: the commit in flight finishes, locks are let go, exit 143 with a message (review 48,
    F10: SIGTERM killed the process at once, exit 143 and no word; the ledger stayed consistent)."""


class IndknnError(Exception):
    """Base class of every error the library raises on purpose."""

    exit_code = EXIT_RUNTIME


class BadInputError(IndknnError, ValueError):
    """Malformed or inconsistent input: nothing was written."""

    exit_code = EXIT_USAGE


class StoreError(IndknnError):
    """The feature store is missing, corrupt or of another format/extractor."""

    exit_code = EXIT_USAGE


class LedgerError(IndknnError):
    """The budget ledger is missing, corrupt, foreign or of another format."""

    exit_code = EXIT_USAGE


class LedgerIntegrityError(LedgerError):
    """The ledger fails its integrity checks (hash chain, sequence numbers, budgets, the store's
    high-water mark): damaged, tampered with or rolled back. Refused, nothing written (exit 1)."""

    exit_code = EXIT_RUNTIME


class LedgerOlderThanStoreError(LedgerIntegrityError):
    """The ledger was written for the store before a compaction it never saw (restored from an older backup)."""


class StorageError(IndknnError):
    """The file system refused a write (read-only, full, permission denied): nothing was committed."""

    exit_code = EXIT_RUNTIME


class LockTimeoutError(IndknnError):
    """Another process holds the ledger or store lock."""

    exit_code = EXIT_RUNTIME


class BudgetExhaustedError(IndknnError):
    """Fewer active records than the operator's `account --min-active` (an operator-only check; serving never
    raises it: with no active record left, queries are still answered from noise and reuse, SPEC §8)."""

    exit_code = EXIT_BUDGET_EXHAUSTED


class ConcurrentChangeError(IndknnError):
    """Another process changed the store or ledger under us (a compaction renumbered the rows while this
    command waited for a lock): nothing was written; a transient condition, so a runtime error (exit 1).
    `serve-queries` re-opens and goes on by itself."""

    exit_code = EXIT_RUNTIME


class QueryAllowanceError(IndknnError):
    """The public query allowance (queries answered against T) is used up: nothing was answered."""

    exit_code = EXIT_BUDGET_EXHAUSTED


class PrivacyRefusedError(BadInputError):
    """A request that would break the privacy argument (e.g. IVF trained on private data)."""


class CheckFailedError(IndknnError):
    """A budget check (`account --eps`) did not pass."""

    exit_code = EXIT_CHECK_FAILED


class SchedulerError(IndknnError):
    """A Dask scheduler (`--scheduler ADDRESS` or `$INDKNN_SCHEDULER`) could not be reached or its
    workers failed past Dask's retries: nothing was written or released (exit 1)."""

    exit_code = EXIT_RUNTIME
