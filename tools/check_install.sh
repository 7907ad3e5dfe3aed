#!/usr/bin/env bash
# Dry-run every `pip install` of the README's numbered commands (1: main job, 2: tests,
# 3: GRPO) in a fresh virtual environment (stock python3 and its own pip), and fail unless
# each resolves and any torch it would install is exactly the version constraints.txt pins
# (a CPU build; no CUDA wheels).
#
#   tools/check_install.sh            # exit 0: every command would install as written
#
# Used by .ci/run before the real install, so a dependency set that no longer resolves fails
# in about a minute with the resolver's own message.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
want_torch=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' constraints.txt)
[[ -n "$want_torch" ]] || { echo "check_install: constraints.txt pins no torch==X" >&2; exit 2; }

venv=$(mktemp -d "${TMPDIR:-/tmp}/rlbuffers-check-install.XXXXXX")
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
echo "check_install: fresh venv $(python3 --version), $(python3 -m pip --version | cut -d' ' -f1-2)"

status=0
for n in 1 2 3; do
    while IFS= read -r step; do
        log="$venv/step.log"
        if ! eval "$step --dry-run" >"$log" 2>&1; then
            echo "FAIL README command $n: '$step' does not resolve:" >&2
            grep -E "ERROR|conflict|depends on" "$log" | head -20 >&2
            status=1
            continue
        fi
        would=$(grep '^Would install' "$log" || true)
        torch=$(tr ' ' '\n' <<<"$would" | sed -n 's/^torch-//p')
        cuda=$(tr ' ' '\n' <<<"$would" | grep -E '^nvidia-|^triton-' || true)
        if [[ -n "$torch" && "$torch" != "$want_torch" && "$torch" != "$want_torch+"* ]]; then
            echo "FAIL README command $n: '$step' would install torch $torch, not $want_torch" >&2
            status=1
        elif [[ -n "$cuda" ]]; then
            echo "FAIL README command $n: '$step' would install CUDA wheels: $(echo $cuda)" >&2
            status=1
        else
            echo "ok   README command $n: '$step' resolves (torch: ${torch:-not installed by it})"
        fi
    done < <(python3 tools/readme_command.py "$n" --installs)
done
exit $status
