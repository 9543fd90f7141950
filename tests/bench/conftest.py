"""Fixtures for bench tests: a tiny questions file and a tiny HF model folder (no download)."""
from __future__ import annotations

import json

import pytest

from tests.helpers import tiny_hf_llama

WORDS = ["<s>", "</s>", "[UNK]"] + [f"w{i}" for i in range(125)]


def write_questions(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def questions_file(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [" ".join(f"w{(i * 7 + j) % 50}" for j in range(12)),
                                                           "second turn"]}
            for i, cat in enumerate(["writing", "writing", "qa", "math", "qa", "writing"])]
    return write_questions(tmp_path / "q.jsonl", rows)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="[UNK]", pad_token="</s>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A Hugging Face folder (config, safetensors, tokenizer) of a 2-layer random llama, vocab 128."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_hf_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
