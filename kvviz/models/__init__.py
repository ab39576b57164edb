"""Models: loading (ModelSpec -> LoadedModel), GGUF, tiny synthetic models, device placement and the
compatibility seam with transformers (compat). Imports nothing from kvviz.views, kvviz.teach or kvviz.io."""
