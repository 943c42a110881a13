#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the GPU machine (device tool):
#   1. build the GPU-test and benchmark catalogs into the cache in parallel (a no-op when the cache was carried
#      and nvcc matches)
#   2. the GPU tests (tests/gpu: correctness matrix, CUDA graphs, runtime), junit + log under $OUT
#   3. the benchmarks: attnjit vs FlashInfer 0.7.2 (when .bench/flashinfer.tar.xz was carried) vs torch SDPA
# and prints a short table last. Nothing is installed from the network.
#
#   bash scripts/gpu_check.sh [all|tests|bench|sweep] [pytest args...]   (sweep: prefill tile variants too)
#   carry: .device-cache (pre-built cubins, see `make_device_cache` below) and .bench (FlashInfer bundle)
# Build the carried cache here first (no GPU needed):
#   ATTNJIT_CACHE_DIR=.device-cache attnjit warm specs/gpu-tests.toml specs/bench.toml
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
sweep=0; if [ "$what" = sweep ]; then sweep=1; what=all; fi
OUT=${OUT:-/tmp/attnjit-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ATTNJIT_CACHE_DIR=${ATTNJIT_CACHE_DIR:-$PWD/.device-cache}
mkdir -p "$ATTNJIT_CACHE_DIR" && chmod -R go-w "$ATTNJIT_CACHE_DIR" && chmod 700 "$ATTNJIT_CACHE_DIR"
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m attnjit.cli info >>"$OUT/gpu.txt" 2>&1
before=$(ls "$ATTNJIT_CACHE_DIR"/?? 2>/dev/null | wc -l)
t0=$(date +%s)
python3 -m attnjit.cli warm specs/gpu-tests.toml specs/bench.toml -j 16 >"$OUT/warm.txt" 2>&1
summary+=("warm: $(tail -1 "$OUT/warm.txt")")
if grep -q " built" "$OUT/warm.txt" && [ "$(grep -c '^  built' "$OUT/warm.txt")" -gt 0 ]; then
  # nvcc here differs from the build machine's (or the cache was not carried): send the cubins back
  tar -C "$ATTNJIT_CACHE_DIR" -cJf "$OUT/device-cache.tar.xz" . 2>/dev/null
fi

if [ "$what" = all ] || [ "$what" = tests ]; then
  t=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/junit.xml" -ra "$@" >"$OUT/pytest.txt" 2>&1
  rc=$?
  summary+=("gpu tests (rc=$rc, $(( $(date +%s) - t )) s): $(tail -1 "$OUT/pytest.txt")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -40
fi

if [ "$sweep" = 1 ]; then
  t=$(date +%s)
  python3 benchmarks/bench.py --sweep --json "$OUT/sweep.json" >"$OUT/sweep.txt" 2>"$OUT/sweep.err"
  summary+=("sweep (rc=$?, $(( $(date +%s) - t )) s)")
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  fi_flag=--no-flashinfer
  if [ -f .bench/flashinfer.tar.xz ]; then
    mkdir -p /tmp/fi && tar xJf .bench/flashinfer.tar.xz -C /tmp/fi &&
      python3 -m pip install -q --no-index --no-deps --target /tmp/fi/site /tmp/fi/apache_tvm_ffi*.whl >/dev/null 2>&1 &&
      export PYTHONPATH=/tmp/fi/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a \
             MAX_JOBS=16 && fi_flag=""
    mkdir -p /tmp/fiws
    [ -f .bench/fi-jit.tar.xz ] && tar xJf .bench/fi-jit.tar.xz -C /tmp/fiws  # FlashInfer's JIT output of a run before
  fi
  t=$(date +%s)
  python3 benchmarks/bench.py $fi_flag --json "$OUT/bench.json" >"$OUT/bench.txt" 2>"$OUT/bench.err"
  summary+=("bench (rc=$?, $(( $(date +%s) - t )) s)")
  python3 benchmarks/engine.py runtime >"$OUT/engine.json" 2>>"$OUT/bench.err"
  summary+=("engine: $(tail -1 "$OUT/engine.json")")
  if [ -d /tmp/fiws/.cache ] && [ ! -f .bench/fi-jit.tar.xz ]; then
    tar -C /tmp/fiws -cf - .cache | xz -T0 -3 >"$OUT/fi-jit.tar.xz"
  fi
  tail -5 "$OUT/bench.err"
fi

echo "=== summary ($(( $(date +%s) - t0 )) s)"
printf '%s\n' "${summary[@]}"
[ -f "$OUT/sweep.txt" ] && cat "$OUT/sweep.txt"
[ -f "$OUT/bench.txt" ] && cat "$OUT/bench.txt"
exit 0
