"""Response shapes (keys and JSON types, not values) of a real vLLM, for the emulator to imitate.

The e2e contract test records what a real vLLM 0.32.0 answers into
``tests/e2e/data/vllm-0.32.0-shapes.json``; a test that needs no vLLM can load that file
(:func:`load_shapes`), compute the same shapes from the emulator with :func:`observe_http`,
:func:`shape_of` and :func:`sse_summary`, and compare them with :func:`diff_shapes`.

Pure Python and the standard library only: importable from any test.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES_PATH = Path(__file__).resolve().parent / "data" / "vllm-0.32.0-shapes.json"
#: The model name the recorded server served (``--served-model-name``) and the exchanges ask for.
RECORDED_MODEL = "tiny-llama"

#: A shape: a JSON type name ("str", "int", "float", "bool", "null"), a dict of shapes, or a list
#: holding the shape of its first element (``[]`` for an empty list).
Shape = Any

SSE_DATA_PREFIX = b"data: "
SSE_EVENT_SEPARATOR = b"\n\n"
SSE_DONE = b"data: [DONE]"


def shape_of(value: Any) -> Shape:
    """The shape of a decoded JSON value: dict keys sorted, lists reduced to their first element."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return [shape_of(value[0])] if value else []
    if isinstance(value, dict):
        return {key: shape_of(value[key]) for key in sorted(value)}
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def diff_shapes(
    expected: Shape, actual: Shape, path: str = "$", *, allow_extra: bool = False, null_matches: bool = True
) -> list[str]:
    """Differences between two shapes, one line each with its JSON path; ``[]`` when they agree.

    ``allow_extra``: keys present only in ``actual`` are not reported. ``null_matches``: ``"null"``
    on either side matches any shape (vLLM sends ``null`` for optional fields it did not fill).
    An empty list on either side matches any list.
    """
    if expected == actual or (null_matches and "null" in (expected, actual)):
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{path}.{k}: missing" for k in expected if k not in actual]
        if not allow_extra:
            out += [f"{path}.{k}: unexpected" for k in actual if k not in expected]
        for key in expected.keys() & actual.keys():
            out += diff_shapes(
                expected[key],
                actual[key],
                f"{path}.{key}",
                allow_extra=allow_extra,
                null_matches=null_matches,
            )
        return sorted(out)
    if isinstance(expected, list) and isinstance(actual, list):
        if not expected or not actual:
            return []
        return diff_shapes(
            expected[0], actual[0], f"{path}[0]", allow_extra=allow_extra, null_matches=null_matches
        )
    return [f"{path}: expected {json.dumps(expected)}, got {json.dumps(actual)}"]


def sse_events(body: bytes) -> list[bytes]:
    """Split an SSE body into its events (each without the blank-line separator).

    Raises ``ValueError`` when the body does not end with a separator.
    """
    if not body.endswith(SSE_EVENT_SEPARATOR):
        raise ValueError(f"SSE body does not end with a blank line: {body[-40:]!r}")
    return body[: -len(SSE_EVENT_SEPARATOR)].split(SSE_EVENT_SEPARATOR)


def chunk_kind(chunk: dict[str, Any]) -> str:
    """Name a streamed chunk: ``usage`` (choices empty), ``finish``, ``role`` or ``content``."""
    choices = chunk.get("choices")
    if choices == []:
        return "usage"
    first = choices[0] if isinstance(choices, list) and choices else {}
    if first.get("finish_reason") is not None:
        return "finish"
    if "role" in (first.get("delta") or {}):
        return "role"
    return "content"


def collapse(kinds: list[str]) -> list[str]:
    """Collapse runs of a repeated kind into ``kind+`` (``a a a b`` -> ``a+ b``)."""
    out: list[str] = []
    for kind in kinds:
        if out and out[-1].rstrip("+") == kind:
            out[-1] = kind + "+"
        else:
            out.append(kind)
    return out


def sse_summary(body: bytes) -> dict[str, Any]:
    """The framing and chunk shapes of an OpenAI-style SSE body.

    Returns ``{"sequence": [...], "chunks": {kind: shape}, "framing_ok": bool, "done_last": bool}``.
    ``framing_ok`` means every event is exactly one ``data: <payload>`` line; ``done_last`` that
    the last event is ``data: [DONE]`` and no other is. A kind whose chunks differ in shape is
    recorded as the list of its distinct shapes.
    """
    events = sse_events(body)
    framing_ok = all(e.startswith(SSE_DATA_PREFIX) and b"\n" not in e and b"\r" not in e for e in events)
    done_last = bool(events) and events[-1] == SSE_DONE and SSE_DONE not in events[:-1]
    kinds: list[str] = []
    shapes: dict[str, list[Shape]] = {}
    for event in events:
        if event == SSE_DONE:
            kinds.append("[DONE]")
            continue
        chunk = json.loads(event[len(SSE_DATA_PREFIX) :])
        kind = chunk_kind(chunk)
        kinds.append(kind)
        seen = shapes.setdefault(kind, [])
        if shape_of(chunk) not in seen:
            seen.append(shape_of(chunk))
    return {
        "sequence": collapse(kinds),
        "chunks": {k: v[0] if len(v) == 1 else v for k, v in sorted(shapes.items())},
        "framing_ok": framing_ok,
        "done_last": done_last,
    }


@dataclass(frozen=True)
class Exchange:
    """One named request to an OpenAI-compatible server (``body`` is sent verbatim)."""

    name: str
    method: str
    path: str
    body: bytes | None = None

    @property
    def streams(self) -> bool:
        """True when the body is a JSON object asking for ``"stream": true``."""
        try:
            decoded = json.loads(self.body) if self.body is not None else None
        except ValueError:
            return False
        return isinstance(decoded, dict) and decoded.get("stream") is True


@dataclass(frozen=True)
class Observation:
    """What a server answered to one :class:`Exchange`."""

    status: int
    content_type: str | None
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


#: Keeps the random model off its four special ids (``<unk> <s> </s> <pad>``): they decode to "",
#: and a final chunk with no text has another shape (vLLM leaves ``delta.content`` out).
NO_SPECIAL_TOKENS = {"logit_bias": {str(token_id): -100 for token_id in range(4)}}


def chat_body(**fields: Any) -> bytes:
    """A chat completion request body for the served model, with ``fields`` added."""
    base: dict[str, Any] = {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": "Hello there"}]}
    return json.dumps({**base, **NO_SPECIAL_TOKENS, **fields}).encode()


def completion_body(**fields: Any) -> bytes:
    """A text completion request body for the served model, with ``fields`` added."""
    return json.dumps(
        {"model": RECORDED_MODEL, "prompt": "Hello there", **NO_SPECIAL_TOKENS, **fields}
    ).encode()


_USAGE = {"stream": True, "stream_options": {"include_usage": True}}

#: The exchanges recorded from the real vLLM (served as ``tiny-llama`` with max_model_len 1024).
EXCHANGES: tuple[Exchange, ...] = (
    Exchange("health", "GET", "/health"),
    Exchange("version", "GET", "/version"),
    Exchange("models", "GET", "/v1/models"),
    Exchange("chat", "POST", "/v1/chat/completions", chat_body(max_tokens=8, ignore_eos=True)),
    Exchange(
        "chat_stream_usage",
        "POST",
        "/v1/chat/completions",
        chat_body(max_tokens=8, ignore_eos=True, **_USAGE),
    ),
    Exchange(
        "chat_stream", "POST", "/v1/chat/completions", chat_body(max_tokens=8, ignore_eos=True, stream=True)
    ),
    Exchange("completion", "POST", "/v1/completions", completion_body(max_tokens=8, ignore_eos=True)),
    Exchange(
        "completion_stream_usage",
        "POST",
        "/v1/completions",
        completion_body(max_tokens=8, ignore_eos=True, **_USAGE),
    ),
    Exchange(
        "error_unknown_model", "POST", "/v1/chat/completions", chat_body(model="no-such-model", max_tokens=8)
    ),
    Exchange(
        "error_max_tokens_over_max_model_len", "POST", "/v1/chat/completions", chat_body(max_tokens=2000)
    ),
    Exchange("error_invalid_json", "POST", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": ['),
    # Within max_model_len alone but not with the prompt: vLLM answers 200 and stops at the limit.
    Exchange(
        "prompt_plus_max_tokens_over_max_model_len",
        "POST",
        "/v1/chat/completions",
        chat_body(max_tokens=1020, ignore_eos=True),
    ),
)


def with_model(exchange: Exchange, model: str) -> Exchange:
    """``exchange`` asking for ``model`` wherever it asks for :data:`RECORDED_MODEL`.

    For replaying the exchanges against a server with another served name. The body is edited as
    bytes, so the one that is not valid JSON is retargeted too; other model names are kept.
    """
    if exchange.body is None:
        return exchange
    old = b'"model": ' + json.dumps(RECORDED_MODEL).encode()
    new = b'"model": ' + json.dumps(model).encode()
    return dataclasses.replace(exchange, body=exchange.body.replace(old, new))


def diff_entries(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Differences between two :func:`describe` entries, the request itself left out.

    Status, content type and body or SSE shapes go through :func:`diff_shapes` with
    ``null_matches=False`` (a null where the other side has a value is a difference); the SSE chunk
    order is compared whole, since :func:`diff_shapes` looks at a list's first element only.
    """
    drop = {"request"}
    out = diff_shapes(
        {k: v for k, v in expected.items() if k not in drop},
        {k: v for k, v in actual.items() if k not in drop},
        null_matches=False,
    )
    want = expected.get("sse", {}).get("sequence")
    got = actual.get("sse", {}).get("sequence")
    if want is not None and got is not None and want != got:
        out.append(f"$.sse.sequence: expected {json.dumps(want)}, got {json.dumps(got)}")
    return sorted(set(out))


def observe_http(base_url: str, exchange: Exchange, timeout_s: float = 60.0) -> Observation:
    """Send ``exchange`` to ``base_url`` with urllib and return the status, type and whole body."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(base_url + exchange.path, data=exchange.body, method=exchange.method)
    if exchange.body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return Observation(resp.status, resp.headers.get("Content-Type"), resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return Observation(err.code, err.headers.get("Content-Type"), err.read())


def describe(exchange: Exchange, seen: Observation) -> dict[str, Any]:
    """The recorded entry of one exchange: request, status, content type and body shape."""
    entry: dict[str, Any] = {
        "request": {
            "method": exchange.method,
            "path": exchange.path,
            "body": exchange.body.decode() if exchange.body is not None else None,
        },
        "status": seen.status,
        "content_type": seen.content_type,
    }
    if exchange.streams and seen.status == 200:
        entry["sse"] = sse_summary(seen.body)
    elif seen.body:
        entry["body"] = shape_of(seen.json())
    else:
        entry["body"] = None
    return entry


def metric_families(text: str) -> dict[str, dict[str, Any]]:
    """``{family: {"type": ..., "labels": [...]}}`` for the ``vllm:`` families of a scrape.

    Names are as prometheus_client's text parser reports them (counters lose ``_total``);
    ``*_created`` families are left out; ``labels`` excludes ``le`` and ``quantile``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels = {k for s in family.samples for k in s.labels} - {"le", "quantile"}
        out[family.name] = {"type": family.type, "labels": sorted(labels)}
    return dict(sorted(out.items()))


def load_shapes(path: Path = SHAPES_PATH) -> dict[str, Any]:
    """The recorded shapes: ``{"vllm_version", "server", "exchanges": {name: entry}, "metrics"}``."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data
