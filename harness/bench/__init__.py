"""`epp-bench`: routing quality and overhead, measured on a local pool of sim model servers."""
