#!/usr/bin/env bash
# Usage: scripts/env.sh TIER
# Creates (once) and prints the path of a virtual environment for a test tier, built from
# requirements/TIER.txt (plus requirements/TIER.post.sh if present, run inside the env), with
# rl-kernel installed editable. Environments are cached outside the clone, keyed on the content
# of those files, so CI reuses them and rebuilds when the requirement lists change.
set -euo pipefail
tier=${1:?usage: scripts/env.sh TIER}
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements/$tier.txt"
post="$root/requirements/$tier.post.sh"
[ -f "$req" ] || { echo "no requirement list $req" >&2; exit 2; }
key=$( { cat "$req"; [ ! -f "$post" ] || cat "$post"; } | sha256sum | cut -c1-12)
cache=${RL_KERNEL_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-kernel/envs}
env="$cache/$tier-$key"
if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  mkdir -p "$cache"
  python3 -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip >&2
  "$env/bin/python" -m pip install -q -r "$req" >&2
  if [ -f "$post" ]; then (source "$env/bin/activate" && bash "$post") >&2; fi
  touch "$env/.complete"
fi
# The project itself is (re)installed every time: it is small and the clone may have moved.
"$env/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$env"
