"""Every error a client can get from the gateway is an OpenAI error JSON with a clear message: the EPP's own, and
Envoy's (no healthy upstream, the EPP unreachable under FailClose, a buffered body over its limit); HTTP/1.0 clients
are answered."""

import json
import signal
import socket

import aiohttp

MODEL = "sim-llama-8b"


def assert_openai_error(status: int, body: bytes, expected_status: int | None = None) -> dict:
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    if expected_status is not None:
        assert status == expected_status, (status, error)
    return error


async def post(session, stack, body):
    async with session.post(f"{stack.gateway_url}/v1/completions", json=body) as r:
        return r.status, r.headers.get("content-type", ""), await r.read()


async def test_envoy_errors_are_openai_shaped(make_stack):
    stack = await make_stack(servers=2, separate_model_server_processes=True)
    async with aiohttp.ClientSession() as session:
        status, ctype, body = await post(session, stack, {"prompt": "no model"})  # the EPP's own error
        assert_openai_error(status, body, 400)
        for name in ("modelserver-0", "modelserver-1"):  # every server dead
            stack.processes[name].send_signal(signal.SIGKILL)
            stack.processes[name].wait(10)
        status, ctype, body = await post(session, stack, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert 500 <= status < 600 and ctype.startswith("application/json")
        assert_openai_error(status, body)
        stack.processes["epp"].send_signal(signal.SIGKILL)  # FailClose with the EPP gone
        stack.processes["epp"].wait(10)
        status, ctype, body = await post(session, stack, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert 500 <= status < 600 and ctype.startswith("application/json"), (status, body)
        error = assert_openai_error(status, body)
        assert "ext_proc" in error["message"], error


async def test_http_1_0_clients_are_answered(make_stack):
    stack = await make_stack(servers=1)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    host, port = stack.gateway_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(payload)["choices"]


async def test_envoy_413_is_openai_shaped(make_stack):
    """FailOpen buffers bodies in Envoy: one over its 64 MiB buffer is Envoy's own 413, shaped like the EPP's."""
    stack = await make_stack(servers=1, fail_open=True)
    async with aiohttp.ClientSession() as session:
        status, ctype, body = await post(session, stack, {"model": MODEL, "max_tokens": 1, "prompt": "a" * (65 << 20)})
    assert ctype.startswith("application/json"), (status, ctype, body[:200])
    error = assert_openai_error(status, body, 413)
    assert "Payload Too Large" in error["message"], error
