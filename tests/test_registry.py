"""The view entry is the one source of each view's facts: the core iterates the registry and names no view."""
import ast
import io
import tokenize
import types
from argparse import Namespace
from pathlib import Path

import pytest

from kvviz import views
from kvviz.core.errors import KvvizError

from conftest import ROOT

# Stand-ins for the pieces a scratch entry names (the registry takes objects, never "module:function" strings)
_reopen = dict
_CLI = types.SimpleNamespace(HELP="a scratch subcommand", add_arguments=lambda p: None, command=lambda args: None)


class _Config:
    pass


def _run(lm, config, ctx=None):
    return None

# The modules that iterate the registry instead of keeping per-view tables (kvviz/views/<view>/ and the registry
# itself may name views). kvviz/teach/presets.py is left out: its scenario keys ("padding") are no view's.
CORE = [*(p for d in ("", "core", "models", "teach", "io") for p in sorted((ROOT / "kvviz" / d).glob("*.py"))
          if p.name != "presets.py"), ROOT / "app.py",
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
        out |= {v.name, *((v.command, v.command.split(" ")[0]) if v.command else ()), *v.command_aliases}
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
        views.register(views.View("nameless", "Nameless", "NamelessResult", _reopen))
    assert "nameless" not in views.names()


def test_a_view_that_declares_it_proves_is_refused(scratch_registry):
    with pytest.raises(KvvizError, match=r"declares MemoryProfile\(proves=True\): whether its run proves is derived"):
        views.register(views.View("declared", "Declared", "DeclaredResult", _reopen,
                                  memory=views.MemoryProfile(proves=True), config=_Config, run=_run))
    assert "declared" not in views._VIEWS


def test_a_view_without_a_config_and_run_is_refused(scratch_registry):
    with pytest.raises(KvvizError, match="names no config class and run"):
        views.register(views.View("runless", "Runless", "RunlessResult", _reopen,
                                  memory=views.MemoryProfile()))
    assert "runless" not in views._VIEWS


def test_every_view_has_its_facts_in_its_entry():
    for v in views.all_views():
        assert isinstance(v.memory, views.MemoryProfile), v.name
        # the plan counts the proof's kernel probes for exactly the views whose run proves (does not refuse it):
        # derived from the entry, never declared in it
        assert not v.memory.proves, v.name
        assert views.memory_profile(v.name).proves == (v.memory.reference and "prove" not in v.refusals()), v.name
        if v.page:
            assert (ROOT / "pages" / f"{v.page.stem}.py").is_file(), v.name
            assert views.for_page(v.page.stem) is v
        for run in v.run_names():
            assert views.for_run(run) is v and views.for_run(run + "_ab") is v
        if v.command:
            assert views.for_command(v.command) is v
    proving = {v.name for v in views.all_views() if views.memory_profile(v.name).proves}
    assert proving == {"split", "greedy", "dtypes", "padding", "reuse", "serving"}
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
            generic = 'with_name("view.py")' in source  # the generic page reads view.page.defaults itself
            assert generic or ("DEFAULTS" in source) == bool(v.page.defaults), v.page.stem  # a page reads its defaults


def test_a_page_prefix_other_than_its_folders_is_refused():
    from kvviz.views import MemoryProfile, Page, View, register

    v = View("some_view", "Some view", "SomeResult", _reopen, page=Page("some_page", "Investigate", "", prefix="sv_"),
             memory=MemoryProfile(), config=_Config, run=_run)
    with pytest.raises(KvvizError, match="take the prefix of its folder, 'somewhere_'"):
        register(v, "kvviz.views.somewhere")


# --- one memory-plan builder: the CLI and the page count the same run the same way ----------------------------

def _cli_plan(argv):
    from kvviz.cli import build_parser
    from kvviz.io import clirun

    return clirun.plan_for_args(build_parser().parse_args(argv))


def _page_plan(run_name, work, spec="tiny:llama", dtype="float32"):
    """The plan a page shows: pages/memory_plan.plan_for of the typed workload the page hands run_cached (its config's
    `workload()`)."""
    from pages.memory_plan import plan_for

    choice = Namespace(spec=spec, dtype=dtype, device="cpu")
    return plan_for(choice, views.for_run(run_name).name, work)


PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _page_workloads():
    """The runs tests/test_workloads.py's AppTest cases do not open (the bisector runs on a click; Serving is not among
    them): their configs' workloads, as their pages hand them to run_cached."""
    from kvviz.views.bisect.run import BisectConfig
    from kvviz.views.serving.run import ServeConfig

    return [
        (["bisect", "--prompt", PROMPT, "--split", "5", "--left-pad", "2"], "bisect",
         BisectConfig(prompt=PROMPT, split=5, left_pad=2).workload()),
        # the study's engine calls: its prompts with the prefix, new tokens, requests in flight, conditions, page size
        (["serving", "--prompt", PROMPT, "--prefix", "Q: ", "--max-new-tokens", "6", "--batch-size", "3",
          "--conditions", "alone,batch", "--page-size", "16"], "serving",
         ServeConfig(prompts=[PROMPT], shared_prefix="Q: ", conditions=("alone", "batch"), max_new_tokens=6,
                     batch_size=3, page_size=16).workload()),
        (["serving", "--prompt", PROMPT, "--engine", "llama.cpp"], "serving",
         ServeConfig(prompts=[PROMPT], engine="llama.cpp").workload()),
    ]


@pytest.mark.app  # the page side imports pages/ (Streamlit)
@pytest.mark.parametrize("case", range(len(_page_workloads())))
def test_the_cli_and_the_page_plan_the_same_run_the_same(case):
    """The CLI's plan, read off its arguments (or its config's workload), equals the plan of the typed workload the
    page builds from the same settings."""
    argv, run_name, work = _page_workloads()[case]
    cli = _cli_plan([*argv, "--model", "tiny:llama"])
    page = _page_plan(run_name, work)
    assert cli.view == page.view == views.for_run(run_name).name
    assert (cli.tokens, cli.batch, cli.dtype) == (page.tokens, page.batch, page.dtype)
    assert cli.parts() == page.parts() and cli.total == page.total > 0
    assert cli.if_identical == page.if_identical  # what a run without its float64 phase is planned at


# --- one name: the subcommand and the page's URL path derive from the view's folder; older names are aliases -----

def _folder(v) -> str:
    return v.package.rsplit(".", 1)[-1]


def _subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_subcommand_and_page_url_is_derived_from_the_views_folder():
    from kvviz.cli import build_parser

    sub = _subparsers(build_parser())
    for v in views.all_views():
        folder = _folder(v)
        if v.page:
            assert v.page.url_path == folder and v.page.prefix == folder + "_", v.name
            assert v.page.stem == folder, v.name  # pages/<folder>.py
        if not v.cli:
            continue
        head, *word = v.command.split(" ")
        assert head == folder.replace("_", "-"), v.name
        assert (v.name == folder) == (not word), v.name  # a folder's own view, or one word more in a shared folder
        parser = sub.choices[head]
        assert parser.get_default("command") == head
        if word:
            assert word[0] in _subparsers(parser).choices, v.command
        for alias in v.command_aliases:  # an older subcommand is the same parser
            assert sub.choices[alias] is parser and views.for_command(alias) is v
    assert views.get("loading_trap").command == "loading-trap" and views.get("serving").command == "serving"
    assert views.for_command("serve-study").name == "serving"


def test_help_names_the_derived_subcommand_and_its_alias(capsys):
    from kvviz.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "serving (serve-study)" in out and "loading-trap" in out


def test_an_older_subcommand_runs_the_same_view(capsys, tmp_path):
    """`serve-study` (an alias) runs the serving view exactly as `serving` does, and names it `serving`."""
    import json

    from kvviz.cli import main

    got = {}
    for command in ("serving", "serve-study"):
        out = tmp_path / f"{command}.json"
        assert main([command, "--model", "tiny:llama", "--prompt", "Hi there", "--runs", "1", "--max-new-tokens",
                     "2", "--conditions", "alone", "--quiet", "--json-out", str(out)]) == 0
        d = json.loads(out.read_text())
        got[command] = (d["kvviz_result"]["view"], d["settings"], [p["completions"] for p in d["prompts"]])
    assert got["serving"] == got["serve-study"] and got["serving"][0] == "serving"
    from kvviz.cli import build_parser  # messages and the memory plan name the subcommand, not the alias as typed

    assert build_parser().parse_args(["serve-study", "--model", "tiny:llama"]).command == "serving"


def _entry(**kw):
    page = kw.pop("page", None)
    return views.View("some_view", "Some view", "SomeResult", _reopen, memory=views.MemoryProfile(),
                      page=page, config=_Config, run=_run, **kw)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, in a copy the test may add to."""
    monkeypatch.setattr(views, "_VIEWS", dict(views._VIEWS | {v.name: v for v in views.all_views()}))


@pytest.mark.parametrize("kw, match", [
    ({"cli": _CLI, "command": "some-other"}, "its subcommand is 'some-view'.*command_aliases"),
    ({"cli": _CLI, "command": "some_view"}, "its subcommand is 'some-view'"),
    ({"cli": _CLI, "command_aliases": ("split",)}, "'split' is already view 'split'"),
    ({"cli": _CLI, "command_aliases": ("serve-study",)}, "'serve-study' is already view 'serving'"),
    ({"command": "some-other"}, "its subcommand is 'some-view'"),  # no cli.py: the one made from its config
    ({"page": views.Page("some_page", "Investigate", "")}, r"pages/some_view\.py \(its folder\), not pages/some_page\.py"),
    ({"page": views.Page("some_page", "Investigate", "", url_aliases=("some_page",))}, "not pages/some_page.py"),
    ({"page": views.Page("some_view", "Investigate", "", url_path="some-view")}, "URL path is its folder"),
    ({"page": views.Page("some_view", "Investigate", "", url_aliases=("split_point",))}, "already view 'split'"),
    ({"page": views.Page("some_view", "Investigate", "", url_aliases=("split",))}, "already view 'split'"),
    ({"page": views.Page("some_view", "Investigate", "", url_aliases=("some_view",))}, "its page's own URL path"),
])
def test_an_entry_declaring_another_name_than_the_derived_is_refused(scratch_registry, kw, match):
    with pytest.raises(KvvizError, match=match):
        views.register(_entry(**kw), "kvviz.views.some_view")
    assert "some_view" not in views._VIEWS


def test_older_names_are_accepted_as_aliases(scratch_registry):
    v = views.register(_entry(cli=_CLI, command_aliases=("some-older",),
                              page=views.Page("some_view", "Investigate", "", url_aliases=("some_page",))),
                       "kvviz.views.some_view")
    assert v.command == "some-view" and v.page.url_path == "some_view" and v.page.prefix == "some_view_"
    assert views.for_command("some-older") is v and views.page_url_aliases()["some_page"] == "some_view"
    shared = views.register(views.View("some_part", "Part", "PartResult", _reopen, cli=_CLI,
                                       command="some-view part", memory=views.MemoryProfile(),
                                       config=_Config, run=_run),
                            "kvviz.views.some_view")  # a second view of the folder: its subcommand and a word
    assert views.for_command("some-view part") is shared
    with pytest.raises(KvvizError, match="'some-view' and a word of its own"):
        views.register(views.View("other_part", "Part", "PartResult", _reopen, cli=_CLI,
                                  command="other part", memory=views.MemoryProfile(), config=_Config,
                                  run=_run), "kvviz.views.some_view")


def test_a_folders_one_view_takes_the_folders_name(tmp_path, monkeypatch):
    pkg = tmp_path / "named_views" / "some_folder"
    pkg.mkdir(parents=True)
    (tmp_path / "named_views" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('from kvviz.views import MemoryProfile, View\n'
                                     'VIEW = View("another_name", "T", "R", "report:reopen", memory=MemoryProfile())\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KvvizError, match="named 'another_name': a view takes its folder's name"):
        views.add_folder("named_views.some_folder")
    assert "another_name" not in views._VIEWS


def test_the_docs_name_every_alias_the_registry_keeps():
    """docs/cli.md's sentence on older names lists exactly the entries' command and page URL aliases."""
    import re

    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sentence = doc[doc.index("Older names still work as aliases"):].split("\n\n")[0]
    commands = dict(re.findall(r"`([a-z-]+)` runs `([a-z-]+)`", sentence))
    assert commands == {a: v.command for v in views.all_views() for a in v.command_aliases}
    assert set(re.findall(r"`/([a-z_]+)`", sentence)) == set(views.page_url_aliases())


def test_every_older_page_url_has_its_file_for_a_fresh_servers_first_request():
    """A fresh Streamlit server looks its first request's URL up among pages/ file names before app.py runs: an older
    URL with no file there answered "Page not found" and landed on Home (seen in Chromium). Each older URL keeps a
    file that only hands the request to app.py (which sends it on to the page's own URL)."""
    aliases = views.page_url_aliases()
    assert len(aliases) == 9
    for old, stem in aliases.items():
        text = (ROOT / "pages" / f"{old}.py").read_text()
        assert f"/{stem} with its settings" in text and text.rstrip().endswith("ensure_navigation()"), old
        assert (ROOT / "pages" / f"{stem}.py").exists() and stem != old
