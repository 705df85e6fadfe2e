"""The gateway data-path conformance suite (`gateway-conformance`): a gateway's Envoy bootstrap against our EPP in
test mode. It runs our EPP and renders our bootstrap template, so it lives with the EPP's tooling; the contract's
own suites (the Model Server Protocol) are in `protocol.conformance` and import nothing of ours."""
