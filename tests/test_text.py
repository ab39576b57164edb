"""kvviz.core.text: how token texts are shown (lone bytes as bytes, never mojibake), in the views and their pages."""
import pytest

import kvviz

from conftest import DEVICE


def test_texts_of_random_bytes_show_their_bytes_not_mojibake():
    from kvviz.core.text import REPLACEMENT, display_text

    lm = kvviz.load_model("tiny:mistral", "float32", DEVICE)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = lm.tokenizer  # byte-level: one token a byte; a random model emits bytes that are not UTF-8
    byte = bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(byte[0xE4]), tok.convert_tokens_to_ids(byte[0xFF])] + \
        tok("Hi there", add_special_tokens=False)["input_ids"]
    assert REPLACEMENT in tok.decode(ids)  # what the sliding-window scenario's texts showed
    shown = display_text(tok, ids)
    assert REPLACEMENT not in shown and "⟨e4⟩" in shown and "⟨ff⟩" in shown and shown.endswith("Hi there")
    clean = tok("Hello world", add_special_tokens=False)["input_ids"]
    assert display_text(tok, clean) == tok.decode(clean)


@pytest.mark.app
def test_the_sliding_window_scenario_runs_on_its_own_and_its_texts_show_no_mojibake():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT
    from kvviz.core.text import REPLACEMENT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.run()
    at.button(key="preset_window").click().run()
    assert not at.exception, at.exception
    shown = [e.value for e in list(at.info) + list(at.success) + list(at.error) + list(at.warning)]
    assert not any("Run the matrix" in v for v in shown), shown  # it ran: no "press Run the matrix"
    assert any(v.startswith("**Verdict:") for v in shown) and at.get("plotly_chart"), shown
    texts = [t.value for t in at.text] + [c.value for c in at.caption] + shown
    assert not [t for t in texts if REPLACEMENT in t]


def test_split_next_token_columns_show_lone_bytes_not_mojibake():
    """Split point's logits table (next token, full and cached): a token that is one byte of a UTF-8 character shows
    as its byte (⟨e4⟩), not U+FFFD - on a byte-level tiny model most next tokens are such bytes."""
    import kvviz
    from kvviz.core.text import REPLACEMENT
    from kvviz.views.split.figures import logits_frame
    from kvviz.views.split.run import SplitConfig, run_split

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_split(lm, SplitConfig("The capital of France is Paris, and the capital of Italy is", split=20),
                    prove=False)
    frame = logits_frame(res)
    shown = list(frame["next (full)"]) + list(frame["next (cached)"])
    assert shown and not [t for t in shown if REPLACEMENT in t], shown
    raw = [lm.tokenizer.decode([int(i)]) for i in range(lm.config.vocab_size)]
    assert any(REPLACEMENT in t for t in raw)  # the tokenizer has such tokens (the test can fail)
