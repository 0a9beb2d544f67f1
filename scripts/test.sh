#!/usr/bin/env bash
# Every test tier, in order of cost, each recorded as pass/fail; ends with one summary line
#   summary: N passed, N failed, N skipped
# where pytest contributes its test counts and every other stage (lint, molecule scenario) counts as one.
# Usage: scripts/test.sh [lint|pytest|molecule|quick]...   (default: lint pytest molecule)
#   quick: the inner loop (make test-quick): the lint stages, then both pytest tiers with -m "not slow"; no
#   molecule, and none of the stages run beside the others (tiny target, CT image). Never a stand-in for the rest.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# COLUMNS: molecule's output is not folded at 80 columns, so a failure's message stays on one searchable line.
export PATH="$ROOT/.venv/bin:$PATH" ANSIBLE_FORCE_COLOR=false PY_COLORS=0 NO_COLOR=1 COLUMNS=250
REPORTS=$(mktemp -d /tmp/eagle3-test.XXXXXX)
trap 'rm -rf "$REPORTS"' EXIT

passed=0 failed=0 skipped=0 failures=() timings=()
SUITE_START=$SECONDS
timing() {  # timing NAME T0 RESULT: one row of the closing table
    timings+=("$(printf '%-22s %6ss  %s' "$1" $((SECONDS - $2)) "$3")")
}
stage() {  # stage NAME CMD...: a stage that counts as one test
    local name=$1; shift
    local t0=$SECONDS
    printf '\n=== %s: %s\n' "$name" "$*"
    if "$@" 2>&1 | tee "$REPORTS/stage-$name.log"; then
        passed=$((passed + 1)); printf '=== %s: ok (%ss)\n' "$name" $((SECONDS - t0)); timing "$name" "$t0" ok
    else
        failed=$((failed + 1)); failures+=("$name"); printf '=== %s: FAILED (%ss)\n' "$name" $((SECONDS - t0))
        timing "$name" "$t0" FAILED
    fi
}
digest() {  # digest NAME: why a failed stage failed, printed again near the end (CI keeps only the output's tail)
    local log="$REPORTS/stage-$1.log"
    [ -f "$log" ] || log="$REPORTS/$1.log"
    [ -f "$log" ] || return 0
    local pattern='fatal: \[|failed: \[|FAILED! =>|Traceback|^E  |^FAILED |^ERROR |would be reformatted|^[A-Z]+[0-9]+ '
    printf '\n--- why %s failed (from its log: each fatal, failed or error line with what follows, else its end) ---\n' "$1"
    if grep -a -q -E "$pattern" "$log"; then
        grep -a -A14 -E "$pattern" "$log" | tail -80 | cut -c1-400
    else
        tail -30 "$log" | cut -c1-400
    fi
}
pytest_run() {  # pytest_run NAME PYTHON DIR ARGS...: runs one tier into $REPORTS/NAME.{log,xml,rc,secs}
    local name=$1 py=$2 dir=$3; shift 3
    local t0=$SECONDS
    # --durations: the slowest 50 tests are named at the end of every run, so a slow test is seen before it is costly.
    (cd "$dir" && "$py" -m pytest -q -p no:cacheprovider --durations=50 --junitxml="$REPORTS/$name.xml" "$@") \
        > "$REPORTS/$name.log" 2>&1
    echo $? > "$REPORTS/$name.rc"
    echo $((SECONDS - t0)) > "$REPORTS/$name.secs"
}
pytest_account() {  # pytest_account NAME DIR: prints the tier's output and adds pytest's own counts
    local name=$1 dir=$2
    local xml="$REPORTS/$name.xml" rc secs p=0 f=0 s=0
    rc=$(cat "$REPORTS/$name.rc") secs=$(cat "$REPORTS/$name.secs")
    printf '\n=== %s: pytest %s\n' "$name" "$dir"
    cat "$REPORTS/$name.log"
    if [ "$rc" -eq 5 ]; then
        # No test collected: a broken collection must never pass silently.
        failed=$((failed + 1)); failures+=("$name (no tests collected)")
        printf '=== %s: FAILED: pytest collected no tests in %s\n' "$name" "$dir"
        timing "$name" $((SECONDS - secs)) "FAILED (no tests collected)"
        return
    fi
    if [ -f "$xml" ]; then
        read -r p f s < <("$ROOT/.venv/bin/python" - "$xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t - f - sk, f, sk)
PY
        )
        passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    fi
    if [ "$rc" -ne 0 ]; then
        failures+=("$name (rc=$rc)")
        [ -f "$xml" ] && [ "${f:-0}" -gt 0 ] || failed=$((failed + 1))
    fi
    printf '=== %s: rc=%s (%ss)\n' "$name" "$rc" "$secs"
    # timing takes a start time: the tier's own wall time, measured in pytest_run, gives it.
    timing "$name" $((SECONDS - secs)) \
        "$([ "$rc" -eq 0 ] && echo ok || echo "FAILED (rc=$rc)"): $p passed, $f failed, $s skipped"
}

lint_stages() {  # the lint stages, each counted as one test
    stage ruff-check ruff check .
    stage ruff-format ruff format --check .
    stage ansible-lint ansible-lint --profile production -q
}
pytest_tiers() {  # pytest_tiers NAME ARGS...: both pytest tiers, ARGS passed to each pytest, then their accounts
    local name=$1; shift
    # The two tiers run side by side: the controller tier mostly waits on single-threaded ansible-playbook
    # runs and the trainer tier on torch processes, so together they fill the 2 cores better than in turn.
    # Their output is printed one tier after the other; their wall times overlap (and add up to more than
    # the "NAME, both tiers" line).
    local t0=$SECONDS controller
    printf '\n=== %s: the controller and trainer tiers side by side\n' "$name"
    pytest_run pytest-controller "$ROOT/.venv/bin/python" "$ROOT" tests "$@" &
    controller=$!
    pytest_run pytest-trainer "$ROOT/.venv-train/bin/python" "$ROOT/training" tests "$@"
    wait "$controller"
    pytest_account pytest-controller "$ROOT"
    pytest_account pytest-trainer "$ROOT/training"
    timing "$name, both tiers" "$t0" "side by side"
}

want=("$@"); [ ${#want[@]} -gt 0 ] || want=(lint pytest molecule)
wants() { [[ " ${want[*]} " == *" $1 "* ]]; }
declare -A beside_pid=()
beside() {  # beside NAME CMD...: a stage started in the background, into $REPORTS/stage-NAME.{log,rc,secs}
    local name=$1; shift
    (s0=$SECONDS; "$@" > "$REPORTS/stage-$name.log" 2>&1; echo $? > "$REPORTS/stage-$name.rc"
     echo $((SECONDS - s0)) > "$REPORTS/stage-$name.secs") &
    beside_pid[$name]=$!
}
collect() {  # collect NAME: once, waits for a background stage, prints its output and counts it as one test
    local name=$1 rc secs
    [ -n "${beside_pid[$name]:-}" ] || return 0
    wait "${beside_pid[$name]}"
    unset "beside_pid[$name]"
    rc=$(cat "$REPORTS/stage-$name.rc") secs=$(cat "$REPORTS/stage-$name.secs")
    printf '\n=== %s (it ran beside the stages before this line)\n' "$name"
    cat "$REPORTS/stage-$name.log"
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1)); printf '=== %s: ok (%ss)\n' "$name" "$secs"; timing "$name (beside)" $((SECONDS - secs)) ok
    else
        failed=$((failed + 1)); failures+=("$name"); printf '=== %s: FAILED (%ss)\n' "$name" "$secs"
        timing "$name (beside)" $((SECONDS - secs)) FAILED
    fi
}
# The tiny real target (training/eagle3/tiny_target.py) that the trainer tier and the lxc scenario share: built once
# and cached like the root file system, in the background while lint runs (ansible-lint keeps one core busy), and
# waited for before the tests that read it.
if wants pytest || wants molecule; then
    beside tiny-target env -C "$ROOT/training" HF_HUB_OFFLINE=1 "$ROOT/.venv-train/bin/python" -c \
        'from eagle3.tiny_target import cached; print(cached())'
fi
# The local CT's root file system (mmdebstrap, cached), for the scenarios with CTs: built beside the stages before them.
if wants molecule; then
    beside ct-image ansible-playbook -i inventory/local playbooks/local_ct_image.yml
fi
# The two light molecule scenarios (localhost; a fake PVE API: no CT, no trainer) run beside lint as well.
early_scenarios=()
if wants lint && wants molecule; then
    for s in default pve; do
        [ -f "molecule/$s/molecule.yml" ] && { beside "molecule-$s" molecule test -s "$s"; early_scenarios+=("$s"); }
    done
fi
for w in "${want[@]}"; do
    case "$w" in
    lint) lint_stages ;;
    pytest)
        collect tiny-target
        pytest_tiers pytest
        ;;
    quick)
        # The tests marked slow (ansible-playbook, multi-process and learning runs) are deselected: pytest's count
        # of them is in each tier's last line. A trainer test that needs the tiny target builds it itself.
        lint_stages
        pytest_tiers "pytest not slow" -m "not slow"
        ;;
    molecule)
        collect tiny-target
        collect ct-image
        for s in default pve lxc pipeline multinode; do
            [ -f "molecule/$s/molecule.yml" ] && continue
            printf '\n=== molecule-%s: missing\n' "$s"; failed=$((failed + 1)); failures+=("molecule-$s (missing)")
        done
        for s in default pve; do
            [ -f "molecule/$s/molecule.yml" ] || continue
            if [[ " ${early_scenarios[*]} " == *" $s "* ]]; then collect "molecule-$s"; else stage "molecule-$s" molecule test -s "$s"; fi
        done
        # The three scenarios with CTs side by side (their own lxcpaths, VMIDs and network namespace; the root file
        # system is built above): most of their time is one task after another through pct exec, each waiting on
        # the previous one, and the trainers in the CTs run at nice 19, so one scenario's tasks fill the gaps of
        # the others'. pipeline holds the cases split off lxc (same tasks files, a CT of its own). Their output is
        # printed after lxc's.
        [ -f molecule/multinode/molecule.yml ] && beside molecule-multinode molecule test -s multinode
        [ -f molecule/pipeline/molecule.yml ] && beside molecule-pipeline molecule test -s pipeline
        [ -f molecule/lxc/molecule.yml ] && stage molecule-lxc molecule test -s lxc
        collect molecule-pipeline
        collect molecule-multinode
        ;;
    *) echo "unknown stage $w (lint|pytest|molecule|quick)" >&2; exit 2 ;;
    esac
done

echo
echo "stage wall times:"
[ -z "${EAGLE3_SETUP_SECONDS:-}" ] || printf '  %-22s %6ss  %s\n' setup "$EAGLE3_SETUP_SECONDS" ok
printf '  %s\n' "${timings[@]}"
printf '  %-22s %6ss\n' total $((SECONDS - SUITE_START + ${EAGLE3_SETUP_SECONDS:-0}))
for f in "${failures[@]}"; do digest "${f%% (*}"; done
[ ${#failures[@]} -eq 0 ] || printf 'failed stages: %s\n' "${failures[*]}"
echo "summary: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
