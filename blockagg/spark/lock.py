"""One job per metadata group and topic: a lock held through Kafka group membership.

The driver joins the consumer group ``<metadata_group_id>.lock``, subscribed to the
job's topics (or pattern) with the ``cooperative-sticky`` assignor, and pauses every
partition it is given (it never fetches). Kafka then does the locking:

* a partition of our topics assigned to another member means another job subscribed
  to the same topic in the same group: the starting job waits ``lock_timeout`` (a
  killed job's membership expires after the short session timeout) and then refuses,
  naming the other member;
* a running job always keeps at least one partition when a second one joins (the
  sticky assignor moves only what balancing needs), so the newcomer sees another
  member holding a partition of its topics and refuses; the running job carries on
  (two jobs starting at the same instant both refuse, which is safe).

The metadata group itself is never joined (the broker rejects simple offset commits
to a group with active members); :func:`check_metadata_group_idle` refuses to start
when something else is a member of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from blockagg import logs
from blockagg.spark.exceptions import JobLocked, LockLost
from blockagg.spark.offsets import TopicPartition

log = logs.get("lock")

WAIT_NOTICE_INTERVAL = 10.0


def _describe(admin: Any, group: str, timeout: float = 10.0) -> Any:
    futures = admin.describe_consumer_groups([group], request_timeout=timeout)
    return futures[group].result(timeout=timeout)


def check_metadata_group_idle(kafka_config: Mapping[str, str], group: str) -> None:
    """Refuse when the metadata group has active members (its commits would fail)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(logs.kafka_client_config(kafka_config))
    try:
        description = _describe(admin, group)
    except Exception as exc:  # a group that never existed is fine
        log.debug("describe of %s failed: %s", group, exc)
        return
    members = list(getattr(description, "members", []) or [])
    if members:
        shown = ", ".join(f"{m.client_id}@{m.host}" for m in members)
        raise JobLocked(
            f"the metadata group {group!r} has active members ({shown}): something "
            "subscribed with the group blockagg commits to, and the broker would reject "
            "blockagg's commits. Stop it, or set job.metadata_group_id to a group of its own"
        )


class GroupLock:
    """Membership of ``<group>.lock`` covering the job's topics (see the module doc)."""

    def __init__(
        self,
        kafka_config: Mapping[str, str],
        metadata_group: str,
        subscription: list[str],
        owns: Callable[[str], bool],
        client_id: str,
        session_timeout_ms: int = 10_000,
        on_lost: Callable[[LockLost], None] | None = None,
    ) -> None:
        from confluent_kafka import Consumer

        self.group = f"{metadata_group}.lock"
        self._on_lost_hook = on_lost
        self._owns = owns
        self._subscription = subscription
        conf: dict[str, object] = dict(kafka_config)
        conf.update(
            {
                "group.id": self.group,
                "client.id": client_id,
                "enable.auto.commit": False,
                "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": session_timeout_ms,
                "heartbeat.interval.ms": max(1000, session_timeout_ms // 5),
                "auto.offset.reset": "latest",
            }
        )
        self._consumer = Consumer(logs.kafka_client_config(conf))
        self._admin_conf: dict[str, Any] = dict(kafka_config)
        self._assigned: set[TopicPartition] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False
        self._member_id: str | None = None

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        consumer.incremental_assign(partitions)
        consumer.pause(partitions)
        member = consumer.memberid()  # here, in the polling thread: the consumer is busy
        with self._lock:
            self._member_id = member
            self._assigned.update((p.topic, p.partition) for p in partitions)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        with self._lock:
            for p in partitions:
                self._assigned.discard((p.topic, p.partition))
        consumer.incremental_unassign(partitions)
        if self._held and partitions:
            moved = ", ".join(f"{p.topic}[{p.partition}]" for p in partitions)
            log.warning(
                "lock group %s moved %s to another member: a second job on the same "
                "metadata group and topic is starting; it will refuse to run", self.group, moved
            )

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        """The coordinator dropped us (no heartbeat within the session timeout, e.g. the
        broker was unreachable): nobody took the partitions, so say so, not "a second job".

        Without the membership a second job would not be refused, so the lock is no
        longer held: ``on_lost`` (the driver) is told, and stops the job cleanly. The
        fencing of task attempts (``aggregator.kafka.fencing``) keeps the data safe
        meanwhile; the stop keeps two jobs from taking turns fencing each other."""
        with self._lock:
            for p in partitions:
                self._assigned.discard((p.topic, p.partition))
        consumer.incremental_unassign(partitions)
        if self._held and partitions:
            self._held = False
            reason = (
                f"lock group {self.group} membership lost: no heartbeat reached the group "
                "coordinator within the session timeout (broker unreachable, or the driver "
                "paused longer than job.lock_session_timeout); a second job on the same "
                "metadata group and topic would no longer be refused, so this job stops. "
                "Restart it once the brokers are reachable"
            )
            log.warning("%s", reason)
            if self._on_lost_hook is not None:
                self._on_lost_hook(LockLost(reason))

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self._consumer.poll(0.5)
            except Exception as exc:  # pragma: no cover - logged, retried
                log.warning("lock consumer poll failed: %s", exc)
                time.sleep(1)

    def _others(self) -> dict[TopicPartition, str]:
        """Partitions of our topics held by other members of the lock group."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(logs.kafka_client_config(self._admin_conf))
        description = _describe(admin, self.group)
        with self._lock:
            me = self._member_id
        out: dict[TopicPartition, str] = {}
        for member in getattr(description, "members", []) or []:
            if member.member_id == me:
                continue
            assignment = getattr(member, "assignment", None)
            for tp in getattr(assignment, "topic_partitions", []) or []:
                if self._owns(tp.topic):
                    out[(tp.topic, tp.partition)] = f"{member.client_id}@{member.host}"
        return out

    def acquire(self, timeout: float) -> None:
        """Join, then wait until no other member holds a partition of our topics."""
        self._consumer.subscribe(self._subscription, on_assign=self._on_assign,
                                 on_revoke=self._on_revoke, on_lost=self._on_lost)
        self._thread = threading.Thread(target=self._poll, name="blockagg-lock", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        next_notice = 0.0
        others: dict[TopicPartition, str] = {}
        while True:
            time.sleep(1.0)
            try:
                others = self._others()
            except Exception as exc:
                log.info("lock group %s not described yet: %s", self.group, exc)
                others = {}
                if time.monotonic() < deadline:
                    continue
            with self._lock:
                mine = set(self._assigned)
            if not others and mine:
                self._held = True
                logs.event(log, "lock acquired", group=self.group, partitions=len(mine))
                return
            if others and time.monotonic() >= next_notice:
                next_notice = time.monotonic() + WAIT_NOTICE_INTERVAL
                self._log_waiting(others, deadline)
            if time.monotonic() >= deadline:
                self.release()
                if others:
                    holders = sorted(set(others.values()))
                    raise JobLocked(
                        f"another job serves the same metadata group and topic: lock group "
                        f"{self.group} has {', '.join(holders)} holding "
                        f"{', '.join(f'{t}[{p}]' for t, p in sorted(others))}. Stop that job, "
                        "or give this one its own job.metadata_group_id"
                    )
                raise JobLocked(
                    f"could not join lock group {self.group} within {timeout:.0f}s (no "
                    "partition assigned): are the topics there and the brokers reachable?"
                )

    def _log_waiting(self, others: Mapping[TopicPartition, str], deadline: float) -> None:
        holders = sorted(set(others.values()))
        logs.event(log, "waiting for the lock", level=30, group=self.group,
                   holders=holders, partitions=len(others),
                   refusing_in=f"{max(0.0, deadline - time.monotonic()):.0f}s",
                   hint="another job serves this metadata group and topic; it is "
                        "refused at job.lock_timeout unless the holder goes away")

    def release(self) -> None:
        self._held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._consumer.close()
        except Exception as exc:  # pragma: no cover
            log.debug("lock consumer close: %s", exc)
