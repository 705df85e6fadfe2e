"""The Endpoint Picker: an Envoy ext_proc server that routes each OpenAI request by the model servers' state."""

from epp import compiled

compiled.install(__name__)  # before any other module of ours is imported: none may run stale compiled code
