"""Static pool discovery: a YAML file of endpoints (and objectives, models, rewrites), reloaded when it changes.

endpoints:
- address: 127.0.0.1
  port: 8000            # or `ports: [8000, 8001]`: one endpoint per data-parallel rank, named <name>-rank-<i>
  name: ms-0            # optional, default "address:port" (with ports: "address")
  engine: vllm          # optional: vllm | sglang | trtllm-serve | triton-tensorrt-llm
  labels: {zone: a}     # optional
objectives:             # optional: x-gateway-inference-objective name -> priority (negative = sheddable)
- {name: batch, priority: -1}
models: [llama, sql-lora]   # optional: the pool answers 404 for any other model
rewrites:               # optional: requests for `model` are sent as weighted targets
- model: llama
  targets: [{model: llama-v2, weight: 90}, {model: llama-v3, weight: 10}]
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from epp.datalayer.endpoint import EndpointSpec, ModelRewrite, PoolState
from protocol.metrics import engine_spec

log = logging.getLogger("epp.pool")


class PoolFileError(ValueError):
    pass


# The fields each part of the file may have: any other is a mistake (`endpoint:` for `endpoints:`), refused as the
# scheduler config refuses one, not read as an empty pool.
FIELDS = {
    "the pool file": ("endpoints", "objectives", "models", "rewrites"),
    "endpoints": ("address", "port", "ports", "name", "engine", "labels"),
    "objectives": ("name", "priority"),
    "rewrites": ("model", "targets"),
    "targets": ("model", "weight"),
}


def check_fields(item: dict, where: str, kind: str) -> None:
    """PoolFileError naming the first field of `item` that FIELDS[kind] does not list, and the closest that it does."""
    known = FIELDS[kind]
    for key in item:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"the fields are {', '.join(known)}"
            raise PoolFileError(f"{where}: unknown field `{key}` ({hint})")


def parse_pool(data: Any) -> PoolState:
    if not isinstance(data, dict):
        raise PoolFileError("the pool file must be a mapping with an `endpoints` list")
    check_fields(data, "the pool file", "the pool file")
    for section in ("endpoints", "objectives", "rewrites"):
        if not isinstance(data.get(section) or [], list):
            raise PoolFileError(f"`{section}` must be a list")
    endpoints, names = [], set()
    for i, item in enumerate(data.get("endpoints") or []):
        if isinstance(item, dict):
            check_fields(item, f"endpoints[{i}]", "endpoints")
        if not isinstance(item, dict) or not isinstance(item.get("address"), str):
            raise PoolFileError(f"endpoints[{i}] needs an `address` string")
        if ("port" in item) == ("ports" in item):
            raise PoolFileError(f"endpoints[{i}] needs either `port` or `ports` (one per data-parallel rank)")
        ports = [item["port"]] if "port" in item else item["ports"]
        if not isinstance(ports, list) or not ports or len(set(map(repr, ports))) < len(ports):
            raise PoolFileError(f"endpoints[{i}].ports must be a non-empty list of distinct ports")
        for port in ports:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise PoolFileError(f"endpoints[{i}]: a port must be an integer in 1..65535, not {port!r}")
        engine = item.get("engine", "vllm")
        try:
            engine_spec(engine)
        except ValueError as exc:
            raise PoolFileError(f"endpoints[{i}]: {exc}") from None
        labels = item.get("labels") or {}
        if not isinstance(labels, dict):
            raise PoolFileError(f"endpoints[{i}].labels must be a mapping")
        labels = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        if "port" in item:
            ranks = [(str(item.get("name") or f"{item['address']}:{item['port']}"), item["port"])]
        else:
            pod = str(item.get("name") or item["address"])
            ranks = [(f"{pod}-rank-{rank}", port) for rank, port in enumerate(ports)]
        for name, port in ranks:
            if name in names:
                raise PoolFileError(f"duplicate endpoint name {name!r}")
            names.add(name)
            endpoints.append(EndpointSpec(name, ip_address(item["address"], f"endpoints[{i}]"), port, engine, labels))
    objectives = {}
    for i, item in enumerate(data.get("objectives") or []):
        if isinstance(item, dict):
            check_fields(item, f"objectives[{i}]", "objectives")
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise PoolFileError(f"objectives[{i}] needs a `name`")
        priority = item.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise PoolFileError(f"objectives[{i}].priority must be an integer")
        objectives[item["name"]] = priority
    models = data.get("models")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise PoolFileError("`models` must be a list of names")
    rewrites = []
    for i, item in enumerate(data.get("rewrites") or []):
        if isinstance(item, dict):
            check_fields(item, f"rewrites[{i}]", "rewrites")
            for j, target in enumerate(item.get("targets") or []):
                if isinstance(target, dict):
                    check_fields(target, f"rewrites[{i}].targets[{j}]", "targets")
        try:
            targets = tuple((str(t["model"]), int(t.get("weight", 1))) for t in item["targets"])
            rewrites.append(ModelRewrite(str(item["model"]), targets))
        except (KeyError, TypeError, ValueError):
            raise PoolFileError(f"rewrites[{i}] needs `model` and `targets: [{{model, weight}}]`") from None
    return PoolState(tuple(endpoints), objectives, frozenset(models) if models is not None else None, tuple(rewrites))


def ip_address(address: str, where: str) -> str:
    """The address as an IP: the proxy connects to the "ip:port" the EPP picks (Envoy's ORIGINAL_DST cluster takes no
    host name), so a host name is resolved when the file is read, again at each reload."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
        return address
    except OSError:
        pass
    try:
        found = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PoolFileError(f"{where}.address {address!r} does not resolve: {exc.strerror or exc}") from None
    found.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as `localhost` usually means
    return found[0][4][0]


def load_pool_file(path: str | Path) -> PoolState:
    try:
        return parse_pool(yaml.safe_load(Path(path).read_text()))
    except OSError as exc:
        raise PoolFileError(f"cannot read the pool file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise PoolFileError(f"{path}: not valid YAML: {exc}") from None
    except PoolFileError as exc:
        raise PoolFileError(f"{path}: {exc}") from None


class PoolFileSource:
    """A pool source (`epp.datalayer.source`): publishes the file's PoolState at start and whenever the file
    changes; a broken edit keeps the old pool."""

    name = "pool-file"

    def __init__(self, path: str | Path, poll_interval: float = 1.0):
        self.path = Path(path)
        self.poll_interval = poll_interval

    def initial(self) -> PoolState:
        return load_pool_file(self.path)

    async def run(self, on_update: Callable[[PoolState], None]) -> None:
        last = self._stamp()  # reloads read (and resolve host names) in a thread: the event loop keeps routing
        while True:
            await asyncio.sleep(self.poll_interval)
            stamp = self._stamp()
            if stamp == last:
                continue
            last = stamp
            try:
                on_update(await asyncio.to_thread(load_pool_file, self.path))
                log.info("pool file %s reloaded", self.path)
            except (OSError, PoolFileError) as exc:
                log.error("pool file %s not reloaded, keeping the current pool: %s", self.path, exc)

    def _stamp(self) -> tuple[float, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime, stat.st_size
