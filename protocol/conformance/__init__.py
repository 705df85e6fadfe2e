"""Conformance suites: the Model Server Protocol, checked black-box against any OpenAI-compatible server."""
