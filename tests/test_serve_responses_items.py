"""``GET /v1/responses/{id}/input_items``, driven by the official ``openai`` client
(``client.responses.input_items.list``) over the fake engine, and its paging rules on
their own (:func:`chassis.serve.responses_items.page`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_serve_responses import MODEL, Server, serve

from chassis.serve.errors import APIError
from chassis.serve.responses_items import page

openai = pytest.importorskip("openai")


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serve("Hello there!")


def test_the_input_items_of_a_response(server: Server) -> None:
    first = server.client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi", metadata={"turn": "1"}
    )
    listing = server.client.responses.input_items.list(first.id)
    assert listing.object == "list" and listing.has_more is False
    (message,) = listing.data
    assert message.type == "message" and message.role == "user"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert [(p.type, p.text) for p in message.content] == [("input_text", "Hi")]
    assert listing.first_id == listing.last_id == message.id

    # the next turn's input items: the first turn's input and output, then its own input,
    # newest first by default; the earlier items keep their ids
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "A"}]},
        {"role": "user", "content": "B", "id": "msg_mine"},
    ]
    second = server.client.responses.create(model=MODEL, input=items, previous_response_id=first.id)
    listed = server.client.responses.input_items.list(second.id).data
    assert [item.id for item in listed][::-1] == [
        message.id,
        first.output[0].id,
        listed[1].id,
        "msg_mine",
    ]
    assert listed[1].id.startswith("msg_") and listed[1].role == "developer"
    answer = listed[2]
    assert answer.role == "assistant" and answer.content[0].type == "output_text"
    assert answer.content[0].text == "Hello there!"
    assert [(p.type, p.text) for p in listed[0].content] == [("input_text", "B")]
    # the first response's own listing is unchanged
    assert server.client.responses.input_items.list(first.id).data == [message]


def test_an_item_id_is_one_item_of_the_conversation(server: Server) -> None:
    # as OpenAI: an item id that is already in the conversation is a 400 (a listing's cursor
    # is an item id; with two items under one the SDK's auto-pagination would loop)
    first = server.client.responses.create(model=MODEL, input="Hi")
    again = first.output[0].model_dump(exclude_none=True)
    for items, previous in (
        ([again, {"role": "user", "content": "More"}], first.id),
        ([{"role": "user", "content": "A", "id": "msg_x"}] * 2, None),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            server.client.responses.create(model=MODEL, input=items, previous_response_id=previous)
        assert info.value.body["param"] == "input" and "duplicate" in info.value.body["message"]
    assert len(server.engine.requests) == 1


def test_function_call_items_are_listed(server: Server) -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = server.client.responses.create(model=MODEL, input=items)
    listed = server.client.responses.input_items.list(response.id, order="asc").data
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    call, output = listed[1], listed[2]
    assert call.id.startswith("fc_") and call.call_id == "call_1" and call.name == "f"
    assert output.id.startswith("fco_") and output.output == "sunny"
    assert output.status == "completed"


def test_pages_through_the_client(server: Server) -> None:
    items = [{"role": "user", "content": str(i)} for i in range(7)]
    response = server.client.responses.create(model=MODEL, input=items)
    texts = [
        item.content[0].text
        for item in server.client.responses.input_items.list(response.id, limit=3, order="asc")
    ]  # the client follows has_more with after=last id
    assert texts == [str(i) for i in range(7)]
    newest = server.client.responses.input_items.list(response.id, limit=3)
    assert [i.content[0].text for i in newest.data] == ["6", "5", "4"] and newest.has_more
    pages = list(server.client.responses.input_items.list(response.id, limit=3).iter_pages())
    assert [len(p.data) for p in pages] == [3, 3, 1] and pages[-1].has_more is False


def test_input_items_errors(server: Server) -> None:
    response = server.client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.NotFoundError):
        server.client.responses.input_items.list("resp_unknown")
    url = f"/v1/responses/{response.id}/input_items"
    for params, param in [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_unknown"}, "after"),
        ({"before": "msg_unknown"}, "before"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"include": "bogus"}, "include"),
    ]:
        reply = server.http.get(url, params=params)
        assert reply.status_code == 400, (params, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].endswith(param)
    # include values about items the server never stores add nothing, and are accepted
    accepted = server.client.responses.input_items.list(
        response.id, include=["message.input_image.image_url", "file_search_call.results"]
    )
    assert len(accepted.data) == 1
    # the SDK sends include as include[]=... (OpenAI's array format)
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.input_items.list(
            response.id, include=["reasoning.encrypted_content"]
        )
    assert info.value.body["param"] == "include"
    for limit in (1, 100):
        assert server.http.get(url, params={"limit": limit}).status_code == 200


ITEMS = [{"id": f"i{n}", "role": "user", "content": str(n)} for n in range(5)]


def ids(listing: dict[str, Any]) -> list[str]:
    return [item["id"] for item in listing["data"]]


@pytest.mark.parametrize(
    ("params", "expected", "has_more"),
    [
        ({}, ["i4", "i3", "i2", "i1", "i0"], False),
        ({"order": "asc"}, ["i0", "i1", "i2", "i3", "i4"], False),
        ({"limit": 2}, ["i4", "i3"], True),
        ({"limit": 5}, ["i4", "i3", "i2", "i1", "i0"], False),
        ({"order": "asc", "after": "i1", "limit": 2}, ["i2", "i3"], True),
        ({"order": "asc", "after": "i2", "limit": 2}, ["i3", "i4"], False),
        ({"order": "asc", "after": "i4"}, [], False),
        ({"after": "i3"}, ["i2", "i1", "i0"], False),
        # before walks back from the cursor: the page just before it
        ({"order": "asc", "before": "i4", "limit": 2}, ["i2", "i3"], True),
        ({"order": "asc", "before": "i2", "limit": 2}, ["i0", "i1"], False),
        ({"order": "asc", "before": "i0"}, [], False),
        ({"before": "i1"}, ["i4", "i3", "i2"], False),
        # both: the items strictly between them
        ({"order": "asc", "after": "i0", "before": "i4"}, ["i1", "i2", "i3"], False),
        ({"order": "asc", "after": "i0", "before": "i4", "limit": 2}, ["i1", "i2"], True),
        ({"order": "asc", "after": "i3", "before": "i1"}, [], False),
    ],
)
def test_paging_rules(params: dict[str, Any], expected: list[str], has_more: bool) -> None:
    listing = page(ITEMS, **params)
    assert ids(listing) == expected and listing["has_more"] is has_more
    assert listing["first_id"] == (expected[0] if expected else None)
    assert listing["last_id"] == (expected[-1] if expected else None)


def test_a_bad_cursor_names_itself() -> None:
    with pytest.raises(APIError) as info:
        page(ITEMS, before="nope")
    assert info.value.status == 400 and info.value.param == "before"
