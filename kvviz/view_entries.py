"""Every view kvviz has, one line each (kvviz/views.py reads this module on first use).

Adding a view: its module (config, run, result with `to_dict`), then one `register(View(...))` line here.
"""
from .views import View, register

E = "kvviz.export"

register(View("split", "Split point", "SplitResult", f"{E}:reopen_split", f"{E}:split_figures", f"{E}:split_verdict",
              repro=True, command="split"))
register(View("greedy", "Greedy paths", "GreedyResult", f"{E}:reopen_greedy", f"{E}:greedy_figures",
              f"{E}:greedy_verdict", repro=True, command="greedy"))
register(View("dtypes", "Dtypes side by side", "DtypesResult", f"{E}:reopen_dtypes", f"{E}:dtypes_figures",
              f"{E}:dtypes_verdict", verdict_is_html=True, repro=True, command="dtypes"))
register(View("padding", "Padding and batching", "PaddingResult", f"{E}:reopen_padding",
              f"{E}:padding_figures", f"{E}:padding_verdict", verdict_is_html=True, repro=True,
              command="padding"))
register(View("reuse", "Prompt-cache reuse", "ReuseResult", f"{E}:reopen_reuse", None, f"{E}:reuse_verdict",
              verdict_is_html=True, repro=True, command="reuse"))
register(View("matrix", "Backends & compile", "MatrixResult", f"{E}:reopen_matrix", f"{E}:matrix_figures",
              f"{E}:matrix_verdict", repro=True, command="matrix"))
register(View("quant", "Quantized cache & weights", "QuantResult", f"{E}:reopen_quant", f"{E}:quant_figures",
              None, repro=True, command="quant"))
register(View("loading_trap", "Loading trap", "LoadingTrapResult", f"{E}:reopen_loading_trap",
              f"{E}:loading_trap_figures", None, repro=True, command="loading-trap"))
register(View("check", "Is my model cache-safe?", "CheckCard", f"{E}:reopen_check", None, f"{E}:check_verdict",
              verdict_is_html=True, repro=True, command="check"))
register(View("bisect", "Bisector", "BisectResult", f"{E}:reopen_bisect", f"{E}:bisect_figures",
              f"{E}:bisect_verdict", command="bisect"))
register(View("kv_reload", "KV cache: reload", "ContinueResult", f"{E}:reopen_kv_reload", None,
              f"{E}:kv_reload_verdict", command="cache load"))
register(View("kv_size", "KV cache: sizes", "SizeReport", f"{E}:reopen_kv_size", None, f"{E}:kv_size_verdict",
              command="cache size"))
register(View("serving", "Serving", "ServeResult", f"{E}:reopen_serving", "kvviz.serving:figures",
              "kvviz.serving:verdict_text", repro=True, command="serve-study"))
