"""Ships rl_kernel_vime.pth at the top of site-packages (pyproject metadata cannot place it).

The .pth line imports a standard-library-only bootstrap that does nothing unless
VIME_RL_KERNEL=1; see docs/vime.md. Everything else is configured in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("rl_kernel_vime") / "rl_kernel_vime.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        self.copy_file(str(PTH), str(target / PTH.name), preserve_mode=0)


setup(cmdclass={"build_py": build_py_with_pth})
