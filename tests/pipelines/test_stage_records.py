"""What each stage makes of the same records: quantize calibrates on every schema, distill needs prompts."""
import json

import pytest

from polybasic.data import DataSource
from polybasic.drafters.data import load_pairs
from polybasic.errors import ConfigError
from polybasic.pipelines.quantize import load_records, record_tokens
from tests.helpers import word_tokenizer

RECS = [{"instruction": "w1 w2", "input": "w3", "output": "w4"},
        {"conversations": [{"from": "human", "value": "w5"}, {"from": "gpt", "value": "w6"},
                           {"from": "human", "value": "w7"}, {"from": "gpt", "value": "w8"}]},
        {"text": "w9 w10"}]


def test_quantize_tokens_follow_each_schema(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(RECS))
    tok = word_tokenizer(64)
    alpaca, sharegpt, text = (record_tokens(tok, ex) for ex in load_records(DataSource(str(p))))
    chat = lambda *turns: tok.apply_chat_template(  # noqa: E731
        [{"role": r, "content": c} for r, c in turns], tokenize=False)
    assert alpaca == tok.encode(chat(("user", "w1 w2\n\nw3"), ("assistant", "w4")))
    # every turn of the conversation, not an empty chat (the old reader read only Alpaca keys)
    assert sharegpt == tok.encode(chat(("user", "w5"), ("assistant", "w6"), ("user", "w7"), ("assistant", "w8")))
    assert text == tok.encode("w9 w10")


def test_distill_takes_the_first_exchange_and_rejects_text(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    assert load_pairs(DataSource(str(p)), limit=2) == [("w1 w2\n\nw3", "w4"), ("w5", "w6")]
    with pytest.raises(ConfigError, match=r"distill\.data: line 3 of .*d\.jsonl is plain \{text\}"):
        load_pairs(DataSource(str(p)))
