"""bench/pages_bench.py times what each page does on its first run with its default controls: it must cover every
page that runs a model, and each of its calls must run (here on a tiny model, quickly)."""
import importlib.util
from pathlib import Path

import pytest

import kvviz
from kvviz import views

from conftest import DEVICE, QUANTO

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("pages_bench", ROOT / "bench" / "pages_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.heavy
@QUANTO  # the quantized page's default run uses a quanto cache
def test_the_pages_bench_covers_every_page_that_runs_and_each_call_runs():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    calls = _bench().page_calls(lm, "tiny:llama")
    # every view whose page has controls and a run, by the registry
    # (a page whose button starts an engine's own process is left to its own tests: tests/test_engine_layers.py)
    assert set(calls) == {v.name for v in views.all_views() if v.page and v.page.prefix and not v.page.starts_engine}
    for name, call in calls.items():
        res = call()
        assert res is not None, name
