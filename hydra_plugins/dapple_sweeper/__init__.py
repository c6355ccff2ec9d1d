"""Hydra sweeper ``hydra/sweeper=dapple``: search DAPPLE plans with Optuna (>= 4) over Hydra jobs.

Hydra finds plugins by importing every public module under the ``hydra_plugins`` namespace
package (modules whose names start with ``_`` are skipped), so this package must be importable:
installed with the project (``hydra_plugins*`` in ``[tool.setuptools.packages.find] include``) or
on ``sys.path`` (the repository root, when running from it). ``config`` registers the config
``hydra/sweeper/dapple``; ``dapple_sweeper`` holds the plugin class. Both stay light: Optuna,
torch and the search load only when a sweep starts.
"""
