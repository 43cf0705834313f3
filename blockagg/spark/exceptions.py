"""Errors of the Spark job: the driver refuses to start or to go on, with a reason."""

from blockagg.aggregator.exceptions import BlockaggError


class JobError(BlockaggError):
    """Base of the job's errors."""


class OffsetLogError(JobError):
    """The streaming checkpoint's offset log can't tell a batch's planned range."""


class JobLocked(JobError):
    """Another job serves the same metadata group and topic."""


class LockLost(JobError):
    """The job's lock membership expired while it ran: it stops rather than run
    unguarded (a second job would not be refused)."""


class TaskContractError(JobError):
    """A Spark task got rows that break the one-partition-per-task contract."""

