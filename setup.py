"""Ships what pyproject metadata cannot place: rl_kernel_vime.pth at the top of site-packages,
and (in a regular wheel) a copy of native/csrc inside rl_kernel_core, for the JIT build.

The .pth line imports a standard-library-only bootstrap that does nothing unless
VIME_RL_KERNEL=1; see docs/vime.md. Everything else is configured in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("rl_kernel_vime") / "rl_kernel_vime.pth"
NATIVE_SOURCES = Path("native") / "csrc"


class build_py_with_extras(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
            # an editable install builds from the checkout's native/csrc directly
            self.copy_tree(str(NATIVE_SOURCES), str(target / "rl_kernel_core" / "native_csrc"))
        self.copy_file(str(PTH), str(target / PTH.name), preserve_mode=0)


setup(cmdclass={"build_py": build_py_with_extras})
