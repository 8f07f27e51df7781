"""The `autopar` command line: a thin mirror of the Python API."""
