"""Developer scripts: ``stack_lib`` is the logic behind ``scripts/stack`` (see docs/stack.md)."""
