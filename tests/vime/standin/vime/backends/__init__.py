"""Contract stand-in for ``vime.backends`` (see the package docstring: not vime)."""
