"""The "Devices" sidebar control: one device, or the layers spread by accelerate (GPUs, CPU RAM, disk).

Call `devices_control()` inside the shared sidebar (pages/common.py) and pass what it returns to
`kvviz.load_model(..., **placement)`; add it to the ModelChoice key so a new placement loads a new model.
`placement_caption(lm)` writes where each layer lives, under the "Loaded:" caption.
"""
from __future__ import annotations

import streamlit as st

import kvviz
from kvviz.placement import parse_placement, placement_summary

CHOICES = {"one device": "one", "auto": "auto", "spread": "spread"}


def devices_control() -> dict:
    """Draw the control (in the sidebar); returns load_model's placement arguments ({} for one device). A budget
    that cannot be read is shown as one line and the model stays on one device."""
    ss = st.session_state
    ss.setdefault("devices", "one device")
    ss.setdefault("max_memory", "")
    with st.sidebar:
        st.selectbox("Devices", list(CHOICES), key="devices",
                     help="one device: the whole model on the Device above. auto: accelerate places the layers "
                          "(GPUs in turn, then CPU RAM, then disk offload in kvviz's cache) for models larger than "
                          "one device. spread: the layers split evenly over several GPUs. The numbers do not "
                          "change, only where each layer runs.")
        if CHOICES[ss.devices] != "one":
            st.text_input("Max memory per device", key="max_memory", placeholder="0=20GiB,1=20GiB,cpu=64GiB",
                          help="What accelerate may use on each device before the next one; what fits nowhere "
                               "goes to disk. Empty: what each device has.")
    try:
        mode = CHOICES[ss.devices]
        place = parse_placement(mode, (ss.max_memory.strip() or None) if mode != "one" else None)
    except kvviz.KvvizError as e:
        st.sidebar.error(str(e), icon="⚠️")
        return {}
    return {"placement": place} if place.dispatched else {}


def placement_caption(lm: kvviz.LoadedModel) -> None:
    """Where each layer of a dispatched model lives (nothing for a model on one device)."""
    if lm.placement.dispatched:
        st.sidebar.caption(f"**Placement:** {placement_summary(lm)}")
