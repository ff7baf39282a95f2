"""The parameter server's side of the variable service.

`create_server`/`VariableServer` (`variable_server`) run the gRPC server; the
`servicer` answers its calls, bounded by the `stream_guard`; the `store` holds
each variable as a `variable_entry` and applies updates with the Keras
optimizer (`optimizer_host`, rows of tables through `row_updates`), once per
update id (`update_ids`); tables created on the server are initialized there
(`server_init`). Checkpoints (`checkpoint`), their periodic saving (`autosave`
settings, the `autosaver` thread) and restoring onto another number of servers
(`reshard`, reading through `reshard_source`).

`kdist.ps.VariableServer` and `kdist.ps.create_server` are the public names.
"""
