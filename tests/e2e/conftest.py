"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import pytest

from tests.shared_engines import shared_weights_llm

NUM_DOC_QA_PROMPTS = 20


@pytest.fixture(scope="session")
def plain_greedy_doc_qa(model_path, tokenizer):
    """The plain engine's greedy outputs (GREEDY: 32 tokens, EOS ignored) for the first
    NUM_DOC_QA_PROMPTS document-QA prompts, computed once per session: the reference the
    speculative-decoding tests compare with. `doc_qa_prompts(n)` are the first n of them, and a
    greedy request's tokens do not depend on its batch (test_engine_features checks it)."""
    from tests.e2e.test_spec_decode import GREEDY, doc_qa_prompts

    llm = shared_weights_llm(model_path, tokenizer)
    try:
        outputs = llm.generate(doc_qa_prompts(tokenizer, NUM_DOC_QA_PROMPTS), GREEDY)
        llm.engine.assert_idle()
    finally:
        llm.engine.shutdown()
    return outputs
