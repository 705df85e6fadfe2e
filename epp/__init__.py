"""The Endpoint Picker: an Envoy ext_proc server that routes each OpenAI request by the model servers' state."""
