"""The transport under kdist's two gRPC services (`kdist.ps`, `kdist.coordinator`).

What any kdist service needs and no one service owns: the cluster secret and
TLS (`security`, `secret`), the mutual proof of the secret on every call
(`auth` on the server, `auth_client` on the client), a channel that refuses
calls once closed (`guarded_channel`), one watchdog that cancels calls past
their deadline (`watchdog`), the dtype names tensors travel under (`dtypes`),
and the command that regenerates every service's stubs
(`python -m kdist.rpc.regenerate`).

It imports neither `kdist.ps` nor `kdist.coordinator` (tests/test_layout.py):
the services sit on it.
"""
