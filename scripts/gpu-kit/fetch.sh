#!/usr/bin/env bash
# fetch.sh RELEASE [DEST] — run here (PyPI reachable): the wheels the GPU lane and the demo's benches
# need on the offline device machine for vLLM RELEASE (vllm-RELEASE.txt, test-wheels.txt,
# demo-wheels.txt), cut into chunks that each ride along in one device call (a call carries at most
# 64 MiB with the working tree).
#
# DEST (default .gpukit/RELEASE, git-ignored) gets wheels/, pieces/ (wheels over the chunk limit
# split with `split -b`) and chunks/01..NN, each with MANIFEST: a "#" line saying when it was made,
# "release RELEASE", "chunks N", then one line per wheel, "wheel NAME SHA256 SIZE CHUNK/PIECE...".
# install-on-device.sh reassembles and checks them there.
#
# Settings (environment): CHUNK_MAX_MIB (58: a chunk and the tracked tree, about 2 MiB, stay under
# a call's 64 MiB), PIECE_SIZE (57M), PYTHON (python3).
set -euo pipefail

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: $0 RELEASE [DEST]   (e.g. $0 0.32.0; releases: $(cd "$(dirname "$0")" && ls vllm-*.txt | sed 's/vllm-//; s/.txt//' | tr '\n' ' '))" >&2
  exit 2
fi
RELEASE=$1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=$(realpath -m "${2:-$HERE/../../.gpukit/$RELEASE}")
CHUNK_MAX_MIB=${CHUNK_MAX_MIB:-58}
PIECE_SIZE=${PIECE_SIZE:-57M}
PYTHON=${PYTHON:-python3}
LISTS=("$HERE/vllm-$RELEASE.txt" "$HERE/test-wheels.txt" "$HERE/demo-wheels.txt")
[ -f "${LISTS[0]}" ] || { echo "error: no ${LISTS[0]}: write the release's pins first (docs/gpu-tests.md, 'The kits')" >&2; exit 2; }
# A DEST in the working tree that git does not ignore would travel with every device call.
mkdir -p "$DEST"
if git -C "$HERE" rev-parse --show-toplevel >/dev/null 2>&1 && [[ $DEST == $(git -C "$HERE" rev-parse --show-toplevel)/* ]] &&
  ! git -C "$HERE" check-ignore -q "$DEST"; then
  echo "error: $DEST is in the working tree and not git-ignored: it would ride along in every device call" >&2
  exit 2
fi

# Tags the device's python3 (CPython 3.12, glibc >= 2.31) accepts. pip matches manylinux_2_N
# exactly, so each N that a pinned wheel uses is listed (NCCL's is 2_18).
PIP_FLAGS=(
  --no-deps --only-binary=:all: --progress-bar off --disable-pip-version-check
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_18_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
  --platform any
)

norm() { printf '%s' "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g'; }
pins() { sed -e 's/#.*//' -e 's/[[:space:]]//g' "$@" | grep -v '^$'; }
sdist_pins() { grep -h -E '#[[:space:]]*sdist' "$@" | sed -e 's/#.*//' -e 's/[[:space:]]//g'; }

mkdir -p "$DEST/wheels"
echo "== downloading the wheels for vLLM $RELEASE into $DEST/wheels"
"$PYTHON" -m pip download "${PIP_FLAGS[@]}" -q -d "$DEST/wheels" 2> >(grep -v "^WARNING: Location" >&2) \
  $(comm -23 <(pins "${LISTS[@]}" | sort) <(sdist_pins "${LISTS[@]}" | sort))
for spec in $(sdist_pins "${LISTS[@]}"); do
  "$PYTHON" -m pip wheel -q --no-deps --disable-pip-version-check -w "$DEST/wheels" "$spec" 2> >(grep -v "^WARNING: Location" >&2)
done

# Exactly one wheel per pin: leftovers of an earlier run (another version) go.
declare -A want=() have=()
for spec in $(pins "${LISTS[@]}"); do want[$(norm "${spec%%==*}")]=${spec#*==}; done
for w in "$DEST"/wheels/*.whl; do
  base=$(basename "$w"); name=$(norm "${base%%-*}"); rest=${base#*-}; version=${rest%%-*}
  if [ "${want[$name]:-}" = "$version" ] && [ -z "${have[$name]:-}" ]; then
    have[$name]=$base
  else
    echo "   removing $base (not pinned)"; rm -f "$w"
  fi
done
for name in "${!want[@]}"; do
  [ -n "${have[$name]:-}" ] || { echo "error: no wheel for $name==${want[$name]} in $DEST/wheels" >&2; exit 1; }
done

# Split what exceeds a chunk, then pack the pieces into chunks, largest first (first-fit decreasing).
limit=$((CHUNK_MAX_MIB * 1024 * 1024 - 64 * 1024)) # room for MANIFEST
rm -rf "$DEST/pieces" "$DEST/chunks"
mkdir -p "$DEST/pieces" "$DEST/chunks"
for w in "$DEST"/wheels/*.whl; do
  base=$(basename "$w")
  if [ "$(stat -c %s "$w")" -gt "$limit" ]; then
    split -b "$PIECE_SIZE" -d -a 2 "$w" "$DEST/pieces/$base.part"
  else
    ln "$w" "$DEST/pieces/$base" 2>/dev/null || cp "$w" "$DEST/pieces/$base"
  fi
done
for p in "$DEST"/pieces/*; do
  size=$(stat -c %s "$p")
  [ "$size" -le "$limit" ] || { echo "error: piece $(basename "$p") ($size bytes) exceeds a chunk; lower PIECE_SIZE" >&2; exit 1; }
  printf '%s %s\n' "$size" "$(basename "$p")"
done | sort -k1,1nr | awk -v limit="$limit" '
  { placed = 0
    for (b = 1; b <= n; b++) if (used[b] + $1 <= limit) { used[b] += $1; placed = 1; break }
    if (!placed) { n++; b = n; used[b] = $1 }
    printf "%02d %s\n", b, $2 }' > "$DEST/pieces.plan"
while read -r chunk piece; do
  mkdir -p "$DEST/chunks/$chunk"
  ln "$DEST/pieces/$piece" "$DEST/chunks/$chunk/$piece" 2>/dev/null || cp "$DEST/pieces/$piece" "$DEST/chunks/$chunk/$piece"
done < "$DEST/pieces.plan"
nchunks=$(ls -d "$DEST"/chunks/[0-9][0-9] | wc -l)

manifest=$DEST/chunks/MANIFEST
{
  echo "# gpu-kit: $(for list in "${LISTS[@]}"; do basename "$list"; done | paste -sd' '); made $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "release $RELEASE"
  echo "chunks $nchunks"
  for w in "$DEST"/wheels/*.whl; do
    base=$(basename "$w")
    parts=$(awk -v b="$base" '$2 == b || index($2, b ".part") == 1 {print $2, $1 "/" $2}' "$DEST/pieces.plan" |
      sort -k1,1 | awk '{printf " %s", $2}')
    echo "wheel $base $(sha256sum "$w" | awk '{print $1}') $(stat -c %s "$w")$parts"
  done
} > "$manifest"
for d in "$DEST"/chunks/[0-9][0-9]; do cp "$manifest" "$d/MANIFEST"; done

echo "== $(ls "$DEST"/wheels/*.whl | wc -l) wheels, $(du -cb "$DEST"/wheels/*.whl | tail -1 | awk '{printf "%.1f MiB", $1/1048576}'), in $nchunks chunks of at most $CHUNK_MAX_MIB MiB:"
for d in "$DEST"/chunks/[0-9][0-9]; do
  printf '   %s  %5.1f MiB  %s\n' "$(basename "$d")" "$(du -cb "$d"/* | tail -1 | awk '{print $1/1048576}')" \
    "$(ls "$d" | grep -v '^MANIFEST$' | tr '\n' ' ')"
done
rel=$(realpath --relative-to="$HERE/../.." "$DEST")
echo "== on the device, one call per chunk NN (docs/gpu-tests.md, 'The device calls'):"
echo "   carry=[\"$rel/chunks/NN\"], command=\"bash scripts/gpu-kit/receive.sh $rel/chunks/NN\""
echo "   the last call adds: && bash scripts/gpu-kit/install-on-device.sh"
