#!/usr/bin/env bash
# install-on-device.sh [RELEASE] — run on the device machine once every chunk of a kit made by
# fetch.sh is in /tmp/gpukit/RELEASE/chunks (receive.sh puts it there): reassembles the wheels and
# checks their sha256, installs them with pip (no index, no dependency resolution) into /tmp/site,
# writes /tmp/gpukit/env.sh and checks the result (check_install.py). Without RELEASE, the one
# release whose chunks are there.
#
# Afterwards, in every command: `. /tmp/gpukit/env.sh`. To change release on a warm machine:
# `rm -rf /tmp/site /tmp/gpukit` first, then send the other release's chunks.
#
# Settings (environment): GPUKIT_ROOT (/tmp/gpukit), GPUKIT_TARGET (/tmp/site), PYTHON (python3).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=manifest.sh
. "$HERE/manifest.sh"
ROOT=${GPUKIT_ROOT:-/tmp/gpukit}
TARGET=${GPUKIT_TARGET:-/tmp/site}
PY=${PYTHON:-python3}

if [ "$#" -ge 1 ]; then
  RELEASE=$1
else
  releases=$(ls "$ROOT" 2>/dev/null | grep -v '^env.sh$' || true)
  [ "$(wc -w <<< "$releases")" = 1 ] || { echo "gpu-kit: name the release: found '$releases' under $ROOT" >&2; exit 2; }
  RELEASE=$releases
fi
KIT=$ROOT/$RELEASE
manifest=$(ls "$KIT"/chunks/[0-9][0-9]/MANIFEST 2>/dev/null | head -1 || true)
[ -n "$manifest" ] || { echo "gpu-kit: no chunk of $RELEASE under $KIT/chunks: send them first (receive.sh)" >&2; exit 1; }
nchunks=$(manifest_value "$manifest" chunks)
[ -n "$nchunks" ] || { echo "gpu-kit: $manifest has no chunk count: remake the kit with fetch.sh" >&2; exit 1; }
missing=$(missing_chunks "$KIT" "$nchunks")
if [ -n "$missing" ]; then
  echo "gpu-kit: chunks of $RELEASE missing under $KIT/chunks:$missing (of $nchunks)." >&2
  echo "  /tmp is lost when the machine goes cold (30 s after a call): send them again, back to back." >&2
  exit 1
fi

echo "== reassembling $(grep -c '^wheel ' "$manifest") wheels into $KIT/wheels"
mkdir -p "$KIT/wheels"
wheels=()
while read -r kind name sha size parts; do
  [ "$kind" = wheel ] || continue
  out=$KIT/wheels/$name
  wheels+=("$out")
  if [ -f "$out" ] && [ "$(stat -c %s "$out")" = "$size" ] && echo "$sha  $out" | sha256sum -c --status; then
    continue
  fi
  : > "$out.tmp"
  for p in $parts; do
    [ -f "$KIT/chunks/$p" ] || { echo "gpu-kit: piece $p of $name is missing" >&2; exit 1; }
    cat "$KIT/chunks/$p" >> "$out.tmp"
  done
  echo "$sha  $out.tmp" | sha256sum -c --status ||
    { echo "gpu-kit: sha256 mismatch for $name: one of its pieces ($parts) arrived damaged; send those chunks again" >&2; exit 1; }
  mv "$out.tmp" "$out"
done < "$manifest"

# The marker is written once pip has installed every wheel: an install cut short is redone.
marker=$TARGET/.gpukit-release
installed=$(cat "$marker" 2>/dev/null || true)
if [ "$installed" = "$RELEASE" ]; then
  echo "== vLLM $RELEASE already in $TARGET"
elif [ -n "$installed" ]; then
  echo "gpu-kit: $TARGET holds vLLM $installed, not $RELEASE: rm -rf $TARGET $ROOT, then send the chunks again" >&2
  exit 1
else
  echo "== pip install --target $TARGET (${#wheels[@]} wheels)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --upgrade --target "$TARGET" "${wheels[@]}"
  echo "$RELEASE" > "$marker"
fi

# The CUDA libraries: the kit's (cuDNN and NCCL where torch travels) ahead of the image's, which
# a torch in $TARGET does not find by its RPATH (docs/gpu-tests.md, "Which CUDA libraries travel").
image_libs=$(env -u PYTHONPATH "$PY" -c '
import glob, os, sys
print(":".join(d for p in sys.path if p for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
kit_libs=$(ls -d "$TARGET"/nvidia/*/lib 2>/dev/null | paste -sd: || true)
libs=$(printf '%s\n' "$kit_libs" "$image_libs" | grep -v '^$' | paste -sd: || true)  # no empty entry: it means "."
cat > "$ROOT/env.sh" <<EOF
# written by scripts/gpu-kit/install-on-device.sh for vLLM $RELEASE; source it: . $ROOT/env.sh
export PYTHONPATH="$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# FlashInfer is not carried: without this, building the sampler imports it and fails.
export VLLM_USE_FLASHINFER_SAMPLER=0
# An offline machine: no usage reports, no hub look-ups.
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# NVLink multicast stays off on these hosts; vLLM's symmetric-memory all-reduce would try it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
EOF
# shellcheck disable=SC1091
. "$ROOT/env.sh"
gpu=()
if command -v nvidia-smi >/dev/null; then gpu=(--require-gpu); fi  # a GPU machine whose torch sees none fails here
"$PY" "$HERE/check_install.py" --manifest "$manifest" --target "$TARGET" "${gpu[@]}"
echo "== gpu-kit: vLLM $RELEASE ready; start every later command with '. $ROOT/env.sh'"
