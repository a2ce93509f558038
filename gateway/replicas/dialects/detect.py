"""Which engine serves a replica, from what it answers: ``backend: auto``.

Pure functions: ``detect_from_samples`` picks the dialect whose prefix (``vllm:``, ``tgi_``,
``sglang:``) most sample names carry; when ``/metrics`` says nothing, ``engine_from_info`` reads
TGI's ``GET /info`` or SGLang's ``GET /get_server_info``. The scraper does the requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from gateway.replicas.dialects.base import Samples

#: The configured value that asks for detection.
AUTO: Final = "auto"

#: Info endpoints to probe, in order, with the engine each one identifies.
INFO_PATHS: Final = (("tgi", "/info"), ("sglang", "/get_server_info"))


def detect_from_samples(samples: Samples, prefixes: Mapping[str, str]) -> str | None:
    """The dialect (``name -> metric prefix``) whose prefix most sample names start with.

    ``None`` when no name carries any of the prefixes (the process/python families every server
    has say nothing about the engine).
    """
    return detect_from_names(samples.names(), prefixes)


def detect_from_names(names: Iterable[str], prefixes: Mapping[str, str]) -> str | None:
    """As ``detect_from_samples``, over bare metric or sample names."""
    counts = dict.fromkeys(prefixes, 0)
    for name in names:
        for dialect, prefix in prefixes.items():
            if name.startswith(prefix):
                counts[dialect] += 1
    best = max(counts.items(), key=lambda item: item[1], default=None)
    return None if best is None or best[1] == 0 else best[0]


def engine_from_info(engine: str, body: Any) -> bool:
    """True when ``body`` (parsed JSON) is what ``engine``'s info endpoint answers.

    TGI ``/info``: an object with ``max_concurrent_requests`` and a ``router`` naming
    ``text-generation`` (or, before ``router`` existed, ``model_id`` and ``max_total_tokens``).
    SGLang ``/get_server_info``: an object with ``model_path`` and its scheduler or parallelism
    fields (``max_total_num_tokens``, ``tp_size``, ``max_running_requests``).
    """
    if not isinstance(body, dict):
        return False
    if engine == "tgi":
        router = body.get("router")
        if isinstance(router, str):
            return "text-generation" in router
        return {"model_id", "max_concurrent_requests", "max_total_tokens"} <= body.keys()
    if engine == "sglang":
        return "model_path" in body and bool(
            {"max_total_num_tokens", "tp_size", "max_running_requests"} & body.keys()
        )
    return False
