"""The view entry is the one source of each view's facts: the core iterates the registry and names no view."""
import ast
import io
import tokenize
from argparse import Namespace
from pathlib import Path

import pytest

from kvviz import views
from kvviz.errors import KvvizError

from conftest import ROOT

# The modules that iterate the registry instead of keeping per-view tables (kvviz/views/<view>/ and the registry
# itself may name views). kvviz/presets.py is left out: its scenario keys ("padding") are no view's.
CORE = [*(p for p in sorted((ROOT / "kvviz").glob("*.py")) if p.name != "presets.py"), ROOT / "app.py",
        ROOT / "pages" / "runner.py", ROOT / "pages" / "state.py", ROOT / "pages" / "memory_plan.py",
        ROOT / "pages" / "common.py", ROOT / "pages" / "open_result.py", ROOT / "tests" / "test_pages_bench.py"]
# The modules that used to keep a per-view table: there, view names that are ordinary words too ("cache" is also
# the cache step policy and the cache argument, "split" the split point, "dtypes" a list of dtypes) may not be a
# dict key or compared with == / in either.
TABLES = {"memory.py", "meeting.py", "export.py", "cli.py", "clirun.py", "runner.py", "state.py", "memory_plan.py",
          "test_pages_bench.py"}
ALSO_WORDS = {"cache", "split", "dtypes"}


def view_words() -> set[str]:
    out = set()
    for v in views.all_views():
        out |= {v.name, *((v.command, v.command.split(" ")[0]) if v.command else ())}
        out |= set(v.run_names())
    return out


def literals(path: Path):
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str):
                yield tok.start[0], value


def named_views(path: Path, words: set[str]) -> list[str]:
    """Where a file names a view: a string literal that is a view's name, subcommand or run name; for words that are
    also ordinary words, only as a dict key or compared with == / in, in the modules that kept per-view tables."""
    hits = [f"{path.name}:{line}: {v!r}" for line, v in literals(path) if v in words - ALSO_WORDS]
    if path.name not in TABLES:
        return hits
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Dict):
            keys = node.keys
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                keys += side.elts if isinstance(side, (ast.Tuple, ast.Set, ast.List)) else [side]
        for k in keys:
            if isinstance(k, ast.Constant) and k.value in ALSO_WORDS & words:
                hits.append(f"{path.name}:{k.lineno}: {k.value!r} (as a key or compared)")
    return hits


def test_the_check_finds_a_view_name(tmp_path):  # so that the next test can fail
    words = view_words()
    assert {"loading_trap", "loading-trap", "serve-study", "kv_reload", "trap"} <= words
    sample = tmp_path / "memory.py"  # a module that kept a table
    sample.write_text('FORWARDS = {"split": 2, "loading-trap": 1}\nif view == "cache":\n    pass\n')
    assert len(named_views(sample, words)) == 3


def test_no_view_is_named_outside_its_folder_and_the_registry():
    words = view_words()
    hits = [h for path in CORE for h in named_views(path, words)]
    assert hits == []


def test_a_view_without_a_memory_profile_is_refused():
    with pytest.raises(KvvizError, match="no memory profile"):
        views.register(views.View("nameless", "Nameless", "NamelessResult", "report:reopen"))
    assert "nameless" not in views.names()


def test_every_view_has_its_facts_in_its_entry():
    for v in views.all_views():
        assert isinstance(v.memory, views.MemoryProfile), v.name
        if v.page:
            assert (ROOT / "pages" / f"{v.page.stem}.py").is_file(), v.name
            assert views.for_page(v.page.stem) is v
        for run in v.run_names():
            assert views.for_run(run) is v and views.for_run(run + "_ab") is v
        if v.command:
            assert views.for_command(v.command) is v
    prefixes = views.page_prefixes()
    assert len(set(prefixes.values())) == len(prefixes)  # one prefix a page
    assert not any(a != b and a.startswith(b) for a in prefixes.values() for b in prefixes.values())
    for v in views.all_views():  # a page's controls take its folder's name
        if v.page:
            assert v.page.prefix == v.package.rsplit(".", 1)[-1] + "_", (v.name, v.page.prefix)
    others = views.link_prefixes()  # a saved link's other prefix reads as one page's own, and hides no other's
    assert set(others.values()) <= set(prefixes.values())
    assert not any(o.startswith(p) or p.startswith(o) for o in others for p in prefixes.values())


def test_page_defaults_live_in_the_view_entries():
    """pages/defaults.py reads each view's Page(defaults=...) by folder; every page that draws a prompt has one."""
    import sys

    sys.path.insert(0, str(ROOT))
    from pages.defaults import DEFAULTS

    assert DEFAULTS == views.page_defaults()
    for v in views.all_views():
        if v.page:
            folder = v.package.rsplit(".", 1)[-1]
            assert DEFAULTS[folder] is v.page.defaults
            source = (ROOT / "pages" / f"{v.page.stem}.py").read_text()
            assert ("DEFAULTS" in source) == bool(v.page.defaults), v.page.stem  # a page reads the defaults it has


def test_a_page_prefix_other_than_its_folders_is_refused():
    from kvviz.views import MemoryProfile, Page, View, register

    v = View("some_view", "Some view", "SomeResult", "report:reopen", page=Page("some_page", "Investigate", "", prefix="sv_"),
             memory=MemoryProfile())
    with pytest.raises(KvvizError, match="take the prefix of its folder, 'somewhere_'"):
        register(v, "kvviz.views.somewhere")


# --- one memory-plan builder: the CLI and the page count the same run the same way ----------------------------

def _cli_plan(argv):
    from kvviz import memory
    from kvviz.cli import build_parser

    return memory.plan_for_args(build_parser().parse_args(argv))


def _page_plan(run_name, key_parts, spec="tiny:llama", dtype="float32"):
    from pages.memory_plan import plan_for
    from pages.runner import workload

    choice = Namespace(spec=spec, dtype=dtype, device="cpu")
    return plan_for(choice, views.for_run(run_name).name, workload(key_parts))


PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.mark.parametrize("argv, run_name, key_parts", [
    (["split", "--prompt", PROMPT, "--split", "5", "--left-pad", "2"], "split",
     {"cfg": {"prompt": PROMPT, "split": 5, "left_pad": 2, "mode": "chunk"}}),
    (["bisect", "--prompt", PROMPT, "--split", "5"], "bisect", {"cfg": {"prompt": PROMPT, "split": 5}}),
    (["greedy", "--prompt", PROMPT, "--max-new-tokens", "12"], "greedy_ab",
     {"cfg": {"prompt": PROMPT, "max_new_tokens": 12}}),
    (["padding", "--prompt", PROMPT, "--left-pad", "3", "--split", "4"], "padding",
     {"prompt": PROMPT, "pad": 3, "split": 4}),
    (["reuse", "--prefix", PROMPT, "--continuation", " Rome", "--continuation", " and Madrid", "--max-new-tokens",
      "6"], "reuse", {"prefix": PROMPT, "conts": [" Rome", " and Madrid"], "n": 6}),
    (["loading-trap", "--prompt", PROMPT, "--max-new-tokens", "8"], "trap", {"prompt": PROMPT, "n": 8}),
    (["quant", "--prompt", PROMPT, "--max-new-tokens", "8", "--weights", "int8"], "quant",
     {"prompt": PROMPT, "n": 8, "weights": "int8"}),
    (["check"], "check", {"weights": "none"}),
    (["cache", "size", "--tokens", "300", "--batch", "2"], "kv_size", {"tokens": 300, "batch": 2}),
    (["dtypes", "--prompt", PROMPT, "--dtypes", "bfloat16,float16"], "dtypes",
     {"prompts": [PROMPT], "dtypes": ["bfloat16", "float16"]}),
])
def test_the_cli_and_the_page_plan_the_same_run_the_same(argv, run_name, key_parts):
    cli = _cli_plan(argv[:1] + (argv[1:2] if argv[0] == "cache" else []) + ["--model", "tiny:llama"]
                    + argv[(2 if argv[0] == "cache" else 1):])
    page = _page_plan(run_name, key_parts)
    assert cli.view == page.view == views.for_run(run_name).name
    assert (cli.tokens, cli.batch, cli.dtype) == (page.tokens, page.batch, page.dtype)
    assert cli.parts() == page.parts() and cli.total == page.total > 0
