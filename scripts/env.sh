#!/usr/bin/env bash
# Usage: scripts/env.sh TIER          create (once) and print the path of TIER's environment
#        scripts/env.sh --path TIER   print that path only (nothing is built or installed)
# A virtual environment for a test tier, built from requirements/TIER.txt (plus
# requirements/TIER.post.sh if present, run inside the env), with rl-kernel installed editable
# from this checkout. Environments are cached outside the clone, keyed on the content of those
# files and on this checkout's path (its physical path, symlinks resolved): CI reuses them and
# rebuilds when the requirement lists change, and two clones never share one, since an editable
# install points at one checkout and a shared environment would run whichever clone installed
# itself last. A clone that moves gets a new environment; the old one can be deleted.
set -euo pipefail
path_only=
if [ "${1:-}" = --path ]; then path_only=1; shift; fi
tier=${1:?usage: scripts/env.sh [--path] TIER}
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements/$tier.txt"
post="$root/requirements/$tier.post.sh"
[ -f "$req" ] || { echo "no requirement list $req" >&2; exit 2; }
checkout=$(cd "$root" && pwd -P)
key=$( { cat "$req"; [ ! -f "$post" ] || cat "$post"; printf 'checkout %s\n' "$checkout"; } | sha256sum | cut -c1-12)
cache=${RL_KERNEL_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-kernel/envs}
env="$cache/$tier-$key"
if [ -n "$path_only" ]; then echo "$env"; exit 0; fi
mkdir -p "$cache"
# One build at a time per environment: a second caller (a parallel test run, another shell) waits
# for the first instead of deleting its half-built environment.
exec 9>"$env.lock"
flock 9
if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  python3 -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip >&2
  "$env/bin/python" -m pip install -q -r "$req" >&2
  if [ -f "$post" ]; then (source "$env/bin/activate" && bash "$post") >&2; fi
  printf '%s\n' "$checkout" > "$env/.checkout"
  touch "$env/.complete"
fi
# The project itself is (re)installed every time: it is small and its version or entry points may
# have changed since.
"$env/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$env"
