#!/usr/bin/env bash
# The closing summary of CI's test runs: how many tests ran, passed, failed, were ignored or
# skipped, and why each skip happened.
#
#   scripts/ci/test_summary.sh TEST_LOG STATUS SKIP_LOG...
#
# TEST_LOG: the output of the `cargo test` runs, one after another. STATUS: their exit status.
# SKIP_LOG: one file per `cargo test` run, the ALLGRAD_SKIP_LOG it ran with (a missing file is
# a run that skipped nothing). ALLGRAD_REQUIRE names the needs this machine provides: a skip for
# one of them makes the summary exit 1.
#
# Counts:
# - passed, failed and ignored are the sums of cargo's `test result:` lines;
# - a child helper (a `#[test]` that other tests run as a child process, marked
#   `#[ignore = "child helper: ..."]`) is no test: it is counted neither as ignored nor as
#   skipped, only listed;
# - a skipped test is one test, however many skip lines it printed (a test that lacks AVX2 and
#   AVX-512 prints two): per run, the distinct `<binary>::<test>` names of its skip log. cargo
#   counts a skipped test as passed, so these come off the passed count.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 TEST_LOG STATUS [SKIP_LOG...]" >&2
  exit 2
fi
log=$1
test_status=$2
shift 2
skip_logs=()
for f in "$@"; do
  [[ -f $f ]] && skip_logs+=("$f")
done
[[ -f $log ]] || { echo "$0: no test log at $log" >&2; exit 2; }

read -r runs passed failed ignored < <(awk '/^test result: /{
    for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?/) p += $i; if ($(i+1) ~ /^failed;?/) f += $i; if ($(i+1) ~ /^ignored;?/) g += $i }
    n++ } END { print n + 0, p + 0, f + 0, g + 0 }' "$log")
# Every run of a child helper shows as one `... ignored, child helper: ...` line.
helpers=$(grep -c -E '^test .* \.\.\. ignored, child helper' "$log" || true)
skipped=0
for f in ${skip_logs[@]+"${skip_logs[@]}"}; do
  n=$(awk '/^SKIPPED /{print $2}' "$f" | sort -u | wc -l)
  skipped=$((skipped + n))
done
all_skips() { [[ ${#skip_logs[@]} -gt 0 ]] && cat "${skip_logs[@]}" | sort -u; true; }

echo "ci: ---------------------------------------------------------------- summary"
echo "ci: cargo test --workspace, then the GPU tests' harness on the CPU: $runs test runs (test binaries and doc-tests), exit status $test_status"
if [[ $test_status != 0 ]]; then
  echo "ci: cargo test stopped at the first failing test binary: the counts cover the runs before it"
  grep -E '^(test .* FAILED|---- .* stdout ----|failures:)$' "$log" | sort -u | sed 's/^/ci:   /' || true
fi
echo "ci: ignored (#[ignore], diagnostics run by hand): $((ignored - helpers))"
grep -E '^test .* \.\.\. ignored(, .*)?$' "$log" | grep -v -E '\.\.\. ignored, child helper' \
  | sed -E 's/^test (.*) \.\.\. ignored(, (.*))?$/ci:   \1 \3/; s/ $//' | sort -u || true
echo "ci: child helpers (run by other tests as child processes; not tests, not counted): $helpers"
grep -E '^test .* \.\.\. ignored, child helper' "$log" | sed -E 's/^test (.*) \.\.\. ignored, (.*)$/ci:   \1 (\2)/' | sort -u || true
echo "ci: skipped at run time (counted by cargo as passed): $skipped"
all_skips | sed 's/^/ci:   /'
# A skip for a need this machine provides has already failed its test; this is the net.
bad=0
require=${ALLGRAD_REQUIRE:-}
for key in ${require//,/ }; do
  if all_skips | grep -q "^SKIPPED [^ ]* \[$key\]"; then
    echo "ci: error: a test skipped for want of [$key], which this machine provides"
    bad=1
  fi
done
echo "tests: $((passed - skipped)) passed, $failed failed, $((skipped + ignored - helpers)) skipped"
exit $bad
