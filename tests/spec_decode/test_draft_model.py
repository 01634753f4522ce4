"""The draft-model proposer's parts (config, prefix matching, its KV pool) and a separate draft
model end to end on tiny random Hugging Face directories: a draft with the target's weights
(every guess accepted), a smaller draft of another shape and a larger vocabulary (guesses
accepted and rejected), and a draft whose tokenizer differs (refused at load)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.metadata import slot_mapping_of
from pagedserve.config import SpeculativeConfig
from pagedserve.engine.arg_utils import parse_speculative_config
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.draft_kv import DraftKVCache
from pagedserve.spec_decode.draft_model import common_prefix_len

# ---- config ---------------------------------------------------------------------------------


def test_draft_model_config_vllm_style():
    config = parse_speculative_config('{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}')
    assert config.method == "draft_model"  # inferred from "model", as vLLM does
    assert config.draft_model_path == "qwen2.5-coder-0.5b" and not config.is_self_draft
    self_draft = SpeculativeConfig(method="draft_model", model="self", draft_num_layers=8)
    assert self_draft.is_self_draft and self_draft.draft_model_path is None
    assert SpeculativeConfig().method == "ngram"


@pytest.mark.parametrize("bad, message", [
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "self"}, "draft_num_layers"),
    ({"method": "draft_model", "model": "x", "draft_num_layers": 2}, "draft_num_layers"),
    ({"model": "self", "draft_num_layers": 0}, "draft_num_layers"),
    ({"method": "ngram", "model": "x"}, "takes no"),
])
def test_bad_draft_model_config_is_a_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(bad)


def test_self_draft_cannot_have_more_layers_than_the_target(model_path):
    from pagedserve.engine.arg_utils import EngineArgs

    spec = {"model": "self", "draft_num_layers": 31}  # SmolLM2 has 30
    with pytest.raises(ValueError, match="exceeds the target model's 30 layers"):
        EngineArgs(model=model_path, speculative_config=spec).create_engine_config()


# ---- parts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_common_prefix_len_matches_a_plain_loop(seed):
    rng = random.Random(seed)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == expected


def test_draft_kv_pool_reserves_frees_and_refuses_when_short():
    kv = DraftKVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32, device=torch.device("cpu"))
    assert kv.reserve("a", 9)  # 3 blocks
    assert kv.reserve("a", 12) and kv.num_held_blocks == 3  # still 3
    assert not kv.reserve("b", 5)  # needs 2, 1 left: nothing taken
    assert kv.num_held_blocks == 3 and kv.requests["b"].blocks == []
    state = kv.requests["a"]
    assert [slot_mapping_of(state.block_ids, p, p + 1, 4)[0] for p in (0, 3, 4, 11)] == [
        state.blocks[0].block_id * 4, state.blocks[0].block_id * 4 + 3,
        state.blocks[1].block_id * 4, state.blocks[2].block_id * 4 + 3]
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.free("never-seen")
    assert kv.num_held_blocks == 0 and not kv.requests
    kv.check_integrity()


# ---- a separate draft model, end to end on tiny HF directories -------------------------------

transformers = pytest.importorskip("transformers")

VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 5, 17, 300], list(range(100, 190)), [7] * 3, list(range(20, 60, 2))]


def save_tiny_model(path, tokenizer, config, seed: int) -> None:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture
def tiny_target(tmp_path, tokenizer):
    path = tmp_path / "target"
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False)
    save_tiny_model(path, tokenizer, config, seed=0)
    return path


def run(target, speculative_config=None):
    from pagedserve.engine.llm import LLM

    llm = LLM(model=str(target), dtype="float32", kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_num_seqs=8, speculative_config=speculative_config)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine.assert_idle()  # the draft's KV pool included
    return [o.outputs[0].token_ids for o in outputs], llm.engine.get_stats().spec_decoding


def test_a_draft_with_the_targets_weights_has_every_guess_accepted(tmp_path, tiny_target):
    draft = tmp_path / "draft"
    draft.mkdir()
    for file in tiny_target.iterdir():
        (draft / file.name).write_bytes(file.read_bytes())
    plain, _ = run(tiny_target)
    spec, stats = run(tiny_target, {"model": str(draft), "num_speculative_tokens": 3})
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert spec == plain


def test_a_draft_of_another_shape_changes_nothing(tmp_path, tiny_target, tokenizer):
    """Another architecture and KV shape, random weights: its guesses are (almost) all
    rejected, and greedy output still equals the plain engine's."""
    draft = tmp_path / "draft"
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=True)
    save_tiny_model(draft, tokenizer, config, seed=1)
    plain, _ = run(tiny_target)
    spec, stats = run(tiny_target, {"method": "draft_model", "model": str(draft),
                                    "num_speculative_tokens": 4})
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec == plain


def test_a_truncated_draft_with_a_larger_vocab(tmp_path, tiny_target, tokenizer):
    """The target's first layer, with 88 extra vocabulary rows that the target's logits do not
    cover (guesses there are never proposed): some guesses accepted, some rejected."""
    target = transformers.AutoModelForCausalLM.from_pretrained(tiny_target)
    config = target.config.to_dict()
    config.update(num_hidden_layers=1, vocab_size=600)
    config.pop("layer_types", None)  # derived from num_hidden_layers
    draft_model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(**config), dtype=torch.float32)
    state = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            extra = draft_model.state_dict()[name][VOCAB:]
            state[name] = torch.cat([state[name], extra])
    draft_model.load_state_dict(state)
    draft = tmp_path / "draft"
    draft_model.save_pretrained(draft, safe_serialization=True)
    tokenizer._tokenizer.save(str(draft / "tokenizer.json"))
    plain, _ = run(tiny_target)
    spec, stats = run(tiny_target, {"model": str(draft), "num_speculative_tokens": 4})
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec == plain


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, tiny_target, tokenizer):
    from pagedserve.engine.llm import LLM

    draft = tmp_path / "draft"
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    save_tiny_model(draft, tokenizer, config, seed=2)
    other = tokenizer._tokenizer.__class__.from_str(tokenizer._tokenizer.to_str())
    other.add_tokens(["<not-in-the-target>"])
    other.save(str(draft / "tokenizer.json"))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(model=str(tiny_target), dtype="float32", kv_cache_memory="16MiB",
            speculative_config={"model": str(draft)})
