"""What a replica says about itself, asked once: for ``sluice serve --replica URL`` and
``sluice config``, which build a configuration from the URLs alone.

``discover(session, replica, timeout_s)`` asks what the running gateway learns anyway, the same way:
the engine (``/metrics`` names, else TGI's ``/info`` or SGLang's ``/get_server_info``: the
``backend: auto`` detection of ``gateway.replicas.dialects``), the models with their
``max_model_len`` (``/v1/models``, completed from the info endpoint where the list omits it: the
health checker's ``fetch_models``). It adds the hardware facts an engine exposes, for the
predictor (``HardwareSettings``): the model, when the predictor's catalogue knows it (from the
card's ``id`` or ``root``), and SGLang's ``tp_size``, ``max_running_requests`` and
``chunked_prefill_size``. No engine exposes its GPU, and vLLM not its scheduler limits: those
stay unset (the step model is learned from ``/metrics``) until the operator writes them.

Nothing here raises for a replica that does not answer: ``Discovered.error`` says why, and the
replica is configured with ``backend: auto`` so the gateway detects it once it is up. A replica
whose settings name ``api_key_env`` is asked with its key, as the gateway asks it
(``gateway.replicas.auth``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from pydantic import ValidationError
from yarl import URL

from gateway.api.responses import ModelCard
from gateway.config.section import HF_ID
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.replicas.auth import replica_auth
from gateway.replicas.config import HardwareSettings, ReplicaSettings
from gateway.replicas.dialects import AUTO, INFO_PATHS, detect, engine_from_info
from gateway.replicas.exposition import ExpositionError, parse_exposition
from gateway.replicas.health import fetch_models
from gateway.replicas.registry import Replica
from predictor.model import lookup_model

__all__ = ["PROBE_TIMEOUT_S", "Discovered", "discover", "discover_all", "replica_names"]

#: Seconds each request to a replica may take while discovering it.
PROBE_TIMEOUT_S: Final = 3.0

#: Characters a replica name may not hold (``gateway.config.section.Name``).
_NOT_IN_NAME: Final = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class Discovered:
    """One replica as it described itself.

    ``replica``: the entry it was asked as (name, URL, key). ``engine``: ``vllm``, ``tgi`` or
    ``sglang``; ``None`` when it could not be told (the replica is then configured ``auto``).
    ``models``: its ``/v1/models`` cards by id (empty when it did not answer). ``hardware``: the
    facts it exposes (unset keys: not exposed). ``error``: why ``/v1/models`` could not be read,
    ``None`` when it was.
    """

    replica: ReplicaSettings
    engine: str | None = None
    models: Mapping[str, ModelCard] = field(default_factory=dict)
    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    error: str | None = None

    @property
    def url(self) -> str:
        """The base URL it was asked at."""
        return self.replica.url

    def settings(self) -> ReplicaSettings:
        """Its ``replicas:`` entry: as asked, with the detected engine (else ``auto``) and hardware."""
        backend = self.engine or AUTO
        return ReplicaSettings.model_validate(
            {**self.replica.model_dump(), "backend": backend, "hardware": self.hardware}
        )

    def describe(self) -> str:
        """One line for a log or a YAML comment: engine, models and context lengths, or the error."""
        if self.error is not None:
            return f"not reachable now ({self.error}); engine and models detected once it answers"
        models = ", ".join(
            f"{card.id} (max_model_len {card.max_model_len or 'unknown'})" for card in self.models.values()
        )
        known = [f"{key} {value}" for key, value in self.hardware.model_dump(exclude_defaults=True).items()]
        facts = f"; hardware: {', '.join(known)}" if known else ""
        return f"{self.engine or 'engine not detected'}, serving {models or 'no model'}{facts}"


async def discover(
    session: aiohttp.ClientSession, replica: ReplicaSettings, timeout_s: float = PROBE_TIMEOUT_S
) -> Discovered:
    """Ask ``replica`` (its URL is the base URL, no ``/v1``) what it runs; never raises for it."""
    limit = aiohttp.ClientTimeout(total=timeout_s)
    base = replica.url.rstrip("/")
    engine, info = await _engine(session, base, limit)
    probe = Replica(replica.model_copy(update={"backend": AUTO}))
    probe.detected_engine = engine
    models = await fetch_models(session, probe, timeout_s)
    if isinstance(models, str):
        return Discovered(replica, engine, error=models)
    if engine == "sglang" and info is None:
        info = await _json(session, base + "/get_server_info", limit)
    return Discovered(replica, engine, models, _hardware(engine, models, info))


async def discover_all(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> list[Discovered]:
    """``discover`` every entry of ``settings.replicas`` at once, in one client session that sends
    each its own key; results in configuration order."""
    middleware = replica_auth(SettingsStore(settings))
    async with aiohttp.ClientSession(middlewares=(middleware,)) as session:
        return list(await asyncio.gather(*(discover(session, r, timeout_s) for r in settings.replicas)))


def replica_names(urls: Sequence[str]) -> list[str]:
    """A distinct replica name for each URL: its host, with the port when hosts repeat, with the
    position when both do; characters a name may not hold become ``-``."""
    parsed = [URL(url) for url in urls]
    hosts = [_name_part(u.host or "") or f"replica-{i}" for i, u in enumerate(parsed)]
    names = [
        h if hosts.count(h) == 1 else f"{h}-{u.explicit_port or u.port}"
        for h, u in zip(hosts, parsed, strict=True)
    ]
    return [n if names.count(n) == 1 else f"{n}-{i}"[-63:] for i, n in enumerate(names)]


def _name_part(text: str) -> str:
    return _NOT_IN_NAME.sub("-", text).strip("-_.")[:56]


async def _engine(
    session: aiohttp.ClientSession, base: str, limit: aiohttp.ClientTimeout
) -> tuple[str | None, Any]:
    """The engine from ``/metrics``, else from an info endpoint (with that endpoint's body)."""
    text = await _text(session, base + "/metrics", limit)
    if text is not None:
        try:
            found = detect(parse_exposition(text))
        except ExpositionError:
            found = None
        if found is not None:
            return found, None
    for engine, path in INFO_PATHS:
        body = await _json(session, base + path, limit)
        if engine_from_info(engine, body):
            return engine, body
    return None, None


async def _text(session: aiohttp.ClientSession, url: str, limit: aiohttp.ClientTimeout) -> str | None:
    try:
        async with session.get(url, timeout=limit) as resp:
            return await resp.text(errors="replace") if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


async def _json(session: aiohttp.ClientSession, url: str, limit: aiohttp.ClientTimeout) -> Any:
    try:
        async with session.get(url, timeout=limit) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def _hardware(engine: str | None, models: Mapping[str, ModelCard], info: Any) -> HardwareSettings:
    """The facts the replica exposes; a combination the settings refuse keeps the model only."""
    facts: dict[str, Any] = {}
    model = _catalogue_model(models)
    if model is not None:
        facts["model"] = model
    if engine == "sglang" and isinstance(info, dict):
        for key, source in (
            ("tensor_parallel", "tp_size"),
            ("max_num_seqs", "max_running_requests"),
            ("max_num_batched_tokens", "chunked_prefill_size"),
        ):
            value = info.get(source)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                facts[key] = value
    try:
        return HardwareSettings.model_validate(facts)
    except ValidationError:
        return HardwareSettings.model_validate({"model": model} if model else {})


def _catalogue_model(models: Mapping[str, ModelCard]) -> str | None:
    """The first card's model as the predictor's catalogue knows it: its ``id`` or ``root`` (a
    Hugging Face id as it is; a path by its last part); ``None`` when the catalogue knows neither."""
    card = next(iter(models.values()), None)
    if card is None:
        return None
    for name in (card.id, card.card.get("root")):
        if not isinstance(name, str) or not name.strip():
            continue
        candidate = name if HF_ID.match(name) else name.rstrip("/").rsplit("/", 1)[-1]
        if lookup_model(candidate) is not None:
            return candidate
    return None
