"""What a tenant's request costs, and the token weights that price it.

Pure numbers (no I/O; the prediction service is only read). ``limits.token_weights`` decides
(``configured_weights``, ``GpuTimeWeights``):

* ``null`` (the default): plain tokens, prompt 1 and output 1 (``PLAIN_WEIGHTS``), as OpenAI's
  TPM counts.
* ``{prompt: x, output: y}``: those two weights, fixed.
* ``{mode: gpu_time, ...}``: a prompt token 1 and an output token its GPU time over a prompt
  token's, per model: its replica group is the replicas serving that model, and the target is
  their step models' ratio at a fixed reference operating point (``reference_prices``: a stated
  decode batch and context, not the live batch), averaged over the group's replicas with a valid
  step model; ``DEFAULT_WEIGHTS`` (VTC's 1 : 2) until one has, and for a model no replica
  serves. Each group's weight in force moves towards its target by at most
  ``max_change_per_minute`` a minute (``GpuTimeWeights``; ``GroupWeights`` keeps one per model),
  so two identical requests within a minute never differ by more than a factor
  ``1 + max_change_per_minute``.

A reservation is settled with the weights it was made with (``gateway.admission.budget.Hold``),
so a change between the two never shifts a tenant's balance. ``fleet_token_weights`` (the
weights at the live batch) stays for the tools that study pricing (``bench.tenancy_cost``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.admission.fairness import TokenWeights
from gateway.limits.config import GpuTimeWeightSettings, LimitsSettings
from gateway.prediction.service import PredictionService
from gateway.replicas.config import ReplicaSettings
from predictor import StepModel
from predictor.step_model import StepBatch

#: Plain tokens: what a tenant's budget counts by default (prompt + output, as OpenAI's TPM).
PLAIN_WEIGHTS: Final = TokenWeights(input=1.0, output=1.0)
#: GPU-time weights until a step model exists: VTC's 1 : 2 (Sheng et al., OSDI 2024).
DEFAULT_WEIGHTS: Final = TokenWeights(input=1.0, output=2.0)
#: The decode step a decode token's GPU time is taken from, until the replica's own batch is
#: observed: this many sequences (at most ``max_num_seqs``) with this many tokens of context each.
DECODE_BATCH_SEQS: Final = 256
DECODE_CONTEXT_TOKENS: Final = 1024
#: Defaults of the engine limits a replica's YAML may leave out (vLLM's, and the predictor's).
DEFAULT_MAX_NUM_SEQS: Final = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = 8192


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """GPU seconds of one prompt (``prefill_s``) and one output token (``decode_s``) on a replica;
    ``context_s``: what each token of the context an output token reads adds to it (its KV read;
    0 when ``decode_s`` is already the price at the batch's mean context)."""

    prefill_s: float
    decode_s: float
    context_s: float = 0.0

    @property
    def ratio(self) -> float:
        """``decode_s / prefill_s``: what ``w_out`` is with ``w_in = 1``."""
        return self.decode_s / self.prefill_s

    @property
    def context_ratio(self) -> float:
        """``context_s / prefill_s``: what ``w_ctx`` is with ``w_in = 1``."""
        return self.context_s / self.prefill_s


def step_model_prices(
    model: StepModel,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    decode_seqs: float | None = None,
    context_tokens: float | None = None,
    prompt_tokens: float | None = None,
) -> TokenPrices | None:
    """A prompt and an output token's GPU seconds per ``model``, at the batch the replica runs.

    A step costs a fixed part whatever it carries (``base``: overheads, reading the weights),
    shared by the sequences it serves, plus what each token and each sequence's attention add.

    * Decode: one step of the decode batch, per sequence: ``t(D decodes, D x C KV tokens) / D``,
      with ``D = decode_seqs`` (the replica's observed output tokens per step; default
      ``min(max_num_seqs, DECODE_BATCH_SEQS)``), at least 1 and at most ``max_num_seqs``, and
      ``C = context_tokens`` KV tokens each (observed; default ``DECODE_CONTEXT_TOKENS``).
    * Prefill: what a full chunk of ``max_num_batched_tokens`` tokens of a fresh prompt adds to
      that step, per token: ``(t(batch + chunk) - t(batch)) / chunk`` (a prompt rides in a step
      that runs anyway: the fixed part is the decodes'), but never less than ``t(batch) / chunk``:
      a full chunk at least doubles a decode step on any real engine (thousands of tokens of
      compute against a few dozen), and a fit whose per-token prefill term is still near zero (a
      replica that has seen few prompts) must not make prompts free and price an output token
      at hundreds of thousands of prompt tokens. The chunk's attention: ``prompt_tokens / 2``
      pairs per token when the replica's mean prompt (``prompt_tokens``) is known, the pairs per
      prompt token the fit itself saw (``predictor.observations.observation_from_window``); a
      fresh prompt filling the chunk (``chunk / 2`` per token) otherwise. The fit cannot tell
      the linear slope from attention when the prompts' lengths do not vary, and only prices at
      the features it was fitted at are what its step times bear out: extrapolating its
      attention coefficient to a longer prompt than the replica runs swings the price.

    ``None`` when the model is not valid or either time is not a positive finite number.
    """
    if not model.valid:
        return None
    cap = float(max(1, max_num_seqs))
    seqs = float(min(max_num_seqs, DECODE_BATCH_SEQS)) if decode_seqs is None else decode_seqs
    seqs = min(max(seqs, 1.0), cap)
    context = DECODE_CONTEXT_TOKENS if context_tokens is None else max(context_tokens, 1.0)
    batch = StepBatch(decode_seqs=seqs, kv_tokens_read=seqs * context)
    step = model.step_time(batch)
    chunk = float(max_num_batched_tokens)
    pairs_per_token = chunk / 2.0 if prompt_tokens is None or prompt_tokens <= 0.0 else prompt_tokens / 2.0
    with_chunk = dataclasses.replace(batch, prefill_tokens=chunk, prefill_attn_pairs=chunk * pairs_per_token)
    prefill = max(model.step_time(with_chunk) - step, step) / chunk
    decode = step / seqs
    if not (math.isfinite(prefill) and math.isfinite(decode) and prefill > 0 and decode > 0):
        return None
    return TokenPrices(prefill_s=prefill, decode_s=decode)


def decode_to_prefill_ratio(
    model: StepModel,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    decode_seqs: float | None = None,
    context_tokens: float | None = None,
) -> float | None:
    """``step_model_prices(...).ratio``: GPU seconds of one decode token over one prefill token,
    per ``model``; ``None`` when it has none."""
    prices = step_model_prices(
        model,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        decode_seqs=decode_seqs,
        context_tokens=context_tokens,
    )
    return None if prices is None else prices.ratio


def replica_prices(
    service: PredictionService, replica: ReplicaSettings, model: StepModel
) -> TokenPrices | None:
    """The GPU seconds of a prompt token, an output token and an output token's context token on
    ``replica``; ``None`` when ``model`` (its step model) gives no prices.

    ``step_model_prices``'s prices at the decode batch ``service`` saw the replica run over its
    latest scrape window (its defaults before one): output tokens per step, KV tokens in use per
    running request, and for the prompt's attention the replica's mean prompt, the point the fit
    was made at. The output token's price is then split (``split_context``) into a part per
    token and a part per token of context it reads (its KV read: the step model's
    ``per_kv_token_s``, or its roofline prior's where the fit left it at 0), so that an output
    token after a 4000-token document costs what it does, not the batch's mean.
    """
    hardware = replica.hardware
    seqs: float | None = None
    context: float | None = None
    prompt: float | None = None
    window = service.latest_window(replica.name)
    if window is not None:
        snapshot, gauges = window
        prompt = snapshot.mean_prompt_tokens_per_request
        steps, output = snapshot.steps_per_s, snapshot.generation_tokens_per_s
        if steps is not None and output is not None and steps > 0.0 and output > 0.0:
            seqs = output / steps
        if gauges.running > 0.0 and gauges.kv_tokens > 0.0:
            context = gauges.kv_tokens / gauges.running
    prices = step_model_prices(
        model,
        max_num_batched_tokens=hardware.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=hardware.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        decode_seqs=seqs,
        context_tokens=context,
        prompt_tokens=prompt,
    )
    if prices is None or window is None:
        return prices
    per_kv = model.params.per_kv_token_s
    if per_kv <= 0.0:
        report = service.report(replica.name)
        per_kv = 0.0 if report is None or report.prior is None else report.prior.per_kv_token_s
    return split_context(prices.decode_s, per_kv, context or 0.0, prices.prefill_s)


def split_context(
    decode_s: float, per_kv_token_s: float, context_tokens: float, prefill_s: float
) -> TokenPrices:
    """``TokenPrices`` with an output token at ``decode_s`` on average over outputs read after
    ``context_tokens`` of context each, of which ``per_kv_token_s`` per context token: the part
    per output token is ``decode_s - per_kv_token_s x context_tokens``. When that would be below
    half of ``decode_s`` (a KV price the window's times do not bear out), no split: the mean
    price per output token, nothing per context token."""
    per_kv = max(per_kv_token_s, 0.0) if math.isfinite(per_kv_token_s) else 0.0
    own = decode_s - per_kv * max(context_tokens, 0.0)
    if own < 0.5 * decode_s:
        return TokenPrices(prefill_s=prefill_s, decode_s=decode_s)
    return TokenPrices(prefill_s=prefill_s, decode_s=own, context_s=per_kv)


def fleet_token_weights(service: PredictionService, replicas: Iterable[ReplicaSettings]) -> TokenWeights:
    """``w_in = 1`` and ``w_out`` = the mean over ``replicas`` with a valid step model in
    ``service`` of their output token's GPU time over their prompt token's, rounded to 0.01;
    ``DEFAULT_WEIGHTS`` when none has one.

    Per replica (``replica_prices``): the step model's prices (``step_model_prices``) at the
    decode batch its engine steps really carried over its latest scrape window (output tokens
    per step, KV tokens in use per running request), not at a nominal one. ``context``
    (``w_ctx``): the mean over the same replicas of their output token's KV read per token of
    context over their prompt token's price, to 3 significant digits.
    """
    ratios: list[float] = []
    contexts: list[float] = []
    for replica in replicas:
        model = service.step_model(replica.name)
        if model is None:
            continue
        prices = replica_prices(service, replica, model)
        if prices is not None:
            ratios.append(prices.ratio)
            contexts.append(prices.context_ratio)
    if not ratios:
        return DEFAULT_WEIGHTS
    output = max(round(sum(ratios) / len(ratios), 2), 0.01)
    return TokenWeights(input=1.0, output=output, context=float(f"{sum(contexts) / len(contexts):.3g}"))


def configured_weights(limits: LimitsSettings) -> TokenWeights | None:
    """The fixed weights ``limits.token_weights`` states: ``PLAIN_WEIGHTS`` when it is null, the
    pinned ``{prompt, output}`` otherwise; ``None`` when GPU-time weighting is on (``{mode:
    gpu_time}``: the weights come from ``GpuTimeWeights``)."""
    pinned = limits.token_weights
    if pinned is None:
        return PLAIN_WEIGHTS
    if isinstance(pinned, GpuTimeWeightSettings):
        return None
    return TokenWeights(input=pinned.prompt, output=pinned.output)


def reference_prices(
    replica: ReplicaSettings, model: StepModel, settings: GpuTimeWeightSettings
) -> TokenPrices | None:
    """``step_model_prices`` of ``replica`` at ``settings``' reference operating point: a decode
    batch of ``reference_batch_seqs`` sequences (at most the replica's ``max_num_seqs``) reading
    ``reference_context_tokens`` tokens of context each, prompts of that many tokens. Whatever
    the replica runs now; ``None`` when ``model`` gives no prices."""
    hardware = replica.hardware
    return step_model_prices(
        model,
        max_num_batched_tokens=hardware.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=hardware.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        decode_seqs=float(settings.reference_batch_seqs),
        context_tokens=float(settings.reference_context_tokens),
        prompt_tokens=float(settings.reference_context_tokens),
    )


def replica_reference_ratio(
    service: PredictionService, replica: ReplicaSettings, settings: GpuTimeWeightSettings
) -> float | None:
    """``reference_prices(...).ratio`` of ``replica`` per its step model in ``service``: an output
    token's GPU time over a prompt token's at the reference point; ``None`` when it has none."""
    model = service.step_model(replica.name)
    prices = None if model is None else reference_prices(replica, model, settings)
    return None if prices is None else prices.ratio


def reference_ratio(
    service: PredictionService, replicas: Iterable[ReplicaSettings], settings: GpuTimeWeightSettings
) -> float | None:
    """The mean over ``replicas`` (one replica group) with a valid step model of
    ``replica_reference_ratio``; ``None`` when none has one."""
    ratios = [r for r in (replica_reference_ratio(service, x, settings) for x in replicas) if r is not None]
    return sum(ratios) / len(ratios) if ratios else None


class GpuTimeWeights:
    """The GPU-time weights in force for one replica group, moving slowly towards its target.

    ``update(target, now)``: ``target`` is the output weight the step models give now
    (``reference_ratio``; ``None``: keep the current one), ``now`` monotonic seconds. The output
    weight is ``DEFAULT_WEIGHTS.output`` until the first target, which it takes as it is (a
    placeholder, not a price, gives way at once); from then on it moves towards each target by
    at most a factor ``(1 + max_change_per_minute) ** (elapsed / 60)`` (compounding: at most
    ``1 + max_change_per_minute`` over any minute). Output weights are rounded to 0.01 and at
    least 0.01."""

    def __init__(self, settings: GpuTimeWeightSettings, now: float) -> None:
        self.settings = settings
        self._output = DEFAULT_WEIGHTS.output
        self._priced = False
        self._at = now
        self._current = DEFAULT_WEIGHTS

    @property
    def current(self) -> TokenWeights:
        """The weights a reservation made now is priced with (the same object until they change)."""
        return self._current

    def update(self, target: float | None, now: float) -> TokenWeights:
        """Move towards ``target`` as far as the time since the last update allows; the weights
        now."""
        elapsed = max(now - self._at, 0.0)
        self._at = now
        if target is None or not math.isfinite(target) or target <= 0.0:
            return self.current
        if not self._priced:
            self._output, self._priced = target, True
        else:
            step = (1.0 + self.settings.max_change_per_minute) ** (elapsed / 60.0)
            self._output = min(max(target, self._output / step), self._output * step)
        output = max(round(self._output, 2), 0.01)
        if output != self._current.output:
            self._current = TokenWeights(input=1.0, output=output)
        return self._current


#: The replicas serving each model, by the model's id (``ReplicaRegistry.model_groups``).
ReplicaGroups = Mapping[str, Sequence[ReplicaSettings]]


class GroupWeights:
    """The GPU-time weights in force per replica group: one ``GpuTimeWeights`` per model, its
    group being the replicas serving that model (a replica serving several models is in each
    of their groups).

    ``refresh(groups, service, now)`` moves every group's weights towards its target
    (``reference_ratio`` over the group's replicas; a group with no replica or no valid step
    model keeps its weights, ``DEFAULT_WEIGHTS`` until its first price). A model seen once keeps
    its weights while it is away (a replica leaving and coming back does not reset its pace);
    only models some replica served are ever kept, never names a client sends.
    ``for_model(model)``: O(1), the group's weights, ``DEFAULT_WEIGHTS`` for a model no replica
    has served. ``fleet``: the mean output weight over the groups served now (what one set of
    weights for every model, as fair share charges, is), ``DEFAULT_WEIGHTS`` when none is."""

    def __init__(self, settings: GpuTimeWeightSettings) -> None:
        self.settings = settings
        self._groups: dict[str, GpuTimeWeights] = {}
        self._served: frozenset[str] = frozenset()
        self._fleet = DEFAULT_WEIGHTS

    def for_model(self, model: str | None) -> TokenWeights:
        """The weights a reservation for ``model`` made now is priced with (``None``: ``fleet``)."""
        if model is None:
            return self._fleet
        found = self._groups.get(model)
        return DEFAULT_WEIGHTS if found is None else found.current

    @property
    def fleet(self) -> TokenWeights:
        """The mean of the served groups' weights (output rounded to 0.01)."""
        return self._fleet

    def by_model(self) -> dict[str, TokenWeights]:
        """The weights in force of every model served now, by model id, sorted."""
        return {model: self._groups[model].current for model in sorted(self._served)}

    def refresh(self, groups: ReplicaGroups, service: PredictionService, now: float) -> None:
        """Move each group's weights towards its step models' target at ``now`` (monotonic
        seconds); each replica's reference price is computed once, whatever its groups."""
        ratios: dict[str, float | None] = {}
        for model, replicas in groups.items():
            found: list[float] = []
            for replica in replicas:
                if replica.name not in ratios:
                    ratios[replica.name] = replica_reference_ratio(service, replica, self.settings)
                ratio = ratios[replica.name]
                if ratio is not None:
                    found.append(ratio)
            weights = self._groups.get(model)
            if weights is None:
                weights = self._groups[model] = GpuTimeWeights(self.settings, now)
            weights.update(sum(found) / len(found) if found else None, now)
        for model in self._groups.keys() - groups.keys():
            self._groups[model].update(None, now)
        self._served = frozenset(model for model, replicas in groups.items() if replicas)
        outputs = [self._groups[model].current.output for model in self._served]
        fleet = max(round(sum(outputs) / len(outputs), 2), 0.01) if outputs else DEFAULT_WEIGHTS.output
        if fleet != self._fleet.output:
            self._fleet = TokenWeights(input=1.0, output=fleet)
