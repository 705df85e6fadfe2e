"""A local Kubernetes API server (list/watch, leases) and a real `kubernetes` client pointed at it."""

import pytest
from aiohttp import web
from kubernetes import client as k8s

from tests.conftest import free_ports
from tests.kubernetes.fake_apiserver import FakeAPIServer


@pytest.fixture
async def apiserver():
    server = FakeAPIServer()
    runner = web.AppRunner(server.app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    config = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    api = k8s.ApiClient(config)
    try:
        yield server, api
    finally:
        await server.drop_watches()
        await runner.cleanup()
        api.close()
