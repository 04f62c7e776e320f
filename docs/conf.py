"""Sphinx configuration for the dask_dataservice documentation (MyST Markdown pages).

Build with ``.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

# Document the source tree even when the package is not installed.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "dask_dataservice"
author = "the dask_dataservice developers"
copyright = "2026, the dask_dataservice developers"
try:
    release = metadata.version("dask-dataservice")
except metadata.PackageNotFoundError:
    release = "0+unknown"
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Broken cross-references to our own objects should show up, but every unresolved
# ``numpy.ndarray`` or ``Callable`` in a signature would too; keep nitpicky off.
nitpicky = False

# MyST
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc / napoleon: numpydoc-style docstrings
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "description"
# Types go next to parameters the docstring describes; undocumented ones stay in the signature.
autodoc_typehints_description_target = "documented"
autosummary_generate = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True

# HTML
html_theme = "alabaster"
html_title = f"dask_dataservice {release}"
html_static_path: list[str] = []
