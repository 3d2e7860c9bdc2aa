"""The one way axoplan draws a plot: matplotlib is imported only when a plot is asked for (planning
never pays for it), on the Agg backend (login and compute nodes have no display), and the PNG comes back as
bytes, which callers write atomically through axoplan.atomic like every other output."""
from __future__ import annotations

import io


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 110) -> bytes:
    """Render fig as a PNG and close it: the bytes, for a command that writes its outputs as one set."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return buf.getvalue()
