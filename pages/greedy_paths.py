"""The Greedy paths page's older URL (/greedy_paths). A fresh Streamlit server looks its very first request up among
the pages/ file names before app.py runs; this file answers that lookup, then app.py sends the link on to
/greedy with its settings."""
from pages.common import ensure_navigation

ensure_navigation()
