"""The "Devices" sidebar control: one device, or the layers spread by accelerate (GPUs, CPU RAM, disk). Its two
strings are ModelChoice fields (plain strings: a new placement is a new key, so it loads a new model)."""
from __future__ import annotations

import streamlit as st

import kvviz
from kvviz.models.placement import parse_placement, placement_summary

CHOICES = {"one device": "one", "auto": "auto", "spread": "spread"}


def devices_control() -> tuple[str, str]:
    """Draw the control (in the sidebar); returns (devices, max_memory): "one" | "auto" | "spread" and the budget
    text. A budget that cannot be read is shown as one line and the model stays on one device."""
    ss = st.session_state
    ss.setdefault("devices", "one device")
    ss.setdefault("max_memory", "")
    with st.sidebar:
        st.selectbox("Devices", list(CHOICES), key="devices",
                     help="one device: the whole model on the Device above. auto: accelerate places the layers "
                          "(GPUs in turn, then CPU RAM, then disk offload in kvviz's cache) for models larger than "
                          "one device. spread: the layers split evenly over several GPUs. The numbers do not "
                          "change, only where each layer runs.")
        mode = CHOICES[ss.devices]
        if mode != "one":
            st.text_input("Max memory per device", key="max_memory", placeholder="0=20GiB,1=20GiB,cpu=64GiB",
                          help="What accelerate may use on each device before the next one; what fits nowhere "
                               "goes to disk. Empty: what each device has.")
    budget = ss.max_memory.strip() if mode != "one" else ""
    try:
        parse_placement(mode, budget or None)
    except kvviz.KvvizError as e:
        st.sidebar.error(str(e), icon="⚠️")
        return "one", ""
    return mode, budget


def placement_kwargs(devices: str, max_memory: str) -> dict:
    """kvviz.load_model's arguments for a devices choice ({} for one device)."""
    place = parse_placement(devices, max_memory or None)
    return {"placement": place} if place.dispatched else {}


def placement_caption(lm: kvviz.LoadedModel) -> None:
    """Where each layer of a dispatched model lives (nothing for a model on one device)."""
    if lm.placement.dispatched:
        st.sidebar.caption(f"**Placement:** {placement_summary(lm)}")
