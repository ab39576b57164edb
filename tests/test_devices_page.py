"""The "Devices" sidebar control (pages/devices.py), run on its own in Streamlit's AppTest."""
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

pytestmark = pytest.mark.app


def _script():
    import sys
    from pathlib import Path

    import streamlit as st

    sys.path.insert(0, str(Path.cwd()))
    from pages.devices import devices_control, placement_kwargs

    got = devices_control()
    st.write(repr(got))
    st.write(repr(placement_kwargs(*got).get("placement")))


def _run(**state) -> AppTest:
    at = AppTest.from_function(_script, default_timeout=60)
    for k, v in state.items():
        at.session_state[k] = v
    return at.run()


def test_one_device_by_default():
    at = _run()
    assert not at.exception and at.markdown[0].value == "('one', '')" and at.markdown[1].value == "None"
    assert at.sidebar.selectbox[0].label == "Devices" and not at.sidebar.text_input


def test_auto_with_a_budget():
    at = _run(devices="auto", max_memory="cpu=1GiB")
    assert not at.exception
    assert at.markdown[0].value == "('auto', 'cpu=1GiB')"
    assert "Placement(mode='auto', max_memory=(('cpu', 1073741824),))" in at.markdown[1].value
    assert at.sidebar.text_input[0].label == "Max memory per device"


def test_a_bad_budget_is_one_line_and_one_device():
    at = _run(devices="auto", max_memory="cpu=lots")
    assert not at.exception and at.markdown[0].value == "('one', '')"
    assert "cannot read the memory size" in at.sidebar.error[0].value
