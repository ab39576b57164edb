"""Page: the KV cache as an object - save it, reload it, continue and compare; how big it is."""
import streamlit as st

from kvviz import views
from kvviz.views.cache import figures as cache_figures
from kvviz.views.cache.run import ReloadConfig, save_cache_bytes
from kvviz.views.cache.size import KVShape, SizeConfig, growth, known_configs, known_table
from pages.common import page
from pages.defaults import DEFAULTS
from pages.runner import run_or_stop, run_task, run_view, show_error
from pages.exporting import exports

choice, lm = page("KV cache",
                  "Save the cache of a prompt (safetensors, with the model's fingerprint), load it back, continue "
                  "from it and check it bit for bit against a freshly computed cache; and see how big caches get.")
t1, t2 = st.tabs(["Save, load, continue", "Size"])
with t1:
    prompt = st.text_area("Prompt to cache", DEFAULTS["cache"]["prompt"], key="cache_prompt", height=70)
    try:
        data, meta = run_task("kv_save", ReloadConfig(prompt=prompt), lambda: save_cache_bytes(lm, prompt))
        st.download_button(f"Download the cache ({meta['n_tokens']} tokens, {len(data) / 1024:.0f} KiB)", data,
                           file_name="kvviz-cache.safetensors", mime="application/octet-stream", key="cache_download")
    except Exception as e:  # noqa: BLE001
        show_error(e)
    up = st.file_uploader("Load a saved cache (.safetensors)", type=["safetensors"], key="cache_upload")
    cont = st.text_input("Continue with", " Paris, and the capital of Italy is", key="cache_cont")
    if up is not None:
        try:
            res = run_view(views.get("kv_reload"), lm, ReloadConfig(continuation=cont, source=up.getvalue()),
                           name="kv_load", label="Reloading the cache and continuing…")
        except Exception as e:  # noqa: BLE001
            show_error(e)
        else:
            box = st.success if res.bitwise_equal else st.error
            box(f"Reloaded {res.n_cached} cached tokens and fed {len(res.continuation_tokens)} more: "
                + ("**bit for bit** what a freshly computed cache gives (logits, hidden states, keys and values)."
                   if res.bitwise_equal else
                   f"**differs** from a fresh cache: logits by {res.max_abs_logits:.3g}, keys/values by "
                   f"{res.max_abs_kv:.3g}."))
            st.caption(f"Saved from {res.meta['model']} with kvviz {res.meta['kvviz']}; next token "
                       f"{res.next_token_loaded!r} (reloaded) vs {res.next_token_fresh!r} (fresh).")
            exports(res, "kv_reload", lm)
with t2:
    c1, c2 = st.columns(2)
    tokens = c1.number_input("Tokens", 1, 1_000_000, DEFAULTS["cache"]["tokens"], key="cache_tokens")
    batch = c2.number_input("Batch", 1, 1024, 1, key="cache_batch")
    rep = run_or_stop("kv_size", lm, SizeConfig(int(tokens), int(batch), measure=lm.max_positions is None
                                                or int(tokens) <= lm.max_positions), label="Sizing…")
    m1, m2, m3 = st.columns(3)
    m1.metric("per token", f"{rep.per_token_bytes:,} B")
    m2.metric("formula", f"{rep.formula_bytes / 2 ** 20:.3g} MiB")
    m3.metric("measured (live cache)", "—" if rep.measured_bytes is None else f"{rep.measured_bytes / 2 ** 20:.3g} MiB",
              help=rep.note or "The keys and values the model really stored after running that many tokens")
    st.caption(f"{lm.name} in {rep.dtype}: 2 × layers × KV heads × head dim × bytes per value; "
               f"{rep.sliding_layers} sliding layers stop growing at their window. fp8 cache ≈ "
               f"{rep.fp8_formula_bytes / 2 ** 20:.3g} MiB, int4 (residual 128) ≈ {rep.int4_formula_bytes / 2 ** 20:.3g} MiB.")
    st.dataframe(known_table(int(tokens)).style.format(precision=3), hide_index=True, width="stretch")
    shapes = [KVShape.from_model(lm)] + known_configs()
    picked = st.multiselect("Chart", [s.name for s in shapes], [shapes[0].name, "Llama-3-8B", "Gemma-2-2B"],
                            key="cache_chart_models")
    rows = growth([s for s in shapes if s.name in picked], 32768, dtypes=("float32", "bfloat16"))
    st.plotly_chart(cache_figures.cache_growth(rows), width="stretch", key="cache_growth")
    exports(rep, "kv_size", lm)
