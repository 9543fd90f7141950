"""Chain levels must share the target's tokenizer."""
import pytest

from polybasic.errors import ConfigError


def test_check_same_tokenizer_accepts_equal_and_names_the_level_otherwise():
    from copy import deepcopy

    from polybasic.models.tokenizer_check import check_same_tokenizer
    from tests.helpers import word_tokenizer

    target = word_tokenizer(64)
    check_same_tokenizer(target, word_tokenizer(64), "sibling")  # equal: no error
    check_same_tokenizer(target, deepcopy(target), "copy")
    with pytest.raises(ConfigError, match="chain level 'small': .*vocabularies of 64 and 32 entries"):
        check_same_tokenizer(target, word_tokenizer(32), "small")
    other_eos = word_tokenizer(64)
    other_eos.eos_token = "<user>"
    with pytest.raises(ConfigError, match="chain level 'x': .*eos_token_id 1 vs 2"):
        check_same_tokenizer(target, other_eos, "x")
