#!/usr/bin/env bash
# Create .venv at the repository root (if needed) and install the project with pinned versions.
# Usage: scripts/setup.sh [extra ...]   e.g. scripts/setup.sh test
# The interpreter: $PYTHON, else python3.11, python3.12 or python3, whichever is 3.11 or 3.12.
# A .venv made with another Python (or broken) is replaced. Says what it does on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }
supported() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else 1)' 2>/dev/null; }
version() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo "unknown"; }

if [ -e .venv ] && ! supported .venv/bin/python; then
  say ".venv has Python $(version .venv/bin/python), not 3.11 or 3.12 (or it is broken): replacing it"
  rm -rf .venv
fi

if [ ! -x .venv/bin/python ]; then
  PY=""
  for candidate in ${PYTHON:-} python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null && supported "$candidate"; then PY=$(command -v "$candidate"); break; fi
  done
  if [ -z "$PY" ]; then
    found=$(command -v python3 >/dev/null && echo "python3 is $(version python3)" || echo "no python3 on PATH")
    say "needs Python 3.11 or 3.12 ($found); install one, or set PYTHON=/path/to/python3.11"
    exit 1
  fi
  say "creating .venv with Python $(version "$PY") ($PY)"
  "$PY" -m venv .venv
fi

# "ui" always: the scripts start the UI and `dg` (dagster-webserver, dagster-dg-cli).
extras=$(IFS=,; echo "ui${*:+,$*}")
hash=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16)
# Up to date if a stamp of this hash covers every extra asked for (a "test" install covers base).
for stamp in .venv/.installed-"$hash"-*; do
  [ -f "$stamp" ] || continue
  covered=1
  for extra in "$@"; do
    case ",${stamp##*-}," in *",$extra,"*) ;; *) covered=0 ;; esac
  done
  [ "$covered" = 1 ] && exit 0
done

log=.venv/setup.log
: > "$log"
# pip's own lines go to the log; one line per package (or one updating line on a terminal) here.
progress() {
  local n=0 line name
  while IFS= read -r line; do
    echo "$line" >> "$log"
    case "$line" in
      Collecting*|"Requirement already satisfied"*)
        n=$((n + 1))
        name=${line#Collecting }; name=${name#Requirement already satisfied: }; name=${name%% *}
        if [ -t 2 ]; then printf '\rsetup:   %3d requirements resolved (%s)\033[K' "$n" "$name" >&2
        elif [ "${line%% *}" = Collecting ]; then echo "setup:   collecting $name" >&2; fi ;;
      "Installing collected packages: "*)
        [ -t 2 ] && printf '\n' >&2
        name=${line#Installing collected packages: }
        say "installing $(echo "$name" | tr ',' '\n' | wc -l | tr -d ' ') package(s): ${name:0:160}" ;;
    esac
  done
  [ -t 2 ] && [ "$n" -gt 0 ] && printf '\n' >&2
  return 0
}
install() {
  if ! .venv/bin/python -m pip install --disable-pip-version-check "$@" 2>&1 | progress; then
    say "pip failed; the last lines of $log:"
    tail -n 15 "$log" | sed 's/^/  /' >&2
    exit 1
  fi
}
say "upgrading pip"
install --upgrade pip
say "installing aml_pipeline${extras:+ [$extras]} and its pinned dependencies (dagster, duckdb, numpy, ...); about a minute the first time"
install -c requirements/constraints.txt -e ".${extras:+[$extras]}"
rm -f .venv/.installed-*
touch ".venv/.installed-$hash-${extras:-base}"
say "done: .venv is ready (.venv/bin/aml-pipeline, .venv/bin/dg)"
