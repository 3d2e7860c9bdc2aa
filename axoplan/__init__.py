"""axoplan: rank every 4D-parallel configuration for GPT training, validate the ranking with a
bundled trainer, and emit launch configs. The planner imports no torch."""

__version__ = "0.1.0"


def rank(*args, **kwargs):
    """See axoplan.rank.rank: returns the ranking DataFrame."""
    from .rank import rank as _rank

    return _rank(*args, **kwargs)


def explain(*args, **kwargs):
    """See axoplan.rank.explain."""
    from .rank import explain as _explain

    return _explain(*args, **kwargs)
