"""axoplan: rank every 4D-parallel configuration for GPT training, validate the ranking with a
bundled trainer, and emit launch configs. The planner imports no torch."""

__version__ = "0.1.0"

__all__ = ["rank", "explain", "__version__"]


def __getattr__(name):
    """The public API, axoplan.rank(...) and axoplan.explain(...), imported on first use so that
    `import axoplan` (and every command) does not pay for the planner and pandas."""
    if name in ("rank", "explain"):
        from axoplan.planner import rank as _rank

        value = getattr(_rank, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"rank", "explain"})
