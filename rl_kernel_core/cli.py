"""``python -m rl_kernel_core.cli``: the ``rl-kernel`` command, whose home is :mod:`rl_kernel_core.tools.cli`;
this module runs it and keeps its names importable from here."""

import sys

from rl_kernel_core.tools.cli import build_parser, device_name, integer, json_object, main, number  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
