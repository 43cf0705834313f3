"""Ownership conflicts for ``arv verify`` and ``arv audit``: a group that committed
offsets of a topic that the ownership records (``aggregator.kafka.ownership``) give
to another group. Two groups delivering one topic into one shard store its messages
twice, and each group's own history looks clean: only the record tells.

A group the record names as a previous owner (it was taken over from) is not in
conflict: its commits are from before the take-over. The shard is not known to
``arv verify`` (it reads Kafka only), so a group is in conflict when it owns no key of
the topic and some other group owns one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from blockagg.aggregator.kafka.exceptions import KafkaAdapterError
from blockagg.aggregator.kafka.ownership import Claim, ClaimKey, OwnersStore
from blockagg.verifier.exceptions import VerifierError


@dataclass(frozen=True)
class OwnershipConflict:
    group: str
    topic: str
    owner: str
    shard: str
    since_ms: int

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "ownership", "severity": "anomaly", "group": self.group,
                "topic": self.topic, "owner": self.owner, "shard": self.shard,
                "since_ms": self.since_ms, "detail": self.detail}

    @property
    def detail(self) -> str:
        return (f"group {self.group} committed offsets of topic {self.topic}, which group "
                f"{self.owner} delivers into shard {self.shard}: two groups store its "
                f"messages twice (arv audit --group {self.owner} counts them); stop "
                f"{self.group}'s job, or make it the owner with --take-over {self.owner}")


def conflicts(records: Mapping[ClaimKey, Claim], cluster: str,
              group_topics: Iterable[tuple[str, str]]) -> list[OwnershipConflict]:
    """The conflicts of (group, topic) pairs that have commits (pure)."""
    out: list[OwnershipConflict] = []
    for group, topic in sorted(set(group_topics)):
        claims = [c for k, c in sorted(records.items())
                  if k.cluster == cluster and k.topic == topic]
        if not claims or any(c.owner == group for c in claims):
            continue
        for claim in claims:
            if any(h.from_group == group for h in claim.history):
                continue  # taken over from this group: its commits are older
            out.append(OwnershipConflict(group, topic, claim.owner, claim.key.shard,
                                         claim.since_ms))
    return out


def read_conflicts(bootstrap_servers: str, settings: Mapping[str, str], owners_topic: str,
                   group_topics: Iterable[tuple[str, str]],
                   timeout: float) -> list[OwnershipConflict]:
    """Read the ownership topic (absent: no record, no conflict) and judge."""
    pairs = list(group_topics)
    if not pairs:
        return []
    store = OwnersStore({**settings, "bootstrap.servers": bootstrap_servers}, owners_topic,
                        timeout)
    try:
        return conflicts(store.read(), store.cluster_id(), pairs)
    except KafkaAdapterError as exc:
        raise VerifierError(f"{exc} (--owners-topic {owners_topic})") from None
