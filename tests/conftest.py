import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARTIFACTS = ROOT / "test-artifacts"

# One kvviz cache for the whole run (tiny models, the converted default model), fresh for every test session so
# the default model's first load really converts; HF stays offline as on the target machines.
_CACHE = Path(os.environ.get("KVVIZ_TEST_CACHE", "")) if os.environ.get("KVVIZ_TEST_CACHE") else None
if _CACHE is None:
    import tempfile

    _CACHE = Path(tempfile.mkdtemp(prefix="kvviz-test-cache-"))
os.environ["KVVIZ_CACHE"] = str(_CACHE)
# A Hugging Face cache of the tests' own (tests/test_routes.py lays a hub model out in it), set before anything
# imports huggingface_hub, which reads it once; offline as on the target machines.
os.environ["HF_HUB_CACHE"] = str(_CACHE / "hf-hub")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = "Hello world, caching is fun! 123"
# The device library tests run on: cpu by default (CI); `make gpu-check` sets KVVIZ_TEST_DEVICE=auto on a GPU machine.
DEVICE = os.environ.get("KVVIZ_TEST_DEVICE", "cpu")

# Property tests explore the same examples on every run, so CI is reproducible (and a failure can be replayed).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("kvviz", derandomize=True, database=None, print_blob=True)
_hyp_settings.load_profile("kvviz")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def kvviz_cache() -> Path:
    return _CACHE
