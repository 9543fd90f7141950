"""QuantConfig validation and (de)serialisation."""
import pytest

from polybasic.config import QUANT_CONFIG_VERSION, QuantConfig
from polybasic.errors import ConfigError


def test_round_trip_and_defaults():
    cfg = QuantConfig(w_bits=4, a_bits=4, group_size=-1, method="affinequant", kernel="int8mm")
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    assert QuantConfig().a_symmetric is False and QuantConfig().quantize_lm_head is False
    assert cfg.version == QUANT_CONFIG_VERSION


@pytest.mark.parametrize("kw, field", [
    ({"w_bits": 3}, "w_bits"), ({"a_bits": 2}, "a_bits"), ({"w_bits": 16}, "w_bits"),
    ({"group_size": 0}, "group_size"), ({"group_size": -2}, "group_size"),
    ({"method": "gptq"}, "method"), ({"kernel": "marlin"}, "kernel"),
    ({"w_symmetric": 1}, "w_symmetric"),
    ({"kernel": "int4pack", "group_size": 16}, "group_size"),
    ({"kernel": "int4pack", "w_bits": 8}, "kernel"),
    ({"kernel": "int8mm", "a_bits": 16}, "kernel"),
    ({"kernel": "int8mm", "a_bits": 8, "group_size": 64}, "group_size"),
    ({"version": QUANT_CONFIG_VERSION + 1}, "version"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"QuantConfig.{field}"):
        QuantConfig(**kw)


def test_unknown_field_and_newer_version_from_dict():
    d = QuantConfig().to_dict()
    with pytest.raises(ConfigError, match=r"unknown fields \['rotation'\]"):
        QuantConfig.from_dict({**d, "rotation": "hadamard"})
    with pytest.raises(ConfigError, match="newer.*upgrade polybasic"):
        QuantConfig.from_dict({**d, "version": QUANT_CONFIG_VERSION + 1, "rotation": 1})
