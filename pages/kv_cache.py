"""The KV cache page's older URL (/kv_cache). A fresh Streamlit server looks its very first request up among
the pages/ file names before app.py runs; this file answers that lookup, then app.py sends the link on to
/cache with its settings."""
from pages.common import ensure_navigation

ensure_navigation()
