"""Replica registry: health state machine, least-outstanding routing, reconcile on reload (pure)."""

from __future__ import annotations

import time

import pytest

from gateway.api.responses import ModelCard
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HealthSettings, ReplicaSettings
from gateway.replicas.registry import NoReplica, Replica, ReplicaRegistry, ReplicaState

H = ReplicaState.HEALTHY
U = ReplicaState.UNHEALTHY
K = ReplicaState.UNKNOWN


def replica_settings(*names: str, port: int = 9000) -> list[ReplicaSettings]:
    return [ReplicaSettings(name=n, url=f"http://127.0.0.1:{port + i}") for i, n in enumerate(names)]


def registry_for(*names: str) -> ReplicaRegistry:
    return ReplicaRegistry(SettingsStore(Settings(replicas=replica_settings(*names))))


def make_healthy(replica: Replica, *models: str) -> None:
    replica.models = {m: ModelCard(m, 4096, {"id": m}) for m in models or ("m",)}
    replica.state = ReplicaState.HEALTHY


@pytest.mark.parametrize(
    ("checks", "unhealthy_after", "healthy_after", "states", "transitions"),
    [
        pytest.param("+", 2, 1, [H], [H], id="unknown-to-healthy-on-first-success"),
        pytest.param("-", 2, 1, [U], [U], id="unknown-to-unhealthy-on-first-failure"),
        pytest.param("+-", 2, 1, [H, H], [H, None], id="one-failure-tolerated"),
        pytest.param("+--", 2, 1, [H, H, U], [H, None, U], id="unhealthy-after-two"),
        pytest.param("+-+-", 2, 1, [H, H, H, H], [H, None, None, None], id="failures-must-be-consecutive"),
        pytest.param("-++", 2, 2, [U, U, H], [U, None, H], id="healthy-after-two"),
        pytest.param("-+-+", 2, 2, [U, U, U, U], [U, None, None, None], id="successes-must-be-consecutive"),
        pytest.param("+---", 1, 1, [H, U, U, U], [H, U, None, None], id="transition-reported-once"),
    ],
)
def test_health_state_machine(
    checks: str,
    unhealthy_after: int,
    healthy_after: int,
    states: list[ReplicaState],
    transitions: list[ReplicaState | None],
) -> None:
    health = HealthSettings(unhealthy_after=unhealthy_after, healthy_after=healthy_after)
    replica = Replica(replica_settings("r")[0])
    assert replica.state == K
    seen_states, seen_transitions = [], []
    for check in checks:
        seen_transitions.append(replica.record(check == "+", health, error="boom"))
        seen_states.append(replica.state)
    assert seen_states == states
    assert seen_transitions == transitions


@pytest.mark.parametrize(
    ("outstanding", "picks"),
    [
        pytest.param([0, 0, 0], ["a", "b", "c", "a"], id="all-idle-round-robin"),
        pytest.param([2, 0, 1], ["b", "b", "b"], id="least-outstanding-wins"),
        pytest.param([1, 0, 0], ["b", "c", "b"], id="ties-among-least-rotate"),
    ],
)
def test_pick_least_outstanding_with_round_robin_ties(outstanding: list[int], picks: list[str]) -> None:
    registry = registry_for("a", "b", "c")
    for replica, count in zip(registry.replicas(), outstanding, strict=True):
        make_healthy(replica)
        replica.outstanding = count
    assert [pick_name(registry, "m") for _ in picks] == picks


def pick_name(registry: ReplicaRegistry, model: str) -> str:
    picked = registry.pick(model)
    assert isinstance(picked, Replica)
    return picked.name


def test_leases_count_outstanding_until_released() -> None:
    registry = registry_for("a", "b")
    a, b = registry.replicas()
    make_healthy(a)
    make_healthy(b)
    with registry.lease(a):
        assert a.outstanding == 1
        assert pick_name(registry, "m") == "b"
        with registry.lease(b), registry.lease(b):
            assert pick_name(registry, "m") == "a"
    assert (a.outstanding, b.outstanding) == (0, 0)


def test_pick_only_among_healthy_replicas_serving_the_model() -> None:
    registry = registry_for("a", "b", "c")
    a, b, c = registry.replicas()
    make_healthy(a, "other")
    make_healthy(b, "m")
    make_healthy(c, "m")
    c.state = ReplicaState.UNHEALTHY
    assert {pick_name(registry, "m") for _ in range(4)} == {"b"}


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        pytest.param("all-known-none-serves", NoReplica.UNKNOWN_MODEL, id="unknown-model"),
        pytest.param("server-unhealthy", NoReplica.NONE_HEALTHY, id="its-replica-is-down"),
        pytest.param("never-fetched", NoReplica.NONE_HEALTHY, id="a-replica-never-answered"),
    ],
)
def test_why_no_replica(setup: str, why: NoReplica) -> None:
    registry = registry_for("a", "b")
    a, b = registry.replicas()
    make_healthy(a, "other")
    if setup == "all-known-none-serves":
        make_healthy(b, "other2")
    elif setup == "server-unhealthy":
        make_healthy(b, "m")
        b.state = ReplicaState.UNHEALTHY
    assert registry.pick("m") is why


def test_reconcile_keeps_unchanged_replaces_changed_retires_removed() -> None:
    store = SettingsStore(Settings(replicas=replica_settings("a", "b", "c")))
    registry = ReplicaRegistry(store)
    a, b, c = registry.replicas()
    a.outstanding = 3
    make_healthy(a)
    with registry.lease(b):
        changed_c = ReplicaSettings(name="c", url="http://127.0.0.1:7777")
        store.swap(
            Settings(
                replicas=[replica_settings("a")[0], changed_c, ReplicaSettings(name="d", url="http://h:1")]
            )
        )

        names = [r.name for r in registry.replicas()]
        assert names == ["a", "c", "d"]
        assert registry.get("a") is a
        assert a.outstanding == 3
        assert a.state == H
        assert registry.get("c") is not c
        assert c.retired
        assert b.retired
        assert registry.draining() == [b]
        assert [d["state"] for d in registry.describe()][-1] == "draining"
    assert registry.draining() == []  # its last request ended


def test_retired_replicas_are_never_picked_and_ignore_failures() -> None:
    store = SettingsStore(Settings(replicas=replica_settings("a", "b")))
    registry = ReplicaRegistry(store)
    a, b = registry.replicas()
    make_healthy(a)
    make_healthy(b)
    store.swap(Settings(replicas=replica_settings("a")))
    assert {pick_name(registry, "m") for _ in range(3)} == {"a"}
    assert registry.report_failure(b, "gone") is None


def test_closed_registry_stops_following_the_store() -> None:
    store = SettingsStore(Settings(replicas=replica_settings("a")))
    registry = ReplicaRegistry(store)
    registry.close()
    store.swap(Settings(replicas=replica_settings("a", "b")))
    assert [r.name for r in registry.replicas()] == ["a"]


# -- engines, overload back-off and outlier ejection ---------------------------------------------


def test_pick_with_an_engine_only_among_replicas_running_it() -> None:
    store = SettingsStore(
        Settings(
            replicas=[
                ReplicaSettings(name="v", url="http://127.0.0.1:9000", backend="vllm"),
                ReplicaSettings(name="t", url="http://127.0.0.1:9001", backend="tgi"),
                ReplicaSettings(name="a", url="http://127.0.0.1:9002", backend="auto"),
            ]
        )
    )
    registry = ReplicaRegistry(store)
    v, t, a = registry.replicas()
    for replica in (v, t, a):
        make_healthy(replica, "m")

    assert {registry.pick("m", engine="tgi") for _ in range(4)} == {t}
    assert registry.engine_models("tgi") == ["m"]
    assert a.engine is None, "auto: unknown until detected"
    a.detected_engine = "tgi"
    assert {registry.pick("m", engine="tgi") for _ in range(4)} == {t, a}
    assert registry.pick("m", engine="sglang") is NoReplica.NONE_HEALTHY


def test_saturated_replicas_are_routed_around_until_their_back_off_ends() -> None:
    registry = registry_for("a", "b")
    a, b = registry.replicas()
    make_healthy(a)
    make_healthy(b)

    registry.saturate(a, now=100.0, back_off_s=2.0, why="answered 429")
    assert [registry.pick("m", now=101.0) for _ in range(3)] == [b, b, b]
    registry.saturate(b, now=101.0, back_off_s=5.0, why="answered 429")
    assert registry.pick("m", now=101.5) is NoReplica.SATURATED
    assert registry.pick("m", now=102.5) is a, "a's back-off ended"
    registry.saturate(a, now=102.5, back_off_s=0.5, why="again")
    assert a.saturated_until == 103.0


def test_timeouts_in_a_row_eject_a_replica_that_health_checks_cannot_bring_back() -> None:
    health = HealthSettings(eject_after_timeouts=2, eject_s=30.0, healthy_after=1)
    store = SettingsStore(Settings(replicas=replica_settings("r"), health=health))
    registry = ReplicaRegistry(store)
    (r,) = registry.replicas()
    make_healthy(r)

    assert registry.report_timeout(r, "timed out") is None, "one timeout is not a streak"
    registry.report_success(r)
    assert registry.report_timeout(r, "timed out") is None, "a success ended the streak"
    assert registry.report_timeout(r, "timed out") == U
    assert "ejected for 30 s" in (r.last_error or "")
    assert r.record(True, health) is None, "ejected: a good /health proves nothing yet"
    assert r.state == U
    r.ejected_until = 0.0  # the ejection ran out
    assert r.record(True, health) == H
    # The next ejection in a row (no answer in between) lasts twice as long: 60 s, the cap.
    registry.report_timeout(r, "t")
    registry.report_timeout(r, "t")
    assert r.ejections == 2
    assert 50.0 < r.ejected_until - time.monotonic() <= 60.0
    assert "ejected for 60 s" in (r.last_error or "")
