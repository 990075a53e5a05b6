"""Demos of vjpgen (run from the repo root: ``python -m examples.demo``); not part of the package."""
