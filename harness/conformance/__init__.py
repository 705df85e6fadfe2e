"""Conformance suites: the Model Server Protocol (`msp-conformance`, black-box against any OpenAI-compatible
server) and the gateway's data path (`gateway-conformance`: a gateway's Envoy bootstrap against our EPP)."""
