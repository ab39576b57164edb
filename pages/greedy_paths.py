"""/greedy_paths, an older URL of /greedy: a fresh server looks its first request up among the pages/ file names;
this file hands it to app.py (pages/__init__.py, on import), which sends it on to /greedy with its settings."""
import pages  # noqa: F401
