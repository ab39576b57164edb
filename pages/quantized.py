"""/quantized, an older URL of /quant: a fresh server looks its first request up among the pages/ file names;
this file hands it to app.py (pages/__init__.py, on import), which sends it on to /quant with its settings."""
import pages  # noqa: F401
