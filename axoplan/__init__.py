"""axoplan: rank every 4D-parallel configuration for GPT training, validate the ranking with a
bundled trainer, and emit launch configs. The planner imports no torch."""

__version__ = "0.1.0"

from axoplan.planner.rank import explain, rank  # noqa: E402  (the public API: axoplan.rank(...), axoplan.explain(...))

__all__ = ["rank", "explain", "__version__"]
