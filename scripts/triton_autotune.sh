#!/usr/bin/env bash
# Sourced by the device-call scripts: Triton's autotuning results, kept between device machines.
# A fresh machine autotunes every labkit kernel again: it compiles and times every config of every tuned kernel at
# every new key (notebook 03 took more than 150 s cold, 73 s with a warm cache). With TRITON_CACHE_AUTOTUNING=1 the
# autotuner writes each key's timings to Triton's cache (a small <kernel>.autotune.json under a hash of Triton's
# version, the GPU target, the kernel's source, the key and the configs) and, finding one, compiles the winner alone.
#   autotune_seed   unpack research/records/<gpu>/triton_autotune.tgz (if committed) into Triton's cache
#   autotune_pack F pack every *.autotune.json of Triton's cache into F (commit it as the file above)
# One archive per GPU kind: the H100 and the H200 share a target (sm_90) and so a hash, but not their best configs.
# A changed kernel or config list changes the hash: its stale entries are never read (a pack keeps them; delete the
# archive to start afresh).
export TRITON_CACHE_AUTOTUNING=1
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}

autotune_gpu() {  # the GPU's class as results/ names it (labkit.data.machine_class: h100, h200, a slug otherwise)
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  [ -n "$name" ] && python3 -c "import sys; from labkit.data import machine_class; print(machine_class(sys.argv[1]))" \
    "$name"
}

autotune_seed() {
  local seed
  seed="$(dirname "${BASH_SOURCE[0]}")/../research/records/$(autotune_gpu)/triton_autotune.tgz"
  mkdir -p "$TRITON_CACHE"
  if [ -f "$seed" ]; then
    tar xzf "$seed" -C "$TRITON_CACHE" && echo "autotune results seeded: $(tar tzf "$seed" | grep -c autotune.json) from $seed"
  else
    echo "no autotune results at $seed: every tuned kernel tunes from scratch"
  fi
}

autotune_pack() {
  (cd "$TRITON_CACHE" 2>/dev/null && find . -name "*.autotune.json" -print0 | tar czf "$1" --null -T -)
}

# The compiled kernels: Triton's (each kernel's metadata .json and .cubin, the group files that list them, and the
# launcher stubs it builds with the host compiler, .so) and torch.compile's (Inductor's FX-graph and AOTAutograd
# caches, the Python modules it generated and their Triton kernels), kept between device calls of one session and
# the next, as vLLM keeps its torch.compile cache: a fresh machine compiles every specialisation of every labkit
# kernel again, which made notebook cells 2-4x slower on a cold H100 than on a warm one (09's engine cell: 62 s
# against 21 s), and compiles HF's decode step for notebooks 00 and 05 (~40-55 s each) again. The archive is
# committed beside the autotune results (research/records/<gpu>/compiled_kernels.tar.xz, triton/ and inductor/
# inside, ~4 MB xz): an ignored folder had held it, and every fresh checkout of a later session lost it, so each
# session's first call started cold. Commit $OUT's compiled_kernels.tar.xz there after a call.
# A stage row says which state the run started from (LABKIT_TRITON_CACHE: "cold" or "seeded: N Triton kernels,
# M Inductor graphs"), so a time measured warm is never read as a new user's first run.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/torchinductor}

kernel_cache_seed() {
  local seed tmp dir gpu other
  dir="$(dirname "${BASH_SOURCE[0]}")/../research/records"
  gpu=$(autotune_gpu)
  seed="$dir/$gpu/compiled_kernels.tar.xz"
  # the H100 and the H200 share Triton's target (sm_90), so one's cubins are hits on the other (Inductor's graphs
  # are keyed by the device's name and simply miss): seed from the other when this GPU has no archive of its own
  if [ ! -f "$seed" ]; then
    case $gpu in h100) other=h200 ;; h200) other=h100 ;; *) other= ;; esac
    [ -n "$other" ] && [ -f "$dir/$other/compiled_kernels.tar.xz" ] && seed="$dir/$other/compiled_kernels.tar.xz"
  fi
  export LABKIT_TRITON_CACHE=cold
  if [ -f "$seed" ]; then
    tmp=$(mktemp -d)
    mkdir -p "$TRITON_CACHE" "$TORCHINDUCTOR_CACHE_DIR" "$tmp/triton" "$tmp/inductor"
    tar xJf "$seed" -C "$tmp" && cp -r "$tmp/triton/." "$TRITON_CACHE/" && cp -r "$tmp/inductor/." "$TORCHINDUCTOR_CACHE_DIR/" &&
      LABKIT_TRITON_CACHE="seeded: $(find "$tmp/triton" -name "*.cubin" | wc -l) Triton kernels, $(find "$tmp/inductor/fxgraph" -type f 2>/dev/null | wc -l) Inductor graphs"
    rm -rf "$tmp"
    echo "compiled-kernel cache $LABKIT_TRITON_CACHE from $seed"
  else
    echo "no compiled-kernel cache at $seed: every kernel compiles on first use"
  fi
}

# F: an archive of the compiled kernels (autotune results excluded: autotune_pack keeps those; Triton's and
# Inductor's intermediate .ptx/.ttir/.ttgir/.llir/.source left out: a cache hit needs the cubins), xz-compressed
# (the H100's 358 Triton kernels after five notebooks: 7.4 MB gzipped, 2.1 MB with xz). Above 8 MiB Inductor's part
# is left out, and above 8 MiB without it the archive is not returned (a message says which): what travels to the
# device is 64 MiB in all, and the tracked tree (~38 MB) and the wheels (~19 MB) take most of it.
_pack_parts() {  # F PART...: an xz tar of the named parts (triton, inductor) of the compiled-kernel caches
  local out=$1 tar_file
  shift
  tar_file=$(mktemp)
  tar cf "$tar_file" --files-from /dev/null
  if [[ " $* " == *" triton "* ]]; then
    (cd "$TRITON_CACHE" 2>/dev/null && find . \( -name "*.cubin" -o -name "*.so" -o \
      \( -name "*.json" ! -name "*.autotune.json" \) \) -print0 | tar rf "$tar_file" --null -T - --transform 's,^\./,triton/,')
  fi
  if [[ " $* " == *" inductor "* ]]; then
    (cd "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null && find . -type f ! -name "*.ptx" ! -name "*.ttir" ! -name "*.ttgir" \
      ! -name "*.llir" ! -name "*.source" ! -name "*.lock" -print0 | tar rf "$tar_file" --null -T - --transform 's,^\./,inductor/,')
  fi
  xz -T0 -6 -c "$tar_file" > "$out"
  rm -f "$tar_file"
}

kernel_cache_pack() {
  local limit=$((8 * 1024 * 1024))
  _pack_parts "$1" triton inductor
  if [ "$(stat -c %s "$1" 2>/dev/null || echo 0)" -gt $limit ]; then
    echo "compiled-kernel cache over 8 MiB with Inductor's part: Triton's kernels alone"
    _pack_parts "$1" triton
  fi
  if [ "$(stat -c %s "$1" 2>/dev/null || echo 0)" -gt $limit ]; then
    echo "compiled-kernel cache archive over 8 MiB: not returned"
    rm -f "$1"
  fi
}
