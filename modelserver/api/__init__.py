"""The OpenAI-compatible HTTP API (aiohttp) over an `AsyncEngine`."""
