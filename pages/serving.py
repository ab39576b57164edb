"""Page: the Serving view - prompts under serving conditions (alone, in a continuous batch, prefix warm), R runs;
and where determinism ends: a sweep of requests in flight × prompt length through the same engine (on its button)."""
import streamlit as st

from kvviz import views
from kvviz.io.clirun import split_list
from kvviz.core.errors import KvvizError
from kvviz.views.serving import figures as serving_figures, report as serving_report
from kvviz.views.serving.run import CONDITION_LABELS, CONDITIONS, ServeConfig
from kvviz.views.serving.sweep import PROMPTS_PER_CELL, SweepConfig, figure as sweep_figure, frame as sweep_frame
from kvviz.engines import registry
from kvviz.teach.firstscreen import serving_why
from pages.common import controls, page, prompt_set, show_verdict
from pages.runner import forget_button, run_button, run_or_stop, run_view, show_error
from pages.defaults import DEFAULTS
from pages.exporting import exports

SV = DEFAULTS["serving"]

choice, lm = page("Serving",
                  "Does the same prompt give the same greedy completion when a serving engine runs it alone, in a "
                  "continuous batch with other requests, or with its prefix already cached? Each condition runs R "
                  "times through transformers' continuous batching (paged cache, scheduler); every run is compared "
                  "with the prompt alone without cache, and each first divergence is replayed in float64 and proved "
                  "in invariant mode. With vLLM or llama.cpp (their own environments, `make engines`) the real engine "
                  "runs, and each parting prompt's log-probs are compared with the float64 reference on the same "
                  "tokens: within the engine's rounding distance is precision, farther is logic.")
with controls():
    source, prompts = prompt_set("serving", ["built-in set", "one prompt", "upload a file"], "The capital of France is",
                                 [SV["category"]], SV["limit"], height=70)
    prefix = st.text_input("Shared prefix (put before every prompt; warmed for 'prefix warm')", "",
                           key="serving_prefix")
    c1, c2, c3, c4 = st.columns(4)
    conditions = c1.multiselect("Conditions", list(CONDITIONS), default=list(CONDITIONS),
                                key="serving_conditions", format_func=CONDITION_LABELS.get)
    runs = c2.number_input("Runs (R)", 1, 50, SV["runs"], key="serving_runs")
    new_tokens = c3.number_input("New tokens", 1, 128, SV["n"], key="serving_tokens")
    batch = c4.number_input("Batch size k", 2, 16, SV["batch"], key="serving_batch")
    c1, c2, c3 = st.columns(3)
    engine = c1.selectbox("Engine", registry.names(), key="serving_engine")
    pages = registry.get(engine).pages_here  # vLLM's blocks and llama.cpp's cache are not kvviz's to set
    page_size = c2.number_input("Page size (tokens)", 4, 256, 8, key="serving_page", disabled=not pages,
                                help=None if pages else "transformers' continuous batching only")
    seed = c3.number_input("Seed of the batch draws", 0, 10_000, 0, key="serving_seed")
    why = registry.status(engine)
    if why:
        st.info(why)
        st.stop()

cfg = ServeConfig(prompts=list(prompts), shared_prefix=prefix, conditions=tuple(conditions), runs=int(runs),
                  max_new_tokens=int(new_tokens), batch_size=int(batch), seed=int(seed), engine=engine,
                  page_size=int(page_size) if pages else None, prompt_source=source)
try:
    cfg.validate()
except Exception as e:  # noqa: BLE001 - one line, the controls stay
    show_error(e)
    st.stop()
res = run_or_stop("serving", lm, cfg, label=f"Running {len(prompts)} prompt(s) × {len(conditions)} condition(s) × "
                  f"{int(runs)} runs…")

verdict, text = serving_report.verdict(res)
parting = [p for p in res.prompts if p.first_divergence is not None]
if parting:
    first = min(parting, key=lambda p: p.first_divergence)
    show_verdict(first.verdict or "logic", res.summary_line() + ". " + (first.explanation or ""), first.proof,
                 proved=first.proved)
else:
    why, fix = serving_why(res)  # an identical first screen says why, with the one click that shows a parting
    show_verdict("identical", text + (f" {why}" if why else ""))
    if fix:
        st.button("Switch to bfloat16 (near ties: completions part)", key="serving_show_gap", type="primary",
                  icon=":material/visibility:", on_click=st.session_state.update, kwargs={"dtype": "bfloat16"})
st.plotly_chart(serving_figures.histogram_figure(res), width="stretch", key="serving_hist")
if parting:
    st.plotly_chart(serving_figures.divergence_figure(res), width="stretch", key="serving_div")
share = res.warm_differs_share
c1, c2, c3 = st.columns(3)
c1.metric("Prompts with 1 distinct completion", f"{res.histogram.get(1, 0)} / {len(res.prompts)}")
c2.metric("Warm ≠ cold", "—" if share is None else f"{share:.0%}")
c3.metric("Parting prompts", len(parting))
st.dataframe(serving_figures.prompt_frame(res), hide_index=True, width="stretch")
st.plotly_chart(serving_figures.throughput_figure(res), width="stretch", key="serving_tps")
with st.expander("Completions of one prompt, run by run"):
    i = st.number_input("Prompt #", 0, len(res.prompts) - 1, 0, key="serving_show")
    p = res.prompts[int(i)]
    st.text(f"reference: {p.reference_text!r}")
    for c in p.texts:
        for r, t in enumerate(p.texts[c]):
            st.text(f"{CONDITION_LABELS[c]}, run {r + 1}: {t!r}")
if choice.invariant:
    st.info(":material/lock: Invariant mode is on: every condition (the engine's own thread too) computes each row "
            "the same way whatever comes with it, so each prompt must give exactly one completion everywhere.")
st.caption(f"Engine {res.engine['name']} {res.engine.get('version', '')}; toggles: "
           + "; ".join(res.engine["toggles"]) + f". {res.settings.dtype} on {res.settings.device}.")
exports(res, "serving", lm)


# Where determinism ends (kvviz.views.serving.sweep): requests in flight × prompt length through the engine above. It
# starts the engine's own process (vLLM: minutes on a CPU), so it runs on its button only; Stop (the progress bar's)
# ends it at its next checkpoint and its engine with it (the worker process is killed).
st.divider()
st.subheader("Where determinism ends")
st.caption("A grid of requests in flight × prompt length through the engine chosen above, with its New tokens, Runs "
           "and Seed: each cell runs its prompts alone and, above 1 in flight, in a continuous batch of that many "
           "requests, and judges every completion against the float64 reference. The engine starts on the button and "
           "is ended when the sweep ends or on Stop.")
c1, c2, c3, c4, c5 = st.columns(5)
conc_text = c1.text_input("Requests in flight", "1,2,4,8", key="serving_sweep_concurrency",
                          help="Comma-separated, 1 to 64: one column each")
lengths_text = c2.text_input("Prompt lengths (tokens)", "16,64,256", key="serving_sweep_lengths",
                             help="Comma-separated, 1 to 8192: one row each; prompts are cut from the built-in set")
per_cell = c3.number_input("Prompts a cell", 1, 64, PROMPTS_PER_CELL, key="serving_sweep_prompts")
budget = c4.number_input("Time budget (s; 0: none)", 0.0, 86400.0, 600.0, step=60.0, key="serving_sweep_budget",
                         help="The sweep stops between cells once this is spent; the cells left are listed as not run")
cell_limit = c5.number_input("Cell limit (s; 0: none)", 0.0, 86400.0, 0.0, step=60.0, key="serving_sweep_cell_limit",
                             help="A cell still running after this long is stopped and listed as not finished (the "
                                  "cells at least as large as not run); the sweep goes on with the others")
try:
    try:
        conc, lengths = (tuple(int(x) for x in split_list(t)) for t in (conc_text, lengths_text))
    except ValueError:
        raise KvvizError("requests in flight and prompt lengths take comma-separated whole numbers, like 1,4,16") \
            from None
    scfg = SweepConfig(concurrency=conc, lengths=lengths, prompts_per_cell=int(per_cell),
                       max_new_tokens=int(new_tokens), runs=int(runs), seed=int(seed), engine=engine,
                       budget_s=float(budget) or None, cell_limit_s=float(cell_limit) or None)
    scfg.validate()
except Exception as e:  # noqa: BLE001 - a bad grid: one line, the controls stay
    show_error(e)
    st.stop()
run_button("serving_sweep", scfg, "Run the sweep", f"Choose the grid and press **Run the sweep**: "
           f"{len(scfg.concurrency) * len(scfg.lengths)} cells of {int(per_cell)} prompts through {engine}.",
           key="serving_sweep_run", type="primary", icon=":material/play_arrow:",
           help="Starts the engine (vLLM: in its own environment, a minute or more on a CPU) and runs the grid")

where = st.empty()  # the button is far below the progress bar: say where it is while the sweep runs
where.info("Sweeping: its progress, the time left and **Stop** are at the top of the page.",
           icon=":material/arrow_upward:")
try:
    sres = run_view(views.get("serving_sweep"), lm, scfg,  # once per grid: a rerun shows the stored result
                    label=f"Sweeping {len(scfg.concurrency)} × {len(scfg.lengths)} cells through {engine}…")
except Exception as e:  # noqa: BLE001
    where.empty()  # before st.stop(): the `finally` below runs after it, too late to clear the pointer
    forget_button("serving_sweep")  # a failed sweep is not started again by the next rerun
    show_error(e)
    st.stop()
finally:  # also when the run stops the script (Stop: the next run says how far it got)
    where.empty()
sverdict, stext = views.get("serving_sweep").verdict_text(sres)
show_verdict(sverdict, stext)
st.plotly_chart(sweep_figure(sres), width="stretch", key="serving_sweep_map")
st.dataframe(sweep_frame(sres), hide_index=True, width="stretch")
for note in sres.notes:
    st.caption(note)
exports(sres, "serving_sweep", lm)
