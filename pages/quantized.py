"""The Quantized cache & weights page's older URL (/quantized). A fresh Streamlit server looks its very first request up among
the pages/ file names before app.py runs; this file answers that lookup, then app.py sends the link on to
/quant with its settings."""
from pages.common import ensure_navigation

ensure_navigation()
