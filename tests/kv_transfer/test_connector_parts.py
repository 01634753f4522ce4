"""The KV tiers' parts without a model: the block payload codec, the cost model, the config."""

from __future__ import annotations

import json

import pytest

from pagedserve.config import KVTransferConfig
from pagedserve.kv_transfer import block_codec
from pagedserve.kv_transfer.block_codec import BlockDecodeError
from pagedserve.kv_transfer.cost_model import CostModel, PrefillProfile, PrefillTiming, TierCost
from pagedserve.kv_transfer.tiered import parse_tiers

LAYOUT = [("bfloat16", [3, 16, 64]), ("bfloat16", [3, 16, 64])]
KEY, HASH, TOKENS = "pskv1:abc:00ff", bytes(range(32)), list(range(16))


def payload() -> bytes:
    segments = [bytes([i]) * (3 * 16 * 64 * 2) for i in range(2)]
    return block_codec.encode(KEY, HASH, TOKENS, LAYOUT, segments)


def test_codec_round_trip():
    segments = block_codec.decode(payload(), KEY, HASH, TOKENS, LAYOUT)
    assert [bytes(s) for s in segments] == [bytes([i]) * (3 * 16 * 64 * 2) for i in range(2)]


@pytest.mark.parametrize("damage", ["flip", "truncate_body", "truncate_header", "garbage"])
def test_codec_rejects_damaged_payloads_as_corrupt(damage):
    data = bytearray(payload())
    if damage == "flip":
        data[-100] ^= 1
    elif damage == "truncate_body":
        data = data[:-1]
    elif damage == "truncate_header":
        data = data[:20]
    else:
        data = bytearray(b"not a payload at all")
    with pytest.raises(BlockDecodeError) as error:
        block_codec.decode(bytes(data), KEY, HASH, TOKENS, LAYOUT)
    assert error.value.kind == "corrupt"


@pytest.mark.parametrize("field", ["key", "hash", "tokens", "layout"])
def test_codec_rejects_another_blocks_payload_as_foreign(field):
    expected = {"key": KEY, "block_hash": HASH, "token_ids": TOKENS, "layout": LAYOUT}
    expected.update({"key": {"key": KEY + "x"}, "hash": {"block_hash": bytes(32)},
                     "tokens": {"token_ids": TOKENS[:-1] + [99]},
                     "layout": {"layout": [("int8", [3, 16, 64])] * 2}}[field])
    with pytest.raises(BlockDecodeError) as error:
        block_codec.decode(payload(), **expected)
    assert error.value.kind == "foreign"


def test_prefill_profile_fits_two_timings():
    # 1 ms/token at context 0 (128 tokens); 3 ms/token after 1000 tokens of context.
    profile = PrefillProfile.fit([PrefillTiming(128, 0, 0.128), PrefillTiming(128, 1000, 0.384)])
    assert profile.seconds_per_token_per_context == pytest.approx(2e-6)
    assert profile.recompute_seconds(128, 0) == pytest.approx(0.128)
    assert profile.recompute_seconds(128, 1000) == pytest.approx(0.384)
    assert profile.recompute_seconds(256, 0) > 2 * profile.recompute_seconds(128, 0)


def test_cost_model_loads_only_when_faster():
    profile = PrefillProfile(seconds_per_token=1e-3, seconds_per_token_per_context=0.0)
    fast, slow = TierCost(seconds_per_block=1e-3, num_parallel=4), TierCost(0.1, num_parallel=4)
    model = CostModel(profile, [fast, slow])
    # 8 blocks of 16 tokens: recomputing costs 128 ms.
    assert model.should_load([0] * 8, 0, 16)  # 2 ms
    assert not model.should_load([1] * 8, 0, 16)  # 200 ms
    assert CostModel(profile, [slow], policy="always").should_load([0] * 8, 0, 16)
    assert not CostModel(profile, [fast], policy="never").should_load([0] * 8, 0, 16)
    slow.observe(8, 8 * 1e-3)  # the tier got faster: the average follows
    assert slow.seconds_per_block < 0.1


def config(connector: str, **extra) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_connector": connector,
                                       "kv_connector_extra_config": extra})


def test_tier_configs_parse_with_vllm_keys():
    options = parse_tiers(config("DiskConnector", path="/tmp/x", max_bytes="1GiB",
                                 load_policy="always"), "cpu")
    assert [t.connector for t in options.tiers] == ["DiskConnector"]
    assert options.tiers[0].options == {"path": "/tmp/x", "max_bytes": "1GiB"}
    assert options.load_policy == "always"
    multi = parse_tiers(config("MultiConnector", connectors=[
        {"kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": "/tmp/x"}},
        {"kv_connector": "RedisConnector",
         "kv_connector_extra_config": {"url": "redis://127.0.0.1:1/0"}}]), "cpu")
    assert [t.connector for t in multi.tiers] == ["DiskConnector", "RedisConnector"]


@pytest.mark.parametrize("value, message", [
    ({"kv_connector": "NoSuchConnector"}, "unknown kv_connector"),
    ({"kv_connector": "DiskConnector", "kv_role": "kv_nobody"}, "kv_role"),
    ({"kv_connector": "DiskConnector", "kv_connector_extra_config": {"paht": "/x"}}, "paht"),
    ({"kv_connector": "RedisConnector"}, "needs kv_connector_extra_config.url"),
    ({"kv_connector": "HostOffloadConnector"}, "CUDA devices only"),
    ({"kv_connector": "MultiConnector"}, "connectors"),
    ({"kv_connector": "DiskConnector", "kv_connector_extra_config": {"load_policy": "maybe"}},
     "load_policy"),
    ({"kv_connector": "DiskConnector", "extra": 1}, "unknown kv_transfer_config keys"),
])
def test_bad_tier_configs_say_what_is_wrong(value, message):
    from pagedserve.engine.arg_utils import parse_kv_transfer_config

    with pytest.raises(ValueError, match=message):
        parse_tiers(parse_kv_transfer_config(json.dumps(value)), "cpu")
