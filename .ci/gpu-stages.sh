# The stages of .ci/gpu and their summary, sourced by it (and by tests/unit/test_ci_gpu_stages.py on any machine).
#
# The caller sets LOG (the whole log, appended to), WORK (a folder for each stage's own log), TOTAL_S (seconds for
# every stage together) and START ($SECONDS when the first began), then calls
#
#   stage [--may-skip] NAME BUDGET_S COMMAND...   # COMMAND under `timeout`, at most BUDGET_S, never past TOTAL_S
#   summary                                       # a line per stage; returns 1 when the check failed
#
# A stage's status: "ok"; "ok, N skipped" where some of its tests skipped; "skipped" where it proved nothing: every
# test it collected skipped (pytest's last line counts skipped tests only), or it collected none (pytest's exit 5),
# or the command said it cannot run here (exit 77, users_loop.py's and users_recipes.py's "skipped: ..."); "TIMEOUT";
# "FAILED (exit N)"; "NOT RUN" when the check's time was spent before it. Every stage must run on a GPU unless
# declared --may-skip: a skipped one fails the summary ("SKIPPED: must run on a GPU"), since a GPU check whose
# stages all skipped would otherwise print "ok" without having checked anything.

SUMMARY=()
FAILED=0
NOT_SELECTED=0
SKIPPED_EXIT=77
# HF_RTP_GPU_STAGES=recipes,trl: only those stages (and `versions`, which starts the world the others run in), to
# rerun what a call found wrong in a short second call; the summary then says the check was partial
SELECTED=${HF_RTP_GPU_STAGES:-}

# the status of a stage that ran, from its exit code and its output's last pytest summary line
stage_status() { # RC OUTPUT_FILE
  local rc=$1 out=$2 line
  case $rc in
    124 | 137) echo "TIMEOUT" && return ;;
    "$SKIPPED_EXIT") echo "skipped" && return ;;
    5) echo "skipped" && return ;; # pytest: no test collected (all deselected, or none there)
  esac
  if ((rc != 0)); then
    echo "FAILED (exit $rc)"
    return
  fi
  # pytest's last line: "===== 3 passed, 1 skipped in 9.1s =====", "==== 5 skipped in 0.4s ====" (-q: undecorated)
  line=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$out" | tail -n 1)
  if [ -n "$line" ] && ! grep -qE '[0-9]+ (passed|failed|error|errors|xfailed|xpassed)' <<<"$line"; then
    echo "skipped"
  elif grep -qE '[0-9]+ skipped' <<<"$line"; then
    echo "ok, $(grep -oE '[0-9]+ skipped' <<<"$line")"
  else
    echo "ok"
  fi
}

stage() {
  local may_skip=0
  if [ "$1" = --may-skip ]; then
    may_skip=1
    shift
  fi
  local name=$1 budget=$2 began rc status last
  shift 2
  if [ -n "$SELECTED" ] && [ "$name" != versions ] && [[ ",$SELECTED," != *",$name,"* ]]; then
    SUMMARY+=("$(printf '%-17s %4d s  %s' "$name" 0 "not selected (HF_RTP_GPU_STAGES)")")
    NOT_SELECTED=$((NOT_SELECTED + 1))
    return
  fi
  local left=$((TOTAL_S - (SECONDS - START)))
  ((budget > left)) && budget=$left
  if ((budget < 5)); then
    SUMMARY+=("$(printf '%-17s %4d s  %s' "$name" 0 "NOT RUN: the check's time was spent")")
    FAILED=1
    return
  fi
  echo "=== $name (at most $budget s)" | tee -a "$LOG"
  began=$SECONDS
  timeout -k 10 "$budget" "$@" 2>&1 | tee "$WORK/$name.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  status=$(stage_status "$rc" "$WORK/$name.log")
  case $status in
    ok*) ;;
    skipped)
      if ((!may_skip)); then
        status="SKIPPED: must run on a GPU"
        FAILED=1
      fi
      ;;
    *) FAILED=1 ;;
  esac
  last=$(grep -v '^[[:space:]]*$' "$WORK/$name.log" | tail -n 1 | cut -c1-110)
  SUMMARY+=("$(printf '%-17s %4d s  %-26s %s' "$name" $((SECONDS - began)) "$status" "$last")")
}

# whether the last stage failed (for a stage that runs only then: QLoRA's traced run)
last_stage_failed() {
  [ "${SUMMARY[-1]}" != "${SUMMARY[-1]/FAILED/}" ]
}

summary() {
  echo
  echo "=== .ci/gpu: $((SECONDS - START)) s${SUMMARY_NOTE:+; $SUMMARY_NOTE}"
  printf '%s\n' "${SUMMARY[@]}"
  if ((FAILED)); then
    echo "=== .ci/gpu: FAILED (a stage failed, timed out, was not run, or skipped where it must run)"
  elif ((NOT_SELECTED)); then
    echo "=== .ci/gpu: the selected stages passed; $NOT_SELECTED not selected (HF_RTP_GPU_STAGES=$SELECTED): a partial check"
  else
    echo "=== .ci/gpu: every stage ran and passed"
  fi
  return $FAILED
}
