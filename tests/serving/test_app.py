"""hf-tpu serve's calls into transformers' serving code (hf_tpu.serving._app), on the installed transformers: its app
factory given the arguments its signature names, the response-template helpers given the model or its config, a
parser fed the text hf_tpu sends; and a signature hf_tpu does not know named, not run. No server: the app is built and
asked through ASGI in process."""

from __future__ import annotations

import asyncio
import json

import pytest

from hf_tpu.serving import _app

pytest.importorskip("fastapi")


class _Handler:
    def __init__(self, answer: dict) -> None:
        self.answer = answer

    async def handle_request(self, body, request_id):
        return dict(self.answer, request_id=request_id)


def _served() -> _app.ServedModel:
    return _app.ServedModel("tiny", {"tiny", "/models/tiny"}, model=None, processor=None)


def _ask(app, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request to the ASGI ``app`` in process: (status, body)."""
    sent = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(sent)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    out = {"status": None, "body": b""}
    given = False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": sent, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out["status"], out["body"]


def test_transformers_app_factory_serves_hf_tpu_handlers_and_the_served_model():
    served = _served()
    app = _app.build_app(served, _Handler({"chat": 1}), _Handler({"text": 1}), _Handler({"responses": 1}))
    status, body = _ask(app, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 200 and json.loads(body)["chat"] == 1  # transformers' route, hf_tpu's handler
    status, body = _ask(app, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"] == [served.card()]
    assert _ask(app, "GET", "/health") == (200, b'{"status":"ok"}')
    status, body = _ask(app, "POST", "/load_model", {"model": "/models/tiny"})
    assert status == 200 and json.loads(body.decode().removeprefix("data: "))["status"] == "ready"
    status, body = _ask(app, "POST", "/load_model", {"model": "other"})
    assert "not served here" in json.loads(body.decode().removeprefix("data: "))["message"]


def test_a_dead_batch_makes_the_model_dead_for_health_and_refuses_requests():
    import types

    served = _served()
    assert served.is_cb_alive() and not served.is_dead
    served.cb = types.SimpleNamespace(background_thread_status=types.SimpleNamespace(fatal_error=RuntimeError("x")),
                                      is_running=lambda: False)  # fmt: skip
    assert served.is_dead and not served.is_cb_alive() and served.failure() == "RuntimeError: x"
    with pytest.raises(_app.BatchDiedError, match="cannot take request r1: RuntimeError: x"):
        served.check_alive("r1")


def test_an_app_factory_hf_tpu_does_not_know_is_named(monkeypatch):
    from transformers.cli.serving import server as server_module

    def build_server(model_manager, chat_handler, completion_handler, response_handler, engine_pool):
        raise AssertionError("not called")

    monkeypatch.setattr(server_module, "build_server", build_server)
    with pytest.raises(_app.UpstreamServingError, match=r"build_server\(model_manager, .*engine_pool\): it needs "
                                                        r"engine_pool\. hf_tpu expected"):  # fmt: skip
        _app.build_app(_served(), None, None, None)

    def without_chat(model_manager, completion_handler, response_handler):
        raise AssertionError("not called")

    monkeypatch.setattr(server_module, "build_server", without_chat)
    with pytest.raises(_app.UpstreamServingError, match="it takes no chat_handler"):
        _app.build_app(_served(), None, None, None)


def test_the_response_template_helpers_get_the_model_or_its_config_as_their_signature_says():
    import types

    from transformers.cli.serving.utils import get_response_template, parse_assistant_message

    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    for helper in (get_response_template, parse_assistant_message):
        given = _app.model_or_config(helper, model)
        assert given is model or given is model.config
    assert _app.model_or_config(lambda processor, model: 0, model) is model
    assert _app.model_or_config(lambda processor, config: 0, model) is model.config
    with pytest.raises(_app.UpstreamServingError, match=r"expected \(processor, model, \.\.\.\)"):
        _app.model_or_config(lambda processor, checkpoint: 0, model)


def test_the_response_parser_takes_the_text_hf_tpu_sends(pair):
    """A model whose tokenizer has a response template: the parser is fed text (cut at a stop string, as hf_tpu's
    handlers send it), on 5.24 and on 5.25, whose own helper makes a parser fed token ids."""
    from transformers.cli.serving import utils
    from transformers.utils.chat_parsing import ResponseParser

    from hf_tpu.assets import default_model_path

    templates = getattr(utils, "_RESPONSE_TEMPLATE_FALLBACKS", {})
    if not templates:
        pytest.skip("this transformers has no response templates to take one from")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.response_template = next(iter(templates.values()))
    _cpu, model = pair
    assert _app.response_parser(tokenizer, model, [5, 6, 7]) is not None
    parser = _app.response_parser(tokenizer, model, tokenizer("user: hi\nassistant:")["input_ids"])
    assert isinstance(parser, ResponseParser)
    assert isinstance(parser.feed("Hello"), list) and isinstance(parser.feed(" there"), list)
    tokenizer.response_template = None
    assert _app.response_parser(tokenizer, model, [5, 6, 7]) is None  # llama: no template, the text goes unparsed


def test_say_once_lets_each_upstream_message_through_once_until_undone():
    import logging

    from transformers.utils import logging as hf_logging

    from hf_tpu.serving.server import say_once

    class Recorder(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.said: list[str] = []

        def emit(self, record) -> None:
            self.said.append(record.getMessage())

    recorder, root = Recorder(), hf_logging._get_library_root_logger()
    root.addHandler(recorder)
    logger = hf_logging.get_logger("transformers.generation.continuous_batching")
    try:
        undo = say_once()
        for _ in range(3):
            logger.warning("a message upstream gives per request")
        logger.warning("another one")
        undo()
        logger.warning("another one")
    finally:
        root.removeHandler(recorder)
    assert recorder.said == ["a message upstream gives per request", "another one", "another one"]
