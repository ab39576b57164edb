"""docs/cli.md cannot drift from the CLI (issue 40 item 7): its reference part is generated from the parsers by
scripts/gen_cli_docs.py, and this test fails when the file differs from a fresh generation."""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvviz.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _gen()


def _sections(text: str) -> dict[str, str]:
    """### heading -> its text, in the generated part."""
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_cli_md_is_the_parsers_own_list():
    head, generated = gen.current()
    assert generated, f"docs/cli.md has lost its marker line: {gen.MARKER}"
    assert generated == gen.render(), "docs/cli.md is stale: run `python scripts/gen_cli_docs.py` and commit it"
    assert head.strip().startswith("# Command line") and "## Flags, honestly" in head  # the hand-written part


def test_the_check_mode_fails_on_a_stale_file_and_regenerating_keeps_the_hand_written_part(tmp_path, monkeypatch):
    head, generated = gen.current()
    stale = tmp_path / "cli.md"
    stale.write_text(head + generated.replace("| `--plan` | off |", "| `--plan` | on |"), encoding="utf-8")
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    # a file without the marker yet: its text is kept whole, the generated part appended
    fresh = tmp_path / "new.md"
    fresh.write_text("# Command line\n\nHand-written.\n", encoding="utf-8")
    monkeypatch.setattr(gen, "DOC", fresh)
    gen.main([])
    assert fresh.read_text(encoding="utf-8").startswith("# Command line\n\nHand-written.\n\n" + gen.MARKER)


def test_the_script_runs_from_the_command_line():
    r = subprocess.run([sys.executable, "scripts/gen_cli_docs.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _leaves(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue  # an alias
                seen.add(id(sub))
                nested = list(_leaves(sub, (*prefix, name)))
                yield from nested or [((*prefix, name), sub)]


def test_every_subcommand_and_every_flag_is_there_with_its_default():
    """Read independently of the generator: each subcommand of the real parser has its section, and each of its
    flags is in that section or in the common flags, with the default argparse would use."""
    _, generated = gen.current()
    sections = _sections(generated)
    common = sections["Common flags"]
    leaves = list(_leaves(build_parser()))
    assert len(leaves) >= 17 and ("sweep-architectures",) in [p for p, _ in leaves]
    for path, sub in leaves:
        own = sections[" ".join(path)]
        for a in sub._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            name = a.option_strings[0] if a.option_strings else a.dest
            rows = [ln for ln in (own + common).splitlines() if ln.startswith(f"| `{name}")]
            assert rows, f"{' '.join(path)}: {name} is missing from docs/cli.md"
            if a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS) and not a.required:
                assert any(f"`{a.default}`" in r or f"`{a.default!r}`" in r for r in rows), \
                    f"{' '.join(path)} {name}: default {a.default!r} not in {rows}"
            if a.help and a.help != argparse.SUPPRESS and "%(" not in a.help:
                assert any(" ".join(a.help.split()).replace("|", "\\|") in r for r in rows), (path, name)


@pytest.mark.parametrize("flag", ["--plan", "--devices", "--max-memory", "--stop-at-divergence", "--seed",
                                  "--batch-with", "--no-measure", "--attention-mask", "--dtypes", "--cast-dtype",
                                  "--conditions", "--page-size", "--batch-size"])
def test_the_flags_the_hand_written_page_had_lost_are_listed(flag):
    _, generated = gen.current()
    assert f"| `{flag}" in generated


def test_the_links_into_docs_cli_md_resolve():
    text = DOC.read_text(encoding="utf-8")
    anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
    inner = re.findall(r"\]\(#([^)]+)\)", text)
    assert inner and set(inner) <= anchors, set(inner) - anchors
    links = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(((?:docs/)?cli\.md(?:#[^)]*)?)\)", md.read_text(encoding="utf-8")):
            links.append((md.name, target))
            if "#" in target:
                assert target.split("#", 1)[1] in anchors, (md.name, target)
    assert ("README.md", "docs/cli.md") in links
