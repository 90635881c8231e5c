"""Sphinx configuration: Markdown pages (MyST) and API pages from docstrings (autodoc).

Built by `nox -s docs`, which installs the package from dist/ first, so autodoc imports the
installed transformer_engine.
"""

project = "Transformer Engine"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
myst_enable_extensions = ["colon_fence"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True

html_theme = "alabaster"
