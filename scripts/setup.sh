#!/usr/bin/env bash
# Create (or reuse) the pinned virtual environment of one stack: .venv/<stack>.
#   scripts/setup.sh user     torch 2.8.0 + accelerate 1.13.0 (the reporter's stack)
#   scripts/setup.sh newest   torch 2.14.1 + accelerate 1.15.0
# Idempotent: a stamp holding the hash of the lock file and pyproject.toml skips
# the install when nothing changed, so a second run costs about a second.
set -euo pipefail
stack="${1:-user}"
root="$(cd "$(dirname "$0")/.." && pwd)"
lock="$root/requirements/${stack}-stack.lock"
[ -f "$lock" ] || { echo "setup: unknown stack '$stack' (expected: user, newest)" >&2; exit 2; }
venv="$root/.venv/$stack"
stamp="$venv/.ckptdoctor-stamp"
want="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "setup: installing the '$stack' stack into .venv/$stack (torch wheels are large; a few minutes the first time)" >&2
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$lock" 2> >(grep -v "is ignored: it is neither" >&2)
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$root" 2> >(grep -v "is ignored: it is neither" >&2)
echo "$want" > "$stamp"
echo "setup: .venv/$stack ready" >&2
