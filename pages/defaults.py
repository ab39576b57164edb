"""Every page's default controls, from the view registry (each view's Page(defaults=...)), by view folder: the pages
draw their controls with these values and bench/pages_bench.py times the library calls the pages make with them (the
budget: each default run <= 30 s on a quiet 2-core CPU with the default model). Defaults that teach: few prompts,
tokens and cells; "more" is one control away on each page."""
from kvviz import views as _views

DEFAULTS = _views.page_defaults()
