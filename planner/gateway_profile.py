"""A replica profile from a running gateway: the step model its predictor fitted, read from
``GET /sluice/v1/replicas`` (the admin API), priced by the emulator in place of the per-layer table.

``fetch_replicas`` does the one GET (stdlib ``urllib``, a timeout, the admin token as a bearer
header); ``profile_from_gateway`` picks a replica's fit and facts from the answer and builds a
``Profile`` whose ``step_model`` prices every step. What the answer does not say (GPU and model
facts outside the predictor's catalogues, KV capacity before a scrape, ``max_model_len``, output
lengths) comes from the flags or the template profile, and is listed in ``GatewayProfile.assumed``.
Every problem (unreachable, refused, unknown replica, no valid fit, an unexpected body) raises
``GatewayProfileError`` with a message for the operator.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from predictor import ModelSource, StepModel, StepParams
from predictor.hardware import lookup_gpu
from predictor.model import lookup_model
from simulator.profile import GpuFacts, ModelFacts, Profile, StepModelParams, kv_blocks_that_fit

__all__ = [
    "ADMIN_PATH",
    "GatewayProfile",
    "GatewayProfileError",
    "fetch_replicas",
    "profile_from_gateway",
    "replicas_url",
]

#: The admin endpoint that lists each replica's facts, fit and last snapshot.
ADMIN_PATH = "/sluice/v1/replicas"
DEFAULT_TIMEOUT_S = 10.0


class GatewayProfileError(ValueError):
    """The gateway's step model could not be read or used; the message says why."""


@dataclass(frozen=True, slots=True)
class GatewayProfile:
    """A profile built from a gateway's fit: the ``profile`` (its ``step_model`` set), the fitted
    ``step_model`` as the predictor holds it, ``source`` (one line naming the gateway, the replica
    and the fit error) and ``assumed`` (one line per value the gateway did not give)."""

    profile: Profile
    step_model: StepModel
    source: str
    assumed: tuple[str, ...]


def replicas_url(url: str) -> str:
    """``url`` itself when it names the admin endpoint, else the endpoint under it."""
    stripped = url.rstrip("/")
    return stripped if stripped.endswith(ADMIN_PATH) else stripped + ADMIN_PATH


def fetch_replicas(
    url: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """``GET`` the gateway's replica view at ``url`` (a gateway or admin-listener base URL, or the
    endpoint itself) with ``Authorization: Bearer token`` when a token is given; the parsed JSON."""
    target = replicas_url(url)
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(target, headers=headers, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            hint = (
                "the token was refused"
                if token
                else "the admin API needs a token: put it in an environment variable and name it with "
                "--admin-token-env"
            )
            raise GatewayProfileError(f"gateway {target} answered {exc.code}: {hint}") from exc
        raise GatewayProfileError(f"gateway {target} answered {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise GatewayProfileError(f"cannot reach gateway {target}: {reason}") from exc
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise GatewayProfileError(f"gateway {target}: the answer is not JSON") from exc
    if not isinstance(body, dict):
        raise GatewayProfileError(f"gateway {target}: expected a JSON object")
    return body


def _step_model(fit: Mapping[str, Any], where: str) -> StepModel:
    """The predictor's ``StepModel`` from a fit's ``params`` (the admin view's coefficient names)."""
    params = fit.get("params")
    keys = ("base", "tokens_to_knee", "decode_seqs", "tokens_past_knee", "kv_tokens", "attn_pairs")
    if not isinstance(params, dict) or any(k not in params for k in (*keys, "knee_tokens")):
        raise GatewayProfileError(f"{where}: the fit has no step-model parameters")
    try:
        values = [float(params[k]) for k in keys]
        knee = float(params["knee_tokens"])
        alpha = float(params.get("attn_pair_tokens") or 0.0)
    except (TypeError, ValueError) as exc:
        raise GatewayProfileError(f"{where}: step-model parameters are not numbers") from exc
    if not all(math.isfinite(v) and v >= 0 for v in (*values, knee)):
        raise GatewayProfileError(f"{where}: step-model parameters must be finite and >= 0: {params}")
    base, to_knee, decode, past_knee, kv, pairs = values
    params_ = StepParams(base, to_knee, decode, past_knee, kv, pairs, knee, alpha)
    try:
        source = ModelSource(str(fit.get("source", "fitted")))
    except ValueError:
        source = ModelSource.FITTED
    return StepModel(params_, source=source, valid=True)


def _pick(body: Mapping[str, Any], replica: str | None, url: str) -> tuple[str, Mapping[str, Any]]:
    prediction = body.get("prediction")
    if not isinstance(prediction, dict):
        raise GatewayProfileError(f"gateway {url}: no 'prediction' section in the replica view")
    if "error" in prediction:
        raise GatewayProfileError(f"gateway {url}: its prediction service failed: {prediction['error']}")
    described = prediction.get("replicas")
    if not isinstance(described, dict) or not described:
        raise GatewayProfileError(f"gateway {url}: no replica has a step model")
    names = ", ".join(sorted(described))
    if replica is None:
        if len(described) > 1:
            raise GatewayProfileError(
                f"gateway {url} has several replicas ({names}): pick one with --replica"
            )
        replica = next(iter(described))
    entry = described.get(replica)
    if not isinstance(entry, dict):
        raise GatewayProfileError(f"gateway {url}: no replica {replica!r} (it has: {names})")
    return replica, entry


def _metrics(body: Mapping[str, Any], replica: str) -> Mapping[str, Any]:
    """The last snapshot summary of ``replica`` in the view's ``replicas`` list ({} when none)."""
    for entry in body.get("replicas") or ():
        if isinstance(entry, dict) and entry.get("name") == replica:
            metrics = entry.get("metrics")
            return metrics if isinstance(metrics, dict) else {}
    return {}


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _fit_error(fit: Mapping[str, Any]) -> str:
    mdape = fit.get("mdape")
    kept = fit.get("observations_kept")
    error = "fit error unknown (no observation yet)" if mdape is None else f"fit error (MdAPE) {mdape:.1%}"
    return error + (f" over {kept} observations" if isinstance(kept, int) else "")


def profile_from_gateway(
    body: Mapping[str, Any],
    url: str,
    template: Profile,
    *,
    replica: str | None = None,
    kv_capacity_tokens: int | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
) -> GatewayProfile:
    """The profile of ``replica`` (``None``: the gateway's only replica) in the replica view
    ``body`` fetched from ``url``. The step model and engine limits are the gateway's; KV capacity
    and block size the flags', else the replica's last scrape's; ``max_model_len`` the flag's, else
    the facts'. GPU and model facts come from the predictor's catalogues for the names the gateway
    has, else from ``template``, as does anything else still missing (see ``assumed``)."""
    name, entry = _pick(body, replica, url)
    where = f"gateway {url}, replica {name!r}"
    fit = entry.get("fit")
    if not isinstance(fit, dict):
        raise GatewayProfileError(f"{where}: no fit in the replica view")
    if not fit.get("valid"):
        reason = fit.get("reason") or "not fitted yet"
        raise GatewayProfileError(f"{where}: no valid step model ({reason}); send it traffic, then retry")
    model = _step_model(fit, where)
    facts = entry.get("facts") if isinstance(entry.get("facts"), dict) else {}
    assert isinstance(facts, dict)
    metrics = _metrics(body, name)
    assumed: list[str] = []
    data = template.model_dump()
    tp = _positive_int(facts.get("tensor_parallel")) or template.tensor_parallel

    gpu_name = facts.get("gpu")
    spec = lookup_gpu(gpu_name) if isinstance(gpu_name, str) else None
    if isinstance(gpu_name, str) and spec is not None and spec.known and spec.memory_bytes > 0:
        data["gpu"] = GpuFacts(
            name=gpu_name,
            memory_bytes=int(spec.memory_bytes),
            hbm_bandwidth_Bps=spec.hbm_bandwidth,
            peak_bf16_flops=spec.peak_bf16_flops,
            allreduce_bus_bandwidth_Bps=template.gpu.allreduce_bus_bandwidth_Bps,
            allreduce_latency_s=template.gpu.allreduce_latency_s,
        ).model_dump()
    else:
        assumed.append(
            f"GPU {template.gpu.name} (from profile {template.name}; the gateway's is {gpu_name!r})"
        )
    model_name = facts.get("model")
    arch = lookup_model(model_name) if isinstance(model_name, str) else None
    if isinstance(model_name, str) and arch is not None:
        data["served_model_name"] = model_name
        data["model"] = ModelFacts(
            name=arch.name,
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            num_params=int(arch.num_params),
            dtype_bytes=max(1, round(arch.kv_dtype_bytes)),
        ).model_dump()
    else:
        assumed.append(
            f"model {template.model.name} (from profile {template.name}; the gateway's is {model_name!r})"
        )

    engine = dict(data["engine"])
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        value = _positive_int(facts.get(key))
        if value is None:
            assumed.append(f"{key}={engine[key]} (from profile {template.name})")
        else:
            engine[key] = value
    given_len = max_model_len or _positive_int(facts.get("max_model_len"))
    if given_len is None:
        assumed.append(f"max_model_len={engine['max_model_len']} (from profile {template.name})")
    else:
        engine["max_model_len"] = given_len
    given_block = block_size or _positive_int(metrics.get("block_size"))
    if given_block is None:
        assumed.append(f"block_size={engine['block_size']} (from profile {template.name})")
    else:
        engine["block_size"] = given_block
    capacity = kv_capacity_tokens or _positive_int(metrics.get("kv_capacity_tokens"))
    if capacity is not None:
        # The measured capacity sizes the cache; the memory budget only has to hold it.
        engine.update(
            num_gpu_blocks=max(1, capacity // engine["block_size"]),
            gpu_memory_utilization=1.0,
            non_kv_reserve_bytes=0,
        )
    else:
        engine["num_gpu_blocks"] = 1  # sized below, as vLLM would, from memory
    fit_line = _fit_error(fit)
    data.update(
        name=f"gateway-{name}",
        description=f"step model fitted by gateway {url} for replica {name}",
        tensor_parallel=tp,
        engine=engine,
        step_model=StepModelParams(
            base_s=model.params.base_s,
            per_token_s=model.params.per_token_s,
            per_decode_seq_s=model.params.per_decode_seq_s,
            per_compute_token_s=model.params.per_compute_token_s,
            per_kv_token_s=model.params.per_kv_token_s,
            per_attn_pair_s=model.params.per_attn_pair_s,
            knee_tokens=model.params.knee_tokens,
            source=f"gateway {url}, replica {name}",
        ).model_dump(),
    )
    try:
        profile = Profile.model_validate(data)
        if capacity is None:
            blocks = kv_blocks_that_fit(profile)
            if blocks < 1:
                raise GatewayProfileError(f"{where}: the model's weights leave no room for a KV cache")
            profile = profile.with_engine(num_gpu_blocks=blocks)
            assumed.append(
                f"KV capacity {profile.kv_cache_size_tokens:,} tokens (sized from GPU memory at "
                f"gpu_memory_utilization={engine['gpu_memory_utilization']}; no scrape gave it: "
                "--kv-capacity-tokens sets it)"
            )
    except ValidationError as exc:
        raise GatewayProfileError(f"{where}: cannot build a profile from its facts: {exc}") from exc
    source = f"step model fitted by gateway {url} for replica {name} ({fit.get('source', '?')}, {fit_line})"
    return GatewayProfile(profile, model, source, tuple(assumed))
