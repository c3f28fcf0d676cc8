"""Contract stand-in for ``vime.utils.misc`` (not vime): the loader behind the hook flags."""

import importlib
from typing import Callable


def load_function(path: str) -> Callable:
    """The object named by ``path`` (``"package.module.attr"``), as slime's hook flags resolve them."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)
