"""Sphinx configuration of the API reference (built by tools/docs.sh, warnings as errors).

The pages document the packages that the interpreter imports: the installed ones, or the source trees
when they are on PYTHONPATH with their extensions built.
"""
import importlib

project = "commkit"
author = "commkit maintainers"
# napoleon: the docstrings use Google-style sections ("Arguments:", "Returns:", "Raises:").
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections as :ivar: fields of the class: autodoc documents the attributes themselves too, and
# two descriptions of one attribute would be a duplicate-object warning.
napoleon_use_ivar = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# torch's own types appear in signatures; their cross-references are not ours to resolve.
nitpicky = False
# An :ivar: field cross-references the attribute's bare name, which several classes share (rank,
# num_sms); such an ambiguous link is no error in the docstring.
suppress_warnings = ["ref.python"]
html_theme = "alabaster"
html_static_path = []
exclude_patterns = ["_build"]

# The version line of each page: the packages' own versions (each is released on its own).
release = version = ", ".join(
    f"{pkg} {importlib.import_module(pkg).__version__}" for pkg in ("elastic_ep", "ipc_all2all", "fp8_layerwise"))
