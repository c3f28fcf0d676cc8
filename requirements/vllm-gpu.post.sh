# Runs inside the vllm-gpu tier's venv after requirements/vllm-gpu.txt is installed.
# vllm 0.33.0's metadata pins torch==2.14.0 and certifi>=2026.10.19; the list installs torch 2.14.1
# and the certifi the index has, so the wheel goes in without its dependencies. Then check that
# the modules the tests use import on a CPU-only machine and that no torchvision came in
# (transformers imports it when present, and a mismatched build breaks that import).
set -euo pipefail
python -m pip install -q --no-deps vllm==0.33.0
python - <<'PY'
import importlib.util, sys
import torch, transformers, vllm
import vllm.plugins
import vllm.v1.sample.sampler
import vllm.v1.worker.gpu.sample.logprob
import vllm.v1.worker.gpu.sample.sampler
import vllm.model_executor.layers.logits_processor
if vllm.__version__ != "0.33.0":
    sys.exit(f"expected vllm 0.33.0, got {vllm.__version__}")
if importlib.util.find_spec("torchvision"):
    sys.exit("torchvision is importable; this tier must not have it")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
