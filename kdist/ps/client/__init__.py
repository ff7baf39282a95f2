"""The worker's side of the variable service: `VariableClient` (`variable_client`),
the requests it builds (`payload`), and how its calls are retried and bounded (`retry`).

`kdist.ps.VariableClient` is the public name; this package imports gRPC.
"""
