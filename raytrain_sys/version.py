"""The package's version, in a room of its own at the bottom of the house: the run's record and
its MLflow tags name it from below every floor that imports them."""

__version__ = "0.1.0"  # pyproject.toml's [project] version says the same; tests/test_docs checks
