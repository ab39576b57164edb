"""python -m kvviz: JSON output, readable summary, one-line errors with non-zero exit."""
import json
import subprocess
import sys

import pytest

from kvviz.cli import main

from conftest import DEVICE, PROMPT, ROOT


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_split_json_has_everything(capsys):
    code, out, err = run_cli(capsys, "split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "10",
                             "--dtype", "float32", "--left-pad", "3", "--position-ids", "omit", "--json", "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert d["settings"]["split"] == 10 and d["settings"]["left_pad"] == 3 and d["settings"]["dtype"] == "float32"
    assert d["verdict"] == "logic"
    n = len(d["tokens"]) - 10
    assert d["compared_positions"] == list(range(10, len(d["tokens"])))
    for metric in ("max_abs", "mean_abs", "relative", "cosine", "eps_units"):
        m = d["result"]["hidden"][metric]
        assert len(m) == len(d["layer_labels"]) == 5 and all(len(row) == n for row in m)
    assert set(d["result"]["logits"]) >= {"max_abs", "kl", "argmax_agree", "top5_overlap"}
    assert len(d["result"]["kv"]) == 4
    assert d["result"]["describe"]["absolute Δ"]["max"] > 0
    assert d["float64_evidence"]["dtype"] == "float64" and d["float64_evidence"]["max_relative"] > 1e-3


def test_split_summary_is_readable(capsys):
    code, out, err = run_cli(capsys, "split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "5",
                             "--dtype", "bfloat16", "--mode", "step")
    assert code == 0
    assert "verdict: PRECISION" in out or "verdict: IDENTICAL" in out
    assert "layer 4 + final norm" in out
    assert "%]" in err  # progress went to stderr


@pytest.mark.parametrize("args, msg", [
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "0"], "outside the prompt"),
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "500"], "outside the prompt"),
    (["split", "--model", "tiny:gpt2", "--prompt", "  ", "--split", "1"], "empty"),
    (["split", "--model", "tiny:gpt2", "--prompt", PROMPT, "--split", "3", "--left-pad", "-1"], "left-pad"),
    (["split", "--model", "nowhere/../x", "--prompt", PROMPT, "--split", "3"], "not found"),
    (["split", "--model", "tiny:bert", "--prompt", PROMPT, "--split", "3"], "unknown tiny model"),
])
def test_bad_input_one_line_nonzero(capsys, args, msg):
    code, out, err = run_cli(capsys, *args, "--quiet")
    assert code != 0
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unexpected_error_is_one_line_and_its_traceback_on_request(capsys, monkeypatch):
    """An error kvviz did not foresee (a bug, or a model's own code failing) is one line and exit 3, as the app
    shows it; KVVIZ_DEBUG=1 lets the traceback through. An out-of-memory error keeps its own line (exit 1)."""
    from kvviz import views

    split = views.get("split")
    real = split.cli_module()

    def boom(args):
        raise ValueError("a model's own code failed\nsecond line of its message")

    monkeypatch.setattr(real, "command", boom)
    monkeypatch.delenv("KVVIZ_DEBUG", raising=False)
    argv = ["split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "3", "--quiet"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 3 and out == ""
    assert err.strip().splitlines() == [
        "kvviz: unexpected error (ValueError): a model's own code failed - a bug in kvviz or in the model's own "
        "code; KVVIZ_DEBUG=1 shows the traceback"]
    monkeypatch.setenv("KVVIZ_DEBUG", "1")
    with pytest.raises(ValueError, match="own code failed"):
        main(argv)
    monkeypatch.setattr(real, "command", lambda args: (_ for _ in ()).throw(RuntimeError("CUDA out of memory.")))
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and "out of memory; use a shorter prompt" in err and len(err.strip().splitlines()) == 1


def test_bad_argument_types_exit_2():
    # through the real entry point: argparse errors are one line too
    bad = [["split", "--model", "tiny:gpt2", "--prompt", "x", "--split", "abc"],
           ["split", "--prompt", "x", "--split", "1", "--dtype", "int4"]]
    from conftest import EACH_CASE_AS_ITS_COMMAND

    p = subprocess.run([sys.executable, "-c", EACH_CASE_AS_ITS_COMMAND, json.dumps(list(enumerate(bad)))],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (rc, err), (rc2, err2) = [(d["rc"], d["stderr"]) for d in map(json.loads, p.stdout.splitlines())]
    assert rc == 2, err
    assert err.strip().startswith("kvviz: error:") and len(err.strip().splitlines()) == 1, err
    assert rc2 == 2 and "invalid choice" in err2, err2


def test_greedy_json(capsys):
    code, out, err = run_cli(capsys, "greedy", "--model", "tiny:gpt2", "--prompt", "Hello there", "--max-new-tokens",
                             "6", "--left-pad", "2", "--paths", "no_cache,cache,generate,user_loop,float64",
                             "--json", "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert set(d["paths"]) == {"no_cache", "cache", "generate", "user_loop", "float64"}
    assert all(len(p["token_ids"]) == 6 for p in d["paths"].values())
    assert all(p["forwards"] == 6 for p in d["paths"].values())
    assert len(d["pairs"]) == 10
    user = [p for p in d["pairs"] if "user_loop" in (p["a"], p["b"]) and p["first_divergence"] is not None]
    assert user and all(p["verdict"] == "logic" for p in user)


def test_greedy_fast_summary(capsys):
    code, out, err = run_cli(capsys, "greedy", "--model", "tiny:llama", "--prompt", "Hello there",
                             "--max-new-tokens", "6", "--fast", "--dtype", "bfloat16", "--quiet")
    assert code == 0
    assert "FAST PREVIEW" in out and "fast preview" in out


@pytest.mark.parametrize("n", ["0", "100000"])
def test_greedy_bad_token_counts(capsys, n):
    code, out, err = run_cli(capsys, "greedy", "--model", "tiny:gpt2", "--prompt", "x", "--max-new-tokens", n,
                             "--quiet")
    assert code == 1 and "between 1 and" in err and len(err.strip().splitlines()) == 1


def test_dtypes_prompt_set_json_and_progress(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Hello world\nSecond prompt here\nA third one, longer than the others\n")
    code, out, err = run_cli(capsys, "dtypes", "--model", "tiny:qwen2", "--prompts", str(f), "--limit", "2",
                             "--dtypes", "float32,bfloat16", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["n_prompts"] == 2 and d["dtypes"] == ["float64", "float32", "bfloat16"]
    for how in ("mean", "max"):
        assert len(d["per_layer"]["max_abs"][how]["bfloat16"]) == 5
    assert "Prompt 2/2" in err  # progress on stderr


def test_dtypes_builtin_summary(capsys):
    code, out, err = run_cli(capsys, "dtypes", "--model", "tiny:llama", "--prompts", "builtin", "--limit", "3",
                             "--quiet")
    assert code == 0 and "layers" not in err
    assert "mean over prompts" in out and "float16" in out and "verdicts" in out


def test_padding_and_reuse_cli(capsys):
    code, out, err = run_cli(capsys, "padding", "--model", "tiny:gpt2", "--prompt", "Hello world, caching",
                             "--left-pad", "3", "--json", "--quiet")
    assert code == 0
    cells = json.loads(out)["cells"]
    assert len(cells) == 15 and {c["verdict"] for c in cells} >= {"logic", "precision"}
    code, out, err = run_cli(capsys, "reuse", "--model", "tiny:llama", "--prefix", "Story:", "--continuation",
                             " Once", "--continuation", " The cat", "--max-new-tokens", "6", "--quiet")
    assert code == 0 and "reused" in out and "logic" in out


@pytest.mark.parametrize("args, msg", [
    (["dtypes", "--model", "tiny:gpt2", "--prompts", "/no/such/file.txt"], "not found"),
    (["dtypes", "--model", "tiny:gpt2", "--prompts", "builtin", "--limit", "0"], "limit"),
    (["dtypes", "--model", "tiny:gpt2", "--prompt", "x y z", "--split", "soon"], "--split"),
    (["padding", "--model", "tiny:gpt2", "--prompt", "Hello", "--left-pad", "-2"], "left-pad"),
    (["reuse", "--model", "tiny:gpt2", "--prefix", "a", "--continuation", " b", "--max-new-tokens", "0"],
     "between 1 and"),
])
def test_lab_bad_input(capsys, args, msg):
    code, out, err = run_cli(capsys, *args, "--quiet")
    assert code == 1 and msg in err and len(err.strip().splitlines()) == 1


def test_non_utf8_and_empty_prompt_files(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not text")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for f, msg in ((bad, "not UTF-8"), (empty, "no prompts")):
        code, out, err = run_cli(capsys, "dtypes", "--model", "tiny:gpt2", "--prompts", str(f), "--quiet")
        assert code == 1 and msg in err


def test_no_proof_skips_the_invariant_rerun(monkeypatch, capsys):
    import kvviz.views.padding.run
    import kvviz.views.reuse.run

    seen = {}
    for mod, name in ((kvviz.views.padding.run, "run_padding"), (kvviz.views.reuse.run, "run_reuse")):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **k):
            seen[_name] = k.get("prove")
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    assert main(["padding", "--model", "tiny:gpt2", "--prompt", "Hello world, caching", "--no-proof", "--json",
                 "--quiet"]) == 0
    assert all(c["proved"] is None for c in json.loads(capsys.readouterr().out)["cells"])
    assert main(["reuse", "--model", "tiny:gpt2", "--prefix", "A.", "--continuation", " B", "--max-new-tokens", "2",
                 "--no-proof", "--json", "--quiet"]) == 0
    assert seen == {"run_padding": False, "run_reuse": False}
    assert main(["padding", "--model", "tiny:gpt2", "--prompt", "Hello world, caching", "--json", "--quiet"]) == 0
    assert seen["run_padding"] is None  # the one default everywhere: prove where a precision cell needs it


def test_matrix_sliding_window_preset_names_what_it_needs(capsys):
    assert main(["matrix", "--model", "tiny:llama", "--preset", "sliding-window", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no sliding window" in err and "tiny:mistral" in err and "seed" not in err


# Every common flag either does what it says or is refused with one line (exit 2): never accepted and ignored.
REFUSED = [
    (["check"], "--invariant"), (["check"], "--no-proof"), (["quant", "--prompt", "Hi", "--kv", "fp8"], "--invariant"),
    (["loading-trap"], "--invariant"), (["bisect", "--prompt", "Hello there", "--split", "3"], "--no-proof"),
    (["cache", "save", "--prompt", "Hi", "--out", "x.safetensors"], "--invariant"),
    (["cache", "size", "--tokens", "8"], "--invariant"),
]


@pytest.mark.parametrize("argv,flag", REFUSED)
def test_a_flag_a_subcommand_cannot_honour_is_refused_in_one_line(argv, flag, capsys, monkeypatch):
    monkeypatch.setattr("kvviz.models.loading.load_model", lambda *a, **k: pytest.fail("refused flags must fail before loading"))
    code = main([*argv, flag, "--model", "tiny:llama", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvviz: error: " + flag) and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("out_flag", ["--json-out", "--html"])
def test_cache_save_refuses_exports_and_load_and_size_write_them(out_flag, tmp_path, capsys):
    base = ["--model", "tiny:llama", "--quiet", "--device", DEVICE]
    saved = tmp_path / "c.safetensors"
    assert main(["cache", "save", "--prompt", PROMPT, "--out", str(saved), out_flag, str(tmp_path / "x"), *base]) == 2
    assert "its product is the --out file" in capsys.readouterr().err and not saved.exists()
    assert main(["cache", "save", "--prompt", PROMPT, "--out", str(saved), *base]) == 0
    for argv, name in ((["cache", "load", "--file", str(saved), "--continue", " more"], "reload"),
                       (["cache", "size", "--tokens", "16"], "size")):
        target = tmp_path / f"{name}.out"
        assert main([*argv, out_flag, str(target), *base]) == 0
        text = target.read_text(encoding="utf-8")
        if out_flag == "--json-out":
            d = json.loads(text)
            assert d["kvviz_result"]["view"] == {"reload": "kv_reload", "size": "kv_size"}[name]
        else:
            assert text.lstrip().lower().startswith("<!doctype html")


def test_invariant_is_honoured_and_said(capsys):
    assert main(["split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "5", "--invariant", "--quiet",
                 "--device", DEVICE, "--no-proof"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(run in invariant mode)") and "verdict: IDENTICAL" in out
    assert main(["split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "5", "--invariant", "--json",
                 "--quiet", "--device", DEVICE]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["execution"]["invariant"] is True


def test_the_flags_table_in_the_docs_is_the_code_s():
    """docs/cli.md's table of common flags (honoured or refused) against every view subcommand's parser."""
    import argparse
    import re

    from kvviz import views
    from kvviz.cli import build_parser, refused_flags

    from conftest import ROOT

    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    table = {m.group(1): m.group(2, 3, 4) for m in
             re.finditer(r"^\| `([a-z -]+)` \| (yes|refused) \| (yes|refused) \| (yes|refused) \|$", doc, re.M)}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    code = {}
    for name, parser in sub.choices.items():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        leaves = nested[0].choices.items() if nested else [("", parser)]
        for leaf, p in leaves:
            command = f"{name} {leaf}".strip()
            if not any(v.command and v.command.split(" ")[0] == name for v in views.all_views()):
                continue  # open, sweep-architectures: no view, no common run flags
            refused = refused_flags(command, p.get_default("not_honoured"))
            word = lambda flag: "refused" if flag in refused else "yes"  # noqa: E731
            code[command] = (word("invariant"), word("no_proof"),
                                              word("json_out") if word("json_out") == word("html") else "mixed")
    assert table == code
