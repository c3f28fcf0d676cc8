# Sourced by the GPU check scripts: `source scripts/gpu_preamble.sh DEFAULT_OUT "$@"` from the
# repository root. Sets `out` (the first argument, else $OUT, else DEFAULT_OUT) and creates it,
# makes the checkout importable (an editable install, else PYTHONPATH), unbuffers Python and
# starts `status` at 0 for the script to set on a failed step.
out=${2:-${OUT:-$1}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
