"""/dtypes_lab, an older URL of /dtypes: a fresh server looks its first request up among the pages/ file names;
this file hands it to app.py (pages/__init__.py, on import), which sends it on to /dtypes with its settings."""
import pages  # noqa: F401
