# Runs inside the verl tier's environment after requirements/verl.txt.
# verl without its dependency list (see verl.txt for why); then a guard that the torch in the
# environment is still the CPU build the list pinned.
set -euo pipefail
python -m pip install -q --no-deps verl==0.9.1
python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"verl tier expects torch 2.13.0 CPU, found {torch.__version__} (cuda={torch.version.cuda})")
PY
