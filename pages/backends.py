"""The Backends & compile page's older URL (/backends). A fresh Streamlit server looks its very first request up among
the pages/ file names before app.py runs; this file answers that lookup, then app.py sends the link on to
/matrix with its settings."""
from pages.common import ensure_navigation

ensure_navigation()
