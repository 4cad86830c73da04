#!/usr/bin/env bash
# receive.sh CHUNK — run on the device machine, in the call that carried CHUNK (a chunks/NN folder
# made by fetch.sh): copies it to /tmp/gpukit/RELEASE/chunks/NN, out of the working tree's way, and
# says which of the release's chunks are still to come. /tmp is lost when the machine goes cold
# (30 s after a call), so the chunks go in back-to-back calls, the install in the last.
set -euo pipefail
# shellcheck source=manifest.sh
. "$(dirname "${BASH_SOURCE[0]}")/manifest.sh"
chunk=${1:?usage: receive.sh .gpukit/RELEASE/chunks/NN}
[ -f "$chunk/MANIFEST" ] || { echo "gpu-kit: $chunk/MANIFEST missing: carry the chunk folder (carry=[\"$chunk\"])" >&2; exit 1; }
release=$(manifest_value "$chunk/MANIFEST" release)
nchunks=$(manifest_value "$chunk/MANIFEST" chunks)
[ -n "$release" ] && [ -n "$nchunks" ] || { echo "gpu-kit: $chunk/MANIFEST names no release or chunk count: remake the kit with fetch.sh" >&2; exit 1; }
kit=${GPUKIT_ROOT:-/tmp/gpukit}/$release
mkdir -p "$kit/chunks"
# Every chunk must come from the same fetch.sh run (its MANIFEST's first line says when).
for other in "$kit"/chunks/*/MANIFEST; do
  if [ -f "$other" ] && ! cmp -s "$other" "$chunk/MANIFEST"; then
    echo "gpu-kit: $chunk was made by another fetch.sh run than the chunks already in $kit/chunks" >&2
    echo "  ($(head -1 "$chunk/MANIFEST") against $(head -1 "$other")): rm -rf $kit and send one kit's chunks" >&2
    exit 1
  fi
  break
done
cp -r "$chunk" "$kit/chunks/"
missing=$(missing_chunks "$kit" "$nchunks")
echo "gpu-kit $release: $(basename "$chunk") received; $((nchunks - $(wc -w <<< "$missing"))) of $nchunks here${missing:+, still to come:$missing}"
