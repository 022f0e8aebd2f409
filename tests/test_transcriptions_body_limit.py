"""The audio routes' multipart body under ``--max-request-body-size``: an upload sent without
a ``Content-Length`` (chunked) that grows past the bound while the form is read is a 413
``request_too_large``, as every route's, not a 400 about an unreadable form."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.testclient import TestClient


def test_a_chunked_upload_over_the_body_bound_is_a_413() -> None:
    from fake_engine import FakeAsyncLLM

    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    boundary = "b0undary"

    def body() -> Iterator[bytes]:  # (a generator: httpx sends it chunked, no length)
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
        ).encode()
        for _ in range(8):
            yield b"\0" * 1024
        yield f"\r\n--{boundary}--\r\n".encode()

    settings = ServerSettings(max_request_body_bytes=4096)
    with TestClient(build_app(FakeAsyncLLM(), settings)) as client:
        answer = client.post(
            "/v1/audio/transcriptions",
            content=body(),
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "request_too_large"
