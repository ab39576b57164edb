"""Every page's downloads: the result as JSON (with the environment), the HTML report, the repro script."""
from __future__ import annotations

import streamlit as st

from kvviz.core.errors import KvvizError

def exports(res, name: str, lm=None) -> None:
    """Every page's downloads: the result as JSON (with the environment), a self-contained HTML report and (split,
    greedy, dtypes, padding, reuse) a standalone repro script. Built on click only, so views stay cheap."""
    from kvviz.io.export import export_json, html_report

    cols = st.columns(3)

    def as_json() -> str:  # the model fingerprint (hashes the vocabulary) only when the download is asked for
        from kvviz.core.fingerprint import fingerprint

        return export_json(res, fingerprint(lm) if lm is not None else None)

    cols[0].download_button("Result (JSON)", as_json, file_name=f"kvviz-{name}.json",
                            mime="application/json", key=f"dl_json_{name}", on_click="ignore")
    cols[1].download_button("Report (HTML)", lambda: html_report(res), file_name=f"kvviz-{name}.html",
                            mime="text/html", key=f"dl_html_{name}", on_click="ignore")
    if lm is not None:
        from kvviz.io.repro import check_reproducible, repro_script, repro_views

        try:
            why = None if name in repro_views() and check_reproducible(res) else "not for this view"
        except KvvizError as e:
            why = str(e)
        if why is None:
            cols[2].download_button("Repro script (Python)", lambda: repro_script(res, lm, f"kvviz_repro_{name}.py"),
                                    file_name=f"kvviz_repro_{name}.py", mime="text/x-python",
                                    key=f"dl_repro_{name}", on_click="ignore",
                                    help="A standalone script (torch + transformers only) that rebuilds this run; "
                                         "its last line equals this result's max |Δ logits| bit for bit here "
                                         "(it sets the threads and CPU kernels this result was computed with).")
        elif name in repro_views():
            cols[2].caption(f"No repro script: {why}")
