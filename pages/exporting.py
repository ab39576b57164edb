"""Every page's downloads: the result as JSON (with the environment), the HTML report, the repro script; and "Add to
the meeting", which keeps the result (its JSON) in this user's session for Home's "Prepare the meeting"."""
from __future__ import annotations

import streamlit as st

from kvviz.core.errors import KvvizError
from kvviz import views
from kvviz.core.fingerprint import fingerprint
from kvviz.io.export import export_json, html_report
from kvviz.io.repro import check_reproducible, repro_script, repro_views
from kvviz.teach.meeting import run_title

# This user's runs added to the meeting: [{"id", "title", "json"}] in their own session state (never shared between
# users), listed on Home's "Prepare the meeting", which bundles them (kvviz.teach.meeting.prepare's `runs`).
MEETING_RUNS = "_meeting_runs"


def add_to_meeting(res, lm, name: str, saved: "str | bytes | None" = None) -> None:
    """The button's callback: the result's JSON export (`saved`: the file a reopened result came from) and its title,
    appended to this session's meeting runs once."""
    ss = st.session_state
    runs = ss.setdefault(MEETING_RUNS, [])
    text = (export_json(res, _fingerprint(lm)) if saved is None
            else saved.decode("utf-8") if isinstance(saved, bytes) else saved)
    if any(r["json"] == text for r in runs):
        ss["_meeting_added"] = (name, "already")
        return
    runs.append({"id": max((r["id"] for r in runs), default=0) + 1, "title": run_title(views.of(res).name, res),
                 "json": text})
    ss["_meeting_added"] = (name, "added")


def _fingerprint(lm):
    return fingerprint(lm) if lm is not None else None


def exports(res, name: str, lm=None, saved: "str | bytes | None" = None) -> None:
    """Every page's downloads, built on click only: the result as JSON (with the environment), an HTML report and, for
    a view that has one, a repro script; beside them "Add to the meeting" (`saved`: a reopened result's JSON)."""
    cols = st.columns(4)

    def as_json() -> str:  # the model fingerprint (hashes the vocabulary) only when the download is asked for
        return export_json(res, _fingerprint(lm))

    cols[0].download_button("Result (JSON)", as_json, file_name=f"kvviz-{name}.json",
                            mime="application/json", key=f"dl_json_{name}", on_click="ignore")
    cols[1].download_button("Report (HTML)", lambda: html_report(res), file_name=f"kvviz-{name}.html",
                            mime="text/html", key=f"dl_html_{name}", on_click="ignore")
    if lm is not None:
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
    cols[3].button("Add to the meeting", key=f"meeting_add_{name}", icon=":material/event_available:",
                   on_click=add_to_meeting, args=(res, lm, name, saved),
                   help="Keeps this result with its settings (its JSON) for Home's “Prepare the meeting”, which "
                        "bundles it, reopened as it is now, into the meeting's report")
    added = st.session_state.get("_meeting_added")
    if added and added[0] == name:  # said once, on the run the click starts
        del st.session_state["_meeting_added"]
        n = len(st.session_state.get(MEETING_RUNS, []))
        cols[3].caption(("Already in the meeting" if added[1] == "already" else "Added to the meeting")
                        + f" ({n} run{'s' if n != 1 else ''}): Home → Prepare the meeting")
