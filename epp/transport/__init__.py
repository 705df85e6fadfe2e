"""The ext_proc transports: gRPC servers that drive the handlers of `epp.handlers` through its interface. `h2` is
the EPP's own HTTP/2 server on the event loop (the default); `grpcio` is grpcio aio's (TLS, reflection)."""
