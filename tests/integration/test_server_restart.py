"""A model server SIGKILLed under 60 streaming clients and restarted 7 s later: besides the streams cut in flight, no
request fails while the other server is up (the requests sent to the dead one before the EPP noticed are retried on
their fallback: Envoy's composite cluster must allow that many parallel retries, harness/templates/envoy.yaml.tmpl)."""

import asyncio
import signal
import time

import aiohttp

MODEL = "sim-llama-8b"


async def stream(session: aiohttp.ClientSession, url: str, outcomes: dict[str, int]) -> None:
    body = {"model": MODEL, "prompt": "stream me a while", "max_tokens": 40, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            key = f"status {r.status}: {(await r.read())[:160]!r}"
            outcomes[key] = outcomes.get(key, 0) + 1
            return
        try:
            raw = await r.read()
        except aiohttp.ClientPayloadError:
            raw = b""
        key = "ok" if raw.rstrip().endswith(b"[DONE]") else "cut in flight"
        outcomes[key] = outcomes.get(key, 0) + 1


async def test_new_requests_never_fail_while_a_server_is_killed_and_restarted(make_stack):
    stack = await make_stack(servers=2, separate_model_server_processes=True)
    outcomes: dict[str, int] = {}
    until = time.monotonic() + 10

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            await stream(session, stack.gateway_url, outcomes)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(60)]
        await asyncio.sleep(1.5)
        stack.processes["modelserver-1"].send_signal(signal.SIGKILL)
        stack.processes["modelserver-1"].wait(10)
        await asyncio.sleep(7)
        stack.restart("modelserver-1")
        await asyncio.gather(*clients)
        async with session.get(f"http://{stack.config.host}:{stack.config.admin_port}/stats") as r:
            overflow = [line for line in (await r.text()).splitlines() if "retry_overflow" in line]
    failed = {k: v for k, v in outcomes.items() if k.startswith("status")}
    assert outcomes.get("ok", 0) > 100 and not failed, (outcomes, overflow)
