"""Contract stand-in for ``vime.backends.megatron_utils`` (see the package docstring: not vime)."""
