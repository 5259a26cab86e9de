#!/usr/bin/env bash
# Hardening runs: libFuzzer harnesses under ASan+UBSan, and the C++ tests under ThreadSanitizer.
#
#   scripts/fuzz.sh [smoke]      build build/fuzz, replay tests/fuzz/regressions, then fuzz every
#                                harness for FUZZ_SECONDS (default 25) each
#   scripts/fuzz.sh long         the same with FUZZ_SECONDS=600 by default, FUZZ_JOBS parallel jobs
#   scripts/fuzz.sh regressions  only replay the saved inputs
#   scripts/fuzz.sh tsan         build build/tsan (clang, -DFBN_SANITIZE=thread) and run the
#                                concurrency stress tests (FBN_STRESS_ROUNDS passes, default 3) and
#                                every other C++ test under TSan
#   scripts/fuzz.sh all          smoke, then tsan
#
# CI (scripts/test.sh without --fast) runs `FUZZ_SECONDS=20 scripts/fuzz.sh smoke` and
# `scripts/fuzz.sh tsan`: about 2.5 + 2 minutes on 2 cores, builds included. A longer campaign:
# `FUZZ_SECONDS=600 FUZZ_JOBS=2 scripts/fuzz.sh long`, `FBN_STRESS_ROUNDS=50 scripts/fuzz.sh tsan`.
#
# Environment: FUZZ_SECONDS, FUZZ_JOBS (default 1), FUZZ_ONLY (a harness name to run alone),
# FUZZ_BUILD_DIR (build/fuzz), TSAN_BUILD_DIR (build/tsan), FBN_STRESS_ROUNDS (stress passes),
# BUILD_JOBS (2). Findings go to $FUZZ_BUILD_DIR/artifacts/<harness>/ (crash-*, timeout-*, oom-*);
# new corpus entries to $FUZZ_BUILD_DIR/corpus/<harness>/. Exit status: non-zero on any finding.
# Every run prints a per-harness summary: executions, executions per second, corpus size, findings.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-smoke}
build_jobs=${BUILD_JOBS:-2}
fuzz_dir=${FUZZ_BUILD_DIR:-build/fuzz}
tsan_dir=${TSAN_BUILD_DIR:-build/tsan}
CC_=${CC:-clang-14}
CXX_=${CXX:-clang++-14}

build_fuzzers() {
  echo "== building libFuzzer harnesses in $fuzz_dir (clang, ASan+UBSan)"
  CC=$CC_ CXX=$CXX_ cmake -S . -B "$fuzz_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFBN_BUILD_FUZZERS=ON -DFBN_SANITIZE="address;undefined" -DFBN_BUILD_TESTS=OFF \
    -DFBN_BUILD_BENCHMARKS=OFF -DFBN_BUILD_EXAMPLES=OFF -DFBN_INSTALL=OFF >/dev/null
  cmake --build "$fuzz_dir" -j "$build_jobs"
}

harnesses() {
  local all
  all=$(cd "$fuzz_dir/tests/fuzz" && ls ./*_fuzzer 2>/dev/null | sed 's|^\./||')
  if [ -n "${FUZZ_ONLY:-}" ]; then echo "$FUZZ_ONLY"; else echo "$all"; fi
}

export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}

replay_regressions() {
  local failed=0 h dir
  echo "== replaying tests/fuzz/regressions"
  for h in $(harnesses); do
    dir=tests/fuzz/regressions/$h
    [ -d "$dir" ] || continue
    if "$fuzz_dir/tests/fuzz/$h" -runs=0 "$dir" >"$fuzz_dir/$h.regressions.log" 2>&1; then
      printf '  %-32s %3d inputs  ok\n' "$h" "$(ls "$dir" | wc -l)"
    else
      printf '  %-32s FAILED (see %s)\n' "$h" "$fuzz_dir/$h.regressions.log"
      failed=1
    fi
  done
  return $failed
}

run_fuzzers() {
  local seconds=$1 jobs=${FUZZ_JOBS:-1} failed=0 h corpus artifacts log execs status findings
  local line total=0 start elapsed
  local summary=()
  echo "== fuzzing: ${seconds}s per harness, $jobs job(s)"
  printf '  %-32s %7s %12s %9s %7s  %s\n' harness seconds executions "execs/s" corpus result
  for h in $(harnesses); do
    corpus=$fuzz_dir/corpus/$h
    artifacts=$fuzz_dir/artifacts/$h/
    log=$fuzz_dir/$h.fuzz.log
    mkdir -p "$corpus" "$artifacts"
    start=$SECONDS
    local seeds=()
    [ -d "tests/fuzz/seeds/$h" ] && seeds=("tests/fuzz/seeds/$h")
    local args=(-max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
                -artifact_prefix="$artifacts")
    if [ "$jobs" -gt 1 ]; then args+=(-jobs="$jobs" -workers="$jobs"); fi
    if "$fuzz_dir/tests/fuzz/$h" "${args[@]}" "$corpus" "${seeds[@]}" >"$log" 2>&1; then
      status=ok
    else
      status=FINDING
      failed=1
    fi
    elapsed=$((SECONDS - start))
    # With -jobs the statistics are in fuzz-<n>.log files; sum what there is.
    execs=$({ cat "$log"; cat fuzz-*.log 2>/dev/null || true; } |
            awk '/stat::number_of_executed_units/ {s += $2} END {print s + 0}')
    findings=$(find "$artifacts" -type f | wc -l)
    [ $status = ok ] || status="FINDING ($findings file(s) in $artifacts; log $log)"
    line=$(printf '  %-32s %7s %12s %9s %7d  %s' "$h" "${elapsed}s" "$execs" \
                  "$((execs / (elapsed > 0 ? elapsed : 1)))" "$(ls "$corpus" | wc -l)" "$status")
    echo "$line"
    summary+=("$line")
    total=$((total + execs))
    rm -f fuzz-*.log
    if [ "$status" != ok ]; then
      grep -E "ERROR|runtime error|fbn fuzz check|SUMMARY|Test unit written" "$log" | head -20 || true
    fi
  done
  echo "== fuzzing summary (${seconds}s per harness; $total executions in all)"
  printf '  %-32s %7s %12s %9s %7s  %s\n' harness seconds executions "execs/s" corpus result
  printf '%s\n' "${summary[@]}"
  return $failed
}

run_tsan() {
  echo "== ThreadSanitizer build in $tsan_dir (clang, -DFBN_SANITIZE=thread)"
  CC=$CC_ CXX=$CXX_ cmake -S . -B "$tsan_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFBN_SANITIZE=thread -DFBN_BUILD_TESTS=ON -DFBN_BUILD_BENCHMARKS=OFF \
    -DFBN_BUILD_EXAMPLES=OFF -DFBN_INSTALL=OFF >/dev/null
  cmake --build "$tsan_dir" -j "$build_jobs"
  # exitcode 66: a test with a TSan report fails even when its assertions pass.
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=0:exitcode=66:second_deadlock_stack=1}
  export FBN_STRESS_ROUNDS=${FBN_STRESS_ROUNDS:-3}
  echo "== concurrency stress tests under TSan"
  ctest --test-dir "$tsan_dir" --output-on-failure -L stress
  echo "== every other C++ test under TSan"
  ctest --test-dir "$tsan_dir" --output-on-failure -j "$build_jobs" -LE stress -E 'consumer|bench'
}

case "$mode" in
  smoke)
    build_fuzzers
    replay_regressions
    run_fuzzers "${FUZZ_SECONDS:-25}"
    ;;
  long)
    build_fuzzers
    replay_regressions
    run_fuzzers "${FUZZ_SECONDS:-600}"
    ;;
  regressions)
    build_fuzzers
    replay_regressions
    ;;
  tsan)
    run_tsan
    ;;
  all)
    build_fuzzers
    replay_regressions
    run_fuzzers "${FUZZ_SECONDS:-25}"
    run_tsan
    ;;
  *)
    echo "usage: scripts/fuzz.sh [smoke|long|regressions|tsan|all]" >&2
    exit 2
    ;;
esac
