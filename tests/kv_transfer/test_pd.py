"""Prefill/decode disaggregation between two engines on the real default model (fp32, greedy).

The prefill engine (kv_producer) runs each prompt with one output token; the decode engine
(kv_consumer) then runs the whole request and must load all of the prompt but its last token:
each test first shows that (tokens loaded, one prompt token computed a request, or the fallback
counted), then that the outputs equal an engine's without disaggregation. Prompt lengths cover a
partial last block, a prompt that ends on a block boundary, and one shorter than a block.
"""

from __future__ import annotations

import json

import pytest

from tests.kv_transfer.redis_server import RedisServer
from tests.kv_transfer.test_tiers import DOC, MAX_TOKENS, generate
from tests.processes import free_port

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


def prompts_of_lengths(tokenizer) -> list[str]:
    """Prompts whose token counts are: partial last block, a block boundary, under one block."""
    prompts = [f"{DOC[:900]}\n\nQuestion: Who wrote this?\nAnswer:", "The capital of France is"]
    words = DOC.split()
    for count in range(40, 200):  # grow a prompt until it ends exactly on a block boundary
        text = " ".join(words[:count])
        if len(tokenizer.encode(text)) % BLOCK_SIZE == 0:
            prompts.append(text)
            break
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert lengths[0] % BLOCK_SIZE and lengths[1] < BLOCK_SIZE and lengths[2] % BLOCK_SIZE == 0
    return prompts


def pd_config(connector: str, role: str, **options) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role,
                       "kv_connector_extra_config": options})


def prefill(llm, prompts) -> None:
    from pagedserve.sampling_params import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))


def prompt_tokens_computed(llm) -> int:
    return llm.engine.get_stats().num_prompt_tokens_computed


@pytest.fixture
def reference_outputs(make_llm):
    def outputs(prompts):
        return generate(make_llm(), prompts)

    return outputs


def test_tcp_decode_computes_only_each_prompts_last_token(make_llm, tokenizer, reference_outputs):
    prompts = prompts_of_lengths(tokenizer)
    port = free_port()
    producer = make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_producer", port=port))
    consumer = make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_consumer", port=port))
    prefill(producer, prompts)
    outputs = generate(consumer, prompts)

    stats = consumer.engine.get_stats().kv_tier
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert stats.loaded_tokens == sum(n - 1 for n in lengths)
    assert stats.load_failed_tokens == 0 and stats.tiers["tcp"].faults == {}
    assert prompt_tokens_computed(consumer) == len(prompts)
    assert producer.engine.get_stats().kv_tier.tiers["tcp"].blocks_saved > 0
    assert outputs == reference_outputs(prompts)


def test_broken_transfer_is_recomputed_and_counted(make_llm, tokenizer, reference_outputs):
    prompts = prompts_of_lengths(tokenizer)[:2]
    port = free_port()
    producer = make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_producer", port=port))
    consumer = make_llm(kv_transfer_config=pd_config(
        "TcpConnector", "kv_consumer", port=port, debug_fail_loads=True))
    prefill(producer, prompts)
    outputs = generate(consumer, prompts)

    stats = consumer.engine.get_stats().kv_tier
    assert stats.loaded_tokens == 0 and stats.load_failed_tokens > 0
    assert stats.load_fallbacks == len(prompts)
    assert stats.tiers["tcp"].faults.get("io_error", 0) >= len(prompts)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert prompt_tokens_computed(consumer) == sum(lengths)
    assert outputs == reference_outputs(prompts)


def test_dead_producer_is_a_miss_not_an_error(make_llm, tokenizer, reference_outputs):
    prompts = prompts_of_lengths(tokenizer)[:1]
    consumer = make_llm(kv_transfer_config=pd_config(
        "TcpConnector", "kv_consumer", port=free_port(), connect_timeout_s=0.5))
    assert generate(consumer, prompts) == reference_outputs(prompts)
    assert consumer.engine.get_stats().kv_tier.loaded_tokens == 0


def test_abort_during_transfer_frees_both_sides(make_llm, tokenizer):
    from pagedserve.outputs import OutputKind
    from pagedserve.sampling_params import SamplingParams

    prompts = prompts_of_lengths(tokenizer)[:1]
    port = free_port()
    producer = make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_producer", port=port))
    consumer = make_llm(kv_transfer_config=pd_config(
        "TcpConnector", "kv_consumer", port=port, debug_load_delay_s=0.05))
    prefill(producer, prompts)
    producer.engine.assert_idle()

    engine = consumer.engine
    engine.add_request("r", prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                       output_kind=OutputKind.DELTA)
    while not engine.scheduler._loading:  # admitted: its blocks are reserved and loading
        engine.step()
    engine.abort_request("r")
    while engine.has_unfinished_requests():  # the load ends, then its blocks are freed
        engine.step()
    engine.assert_idle()
    assert engine.get_stats().kv_tier.decisions["load"] == 1  # the abort came mid-transfer


def test_redis_pool_joins_prefill_and_decode(make_llm, tokenizer, reference_outputs):
    prompts = prompts_of_lengths(tokenizer)
    with RedisServer() as server:
        producer = make_llm(kv_transfer_config=pd_config("RedisConnector", "kv_producer",
                                                         url=server.url))
        consumer = make_llm(kv_transfer_config=pd_config("RedisConnector", "kv_consumer",
                                                         url=server.url))
        prefill(producer, prompts)
        outputs = generate(consumer, prompts)
        stats = consumer.engine.get_stats().kv_tier
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert stats.loaded_tokens == sum(n - 1 for n in lengths)
    assert prompt_tokens_computed(consumer) == len(prompts)
    assert outputs == reference_outputs(prompts)


def test_tcp_connector_options_are_checked(make_llm):
    with pytest.raises(ValueError, match="kv_producer"):
        make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_both", port=free_port()))
    with pytest.raises(ValueError, match="port"):
        make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_consumer"))
    with pytest.raises(ValueError, match="unknown TcpConnector options"):
        make_llm(kv_transfer_config=pd_config("TcpConnector", "kv_consumer", port=1, url="x"))
