"""Request control: the request's lifecycle in the EPP, independent of how the proxy talks to us.

`director.Director` takes a request (its headers, its parsed body) through objective lookup -> model rewrite ->
admission -> scheduling -> in-flight accounting, answers with a `types.RoutingDecision` (plain data: the endpoints,
the body to send), and follows the response (headers, streamed chunks, completion). The ext_proc handler
(`epp.handlers.extproc`) only translates between Envoy's messages and these calls.
"""
