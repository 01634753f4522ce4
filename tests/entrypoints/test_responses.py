"""POST /v1/responses through the official `openai` client: text and message input, instructions,
max_output_tokens, the stream's event sequence, a previous_response_id chain, the store's
routes and bound, and refused features."""

from __future__ import annotations

import json
import logging
import uuid

import httpx
import openai
import pytest

from tests.entrypoints.utils import MODEL_NAME

GREEDY = dict(model=MODEL_NAME, temperature=0)
QUESTION = "Name three colors."

STREAM_EVENT_ORDER = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
]


def num_template_tokens(http: httpx.Client, messages: list[dict]) -> int:
    response = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_text_input_matches_chat_completion(client, http):
    response = client.responses.create(input=QUESTION, max_output_tokens=24, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION}], max_tokens=24, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text and response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert message.content[0].annotations == []
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == num_template_tokens(
        http, [{"role": "user", "content": QUESTION}])
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0


def test_message_input_and_instructions(client, http):
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    with_instructions = client.responses.create(
        instructions="Answer in French.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=16, **GREEDY)
    as_messages = client.responses.create(input=messages, max_output_tokens=16, **GREEDY)
    plain = client.responses.create(input=QUESTION, max_output_tokens=16, **GREEDY)
    # The instructions are a system message first: the same prompt as sending it yourself.
    assert with_instructions.instructions == "Answer in French."
    expected_tokens = num_template_tokens(http, [messages[0], {"role": "user",
                                                               "content": QUESTION}])
    assert with_instructions.usage.input_tokens == expected_tokens
    assert as_messages.usage.input_tokens == expected_tokens
    assert with_instructions.output_text == as_messages.output_text
    assert with_instructions.usage.input_tokens != plain.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(input="Count from one to one hundred.",
                                       max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"
    assert response.output_text


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    response = client.responses.create(
        input=QUESTION, max_output_tokens=24, **GREEDY,
        text={"format": {"type": "json_schema", "name": "color", "schema": schema}})
    assert response.text.format.type == "json_schema"
    assert json.loads(response.output_text)["color"] in ("red", "blue")


def test_stream_events_in_order(client):
    events = list(client.responses.create(input=QUESTION, max_output_tokens=24, stream=True,
                                          **GREEDY))
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1, "the text came in one piece: not streamed"
    # Collapse the run of deltas to compare the order.
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed[:-1] == STREAM_EVENT_ORDER
    assert collapsed[-1] in ("response.completed", "response.incomplete")
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in deltas)
    assert text == final.output_text == events[types.index("response.output_text.done")].text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert {event.item_id for event in deltas} == {final.output[0].id}
    assert final.usage.output_tokens > 0
    greedy = client.responses.create(input=QUESTION, max_output_tokens=24, **GREEDY)
    assert text == greedy.output_text


def test_previous_response_id_chain(client, http):
    first = client.responses.create(input="My name is Ada. Say hello.",
                                    instructions="Be brief.", max_output_tokens=8, **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)
    third = client.responses.create(input="Say it again.", previous_response_id=second.id,
                                    max_output_tokens=8, **GREEDY)
    # Each turn's prompt holds the earlier inputs and outputs (not the first's instructions).
    conversation = [{"role": "user", "content": "My name is Ada. Say hello."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == num_template_tokens(http, conversation)
    assert second.usage.input_tokens > first.usage.output_tokens + num_template_tokens(
        http, conversation[:1])
    conversation += [{"role": "assistant", "content": second.output_text},
                     {"role": "user", "content": "Say it again."}]
    assert third.usage.input_tokens == num_template_tokens(http, conversation)
    assert third.previous_response_id == second.id
    # The same conversation sent in full gives the same reply.
    explicit = client.responses.create(input=conversation, max_output_tokens=8, **GREEDY)
    assert explicit.output_text == third.output_text


def test_retrieve_delete_and_unknown_ids(client):
    stored = client.responses.create(input=QUESTION, max_output_tokens=4, **GREEDY)
    unstored = client.responses.create(input=QUESTION, max_output_tokens=4, store=False,
                                       **GREEDY)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(input="hi", previous_response_id=unstored.id, **GREEDY)
    assert error.value.body["param"] == "previous_response_id"
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools", "tools is not supported"),
    ({"background": True}, "background", "background is not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input[0].content[0] of type 'input_image' is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input",
     "input[0] of type 'function_call_output' is not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 100_000}, "max_output_tokens", "maximum context length is"),
])
def test_unsupported_or_bad_fields_are_400(http, body, param, says):
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_unknown_fields_are_served_and_warned_about(http, caplog):
    name = f"not_a_responses_field_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="pagedserve.entrypoints.openai.request_fields")
    response = http.post("/v1/responses", json={**GREEDY, "input": "hi", "max_output_tokens": 2,
                                               name: 1})
    assert response.status_code == 200, response.text
    assert any(repr(name) in record.getMessage() for record in caplog.records)


def test_store_evicts_least_recently_used():
    from pagedserve.entrypoints.openai.serving_responses import (
        ResponseObject,
        ResponseStore,
        StoredResponse,
    )

    def entry(response_id: str) -> StoredResponse:
        return StoredResponse(ResponseObject(id=response_id, created_at=0, status="completed",
                                             model=MODEL_NAME), ())

    store = ResponseStore(max_size=2)
    store.put(entry("resp_a"))
    store.put(entry("resp_b"))
    assert store.get("resp_a") is not None  # now the most recently used
    store.put(entry("resp_c"))
    assert len(store) == 2
    assert store.get("resp_b") is None
    assert store.get("resp_a") is not None and store.get("resp_c") is not None
    with pytest.raises(ValueError, match="responses-store-size"):
        ResponseStore(max_size=0)
