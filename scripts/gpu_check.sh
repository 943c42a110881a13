#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the GPU machine (device tool):
#   1. build the GPU-test and benchmark catalogs into the cache in parallel (a no-op when the cache was carried
#      and nvcc matches)
#   2. the GPU tests (tests/gpu: correctness matrix, CUDA graphs, runtime), junit + log under $OUT
#   3. the benchmarks: attnjit vs FlashInfer 0.7.2 (when .bench/flashinfer.tar.xz was carried) vs torch SDPA
# and prints a short table last. Nothing is installed from the network.
#
#   4. the example model (examples/llama_serving.py): its dispatch record, the catalog from it, and a strict-mode
#      run (ATTNJIT_JIT=0) from a cache warmed with specs/llama-example.toml on a machine without a GPU
#   5. the model benchmark (benchmarks/model.py): tokens/s with attnjit and with FlashInfer at the same call sites
#
#   bash scripts/gpu_check.sh [STAGES] [pytest args...]
#   STAGES: all (= tests,model,bench,plan) or a comma-separated list of smoke (each family on a few batches, under a
#   timeout), tests, model, bench, sweep (tile variants), order (prefill work orders), dsweep (deep decode tile
#   variants, small batches), fsweep (fp8 decode tile variants), tsweep (the sm90 tile configurations against
#   FlashInfer fa3 and cuDNN), profile (Nsight Compute,
#   short prefill rows), plan (plan() host time against FlashInfer), tune (attnjit tune on
#   the benchmark spec), layouts (benchmarks/decode_layouts.py), fixed (benchmarks/decode_fixed.py), timeline
#   (benchmarks/sm90_timeline.py from .timeline-cache, built here with its --build); default all
#   env: TESTS_BUDGET / BENCH_BUDGET (seconds each stage may take; the device tool stops a call at 600 s),
#   BENCH_ARGS (e.g. --fi-skip fa3:64), SWEEP_ARGS (the sweeps' options, e.g. --main-only --tiles kv128,kv128t8),
#   TEST_TIMEOUT (per test, with pytest-timeout), SMOKE_TIMEOUT, TIMELINE_ARGS (';'-separated argument sets of
#   sm90_timeline.py, one call each; default "32x512 8x2048"); pack: TIMELINE_BUILD (their kernels' --build sets)
#   carry: .carry (compressed caches, `bash scripts/gpu_check.sh pack` builds them here, no GPU needed) and .bench
#   (the FlashInfer bundle, ../shared/tools/flashinfer-bundle.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
if [ "$what" = pack ]; then   # on the build machine: warm both caches and compress them into .carry (cubins ~15x)
  set -e
  ATTNJIT_CACHE_DIR=.device-cache python3 -m attnjit.cli warm specs/gpu-tests.toml specs/bench.toml
  # entries of earlier sources (a header changed) would travel too: keep only what the catalogs build now
  python3 -m attnjit.cli cache prune --keep specs/gpu-tests.toml --keep specs/bench.toml --cache-dir .device-cache
  rm -rf .llama-cache && ATTNJIT_CACHE_DIR=.llama-cache python3 -m attnjit.cli warm specs/llama-example.toml
  mkdir -p .carry
  for c in device-cache llama-cache; do tar -C ".$c" -cf - . | xz -T0 -6 >".carry/$c.tar.xz"; done
  # the timeline stage's kernels (carried as .timeline-cache): TIMELINE_BUILD, ';'-separated argument sets of
  # sm90_timeline.py --build, e.g. "--no-stamps 8x2048;--no-stamps --what-if plain-kv 8x2048"
  if [ -n "${TIMELINE_BUILD:-}" ]; then
    IFS=';' read -ra tl_builds <<<"$TIMELINE_BUILD"
    for a in "${tl_builds[@]}"; do
      # shellcheck disable=SC2086  # each set is a list of arguments
      ATTNJIT_CACHE_DIR=$PWD/.timeline-cache python3 benchmarks/sm90_timeline.py --build $a
    done
    du -sh .timeline-cache
  fi
  du -sh .carry/*; exit 0
fi
for c in device-cache llama-cache; do
  if [ -f ".carry/$c.tar.xz" ] && [ ! -d ".$c" ]; then mkdir -p ".$c" && tar xJf ".carry/$c.tar.xz" -C ".$c"; fi
done
[ "$what" = all ] && what=tests,model,bench,plan
has() { [[ ",$what," == *",$1,"* ]]; }
for s in ${what//,/ }; do
  case $s in smoke|tests|model|bench|sweep|order|dsweep|fsweep|tsweep|profile|tune|plan|layouts|fixed|timeline) ;;
    *) echo "gpu_check.sh: unknown stage '$s' (stages: all, or a comma-separated list of smoke, tests, model," \
            "bench, sweep, order, dsweep, fsweep, tsweep, profile, tune, plan, layouts, fixed, timeline; or pack)" >&2; exit 2;;
  esac
done
OUT=${OUT:-/tmp/attnjit-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ATTNJIT_CACHE_DIR=${ATTNJIT_CACHE_DIR:-$PWD/.device-cache}
mkdir -p "$ATTNJIT_CACHE_DIR" && chmod -R go-w "$ATTNJIT_CACHE_DIR" && chmod 700 "$ATTNJIT_CACHE_DIR"
summary=()
hung=()   # smoke entries that timed out

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
# the compiled scheduler for this machine's Python (the checkout runs from PYTHONPATH, not a pip install): plan()
# uses it where it builds, else plans in Python (the same work lists)
python3 setup.py -q build_ext --inplace >"$OUT/cplan-build.txt" 2>&1
summary+=("compiled scheduler: $(python3 -c 'from attnjit.ops import scheduler as s; print("built" if s._cplan else "not built")' 2>&1 | tail -1)")
python3 -m attnjit.cli info >>"$OUT/gpu.txt" 2>&1
before=$(ls "$ATTNJIT_CACHE_DIR"/?? 2>/dev/null | wc -l)
t0=$(date +%s)
python3 -m attnjit.cli warm specs/gpu-tests.toml specs/bench.toml -j 16 >"$OUT/warm.txt" 2>&1
summary+=("warm: $(tail -1 "$OUT/warm.txt")")
if grep -q " built" "$OUT/warm.txt" && [ "$(grep -c '^  built' "$OUT/warm.txt")" -gt 0 ]; then
  # nvcc here differs from the build machine's (or the cache was not carried): send the cubins back
  tar -C "$ATTNJIT_CACHE_DIR" -cJf "$OUT/device-cache.tar.xz" . 2>/dev/null
fi

fi_flag=--no-flashinfer
# the SM clock, power and temperature every 100 ms while a stage times (benchmarks/clocks.py joins them with the
# timed spans of its JSON: what clock each figure was measured at)
clocks_start() {
  clk_pid=
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 \
    >"$OUT/clocks-$1.csv" 2>/dev/null &
  clk_pid=$!
}
clocks_stop() {   # stage, then the JSON files to join
  local stage=$1 f
  shift
  [ -n "$clk_pid" ] || return 0
  kill "$clk_pid" 2>/dev/null
  wait "$clk_pid" 2>/dev/null
  for f in "$@"; do
    [ -f "$f" ] && python3 benchmarks/clocks.py "$f" "$OUT/clocks-$stage.csv" >>"$OUT/clocks-$stage.txt" 2>&1
  done
  [ -f "$OUT/clocks-$stage.txt" ] && grep -E "prefill .* (attnjit|flashinfer_fa3|sdpa_cudnn) |TFLOP/s" \
    "$OUT/clocks-$stage.txt" | head -24
  return 0
}

setup_flashinfer() {   # FlashInfer 0.7.2 from the carried bundle, with its JIT output of an earlier run
  [ "$fi_flag" = "" ] && return
  [ -f .bench/flashinfer.tar.xz ] || return
  mkdir -p /tmp/fi /tmp/fiws && tar xJf .bench/flashinfer.tar.xz -C /tmp/fi &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/fi/site /tmp/fi/apache_tvm_ffi*.whl >/dev/null 2>&1 &&
    export PYTHONPATH=/tmp/fi/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a \
           MAX_JOBS=16 && fi_flag=""
  for f in .bench/fi-jit*.tar.xz; do [ -f "$f" ] && tar xJf "$f" -C /tmp/fiws; done
  # FlashInfer loads <package>/data/aot/<uri>/<uri>.so as it is (its JIT directory always goes through ninja, which
  # rebuilds on this machine): the modules scripts/flashinfer_prebuild.py built on the CPU machine go there
  [ -d /tmp/fiws/.cache/aot ] && ln -sfn /tmp/fiws/.cache/aot /tmp/fi/site/flashinfer/data/aot
  fi_files_before=$(find /tmp/fiws -type f | wc -l)
  touch /tmp/fiws/.carried   # what FlashInfer compiles from here on is newer: only that travels back
}

if has smoke; then   # each family, and sm90's three-consumer tile, on a few batches, each under its own timeout: a
  # hanging one is left out of the GPU tests (and tsweep) below, so a broken kernel costs seconds, not the call
  for entry in fa2 sm90 sm90:q192kv64 sm90:kv160 sm90:kv176q1; do
    t=$(date +%s)
    timeout -k 5 ${SMOKE_TIMEOUT:-120} python3 scripts/smoke.py $entry >"$OUT/smoke-${entry/:/-}.txt" 2>&1
    rc=$?
    summary+=("smoke $entry (rc=$rc, $(( $(date +%s) - t )) s): $(grep -c ' ok$' "$OUT/smoke-${entry/:/-}.txt") ok, $(grep -cE 'WRONG|ERROR' "$OUT/smoke-${entry/:/-}.txt") bad")
    cat "$OUT/smoke-${entry/:/-}.txt"
    if [ $rc = 124 ] || [ $rc = 137 ]; then
      echo "smoke: $entry timed out after the line above; GPU tests run without it, tsweep is skipped" >&2
      hung+=("${entry#*:}")              # the test ids' name for it: fa2, sm90, q192kv64
      [ "$entry" = sm90 ] && break       # its tile configurations would hang too
    fi
  done
  if [ ${#hung[@]} -gt 0 ]; then
    expr="not ${hung[0]}"; for h in "${hung[@]:1}"; do expr="$expr and not $h"; done
    set -- "$@" -k "$expr"
  fi
fi

if has tests; then
  t=$(date +%s)
  guard=(); python3 -c "import pytest_timeout" 2>/dev/null && guard=(--timeout "${TEST_TIMEOUT:-300}" --timeout-method thread)
  timeout -k 10 "${TESTS_BUDGET:-1800}" python3 -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/junit.xml" \
    -ra "${guard[@]}" "$@" >"$OUT/pytest.txt" 2>&1
  rc=$?
  summary+=("gpu tests (rc=$rc, $(( $(date +%s) - t )) s): $(tail -1 "$OUT/pytest.txt")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -40
fi

for s in sweep order dsweep fsweep tsweep; do
  has $s || continue
  if [ $s = tsweep ] && [ ${#hung[@]} -gt 0 ]; then summary+=("tsweep skipped: a smoke run hung (${hung[*]})"); continue; fi
  t=$(date +%s); flag=--sweep; [ $s = order ] && flag=--order-sweep; [ $s = dsweep ] && flag=--deep-sweep
  [ $s = fsweep ] && flag=--fp8-sweep
  [ $s = tsweep ] && flag=--sm90-sweep && setup_flashinfer
  python3 benchmarks/bench.py $flag ${SWEEP_ARGS:-} --json "$OUT/$s.json" >"$OUT/$s.txt" 2>"$OUT/$s.err"
  summary+=("$s (rc=$?, $(( $(date +%s) - t )) s)")
done

if has layouts; then   # decode TB/s by the contiguous bytes of a head's token row (issue 14's fp8 gap)
  python3 benchmarks/decode_layouts.py --json "$OUT/layouts.json" >"$OUT/layouts.txt" 2>"$OUT/layouts.err"
  summary+=("layouts (rc=$?)")
  cat "$OUT/layouts.txt"
fi

if has timeline; then   # the sm90 consumer's phases and what-if patches, kernels from .timeline-cache (no compile)
  IFS=';' read -ra tl_sets <<<"${TIMELINE_ARGS:-32x512 8x2048}"
  n=0
  clocks_start timeline
  for a in "${tl_sets[@]}"; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # each set is a list of arguments
    ATTNJIT_JIT=0 ATTNJIT_CACHE_DIR=$PWD/.timeline-cache timeout 300 python3 benchmarks/sm90_timeline.py $a \
      --json "$OUT/timeline-$n.json" >"$OUT/timeline-$n.txt" 2>&1
    summary+=("timeline $n ($a): rc=$?")
    grep -E "tflops|iteration_cycles|\"(epilogue|main loop|wait Q|to the next item)|Error|error|WRONG" \
      "$OUT/timeline-$n.txt" | head -24
  done
  clocks_stop timeline "$OUT"/timeline-*.json
fi
if has fixed; then   # decode's fixed cost per call: by KV length, split size, and against plain reads of the bytes
  python3 benchmarks/decode_fixed.py --json "$OUT/fixed.json" >"$OUT/fixed.txt" 2>"$OUT/fixed.err"
  summary+=("decode fixed cost (rc=$?)")
  cat "$OUT/fixed.txt"
fi

if has model; then
  t=$(date +%s)
  # the record-to-catalog loop: record a run, turn the record into a catalog, compare it with the committed one,
  # then run again in strict mode from .llama-cache (warmed from specs/llama-example.toml without a GPU)
  ATTNJIT_LOG="$OUT/llama-run.jsonl" python3 examples/llama_serving.py --graphs >"$OUT/llama-run.txt" 2>&1
  rc=$?
  python3 -m attnjit.cli catalog from-log "$OUT/llama-run.jsonl" -o "$OUT/llama-example.toml" >>"$OUT/llama-run.txt" 2>&1
  same=$(python3 -c "import attnjit as a; print(a.load_catalog('$OUT/llama-example.toml') == a.load_catalog('specs/llama-example.toml'))" 2>&1 | tail -1)
  summary+=("model run (rc=$rc): $(grep -m1 '^backend' "$OUT/llama-run.txt" | cut -c1-150)")
  summary+=("  catalog from its record equals specs/llama-example.toml: $same")
  if [ -d .llama-cache ]; then
    chmod -R go-w .llama-cache && chmod 700 .llama-cache
    ATTNJIT_JIT=0 ATTNJIT_CACHE_DIR=$PWD/.llama-cache ATTNJIT_LOG="$OUT/llama-strict.jsonl" \
      python3 examples/llama_serving.py --graphs >"$OUT/llama-strict.txt" 2>&1
    rc=$?
    hits=$(python3 -c "import json,collections; print(dict(collections.Counter(json.loads(l)['binary'] for l in open('$OUT/llama-strict.jsonl'))))" 2>&1 | tail -1)
    summary+=("  strict run from .llama-cache (ATTNJIT_JIT=0, rc=$rc): dispatches by binary source $hits")
  fi
  python3 examples/llama_serving.py --check-hf >"$OUT/llama-hf.txt" 2>&1
  summary+=("  example vs transformers (rc=$?): $(tail -1 "$OUT/llama-hf.txt" | cut -c1-160)")
fi

if has bench; then
  setup_flashinfer
  t=$(date +%s)
  clocks_start bench
  timeout -k 10 "${BENCH_BUDGET:-1800}" python3 benchmarks/bench.py $fi_flag ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    >"$OUT/bench.txt" 2>"$OUT/bench.err"
  summary+=("bench (rc=$?, $(( $(date +%s) - t )) s)")
  clocks_stop bench "$OUT/bench.json"
  python3 benchmarks/engine.py runtime >"$OUT/engine.json" 2>>"$OUT/bench.err"
  summary+=("engine: $(tail -1 "$OUT/engine.json")")
  tail -5 "$OUT/bench.err"
fi

if has tune; then   # attnjit tune on the benchmark's prefill spec: a tuning record, and the table it was chosen from
  t=$(date +%s)
  timeout -k 10 "${TUNE_BUDGET:-300}" python3 -m attnjit.cli tune --cache-dir "$OUT/tune-cache" --shape "${TUNE_SHAPE:-8x2048}" \
    --spec op=prefill,head_dim=128,page_size=16,dtype=bf16,mask=causal,group_size=4 \
    --spec op=prefill,head_dim=128,page_size=16,dtype=bf16,mask=none,group_size=4 >"$OUT/tune.txt" 2>&1
  summary+=("tune (rc=$?, $(( $(date +%s) - t )) s): $(grep -c 'recorded in' "$OUT/tune.txt") recorded")
  cat "$OUT/tune.txt"
  rm -rf "$OUT/tune-cache"
fi

if has plan; then   # plan() host time, attnjit and FlashInfer, host and device metadata
  setup_flashinfer
  python3 benchmarks/plan_host.py --json "$OUT/plan_host.json" >"$OUT/plan_host.txt" 2>"$OUT/plan_host.err"
  summary+=("plan host time (rc=$?): $(grep -c '"op"' "$OUT/plan_host.txt") rows in plan_host.json")
  python3 benchmarks/plan_host.py --profile "$OUT/plan_profile.txt" >/dev/null 2>>"$OUT/plan_host.err"
fi

if has profile; then   # Nsight Compute on the short prefill rows, attnjit and FlashInfer fa2 side by side
  setup_flashinfer
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # BxL (prefill), decode:BxL or prefix:BxL (cascade level 0); a :e4m3 / :e5m2 suffix profiles an fp8 cache
  for shape in ${PROFILE_SHAPES:-32x512 8x2048}; do
    op=prefill; case $shape in decode:*) op=decode; shape=${shape#decode:};; prefix:*) op=prefix; shape=${shape#prefix:};; esac
    kv=bf16; case $shape in *:*) kv=${shape#*:}; shape=${shape%%:*}-$kv;; esac   # file names: BxL or BxL-kv
    for who in attnjit flashinfer; do
      k="attnjit_(attention|sm90)"; [ $who = flashinfer ] && k="Prefill|Decode"
      PROFILE_KV=$kv "$ncu" --clock-control none -k regex:"$k" --launch-skip 2 --launch-count 1 --set full --import-source yes \
        -o "/tmp/ncu-$who-$shape" -f python3 benchmarks/profile_kernels.py $op ${shape%%-*} >"$OUT/ncu-log-$who-$shape.txt" 2>&1
      "$ncu" -i "/tmp/ncu-$who-$shape.ncu-rep" >"$OUT/ncu-$who-$shape.txt" 2>&1
      # every metric (ncu's messages apart)
      "$ncu" -i "/tmp/ncu-$who-$shape.ncu-rep" --page raw --csv 2>"$OUT/raw-$who-$shape.err" |
        xz -T0 >"$OUT/raw-$who-$shape.csv.xz"
      "$ncu" -i "/tmp/ncu-$who-$shape.ncu-rep" --page source --csv --print-source sass >"/tmp/src-$who-$shape.csv" 2>&1
      python3 benchmarks/ncu_source.py "/tmp/src-$who-$shape.csv" 30 >"$OUT/stalls-$who-$shape.txt" 2>&1
      cp "/tmp/src-$who-$shape.csv" "$OUT/"
    done
  done
  for f in "$OUT"/ncu-attnjit-*.txt "$OUT"/ncu-flashinfer-*.txt; do
    echo "== $(basename "$f")"
    grep -E "^  [A-Za-z].*\(|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Compute \(SM\) Th|Memory Throughput|L2 Hit|L1/TEX Hit|Dynamic Shared|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|DRAM Throughput|Grid Size|Waves Per SM" "$f" | head -40
  done >"$OUT/ncu-summary.txt"
  summary+=("profile: $(grep -c Duration "$OUT/ncu-summary.txt") kernels")
  cat "$OUT"/stalls-*.txt >>"$OUT/ncu-summary.txt"
fi

if has model; then
  setup_flashinfer
  t=$(date +%s)
  timeout -k 10 "${MODEL_BUDGET:-1800}" python3 benchmarks/model.py $([ -n "$fi_flag" ] && echo --backends attnjit) \
    --json "$OUT/model.json" >"$OUT/model.txt" 2>"$OUT/model.err"
  summary+=("model bench (rc=$?, $(( $(date +%s) - t )) s)")
  tail -5 "$OUT/model.err"
fi

if [ -d /tmp/fiws/.cache ] && [ "$(find /tmp/fiws -type f | wc -l)" != "${fi_files_before:-0}" ]; then
  # FlashInfer compiled something new: send back only those modules (the device tool returns files up to 16 MB)
  (cd /tmp/fiws && find .cache -newer .carried -type f -print0 | tar --null -T - -cf - | xz -T0 -6 >"$OUT/fi-jit-new.tar.xz")
fi

echo "=== summary ($(( $(date +%s) - t0 )) s)"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
for s in sweep order dsweep fsweep tsweep ncu-summary; do [ -f "$OUT/$s.txt" ] && cat "$OUT/$s.txt"; done
[ -f "$OUT/bench.txt" ] && cat "$OUT/bench.txt"
[ -f "$OUT/model.txt" ] && cat "$OUT/model.txt"
# the device tool brings back only a few files: everything else travels as one archive
(cd "$OUT" && tar -cJf /tmp/attnjit-details.tar.xz --exclude='*.tar.xz' --exclude=summary.txt . &&
  mv /tmp/attnjit-details.tar.xz details.tar.xz &&
  find . -type f ! -name '*.tar.xz' ! -name summary.txt -delete && find . -mindepth 1 -type d -empty -delete)
exit 0
