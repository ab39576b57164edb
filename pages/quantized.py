"""/quantized, an older URL: a fresh server looks its first request up among pages/ file names; this file hands it
to app.py, which sends the link on to /quant with its settings."""
from pages import ensure_navigation

ensure_navigation()
