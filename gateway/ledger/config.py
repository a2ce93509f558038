"""The ``ledger:`` section: the replica ledger gateways share through Redis (docs/deployment.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from gateway.config.section import PositiveSeconds, Section, SettingsViolations, Violation

__all__ = ["LedgerSettings"]


class LedgerSettings(Section):
    """Each gateway publishes its in-flight requests per replica; every other gateway counts them
    in its admission view. Uses ``limits.redis`` (URL, cluster, key prefix). Restart required."""

    enabled: Annotated[
        bool,
        Field(
            description="Share every gateway's in-flight requests per replica through Redis "
            "(limits.redis). Off: each gateway sees its own requests plus the replicas' scrapes."
        ),
    ] = False
    heartbeat_s: Annotated[
        PositiveSeconds,
        Field(
            ge=0.05,
            le=60,
            description="Every this many seconds a gateway renews its heartbeat key, checks the other "
            "gateways' and re-reads every replica's entries (repairing missed messages).",
        ),
    ] = 1.0
    expiry_s: Annotated[
        PositiveSeconds,
        Field(
            le=600,
            description="TTL of a gateway's heartbeat key, in seconds: entries of a gateway silent this long "
            "(crashed, cut off) are dropped by every other within expiry_s + heartbeat_s. At least "
            "2 x heartbeat_s.",
        ),
    ] = 3.0
    progress_interval_s: Annotated[
        PositiveSeconds,
        Field(
            ge=0.01,
            le=10,
            description="A request's progress (tokens so far) is published at most this often, in seconds; "
            "dispatch, first token and finish are published at once.",
        ),
    ] = 0.25
    max_entries_per_replica: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            description="Most entries of other gateways kept per replica (and most of its own a gateway "
            "publishes per replica). Beyond it entries are not counted (sluice_ledger_dropped_total); "
            "the replica's next scrape still shows their load.",
        ),
    ] = 4096
    unavailable_margin: Annotated[
        float,
        Field(
            ge=0,
            le=10,
            description="While the ledger is unreachable, every class's forecast margin is widened by this "
            "fraction: forecasts x (1 + unavailable_margin), on top of the class's own margin.",
        ),
    ] = 0.2
    count_unseen: Annotated[
        bool,
        Field(
            description="Count the other gateways' dispatches not heard of yet: per replica, their "
            "recent rate times the ledger's measured delay (at most 0.5 s), as prefills about to "
            "start. Off: only the entries received count.",
        ),
    ] = True

    @model_validator(mode="after")
    def _expiry_outlasts_heartbeats(self) -> LedgerSettings:
        if self.expiry_s < 2 * self.heartbeat_s:
            raise SettingsViolations(
                [
                    Violation(
                        ("expiry_s",),
                        f"must be at least 2 x heartbeat_s ({self.heartbeat_s!r})",
                        self.expiry_s,
                    )
                ]
            )
        return self
