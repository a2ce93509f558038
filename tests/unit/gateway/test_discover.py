"""What `sluice serve --replica URL` asks a replica before it starts (``gateway.replicas.discover``).

Real aiohttp replicas (the unit suite's ``FakeReplica``): a vLLM-like one names its engine on
``/metrics`` and its model in ``/v1/models``; a replica behind ``--api-key`` is asked with its key
(``api_key_env``) and reports the 401 without it; one that does not answer is configured ``auto``.
"""

from __future__ import annotations

import pytest

from gateway.config.settings import Settings
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.discover import discover_all
from tests.unit.gateway.conftest import StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica
from tests.unit.gateway.test_replica_auth import KEY, KeyedReplica

VLLM_METRICS = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"


def _settings(*replicas: ReplicaSettings) -> Settings:
    return Settings(replicas=list(replicas))


async def test_a_vllm_replica_names_its_engine_model_and_context(start_replica: StartReplica) -> None:
    replica = FakeReplica(
        metrics_text=VLLM_METRICS,
        models=[{"id": "llama", "root": "/models/Meta-Llama-3-8B-Instruct", "max_model_len": 8192}],
    )
    _, url = await start_replica(replica)

    (found,) = await discover_all(_settings(ReplicaSettings(name="a", url=url, backend="auto")))

    assert found.error is None
    assert found.engine == "vllm"
    assert {card.id: card.max_model_len for card in found.models.values()} == {"llama": 8192}
    assert found.hardware.model == "Meta-Llama-3-8B-Instruct"  # the root's last part, in the catalogue
    assert found.hardware.gpu is None
    entry = found.settings()
    assert (entry.name, entry.url, entry.backend) == ("a", url, "vllm")
    assert (
        "vllm, serving llama (max_model_len 8192); hardware: model Meta-Llama-3-8B-Instruct"
        in found.describe()
    )


async def test_a_keyed_replica_is_asked_with_its_key(
    start_replica: StartReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_TEST_REPLICA_KEY", KEY)
    _, url = await start_replica(KeyedReplica(metrics_text=VLLM_METRICS))
    _, other_url = await start_replica(KeyedReplica(metrics_text=VLLM_METRICS))
    keyed = ReplicaSettings(name="k", url=url, backend="auto", api_key_env="SLUICE_TEST_REPLICA_KEY")
    bare = ReplicaSettings(name="b", url=other_url, backend="auto")

    with_key, without = await discover_all(_settings(keyed, bare))

    assert with_key.error is None
    assert list(with_key.models) == [MODEL]
    assert with_key.engine == "vllm"
    assert with_key.settings().api_key_env == "SLUICE_TEST_REPLICA_KEY"
    assert without.error == "/v1/models answered 401"


async def test_a_replica_that_does_not_answer_is_configured_auto() -> None:
    (found,) = await discover_all(_settings(ReplicaSettings(name="gone", url="http://127.0.0.1:1")))

    assert found.error is not None
    assert found.engine is None
    assert found.settings().backend == "auto"
    assert found.describe().startswith("not reachable now (/v1/models failed:")
