# Sourced by receive.sh and install-on-device.sh: reading a kit's MANIFEST (fetch.sh writes it).

# manifest_value MANIFEST KEY: the value of the line "KEY VALUE" (release, chunks).
manifest_value() { awk -v key="$2" '$1 == key {print $2}' "$1"; }

# missing_chunks KIT NCHUNKS: the chunk numbers not yet under KIT/chunks, each after a space.
missing_chunks() {
  local i
  for i in $(seq -f '%02g' 1 "$2"); do [ -d "$1/chunks/$i" ] || printf ' %s' "$i"; done
}
