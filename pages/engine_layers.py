"""Page: inside the engine - two runs of one prompt through vLLM (warm vs cold, batch vs alone, tensor parallel 1 vs
N) or llama.cpp (warm vs cold, on the GGUF itself) compared hidden state by hidden state in the engine's worker, each
against the float64 reference. An engine run takes minutes, so it starts on the button, not on the first screen."""
import streamlit as st

from kvviz.core.errors import KvvizError
from kvviz.core.plotting import METRIC_TITLES
from kvviz.views.engine_layers import figures as el_figures, report as el_report
from kvviz.views.engine_layers.run import ENGINES, PAIRS, EngineLayersConfig
from kvviz.engines import registry
from kvviz.engines.workers import gguf_of
from pages.common import controls, page, show_verdict
from pages.exporting import exports
from pages.runner import run_button, run_or_stop, show_error

ENGINE_LABELS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}
PAIR_LABELS = {"warm": "cold vs warm prefix", "batch": "alone vs batch", "tp": "tensor parallel 1 vs N"}

choice, lm = page("Engine layers",
                  "Inside a real engine: vLLM or llama.cpp runs the prompt twice - cold and with its prefix warm in "
                  "the cache; with vLLM also alone and in a batch, or on 1 and N tensor-parallel ranks -, its worker "
                  "captures every decoder "
                  "layer's hidden state of both runs and compares them layer × token, and each run is compared with "
                  "kvviz's float64 reference on its own tokens: within rounding of it at every layer is precision, "
                  "the first layer beyond is named; bit for bit equal runs are identical, and logic needs the runs "
                  "to differ beyond rounding too (else: undecided, and what decides it).")
with controls(expanded=True):
    prompt = st.text_area("Prompt", "Rain fell on the quiet town, and the streets shone like polished glass.",
                          key="engine_layers_prompt", height=70)
    prefix = st.text_input("Shared prefix (before the prompt; the warmer of 'warm')",
                           "You are a careful assistant. Answer in one short sentence, with no preamble, no lists "
                           "and no markdown; if you do not know, say so plainly. ", key="engine_layers_prefix")
    c0, c1, c2, c3, c4 = st.columns([1, 1.5, 1, 1, 1])  # the pair's names are the longest
    engine = c0.selectbox("Engine", ENGINES, key="engine_layers_engine", format_func=ENGINE_LABELS.get,
                          help="vLLM runs the model's weights in the sidebar's dtype; llama.cpp runs the GGUF file "
                               "itself (8-bit activations), warm vs cold only")
    llama = registry.get(engine).quantized  # llama.cpp: the GGUF itself, warm vs cold only
    pair = c1.selectbox("Pair", list(PAIRS), key="engine_layers_pair",
                        format_func=lambda p: PAIR_LABELS[p] + (" (vLLM only)" if llama and p != "warm" else ""))
    n = c2.number_input("New tokens", 1, 64, 16, key="engine_layers_n")
    batch = c3.number_input("Batch size k", 2, 16, 4, key="engine_layers_batch", disabled=pair != "batch" or llama)
    tp = c4.number_input("Tensor parallel N", 2, 16, 3, key="engine_layers_tp", disabled=pair != "tp" or llama)
    others = st.number_input("Other built-in prompts, compared at their outputs", 0, 20, 0,
                             key="engine_layers_others")
    cfg = EngineLayersConfig(prompt=prompt, pair=pair, prefix=prefix, max_new_tokens=int(n), batch_size=int(batch),
                             tensor_parallel_size=int(tp), others=int(others), engine=engine)
    try:  # one line for what the engine refuses (llama.cpp: batch, tp; no GGUF) before anything starts
        cfg.validate()
        if llama:
            gguf_of(lm)
    except KvvizError as e:
        show_error(e)
        st.stop()
    why = registry.status(engine)
    if why:
        st.info(why)
        st.stop()

label = ENGINE_LABELS[engine]
run_button("engine_layers", cfg, f"Run inside {label}", f"Choose the pair and press **Run inside {label}**: the "
           f"engine starts in its own process, so a run takes {'a minute or so' if llama else 'minutes'} on a CPU.",
           key="engine_layers_run", type="primary", icon=":material/play_arrow:",
           help=f"Starts {label} in its own environment (" + (
               "seconds to a minute on a CPU)" if llama else "a minute or more on a CPU; tensor parallel starts two)"))
# once per settings: a rerun shows the stored result
res = run_or_stop("engine_layers", lm, cfg, button="engine_layers", label=f"Running the prompt twice inside {label}…")

verdict, text = el_report.verdict(res)
show_verdict(verdict, text)
metric = st.radio("Measure", ["relative", "eps_units", "max_abs"], horizontal=True, key="engine_layers_metric",
                  format_func=METRIC_TITLES.get)
st.plotly_chart(el_figures.pair_heatmap(res, metric), width="stretch", key="engine_layers_pair_map")
if (lens_map := el_figures.lens_heatmap(res)) is not None:  # the logit lens of both sides
    st.plotly_chart(lens_map, width="stretch", key="engine_layers_lens_map")
elif res.lens_absent:
    st.caption(f"No logit lens: {res.lens_absent}.")
st.plotly_chart(el_figures.layer_lines(res), width="stretch", key="engine_layers_lines")
fa, fb = el_figures.reference_heatmaps(res, metric)
st.plotly_chart(fa, width="stretch", key="engine_layers_ref_a")
st.plotly_chart(fb, width="stretch", key="engine_layers_ref_b")
st.dataframe(el_figures.layers_frame(res), hide_index=True, width="stretch")
if res.lens is not None:
    st.dataframe(el_figures.lens_frame(res), hide_index=True, width="stretch")
if res.prompts:
    st.caption(res.parting_line())
    st.dataframe(el_figures.prompts_frame(res), hide_index=True, width="stretch")
for note in res.notes:
    st.caption(note)
exports(res, "engine_layers", lm)
