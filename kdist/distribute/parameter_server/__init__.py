"""`ParameterServerStrategy` and its client side: the router, placement, row ownership, partitioners, views.

`strategy` (the strategy and its extended), `router` (`VariableRouter`: one
`kdist.ps.VariableClient` per server, and what goes to which), `route` (one
placed variable), `rows` (which rows each shard owns), `placement`,
`partitioners` (public as `kdist.partitioners`), `sharded_variable` and
`variable_reader` (the `ShardedVariable`/`RemoteVariable` views). See
docs/architecture.md.
"""
