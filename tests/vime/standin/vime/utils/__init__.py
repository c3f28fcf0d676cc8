"""Contract stand-in for ``vime.utils`` (see the package docstring: not vime)."""
