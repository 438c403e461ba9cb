# CI's stage times against the numbers recorded in CONTRIBUTING.md ("CI stage times", the table
# after the `ci-stage-times` marker) and against the budget.  Sourced by .ci/run; bash only (no
# pipelines: nothing here can fail at random under pipefail).
#
#   check_stage KEY SECONDS   prints a warning line (kept for the end) when SECONDS is more than
#                             20 % over the recorded number of stage KEY
#   budget_line TOTAL         the total against CI_BUDGET_S, then every warning again
CI_BUDGET_S=${CI_BUDGET_S:-1500}
CI_TIMES_FILE=${CI_TIMES_FILE:-CONTRIBUTING.md}
CI_WARNINGS=()

recorded_s() {  # the recorded seconds of stage $1, or nothing
  awk -F'|' -v k="$1" '
    /<!-- ci-stage-times -->/ { on = 1; next }
    on && !/^\|/ && seen { on = 0 }
    on && /^\|/ { seen = 1; key = $2; gsub(/[ `]/, "", key); v = $3; gsub(/[^0-9]/, "", v)
                  if (key == k && v != "") print v }' "$CI_TIMES_FILE"
}

check_stage() {
  local rec w
  rec=$(recorded_s "$1")
  if [ -z "$rec" ]; then
    echo "[ci] stage $1: $2 s (no recorded number in $CI_TIMES_FILE, \"CI stage times\")"
    return 0
  fi
  if [ $(( $2 * 10 )) -gt $(( rec * 12 )) ]; then
    w="[ci] WARNING: stage $1 took $2 s, $(( ($2 - rec) * 100 / rec )) % over its recorded $rec s (CONTRIBUTING.md, \"CI stage times\"): see what grew (--durations) before the budget is gone"
    CI_WARNINGS+=("$w")
    echo "$w"
  fi
}

budget_line() {
  if [ "$1" -le "$CI_BUDGET_S" ]; then
    echo "[ci] total $1 s of the $CI_BUDGET_S s budget ($(( CI_BUDGET_S - $1 )) s left)"
  else
    echo "[ci] total $1 s: OVER the $CI_BUDGET_S s budget by $(( $1 - CI_BUDGET_S )) s"
  fi
  local w
  for w in "${CI_WARNINGS[@]}"; do echo "$w"; done
}
