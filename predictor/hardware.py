"""Accelerator facts the roofline prior needs: peak dense tensor FLOP/s and memory bandwidth.

Datasheet peaks for ONE device, dense: ceilings that ``predictor.step_model.Efficiency`` scales.
The ``cpu`` entry means "unknown hardware": no prior, the step model is learned from metrics only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = ["GPUS", "UNKNOWN_GPU", "GpuSpec", "gpu_names", "lookup_gpu"]

_T = 1e12
_GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator kind.

    ``peak_bf16_flops``: dense BF16/FP16 tensor FLOP/s (0.0 = unknown).
    ``hbm_bandwidth``: device memory bandwidth in bytes/s (0.0 = unknown).
    ``memory_bytes``: device memory in bytes (0.0 = unknown).
    ``peak_fp8_flops``: dense FP8 tensor FLOP/s, or ``None`` when the device has no FP8 tensor cores.
    """

    name: str
    peak_bf16_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    peak_fp8_flops: float | None = None

    def __post_init__(self) -> None:
        if min(self.peak_bf16_flops, self.hbm_bandwidth, self.memory_bytes) < 0.0:
            raise ValueError(f"GPU {self.name!r}: FLOP/s, bandwidth and memory must be >= 0")

    @property
    def known(self) -> bool:
        """True when both the compute and the bandwidth ceilings are known (a prior is possible)."""
        return self.peak_bf16_flops > 0.0 and self.hbm_bandwidth > 0.0

    def peak_flops(self, weight_dtype_bytes: float) -> float:
        """Dense FLOP/s for GEMMs whose weights take ``weight_dtype_bytes`` bytes per element.

        FP8 (1 byte) uses the FP8 tensor cores when the device has them; anything else (BF16, or
        weight-only INT4 that dequantises to BF16) runs at the BF16 rate.
        """
        if weight_dtype_bytes == 1.0 and self.peak_fp8_flops is not None:
            return self.peak_fp8_flops
        return self.peak_bf16_flops


_SPECS: Final[tuple[GpuSpec, ...]] = (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS and FP8 3,958 TFLOPS
    # "with sparsity" (so 989.4 / 1,978.9 dense), 3.35 TB/s HBM3, 80 GB.
    GpuSpec("H100-SXM", 989.4 * _T, 3.35e12, 80 * _GB, 1978.9 * _T),
    # Same datasheet, PCIe column: BF16 1,513 / FP8 3,026 TFLOPS with sparsity, 2.0 TB/s HBM2e, 80 GB.
    GpuSpec("H100-PCIe", 756.5 * _T, 2.0e12, 80 * _GB, 1513.0 * _T),
    # Same datasheet, NVL column: BF16 1,671 / FP8 3,341 TFLOPS with sparsity, 3.9 TB/s, 94 GB.
    GpuSpec("H100-NVL", 835.5 * _T, 3.9e12, 94 * _GB, 1670.5 * _T),
    # NVIDIA H200 datasheet (SXM): same GH100 compute as H100 SXM, 4.8 TB/s HBM3e, 141 GB.
    GpuSpec("H200", 989.4 * _T, 4.8e12, 141 * _GB, 1978.9 * _T),
    # NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 sparse); 80GB SXM 2,039 GB/s HBM2e.
    # No FP8 tensor cores on Ampere.
    GpuSpec("A100-80GB-SXM", 312.0 * _T, 2.039e12, 80 * _GB),
    # Same datasheet, 80GB PCIe: 1,935 GB/s.
    GpuSpec("A100-80GB-PCIe", 312.0 * _T, 1.935e12, 80 * _GB),
    # Same datasheet, A100 40GB (SXM and PCIe): 1,555 GB/s HBM2.
    GpuSpec("A100-40GB", 312.0 * _T, 1.555e12, 40 * _GB),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 sparse), FP8 733 dense (1,466 sparse),
    # 864 GB/s GDDR6, 48 GB.
    GpuSpec("L40S", 362.05 * _T, 0.864e12, 48 * _GB, 733.0 * _T),
    # NVIDIA L4 datasheet: BF16 242 TFLOPS and FP8 485 TFLOPS with sparsity, 300 GB/s GDDR6, 24 GB.
    GpuSpec("L4", 121.0 * _T, 0.300e12, 24 * _GB, 242.5 * _T),
    # NVIDIA A10 datasheet: BF16 125 TFLOPS dense (250 sparse), 600 GB/s GDDR6, 24 GB.
    GpuSpec("A10", 125.0 * _T, 0.600e12, 24 * _GB),
    # AWS A10G (G5 instances): same 24 GB / 600 GB/s memory as the A10 but lower tensor throughput,
    # about 70 TFLOPS BF16 dense (Baseten, "NVIDIA A10 vs A10G for ML model inference") (recall).
    GpuSpec("A10G", 70.0 * _T, 0.600e12, 24 * _GB),
    # AMD Instinct MI300X datasheet: FP16/BF16 1,307.4 TFLOPS dense, FP8 2,614.9 dense,
    # 5.3 TB/s HBM3, 192 GB.
    GpuSpec("MI300X", 1307.4 * _T, 5.3e12, 192 * _GB, 2614.9 * _T),
    # Unknown hardware (a CPU replica, or a device not in this table): no ceilings at all.
    GpuSpec("cpu", 0.0, 0.0, 0.0),
)

#: Canonical name -> spec. Read-only.
GPUS: Final = MappingProxyType({spec.name: spec for spec in _SPECS})

#: The "unknown hardware" entry: ``known`` is False, so no roofline prior is built from it.
UNKNOWN_GPU: Final = GPUS["cpu"]

# Normalised spellings (upper case, alphanumerics only) -> canonical name. Covers the canonical
# names, the strings `nvidia-smi --query-gpu=name` prints, and common shorthands.
_ALIASES: Final[dict[str, str]] = {
    "H100": "H100-SXM",
    "H100SXM5": "H100-SXM",
    "H100SXM580GB": "H100-SXM",
    "H10080GBHBM3": "H100-SXM",
    "H100PCIE80GB": "H100-PCIe",
    "H100NVL94GB": "H100-NVL",
    "H200SXM": "H200",
    "H200141GB": "H200",
    "H200141GBHBM3E": "H200",
    "A10080GB": "A100-80GB-SXM",
    "A100SXM480GB": "A100-80GB-SXM",
    "A10080GBSXM4": "A100-80GB-SXM",
    "A10080GBPCIE": "A100-80GB-PCIe",
    "A100PCIE80GB": "A100-80GB-PCIe",
    "A100SXM440GB": "A100-40GB",
    "A100PCIE40GB": "A100-40GB",
    "A10040GBSXM": "A100-40GB",
    "A10040GBPCIE": "A100-40GB",
    "L40S48GB": "L40S",
    "L424GB": "L4",
    "A10G24GB": "A10G",
    "MI300": "MI300X",
    "UNKNOWN": "cpu",
    "NONE": "cpu",
}


def _normalise(name: str) -> str:
    upper = name.upper().replace("NVIDIA", "").replace("AMD", "").replace("INSTINCT", "")
    return re.sub(r"[^A-Z0-9]", "", upper)


_BY_KEY: Final[dict[str, str]] = {_normalise(n): n for n in GPUS} | _ALIASES


def lookup_gpu(name: str) -> GpuSpec | None:
    """The spec for ``name`` (canonical, ``nvidia-smi`` spelling or shorthand), or ``None``.

    ``None`` means the name is not recognised (a configuration typo, say); ``"cpu"`` and
    ``"unknown"`` are recognised and return ``UNKNOWN_GPU``.
    """
    canonical = _BY_KEY.get(_normalise(name))
    return GPUS[canonical] if canonical is not None else None


def gpu_names() -> tuple[str, ...]:
    """Canonical names, in table order (for error messages and `sluice check-config`)."""
    return tuple(GPUS)
