"""The workshop: the tools around the product, never part of it. `epp-local` (the whole stack on loopback) and its
demo, `epp-bench` and its workloads and floors, the conformance suites (`msp-conformance` for model servers,
`gateway-conformance` for a gateway's data path) and the local Envoy bootstrap. It may import everything; nothing in
`protocol`, `modelserver` or `epp` imports it, and no image or runtime wheel contains it (pyproject.toml's
import-linter contracts, tests/test_packaging.py)."""
