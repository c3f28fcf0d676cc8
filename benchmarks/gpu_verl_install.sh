# Sourced by the verl GPU scripts from the repository root. Lines of benchmarks/gpu_verl_wheels.txt, each file checked
# by sha256 before pip installs it (--no-index --no-deps) into VERL_SITE (default /tmp/verl-site):
#   verl_install          the `main` wheels from VERL_WHEELS (default .verl-wheels); puts VERL_SITE on PYTHONPATH
#   ray_full_install DIR  the `parts` line's wheel (ray, untrimmed) joined from the parts in DIR (name order), over
#                         the trimmed ray of verl_install
# Each returns 1, saying which file, when a file is missing or its sha256 differs.
verl_list=benchmarks/gpu_verl_wheels.txt

verl_install() {
  local wheels=${VERL_WHEELS:-.verl-wheels} site=${VERL_SITE:-/tmp/verl-site} files=() kind file sha
  while read -r kind _ file sha; do
    [ "$kind" = main ] || continue
    [ -f "$wheels/$file" ] || { echo "missing $wheels/$file: run python3 benchmarks/fetch_verl_wheels.py $wheels where pip reaches the index, and carry it"; return 1; }
    echo "$sha  $wheels/$file" | sha256sum -c --quiet - || { echo "sha256 mismatch: $wheels/$file ($verl_list)"; return 1; }
    files+=("$wheels/$file")
  done < <(grep -v -e '^#' -e '^[[:space:]]*$' "$verl_list")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${files[@]}" || return 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

ray_full_install() {
  local parts=$1 site=${VERL_SITE:-/tmp/verl-site} work kind file sha
  read -r kind _ file sha < <(grep '^parts ' "$verl_list")
  ls "$parts"/*.part* >/dev/null 2>&1 || { echo "no parts of $file in $parts: run python3 benchmarks/fetch_verl_wheels.py --ray-parts .ray and copy each carried .ray/pN into $parts"; return 1; }
  work=$(mktemp -d)
  cat $(ls -1 "$parts"/*.part* | sort -V) > "$work/$file"
  echo "$sha  $work/$file" | sha256sum -c --quiet - || { echo "sha256 mismatch: $file joined from $parts ($verl_list)"; rm -rf "$work"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$work/$file" || { rm -rf "$work"; return 1; }
  rm -rf "$work"
}
