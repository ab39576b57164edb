"""Write docs/cli.md's reference part from the CLI's own parsers (kvviz/cli.py build_parser: every view's cli module
adds its subcommand, kvviz/archsweep.add_parser adds sweep-architectures), so the list of subcommands and flags
cannot drift from the code.

    python scripts/gen_cli_docs.py           # rewrite the part of docs/cli.md below the marker
    python scripts/gen_cli_docs.py --check   # exit 1 when docs/cli.md is stale (tests/test_cli_docs.py does this)

Everything above the marker line in docs/cli.md is written by hand and kept as it is."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
MARKER = ("<!-- Generated below by scripts/gen_cli_docs.py from the parsers: do not edit by hand "
          "(tests/test_cli_docs.py fails when it is stale). -->")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, list[str], str, argparse.ArgumentParser]]:
    """(name, aliases, help, parser) of each subcommand, in the order --help lists them; an alias is not repeated."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            by_parser: dict[int, list[str]] = {}
            for name, sub in action.choices.items():
                by_parser.setdefault(id(sub), []).append(name)
            for names in by_parser.values():
                sub = action.choices[names[0]]
                out.append((names[0], names[1:], helps.get(names[0], ""), sub))
    return out


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(a: argparse.Action) -> str:
    name = ", ".join(a.option_strings) if a.option_strings else a.dest
    if a.nargs == 0:
        return f"`{name}`"
    if a.choices is not None:
        arg = "{" + ",".join(str(c) for c in a.choices) + "}"
    else:
        arg = a.metavar if isinstance(a.metavar, str) else (a.dest.upper() if a.option_strings else "")
    arg = {None: arg, "?": f"[{arg}]", "*": f"[{arg} ...]", "+": f"{arg} [{arg} ...]"}.get(a.nargs, arg)
    return f"`{name} {arg}`" if arg else f"`{name}`"


def _default(a: argparse.Action) -> str:
    if a.required or not a.option_strings:
        return "required"
    if isinstance(a, argparse._StoreTrueAction):
        return "off"
    if isinstance(a, argparse._StoreFalseAction):
        return "on"
    if a.default is None or a.default == argparse.SUPPRESS:
        return "—"
    if isinstance(a, argparse._AppendAction) and a.default == []:
        return "—"
    if isinstance(a.default, str) and (a.default == "" or a.default != a.default.strip()):
        return f"`{a.default!r}`"  # an empty string or one with edge spaces, visible as such
    return f"`{a.default}`"


def _help(a: argparse.Action, parser: argparse.ArgumentParser) -> str:
    if not a.help:
        return ""
    text = parser._get_formatter()._expand_help(a)  # %(default)s and friends, as --help shows them
    repeat = isinstance(a, argparse._AppendAction) and "repeat" not in text
    return _cell(text) + (" (repeatable)" if repeat else "")


def _key(a: argparse.Action, parser: argparse.ArgumentParser) -> tuple:
    return (tuple(a.option_strings), _flag(a), _default(a), _help(a, parser))


def _refused(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """The common run flags a subcommand refuses, and why (its view's run refusals and its parser's `not_honoured`)."""
    from kvviz.cli import refused_flags

    return refused_flags(command, parser.get_default("not_honoured"))


def _table(rows: list[tuple[argparse.Action, argparse.ArgumentParser]]) -> list[str]:
    out = ["| flag | default | what it does |", "|---|---|---|"]
    out += [f"| {_flag(a)} | {_default(a)} | {_help(a, p)} |" for a, p in rows]
    return out


def _leaves(parser, prefix=()) -> list[tuple[tuple[str, ...], list[str], str, argparse.ArgumentParser, bool]]:
    """Every subcommand, nested ones (`cache save`) included: (path, aliases, help, parser, has_subcommands)."""
    out = []
    for name, aliases, help_, sub in _subcommands(parser):
        nested = _subcommands(sub)
        out.append(((*prefix, name), aliases, help_, sub, bool(nested)))
        out += _leaves(sub, (*prefix, name))
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The generated part of docs/cli.md (from the marker line on)."""
    if parser is None:
        sys.path.insert(0, str(ROOT))
        from kvviz.cli import build_parser

        parser = build_parser()
    leaves = _leaves(parser)
    runnable = [x for x in leaves if not x[4]]
    # the options every view subcommand shares, written once (the two that are not views, open and
    # sweep-architectures, have their own)
    views = [x for x in runnable if x[0][0] not in ("open", "sweep-architectures")]
    keysets = [{_key(a, x[3]) for a in _options(x[3])} for x in views]
    common = set.intersection(*keysets) if keysets else set()
    first = views[0][3] if views else parser
    common_rows = [(a, first) for a in _options(first) if _key(a, first) in common]

    lines = [MARKER, "", "## Every subcommand and flag", "",
             f"`{parser.prog} <subcommand> [flags]`; `{parser.prog} <subcommand> --help` prints the same list. "
             + _cell(parser.description or ""), ""]
    lines += ["| subcommand | what it does |", "|---|---|"]
    for path, aliases, help_, _, nested in leaves:
        if nested:
            continue
        alias = f" (alias: {', '.join(f'`{a}`' for a in aliases)})" if aliases else ""
        lines.append(f"| [`{' '.join(path)}`](#{'-'.join(path)}){alias} | {_cell(help_)} |")
    lines += ["", "### Common flags", "", "Every view subcommand (all but `open` and `sweep-architectures`) takes "
              "these; one it cannot honour is refused in one line (see the table above).", ""]
    lines += _table(common_rows)
    lines += ["", "Which subcommand honours which run flag (`yes`) and which refuses it (exit 2, the reason in its "
              "section below):", "", "| subcommand | `--invariant` | `--no-proof` | `--json-out` / `--html` |",
              "|---|---|---|---|"]
    for path, _, _, sub, _ in views:
        refused = _refused(sub, ' '.join(path))
        word = {f: "refused" if f in refused else "yes" for f in ("invariant", "no_proof", "json_out", "html")}
        out = word["json_out"] if word["json_out"] == word["html"] else "mixed"
        lines.append(f"| `{' '.join(path)}` | {word['invariant']} | {word['no_proof']} | {out} |")
    for path, aliases, help_, sub, nested in leaves:
        lines += ["", f"### {' '.join(path)}", ""]
        if help_:
            lines += [_cell(help_), ""]
        if aliases:
            lines += [f"Also runs as {', '.join(f'`{a}`' for a in aliases)}.", ""]
        if nested:
            lines += ["Subcommands: " + ", ".join(f"[`{' '.join(p)}`](#{'-'.join(p)})" for p, *_ in leaves
                                                  if p[:-1] == path) + "."]
            continue
        if _refused(sub, ' '.join(path)):
            lines += ["Refuses (exit 2):", ""]
            lines += [f"- `--{flag.replace('_', '-')}`: {_cell(why)}" for flag, why in _refused(sub, ' '.join(path)).items()]
            lines += [""]
        own = [(a, sub) for a in _options(sub) if path[0] in ("open", "sweep-architectures")
               or _key(a, sub) not in common]
        is_view = path[0] not in ("open", "sweep-architectures")
        if own:
            lines += [("The common flags, and:" if is_view else "Flags:"), ""] + _table(own)
        else:
            lines += ["The common flags only." if is_view else "No flags."]
    return "\n".join(lines) + "\n"


def current(doc: Path | None = None) -> tuple[str, str]:
    """(the hand-written part above the marker, the generated part from it on) of docs/cli.md."""
    text = (doc or DOC).read_text(encoding="utf-8")
    head, sep, tail = text.partition(MARKER)
    return head, sep + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md is stale, change nothing")
    args = ap.parse_args(argv)
    head, generated = current()
    fresh = render()
    if args.check:
        if generated != fresh:
            print("docs/cli.md is stale: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(head.rstrip("\n") + "\n\n" + fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
