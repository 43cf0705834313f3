"""Errors of the Spark job: the driver refuses to start or to go on, with a reason."""

import re

from blockagg.exceptions import BlockaggError

_RAISED = re.compile(r"^(blockagg(?:\.\w+)+)\.(\w+): (.+)$", re.MULTILINE)


class JobError(BlockaggError):
    """Base of the job's errors."""


class OffsetLogError(JobError):
    """The streaming checkpoint's offset log can't tell a batch's planned range."""


class JobLocked(JobError):
    """Another job serves the same metadata group and topic."""


class LockLost(JobError):
    """The job's lock membership expired while it ran: it stops rather than run
    unguarded (a second job would not be refused)."""


class BatchTimedOut(JobError):
    """A batch did not finish within ``job.batch_timeout``; its jobs were cancelled
    (``spark.watch``)."""


class StoppedBeforeBatch(JobError):
    """A micro-batch that Spark started after the stop request: refused before it
    reads or writes anything, so Spark does not record it as done and the next start
    runs it. This ends the query without interrupting any batch."""


class TaskContractError(JobError):
    """A Spark task got rows that break the one-partition-per-task contract."""



def refusal_in(failure: BaseException | str) -> str | None:
    """The blockagg error a failed Spark task raised, as ``Name: message``, found in
    the text Spark wraps it in (a JVM stack and the executor's Python traceback), so
    the operator reads the refusal (``MetadataDecodeError: events[3]: ...``), not the
    traces; ``None`` when the failure is not one of ours."""
    found = _RAISED.findall(str(failure))
    if not found:
        return None
    _module, name, message = found[-1]
    return f"{name}: {message}"
