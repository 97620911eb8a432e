"""How the notebooks show plotly figures, so that they survive export.

Plotly's automatic choice inside a Jupyter kernel is the ``plotly_mimetype`` renderer alone: the
figure reaches the output only as ``application/vnd.plotly.v1+json``, which JupyterLab draws but
``jupyter nbconvert --to html``, nbviewer and GitHub drop (they show nothing). The notebooks call
:func:`use_notebook_renderer` first; it adds plotly's ``notebook`` renderer, which puts an HTML
copy of every figure beside the JSON and plotly.js once per notebook (inlined, so the exported
HTML works offline). JupyterLab keeps drawing the JSON; exporters use the HTML.

GitHub's notebook view runs no JavaScript, and it (like nbconvert) prefers an HTML output over a
picture, so an HTML copy would show as an empty box there. For it, ``static="png"`` (or
``"svg"``) puts a picture of each figure beside the JSON *instead of* the HTML copy (JupyterLab
still draws the interactive JSON; exporters and GitHub show the picture). Pictures need the static
exporter (kaleido and a Chrome/Chromium, see :mod:`canzona.viz.export`). The environment variable
``CANZONA_NOTEBOOK_STATIC`` sets the same choice without editing a notebook.
"""

from __future__ import annotations

import os

__all__ = ["STATIC_ENV", "notebook_renderer", "use_notebook_renderer"]

#: environment variable choosing a static picture beside every notebook figure ("png" or "svg")
STATIC_ENV = "CANZONA_NOTEBOOK_STATIC"
_STATIC = ("png", "svg")


def notebook_renderer(static: str | None = None) -> str:
    """The plotly renderer string :func:`use_notebook_renderer` installs (``static``: None, "png"
    or "svg"; None reads :data:`STATIC_ENV`)."""
    if static is None:
        static = os.environ.get(STATIC_ENV, "").strip().lower() or None
    if static is not None and static not in _STATIC:
        raise ValueError(f"static must be one of {', '.join(_STATIC)} (or empty), got {static!r}")
    return f"plotly_mimetype+{static}" if static else "plotly_mimetype+notebook"


def use_notebook_renderer(static: str | None = None) -> str:
    """Make plotly figures in this kernel carry an HTML copy (or, with ``static``, a picture)
    beside their JSON; returns the renderer string. A static picture that cannot be made (no
    kaleido or no browser) raises here, once, with what is missing, not at every figure."""
    import plotly.io as pio

    renderer = notebook_renderer(static)
    if "+png" in renderer or "+svg" in renderer:
        from canzona.viz.export import static_export_problem

        problem = static_export_problem()
        if problem is not None:
            raise RuntimeError(f"cannot embed static figures: {problem}")
    pio.renderers.default = renderer
    return renderer
