"""What an operator knows about a replica: the facts the roofline prior is built from.

vLLM does not expose its GPU, tensor parallelism, ``max_num_seqs`` or ``max_num_batched_tokens``
on ``/metrics``, so the operator writes them in YAML; ``max_model_len`` comes from ``/v1/models``
when not configured. Nothing here reads an emulator profile: the replay builds these facts the way
an operator would, from the deployment's description.
"""

from __future__ import annotations

from dataclasses import dataclass

from predictor import (
    Efficiency,
    GpuSpec,
    ModelArch,
    StepModel,
    lookup_gpu,
    lookup_model,
    roofline_prior,
)

__all__ = ["ReplicaFacts"]


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """What an operator knows about a replica (YAML) plus what ``/v1/models`` says.

    ``gpu``: a ``predictor.hardware`` name (e.g. ``"H100-SXM"``, or an ``nvidia-smi`` spelling);
    ``None``, ``"unknown"`` or ``"cpu"`` means unknown hardware: the step model is learned from
    observations alone. An unrecognised name is treated as unknown too (settings validation
    rejects it before it gets here).
    ``model``: a ``predictor.model`` catalogue name or Hugging Face id; ``None`` = learn from data.
    ``tensor_parallel``: devices per replica (>= 1).
    ``max_num_seqs`` / ``max_num_batched_tokens``: the engine's scheduler limits (>= 1).
    ``max_model_len``: prompt + output cap in tokens; ``None`` when not yet known.
    """

    gpu: str | None = None
    model: str | None = None
    tensor_parallel: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        bad = {
            "tensor_parallel": self.tensor_parallel,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        if self.max_model_len is not None:
            bad["max_model_len"] = self.max_model_len
        wrong = [f"{k}={v}" for k, v in bad.items() if v < 1]
        if wrong:
            raise ValueError(f"replica facts must be >= 1: {', '.join(wrong)}")

    def gpu_spec(self) -> GpuSpec | None:
        """The accelerator's datasheet numbers, or ``None`` when unknown (no prior possible)."""
        spec = None if self.gpu is None else lookup_gpu(self.gpu)
        return spec if spec is not None and spec.known else None

    def model_arch(self) -> ModelArch | None:
        """The model's architecture from the catalogue, or ``None`` when unknown."""
        return None if self.model is None else lookup_model(self.model)

    def prior(self, efficiency: Efficiency | None = None) -> StepModel:
        """The roofline step model these facts give (``valid=False`` with the reason when unknown).

        ``efficiency``: the prior's efficiency guesses (``predictor.Efficiency()`` by default).
        """
        return roofline_prior(
            self.model_arch(),
            self.gpu_spec(),
            tensor_parallel=self.tensor_parallel,
            efficiency=efficiency or Efficiency(),
        )
