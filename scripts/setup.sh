#!/usr/bin/env bash
# Create (or reuse) the pinned virtual environment of one stack: .venv/<stack>.
#   scripts/setup.sh user     torch 2.8.0 + accelerate 1.13.0 (the reporter's stack)
#   scripts/setup.sh newest   torch 2.15.0 + accelerate 1.16.0
#   scripts/setup.sh --check-only STACK   only the disk check; prints the MB the install needs (0: installed)
# CKPTDOCTOR_DISK_RESERVED_MB: MB that installs running beside this one take (scripts/test sets it).
# Idempotent: a stamp holding the hash of the lock file and pyproject.toml skips
# the install when nothing changed, so a second run costs about a second.
set -euo pipefail
check_only=0
if [ "${1:-}" = "--check-only" ]; then check_only=1; shift; fi
stack="${1:-user}"
root="$(cd "$(dirname "$0")/.." && pwd)"
lock="$root/requirements/${stack}-stack.lock"
[ -f "$lock" ] || { echo "setup: unknown stack '$stack' (expected: user, newest)" >&2; exit 2; }
venv="$root/.venv/$stack"
stamp="$venv/.ckptdoctor-stamp"
want="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  if [ "$check_only" = 1 ]; then echo 0; fi
  exit 0
fi
# Fail before pip does, with a message that says how much to free. Measured here (the
# figures the README gives; du -sh and df, in GiB): the user stack's install peaks at about
# 11 GB, pip's downloads included, and leaves a 7.2 GB venv; the newest stack's venv is
# 6.0 GB and its wheels download too (torch 2.15.0 is not among this machine's local
# releases). The limits below are MiB (df -Pm).
case "$stack" in
  newest) venv_mb=6500 download_mb=4500 ;;
  *) venv_mb=7700 download_mb=4500 ;;  # user, and any stack not listed here
esac
if [ -n "${CKPTDOCTOR_DISK_NEED_MB:-}" ]; then venv_mb="$CKPTDOCTOR_DISK_NEED_MB" download_mb=0; fi
reserved="${CKPTDOCTOR_DISK_RESERVED_MB:-0}"
beside=""
if [ "$reserved" -gt 0 ]; then beside=" (with ${reserved} MB for the installs beside it)"; fi
free_mb() { df -Pm "$1" | awk 'NR == 2 {print $4}'; }
require_mb() {  # require_mb DIR MB WHAT
  local free; free="$(free_mb "$1")"
  if [ "$free" -lt "$2" ]; then
    echo "setup: not enough disk for the '$stack' stack: $3 needs about $2 MB in $1, $free MB free; free some space and rerun" >&2
    exit 3
  fi
}
downloads="${TMPDIR:-/tmp}"
if [ "$(stat -c %d "$root")" = "$(stat -c %d "$downloads")" ]; then
  require_mb "$root" $((venv_mb + download_mb + reserved)) "the environment plus pip's downloads$beside"
else
  require_mb "$root" $((venv_mb + reserved)) "the environment$beside"
  require_mb "$downloads" $((download_mb + reserved)) "pip's downloads$beside"
fi
if [ "$check_only" = 1 ]; then echo $((venv_mb + download_mb)); exit 0; fi

echo "setup: installing the '$stack' stack into .venv/$stack (torch wheels are large; a few minutes the first time)" >&2
python3.11 -m venv "$venv"
# The lock file pins every package; a machine-wide pip constraint (here: torch<=2.14.1, the
# releases on local disk) must not decide what the project installs.
export PIP_CONSTRAINT=/dev/null
# Not --no-compile: with PYTHONDONTWRITEBYTECODE=1 (set on these machines) no run would keep its
# byte code, and every rank of every job would compile torch, diffusers and transformers anew.
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$lock" 2> >(grep -v "is ignored: it is neither" >&2)
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$root" 2> >(grep -v "is ignored: it is neither" >&2)
# Judge the install by its effect, not pip's exit status: the pinned torch and Accelerate, and
# ckptdoctor from this checkout, must be what the environment imports.
pins="$(grep -E '^(torch|accelerate)==' "$lock" | sort | tr '\n' ' ')"
got="$("$venv/bin/python" - "$root" <<'PY'
import sys
from importlib import metadata
from pathlib import Path
import ckptdoctor
where = Path(ckptdoctor.__file__).resolve()
if not where.is_relative_to(Path(sys.argv[1]).resolve() / "src"):
    sys.exit(f"ckptdoctor is imported from {where}, not from this checkout")
print(" ".join(f"{p}=={metadata.version(p).split('+')[0]}" for p in ("accelerate", "torch")) + " ")
PY
)" || { echo "setup: the '$stack' environment does not import this checkout's ckptdoctor" >&2; exit 4; }
if [ "$got" != "$pins" ]; then
  echo "setup: the '$stack' environment holds ${got:-nothing} after pip, expected $pins" >&2
  exit 4
fi
echo "$want" > "$stamp"
echo "setup: .venv/$stack ready" >&2
